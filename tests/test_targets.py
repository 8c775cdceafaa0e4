"""Model-level conformance of every kernel target: the generated kernels against the numpy reference executor on
synthetic models of every architecture, and against llama.cpp's fixtures on the two real models."""

from __future__ import annotations

import json

import numpy as np
import pytest

from polystrata.engine import Engine
from polystrata.errors import PolystrataError
from polystrata.parity import Parity
from polystrata.synth import synth_model
from polystrata.targets import KERNEL_TARGETS, make_runtime


def _available() -> list[str]:
    out = []
    for t in KERNEL_TARGETS:
        try:
            make_runtime(t)
        except (ImportError, PolystrataError):
            continue
        out.append(t)
    return out


TARGETS = _available()
ARCHES = ["llama", "qwen2", "qwen3", "qwen3moe", "qwen2moe", "gemma3"]


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    d = tmp_path_factory.mktemp("targets")
    cache = {}

    def get(arch: str, qtype: str):
        if (arch, qtype) not in cache:
            cache[arch, qtype] = synth_model(arch, d / f"{arch}-{qtype}.gguf", preset="tiny", qtype=qtype, seed=7)
        return cache[arch, qtype]

    return get


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [int(i) for i in np.random.default_rng(seed).integers(3, 1000, size=n)]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("arch", ARCHES)
def test_target_matches_reference_on_every_arch(tiny_models, target, arch):
    """Prefill (all logits), then decode steps continuing the cache: both equal the reference executor's."""
    path = tiny_models(arch, "Q8_0")
    ids = _prompt(20)
    ref = Engine(path, target="reference", n_ctx=64)
    got = Engine(path, target=target, n_ctx=64)
    want = ref.score(ids)
    have = got.score(ids)
    scale = np.abs(want).max()
    np.testing.assert_allclose(have, want, rtol=1e-3, atol=2e-3 * scale)
    for t in _prompt(4, seed=1):
        np.testing.assert_allclose(got.forward([t])[-1], ref.forward([t])[-1], rtol=1e-3, atol=2e-3 * scale)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kv_type", ["q8_0", "q8_g64"])
def test_quantized_kv_cache_stays_close(tiny_models, target, kv_type):
    """A quantized KV cache changes logits only by its rounding: top-1 stays, KL stays tiny."""
    path = tiny_models("llama", "F16")
    ids = _prompt(24, seed=2)
    want = Engine(path, target="reference", n_ctx=64).score(ids)
    have = Engine(path, target=target, n_ctx=64, kv_type=kv_type).score(ids)
    top = np.argsort(-want, axis=1)[:, :40]
    par = Parity()
    par.add(top, np.take_along_axis(want, top, 1), have)
    assert par.kl < 1e-3 and par.top1 >= 0.95, str(par)


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_target_parity_with_llama_cpp(target, model, request, fixtures_dir):
    path = request.getfixturevalue(f"{model}_path")
    eng = Engine(path, target=target)
    prompts = json.loads((fixtures_dir / "prompts.json").read_text())
    par = Parity()
    for name in prompts:
        ref = np.load(fixtures_dir / model / f"{name}.npz")
        par.add(ref["top_ids"], ref["top_logits"], eng.score([int(i) for i in ref["ids"]]))
    assert par.ok(), f"{target}: {par}"

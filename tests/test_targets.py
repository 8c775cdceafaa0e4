"""Model-level conformance of every kernel target: the generated kernels against the numpy reference executor on
synthetic models of every architecture, and against llama.cpp's fixtures on the two real models."""

from __future__ import annotations

import json

import numpy as np
import pytest
from oclgrind import oclgrind_problems
from suite_plugin import targets_under_test

from polystrata.engine import Engine
from polystrata.errors import PolystrataError
from polystrata.parity import Parity
from polystrata.synth import synth_model

TARGETS = targets_under_test()
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


def _close(have: np.ndarray, want: np.ndarray) -> None:
    """Kernel targets quantize activations to int8 per 32 values in their matmuls (as llama.cpp does): logits
    move by about 1 % of their norm, and the distribution over the top tokens barely at all."""
    rel = np.linalg.norm(have - want) / np.linalg.norm(want)
    assert rel < 0.03, rel
    top = np.argsort(-want, axis=-1)[:, :40]
    par = Parity()
    par.add(top, np.take_along_axis(want, top, 1), have)
    assert par.kl < 0.01, str(par)
    # Random weights give flat distributions with near-ties; where the reference has a clear winner, so must we.
    top2 = np.take_along_axis(want, top[:, :2], 1)
    clear = top2[:, 0] - top2[:, 1] > 0.1
    assert (have.argmax(1) == top[:, 0])[clear].mean() >= 0.95 if clear.any() else True


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("arch", ARCHES)
def test_target_matches_reference_on_every_arch(tiny_models, target, arch):
    """Prefill (all logits), then decode steps continuing the cache: both agree with the reference executor."""
    path = tiny_models(arch, "Q8_0")
    ids = _prompt(20)
    ref = Engine(path, target="reference", n_ctx=64, all_logits=True)
    got = Engine(path, target=target, n_ctx=64, all_logits=True)
    _close(got.score(ids), ref.score(ids))
    steps = _prompt(4, seed=1)
    _close(np.stack([got.forward([t])[-1] for t in steps]), np.stack([ref.forward([t])[-1] for t in steps]))


@pytest.mark.slow
def test_cpu_int8_tiles_in_long_steps(tiny_models):
    """On the cpu, steps of more than TILES_ABOVE tokens take the int8 tile matmuls (knob tile_q8 on, as on VNNI
    hosts; the portable form elsewhere), shorter ones the f32 tiles, in one plan: a prompt of 81 tokens scored in
    one step agrees with the reference, and a decode step after it too (81: an odd last tile)."""
    from polystrata.codegen.recipes.attention_tiles import TILES_ABOVE

    path = tiny_models("gemma3", "Q8_0")
    got = Engine(path, target="cpu", n_ctx=128, knobs={"matmul": {"tile_q8": 64}}, all_logits=True)
    names = {la.kernel.name for la in got.executor.plans[id(got.graph_all)].launches}
    assert any(n.endswith(f"_tq8_gt{TILES_ABOVE}") for n in names), names
    assert any(n.endswith(f"_tile_le{TILES_ABOVE}") for n in names), names
    ref = Engine(path, target="reference", n_ctx=128, all_logits=True)
    ids = _prompt(81, seed=3)
    _close(got.score(ids), ref.score(ids))
    _close(got.forward([5])[-1:], ref.forward([5])[-1:])


@pytest.mark.parametrize("target", [t for t in TARGETS if t != "cpu"])
def test_long_context_decode_splits_and_groups_heads(tiny_models, target):
    """Past LONG_CONTEXT, one-token plans on GPU-shaped targets split each KV head's keys into many runs and give a
    group all its query heads (gemma3: GQA 4 to 1, sliding windows of 8 and global layers); decode steps after a
    prompt of two prefill chunks agree with the reference."""
    from polystrata.codegen.recipes.attention import DECODE_RUN_KEYS, LONG_CONTEXT, key_span

    path = tiny_models("gemma3", "Q8_0")
    n_ctx = LONG_CONTEXT + 64
    got = Engine(path, target=target, n_ctx=n_ctx)
    attn = [dict(la.kernel.knobs) for la in got.executor.plans[id(got.graph_step)].launches
            if la.kernel.name.startswith("attn_") and not la.kernel.name.startswith("attn_combine")]
    assert attn and all(k["heads"] == 4 and k["splits"] == key_span(n_ctx) // DECODE_RUN_KEYS for k in attn), attn
    ref = Engine(path, target="reference", n_ctx=n_ctx)
    ids = _prompt(300)
    _close(got.forward(ids), ref.forward(ids))
    steps = _prompt(3, seed=1)
    _close(np.stack([got.forward([t])[-1] for t in steps]), np.stack([ref.forward([t])[-1] for t in steps]))


@pytest.fixture(scope="module")
def head64_model(tmp_path_factory):
    """Two layers at SmolLM2's shape and weight format: heads of 64 values, as q8_g64 needs; planned at the default
    context, most of their kernels are the real SmolLM2's, which its parity tests compile anyway."""
    path = tmp_path_factory.mktemp("h64") / "m.gguf"
    return synth_model("llama", path, preset="smollm2-135m", qtype="Q4_1", seed=3, n_layer=2)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kv_type", ["q8_0", "q8_g64"])
def test_quantized_kv_cache_stays_close(head64_model, target, kv_type):
    """A quantized KV cache changes logits only by its rounding: top-1 stays, KL stays tiny."""
    path = head64_model
    ids = _prompt(24, seed=2)
    f16 = Engine(path, target=target, kv_type="f16", all_logits=True).score(ids)
    have = Engine(path, target=target, kv_type=kv_type, all_logits=True).score(ids)
    _close(have, f16)


def test_kv_type_must_fit_the_heads(tiny_models):
    with pytest.raises(PolystrataError, match="q8_g64 stores blocks of 64 values"):
        Engine(tiny_models("llama", "Q8_0"), target="cpu", n_ctx=64, kv_type="q8_g64")


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_target_parity_with_llama_cpp(target, model, request, fixtures_dir):
    path = request.getfixturevalue(f"{model}_path")
    eng = Engine(path, target=target, all_logits=True)
    prompts = json.loads((fixtures_dir / "prompts.json").read_text())
    par = Parity()
    for name in prompts:
        ref = np.load(fixtures_dir / model / f"{name}.npz")
        par.add(ref["top_ids"], ref["top_logits"], eng.score([int(i) for i in ref["ids"]]))
    assert par.ok(), f"{target}: {par}"


@pytest.mark.slow
def test_gemma3_beyond_sliding_window(gemma3_path, fixtures_dir):
    """About 820 tokens of shuffled words: positions past 512 see only the window on gemma3's local layers. The
    reference executor (the kernels' oracle) against llama.cpp's logits there (`scripts/window_fixture.py`). The
    kernels' windows are checked against the reference on tiny models, whose windows are a few tokens."""
    ref = np.load(fixtures_dir / "gemma3" / "window.npz")
    ids, first = [int(i) for i in ref["ids"]], int(ref["first"])
    assert first == 512 and len(ids) - first == len(ref["top_ids"]) > 256
    ours = Engine(gemma3_path, target="reference", all_logits=True).score(ids)
    past_window = Parity()
    past_window.add(ref["top_ids"], ref["top_logits"], ours[first:])
    assert past_window.ok(), str(past_window)


_OCLGRIND_MODEL = """
import numpy as np
from polystrata.engine import Engine
for path in {paths!r}:
    eng = Engine(path, target="opencl", n_ctx=16, all_logits=True)
    eng.score([5, 17, 99])
    eng.forward([11])
print("OK")
"""


@pytest.mark.slow
@pytest.mark.skipif("opencl" not in TARGETS, reason="no OpenCL device")
def test_opencl_model_kernels_pass_oclgrind(tiny_models, tmp_path):
    """Every kernel of small dense and MoE models, prefill and decode, on oclgrind's checked device: no access
    outside a buffer, no data race."""
    paths = [str(tiny_models(a, "Q4_K")) for a in ("llama", "qwen3moe")]
    problems = oclgrind_problems(_OCLGRIND_MODEL.format(paths=paths), tmp_path, timeout=2400, uninitialized=False)
    assert not problems, "\n\n".join(problems[:5])


@pytest.mark.slow
@pytest.mark.skipif("opencl" not in TARGETS, reason="no OpenCL device")
def test_opencl_model_reads_only_initialized_memory(tiny_models, tmp_path):
    """The same small model under oclgrind's uninitialized-value tracking: no kernel reads local or private memory
    before writing it (buffers are zeroed when allocated). What it reported before was oclgrind's own, see
    `oclgrind._UNINITIALIZED_PRELUDE`."""
    problems = oclgrind_problems(_OCLGRIND_MODEL.format(paths=[str(tiny_models("llama", "Q4_K"))]), tmp_path)
    assert not problems, "\n\n".join(problems[:5])

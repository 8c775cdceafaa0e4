"""Against llama.cpp, live: models it quantized itself in every format (read, dequantized bit-exactly, run
correctly). (A prompt past gemma3's sliding window is checked against a recorded fixture: tests/test_targets.py.)

llama.cpp decides the per-tensor types (with its fallbacks for rows that are not a multiple of 256), so these
files hold layouts our own writer never produces.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from plain_numpy import plain_moe_forward

from polystrata.engine import Engine
from polystrata.gguf import GGUFFile
from polystrata.parity import Parity
from polystrata.synth import synth_model

llama_cpp = pytest.importorskip("llama_cpp")
gguf_quants = pytest.importorskip("gguf.quants")

pytestmark = pytest.mark.llama_cpp

FTYPES = ["F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K",
          "IQ4_NL", "IQ4_XS"]
IDS = [int(i) for i in np.random.default_rng(0).integers(0, 1000, 24)]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return synth_model("qwen3moe", tmp_path_factory.mktemp("q") / "f32.gguf", preset="tiny", qtype="F32", seed=5)


def quantize_with_llama_cpp(src, ftype: str, out) -> None:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params))
    assert rc == 0, f"llama.cpp could not quantize to {ftype}"


@pytest.mark.parametrize("ftype", FTYPES)
def test_llama_cpp_quantized_qwen3moe(source, ftype, tmp_path):
    out = tmp_path / f"{ftype}.gguf"
    quantize_with_llama_cpp(source, ftype, out)
    with GGUFFile(out) as f:
        for t in f.tensors.values():
            want = gguf_quants.dequantize(np.asarray(f.raw(t.name)), t.ggml_type).reshape(t.shape)
            got = f.dequantize(t.name)
            assert np.array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32)), t.name
        want = plain_moe_forward(f, IDS)
    got = Engine(out, target="reference", all_logits=True).score(IDS)
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3 * np.abs(want).max())


@pytest.mark.parametrize("ftype", ["F16", "BF16"])
def test_unquantized_activations_agree_with_llama_cpp(source, ftype, tmp_path):
    """Where llama.cpp keeps activations in float (F16/BF16 weights), its logits equal ours."""
    out = tmp_path / f"{ftype}.gguf"
    quantize_with_llama_cpp(source, ftype, out)
    ours = Engine(out, target="reference", all_logits=True).score(IDS)
    llm = llama_cpp.Llama(model_path=str(out), n_ctx=64, verbose=False, logits_all=True, type_k=0, type_v=0)
    llm.eval(IDS)
    theirs = np.asarray(llm.scores[: len(IDS)], dtype=np.float32)
    top = np.argsort(-theirs, axis=1)[:, :40]
    par = Parity()
    par.add(top, np.take_along_axis(theirs, top, 1), ours)
    assert par.kl < 1e-3 and par.top1 >= 0.95, str(par)

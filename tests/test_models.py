"""Model builders and the reference executor: graph structure, real-model parity with llama.cpp, and MoE models
against a plain numpy forward pass written here, independently of the engine."""

from __future__ import annotations

import json

import numpy as np
import pytest
from plain_numpy import plain_moe_forward

from polystrata.engine import Engine, tensor_table
from polystrata.errors import GGUFError, UnsupportedError
from polystrata.gguf import GGUFFile
from polystrata.ir.graph import Graph, GraphError
from polystrata.models import build_graph
from polystrata.parity import Parity
from polystrata.runtimes.reference import check_complete
from polystrata.synth import synth_model

# --- graph IR ------------------------------------------------------------------------------------------------


def test_reference_executor_implements_every_op():
    check_complete()


def test_verifier_rejects_type_mismatch():
    g = Graph(arch="test")
    x = g.input("x", "f32", ("T", 8))
    w = g.weight("w", "F32", (4, 6))
    with pytest.raises(GraphError, match="matmul"):
        g.op("matmul", x, w)
    w2 = g.weight("w2", "F32", (4, 8))
    y = g.op("matmul", x, w2)
    y.type = y.type.__class__("f32", ("T", 5))  # corrupt the node's recorded type
    g.outputs.append(y)
    with pytest.raises(GraphError, match="type"):
        g.verify()


def test_dump_names_every_node(tmp_path):
    path = synth_model("qwen3", tmp_path / "q3.gguf", preset="tiny", qtype="Q8_0", seed=1)
    with GGUFFile(path) as f:
        g = build_graph(f.metadata, tensor_table(f))
    text = g.dump()
    assert text.count("\n") == len(g.nodes) + len(g.inputs) + len(g.weights) + len(g.meta) + 2
    assert "rope(" in text and "attention(" in text and "q_norm" in text


def test_unsupported_architecture_names_supported(tmp_path):
    path = synth_model("llama", tmp_path / "l.gguf", preset="tiny", qtype="F32", seed=0)
    with GGUFFile(path) as f:
        md = dict(f.metadata)
        md["general.architecture"] = "mamba"
        with pytest.raises(UnsupportedError, match="supported: llama, qwen2, qwen3, qwen2moe, qwen3moe, gemma3"):
            build_graph(md, tensor_table(f))


def test_missing_tensor_is_a_clear_error(tmp_path):
    path = synth_model("llama", tmp_path / "l.gguf", preset="tiny", qtype="F32", seed=0)
    with GGUFFile(path) as f:
        tensors = tensor_table(f)
        del tensors["blk.1.ffn_up.weight"]
        with pytest.raises(GGUFError, match="blk.1.ffn_up.weight"):
            build_graph(f.metadata, tensors)


# --- real models against llama.cpp ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_reference_parity_with_llama_cpp(model, request, fixtures_dir):
    path = request.getfixturevalue(f"{model}_path")
    eng = Engine(path, target="reference", all_logits=True)
    parity = Parity()
    for name in json.loads((fixtures_dir / "prompts.json").read_text()):
        ref = np.load(fixtures_dir / model / f"{name}.npz")
        ids = [int(i) for i in ref["ids"]]
        assert ids == eng.tokenizer.encode(json.loads((fixtures_dir / "prompts.json").read_text())[name])
        logits = eng.score(ids)
        assert logits.shape == (len(ids), eng.hparams.n_vocab)
        parity.add(ref["top_ids"], ref["top_logits"], logits)
    assert parity.ok(), str(parity)


@pytest.mark.slow
def test_chunked_prefill_and_decode_match_one_pass(smollm2_path):
    """Prompt in chunks, then token by token, gives the logits of a single pass over everything."""
    eng = Engine(smollm2_path, target="reference", all_logits=True)
    ids = eng.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4)
    full = eng.score(ids)
    eng.n_ubatch = 7  # steps of 7 tokens (-ub 7): on the reference, the step size only cuts the prompt
    eng.reset()
    part = eng.forward(ids[:-3], all_logits=True)
    steps = [eng.forward([t])[-1] for t in ids[-3:]]
    got = np.concatenate([part, np.stack(steps)])
    np.testing.assert_allclose(got, full, rtol=1e-3, atol=1e-3)


# --- MoE against a plain numpy forward -----------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe"])
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_moe_matches_plain_numpy(arch, qtype, tmp_path):
    path = synth_model(arch, tmp_path / f"{arch}.gguf", preset="tiny", qtype=qtype, seed=3)
    ids = [int(i) for i in np.random.default_rng(0).integers(0, 200, size=12)]
    with GGUFFile(path) as f:
        want = plain_moe_forward(f, ids)
        if arch == "qwen2moe":
            assert "blk.0.ffn_gate_inp_shexp.weight" in f.tensors
    eng = Engine(path, target="reference", all_logits=True)
    got = eng.score(ids)
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3 * np.abs(want).max())
    # Decoding the last token after the others reproduces the last row.
    eng.reset()
    eng.forward(ids[:-1])
    np.testing.assert_allclose(eng.forward(ids[-1:])[-1], want[-1], rtol=2e-3, atol=2e-3 * np.abs(want).max())

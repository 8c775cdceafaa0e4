"""Model builders and the reference executor: graph structure, real-model parity with llama.cpp, and MoE models
against a plain numpy forward pass written here, independently of the engine."""

from __future__ import annotations

import json

import numpy as np
import pytest
from polystrata.ir.graph import Graph, GraphError
from polystrata.runtimes.reference import check_complete
from polystrata.synth import synth_model

from polystrata.engine import Engine, tensor_table
from polystrata.errors import GGUFError, UnsupportedError
from polystrata.gguf import GGUFFile
from polystrata.models import build_graph
from polystrata.parity import Parity

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
    eng = Engine(path)
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
    import polystrata.engine as engine_mod

    eng = Engine(smollm2_path)
    ids = eng.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4)
    full = eng.score(ids)
    old = engine_mod.PREFILL_CHUNK
    engine_mod.PREFILL_CHUNK = 7
    try:
        eng.reset()
        part = eng.forward(ids[:-3], all_logits=True)
        steps = [eng.forward([t])[-1] for t in ids[-3:]]
    finally:
        engine_mod.PREFILL_CHUNK = old
    got = np.concatenate([part, np.stack(steps)])
    np.testing.assert_allclose(got, full, rtol=1e-3, atol=1e-3)


# --- MoE against a plain numpy forward -----------------------------------------------------------------------


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope_neox(x, base):
    """x [T, H, D]: rotate (x_i, x_{i+D/2}) by pos * base^(-2i/D)."""
    t, _, d = x.shape
    half = d // 2
    ang = np.arange(t)[:, None] * base ** (-np.arange(half) * 2.0 / d)[None, :]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)


def _silu(x):
    return x / (1 + np.exp(-x))


def plain_moe_forward(f: GGUFFile, ids: list[int]) -> np.ndarray:
    """A qwen3moe/qwen2moe forward pass in float64, token by token and expert by expert."""
    md = f.metadata
    arch = md["general.architecture"]

    def hp(key, default=None):
        return md.get(f"{arch}.{key}", default)

    def W(name):
        return f.dequantize(name).astype(np.float64)

    eps = hp("attention.layer_norm_rms_epsilon")
    n_head, n_kv = hp("attention.head_count"), hp("attention.head_count_kv")
    k_used = hp("expert_used_count")
    norm_topk = arch == "qwen3moe"
    x = W("token_embd.weight")[ids]
    t = len(ids)
    for il in range(hp("block_count")):
        p = f"blk.{il}."
        h = _rms(x, W(p + "attn_norm.weight"), eps)
        q, k, v = (h @ W(p + f"attn_{n}.weight").T for n in "qkv")
        if arch == "qwen2moe":
            q, k, v = q + W(p + "attn_q.bias"), k + W(p + "attn_k.bias"), v + W(p + "attn_v.bias")
        d = q.shape[1] // n_head
        q, k, v = q.reshape(t, n_head, d), k.reshape(t, n_kv, d), v.reshape(t, n_kv, d)
        if arch == "qwen3moe":
            q, k = _rms(q, W(p + "attn_q_norm.weight"), eps), _rms(k, W(p + "attn_k_norm.weight"), eps)
        q, k = _rope_neox(q, hp("rope.freq_base")), _rope_neox(k, hp("rope.freq_base"))
        att = np.zeros_like(q)
        for head in range(n_head):
            kv = head // (n_head // n_kv)
            s = q[:, head] @ k[:, kv].T / np.sqrt(d)
            s[np.triu_indices(t, 1)] = -np.inf
            pr = np.exp(s - s.max(1, keepdims=True))
            att[:, head] = (pr / pr.sum(1, keepdims=True)) @ v[:, kv]
        x = x + att.reshape(t, -1) @ W(p + "attn_output.weight").T
        h = _rms(x, W(p + "ffn_norm.weight"), eps)
        gate_e, up_e, down_e = W(p + "ffn_gate_exps.weight"), W(p + "ffn_up_exps.weight"), W(p + "ffn_down_exps.weight")
        logits = h @ W(p + "ffn_gate_inp.weight").T
        y = np.zeros_like(x)
        for i in range(t):
            pr = np.exp(logits[i] - logits[i].max())
            pr /= pr.sum()
            top = np.argsort(-pr)[:k_used]
            wts = pr[top] / pr[top].sum() if norm_topk else pr[top]
            for e, wt in zip(top, wts):
                y[i] += wt * (down_e[e] @ (_silu(gate_e[e] @ h[i]) * (up_e[e] @ h[i])))
        if arch == "qwen2moe":
            shared = (_silu(h @ W(p + "ffn_gate_shexp.weight").T) * (h @ W(p + "ffn_up_shexp.weight").T)) @ W(
                p + "ffn_down_shexp.weight"
            ).T
            y += shared / (1 + np.exp(-(h @ W(p + "ffn_gate_inp_shexp.weight"))))[:, None]
        x = x + y
    out = "output.weight" if "output.weight" in f.tensors else "token_embd.weight"
    return _rms(x, W("output_norm.weight"), eps) @ W(out).T


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe"])
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_moe_matches_plain_numpy(arch, qtype, tmp_path):
    path = synth_model(arch, tmp_path / f"{arch}.gguf", preset="tiny", qtype=qtype, seed=3)
    ids = [int(i) for i in np.random.default_rng(0).integers(0, 200, size=12)]
    with GGUFFile(path) as f:
        want = plain_moe_forward(f, ids)
        if arch == "qwen2moe":
            assert "blk.0.ffn_gate_inp_shexp.weight" in f.tensors
    eng = Engine(path)
    got = eng.score(ids)
    # Routing must differ between tokens, or the test would not exercise dispatch.
    assert np.abs(want).max() > 0
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3 * np.abs(want).max())
    # Decoding the last token after the others reproduces the last row.
    eng.reset()
    eng.forward(ids[:-1])
    np.testing.assert_allclose(eng.forward(ids[-1:])[-1], want[-1], rtol=2e-3, atol=2e-3 * np.abs(want).max())

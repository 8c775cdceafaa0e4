"""Tests of polystrata.synth: every architecture x format writes a file PolyStrata reads and builds, files are
deterministic, values are sane, and (with llama-cpp-python) llama.cpp loads them and agrees with the
reference executor."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from polystrata import synth
from polystrata.errors import UnsupportedError
from polystrata.gguf import GGUFFile
from polystrata.models import build_graph
from polystrata.parity import Parity
from polystrata.synth import ARCHES, MIXES, PRESETS, QTYPES, synth_model, synth_vocab, tensor_plan

pytest.importorskip("polystrata.ir.formats", reason="polystrata.ir.formats is not available")

# Token ids used for forward passes: more than the gemma3 tiny window (8), so local layers really slide.
IDS = [1, 5, 300, 700, 20, 33, 900, 12, 45, 600, 601, 3, 77, 88, 99, 1000, 40, 41, 42, 43]


def _table(f: GGUFFile) -> dict:
    return {n: (t.shape, t.fmt.name) for n, t in f.tensors.items()}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Cache of tiny models: (arch, qtype) -> path."""
    d = tmp_path_factory.mktemp("synth")
    made: dict[tuple[str, str], Path] = {}

    def get(arch: str, qtype: str) -> Path:
        if (arch, qtype) not in made:
            made[arch, qtype] = synth_model(arch, d / f"{arch}-{qtype}.gguf", qtype=qtype)
        return made[arch, qtype]

    return get


# -- every arch x format ---------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", QTYPES + MIXES)
@pytest.mark.parametrize("arch", ARCHES)
def test_every_arch_and_type_builds(tiny, arch, qtype):
    path = tiny(arch, qtype)
    with GGUFFile(path) as f:
        table = _table(f)
        g = build_graph(f.metadata, table)
        assert g.meta["n_layer"] == PRESETS[arch]["tiny"].n_layer
        assert set(g.weights) <= set(table)
        assert f.metadata["general.architecture"] == arch
        assert f.metadata["tokenizer.ggml.model"] == "gpt2"
        # What was written is exactly the plan, and the plan follows the format rules.
        assert [(n, s, t) for n, (s, t) in table.items()] == tensor_plan(arch, "tiny", qtype)
        for name, (shape, fmt) in table.items():
            if len(shape) == 1 or "ffn_gate_inp" in name or "ssm_conv1d" in name:  # never quantized
                assert fmt == "F32", name
            elif qtype not in MIXES:
                want = synth._K_FALLBACK.get(qtype, qtype) if shape[-1] % 256 else qtype
                assert fmt == want, name
        assert ("output.weight" in table) == (not PRESETS[arch]["tiny"].tied_embeddings)


def test_moe_tensors_and_metadata(tiny):
    with GGUFFile(tiny("qwen2moe", "Q8_0")) as f:
        p = PRESETS["qwen2moe"]["tiny"]
        e, n = p.n_expert, p.n_embd
        t = f.tensors
        assert t["blk.0.ffn_gate_inp.weight"].shape == (e, n)
        assert t["blk.0.ffn_gate_exps.weight"].shape == (e, p.n_ff_expert, n)
        assert t["blk.0.ffn_down_exps.weight"].shape == (e, n, p.n_ff_expert)
        assert t["blk.0.ffn_gate_inp_shexp.weight"].shape == (n,)
        assert t["blk.1.ffn_down_shexp.weight"].shape == (n, p.n_ff_shared)
        assert "blk.0.attn_q.bias" in t
        assert f.metadata["qwen2moe.expert_shared_feed_forward_length"] == p.n_ff_shared
        assert f.metadata["qwen2moe.expert_used_count"] == 2
    with GGUFFile(tiny("gemma3", "Q8_0")) as f:
        assert f.metadata["gemma3.attention.sliding_window"] == 8
        assert "blk.5.post_ffw_norm.weight" in f.tensors and "output.weight" not in f.tensors


def test_q4_k_m_mix_follows_llama_cpp_rule():
    plan = {n: t for n, _s, t in tensor_plan("llama", "llama3-8b", "Q4_K_M")}
    assert plan["output.weight"] == "Q6_K"
    assert plan["token_embd.weight"] == "Q4_K"  # untied: llama.cpp leaves the embeddings at the base type
    downs = [plan[f"blk.{i}.ffn_down.weight"] for i in range(32)]
    more = [i for i in range(32) if i < 4 or i >= 28 or (i - 4) % 3 == 2]
    assert [i for i, t in enumerate(downs) if t == "Q6_K"] == more
    assert [plan[f"blk.{i}.attn_v.weight"] == "Q6_K" for i in range(32)] == [i in more for i in range(32)]
    assert plan["blk.3.attn_q.weight"] == plan["blk.3.ffn_up.weight"] == "Q4_K"
    # Tied: the embeddings are the output matrix; 576-wide rows cannot be K-quants.
    tied = {n: t for n, _s, t in tensor_plan("llama", "smollm2-135m", "Q4_K_M")}
    assert tied["token_embd.weight"] == "Q8_0" and "output.weight" not in tied
    assert tied["blk.0.attn_q.weight"] == "Q5_0" and tied["blk.0.ffn_down.weight"] == "Q6_K"
    assert {t for n, t in tied.items() if "ffn_up" in n} == {"Q5_0"}


@pytest.mark.parametrize("arch,preset", [(a, p) for a in ARCHES for p in PRESETS[a]])
def test_presets_build_without_writing(arch, preset):
    p = PRESETS[arch][preset]
    plan = tensor_plan(arch, preset, "Q4_K_M")
    md = synth._metadata(p, preset, "Q4_K_M")
    g = build_graph(md, {n: (s, t) for n, s, t in plan})
    assert g.meta["n_vocab"] == p.n_vocab == len(md["tokenizer.ggml.tokens"])
    assert g.meta["n_layer"] == p.n_layer


def test_big_presets_have_their_shapes():
    p = PRESETS["llama"]["llama3-8b"]
    assert (p.n_embd, p.n_layer, p.n_head, p.n_head_kv, p.n_ff, p.rope_base, p.n_vocab, p.n_ctx_train) == (
        4096, 32, 32, 8, 14336, 500000.0, 49152, 8192,
    )  # fmt: skip
    q = PRESETS["qwen3moe"]["qwen3-30b-a3b"]
    assert (q.n_embd, q.n_layer, q.n_head, q.n_head_kv, q.head_dim, q.n_expert, q.n_expert_used) == (
        2048, 48, 32, 4, 128, 128, 8,
    )  # fmt: skip
    assert q.n_ff_expert == 768 and q.rope_base == 1e6
    n_params = sum(math.prod(s) for _n, s, _t in tensor_plan("llama", "llama3-8b"))
    assert 7.0e9 < n_params < 8.0e9


# -- determinism, options, errors ------------------------------------------------------------------------


def test_same_seed_same_bytes(tmp_path):
    a = synth_model("qwen3moe", tmp_path / "a.gguf", qtype="Q4_K_M", seed=7)
    b = synth_model("qwen3moe", tmp_path / "b.gguf", qtype="Q4_K_M", seed=7)
    c = synth_model("qwen3moe", tmp_path / "c.gguf", qtype="Q4_K_M", seed=8)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()
    assert a.stat().st_size == c.stat().st_size


def test_row_pool_path(tmp_path, monkeypatch):
    # Force the big-model path (rows picked from a quantized pool) on a tiny model.
    monkeypatch.setattr(synth, "EXACT_ELEMENTS", 1000)
    monkeypatch.setattr(synth, "POOL_ELEMENTS", 4096)
    a = synth_model("llama", tmp_path / "a.gguf", qtype="Q4_K_M", seed=3)
    b = synth_model("llama", tmp_path / "b.gguf", qtype="Q4_K_M", seed=3)
    assert a.read_bytes() == b.read_bytes()
    with GGUFFile(a) as f:
        build_graph(f.metadata, _table(f))
        w = f.dequantize("blk.0.ffn_down.weight")
        assert 0.8 < w.std() * math.sqrt(w.shape[1]) < 1.2
        assert len(np.unique(f.raw("token_embd.weight"), axis=0)) <= 64  # rows come from a 64-row pool


def test_n_layer_override(tmp_path):
    path = synth_model("gemma3", tmp_path / "m.gguf", n_layer=3)
    with GGUFFile(path) as f:
        assert f.metadata["gemma3.block_count"] == 3
        assert "blk.2.attn_q.weight" in f.tensors and "blk.3.attn_q.weight" not in f.tensors
        assert build_graph(f.metadata, _table(f)).meta["n_layer"] == 3


def test_progress_counts_tensors(tmp_path, monkeypatch, capsys):
    from polystrata import progress

    monkeypatch.setattr(progress, "enabled", True)
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    monkeypatch.setattr(progress, "LINE_EVERY_S", 0.0)
    synth_model("llama", tmp_path / "m.gguf")
    n = len(tensor_plan("llama"))
    assert capsys.readouterr().err.splitlines() == [f"writing tensors {i}/{n}" for i in range(1, n + 1)]


def test_errors(tmp_path):
    with pytest.raises(UnsupportedError, match="architecture"):
        synth_model("mamba", tmp_path / "m.gguf")
    with pytest.raises(UnsupportedError, match="preset"):
        synth_model("llama", tmp_path / "m.gguf", preset="huge")
    with pytest.raises(UnsupportedError, match="type"):
        synth_model("llama", tmp_path / "m.gguf", qtype="Q9_9")
    assert not (tmp_path / "m.gguf").exists()


# -- values ----------------------------------------------------------------------------------------------


def test_dequantized_stats(tiny):
    with GGUFFile(tiny("qwen2moe", "F32")) as f32, GGUFFile(tiny("qwen2moe", "Q4_K_M")) as q:
        for name, info in f32.tensors.items():
            w = f32.dequantize(name)
            assert np.isfinite(w).all(), name
            if "norm" in name:
                assert abs(w.mean() - 1) < 0.05 and 0.05 < w.std() < 0.15, name
            elif len(info.shape) >= 2 and "gate_inp" not in name and "token_embd" not in name:
                fan_in = info.shape[-1]
                want = 2.0 if name == "output.weight" else 1.0  # logits of std ~2
                assert 0.85 * want < w.std() * math.sqrt(fan_in) < 1.15 * want, name
                assert abs(w.mean()) < 0.1 / math.sqrt(fan_in), name
            # The same seed draws the same values whatever the format: quantization error only.
            wq = q.dequantize(name)
            rel = np.sqrt(np.mean((wq - w) ** 2)) / np.sqrt(np.mean(w**2))
            assert rel < 0.12, (name, rel)


def test_reference_forward_finite_and_routing_varies(tiny):
    from polystrata.runtimes.reference import ReferenceExecutor

    for arch in ARCHES:
        with GGUFFile(tiny(arch, "Q8_0")) as f:
            g = build_graph(f.metadata, _table(f))
            ex = ReferenceExecutor.from_file(f, g, 64)
            logits = ex.forward(g, np.array(IDS))
            assert logits.shape == (len(IDS), 1024) and np.isfinite(logits).all(), arch
            assert 0.5 < logits.std() < 10, arch
            assert len(set(logits.argmax(-1).tolist())) > 3, arch
            if "blk.0.ffn_gate_inp.weight" in f.tensors:
                # Top-k of the first router on normed embeddings: the chosen sets differ between tokens.
                x = f.dequantize("token_embd.weight")[IDS]
                pre_ffn = "blk.0.ffn_norm.weight" if "blk.0.ffn_norm.weight" in f.tensors else (
                    "blk.0.post_attention_norm.weight")  # the hybrids' name for it
                x = x / np.sqrt((x**2).mean(-1, keepdims=True)) * f.dequantize(pre_ffn)
                top = np.argsort(-(x @ f.dequantize("blk.0.ffn_gate_inp.weight").T), -1)[:, :2]
                assert len({tuple(sorted(r)) for r in top.tolist()}) >= 8, arch


def test_vocab_is_valid_bpe():
    for n_vocab in (1024, 49152):
        tokens, types, merges = synth_vocab(n_vocab)
        assert len(tokens) == len(types) == n_vocab and len(set(tokens)) == n_vocab
        assert len(merges) == n_vocab - 256 - 3
        ids = {t: i for i, t in enumerate(tokens)}
        assert tokens[ord("a")] == "a" and tokens[ord(" ")] == "Ġ" and tokens[ord("\n")] == "Ċ"
        for k, m in enumerate(merges):
            a, b = m.split(" ")
            assert ids[a] < 256 + k and ids[b] < 256 + k and ids[a + b] == 256 + k, m
        assert tokens[-3:] == ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
        assert set(types[-3:]) == {3} and set(types[:-3]) == {1}
        assert "Ġthe" in ids and "he" in ids  # frequent corpus pairs are learned first


# -- llama.cpp -------------------------------------------------------------------------------------------


def _llama(path: Path, **kw):
    llama_cpp = pytest.importorskip("llama_cpp")
    return llama_cpp.Llama(model_path=str(path), n_ctx=64, verbose=False, **kw)


@pytest.mark.llama_cpp
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K_M", "IQ4_XS", "Q4_0", "BF16"])
@pytest.mark.parametrize("arch", ARCHES)
def test_llama_cpp_loads_and_evaluates(tiny, arch, qtype):
    llm = _llama(tiny(arch, qtype), logits_all=True)
    assert llm.n_vocab() == 1024
    llm.eval(IDS[:6])
    scores = np.asarray(llm.scores[:6])
    assert np.isfinite(scores).all() and scores.std() > 0.1


@pytest.mark.llama_cpp
def test_llama_cpp_tokenizer_round_trip(tiny):
    llm = _llama(tiny("llama", "Q8_0"))
    text = b"Hello, world! The quick brown fox jumps over the lazy dog.\n  def main(): return 42"
    toks = llm.tokenize(text, add_bos=False, special=False)
    assert len(toks) < 0.7 * len(text)  # merges are used
    assert llm.detokenize(toks) == text
    assert llm.token_bos() == llm.token_eos() == 1021
    assert llm.tokenize(b"<|im_start|>", add_bos=False, special=True) == [1022]


@pytest.mark.llama_cpp
@pytest.mark.parametrize("qtype,max_kl,min_top1", [("F32", 1e-4, 1.0), ("Q8_0", 0.01, 0.85)])
@pytest.mark.parametrize("arch", ARCHES)
def test_llama_cpp_matches_reference(tiny, arch, qtype, max_kl, min_top1):
    """The architecture parity check: llama.cpp and the reference executor agree on the same file.

    F32 is near-exact (llama.cpp's F32 KV cache requested); Q8_0 differs by llama.cpp quantizing activations
    to Q8_0, which can flip an MoE expert choice now and then."""
    from polystrata.runtimes.reference import ReferenceExecutor

    path = tiny(arch, qtype)
    with GGUFFile(path) as f:
        g = build_graph(f.metadata, _table(f))
        ref = ReferenceExecutor.from_file(f, g, 64).forward(g, np.array(IDS))
    llm = _llama(path, logits_all=True, type_k=0, type_v=0)
    llm.eval(IDS)
    lc = np.asarray(llm.scores[: len(IDS)])
    top = np.argsort(-lc, axis=-1)[:, :40]
    par = Parity()
    par.add(top, np.take_along_axis(lc, top, -1), ref)
    assert par.kl < max_kl and par.top1 >= min_top1, (arch, str(par))


def test_router_skew_concentrates_routing(tmp_path):
    """--router-skew scales each layer's router rows by exp(-S * r): the same weights otherwise, and rows of the
    least favoured experts shrink by exp(-S)."""
    plain = synth_model("qwen3moe", tmp_path / "a.gguf", preset="tiny", qtype="Q8_0", seed=3)
    skewed = synth_model("qwen3moe", tmp_path / "b.gguf", preset="tiny", qtype="Q8_0", seed=3, router_skew=2.0)
    fa, fb = GGUFFile(plain), GGUFFile(skewed)
    name = "blk.0.ffn_gate_inp.weight"
    ra, rb = fa.dequantize(name), fb.dequantize(name)
    ratio = np.linalg.norm(rb, axis=1) / np.linalg.norm(ra, axis=1)
    assert np.isclose(ratio.max(), 1.0, rtol=1e-5) and np.isclose(ratio.min(), np.exp(-2.0), rtol=1e-5)
    assert np.array_equal(fa.dequantize("blk.0.ffn_up_exps.weight"), fb.dequantize("blk.0.ffn_up_exps.weight"))

"""Qwen3.5 / Qwen3.6 / Qwen3-Next hybrids (`polystrata/models/qwen35.py`): the delta rule's two forms, the recurrent
state of the reference executor, the synthetic presets, and logits against transformers' reference models."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from polystrata.engine import Engine
from polystrata.errors import PolystrataError
from polystrata.models import build_graph, model_hparams
from polystrata.parity import Parity
from polystrata.runtimes.reference import delta_rule_chunked, delta_rule_recurrent, l2_normalize
from polystrata.synth import preset_metadata, synth_model, tensor_plan
from polystrata.targets import available_kernel_targets

HYBRIDS = ("qwen35", "qwen35moe", "qwen3next")


@pytest.fixture(scope="module")
def tiny_hybrid(tmp_path_factory):
    """Tiny synthetic F32 models of each hybrid architecture (one file each, written on first use)."""
    made = {}

    def get(arch: str):
        if arch not in made:
            made[arch] = synth_model(arch, tmp_path_factory.mktemp(arch) / f"{arch}.gguf", qtype="F32")
        return made[arch]

    return get


def _delta_inputs(rng, t, hk, hv, dk, dv):
    q = l2_normalize(rng.standard_normal((t, hk, dk), dtype=np.float32), 1e-6)
    k = l2_normalize(rng.standard_normal((t, hk, dk), dtype=np.float32), 1e-6)
    v = rng.standard_normal((t, hv, dv), dtype=np.float32)
    log_decay = -rng.uniform(0.0, 1.5, (t, hv))
    rate = rng.uniform(0.0, 1.0, (t, hv))
    return q, k, v, np.stack([log_decay, rate], axis=-1).astype(np.float32)


@pytest.mark.parametrize("head_map", ["tiled", "grouped"])
@pytest.mark.parametrize("t", [1, 63, 64, 150])
def test_delta_rule_chunked_matches_recurrent(head_map, t):
    rng = np.random.default_rng(t)
    q, k, v, gates = _delta_inputs(rng, t, 2, 4, 16, 8)
    s0 = rng.standard_normal((4, 16, 8)).astype(np.float32)
    s_rec, s_chunk = s0.copy(), s0.copy()
    out_rec = delta_rule_recurrent(q, k, v, gates, s_rec, 0.25, head_map)
    out_chunk = delta_rule_chunked(q, k, v, gates, s_chunk, 0.25, head_map, 64)
    np.testing.assert_allclose(out_chunk, out_rec, rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(s_chunk, s_rec, rtol=1e-4, atol=2e-5)


def test_delta_rule_head_maps_differ():
    # The two head maps pair value heads with different key heads: a builder choosing the wrong one shows.
    q, k, v, gates = _delta_inputs(np.random.default_rng(0), 5, 2, 4, 16, 8)
    a = delta_rule_recurrent(q, k, v, gates, np.zeros((4, 16, 8), np.float32), 0.25, "tiled")
    b = delta_rule_recurrent(q, k, v, gates, np.zeros((4, 16, 8), np.float32), 0.25, "grouped")
    assert np.abs(a - b).max() > 0.1


@pytest.mark.parametrize("arch", HYBRIDS)
def test_state_carried_across_chunks_and_reset(arch, tiny_hybrid, monkeypatch):
    """One pass twice, and after a reset prefill in uneven pieces then token by token: the same logits."""
    e = Engine(tiny_hybrid(arch), target="reference", n_ctx=512, all_logits=True)
    ids = np.random.default_rng(1).integers(0, e.hparams.n_vocab, 200)
    whole = e.score(ids)
    np.testing.assert_array_equal(e.score(ids), whole)  # score starts from zero state again
    monkeypatch.setattr(e, "n_ubatch", 48)  # steps of 48 (-ub) across delta-rule chunks of 64
    e.reset()
    pieces = [e.forward(ids[:130], all_logits=True)]
    pieces += [e.forward(ids[i : i + 1], all_logits=True) for i in range(130, 200)]
    # Float32 rounding differs between the chunked and token-by-token forms: logits of ~1.6 agree to ~1e-5 on
    # average, within a few 1e-4 everywhere, where a lost or doubled token would move them by ~1.
    np.testing.assert_allclose(np.concatenate(pieces), whole, rtol=0, atol=5e-3)


def test_recurrent_state_rewinds_only_to_its_checkpoint(tiny_hybrid):
    e = Engine(tiny_hybrid("qwen35"), target="reference", n_ctx=64, all_logits=True)
    fresh = e.forward([1, 2, 3, 4, 5, 6], all_logits=True)
    e.reset()
    e.forward([1, 2, 3, 4])
    e.checkpoint()
    e.forward([9, 9])
    assert not e.can_rewind(2) and e.can_rewind(4) and e.can_rewind(6) and e.can_rewind(0)
    with pytest.raises(PolystrataError, match="recurrent state"):
        e.rewind(2)
    e.rewind(4)
    np.testing.assert_allclose(e.forward([5, 6], all_logits=True), fresh[4:], rtol=0, atol=1e-4)
    e.rewind(0)
    assert e.n_past == 0 and not e.executor.states


def test_batched_decoding_takes_one_sequence_with_a_recurrent_state(tiny_hybrid):
    """Batched sequences share one engine's K/V cache by rows; a recurrent state is one per engine, so serve takes
    hybrids one sequence at a time (--parallel 1; more are refused in one line), the state zeroed as each opens:
    a second sequence gives what the first gave, as the engine alone does."""
    from polystrata.batch import BatchDecoder

    e = Engine(tiny_hybrid("qwen35"), target="reference", n_ctx=64, all_logits=True)
    with pytest.raises(PolystrataError, match="recurrent state, one per engine.*use -np 1"):
        BatchDecoder(e, 2)
    ids = [5, 9, 2, 7, 3]
    alone = e.forward(ids, all_logits=True)
    b = BatchDecoder(e, 1)
    for _ in range(2):
        slot = b.open()
        np.testing.assert_allclose(b.prefill(slot, ids[:3]), alone[2], rtol=0, atol=1e-5)
        np.testing.assert_allclose(b.step([(slot, [ids[3]])])[0], alone[3], rtol=0, atol=1e-5)
        np.testing.assert_allclose(b.step([(slot, [ids[4]])])[0], alone[4], rtol=0, atol=1e-5)
        b.close(slot)


def test_info_names_hybrid_layout_and_unused_mtp_layer(tiny_hybrid):
    r = subprocess.run([sys.executable, "-m", "polystrata", "info", str(tiny_hybrid("qwen35moe"))],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "3 Gated DeltaNet, 1 gated full attention (3)" in r.stdout
    assert "multi-token prediction: 1 layer (blk.4), read and not used" in r.stdout


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "target"), [("qwen35moe", "opencl"), ("qwen35", "opencl"), ("qwen35moe", "cuda"),
                                            ("qwen35", "cuda")])
def test_kernel_target_matches_reference(tiny_hybrid, arch, target):
    """The recipes' kernels in a whole model on opencl (and cuda where a GPU is), GPU-shaped (qwen35moe: routed experts,
    separate alpha and beta, tiled heads; qwen35 dense): one pass, then a prompt longer than a delta-rule chunk (the
    chunked form) and token-by-token decode (the recurrent form) through the state buffers after a reset that clears
    them, and the decode again after a rewind to a checkpoint. The cpu target's kernels (the recurrent form only, its
    policy) run a whole qwen35moe in test_llama_cpp.py's check against llama.cpp; opencl compiles cost less CI time."""
    if target not in available_kernel_targets():
        pytest.skip(f"no {target} device here")
    path = tiny_hybrid(arch)
    ids = np.random.default_rng(3).integers(0, 1000, 80)
    ref = Engine(path, target="reference", n_ctx=128, all_logits=True).score(ids)
    e = Engine(path, target=target, n_ctx=128, all_logits=True)
    names = {la.kernel.name for plan in e.executor.plans.values() for la in plan.launches}
    assert any(n.startswith("delta_scan_") for n in names) and any(n.startswith("delta_rule_") for n in names)
    # The decode plan's fusions: q, k and v read by the delta rule where the convolution wrote them, q and k
    # L2-normed there, the gates with the convolution; prompt plans cut q, k and v in one launch.
    step = sorted(la.kernel.name for la in e.executor.plans[id(e.graph_step)].launches)
    assert any(n.startswith("slice_heads_") for n in names) and any("_ssm_conv_" in n for n in step), step
    assert all("_x" in n for n in step if n.startswith("delta_rule_")), step
    alone = [n for n in step if n.startswith(("l2_norm_", "gdn_gates_")) and "ssm_conv" not in n]
    assert alone == [], alone
    # Gated attention: q and the gate read in place from their projection, the gate applied by the combine.
    assert not any(n.startswith(("slice_", "ew_sigmoid_mul")) and not n.startswith("slice_heads") for n in step), step
    if arch == "qwen35moe":  # the next layer's norm sums the routed experts and the gated shared expert (the last
        # layer, no norm after it, keeps the combine and the gate's launch)
        fused, alone = (sum(n.startswith(p) for n in step) for p in ("rms_norm_add_moe", ("moe_combine", "ew_gate")))
        assert (fused, alone) == (e.hparams.n_layer - 1, 2), step
    np.testing.assert_allclose(e.score(ids), ref, rtol=0, atol=5e-3)
    e.reset()
    prefill = e.forward(ids[:70], all_logits=True)
    e.checkpoint()
    for _ in range(2):  # the second time from the checkpoint, through the state buffers' host copies
        out = [prefill] + [e.forward(ids[i : i + 1], all_logits=True) for i in range(70, 80)]
        np.testing.assert_allclose(np.concatenate(out), ref, rtol=0, atol=5e-3)
        e.rewind(70)


@pytest.mark.slow
@pytest.mark.parametrize("target", ["opencl", "cuda"])
def test_shared_expert_inside_the_experts_launches(target, tmp_path):
    """qwen3.5 MoE in Q8_0 (the GPU policies' int8 path): the shared expert's matmuls inside the routed experts'
    launches (its rows after theirs) give what its own launches give (knob moe_ffn.shared=0), in a prompt and in
    token-by-token decode."""
    if target not in available_kernel_targets():
        pytest.skip(f"no {target} device here")
    path = synth_model("qwen35moe", tmp_path / "m.gguf", qtype="Q8_0", seed=4)
    ids = np.random.default_rng(5).integers(0, 1000, 40)
    logits, steps = [], []
    for knobs in (None, {"moe_ffn": {"shared": 0}}):
        e = Engine(path, target=target, n_ctx=128, all_logits=True, knobs=knobs)
        steps.append([la.kernel.name for la in e.executor.plans[id(e.graph_step)].launches])
        out = [e.forward(ids[:30], all_logits=True)] + [e.forward(ids[i : i + 1], all_logits=True)
                                                       for i in range(30, 40)]
        logits.append(np.concatenate(out))
    fused, alone = steps
    n = e.hparams.n_layer - 1  # the last layer, no norm after it, keeps the shared expert's own launches
    assert sum(x.endswith("_sh_q8") for x in fused) == 2 * n and sum(x.startswith("glu_") for x in fused) == 1
    assert sum(x.startswith("glu_") for x in alone) == n + 1 and len(alone) - len(fused) == 3 * n
    np.testing.assert_allclose(logits[0], logits[1], rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def streamed_moe(tmp_path_factory):
    """A tiny qwen3.5 MoE in Q8_0, a prompt of 24 tokens then 6 decoded, and a function running them on opencl
    (engine options as keywords) that returns the engine and the logits; the resident run's logits."""
    if "opencl" not in available_kernel_targets():
        pytest.skip("no opencl device here")
    path = synth_model("qwen35moe", tmp_path_factory.mktemp("sm") / "m.gguf", qtype="Q8_0", seed=4)
    ids = [int(i) for i in np.random.default_rng(5).integers(0, 1000, 30)]

    def run(**kw):
        e = Engine(path, target="opencl", n_ctx=64, all_logits=True, **kw)
        return e, [e.forward(ids[:24], all_logits=True)] + [e.forward(ids[i : i + 1]) for i in range(24, 30)]

    return run, run()[1]


@pytest.mark.parametrize(("slots", "policy"), [(2, "lru"), (5, "lfu"), (1, "lru"), (3, "prefetch")])
def test_streamed_experts_match_resident(slots, policy, streamed_moe):
    """qwen3.5 MoE with its experts streamed (its shared expert and the Gated DeltaNet layers around them): the
    resident run's logits bit for bit, in a prompt and in decode; decode resolved on the device where the cache
    holds a token's experts and the policy is lru or lfu, on the host otherwise."""
    run, want = streamed_moe
    e, got = run(expert_slots=slots, expert_policy=policy)
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    k = e.executor.streamer.layers[0].stream.k
    on_device = e.executor.streamer.summary()["device_resolved"]
    assert (on_device > 0) == (slots >= k and policy != "prefetch")


@pytest.mark.parametrize(("arch", "preset", "n_delta", "n_full"), [
    ("qwen35moe", "qwen3.6-35b-a3b", 30, 10),
    ("qwen3next", "qwen3-next-80b-a3b", 36, 12),
])
def test_real_shape_presets_build(arch, preset, n_delta, n_full):
    """The benchmark presets' tensors (from their plan, nothing written) make a complete graph of the real shape."""
    tensors = {name: (shape, fmt) for name, shape, fmt in tensor_plan(arch, preset, "Q4_K_M")}
    md = preset_metadata(arch, preset, "Q4_K_M")
    hp = model_hparams(md, tensors)
    assert (hp.n_layer, len(hp.extra["full_attention_layers"])) == (n_delta + n_full, n_full)
    assert hp.extra["nextn_predict_layers"] == 1 and f"blk.{hp.n_layer}.nextn.eh_proj.weight" in tensors
    assert tensors["blk.0.ssm_conv1d.weight"][1] == "F32"
    g = build_graph(md, tensors, all_logits=False)
    assert g.summary()["ops"]["delta_rule"] == n_delta and g.summary()["ops"]["attention"] == n_full
    assert not any(w.startswith(f"blk.{hp.n_layer}.") for w in g.weights)  # the MTP layer is not run
    if arch == "qwen35moe":
        # Decode on a GPU waits mostly on launches here (a step is ~3 GB of weights a token at most, in hundreds of
        # small kernels): the fusions keep a step at 607 launches for cuda (1105 before them, 2026-12-05).
        from polystrata.compiler.passes import build_plan
        from polystrata.ir.formats import FORMATS, KV_FORMATS
        from polystrata.runtimes.cuda import CUDARuntime

        formats = {name: FORMATS[fmt] for name, (_, fmt) in tensors.items()}
        policy = CUDARuntime(arch="sm_90", compile_only=True).policy
        assert len(build_plan(g, formats, KV_FORMATS["f16"], 512, 1, policy=policy).launches) <= 610


# --- against transformers' reference models --------------------------------------------------------------

# The bounds: KL over the reference's top 40 in F32, and in Q8_0 (whose rounding the reference lacks).
# Top-1 in Q8_0: these random models have near-ties that the rounding flips at 2-3 % of the positions (0.976 to
# 0.979 measured, KL 1.5e-4 to 2.6e-4; llama.cpp on the same Q8_0 files: 0.974 to 0.979, KL 2.5e-4 to 4.1e-4), so
# the bound there is the parity metric's own (`parity.TOP1_MIN`).
KL_MAX = {"F32": 1e-4, "Q8_0": 2e-3}
TOP1_MIN = {"F32": 0.98, "Q8_0": 0.95}


@pytest.mark.slow
@pytest.mark.transformers
@pytest.mark.parametrize("outtype", ["F32", "Q8_0"])
@pytest.mark.parametrize("arch", HYBRIDS)
def test_logits_match_transformers(arch, outtype, tmp_path):
    """A tiny random model of transformers' implementation, converted as llama.cpp's converter does: one pass over
    a prompt of several prefill chunks (and delta-rule chunks), then token-by-token decode, against the reference's
    logits over the whole sequence (KL over its top 40 tokens)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from hf_hybrid import tiny_model, write_gguf_from_hf

    model = tiny_model(arch)
    n_prompt, n_decode = 300, 40
    ids = np.random.default_rng(2).integers(0, model.config.vocab_size, n_prompt + n_decode)
    with torch.no_grad():
        ref = model(torch.from_numpy(ids)[None]).logits[0].numpy()
    top = np.argsort(-ref, axis=1)[:, :40]
    e = Engine(write_gguf_from_hf(model, arch, tmp_path / f"{arch}.gguf", outtype), target="reference", n_ctx=512,
               all_logits=True)

    scored = Parity()
    scored.add(top, np.take_along_axis(ref, top, 1), e.score(ids))
    assert scored.kl <= KL_MAX[outtype] and scored.top1 >= TOP1_MIN[outtype], f"one pass: {scored}"

    e.reset()
    decoded = Parity()
    logits = [e.forward(ids[:n_prompt])]
    logits += [e.forward(ids[i : i + 1]) for i in range(n_prompt, n_prompt + n_decode - 1)]
    rows = slice(n_prompt - 1, n_prompt + n_decode - 1)
    decoded.add(top[rows], np.take_along_axis(ref[rows], top[rows], 1), np.concatenate(logits))
    assert decoded.kl <= KL_MAX[outtype] and decoded.top1 >= TOP1_MIN[outtype], f"decode: {decoded}"


@pytest.mark.llama_cpp
@pytest.mark.transformers
@pytest.mark.parametrize("arch", HYBRIDS)
def test_llama_cpp_agrees_on_converted_models(arch, tmp_path):
    """llama.cpp, the second oracle, on the same converted files: its logits agree with transformers' (so the
    conversion in tests/hf_hybrid.py is one llama.cpp reads as it reads its converter's), over several of its
    delta-rule chunks."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    llama_cpp = pytest.importorskip("llama_cpp")
    from hf_hybrid import tiny_model, write_gguf_from_hf

    model = tiny_model(arch)
    ids = np.random.default_rng(4).integers(0, model.config.vocab_size, 150).tolist()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    llm = llama_cpp.Llama(model_path=str(write_gguf_from_hf(model, arch, tmp_path / f"{arch}.gguf")), n_ctx=256,
                          n_batch=256, logits_all=True, verbose=False, type_k=0, type_v=0)
    llm.eval(ids)
    top = np.argsort(-ref, axis=1)[:, :40]
    par = Parity()
    par.add(top, np.take_along_axis(ref, top, 1), np.asarray(llm.scores[: len(ids)]))
    assert par.kl <= KL_MAX["F32"] and par.top1 >= TOP1_MIN["F32"], str(par)


@pytest.mark.llama_cpp
@pytest.mark.parametrize(("arch", "target"), [
    *((arch, "reference") for arch in HYBRIDS),
    pytest.param("qwen35moe", "cpu", marks=pytest.mark.slow),  # the cpu target's kernels in a whole hybrid model
])
def test_llama_cpp_agrees_on_synth_models(arch, target, tiny_hybrid):
    """llama.cpp as a second oracle on the synthetic tiny models (`synth --preset tiny`; test_synth.py compares one
    short pass): a prompt of two delta-rule chunks, then token-by-token decode, against the reference executor and
    the cpu target's kernels (the recurrent form: the cpu's policy)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    path = tiny_hybrid(arch)
    n_prompt, n_decode = 100, 8
    ids = [int(i) for i in np.random.default_rng(5).integers(0, 1000, n_prompt + n_decode)]
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=128, n_batch=128, logits_all=True, verbose=False, type_k=0,
                          type_v=0)
    llm.eval(ids[:n_prompt])
    for i in range(n_prompt, len(ids)):
        llm.eval([ids[i]])
    want = np.asarray(llm.scores[: len(ids)])
    e = Engine(path, target=target, n_ctx=128, all_logits=True)
    got = [e.forward(ids[:n_prompt], all_logits=True)]
    got += [e.forward(ids[i : i + 1], all_logits=True) for i in range(n_prompt, len(ids))]
    top = np.argsort(-want, axis=1)[:, :40]
    par = Parity()
    par.add(top, np.take_along_axis(want, top, 1), np.concatenate(got))
    assert par.kl <= KL_MAX["F32"] and par.top1 >= TOP1_MIN["F32"], str(par)


@pytest.mark.parametrize(("key", "value"), [("ssm_group_count", 3), ("ssm_inner_size", 66)])
def test_bad_hybrid_metadata_is_one_line(tmp_path, monkeypatch, key, value):
    """Head counts that do not divide: one line naming the keys (the file written with them, shapes to match)."""
    import dataclasses

    from polystrata import synth

    tiny = synth.PRESETS["qwen35"]["tiny"]
    monkeypatch.setitem(synth.PRESETS["qwen35"], "tiny", dataclasses.replace(tiny, extra={**tiny.extra, key: value}))
    bad = synth_model("qwen35", tmp_path / "bad.gguf", qtype="F32")
    r = subprocess.run([sys.executable, "-m", "polystrata", "info", str(bad)], capture_output=True, text=True)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "do not divide evenly (ssm.inner_size, ssm.time_step_rank, ssm.group_count)" in r.stderr

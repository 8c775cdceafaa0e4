"""Recipe conformance, codegen/recipes/deltanet.py: the Gated DeltaNet ops on every target under test, against the
numpy reference; the recurrent ones over two steps (a prompt, then one token) through the same state buffer."""

from __future__ import annotations

import numpy as np
import pytest
from recipe_cases import plan_scratch, recipe, recipe_context, run_launches, target_runtimes

from polystrata.codegen.recipes.deltanet import state_buffer
from polystrata.ir.graph import Graph
from polystrata.ir.kernel import Launch
from polystrata.runtimes import reference as R

rt = target_runtimes()


def _check(rt, g: Graph, steps=(1, 6), rtol=1e-5, atol=1e-5, ctx=None) -> list[np.ndarray]:
    """Lower g's one node with its recipe (in `ctx`, default a one-lane context) and compare each step's output (and
    a recurrent op's state after it) with the reference's, carrying the state from step to step; the outputs."""
    (node,) = g.nodes
    ctx = ctx or recipe_context(g)
    launches = recipe(node.op).lower(g.nodes, ctx)
    scratch_bufs, scratch_outs = plan_scratch(ctx)
    ex = R.ReferenceExecutor({}, n_ctx=64)
    state = state_buffer(node) if node.op in ("ssm_conv", "delta_rule") else None
    keep: dict = {}
    got_outs = []
    for i, t in enumerate(steps):
        rng = np.random.default_rng(t)
        vals = {}
        for v in [*g.inputs, *g.weights.values()]:
            x = rng.standard_normal([t if d == "T" else d for d in v.type.shape]).astype(np.float32)
            if v.name == "gates":  # log decays <= 0, rates in (0, 1)
                x[..., 0], x[..., 1] = -np.abs(x[..., 0]), 1 / (1 + np.exp(-x[..., 1]))
            if v.name in ("q", "k"):
                x = R.l2_normalize(x, 1e-6)
            vals[v.name] = x
        ref = R._IMPLS[node.op](ex, node, [vals[v.name] for v in node.inputs])
        bufs = {k: v.reshape(-1) for k, v in vals.items()}
        outs = {"o": (ref.shape, "f32"), **scratch_outs}
        if i == 0:
            bufs.update(scratch_bufs)
            if state is not None:
                bufs[state[0]] = np.zeros(state[1], np.float32)
        keep.pop("o", None)  # sized for this step
        out = run_launches(rt, launches, bufs, {"T": t}, outs, keep)["o"]
        np.testing.assert_allclose(out, ref, rtol=rtol, atol=atol, err_msg=f"step {i} of {t} tokens")
        got_outs.append(out)
        if state is not None:
            want = next(iter(ex.states.values()))
            if node.op == "delta_rule":  # kept transposed: [Hv, Dv, Dk]
                want = want.transpose(0, 2, 1)
            got = rt.download(keep[state[0]], (state[1],), "f32")
            np.testing.assert_allclose(got, want.reshape(-1), rtol=rtol, atol=atol)
    return got_outs


def test_slice(rt):
    g = Graph("t")
    x = g.input("x", "f32", ("T", 3, 40))
    g.op("slice", x, start=8, stop=29, name="o")
    _check(rt, g)


@pytest.mark.parametrize("op", ["l2_norm", "rms_norm_gated"])
def test_row_norms(rt, op):
    g = Graph("t")
    x = g.input("x", "f32", ("T", 3, 48))
    if op == "l2_norm":
        g.op(op, x, eps=1e-6, name="o")
    else:
        g.op(op, x, g.weight("w", "F32", (48,)), g.input("z", "f32", ("T", 3, 48)), eps=1e-6, name="o")
    _check(rt, g)


@pytest.mark.parametrize("parts", [1, 3])
def test_slice_heads_read_their_rows_in_place(rt, parts):
    """slice -> reshape into heads [-> l2_norm] as one launch (Gated DeltaNet's q and k normalized, v not; or one
    normalized part alone): each part's heads, read from their place in the slices' input, and each slice itself,
    against numpy."""
    g = Graph("t")
    x = g.input("x", "f32", ("T", 96))
    cuts = [(16, 48, 2, 16, True), (48, 80, 2, 16, True), (80, 92, 3, 4, False)][:parts]
    for i, (start, stop, nh, d, norm) in enumerate(cuts):
        heads = g.op("reshape", g.op("slice", x, start=start, stop=stop, name=f"s{i}"), shape=("T", nh, d),
                     name=f"h{i}")
        if norm:
            g.op("l2_norm", heads, eps=1e-6, name=f"o{i}")
    ctx = recipe_context(g, lanes=rt.lanes)
    (launch,) = recipe("slice_heads3" if parts == 3 else "slice_heads").lower(g.nodes, ctx)
    for t in (1, 5):
        xv = np.random.default_rng(t).standard_normal((t, 96)).astype(np.float32)
        outs = {f"s{i}": ((t, stop - start), "f32") for i, (start, stop, _, _, _) in enumerate(cuts)}
        outs |= {f"o{i}": ((t, nh, d), "f32") for i, (_, _, nh, d, norm) in enumerate(cuts) if norm}
        out = run_launches(rt, [launch], {"x": xv.reshape(-1)}, {"T": t}, outs)
        for i, (start, stop, nh, d, norm) in enumerate(cuts):
            np.testing.assert_allclose(out[f"s{i}"], xv[:, start:stop])
            if norm:
                np.testing.assert_allclose(out[f"o{i}"], R.l2_normalize(xv[:, start:stop].reshape(t, nh, d), 1e-6),
                                           rtol=1e-5, atol=1e-6)


def test_gated_norm_writes_the_output_projections_int8_activations(rt):
    """On the GPU path rms_norm_gated (heads of 64) also writes its output, as rows of a token, in the matmuls' int8
    activations (the codes and scales `quantize_x_kernel` writes), and provides that launch."""
    from polystrata.codegen.recipes.linear import quantize_x_kernel

    if rt.lanes == 1:
        pytest.skip("the int8 activations are the GPU path's")
    g = Graph("t")
    x, z = g.input("x", "f32", ("T", 3, 64)), g.input("z", "f32", ("T", 3, 64))
    g.op("rms_norm_gated", x, g.weight("w", "F32", (64,)), z, eps=1e-6, name="o")
    ctx = recipe_context(g, lanes=rt.lanes)
    (launch,) = recipe("rms_norm_gated").lower(g.nodes, ctx)
    (provided,) = launch.provides
    assert launch.kernel.name.endswith("_q8") and provided.kernel.name == "quantize_x_192"
    assert provided.buffers[0] == ("x", "o")
    t = 3
    rng = np.random.default_rng(0)
    vals = {"x": rng.standard_normal((t, 3, 64)), "z": rng.standard_normal((t, 3, 64)), "w": rng.standard_normal(64)}
    vals = {k: v.astype(np.float32).reshape(-1) for k, v in vals.items()}
    qn, dn = dict(launch.buffers)["xq"], dict(launch.buffers)["xd"]
    out = run_launches(rt, [launch], {**vals, qn: np.zeros(t * 48, np.uint32)}, {"T": t},
                       {"o": ((t, 192), "f32"), qn: ((t * 48,), "u32"), dn: ((t * 6,), "f32")})
    want = run_launches(rt, [Launch(quantize_x_kernel("quantize_x_192", 192), (("x", "o"), ("xq", "q"), ("xd", "d")),
                                    (("T", "T"),))], {"o": out["o"].reshape(-1), "q": np.zeros(t * 48, np.uint32)},
                        {"T": t}, {"q": ((t * 48,), "u32"), "d": ((t * 6,), "f32")})
    np.testing.assert_array_equal(out[qn], want["q"])
    np.testing.assert_allclose(out[dn], want["d"], rtol=1e-6)


def test_gdn_gates(rt):
    g = Graph("t")
    alpha, beta = g.input("alpha", "f32", ("T", 6)), g.input("beta", "f32", ("T", 6))
    g.op("gdn_gates", alpha, beta, g.weight("dt", "F32", (6,)), g.weight("a", "F32", (6,)), name="o")
    _check(rt, g)


def test_ssm_conv(rt):
    g = Graph("t")
    x = g.input("x", "f32", ("T", 70))
    g.op("ssm_conv", x, g.weight("w", "F32", (70, 4)), layer=0, name="o")
    _check(rt, g, steps=(2, 5, 1))  # a first step shorter than the kernel: the state keeps older rows


def test_gates_and_conv_in_one_launch(rt):
    """gdn_gates then ssm_conv as one launch (the convolution's groups and one for the gates): the same outputs and
    state, step after step (a first step shorter than the kernel, then more), as each op's own launch."""
    g = Graph("t")
    alpha, beta = g.input("alpha", "f32", ("T", 6)), g.input("beta", "f32", ("T", 6))
    g.op("gdn_gates", alpha, beta, g.weight("dt", "F32", (6,)), g.weight("a", "F32", (6,)), name="gates")
    x = g.input("x", "f32", ("T", 70))
    g.op("ssm_conv", x, g.weight("w", "F32", (70, 4)), layer=0, name="o")
    ctx = recipe_context(g, lanes=rt.lanes)
    fused = recipe("gdn_gates_ssm_conv").lower(g.nodes, ctx)
    apart = recipe("gdn_gates").lower(g.nodes[:1], ctx) + recipe("ssm_conv").lower(g.nodes[1:], ctx)
    assert len(fused) == 1 and len(apart) == 2
    state, count = state_buffer(g.nodes[1])
    keeps: dict = {"fused": {}, "apart": {}}
    for i, t in enumerate((2, 5, 1)):
        rng = np.random.default_rng(t)
        vals = {v.name: rng.standard_normal([t if d == "T" else d for d in v.type.shape]).astype(np.float32).reshape(-1)
                for v in [*g.inputs, *g.weights.values()]}
        if i == 0:
            vals[state] = np.zeros(count, np.float32)
        outs = {"gates": ((t, 6, 2), "f32"), "o": ((t, 70), "f32")}
        for keep in keeps.values():  # sized for this step
            keep.pop("gates", None), keep.pop("o", None)
        got = {how: run_launches(rt, launches, dict(vals), {"T": t}, outs, keeps[how])
               for how, launches in (("fused", fused), ("apart", apart))}
        for name in outs:
            np.testing.assert_allclose(got["fused"][name], got["apart"][name], rtol=1e-6, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(rt.download(keeps["fused"][state], (count,), "f32"),
                                   rt.download(keeps["apart"][state], (count,), "f32"))


# Steps of the delta rule tests: shorter and longer than a chunk of 64, ending inside chunks, one token between.
DELTA_STEPS = (7, 64, 1, 65, 130)


@pytest.mark.parametrize("head_map", ["tiled", "grouped"])
def test_delta_rule_forms(rt, head_map):
    """The recurrent form alone, the chunked form alone, and the two chosen by step length (the default threshold),
    over steps that cross chunk boundaries with the state carried: each against the reference (chunked for steps
    of several tokens, recurrent for one) and against each other. One compile serves every threshold (a scalar);
    on targets with lanes the kernels run GPU-shaped."""
    if head_map == "grouped" and rt.lanes == 1:
        pytest.skip("one-lane targets run the tiled sample (a head map is one index expression; Numba compiles)")
    g = Graph("t")
    q, k = g.input("q", "f32", ("T", 2, 16)), g.input("k", "f32", ("T", 2, 16))
    v, gates = g.input("v", "f32", ("T", 4, 12)), g.input("gates", "f32", ("T", 4, 2))
    g.op("delta_rule", q, k, v, gates, layer=0, scale=0.25, head_map=head_map, chunk=64, name="o")
    outs, kernels = {}, {}
    for form, above in (("recurrent", 1000), ("chunked", 0), ("chosen by length", 16)):
        ctx = recipe_context(g, lanes=rt.lanes)
        ctx.t_max, ctx.knobs = max(DELTA_STEPS), {"delta_rule": {"chunked_above": above}}
        launches = recipe("delta_rule").lower(g.nodes, ctx)
        kernels[form] = {la.kernel.name for la in launches}
        outs[form] = _check(rt, g, steps=DELTA_STEPS, rtol=1e-4, atol=2e-5, ctx=ctx)
    assert len(kernels["recurrent"]) == 1 and len(kernels["chunked"]) == 2
    assert kernels["chosen by length"] == kernels["recurrent"] | kernels["chunked"]
    for form in ("chunked", "chosen by length"):
        for t, a, b in zip(DELTA_STEPS, outs[form], outs["recurrent"]):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5, err_msg=f"{form} vs recurrent, {t} tokens")


def test_delta_rule_decode_plan_has_recurrent_form_only():
    g = Graph("t")
    q, k = g.input("q", "f32", ("T", 1, 8)), g.input("k", "f32", ("T", 1, 8))
    v, gates = g.input("v", "f32", ("T", 2, 8)), g.input("gates", "f32", ("T", 2, 2))
    g.op("delta_rule", q, k, v, gates, layer=0, scale=0.25, head_map="tiled", chunk=64, name="o")
    ctx = recipe_context(g)
    ctx.t_max = 1
    (launch,) = recipe("delta_rule").lower(g.nodes, ctx)
    assert launch.kernel.name.startswith("delta_rule_") and not ctx.scratch_buffers

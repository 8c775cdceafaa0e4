"""Recipe conformance, codegen/recipes/moe.py: the router, the expert lists, moe_ffn and its fusions, on every
target under test, against the numpy reference."""

from __future__ import annotations

import numpy as np
import pytest
from recipe_cases import (
    gpu_shaped,
    plan_scratch,
    q8_rounded,
    recipe,
    recipe_context,
    run,
    run_launches,
    target_runtimes,
    weight,
)

from polystrata.ir.formats import FORMATS
from polystrata.ir.graph import Graph
from polystrata.runtimes import reference as R

rt = target_runtimes()


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("lanes", [1, 32])
def test_router(rt, norm, lanes):
    """Top-k expert ids and weights; tied logits go to the lowest index (a warp of lanes: the GPU router)."""
    gpu_shaped(rt, lanes, sampled=norm)
    e = 40
    g = Graph("t")
    x = g.input("x", "f32", ("T", e))
    g.op("router", x, k=3, norm=norm, name="o")
    launches = recipe("router").lower(g.nodes, recipe_context(g, lanes=lanes))
    assert launches[0].kernel.lanes == lanes
    t = 5
    xv = np.random.default_rng(0).standard_normal((t, e)).astype(np.float32)
    xv[1, [7, 30, 33]] = xv[1].max() + 1.0  # a three-way tie for the top
    xv[2, [3, 4]] = xv[2].max() + 0.5
    out = run_launches(rt, launches, {"x": xv.reshape(-1)}, {"T": t}, {"o": ((2 * t * 3,), "i32")})["o"]
    ids, w = R._IMPLS["router"](None, g.nodes[0], [xv])
    assert list(ids[1]) == [7, 30, 33] and list(ids[2][:2]) == [3, 4]
    np.testing.assert_array_equal(out[: t * 3].reshape(t, 3), ids)
    np.testing.assert_allclose(out[t * 3:].reshape(t, 3) / 2.0**30, w, atol=1e-6)


def _moe_case(rt, fmt_name, lanes, t_max=16, e=8, dm=256, ff=256, k=2, knobs=None, matrix_units=False):
    """A router + moe_ffn graph lowered on a context of `lanes` lanes (and moe_ffn `knobs`; `matrix_units`: a
    target whose policy has them); returns what a test needs to run it."""
    g = Graph("t")
    x = g.input("x", "f32", ("T", dm))
    logits = g.input("logits", "f32", ("T", e))
    route = g.op("router", logits, k=k, norm=True, name="route")
    gw = g.weight("g", fmt_name, (e, ff, dm))
    uw = g.weight("u", fmt_name, (e, ff, dm))
    dw = g.weight("d", fmt_name, (e, dm, ff))
    g.op("moe_ffn", x, route, gw, uw, dw, name="o")
    ctx = recipe_context(g, formats={n: FORMATS[fmt_name] for n in "gud"}, lanes=lanes if matrix_units else 1,
                         matrix_units=matrix_units)
    ctx.lanes, ctx.t_max = lanes, t_max
    ctx.knobs = {"moe_ffn": knobs or {}}
    rl = recipe("router").lower(g.nodes[:1], ctx)
    ml = recipe("moe_ffn").lower(g.nodes[1:], ctx)
    return g, ctx, rl, ml, *_moe_weights(fmt_name, e, dm, ff)


def _moe_weights(fmt_name, e, dm, ff):
    """Random expert weights "g", "u" [e, ff, dm] and "d" [e, dm, ff]: (raw buffers by name, dequantized)."""
    _, bg, dg = weight(fmt_name, e * ff, dm, 1)
    _, bu, du = weight(fmt_name, e * ff, dm, 2)
    _, bd, dd = weight(fmt_name, e * dm, ff, 3)
    return {"g": bg, "u": bu, "d": bd}, (dg.reshape(e, ff, dm), du.reshape(e, ff, dm), dd.reshape(e, dm, ff))


def _moe_ref(x: np.ndarray, ids: np.ndarray, w: np.ndarray, deq, int8: bool) -> np.ndarray:
    """float64 moe_ffn; `int8`: with x and h rounded as the GPU path does (`q8_rounded`), so only float error
    remains."""
    g, u, d = (a.astype(np.float64) for a in deq)
    xs = q8_rounded(x) if int8 else x.astype(np.float64)
    y = np.zeros((x.shape[0], d.shape[1]))
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            e = ids[t, s]
            a = g[e] @ xs[t]
            h = a / (1 + np.exp(-a)) * (u[e] @ xs[t])
            h = q8_rounded(h[None])[0] if int8 else h
            y[t] += float(w[t, s]) * (d[e] @ h)
    return y


@pytest.mark.parametrize("fmt_name", ["Q4_0", "F16", "Q4_K", "Q8_0", "Q6_K"])
def test_moe_ffn(rt, fmt_name):
    """Router + expert-dispatched moe_ffn vs. the reference, k = 2 of 8 experts, T = 1 and 9 on one plan."""
    e, dm, k = 8, 256, 2
    for lanes in sorted({1, rt.lanes}):
        g, ctx, rl, ml, weights, deq = _moe_case(rt, fmt_name, lanes)
        keep: dict = {}
        rng = np.random.default_rng(5)
        for t in (16, 1, 9):  # largest first: `keep` holds buffers sized by the first step
            xv = rng.standard_normal((t, dm)).astype(np.float32)
            lv = rng.standard_normal((t, e)).astype(np.float32)
            sb, so = plan_scratch(ctx)
            out = run_launches(rt, rl + ml, {"x": xv.reshape(-1), "logits": lv.reshape(-1), **weights, **sb},
                                {"T": t}, {"o": ((t, dm), "f32"), "route": ((2 * t * k,), "i32"), **so}, keep)["o"]
            r = R._IMPLS["router"](None, g.nodes[0], [lv])
            if any(la.kernel.name.startswith("quantize_x") for la in ml):  # GPU int8 path: its own oracle
                ref = _moe_ref(xv, *r, deq, int8=True)
                np.testing.assert_allclose(out, ref, rtol=1e-3, atol=1e-4 * np.abs(ref).max(), err_msg=f"T={t}")
            ref = R._IMPLS["moe_ffn"](None, g.nodes[1], [xv, r, *deq])
            tol = 3e-2 if any(la.kernel.name.startswith("quantize_x") for la in ml) else 1e-3
            np.testing.assert_allclose(out, ref, rtol=tol, atol=tol * np.abs(ref).max(), err_msg=f"T={t}")


@pytest.mark.parametrize("fmt_name", ["Q4_K", "Q8_0"])
def test_moe_residual_norm_sums_the_experts(rt, fmt_name):
    """router + moe_ffn + the residual add + the next RMS norm lower together: no combine launch, the norm kernel
    sums the experts' outputs with the route weights itself. The residual stream (`s`) and the normed row (`y`)
    match the separate recipes' oracle, in one-token plans (router lists) and prefill plans (T = 9)."""
    e, dm, ff, k = 8, 256, 256, 2
    g = Graph("t")
    x = g.input("x", "f32", ("T", dm))
    res = g.input("res", "f32", ("T", dm))
    logits = g.input("logits", "f32", ("T", e))
    route = g.op("router", logits, k=k, norm=True, name="route")
    ws = [g.weight(n, fmt_name, shape) for n, shape in (("g", (e, ff, dm)), ("u", (e, ff, dm)), ("d", (e, dm, ff)))]
    o = g.op("moe_ffn", x, route, *ws, name="o")
    sv = g.op("add", res, o, name="s")
    nw = g.input("nw", "f32", (dm,))
    g.op("rms_norm", sv, nw, eps=1e-5, name="y")
    weights, deq = _moe_weights(fmt_name, e, dm, ff)
    rng = np.random.default_rng(13)
    nwv = rng.uniform(0.5, 1.5, dm).astype(np.float32)
    for lanes in sorted({1, rt.lanes}):
        for t_max, t in ((1, 1), (16, 9)):
            ctx = recipe_context(g, formats={n: FORMATS[fmt_name] for n in "gud"})
            ctx.lanes, ctx.t_max = lanes, t_max
            launches = recipe("router_moe_add_rms_norm").lower(g.nodes, ctx)
            names = [la.kernel.name for la in launches]
            assert not any(n.startswith("moe_combine") for n in names) and "_moe2" in names[-1], names
            xv, resv = (rng.standard_normal((t, dm)).astype(np.float32) for _ in range(2))
            lv = rng.standard_normal((t, e)).astype(np.float32)
            sb, so = plan_scratch(ctx)
            got = run_launches(rt, launches, {"x": xv.reshape(-1), "res": resv.reshape(-1), "nw": nwv,
                                               "logits": lv.reshape(-1), **weights, **sb},
                                {"T": t}, {"s": ((t, dm), "f32"), "y": ((t, dm), "f32"),
                                           "route": ((2 * t * k,), "i32"), **so})
            ids, w = R._IMPLS["router"](None, g.nodes[0], [lv])
            int8 = any(n.startswith("quantize_x") for n in names)
            want_s = resv + _moe_ref(xv, ids, w, deq, int8)
            tol = 1e-3 * np.abs(want_s).max()
            np.testing.assert_allclose(got["s"], want_s, rtol=1e-3, atol=tol, err_msg=f"lanes={lanes} T={t}")
            want_y = R._IMPLS["rms_norm"](None, g.nodes[-1], [got["s"], nwv])
            np.testing.assert_allclose(got["y"], want_y, rtol=1e-4, atol=1e-4, err_msg=f"lanes={lanes} T={t}")


def test_moe_group_lists(rt):
    """The expert lists `group_kernel` writes: counts, each expert's entries in route order, then the experts with
    entries in order (their ranks computed in parallel on GPUs)."""
    from polystrata.codegen.recipes.moe import group_kernel, list_words

    n_exp, k, cap = 24, 3, 16
    rng = np.random.default_rng(5)
    for lanes in sorted({1, rt.lanes}):
        kern = group_kernel(f"t_group_{lanes}", n_exp, k, cap, lanes)
        for t in (1, 5):
            ids = np.stack([rng.choice(n_exp, k, replace=False) for _ in range(t)]).reshape(-1).astype(np.int32)
            route = np.concatenate([ids, np.zeros_like(ids)])
            words = list_words(n_exp, cap)
            lst = run(rt, kern, {"route": route, "lst": np.full(words, -7, np.int32)}, {"T": t},
                      {"lst": ((words,), "i32")})["lst"]
            counts = np.bincount(ids, minlength=n_exp)
            np.testing.assert_array_equal(lst[:n_exp], counts)
            for e in range(n_exp):
                first = n_exp + e * cap
                np.testing.assert_array_equal(lst[first: first + counts[e]], np.flatnonzero(ids == e))
            a = n_exp * (1 + cap)
            active = np.flatnonzero(counts)
            assert lst[a] == len(active)
            np.testing.assert_array_equal(lst[a + 1: a + 1 + len(active)], active)


def _hand_routes(rng, t: int, e: int, k: int, skew: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Routes of t tokens to k of e experts, unnormalised weights: (ids, weights, the route buffer); `skew`: expert
    3 in every token's first slot."""
    ids = np.stack([rng.permutation(e)[:k] for _ in range(t)]).astype(np.int32)
    if skew:
        ids[:, 0] = 3
        ids[:, 1] = np.where(ids[:, 1] == 3, 5, ids[:, 1])
    w = rng.uniform(0.05, 1.0, (t, k)).astype(np.float32)
    q30 = np.round(w.astype(np.float64) * 2.0**30).astype(np.int32)
    return ids, w, np.concatenate([ids.reshape(-1), q30.reshape(-1)])


@pytest.mark.parametrize("fmt_name,spread", [("Q4_K", "auto"), ("Q8_0", "auto"), ("Q4_K", 3)])
def test_moe_ffn_random_routes(rt, fmt_name, spread):
    """moe_ffn alone on hand-made routes: skewed (one expert takes every token), unnormalised weights, T = 1 and 9;
    on GPUs with the expert rows spread over the lanes (by default here: the rows are short), also three rows a
    group where 256 rows do not divide (the last group's loads clamped, its stores guarded)."""
    e, dm, k = 8, 256, 2
    for lanes in sorted({1, rt.lanes}):
        g, ctx, _, ml, weights, deq = _moe_case(rt, fmt_name, lanes, knobs={"spread": spread})
        if lanes > 1:
            spreads = [dict(la.kernel.knobs)["spread"] for la in ml if la.kernel.name.startswith("moe_down")]
            # Q4_K's 256 columns are one block: a few units a row, spread; Q8_0's are 8 blocks of 4 units, 32 lanes.
            if spread == 3 or fmt_name == "Q8_0":
                assert spreads[0] == (3 if spread == 3 else 1)
            else:
                assert spreads[0] > 1
        rng = np.random.default_rng(11)
        keep: dict = {}
        for t, skew in ((9, False), (1, False), (9, True)):
            xv = rng.standard_normal((t, dm)).astype(np.float32)
            ids, w, route = _hand_routes(rng, t, e, k, skew)
            sb, so = plan_scratch(ctx)
            out = run_launches(rt, ml, {"x": xv.reshape(-1), "route": route, **weights, **sb}, {"T": t},
                                {"o": ((t, dm), "f32"), **so}, keep)["o"]
            int8 = any(la.kernel.name.startswith("quantize_x") for la in ml)
            ref = _moe_ref(xv, ids, w, deq, int8)
            np.testing.assert_allclose(out, ref, rtol=1e-3, atol=1e-4 * np.abs(ref).max(), err_msg=f"T={t}")


@pytest.mark.parametrize("fmt_name", ["Q4_K", "Q8_0"])
def test_moe_one_token_plan_router_writes_lists(rt, fmt_name):
    """In a plan of one-token steps (t_max 1, decode) router + moe_ffn lower together: the router also writes the
    expert lists, the list launch is gone, and the output is moe_ffn's (poisoned list buffer: every word read
    must have been written)."""
    e, dm, k = 8, 256, 2
    for lanes in sorted({1, rt.lanes}):
        g, ctx, _, _, weights, deq = _moe_case(rt, fmt_name, lanes, t_max=1)
        ctx.scratch_buffers.clear()
        launches = recipe("router_moe").lower(g.nodes, ctx)
        names = [la.kernel.name for la in launches]
        assert names[0].endswith("_lists") and not any(n.startswith("moe_group") for n in names)
        rng = np.random.default_rng(7)
        for _ in range(3):
            xv = rng.standard_normal((1, dm)).astype(np.float32)
            lv = rng.standard_normal((1, e)).astype(np.float32)
            sb, so = plan_scratch(ctx)
            out = run_launches(rt, launches, {"x": xv.reshape(-1), "logits": lv.reshape(-1), **weights, **sb},
                                {"T": 1}, {"o": ((1, dm), "f32"), "route": ((2 * k,), "i32"), **so})["o"]
            ids, w = R._IMPLS["router"](None, g.nodes[0], [lv])
            int8 = any(n.startswith("quantize_x") for n in names)
            ref = _moe_ref(xv, ids, w, deq, int8)
            np.testing.assert_allclose(out, ref, rtol=1e-3, atol=1e-4 * np.abs(ref).max())


@pytest.mark.parametrize("fmt_name,u8f16", [("Q8_0", False), ("F16", False), ("Q8_0", True)])
def test_moe_ffn_tile_products(rt, fmt_name, u8f16):
    """Prompt chunks on matrix units: each listed expert's tokens through the prefill matmul's tile products
    (`tile_mma`, portable rendering here), gate/up with the GLU as epilogue, then down; Q8_0 on int8 activations
    (with knob mma_f16, the u8f16 products on f16 ones), F16 weights on f16 ones (the formats' decoding is
    test_recipes_tile_mma's: each path here in a cheap format).
    Q8_0 takes them in steps of more than 64 tokens and its int8 matvecs in the others (the row count picks; both
    checked here); F16 in every step. T = 70 and 33 with one expert taking every token (token tiles, the last
    partial), 7 and 1; experts without tokens store nothing (outputs poisoned)."""
    if rt.lanes == 1:
        pytest.skip("GPU-shaped, never planned on one lane")
    e, dm, k = 8, 256, 2
    knobs = {"mma_min": 32, "mma_rows": 32, "mma_tokens": 16, "mma_lanes": 64, "mma_f16": int(u8f16)}
    g, ctx, _, ml, weights, deq = _moe_case(rt, fmt_name, 128, t_max=80, knobs=knobs, matrix_units=True)
    moe = [la.kernel.name for la in ml if la.kernel.name.startswith("moe_")]  # group, ..., combine
    tiles = [la for la in ml if la.kernel.name.endswith("_mma")]
    assert all(("xq" in dict(la.buffers)) == (fmt_name == "Q8_0" and not u8f16) for la in tiles)
    if fmt_name == "F16":
        assert [n.endswith("_mma") for n in moe] == [False, True, True, False], moe
    else:
        assert [n.split("_")[-2:] for n in moe[1:-1]] == [["gt64", "mma"]] * 2 + [["le64", "q8"]] * 2, moe
    rng = np.random.default_rng(17)
    keep: dict = {}
    for t, skew in ((70, True), (33, True), (7, False), (1, False)):
        xv = rng.standard_normal((t, dm)).astype(np.float32)
        ids, w, route = _hand_routes(rng, t, e, k, skew)
        sb, so = plan_scratch(ctx)
        out = run_launches(rt, ml, {"x": xv.reshape(-1), "route": route, **weights, **sb}, {"T": t},
                           {"o": ((t, dm), "f32"), **so}, keep)["o"]
        if fmt_name == "F16" or (u8f16 and t > 64):  # x and h rounded to f16 (2e-3: h's rounding, not modelled)
            ref = _moe_ref(xv.astype(np.float16).astype(np.float32), ids, w, deq, False)
            np.testing.assert_allclose(out, ref, rtol=2e-3, atol=2e-3 * np.abs(ref).max(), err_msg=f"T={t}")
        else:
            ref = _moe_ref(xv, ids, w, deq, True)
            np.testing.assert_allclose(out, ref, rtol=1e-3, atol=1e-4 * np.abs(ref).max(), err_msg=f"T={t}")

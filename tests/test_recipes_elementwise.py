"""Recipe conformance, codegen/recipes/elementwise.py: elementwise ops, RMS norm (also fused with the residual add
and writing int8 activations) and rope, on every target under test, against the numpy reference."""

from __future__ import annotations

import numpy as np
import pytest
from recipe_cases import gpu_shaped, recipe, recipe_context, run_launches, target_runtimes, weight

from polystrata.ir.graph import Graph
from polystrata.runtimes import reference as R

rt = target_runtimes()


@pytest.mark.parametrize("op", ["add", "mul", "scale", "swiglu", "geglu", "sigmoid_mul"])
def test_elementwise(rt, op):
    g = Graph("t")
    x = g.input("x", "f32", ("T", 37))
    if op in ("add", "mul"):
        y = g.input("y", "f32", (37,))
        g.op(op, x, y, name="o")
    elif op == "scale":
        g.op(op, x, factor=0.37, name="o")
    elif op == "sigmoid_mul":
        y = g.input("y", "f32", ("T", 1))
        g.op(op, x, y, name="o")
    else:
        y = g.input("y", "f32", ("T", 37))
        g.op(op, x, y, name="o")
    launches = recipe(op).lower(g.nodes, recipe_context(g))
    for t in (1, 7):
        rng = np.random.default_rng(t)
        vals = {v.name: rng.standard_normal([t if d == "T" else d for d in v.type.shape]).astype(np.float32)
                for v in g.inputs}
        ref = R._IMPLS[op](None, g.nodes[0], [vals[v.name] for v in g.nodes[0].inputs])
        out = run_launches(rt, launches, {k: v.reshape(-1) for k, v in vals.items()}, {"T": t},
                            {"o": (ref.shape, "f32")})["o"]
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("order", ["experts first", "gated first"])
def test_sigmoid_mul_then_add_in_one_launch(rt, order):
    """A shared expert's sigmoid gate, then its sum with the routed experts' (either operand order): one launch,
    writing the sum and the gated value (which other ops may read), against the reference."""
    g = Graph("t")
    s, gate, f = g.input("s", "f32", ("T", 37)), g.input("gate", "f32", ("T", 1)), g.input("f", "f32", ("T", 37))
    gated = g.op("sigmoid_mul", s, gate, name="gated")
    g.op("add", *((f, gated) if order == "experts first" else (gated, f)), name="o")
    (launch,) = recipe("sigmoid_mul_add").lower(g.nodes, recipe_context(g, lanes=rt.lanes))
    for t in (1, 7):
        rng = np.random.default_rng(t)
        vals = {v.name: rng.standard_normal([t if d == "T" else d for d in v.type.shape]).astype(np.float32)
                for v in g.inputs}
        want_gated = R._IMPLS["sigmoid_mul"](None, g.nodes[0], [vals["s"], vals["gate"]])
        out = run_launches(rt, [launch], {k: v.reshape(-1) for k, v in vals.items()}, {"T": t},
                           {"o": ((t, 37), "f32"), "gated": ((t, 37), "f32")})
        np.testing.assert_allclose(out["gated"], want_gated, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(out["o"], want_gated + vals["f"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("gate_format", ["F32", "F16"])
def test_shared_expert_gate_sigmoid_mul_add_in_one_launch(rt, gate_format):
    """A shared expert's gate logit (a one-row matmul), its sigmoid times the expert's output, and the sum with the
    routed experts': one launch where the gate weight is F32 (each group taking its token's dot product), storing
    the logit, the gated value and the sum; another format lowers as the matmul and the pair. Against numpy."""
    from polystrata.ir.formats import FORMATS

    g = Graph("t")
    h, s, f = (g.input(nm, "f32", ("T", 64)) for nm in ("h", "s", "f"))
    logit = g.op("matmul", h, g.weight("wg", gate_format, (1, 64)), name="logit")
    g.op("add", f, g.op("sigmoid_mul", s, logit, name="gated"), name="o")
    launches = recipe("gate_sigmoid_mul_add").lower(g.nodes, recipe_context(g, lanes=rt.lanes,
                                                                             formats={"wg": FORMATS[gate_format]}))
    assert len(launches) == (1 if gate_format == "F32" else 2)
    _, wbytes, wd = weight(gate_format, 1, 64, seed=3)
    rng = np.random.default_rng(3)
    for t in (1, 6):
        vals = {nm: rng.standard_normal((t, 64)).astype(np.float32) for nm in ("h", "s", "f")}
        out = run_launches(rt, launches, {**{k: v.reshape(-1) for k, v in vals.items()}, "wg": wbytes}, {"T": t},
                           {"o": ((t, 64), "f32"), "gated": ((t, 64), "f32"), "logit": ((t, 1), "f32")})
        want_logit = vals["h"] @ wd.T
        want_gated = vals["s"] / (1 + np.exp(-want_logit))
        np.testing.assert_allclose(out["logit"], want_logit, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(out["gated"], want_gated, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(out["o"], want_gated + vals["f"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("n", [1, 4])
def test_last_rows(rt, n):
    """The step's last min(T, n) rows (T_last), at steps of fewer rows than n (all of them), as many, and more;
    every output value written (the output buffer starts as NaN), none past those rows (they stay NaN)."""
    g = Graph("t")
    x = g.input("x", "f32", ("T", 37))
    g.op("last_rows", x, n=n, name="o")
    launches = recipe("last_rows").lower(g.nodes, recipe_context(g))
    for t in (1, 3, 4, 7):
        xv = np.random.default_rng(t).standard_normal((t, 37)).astype(np.float32)
        ref = R._IMPLS["last_rows"](None, g.nodes[0], [xv])
        np.testing.assert_array_equal(ref, xv[t - min(t, n):])
        out = run_launches(rt, launches, {"x": xv.reshape(-1)}, {"T": t, "T_last": min(t, n)},
                           {"o": ((n, 37), "f32")})["o"]
        np.testing.assert_array_equal(out[:len(ref)], ref)
        assert np.isnan(out[len(ref):]).all()


@pytest.mark.parametrize("fused,heads", [(False, False), (True, False), (False, True)])
def test_rms_norm(rt, fused, heads):
    g = Graph("t")
    shape = ("T", 3, 64) if heads else ("T", 96)
    x = g.input("x", "f32", shape)
    w = g.weight("w", "F32", (shape[-1],))
    if fused:
        r = g.input("r", "f32", shape)
        s = g.op("add", x, r, name="s")
        g.op("rms_norm", s, w, eps=1e-5, name="o")
        launches = recipe("add_rms_norm").lower(g.nodes, recipe_context(g))
    else:
        g.op("rms_norm", x, w, eps=1e-5, name="o")
        launches = recipe("rms_norm").lower(g.nodes, recipe_context(g))
    for t in (1, 5):
        rng = np.random.default_rng(t)
        xv = rng.standard_normal((t, *shape[1:])).astype(np.float32)
        rv = rng.standard_normal(xv.shape).astype(np.float32)
        wv = rng.standard_normal(shape[-1]).astype(np.float32)
        src = xv + rv if fused else xv
        ref = R._IMPLS["rms_norm"](None, g.nodes[-1], [src, wv])
        bufs = {"x": xv.reshape(-1), "w": wv, "r": rv.reshape(-1)}
        outs = {"o": (xv.shape, "f32")} | ({"s": (xv.shape, "f32")} if fused else {})
        out = run_launches(rt, launches, bufs, {"T": t}, outs)
        np.testing.assert_allclose(out["o"], ref, rtol=1e-4, atol=1e-5)
        if fused:
            np.testing.assert_array_equal(out["s"], src)


@pytest.mark.parametrize("fused", [False, True])
def test_rms_norm_writes_int8_activations(rt, fused):
    """GPU path: the norm also writes its output quantized as the next matmuls read it, the very codes and scales
    of the quantize launch it stands in for (`provides`)."""
    gpu_shaped(rt, 32, sampled=fused)
    g = Graph("t")
    d = 320
    x = g.input("x", "f32", ("T", d))
    w = g.weight("w", "F32", (d,))
    if fused:
        s = g.op("add", x, g.input("r", "f32", ("T", d)), name="s")
        g.op("rms_norm", s, w, eps=1e-5, name="o")
        (norm,) = recipe("add_rms_norm").lower(g.nodes, recipe_context(g, lanes=32))
    else:
        g.op("rms_norm", x, w, eps=1e-5, name="o")
        (norm,) = recipe("rms_norm").lower(g.nodes, recipe_context(g, lanes=32))
    (quant,) = norm.provides
    assert dict(quant.buffers)["x"] == "o" and "_q8_" in norm.kernel.name
    for t in (1, 3):
        rng = np.random.default_rng(t)
        xv, rv = rng.standard_normal((2, t, d)).astype(np.float32)
        xv[0, :32] = 0.0  # an all-zero block: scale 0, codes 0
        wv = rng.standard_normal(d).astype(np.float32)
        bufs = {"x": xv.reshape(-1), "w": wv, "r": rv.reshape(-1)}
        qouts = {"scratch.xq": ((t * d // 4,), "u32"), "scratch.xd": ((t * d // 32,), "f32")}
        sums = {"s": ((t, d), "f32")} if fused else {}
        out = run_launches(rt, [norm], bufs, {"T": t}, {"o": ((t, d), "f32"), **sums, **qouts})
        ref = R._IMPLS["rms_norm"](None, g.nodes[-1], [xv + rv if fused else xv, wv])
        np.testing.assert_allclose(out["o"], ref, rtol=1e-4, atol=1e-5)
        sep = run_launches(rt, [quant], {"o": out["o"].reshape(-1)}, {"T": t}, qouts)
        np.testing.assert_array_equal(out["scratch.xd"], sep["scratch.xd"])
        np.testing.assert_array_equal(out["scratch.xq"], sep["scratch.xq"])


@pytest.mark.parametrize("mode,dims", [("normal", 64), ("neox", 64), ("neox", 32)])
def test_rope(rt, mode, dims):
    g = Graph("t")
    x = g.input("x", "f32", ("T", 3, 64))
    pos = g.input("positions", "i32", ("T",))
    g.op("rope", x, pos, base=10000.0, dims=dims, mode=mode, freq_scale=0.5, name="o")
    launches = recipe("rope").lower(g.nodes, recipe_context(g))
    t = 7
    xv = np.random.default_rng(0).standard_normal((t, 3, 64)).astype(np.float32)
    pv = np.arange(20, 20 + t, dtype=np.int32)
    out = run_launches(rt, launches, {"x": xv.reshape(-1), "positions": pv}, {"T": t}, {"o": ((t, 3, 64), "f32")})
    ref = R.apply_rope(xv, pv, dims, 10000.0, 0.5, mode)
    np.testing.assert_allclose(out["o"], ref, rtol=1e-4, atol=2e-5)

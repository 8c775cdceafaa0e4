"""Recipe conformance: every recipe's kernels, on every available target, against the numpy reference.

Outputs are poisoned with NaN before each launch. Tolerances: rtol/atol ~1e-4 for f32 paths; the int8-activation
matvec path is bounded by the activation rounding: |err| <= sum_k |w_k| * max|x_blk| / 254 per output.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest

from polystrata.codegen.recipes import RecipeContext, load_all
from polystrata.codegen.recipes._matvec import use_int8
from polystrata.codegen.recipes.linear import embed_kernel, matmul_kernel, matvec_q8_kernel, quantize_x_kernel
from polystrata.compiler.passes import SLICED_ON_WIDE_LOADS
from polystrata.ir import quant as Q
from polystrata.ir.graph import Graph
from polystrata.ir.kernel import Launch
from polystrata.runtimes import reference as R
from polystrata.runtimes.base import eval_int
from polystrata.targets import available_kernel_targets, make_runtime

FORMATS = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
           "IQ4_NL", "IQ4_XS"]
# The formats cuda keeps with rows sliced, by their `_weight_format` names (NAME_S).
SLICED = [f"{name}_S" for name in SLICED_ON_WIDE_LOADS]


@pytest.fixture(scope="module", params=available_kernel_targets())
def rt(request):
    # A private kernel cache per session (keeps runs independent of stale on-disk caches).
    old = os.environ.get("POLYSTRATA_HOME")
    os.environ["POLYSTRATA_HOME"] = tempfile.mkdtemp(prefix="ps_recipes_")
    try:
        yield make_runtime(request.param)
    finally:
        if old is None:
            os.environ.pop("POLYSTRATA_HOME", None)
        else:
            os.environ["POLYSTRATA_HOME"] = old


def run(rt, kernel, buffers: dict[str, np.ndarray], scalars: dict, outs: dict[str, tuple]) -> dict[str, np.ndarray]:
    """Upload, poison outputs with NaN, launch once, download the outputs (name -> (shape, dtype))."""
    dev = {}
    for p in kernel.params:
        if hasattr(p, "dtype") and p.name in buffers:
            dev[p.name] = rt.upload(buffers[p.name])
    for name, (shape, dtype) in outs.items():
        if name in buffers:
            continue
        dev[name] = rt.alloc(shape, dtype)
        if dtype == "f32":
            rt.write(dev[name], np.full(int(np.prod(shape)), np.nan, np.float32))
    grid = [eval_int(g, scalars) for g in kernel.grid]
    rt.launch(rt.compile(kernel), rt.args_for(kernel, dev, scalars), grid)
    rt.sync()
    return {n: rt.download(dev[n], s, d) for n, (s, d) in outs.items()}


def _weight_format(fmt_name: str, cols: int = 0) -> Q.QuantFormat:
    """A GGUF format by name, or device layouts of one: NAME_A16, its blocks padded to 16 bytes (`Q.padded`);
    NAME_S, its rows of `cols` sliced (`Q.sliced`)."""
    name = fmt_name.removesuffix("_S")
    base, _, align = name.partition("_A")
    fmt = Q.padded(Q.FORMATS[base], int(align)) if align else Q.FORMATS[name]
    return Q.sliced(fmt, cols) if name != fmt_name else fmt


def _weight(fmt_name: str, rows: int, cols: int, seed: int = 0):
    fmt = _weight_format(fmt_name, cols)
    base = Q.FORMATS[fmt_name.removesuffix("_S").partition("_A")[0]]
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    raw = Q.repack(Q.quantize(base, w), base, fmt)
    deq = Q.dequantize(base, Q.quantize(base, w), (rows, cols))
    buf = raw.reshape(-1).view(np.float32) if fmt.name == "F32" else raw.reshape(-1)
    return fmt, buf, deq


def _int8_bound(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Per-output bound of the int8 activation rounding (plus float slack)."""
    xb = np.abs(x).reshape(x.shape[0], -1, 32).max(axis=-1) / 254.0  # half a step per 32-block
    xe = np.repeat(xb, 32, axis=1)
    return xe @ np.abs(w).T * 1.01 + 1e-4 * (np.abs(x) @ np.abs(w).T) + 1e-5


# --- matmul: every format, odd row counts, several T on one compiled kernel ---------------------------------


@pytest.mark.parametrize("fmt_name", [*FORMATS, *SLICED])
def test_matmul_formats(rt, fmt_name):
    n, k = 37, 256
    fmt, wb, wd = _weight(fmt_name, n, k)
    kern = matmul_kernel(f"t_mm_{fmt_name.lower()}", [fmt], n, k, rows=4, tokens=4, int8=True, split="rows",
                         lanes=rt.lanes)
    int8 = dict(kern.knobs)["int8"]
    rng = np.random.default_rng(1)
    for t in (1, 2, 7, 33):
        x = rng.standard_normal((t, k)).astype(np.float32)
        y = run(rt, kern, {"x": x.reshape(-1), "w0": wb}, {"T": t}, {"y": ((t, n), "f32")})["y"]
        ref = x @ wd.T
        if int8:
            assert np.all(np.abs(y - ref) <= _int8_bound(x, wd)), fmt_name
        else:
            np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt_name,split,int8,rows", [("Q4_K", "blocks", True, 3), ("Q5_1", "blocks", False, 1),
                                                      ("F16", "blocks", False, 2), ("F32", "blocks", False, 1),
                                                      ("Q6_K", "rows", False, 5)])
def test_matmul_schedules(rt, fmt_name, split, int8, rows):
    n, k = 3, 512
    fmt, wb, wd = _weight(fmt_name, n, k, 2)
    kern = matmul_kernel(f"t_mms_{fmt_name.lower()}_{split}_{int(int8)}_{rows}", [fmt], n, k, rows=rows, tokens=3,
                         int8=int8, split=split, lanes=rt.lanes)
    rng = np.random.default_rng(3)
    for t in (1, 7):
        x = rng.standard_normal((t, k)).astype(np.float32)
        y = run(rt, kern, {"x": x.reshape(-1), "w0": wb}, {"T": t}, {"y": ((t, n), "f32")})["y"]
        ref = x @ wd.T
        if dict(kern.knobs)["int8"]:
            assert np.all(np.abs(y - ref) <= _int8_bound(x, wd))
        else:
            np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt_name", [*FORMATS, *SLICED])
def test_embed(rt, fmt_name):
    """Rows of every format decoded whole (NAME_S: sliced rows, each byte's address computed at run time)."""
    vocab, cols = 7, 512
    fmt, wb, wd = _weight(fmt_name, vocab, cols, 4)
    kern = embed_kernel(f"t_embed_{fmt_name.lower()}", fmt, cols, 3, rt.lanes)
    tok = np.array([3, 0, 6, 3, 1], np.int32)
    y = run(rt, kern, {"w": wb, "tokens": tok}, {"T": len(tok)}, {"y": ((len(tok), cols), "f32")})["y"]
    np.testing.assert_array_equal(y, wd[tok])


# --- graph-level recipes: lower a one-op graph through its recipe ---------------------------------------------


def _ctx(g: Graph, kv="f16", n_ctx=64, formats=None, lanes=1):
    """A recipe context over `g`'s values (lanes > 1: GPU-shaped, with warps of 32)."""
    names = {}
    for v in g.inputs:
        names[id(v)] = v.name
    for nd in g.nodes:
        names[id(nd.output)] = nd.output.name
    return RecipeContext(lanes=lanes, subgroup=min(lanes, 32), kv_format=Q.KV_FORMATS[kv], n_ctx=n_ctx,
                         buffer_names=names, weight_formats=formats or {}, t_max=16)


def _recipe(name):
    for r in load_all() or __import__("polystrata.codegen.recipes", fromlist=["RECIPES"]).RECIPES:
        if r.name == name:
            return r
    from polystrata.codegen.recipes import RECIPES

    return next(r for r in RECIPES if r.name == name)


def _run_launches(rt, launches, bufs: dict[str, np.ndarray], scal: dict, outs: dict[str, tuple], keep=None):
    """Run launches over named plan buffers (numpy in, dict out); `keep` holds device buffers across calls."""
    dev = keep if keep is not None else {}
    for name, arr in bufs.items():
        dev[name] = rt.upload(arr)
    for name, (shape, dtype) in outs.items():
        if name not in dev:
            dev[name] = rt.alloc(shape, dtype)
        if dtype == "f32":
            rt.write(dev[name], np.full(int(np.prod(shape)), np.nan, np.float32))
    for la in launches:
        k = la.kernel
        bmap = dict(la.buffers)
        s = {n: (scal[v] if isinstance(v, str) else v) for n, v in la.scalars}
        args = rt.args_for(k, {p: dev[b] for p, b in bmap.items()}, s)
        rt.launch(rt.compile(k), args, [eval_int(gd, s) for gd in k.grid])
    rt.sync()
    return {n: rt.download(dev[n], sh, dt) for n, (sh, dt) in outs.items()}


@pytest.mark.parametrize("fmt_name", [f for f in FORMATS if use_int8(Q.FORMATS[f], True)] + ["Q6_K_A16", *SLICED])
def test_matvec_q8_formats(rt, fmt_name):
    """The GPU matvec (quantize kernel + one row per group, `sub` lanes per block, interleaved words or runs) on every
    int8-path format, against a float64 product with x rounded as the quantize kernel rounds it: only float error
    may remain (NAME_S: sliced rows, runs of words folded to slice addresses, interleaved words at addresses
    computed at run time)."""
    if rt.lanes == 1:
        pytest.skip("GPU-shaped kernels (the CPU takes matmul_kernel)")
    n, k = 37, 512
    fmt, wb, wd = _weight(fmt_name, n, k)
    rng = np.random.default_rng(4)
    # runs: each lane consecutive words; rows: rows a group (37 is odd: the last group's extra rows are clamped);
    # spread: the lanes spread over the rows rather than each sweeping all of them
    for sub, runs, rows, spread in (("auto", 0, 1, 0), ("auto", 1, 1, 0), (1, 0, 1, 0), (2, 1, 1, 0), ("auto", 1, 2, 0),
                                    ("auto", 0, 3, 0), ("auto", 1, 4, 1), ("auto", 0, 3, 1), (1, 1, 16, 1)):
        qk = quantize_x_kernel(f"t_q8x_{k}", k)
        mk = matvec_q8_kernel(f"t_mv8_{fmt_name.lower()}_{sub}_{runs}_{rows}_{spread}", [fmt], n, k, tokens=4,
                              lanes=32, sub=sub, runs=runs, rows=rows, spread=bool(spread))
        launches = [Launch(qk, (("x", "x"), ("xq", "xq"), ("xd", "xd")), (("T", "T"),)),
                    Launch(mk, (("xq", "xq"), ("xd", "xd"), ("w0", "w"), ("y", "y")), (("T", "T"),))]
        for t in (1, 3, 9):
            x = rng.standard_normal((t, k)).astype(np.float32)
            scratch = {"xq": np.full(t * k // 4, 0x3C3C3C3C, np.uint32)}
            y = _run_launches(rt, launches, {"x": x.reshape(-1), "w": wb, **scratch}, {"T": t},
                              {"y": ((t, n), "f32"), "xd": ((t * k // 32,), "f32")})["y"]
            xq = _q8(x)
            ref = xq @ wd.T.astype(np.float64)
            bound = 1e-4 * (np.abs(xq) @ np.abs(wd.T)) + 1e-5
            assert np.all(np.abs(y - ref) <= bound), (fmt_name, sub, runs, rows, spread, t,
                                                      float(np.max(np.abs(y - ref) - bound)))


def test_matvec_rows_share_activation_loads(rt):
    """Gate and up (same format) over two rows a group: one Reduce serves all four dot products, and the fused
    product matches the reference."""
    if rt.lanes == 1:
        pytest.skip("GPU-shaped kernels")
    from polystrata.ir.kernel import Reduce, walk

    n, k = 13, 512
    fmt, bg, dg = _weight("Q4_K", n, k, 1)
    _, bu, du = _weight("Q4_K", n, k, 2)
    mk = matvec_q8_kernel("t_mv8_rows2", [fmt, fmt], n, k, tokens=4, lanes=32, rows=2, epilogue=lambda v: v[0] * v[1])
    reds = [s for s in walk(mk.body) if isinstance(s, Reduce)]
    assert len(reds) == 1 and len(reds[0].results) == 4
    launches = [Launch(quantize_x_kernel(f"t_q8x_{k}", k), (("x", "x"), ("xq", "xq"), ("xd", "xd")), (("T", "T"),)),
                Launch(mk, (("xq", "xq"), ("xd", "xd"), ("w0", "wg"), ("w1", "wu"), ("y", "y")), (("T", "T"),))]
    for t in (1, 5):
        x = np.random.default_rng(t).standard_normal((t, k)).astype(np.float32)
        y = _run_launches(rt, launches, {"x": x.reshape(-1), "wg": bg, "wu": bu,
                                         "xq": np.zeros(t * k // 4, np.uint32)}, {"T": t},
                          {"y": ((t, n), "f32"), "xd": ((t * k // 32,), "f32")})["y"]
        xq = _q8(x)
        ref = (xq @ dg.T.astype(np.float64)) * (xq @ du.T.astype(np.float64))
        np.testing.assert_allclose(y, ref, rtol=1e-3, atol=1e-3 * np.abs(ref).max())


def test_stacked_matvecs(rt):
    """q, k and v of one input as one stacked launch (GPU path): each weight's rows, in its own format, land in its
    own output, within the int8 rounding of the activations."""
    if rt.lanes == 1:
        pytest.skip("GPU-shaped kernels (the CPU lowers each matmul on its own)")
    g = Graph("t")
    k = 256
    x = g.input("x", "f32", ("T", k))
    shapes = {"wq": ("Q4_K", 19), "wk": ("Q6_K", 7), "wv": ("Q8_0", 5)}
    for name, (fmt_name, n) in shapes.items():
        g.op("matmul", x, g.weight(name, fmt_name, (n, k)), name=f"y{name}")
    ctx = _ctx(g, formats={nm: Q.FORMATS[f] for nm, (f, _) in shapes.items()}, lanes=32)
    ctx.knobs = {"matmul": {"rows": 2}}  # 19, 7 and 5 rows: each weight's last group has one
    launches = _recipe("matmul_stack3").lower(g.nodes, ctx)
    assert [la.kernel.name.startswith("matmul_stack") for la in launches] == [False, True]
    weights = {nm: _weight(f, n, k, seed) for seed, (nm, (f, n)) in enumerate(shapes.items())}
    for t in (1, 5):
        xv = np.random.default_rng(t).standard_normal((t, k)).astype(np.float32)
        outs = {f"y{nm}": ((t, n), "f32") for nm, (_, n) in shapes.items()}
        outs |= {"scratch.xq": ((16 * k // 4,), "u32"), "scratch.xd": ((16 * k // 32,), "f32")}
        y = _run_launches(rt, launches, {"x": xv.reshape(-1), **{nm: w[1] for nm, w in weights.items()}}, {"T": t},
                          outs)
        for nm, (_, _, wd) in weights.items():
            assert np.all(np.abs(y[f"y{nm}"] - xv @ wd.T) <= _int8_bound(xv, wd)), (nm, t)


@pytest.mark.parametrize("fmt_name,sub,spread", [("Q4_K", "auto", 0), ("Q5_K", "auto", 0), ("Q8_0", "auto", 0),
                                                   ("Q4_1", "auto", 0), ("Q4_K", "auto", 1), ("Q6_K_A16", 1, 1),
                                                   ("Q6_K_A16", "auto", 0), ("Q4_K_S", "auto", 0),
                                                   ("Q4_K_S", "auto", 1), ("Q5_K_S", "auto", 0)])
def test_runs_alignment_promises_hold(fmt_name, sub, spread):
    """Every alignment a runs-layout matvec promises (`load_u32` on the weights, `Load.align` on the codes) divides
    the address at every lane, block and row tried, also with the lanes spread over rows and on Q6_K padded to
    16 bytes a block; Q4_K's runs start on 16-byte boundaries (one vector load)."""
    from polystrata.ir.kernel import Call, Let, Load, Reduce, expr_nodes, stmt_exprs, walk

    n, k = 64, 1024
    kern = matvec_q8_kernel("t_runs", [_weight_format(fmt_name, k)], n, k, tokens=1, lanes=32, runs=1, sub=sub,
                            rows=4 if spread else 2, spread=bool(spread))
    red = next(s for s in walk(kern.body) if isinstance(s, Reduce))
    rng = np.random.default_rng(0)
    promised = set()
    for _ in range(40):
        env = {"g0": int(rng.integers(n)), "g1": 0, red.var: int(rng.integers(eval_int(red.stop, {}))), "t": 0}
        for s in walk(kern.body):
            if isinstance(s, Let):
                try:
                    env[s.name] = eval_int(s.expr, env)
                except (ValueError, KeyError):
                    pass  # not an integer expression of the lane's indices
            for e in stmt_exprs(s):
                for x in expr_nodes(e):
                    if isinstance(x, Call) and x.fn == "load_u32":
                        addr, align = eval_int(x.args[1], env), x.args[2].value
                    elif isinstance(x, Load) and x.align > 1:
                        addr, align = eval_int(x.index, env) * 4, x.align * 4  # u32 words
                    else:
                        continue
                    assert addr % align == 0, (fmt_name, addr, align)
                    promised.add(align)
    assert 16 in promised
    if fmt_name.startswith("Q4_K") and not spread:
        words = [x for s in walk(red.body) for e in stmt_exprs(s) for x in expr_nodes(e)
                 if isinstance(x, Call) and x.fn == "load_u32" and x.args[2].value == 16]
        assert len({str(w.args[1]) for w in words}) == 10  # per row: the header and one per 32-byte piece of quants


def test_glu_fused(rt):
    for fmt_name, act in (("Q4_1", "swiglu"), ("F32", "geglu"), ("Q6_K", "swiglu")):
        g = Graph("t")
        x = g.input("x", "f32", ("T", 256))
        wg, wu = g.weight("wg", fmt_name, (19, 256)), g.weight("wu", fmt_name, (19, 256))
        a = g.op("matmul", x, wg, name="a")
        b = g.op("matmul", x, wu, name="b")
        g.op(act, a, b, name="o")
        ctx = _ctx(g, formats={"wg": Q.FORMATS[fmt_name], "wu": Q.FORMATS[fmt_name]})
        launches = _recipe(f"matmul_{act}").lower(g.nodes, ctx)
        _, bg, dg = _weight(fmt_name, 19, 256, 5)
        _, bu, du = _weight(fmt_name, 19, 256, 6)
        for t in (1, 7):
            xv = np.random.default_rng(t).standard_normal((t, 256)).astype(np.float32)
            y = _run_launches(rt, launches, {"x": xv.reshape(-1), "wg": bg, "wu": bu}, {"T": t},
                              {"o": ((t, 19), "f32")})["o"]
            ga, ua = xv @ dg.T, xv @ du.T
            ref = (R.silu(ga) if act == "swiglu" else R.gelu_tanh(ga)) * ua
            tol = 0.02 * np.abs(ref).max() if fmt_name != "F32" else 1e-4
            np.testing.assert_allclose(y, ref, atol=tol, rtol=1e-3)


@pytest.mark.parametrize("op", ["add", "mul", "scale", "swiglu", "geglu", "sigmoid_mul", "last_row"])
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
    elif op == "last_row":
        g.op(op, x, name="o")
    else:
        y = g.input("y", "f32", ("T", 37))
        g.op(op, x, y, name="o")
    launches = _recipe(op).lower(g.nodes, _ctx(g))
    for t in (1, 7):
        rng = np.random.default_rng(t)
        vals = {v.name: rng.standard_normal([t if d == "T" else d for d in v.type.shape]).astype(np.float32)
                for v in g.inputs}
        ref = R._IMPLS[op](None, g.nodes[0], [vals[v.name] for v in g.nodes[0].inputs])
        out = _run_launches(rt, launches, {k: v.reshape(-1) for k, v in vals.items()}, {"T": t},
                            {"o": (ref.shape, "f32")})["o"]
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


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
        launches = _recipe("add_rms_norm").lower(g.nodes, _ctx(g))
    else:
        g.op("rms_norm", x, w, eps=1e-5, name="o")
        launches = _recipe("rms_norm").lower(g.nodes, _ctx(g))
    for t in (1, 5):
        rng = np.random.default_rng(t)
        xv = rng.standard_normal((t, *shape[1:])).astype(np.float32)
        rv = rng.standard_normal(xv.shape).astype(np.float32)
        wv = rng.standard_normal(shape[-1]).astype(np.float32)
        src = xv + rv if fused else xv
        ref = R._IMPLS["rms_norm"](None, g.nodes[-1], [src, wv])
        bufs = {"x": xv.reshape(-1), "w": wv, "r": rv.reshape(-1)}
        outs = {"o": (xv.shape, "f32")} | ({"s": (xv.shape, "f32")} if fused else {})
        out = _run_launches(rt, launches, bufs, {"T": t}, outs)
        np.testing.assert_allclose(out["o"], ref, rtol=1e-4, atol=1e-5)
        if fused:
            np.testing.assert_array_equal(out["s"], src)


@pytest.mark.parametrize("fused", [False, True])
def test_rms_norm_writes_int8_activations(rt, fused):
    """GPU path: the norm also writes its output quantized as the next matmuls read it, the very codes and scales
    of the quantize launch it stands in for (`provides`)."""
    if rt.lanes == 1:
        pytest.skip("GPU-shaped plans only")
    g = Graph("t")
    d = 320
    x = g.input("x", "f32", ("T", d))
    w = g.weight("w", "F32", (d,))
    if fused:
        s = g.op("add", x, g.input("r", "f32", ("T", d)), name="s")
        g.op("rms_norm", s, w, eps=1e-5, name="o")
        (norm,) = _recipe("add_rms_norm").lower(g.nodes, _ctx(g, lanes=32))
    else:
        g.op("rms_norm", x, w, eps=1e-5, name="o")
        (norm,) = _recipe("rms_norm").lower(g.nodes, _ctx(g, lanes=32))
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
        out = _run_launches(rt, [norm], bufs, {"T": t}, {"o": ((t, d), "f32"), **sums, **qouts})
        ref = R._IMPLS["rms_norm"](None, g.nodes[-1], [xv + rv if fused else xv, wv])
        np.testing.assert_allclose(out["o"], ref, rtol=1e-4, atol=1e-5)
        sep = _run_launches(rt, [quant], {"o": out["o"].reshape(-1)}, {"T": t}, qouts)
        np.testing.assert_array_equal(out["scratch.xd"], sep["scratch.xd"])
        np.testing.assert_array_equal(out["scratch.xq"], sep["scratch.xq"])


@pytest.mark.parametrize("mode,dims", [("normal", 64), ("neox", 64), ("neox", 32)])
def test_rope(rt, mode, dims):
    g = Graph("t")
    x = g.input("x", "f32", ("T", 3, 64))
    pos = g.input("positions", "i32", ("T",))
    g.op("rope", x, pos, base=10000.0, dims=dims, mode=mode, freq_scale=0.5, name="o")
    launches = _recipe("rope").lower(g.nodes, _ctx(g))
    t = 7
    xv = np.random.default_rng(0).standard_normal((t, 3, 64)).astype(np.float32)
    pv = np.arange(20, 20 + t, dtype=np.int32)
    out = _run_launches(rt, launches, {"x": xv.reshape(-1), "positions": pv}, {"T": t}, {"o": ((t, 3, 64), "f32")})
    ref = R.apply_rope(xv, pv, dims, 10000.0, 0.5, mode)
    np.testing.assert_allclose(out["o"], ref, rtol=1e-4, atol=2e-5)


def _attention_graph(hq: int, hkv: int, d: int, window: int = 0, softcap: float = 0.0) -> Graph:
    """One attention op over inputs q, k, v, positions (heads of d values), output "o"."""
    g = Graph("t")
    q, k, v = (g.input(n, "f32", ("T", h, d)) for n, h in (("q", hq), ("k", hkv), ("v", hkv)))
    pos = g.input("positions", "i32", ("T",))
    g.op("attention", q, k, v, pos, layer=0, scale=0.125, window=window, softcap=softcap, name="o")
    return g


def _check_attention(rt, kv: str, gqa: int, window: int, softcap: float, lanes: int, n_ctx: int, knobs: dict,
                     steps: tuple[int, ...], seed: int) -> list:
    """The attention recipe's launches (lanes, knobs) against the reference over `steps` (token counts, the
    largest first: `keep` holds buffers sized by it), the cache carried between them; returns the launches."""
    hkv, d = 2, 64
    hq = hkv * gqa
    g = _attention_graph(hq, hkv, d, window, softcap)
    ctx = _ctx(g, kv=kv, n_ctx=n_ctx, lanes=lanes)
    ctx.knobs = {"attention": knobs}
    launches = _recipe("attention").lower(g.nodes, ctx)
    fmt = Q.KV_FORMATS[kv]
    kvb = n_ctx * Q.row_bytes(fmt, hkv * d)
    ex = R.ReferenceExecutor({}, n_ctx)
    keep = {"kv.0.k": rt.alloc((kvb,), "u8"), "kv.0.v": rt.alloc((kvb,), "u8")}
    n_past = 0
    rng = np.random.default_rng(seed)
    for t in steps:
        qv, kvv, vv = (rng.standard_normal((t, h, d)).astype(np.float32) for h in (hq, hkv, hkv))
        pv = np.arange(n_past, n_past + t, dtype=np.int32)
        # The reference sees what the cache holds: K/V rounded through the KV format.
        kq = Q.dequantize(fmt, Q.quantize(fmt, kvv.reshape(t, -1)), (t, hkv * d)).reshape(kvv.shape)
        vq = Q.dequantize(fmt, Q.quantize(fmt, vv.reshape(t, -1)), (t, hkv * d)).reshape(vv.shape)
        ref = R._IMPLS["attention"](ex, g.nodes[0], [qv, kq, vq, pv])
        sb, so = _moe_scratch(ctx)  # split-K partials, poisoned: a run the combine should not read spoils the output
        out = _run_launches(rt, launches, {"q": qv.reshape(-1), "k": kvv.reshape(-1), "v": vv.reshape(-1),
                                           "positions": pv, **sb}, {"T": t}, {"o": ((t, hq, d), "f32"), **so},
                            keep)["o"]
        # Our encoder may pick the neighbouring f16 scale (round-to-nearest vs. rounding up): a q8 step of a value.
        np.testing.assert_allclose(out, ref, atol=1e-4 if kv == "f16" else 0.03, rtol=1e-3)
        n_past += t
    return launches


@pytest.mark.parametrize("kv,gqa,window,softcap", [
    ("f16", 1, 0, 0.0), ("f16", 3, 4, 0.0), ("q8_0", 3, 0, 30.0), ("q8_0", 1, 4, 0.0), ("q8_g64", 3, 0, 0.0),
    ("q8_g64", 1, 3, 20.0),
])
@pytest.mark.parametrize("lanes,splits", [(1, 1), (128, 1), (1, 4), (128, 4)],
                         ids=["lanes1", "lanes128", "lanes1-split4", "lanes128-split4"])
def test_attention(rt, kv, gqa, window, softcap, lanes, splits):
    """Attention against the reference; 128 lanes: the GPU shapes (keys in tiles, lanes sharing a key's dot
    product, V sums in registers); split-K: 4 runs of keys (some empty in the first steps) and the combine."""
    if lanes > 1 and rt.lanes == 1:
        pytest.skip("GPU-shaped kernels")
    launches = _check_attention(rt, kv, gqa, window, softcap, lanes, 32, {"splits": splits}, (7, 1, 1, 5), 7)
    assert len(launches) == (3 if splits > 1 else 2)  # K/V store, attention, [combine]


@pytest.mark.parametrize("kv,gqa,window,softcap,lanes,heads,splits", [
    ("f16", 3, 0, 0.0, 1, 3, 5), ("q8_0", 1, 10, 30.0, 1, 1, 5), ("q8_g64", 4, 0, 0.0, 1, 2, 5),
    ("f16", 4, 10, 0.0, 128, 4, 5), ("q8_0", 3, 0, 0.0, 128, 3, 5), ("q8_g64", 3, 10, 30.0, 128, 3, 5),
    ("q8_0", 4, 0, 20.0, 128, 4, 1),
])
def test_attention_runs(rt, kv, gqa, window, softcap, lanes, heads, splits):
    """Split-K as flash-decoding has it: 5 runs of the keys visible at run time, each at least 4 long (knob
    min_run), so that the runs holding keys, and their lengths, change with the context; the combine reads only
    those (the partials of the others stay NaN). Contexts with a partial last run, prefill chunks and decode
    steps, GQA with groups taking several query heads of a KV head (knob heads), gemma3's sliding window and
    softcap."""
    if lanes > 1 and rt.lanes == 1:
        pytest.skip("GPU-shaped kernels")
    # Runs of the contexts 1..16 of the first step: 1 of 1 to 4 keys, then of 4 (the last partial); 17, 18: 5 runs
    # of 4, the last 1 or 2 long; 22, 23: 5 runs of 5, the last 2 or 3 long; 36, 37: 5 runs of 8, the last 4 or 5
    # long (a window of 10: 3 runs of 4, the last 2).
    knobs = {"splits": splits, "min_run": 4, "heads": heads}
    launches = _check_attention(rt, kv, gqa, window, softcap, lanes, 40, knobs, (16, 1, 1, 4, 1, 13, 1), 11)
    attn = launches[1].kernel
    assert dict(attn.knobs) == {"two_pass": 1, "splits": splits} | ({"min_run": 4} if splits > 1 else {}) | (
        {"heads": heads} if heads > 1 else {})
    assert attn.grid[1].value == 2 * gqa // heads


def test_attention_splits_grow_with_the_context_in_one_token_steps():
    """splits "auto": on GPUs up to 8 runs, and in one-token plans enough that none holds more than
    DECODE_RUN_KEYS keys at a full context (flash-decoding), each group taking the 4 query heads of a KV head
    beyond LONG_CONTEXT (heads "auto"); on the CPU one group per head."""
    from polystrata.codegen.recipes.attention import DECODE_RUN_KEYS, LONG_CONTEXT, MIN_RUN_KEYS

    g = _attention_graph(32, 8, 128)

    def attn(lanes, t_max, n_ctx):
        ctx = _ctx(g, n_ctx=n_ctx, lanes=lanes)
        ctx.t_max = t_max
        launches = _recipe("attention").lower(g.nodes, ctx)
        return dict(launches[1].kernel.knobs), len(launches)

    n_ctx = 32768 + 64
    runs = {"two_pass": 1, "min_run": MIN_RUN_KEYS}
    assert attn(128, 1, n_ctx) == ({**runs, "splits": -(-n_ctx // DECODE_RUN_KEYS), "heads": 4}, 3)
    assert -(-n_ctx // DECODE_RUN_KEYS) == 257
    assert attn(128, 16, n_ctx) == ({**runs, "splits": 8}, 3)
    assert attn(128, 1, LONG_CONTEXT) == ({**runs, "splits": LONG_CONTEXT // DECODE_RUN_KEYS}, 3)
    assert attn(128, 1, 640) == ({**runs, "splits": 8}, 3)
    assert attn(1, 1, n_ctx) == ({"two_pass": 1, "splits": 1}, 2)


@pytest.mark.parametrize("kv,mode,dims,lanes,qk_norm", [
    ("f16", "normal", 64, 1, False), ("q8_0", "neox", 32, 1, True), ("f16", "neox", 64, 128, True),
    ("q8_0", "normal", 48, 128, False)])
def test_rope_attention(rt, kv, mode, dims, lanes, qk_norm):
    """[per-head RMS norms of q and k,] rope(q), rope(k), attention fused (the K/V store norms and ropes q and K on
    the way) against the reference running the ops one by one: prefill, then decode steps. GPU-shaped: split-K,
    and the combine also writes the output as the output projection's int8 activations, the very codes of the
    quantize launch it provides."""
    if lanes > 1 and rt.lanes == 1:
        pytest.skip("GPU-shaped kernels")
    hkv, d, hq, n_ctx = 2, 64, 6, 32
    g = Graph("t")
    q = g.input("q", "f32", ("T", hq, d))
    k = g.input("k", "f32", ("T", hkv, d))
    v = g.input("v", "f32", ("T", hkv, d))
    pos = g.input("positions", "i32", ("T",))
    rope = dict(base=10000.0, dims=dims, mode=mode, freq_scale=0.5)
    rng = np.random.default_rng(3)
    weights = {}
    if qk_norm:
        weights = {"qn": rng.standard_normal(d).astype(np.float32), "kn": rng.standard_normal(d).astype(np.float32)}
        q = g.op("rms_norm", q, g.weight("qn", "F32", (d,)), eps=1e-6, name="qnorm")
        k = g.op("rms_norm", k, g.weight("kn", "F32", (d,)), eps=1e-6, name="knorm")
    qr = g.op("rope", q, pos, name="qr", **rope)
    kr = g.op("rope", k, pos, name="kr", **rope)
    g.op("attention", qr, kr, v, pos, layer=0, scale=0.125, window=0, softcap=0.0, name="o")
    ctx = _ctx(g, kv=kv, n_ctx=n_ctx, lanes=lanes)
    ctx.knobs = {"attention": {"splits": 4 if lanes > 1 else 1}}
    launches = _recipe("norm_rope_attention" if qk_norm else "rope_attention").lower(g.nodes, ctx)
    assert launches[0].kernel.name.startswith("rope_norm_kv_store" if qk_norm else "rope_kv_store")

    norm_nodes = {n.inputs[1].name: n for n in g.nodes if n.op == "rms_norm"}

    def normed(x, w):  # the reference's per-head RMS norm, where the graph has one
        return R._IMPLS["rms_norm"](None, norm_nodes[w], [x, weights[w]]) if qk_norm else x
    provided = launches[-1].provides
    assert len(provided) == (lanes > 1)
    fmt = Q.KV_FORMATS[kv]
    kvb = n_ctx * Q.row_bytes(fmt, hkv * d)
    ex = R.ReferenceExecutor({}, n_ctx)
    keep = {"kv.0.k": rt.alloc((kvb,), "u8"), "kv.0.v": rt.alloc((kvb,), "u8")}
    n_past = 0
    for t in (6, 1, 1):
        qv, kvv, vv = (rng.standard_normal((t, h, d)).astype(np.float32) for h in (hq, hkv, hkv))
        pv = np.arange(n_past, n_past + t, dtype=np.int32)
        krv = R.apply_rope(normed(kvv, "kn"), pv, dims, 10000.0, 0.5, mode)
        qrv = R.apply_rope(normed(qv, "qn"), pv, dims, 10000.0, 0.5, mode)
        kq = Q.dequantize(fmt, Q.quantize(fmt, krv.reshape(t, -1)), (t, hkv * d)).reshape(kvv.shape)
        vq = Q.dequantize(fmt, Q.quantize(fmt, vv.reshape(t, -1)), (t, hkv * d)).reshape(vv.shape)
        ref = R._IMPLS["attention"](ex, g.nodes[-1], [qrv, kq, vq, pv])
        sb, so = _moe_scratch(ctx)
        out = _run_launches(rt, launches, {"q": qv.reshape(-1), "k": kvv.reshape(-1), "v": vv.reshape(-1),
                                           "positions": pv, **sb, **weights}, {"T": t},
                            {"o": ((t, hq, d), "f32"), "qr": ((t, hq, d), "f32"), **so,
                             **({"scratch.xq": (sb["scratch.xq"].shape, "u32")} if provided else {})}, keep)
        np.testing.assert_allclose(out["qr"], qrv, rtol=1e-4, atol=3e-5)
        np.testing.assert_allclose(out["o"], ref, atol=1e-4 if kv == "f16" else 0.02, rtol=1e-3)
        if provided:
            qouts = {"scratch.xq": ((t * hq * d // 4,), "u32"), "scratch.xd": ((t * hq * d // 32,), "f32")}
            sep = _run_launches(rt, provided, {"o": out["o"].reshape(-1)}, {"T": t}, qouts)
            for name, ((n,), _) in qouts.items():
                np.testing.assert_array_equal(out[name][:n], sep[name])
        n_past += t


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("lanes", [1, 32])
def test_router(rt, norm, lanes):
    """Top-k expert ids and weights; tied logits go to the lowest index (a warp of lanes: the GPU router)."""
    if lanes > 1 and rt.lanes == 1:
        pytest.skip("GPU-shaped kernels")
    e = 40
    g = Graph("t")
    x = g.input("x", "f32", ("T", e))
    g.op("router", x, k=3, norm=norm, name="o")
    launches = _recipe("router").lower(g.nodes, _ctx(g, lanes=lanes))
    assert launches[0].kernel.lanes == lanes
    t = 5
    xv = np.random.default_rng(0).standard_normal((t, e)).astype(np.float32)
    xv[1, [7, 30, 33]] = xv[1].max() + 1.0  # a three-way tie for the top
    xv[2, [3, 4]] = xv[2].max() + 0.5
    out = _run_launches(rt, launches, {"x": xv.reshape(-1)}, {"T": t}, {"o": ((2 * t * 3,), "i32")})["o"]
    ids, w = R._IMPLS["router"](None, g.nodes[0], [xv])
    assert list(ids[1]) == [7, 30, 33] and list(ids[2][:2]) == [3, 4]
    np.testing.assert_array_equal(out[: t * 3].reshape(t, 3), ids)
    np.testing.assert_allclose(out[t * 3:].reshape(t, 3) / 2.0**30, w, atol=1e-6)


def _moe_case(rt, fmt_name, lanes, t_max=16, e=8, dm=256, ff=256, k=2, knobs=None):
    """A router + moe_ffn graph lowered on a context of `lanes` lanes (and moe_ffn `knobs`); returns what a test
    needs to run it."""
    g = Graph("t")
    x = g.input("x", "f32", ("T", dm))
    logits = g.input("logits", "f32", ("T", e))
    route = g.op("router", logits, k=k, norm=True, name="route")
    gw = g.weight("g", fmt_name, (e, ff, dm))
    uw = g.weight("u", fmt_name, (e, ff, dm))
    dw = g.weight("d", fmt_name, (e, dm, ff))
    g.op("moe_ffn", x, route, gw, uw, dw, name="o")
    ctx = _ctx(g, formats={n: Q.FORMATS[fmt_name] for n in "gud"})
    ctx.lanes, ctx.t_max = lanes, t_max
    ctx.knobs = {"moe_ffn": knobs or {}}
    rl = _recipe("router").lower(g.nodes[:1], ctx)
    ml = _recipe("moe_ffn").lower(g.nodes[1:], ctx)
    return g, ctx, rl, ml, *_moe_weights(fmt_name, e, dm, ff)


def _moe_weights(fmt_name, e, dm, ff):
    """Random expert weights "g", "u" [e, ff, dm] and "d" [e, dm, ff]: (raw buffers by name, dequantized)."""
    _, bg, dg = _weight(fmt_name, e * ff, dm, 1)
    _, bu, du = _weight(fmt_name, e * ff, dm, 2)
    _, bd, dd = _weight(fmt_name, e * dm, ff, 3)
    return {"g": bg, "u": bu, "d": bd}, (dg.reshape(e, ff, dm), du.reshape(e, ff, dm), dd.reshape(e, dm, ff))


def _q8(x: np.ndarray) -> np.ndarray:
    """x as the GPU path's int8 activations see it: codes round(x * 127 / max|x|) per 32 values, times the scale."""
    xb = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    amax = np.abs(xb).max(axis=-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127.0) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    v = xb * inv
    codes = np.trunc(v + np.where(v < 0, -0.5, 0.5).astype(np.float32))
    return (codes.astype(np.float64) * (amax.astype(np.float64) / 127.0)).reshape(x.shape)


def _moe_ref(x: np.ndarray, ids: np.ndarray, w: np.ndarray, deq, int8: bool) -> np.ndarray:
    """float64 moe_ffn; `int8`: with x and h rounded as the GPU path does (`_q8`), so only float error remains."""
    g, u, d = (a.astype(np.float64) for a in deq)
    xs = _q8(x) if int8 else x.astype(np.float64)
    y = np.zeros((x.shape[0], d.shape[1]))
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            e = ids[t, s]
            a = g[e] @ xs[t]
            h = a / (1 + np.exp(-a)) * (u[e] @ xs[t])
            h = _q8(h[None])[0] if int8 else h
            y[t] += float(w[t, s]) * (d[e] @ h)
    return y


def _moe_scratch(ctx):
    """Scratch buffers of the plan (MoE lists, split-K partials), poisoned: NaN (f32, through `outs`), garbage
    (i32, uploaded)."""
    bufs, outs = {}, {}
    for name, (dt, count) in ctx.scratch_buffers.items():
        if dt == "f32":
            outs[name] = ((count,), dt)
        else:
            bufs[name] = np.full(count, 0x3C3C3C3C, np.int32)
    return bufs, outs


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
            sb, so = _moe_scratch(ctx)
            out = _run_launches(rt, rl + ml, {"x": xv.reshape(-1), "logits": lv.reshape(-1), **weights, **sb},
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
            ctx = _ctx(g, formats={n: Q.FORMATS[fmt_name] for n in "gud"})
            ctx.lanes, ctx.t_max = lanes, t_max
            launches = _recipe("router_moe_add_rms_norm").lower(g.nodes, ctx)
            names = [la.kernel.name for la in launches]
            assert not any(n.startswith("moe_combine") for n in names) and "_moe2" in names[-1], names
            xv, resv = (rng.standard_normal((t, dm)).astype(np.float32) for _ in range(2))
            lv = rng.standard_normal((t, e)).astype(np.float32)
            sb, so = _moe_scratch(ctx)
            got = _run_launches(rt, launches, {"x": xv.reshape(-1), "res": resv.reshape(-1), "nw": nwv,
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
            ids = np.stack([rng.permutation(e)[:k] for _ in range(t)]).astype(np.int32)
            if skew:
                ids[:, 0] = 3
                ids[:, 1] = np.where(ids[:, 1] == 3, 5, ids[:, 1])
            w = rng.uniform(0.05, 1.0, (t, k)).astype(np.float32)
            q30 = np.round(w.astype(np.float64) * 2.0**30).astype(np.int32)
            route = np.concatenate([ids.reshape(-1), q30.reshape(-1)])
            sb, so = _moe_scratch(ctx)
            out = _run_launches(rt, ml, {"x": xv.reshape(-1), "route": route, **weights, **sb}, {"T": t},
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
        launches = _recipe("router_moe").lower(g.nodes, ctx)
        names = [la.kernel.name for la in launches]
        assert names[0].endswith("_lists") and not any(n.startswith("moe_group") for n in names)
        rng = np.random.default_rng(7)
        for _ in range(3):
            xv = rng.standard_normal((1, dm)).astype(np.float32)
            lv = rng.standard_normal((1, e)).astype(np.float32)
            sb, so = _moe_scratch(ctx)
            out = _run_launches(rt, launches, {"x": xv.reshape(-1), "logits": lv.reshape(-1), **weights, **sb},
                                {"T": 1}, {"o": ((1, dm), "f32"), "route": ((2 * k,), "i32"), **so})["o"]
            ids, w = R._IMPLS["router"](None, g.nodes[0], [lv])
            int8 = any(n.startswith("quantize_x") for n in names)
            ref = _moe_ref(xv, ids, w, deq, int8)
            np.testing.assert_allclose(out, ref, rtol=1e-3, atol=1e-4 * np.abs(ref).max())

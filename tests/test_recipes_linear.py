"""Recipe conformance, codegen/recipes/linear.py: matmul in every format and schedule, embed, the GPU int8 matvec,
stacked matvecs and fused GLU matvecs, on every target under test, against the numpy reference.

Tolerances: rtol/atol ~1e-4 for f32 paths; the int8-activation matvec path is bounded by the activation rounding:
|err| <= sum_k |w_k| * max|x_blk| / 254 per output.
"""

from __future__ import annotations

import numpy as np
import pytest
from recipe_cases import (
    FORMAT_NAMES,
    SLICED,
    gpu_shaped,
    int8_bound,
    q8_rounded,
    recipe,
    recipe_context,
    run,
    run_launches,
    target_runtimes,
    weight,
    weight_format,
)

from polystrata.codegen.recipes._matvec import use_int8
from polystrata.codegen.recipes.linear import embed_kernel, matmul_kernel, matvec_q8_kernel, quantize_x_kernel
from polystrata.ir.formats import FORMATS
from polystrata.ir.graph import Graph
from polystrata.ir.kernel import Launch
from polystrata.runtimes import reference as R
from polystrata.runtimes.base import eval_int

rt = target_runtimes()


# --- matmul: every format, odd row counts, several T on one compiled kernel ---------------------------------


@pytest.mark.parametrize("fmt_name", [*FORMAT_NAMES, *SLICED])
def test_matmul_formats(rt, fmt_name):
    n, k = 37, 256
    fmt, wb, wd = weight(fmt_name, n, k)
    kern = matmul_kernel(f"t_mm_{fmt_name.lower()}", [fmt], n, k, rows=4, tokens=4, int8=True, split="rows",
                         lanes=rt.lanes)
    int8 = dict(kern.knobs)["int8"]
    rng = np.random.default_rng(1)
    for t in (1, 2, 7, 33):
        x = rng.standard_normal((t, k)).astype(np.float32)
        y = run(rt, kern, {"x": x.reshape(-1), "w0": wb}, {"T": t}, {"y": ((t, n), "f32")})["y"]
        ref = x @ wd.T
        if int8:
            assert np.all(np.abs(y - ref) <= int8_bound(x, wd)), fmt_name
        else:
            np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt_name,split,int8,rows", [("Q4_K", "blocks", True, 2), ("Q5_1", "blocks", False, 1),
                                                      ("F16", "blocks", False, 2), ("F32", "blocks", False, 1),
                                                      ("Q6_K", "rows", False, 5)])
def test_matmul_schedules(rt, fmt_name, split, int8, rows):
    n, k = 3, 512
    fmt, wb, wd = weight(fmt_name, n, k, 2)
    kern = matmul_kernel(f"t_mms_{fmt_name.lower()}_{split}_{int(int8)}_{rows}", [fmt], n, k, rows=rows, tokens=3,
                         int8=int8, split=split, lanes=rt.lanes)
    rng = np.random.default_rng(3)
    for t in (1, 7):
        x = rng.standard_normal((t, k)).astype(np.float32)
        y = run(rt, kern, {"x": x.reshape(-1), "w0": wb}, {"T": t}, {"y": ((t, n), "f32")})["y"]
        ref = x @ wd.T
        if dict(kern.knobs)["int8"]:
            assert np.all(np.abs(y - ref) <= int8_bound(x, wd))
        else:
            np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt_name", [*FORMAT_NAMES, *SLICED])
def test_embed(rt, fmt_name):
    """Rows of every format decoded whole (NAME_S: sliced rows, each byte's address computed at run time)."""
    vocab, cols = 7, 512
    fmt, wb, wd = weight(fmt_name, vocab, cols, 4)
    kern = embed_kernel(f"t_embed_{fmt_name.lower()}", fmt, cols, 3, rt.lanes)
    tok = np.array([3, 0, 6, 3, 1], np.int32)
    y = run(rt, kern, {"w": wb, "tokens": tok}, {"T": len(tok)}, {"y": ((len(tok), cols), "f32")})["y"]
    np.testing.assert_array_equal(y, wd[tok])


@pytest.mark.parametrize("fmt_name", [f for f in FORMAT_NAMES if use_int8(FORMATS[f], True)] + ["Q6_K_A16", *SLICED])
def test_matvec_q8_formats(rt, fmt_name):
    """The GPU matvec (quantize kernel + one row per group, `sub` lanes per block, interleaved words or runs) on every
    int8-path format, against a float64 product with x rounded as the quantize kernel rounds it: only float error
    may remain (NAME_S: sliced rows, runs of words folded to slice addresses, interleaved words at addresses
    computed at run time). One-lane targets (which take matmul_kernel in plans) run Q8_0's first schedules: a
    K-quant's unrolled GPU matvec takes Numba minutes to compile."""
    gpu_shaped(rt, 32, sampled=fmt_name == "Q8_0")
    n, k = 37, 512
    fmt, wb, wd = weight(fmt_name, n, k)
    rng = np.random.default_rng(4)
    # runs: each lane consecutive words; rows: rows a group (37 is odd: the last group's extra rows are clamped);
    # spread: the lanes spread over the rows rather than each sweeping all of them
    schedules = (("auto", 0, 1, 0), ("auto", 1, 1, 0), (1, 0, 1, 0), (2, 1, 1, 0), ("auto", 1, 2, 0), ("auto", 0, 3, 0),
                 ("auto", 1, 4, 1), ("auto", 0, 3, 1), (1, 1, 16, 1))
    for sub, runs, rows, spread in schedules if rt.lanes > 1 else schedules[:2]:
        qk = quantize_x_kernel(f"t_q8x_{k}", k)
        mk = matvec_q8_kernel(f"t_mv8_{fmt_name.lower()}_{sub}_{runs}_{rows}_{spread}", [fmt], n, k, tokens=4,
                              lanes=32, sub=sub, runs=runs, rows=rows, spread=bool(spread))
        launches = [Launch(qk, (("x", "x"), ("xq", "xq"), ("xd", "xd")), (("T", "T"),)),
                    Launch(mk, (("xq", "xq"), ("xd", "xd"), ("w0", "w"), ("y", "y")), (("T", "T"),))]
        for t in (1, 3, 9):
            x = rng.standard_normal((t, k)).astype(np.float32)
            scratch = {"xq": np.full(t * k // 4, 0x3C3C3C3C, np.uint32)}
            y = run_launches(rt, launches, {"x": x.reshape(-1), "w": wb, **scratch}, {"T": t},
                              {"y": ((t, n), "f32"), "xd": ((t * k // 32,), "f32")})["y"]
            xq = q8_rounded(x)
            ref = xq @ wd.T.astype(np.float64)
            bound = 1e-4 * (np.abs(xq) @ np.abs(wd.T)) + 1e-5
            assert np.all(np.abs(y - ref) <= bound), (fmt_name, sub, runs, rows, spread, t,
                                                      float(np.max(np.abs(y - ref) - bound)))


@pytest.mark.parametrize("fmt_name,rows", [("Q4_K", 2), ("Q6_K", 1), ("Q8_0", 3)])
def test_matvec_token_tile_swept_once(rt, fmt_name, rows):
    """Knob reuse: the token tile's weights swept once for all its tokens (unrolled, partial tiles clamped and
    guarded) gives exactly what sweeping them again for each token gives, for T below, at and past the tile, odd
    row counts, two weights (a GLU's epilogue). Not on one-lane targets: the unrolled tile is minutes of Numba
    compile there, and their plans take `tile_matmul_kernel` instead."""
    gpu_shaped(rt, 32, sampled=False)
    n, k, tokens = 13, 512, 4
    fmt, bg, dg = weight(fmt_name, n, k, 1)
    _, bu, du = weight(fmt_name, n, k, 2)
    qk = Launch(quantize_x_kernel(f"t_q8x_{k}", k), (("x", "x"), ("xq", "xq"), ("xd", "xd")), (("T", "T"),))
    kernels = [matvec_q8_kernel(f"t_mv8_tile_{fmt_name.lower()}_{rows}_{int(reuse)}", [fmt, fmt], n, k, tokens=tokens,
                                lanes=32, rows=rows, reuse=reuse, epilogue=lambda v: v[0] * v[1])
               for reuse in (False, True)]
    assert [dict(mk.knobs)["reuse"] for mk in kernels] == [0, 1]
    for t in (1, 3, 4, 9):
        x = np.random.default_rng(t).standard_normal((t, k)).astype(np.float32)
        ys = [run_launches(rt, [qk, Launch(mk, (("xq", "xq"), ("xd", "xd"), ("w0", "wg"), ("w1", "wu"), ("y", "y")),
                                           (("T", "T"),))],
                           {"x": x.reshape(-1), "wg": bg, "wu": bu, "xq": np.zeros(t * k // 4, np.uint32)}, {"T": t},
                           {"y": ((t, n), "f32"), "xd": ((t * k // 32,), "f32")})["y"] for mk in kernels]
        np.testing.assert_array_equal(ys[1], ys[0], err_msg=f"{fmt_name} rows {rows} T {t}")
        xq = q8_rounded(x)
        ref = (xq @ dg.T.astype(np.float64)) * (xq @ du.T.astype(np.float64))
        np.testing.assert_allclose(ys[1], ref, rtol=1e-3, atol=1e-3 * np.abs(ref).max())


def test_matvec_rows_share_activation_loads(rt):
    """Gate and up (same format) over two rows a group: one Reduce serves all four dot products, and the fused
    product matches the reference."""
    gpu_shaped(rt, 32, sampled=False)
    from polystrata.ir.kernel import Reduce, walk

    n, k = 13, 512
    fmt, bg, dg = weight("Q4_K", n, k, 1)
    _, bu, du = weight("Q4_K", n, k, 2)
    mk = matvec_q8_kernel("t_mv8_rows2", [fmt, fmt], n, k, tokens=4, lanes=32, rows=2, epilogue=lambda v: v[0] * v[1])
    reds = [s for s in walk(mk.body) if isinstance(s, Reduce)]
    assert len(reds) == 1 and len(reds[0].results) == 4
    launches = [Launch(quantize_x_kernel(f"t_q8x_{k}", k), (("x", "x"), ("xq", "xq"), ("xd", "xd")), (("T", "T"),)),
                Launch(mk, (("xq", "xq"), ("xd", "xd"), ("w0", "wg"), ("w1", "wu"), ("y", "y")), (("T", "T"),))]
    for t in (1, 5):
        x = np.random.default_rng(t).standard_normal((t, k)).astype(np.float32)
        y = run_launches(rt, launches, {"x": x.reshape(-1), "wg": bg, "wu": bu,
                                         "xq": np.zeros(t * k // 4, np.uint32)}, {"T": t},
                          {"y": ((t, n), "f32"), "xd": ((t * k // 32,), "f32")})["y"]
        xq = q8_rounded(x)
        ref = (xq @ dg.T.astype(np.float64)) * (xq @ du.T.astype(np.float64))
        np.testing.assert_allclose(y, ref, rtol=1e-3, atol=1e-3 * np.abs(ref).max())


@pytest.mark.parametrize("count", [3, 4])
def test_stacked_matvecs(rt, count):
    """q, k and v of one input (and a fourth, as Gated DeltaNet's qkv, z, beta and alpha) as one stacked launch
    (GPU path): each weight's rows, in its own format, land in its own output, within the int8 rounding of the
    activations."""
    gpu_shaped(rt, 32, sampled=False)
    g = Graph("t")
    k = 256
    x = g.input("x", "f32", ("T", k))
    shapes = dict(list({"wq": ("Q4_K", 19), "wk": ("Q6_K", 7), "wv": ("Q8_0", 5), "wa": ("Q4_0", 3)}.items())[:count])
    for name, (fmt_name, n) in shapes.items():
        g.op("matmul", x, g.weight(name, fmt_name, (n, k)), name=f"y{name}")
    weights = {nm: weight(f, n, k, seed) for seed, (nm, (f, n)) in enumerate(shapes.items())}
    # reuse: the token tile swept once, partial tiles (with three weights; tiles of 2 tokens, since PoCL took 110 s
    # to compile the stacked kernel sweeping the default 8 once, 10 s for 2)
    for reuse, t in ((0, 1), (0, 5), (1, 5), (1, 9)) if count == 3 else ((0, 1), (0, 5)):
        ctx = recipe_context(g, formats={nm: FORMATS[f] for nm, (f, _) in shapes.items()}, lanes=32)
        # 19, 7 and 5 rows: each weight's last group has one
        ctx.knobs = {"matmul": {"rows": 2, "reuse": reuse, **({"tokens": 2} if reuse else {})}}
        launches = recipe(f"matmul_stack{count}").lower(g.nodes, ctx)
        assert [la.kernel.name.startswith("matmul_stack") for la in launches] == [False, True]
        assert dict(launches[1].kernel.knobs)["reuse"] == reuse
        xv = np.random.default_rng(t).standard_normal((t, k)).astype(np.float32)
        outs = {f"y{nm}": ((t, n), "f32") for nm, (_, n) in shapes.items()}
        outs |= {"scratch.xq": ((16 * k // 4,), "u32"), "scratch.xd": ((16 * k // 32,), "f32")}
        y = run_launches(rt, launches, {"x": xv.reshape(-1), **{nm: w[1] for nm, w in weights.items()}}, {"T": t},
                          outs)
        for nm, (_, _, wd) in weights.items():
            assert np.all(np.abs(y[f"y{nm}"] - xv @ wd.T) <= int8_bound(xv, wd)), (nm, t)


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
    kern = matvec_q8_kernel("t_runs", [weight_format(fmt_name, k)], n, k, tokens=1, lanes=32, runs=1, sub=sub,
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
        ctx = recipe_context(g, formats={"wg": FORMATS[fmt_name], "wu": FORMATS[fmt_name]})
        launches = recipe(f"matmul_{act}").lower(g.nodes, ctx)
        _, bg, dg = weight(fmt_name, 19, 256, 5)
        _, bu, du = weight(fmt_name, 19, 256, 6)
        for t in (1, 7):
            xv = np.random.default_rng(t).standard_normal((t, 256)).astype(np.float32)
            y = run_launches(rt, launches, {"x": xv.reshape(-1), "wg": bg, "wu": bu}, {"T": t},
                              {"o": ((t, 19), "f32")})["o"]
            ga, ua = xv @ dg.T, xv @ du.T
            ref = (R.silu(ga) if act == "swiglu" else R.gelu_tanh(ga)) * ua
            tol = 0.02 * np.abs(ref).max() if fmt_name != "F32" else 1e-4
            np.testing.assert_allclose(y, ref, atol=tol, rtol=1e-3)


@pytest.mark.parametrize("fmt_name", ["F16", "F32"])
def test_rows_of_part_of_a_block_are_refused(fmt_name):
    """The matmul kernels walk whole blocks (F16 and F32 in blocks of 32): rows of 40 values would leave 8 out, so
    they are refused with one line instead of computed wrong."""
    from polystrata.errors import UnsupportedError

    g = Graph("t")
    g.op("matmul", g.input("x", "f32", ("T", 40)), g.weight("w", fmt_name, (3, 40)), name="y")
    with pytest.raises(UnsupportedError, match="rows of 40 .* not whole blocks of 32"):
        recipe("matmul").lower(g.nodes, recipe_context(g, formats={"w": FORMATS[fmt_name]}))

"""Recipe conformance, codegen/recipes/tile_matmul.py: the one-lane matmul decoding each weight block once for a
tile of tokens, against the numpy reference and, bit for bit, against `matmul_kernel`'s f32 path token by token;
its int8 form (`tile_matmul_q8_kernel`) and the CPU intrinsics it rests on."""

from __future__ import annotations

import numpy as np
import pytest
from recipe_cases import int8_bound, recipe, recipe_context, run, target_runtimes, weight

from polystrata.codegen.cpu_intrinsics import chunked_byte
from polystrata.codegen.format_analysis import level_range
from polystrata.codegen.recipes._matvec import fmt_for
from polystrata.codegen.recipes.linear import gelu_tanh, matmul_kernel, quantize_x_kernel
from polystrata.codegen.recipes.tile_matmul import (
    q8_level_bias,
    q8_tile_fits,
    tile_matmul_kernel,
    tile_matmul_q8_kernel,
)
from polystrata.ir.formats import FORMATS
from polystrata.ir.graph import Graph
from polystrata.runtimes import reference as R

rt = target_runtimes()


@pytest.mark.parametrize("fmt_name", ["F16", "Q4_K", "Q6_K"])
def test_tile_matmul_formats(rt, fmt_name):
    """37 rows (groups of 4, the last partial), tiles of 4 tokens (7: the second partial): the reference's
    products within float rounding, and each token's row exactly what a one-token matmul gives."""
    n, k = 37, 256
    fmt, wb, wd = weight(fmt_name, n, k)
    kern = tile_matmul_kernel(f"t_tile_{fmt_name.lower()}", [fmt], n, k, rows=4, tokens=4)
    one = matmul_kernel(f"t_tile_one_{fmt_name.lower()}", [fmt], n, k, rows=4, tokens=1, int8=False, split="rows",
                        lanes=1)
    x = np.random.default_rng(1).standard_normal((7, k)).astype(np.float32)
    y = run(rt, kern, {"x": x.reshape(-1), "w0": wb}, {"T": 7}, {"y": ((7, n), "f32")})["y"]
    np.testing.assert_allclose(y, x @ wd.T, rtol=1e-4, atol=1e-4)
    for t in range(7):
        alone = run(rt, one, {"x": x[t], "w0": wb}, {"T": 1}, {"y": ((1, n), "f32")})["y"]
        np.testing.assert_array_equal(y[t], alone[0])


def test_cpu_plans_of_several_tokens_take_it():
    """One-lane plans of more than one token take the tile matmul (knob tile_q8 off, as on hosts without VNNI),
    with the fused gate, up and activation as its epilogue; one-token plans and GPU-shaped ones do not."""
    g = Graph("t")
    x = g.input("x", "f32", ("T", 256))
    wg, wu = g.weight("wg", "Q4_1", (19, 256)), g.weight("wu", "Q4_1", (19, 256))
    g.op("swiglu", g.op("matmul", x, wg, name="a"), g.op("matmul", x, wu, name="b"), name="o")

    def kernel(lanes: int, t_max: int) -> str:
        ctx = recipe_context(g, formats={"wg": FORMATS["Q4_1"], "wu": FORMATS["Q4_1"]}, lanes=lanes)
        ctx.t_max = t_max
        ctx.knobs = {"matmul": {"tile_q8": 0}}
        return recipe("matmul_swiglu").lower(g.nodes, ctx)[-1].kernel.name

    assert kernel(1, 16) == "glu_swiglu_q4_1_q4_1_19x256_tile"
    assert kernel(1, 1) == "glu_swiglu_q4_1_q4_1_19x256"
    assert not kernel(128, 16).endswith("_tile")


# Formats of `tile_matmul_q8_kernel`, several to a kernel (a kernel a format would cost a compile each): blocks of
# 32 (offsets, signed levels, a table); the K-quants of the zoo models (groups of 32 with offsets, groups of 16 with
# signed levels); slow, Q2_K (groups of 16 with offsets): 256-value blocks make long kernels, ~5 s of Numba compile
# a format, so Q3_K, Q5_K and IQ4_XS (levels as Q6_K's, Q5_1's, IQ4_NL's; checked by hand, docs/benchmarks.md) are
# not run here.
# Rows of 320 (two steps after a chunk of `dot_i8_pair`'s layout) and of 256 (a chunk; two in its own test).
Q8_FORMATS = (pytest.param(["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL"], 320, id="blocks32"),
              pytest.param(["Q4_K", "Q6_K"], 256, id="q4k_q6k"),
              pytest.param(["Q2_K"], 256, id="q2k", marks=pytest.mark.slow))


def plain_order(k: int) -> np.ndarray:
    """Where each byte of a row of k lies in `dot_i8_pair`'s chunked layout."""
    return np.array([chunked_byte(e, k) for e in range(k)])


@pytest.mark.parametrize(("fmt_names", "k"), Q8_FORMATS)
def test_tile_matmul_q8_formats(rt, fmt_names, k):
    """The int8 tile matmul over weights of every format it takes at once (its epilogue: GELU of their dot products'
    sum, the CPU's tanh in its loop over a tile's results): 37 rows (groups of 4, the last partial), tiles of 16
    tokens (two a `dot_i8_pair`), steps of 1, 7 and 33 tokens (odd: a token computed twice; 33: the last tile
    partial), after `quantize_x_kernel` with sums. The
    products are those of the int8 activations' values with the weights' (numpy in float64 on the codes the
    quantize kernel wrote), within float rounding."""
    if rt.name != "cpu":
        pytest.skip("dot_i8_pair is the CPU target's (Numba)")
    n = 37
    assert all(q8_tile_fits([FORMATS[f]], k) for f in fmt_names)
    ws = [weight(f, n, k, seed=j) for j, f in enumerate(fmt_names)]
    kern = tile_matmul_q8_kernel(f"t_tq8_{len(fmt_names)}_{fmt_names[0].lower()}", [w[0] for w in ws], n, k, rows=4,
                                 tokens=16, epilogue=lambda v: gelu_tanh(sum(v[1:], v[0])))
    quant = quantize_x_kernel(f"t_quantize_xs_{k}", k, sums=True)
    wsum = sum(w[2].astype(np.float64) for w in ws)
    x = np.random.default_rng(1).standard_normal((33, k)).astype(np.float32)
    for t in (1, 7, 33):
        q = run(rt, quant, {"x": x[:t].reshape(-1)}, {"T": t},
                {"xq": ((t * k // 4,), "u32"), "xd": ((t * k // 32,), "f32"), "xs": ((t * k // 16,), "f32")})
        np.testing.assert_allclose(q["xd"], np.abs(x[:t]).reshape(-1, 32).max(axis=1) / 127, rtol=1e-6)
        codes = q["xq"].view(np.int8).reshape(t, k)[:, plain_order(k)].astype(np.float64)
        xhat = codes * np.repeat(q["xd"].reshape(t, -1), 32, axis=1)
        np.testing.assert_allclose(q["xs"], xhat.reshape(-1, 16).sum(axis=1), rtol=1e-5, atol=1e-5)
        y = run(rt, kern, {**q, **{f"w{j}": w[1] for j, w in enumerate(ws)}}, {"T": t}, {"y": ((t, n), "f32")})["y"]
        want = R.gelu_tanh(xhat @ wsum.T)
        np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
        # GELU's slope is below 1.13
        np.testing.assert_allclose(y, R.gelu_tanh(x[:t] @ wsum.T),
                                   atol=1.13 * sum(int8_bound(x[:t], w[2]) for w in ws).max())


def test_q8_tile_level_ranges():
    """`level_range`, which gives `tile_matmul_q8_kernel` its level biases, bounds each format's levels exactly;
    float formats have none and stay on the f32 tiles."""
    want = {"Q4_0": (-8, 7), "Q4_1": (0, 15), "Q5_0": (-16, 15), "Q8_0": (-128, 127), "Q2_K": (0, 3),
            "Q3_K": (-4, 3), "Q6_K": (-32, 31), "IQ4_NL": (-127, 113)}
    for name, r in want.items():
        assert level_range(fmt_for(FORMATS[name])) == r
        assert q8_level_bias(FORMATS[name]) == max(0, -r[0])
    assert not q8_tile_fits([FORMATS["F16"]], 256) and not q8_tile_fits([FORMATS["Q4_K"]], 48)


@pytest.mark.parametrize("vnni", [False, True], ids=["portable", "vnni"])
def test_dot_i8_pair_forms(monkeypatch, vnni):
    """`dot_i8_pair` and `dot_f32` against numpy: 19 steps (two chunks and three steps after them), unaligned
    offsets, groups of 16 and 32, the two tokens' codes and scales apart, the second's result written to its
    array; the portable LLVM form on any host, the VNNI one where the host has it."""
    from numba import njit

    from polystrata.codegen import cpu_intrinsics
    from polystrata.codegen.policy import HOST_VNNI

    if vnni and not HOST_VNNI:
        pytest.skip("this host has no VNNI")
    monkeypatch.setattr(cpu_intrinsics, "HOST_VNNI", vnni)  # read at compile time; cache=False: compiled here
    dot, dotf = cpu_intrinsics.dot_i8_pair, cpu_intrinsics.dot_f32

    @njit(cache=False)
    def both(out, w, x, sw16, sw32, sx, steps, a, b, n):
        first16 = dot(out, 1, w, 3, x, 5, 5 + 32 * steps + 2, sw16, 1, sx, 2, 2 + steps + 1, steps, 16)
        first32 = dot(out, 2, w, 3, x, 5, 5 + 32 * steps + 2, sw32, 1, sx, 2, 2 + steps + 1, steps, 32)
        return first16, first32, dotf(a, 1, b, 2, n)

    rng = np.random.default_rng(0)
    steps, n, full = 19, 21, 16
    k = 32 * steps
    at = plain_order(k)
    wp = rng.integers(0, 256, k).astype(np.uint8)
    xp = rng.integers(-127, 128, (2, k)).astype(np.int8)
    w = np.zeros(3 + k, np.uint8)
    w[3 + at] = wp
    x = np.zeros(5 + 2 * k + 2 + 3, np.int8)  # token 1's codes 2 bytes after token 0's
    x[5 + at], x[5 + k + 2 + at] = xp
    s16, s32 = rng.random(2 * steps).astype(np.float32), rng.random(steps).astype(np.float32)
    sw16 = np.zeros(1 + 2 * steps, np.float32)  # a chunk's first halves' scales, then its second halves'
    for gi in range(2 * steps):
        st = gi // 2
        sw16[1 + (st // 8 * 16 + gi % 2 * 8 + st % 8 if st < full else gi)] = s16[gi]
    sxp = rng.random((2, steps)).astype(np.float32)
    sx = np.concatenate([[0, 0], sxp[0], [0], sxp[1]]).astype(np.float32)
    a, b = rng.standard_normal(1 + n).astype(np.float32), rng.standard_normal(2 + n).astype(np.float32)
    out = np.zeros(3, np.float32)
    words = np.frombuffer(x.tobytes() + bytes(-x.size % 4), np.uint32)
    got = both(out, w, words, sw16, np.concatenate([[0], s32]).astype(np.float32), sx, steps, a, b, n)
    e = np.arange(k)
    for t in range(2):
        prod = wp.astype(np.float64) * xp[t] * sxp[t][e // 32]
        want16, want32 = np.sum(s16[e // 16] * prod), np.sum(s32[e // 32] * prod)
        assert (got[0] if t == 0 else out[1]) == pytest.approx(want16, rel=1e-5)
        assert (got[1] if t == 0 else out[2]) == pytest.approx(want32, rel=1e-5)
    assert got[2] == pytest.approx(np.dot(a[1:].astype(np.float64), b[2:]), rel=1e-5)


def test_cpu_prefill_takes_int8_tiles():
    """One-lane plans of steps of more than TILES_ABOVE tokens take the int8 tile matmul (a quantize launch with
    sums, then `_tq8`) where knob tile_q8 is on and the format allows, for those steps only: shorter steps (batched
    decoding) keep the f32 tiles, the row count picking at run time (a grid of no groups); off, for F16 weights, or
    in plans of short steps, the f32 tile matmul alone. No C-family target renders the intrinsics."""
    from polystrata.codegen import opencl
    from polystrata.codegen.recipes.attention_tiles import TILES_ABOVE
    from polystrata.ir.kernel import KernelError
    from polystrata.runtimes.base import eval_int

    def launches(fmt: str, tile_q8: int, t_max: int = 256) -> list:
        g = Graph("t")
        x = g.input("x", "f32", ("T", 256))
        g.op("matmul", x, g.weight("w", fmt, (19, 256)), name="y")
        ctx = recipe_context(g, formats={"w": FORMATS[fmt]})
        ctx.knobs, ctx.t_max = {"matmul": {"tile_q8": tile_q8}}, t_max
        return recipe("matmul").lower(g.nodes, ctx)

    above = TILES_ABOVE
    got = launches("Q4_K", 64)
    assert [la.kernel.name for la in got] == [f"quantize_xs_256_gt{above}", f"matmul_q4_k_19x256_tq8_gt{above}",
                                              f"matmul_q4_k_19x256_tile_le{above}"]
    for t, works in ((1, (0, 0, 1)), (above, (0, 0, 1)), (above + 1, (1, 1, 0)), (256, (1, 1, 0))):
        assert tuple(int(min(eval_int(d, {"T": t}) for d in la.kernel.grid) > 0) for la in got) == works, t
    assert [la.kernel.name for la in launches("Q4_K", 0)] == ["matmul_q4_k_19x256_tile"]
    assert [la.kernel.name for la in launches("F16", 64)] == ["matmul_f16_19x256_tile"]
    assert [la.kernel.name for la in launches("Q4_K", 64, t_max=above)] == ["matmul_q4_k_19x256_tile"]
    kern = tile_matmul_q8_kernel("t_tq8_c", [FORMATS["Q8_0"]], 8, 64, rows=4, tokens=4)
    with pytest.raises(KernelError, match="dot_i8_pair has no C-family form"):
        opencl.render(kern)

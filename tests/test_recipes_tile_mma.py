"""Recipe conformance, codegen/recipes/tile_mma.py: the prefill matmul on tile products, on every target under test
(the portable rendering of the tile products; matrix units only on GPUs), against the numpy reference on the GPU
path's int8 activations (`q8_rounded`): float rounding is all that may differ.

Formats are sampled: Q4_K (blocks of 256 with offsets, a K chunk a quarter of a block; operands staged by words
from sliced rows and by bytes), Q6_K (groups of 16, a chunk a whole block, blocks padded), Q3_K (half a block) and
Q5_0 (by bytes: its levels do not pack into words), one kernel each for T in {1, 7, 33, 512}, and in the fused GLU
Q8_0 and Q4_0 (blocks of 32, two a chunk). Every other int8-path format goes through the same decoder walk (a
format is data); all 13 matched the reference on PoCL when this recipe was written, but each costs seconds of PoCL
compile, so CI samples.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from recipe_cases import (
    plan_scratch,
    q8_rounded,
    recipe,
    recipe_context,
    run,
    run_launches,
    target_runtimes,
    weight,
)

from polystrata.codegen.recipes.linear import quantize_x_kernel
from polystrata.codegen.recipes.tile_mma import split_sum_kernel, tile_mma_fits, tile_mma_kernel, tile_products_apply
from polystrata.ir.formats import FORMATS
from polystrata.ir.graph import Graph
from polystrata.runtimes.base import eval_int

rt = target_runtimes()
N, K = 40, 256  # rows: a full and a partial tile of 32


def _quantized(rt, x: np.ndarray) -> dict:
    t = x.shape[0]
    qk = quantize_x_kernel(f"quantize_x_{K}", K)
    return run(rt, qk, {"x": x.reshape(-1)}, {"T": t}, {"xq": ((t * K // 4,), "u32"), "xd": ((t * K // 32,), "f32")})


@pytest.mark.parametrize("fmt_name,chunk,words,unroll", [
    ("Q4_K_S", 64, True, False), ("Q6_K_A16", 256, True, False), ("Q3_K", 128, True, False),
    ("Q4_K", 64, False, False), ("Q5_0", 64, True, False), ("Q4_K_S", 128, True, True)])
def test_tile_mma_formats(rt, fmt_name, chunk, words, unroll):
    """Operands staged a word at a time (knob mma_words; Q4_K sliced and Q6_K padded as the cuda target keeps them,
    Q6_K's and Q3_K's levels biased, the bytes made signed in the word) and a byte at a time (the knob off, and
    Q5_0, whose levels do not pack into words); the loop over a chunk's weight groups written out (knob
    mma_unroll)."""
    if rt.lanes == 1:
        pytest.skip("GPU-shaped, never planned on one lane: a Numba compile of 12 s (the tile constructs themselves "
                    "run there in ir_constructs' cases)")
    fmt, wb, wd = weight(fmt_name, N, K)
    kern = tile_mma_kernel(f"t_mma_{fmt_name.lower()}_{int(words)}{'_u' * unroll}", [fmt], N, K, rows=32, tokens=16,
                           chunk=chunk, lanes=64, words=words, unroll=unroll)
    assert kern.knob_dict["mma_words"] == (words and fmt_name != "Q5_0")
    assert kern.knob_dict.get("mma_unroll", 0) == unroll
    rng = np.random.default_rng(1)
    for t in (1, 7, 33, 512):
        x = rng.standard_normal((t, K)).astype(np.float32)
        y = run(rt, kern, {**_quantized(rt, x), "w0": wb}, {"T": t}, {"y": ((t, N), "f32")})["y"]
        ref = q8_rounded(x) @ wd.T
        np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max(), err_msg=f"{fmt_name} T={t}")


def u8f16_reference(x: np.ndarray, wd: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the u8f16 products' reference: activations and weights rounded to f16, summed exactly; a bound of what the
    weights' f16 scale and offset may add: a relative 2^-10 of each weight, 2^-9 with the offset's own)."""
    x16, w16 = x.astype(np.float16).astype(np.float64), wd.astype(np.float16).astype(np.float64)
    return x16 @ w16.T, np.abs(x16) @ np.abs(w16).T * 2.0 ** -9 + 1e-6


@pytest.mark.parametrize("fmt_name,chunk,split", [("Q4_K_S", 64, 1), ("Q6_K_A16", 256, 1), ("Q8_0", 64, 1),
                                                  ("Q4_0", 128, 1), ("Q3_K", 128, 2)])
def test_tile_mma_u8f16(rt, fmt_name, chunk, split):
    """The u8f16 products (knob mma_f16): levels staged as unsigned bytes (Q4_K's offsets, Q6_K's and Q4_0's
    biases folded into the f16 offset, Q8_0's signed bytes flipped), the f32 activations rounded to f16 in the
    kernel; with K split (Q3_K), the parts added up."""
    if rt.lanes == 1:
        pytest.skip("GPU-shaped, never planned on one lane")
    fmt, wb, wd = weight(fmt_name, N, K)
    kern = tile_mma_kernel(f"t_u8f16_{fmt_name.lower()}_{split}", [fmt], N, K, rows=32, tokens=16, chunk=chunk,
                           lanes=64, split=split, u8f16=True)
    assert kern.knob_dict["mma_f16"] == 1 and "xq" not in {p.name for p in kern.params}
    rng = np.random.default_rng(5)
    for t in (1, 7, 33, 512):
        x = rng.standard_normal((t, K)).astype(np.float32)
        out = "yp" if split > 1 else "y"
        y = run(rt, kern, {"x": x.reshape(-1), "w0": wb}, {"T": t}, {out: ((split, t, N), "f32")})[out].sum(0)
        ref, bound = u8f16_reference(x, wd)
        assert np.all(np.abs(y - ref) <= bound), f"{fmt_name} T={t}: {np.abs(y - ref).max()} > {bound.min()}"


def test_ablation_leaves_a_part_out(rt):
    """Knob mma_ablate (for timing one part alone): "products" stages but multiplies nothing (zero results),
    "staging" multiplies but reads no weight or activation."""
    from polystrata.ir.kernel import loads, stmt_exprs, walk

    if rt.lanes == 1:
        pytest.skip("GPU-shaped, never planned on one lane")
    fmt, wb, _ = weight("Q8_0", N, K)
    bare = tile_mma_kernel("t_mma_ablate_staging", [fmt], N, K, rows=32, tokens=16, chunk=64, lanes=64,
                           ablate="staging")
    read = {ld.buf for st in walk(bare.body) for e in stmt_exprs(st) for ld in loads(e)}
    assert not read & {"w0", "xq", "xd"}, read
    kern = tile_mma_kernel("t_mma_ablate_products", [fmt], N, K, rows=32, tokens=16, chunk=64, lanes=64,
                           ablate="products")
    x = np.random.default_rng(2).standard_normal((7, K)).astype(np.float32)
    y = run(rt, kern, {**_quantized(rt, x), "w0": wb}, {"T": 7}, {"y": ((7, N), "f32")})["y"]
    assert not y.any()


def test_tile_mma_f16_weights(rt):
    """F16 weights: f16 tile products on the activations rounded to f16."""
    if rt.lanes == 1:
        pytest.skip("GPU-shaped, never planned on one lane")
    fmt, wb, wd = weight("F16", N, K)
    kern = tile_mma_kernel("t_mma_f16", [fmt], N, K, rows=32, tokens=16, chunk=64, lanes=64)
    rng = np.random.default_rng(4)
    for t in (1, 7, 33, 512):
        x = rng.standard_normal((t, K)).astype(np.float32)
        y = run(rt, kern, {"x": x.reshape(-1), "w0": wb}, {"T": t}, {"y": ((t, N), "f32")})["y"]
        ref = x.astype(np.float16).astype(np.float64) @ wd.T.astype(np.float64)
        np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max(), err_msg=f"F16 T={t}")


def test_split_k_parts_add_up_to_the_reference(rt):
    """K in parts (knob mma_split, steps of 2 to 64 tokens), each part a group writing its unscaled sums, added up
    by `split_sum_kernel`: 3 parts of 4 K steps (Q4_0's blocks of 32, chunks of 64), so the last part takes none
    and must still write its zeros (the partials are poisoned)."""
    if rt.lanes == 1:
        pytest.skip("GPU-shaped, never planned on one lane")
    fmt, wb, wd = weight("Q4_0", N, K)
    kern = tile_mma_kernel("t_mma_split3", [fmt], N, K, rows=32, tokens=16, chunk=64, lanes=64, split=3)
    assert kern.knob_dict["mma_split"] == 3 and kern.param("yp")
    total = split_sum_kernel("t_split_sum3", N, 3, 64)
    rng = np.random.default_rng(7)
    for t in (2, 17):
        x = rng.standard_normal((t, K)).astype(np.float32)
        yp = run(rt, kern, {**_quantized(rt, x), "w0": wb}, {"T": t}, {"yp": ((3 * t * N,), "f32")})["yp"]
        y = run(rt, total, {"yp": yp}, {"T": t}, {"y": ((t, N), "f32")})["y"]
        ref = q8_rounded(x) @ wd.T
        np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max(), err_msg=f"T={t}")


def test_tile_products_apply_within_local_memory():
    """A tile and chunk whose local arrays pass the policy's local memory keep the int8 matvecs; words staging needs
    no byte array, so a chunk that does not fit by bytes may fit by words."""
    from dataclasses import replace

    from polystrata.codegen.policy import MMA_SYNC, device_policy, matrix_kinds
    from polystrata.codegen.recipes.linear import MATMUL_SPACE

    policy = replace(device_policy(128, 32, wide_loads=True), matrix_kinds=matrix_kinds(MMA_SYNC))
    q4k = [FORMATS["Q4_K"]]
    kn = {**MATMUL_SPACE.defaults(), "mma_min": 512, "mma_chunk": 256, "mma_tokens": 32}
    assert tile_products_apply(policy, "matmul", 512, kn, q4k, 4096, 4096)  # 31.5 KiB
    assert not tile_products_apply(policy, "matmul", 512, {**kn, "mma_rows": 128}, q4k, 4096, 4096)  # 52.5 KiB
    assert not tile_products_apply(policy, "matmul", 512, kn, q4k * 2, 4096, 4096)  # the GLU's two weights: 52.5 KiB
    assert tile_products_apply(policy, "matmul", 512, {**kn, "mma_chunk": 128}, q4k * 2, 4096, 4096)
    tight = replace(policy, local_bytes=20 * 1024)  # chunk 128: 16.5 KiB by words, 24.5 by bytes
    assert tile_products_apply(tight, "matmul", 512, {**kn, "mma_chunk": 128}, q4k, 4096, 4096)
    assert not tile_products_apply(tight, "matmul", 512, {**kn, "mma_chunk": 128, "mma_words": 0}, q4k, 4096, 4096)
    assert not tile_products_apply(policy, "matmul", 1, kn, q4k, 4096, 4096)  # decode


def test_mma_chunk_auto_is_the_policys_where_the_matrix_takes_it():
    from polystrata.codegen.policy import device_policy
    from polystrata.codegen.recipes.linear import MATMUL_SPACE
    from polystrata.codegen.recipes.tile_mma import SMALL_CHUNK, mma_chunk

    policy, kn = device_policy(128, 32, wide_loads=True), MATMUL_SPACE.defaults()
    assert kn["mma_chunk"] == "auto" and policy.default("matmul", "mma_chunk") == 128
    assert mma_chunk(policy, "matmul", kn, [FORMATS["Q8_0"]], 640) == 128
    assert mma_chunk(policy, "matmul", kn, [FORMATS["Q8_0"]], 320) == SMALL_CHUNK  # 320 is no multiple of 128
    assert mma_chunk(policy, "matmul", {**kn, "mma_chunk": 256}, [FORMATS["Q8_0"]], 320) == 256  # as set


def test_tile_mma_fits():
    assert tile_mma_fits([FORMATS["Q4_K"], FORMATS["Q8_0"]], 512, 64)
    assert tile_mma_fits([FORMATS["F16"]], 512, 64)  # the f16 path
    assert not tile_mma_fits([FORMATS["BF16"]], 512, 64)  # neither int8 nor exact in f16
    assert not tile_mma_fits([FORMATS["Q4_K"]], 512, 48)  # a chunk neither dividing nor a multiple of 256
    assert not tile_mma_fits([FORMATS["Q8_0"]], 96, 64)  # K not a multiple of the chunk


def _matmul_launches(matrix_units: bool, t_max: int, fmt: str = "Q4_K", mma_min: int = 32, split: int = 0,
                     above: int = 1, **knobs) -> list:
    g = Graph("t")
    g.op("matmul", g.input("x", "f32", ("T", K)), g.weight("w", fmt, (N, K)), name="y")
    ctx = recipe_context(g, formats={"w": FORMATS[fmt]}, lanes=128, matrix_units=matrix_units)
    ctx.t_max, ctx.knobs = t_max, {"matmul": {"mma_min": mma_min, "mma_split": split, "mma_split_above": above,
                                              "mma_chunk": 64, **knobs}}
    launches = recipe("matmul").lower(g.nodes, ctx)
    for t in range(1, t_max + 1):  # whatever the knobs, one kernel writes y in each step
        writers = [la.kernel.name for la in launches if any(p.name == "y" for p in la.kernel.params)
                   and all(eval_int(e, {"T": t}) > 0 for e in la.kernel.grid)]
        assert len(writers) == 1, (t, writers)
    return launches


def test_tile_tokens_are_the_policys_unless_set():
    """Knob mma_tokens "auto": the device policy's 64 tokens a tile for the prompt steps' matmuls and 32 for the
    experts' tiles, which hold the tokens routed to one expert; a set value wins."""
    from polystrata.codegen.policy import device_policy
    from polystrata.codegen.recipes.moe import MOE_SPACE
    from polystrata.codegen.recipes.tile_mma import tile_tokens

    tokens = lambda launches: {dict(la.kernel.knobs)["mma_tokens"] for la in launches  # noqa: E731
                               if "_mma" in la.kernel.name}
    assert tokens(_matmul_launches(True, 70)) == {64}
    assert tokens(_matmul_launches(True, 70, mma_tokens=32)) == {32}
    assert tile_tokens(device_policy(128, 32), "moe_ffn", MOE_SPACE.defaults()) == 32


def test_taken_for_prefill_on_matrix_units_only():
    """Plans of steps of more than TILES_ABOVE tokens on matrix units: the tile products for those steps and the
    int8 matvecs for shorter ones, after one quantize launch; the row count picks (the other's grid is empty)."""
    launches = _matmul_launches(True, 70)
    names = [la.kernel.name for la in launches]
    assert names[0].startswith("quantize_x") and names[1].endswith("_gt64_mma") and names[2].endswith("_le64_q8"), names
    grid = lambda la, t: [eval_int(e, {"T": t}) for e in la.kernel.grid]  # noqa: E731
    assert grid(launches[1], 65)[1] > 0 and grid(launches[2], 65)[1] == 0
    assert grid(launches[1], 64)[1] == 0 and grid(launches[2], 64)[1] > 0
    assert launches[1].buffers[:2] == launches[2].buffers[:2]  # the same quantized activations
    assert not any("_mma" in n for n in (la.kernel.name for la in _matmul_launches(True, 64)))  # short steps only
    assert not any("_mma" in n for n in (la.kernel.name for la in _matmul_launches(True, 1)))  # decode
    assert not any("_mma" in n for n in (la.kernel.name for la in _matmul_launches(False, 70)))
    assert not any("_mma" in n for n in (la.kernel.name for la in _matmul_launches(True, 70, "F32")))
    assert not any("_mma" in la.kernel.name for la in _matmul_launches(True, 70, mma_min=512))  # too small
    f16 = _matmul_launches(True, 16, "F16")
    assert [la.kernel.name.endswith("_mma") for la in f16] == [True] and f16[0].kernel.param("x")


def test_split_k_takes_the_steps_of_2_to_64_tokens():
    """With knob mma_split (and mma_split_above 1) the steps of 2 to 64 tokens take the split tile products and
    their sum, longer ones the whole tiles, one-token steps the int8 matvecs: exactly one of the three has groups
    for any row count. Parts are at most the K steps (Q4_K's K of 256 is one block: one step, no split)."""
    grid = lambda la, t: [eval_int(e, {"T": t}) for e in la.kernel.grid]  # noqa: E731
    launches = _matmul_launches(True, 70, "Q8_0", split=4)
    names = [la.kernel.name for la in launches]
    tail = lambda ns: [n.removeprefix("matmul_q8_0_40x256") for n in ns]  # noqa: E731
    assert tail(names) == ["quantize_x_256", "_gt64_mma", "_gt1_le64_mma_k4", "_gt1_le64_sum4", "_le1_q8"], names
    for t, on in ((1, {4}), (2, {2, 3}), (64, {2, 3}), (65, {1})):
        assert {i for i, la in enumerate(launches[1:], 1) if grid(la, t)[0] * grid(la, t)[1] > 0} == on, t
    assert grid(launches[2], 33)[1] == 3 * 4  # token tiles of 16, times the parts
    assert launches[2].buffers[-1] == launches[3].buffers[0]  # the partials
    short = [la.kernel.name for la in _matmul_launches(True, 16, "Q8_0", split=4)]  # no long steps in the plan
    assert tail(short) == ["quantize_x_256", "_gt1_le64_mma_k4", "_gt1_le64_sum4", "_le1_q8"], short
    assert not any("_mma_k" in la.kernel.name for la in _matmul_launches(True, 70, "Q4_K", split=4))
    # Long steps refused the tile products (a token tile past the local memory): they keep the matvecs, and so
    # do the short ones, unless the plan has no long steps.
    assert not any("_mma" in la.kernel.name for la in _matmul_launches(True, 70, "Q8_0", split=4, mma_tokens=1024))
    assert any("_mma_k4" in la.kernel.name for la in _matmul_launches(True, 64, "Q8_0", split=4, mma_tokens=1024))
    # Parts as the kernel deals the K steps: 4 steps in at most 3 parts is 2 parts of 2, no empty one.
    assert any(la.kernel.name.endswith("_mma_k2") for la in _matmul_launches(True, 16, "Q8_0", split=3))
    assert not any("_mma_k" in la.kernel.name for la in _matmul_launches(True, 1, "Q8_0", split=4))  # decode
    # Knob mma_split_above: steps of up to that many rows keep the matvecs, longer ones (to 64) split K; a plan of
    # no longer steps has no split kernels.
    launches = _matmul_launches(True, 70, "Q8_0", split=4, above=5)
    names = [la.kernel.name for la in launches]
    assert tail(names) == ["quantize_x_256", "_gt64_mma", "_gt5_le64_mma_k4", "_gt5_le64_sum4", "_le5_q8"], names
    for t, on in ((1, {4}), (5, {4}), (6, {2, 3}), (64, {2, 3}), (65, {1})):
        assert {i for i, la in enumerate(launches[1:], 1) if grid(la, t)[0] * grid(la, t)[1] > 0} == on, t
    assert not any("_mma_k" in la.kernel.name for la in _matmul_launches(True, 5, "Q8_0", split=4, above=5))


def test_u8f16_products_where_the_matrix_unit_has_them():
    """Knob mma_f16: the u8f16 tile products where the policy's matrix unit spells them (cuda's MMA_SYNC), never
    elsewhere (MFMA: they would be loops) nor for byte-staged formats (Q5_0); the tile launches (long steps and
    split K) then read x itself, no int8 activations, while the one-token matvecs keep theirs. Off by default."""
    from polystrata.codegen.policy import MATRIX_ARCHS, MMA_SYNC, matrix_kinds
    from polystrata.codegen.recipes.tile_mma import u8f16_products

    kn = {"mma_f16": 1, "mma_words": 1}
    sync = recipe_context(Graph("t"), lanes=128, matrix_units=True).policy
    assert sync.matrix_kinds == matrix_kinds(MMA_SYNC)
    assert u8f16_products(sync, kn, [FORMATS["Q4_K"]])
    assert not u8f16_products(sync, {**kn, "mma_f16": 0}, [FORMATS["Q4_K"]])
    assert not u8f16_products(replace(sync, matrix_kinds=matrix_kinds(MATRIX_ARCHS["gfx90a"])), kn, [FORMATS["Q4_K"]])
    assert not u8f16_products(sync, kn, [FORMATS["Q5_0"]])
    launches = _matmul_launches(True, 70, "Q8_0", split=4, mma_f16=1)
    by_name = {la.kernel.name.removeprefix("matmul_q8_0_40x256"): la for la in launches}
    for tile in ("_gt64_mma", "_gt1_le64_mma_k4"):
        assert dict(by_name[tile].buffers)["x"] == "x" and "xq" not in dict(by_name[tile].buffers), tile
        assert by_name[tile].kernel.knob_dict["mma_f16"] == 1
    assert "xq" in dict(by_name["_le1_q8"].buffers)
    default = _matmul_launches(True, 70, "Q8_0", split=4)
    assert all("mma_f16" not in la.kernel.knob_dict for la in default)


def test_gpu_policy_splits_k_from_six_rows():
    """The GPUs' policy (matrix units): steps of 6 to 64 rows on split-K tile products in 4 parts, shorter ones on
    the int8 matvecs; the host's: no split K."""
    from polystrata.codegen.policy import DEVICE_KNOBS, HOST_KNOBS

    assert (DEVICE_KNOBS["matmul"]["mma_split"], DEVICE_KNOBS["matmul"]["mma_split_above"]) == (4, 5)
    assert HOST_KNOBS["matmul"]["mma_split"] == 0
    g = Graph("t")
    g.op("matmul", g.input("x", "f32", ("T", K)), g.weight("w", "Q8_0", (N, K)), name="y")
    ctx = recipe_context(g, formats={"w": FORMATS["Q8_0"]}, lanes=128, matrix_units=True)
    ctx.t_max, ctx.knobs = 16, {"matmul": {"mma_min": 32, "mma_chunk": 64}}  # the policy's mma_split knobs
    names = [la.kernel.name for la in recipe("matmul").lower(g.nodes, ctx)]
    assert [n.removeprefix("matmul_q8_0_40x256") for n in names] == [
        "quantize_x_256", "_gt5_le64_mma_k4", "_gt5_le64_sum4", "_le5_q8"], names


@pytest.mark.parametrize("each", [1, 0])
def test_fused_glu_launches_match_the_reference(rt, each):
    """The matmul_swiglu recipe's own launches for T = 1, 7 and 70 with knob mma_split: quantize, one tile kernel
    of two weights and the activation as its epilogue (70), the split tile products (a launch a weight, or with
    knob mma_split_each 0 one of both) and their sum, which applies the activation (7), the int8 matvecs (1)."""
    if rt.lanes == 1:
        pytest.skip("GPU-shaped: a Numba compile of its own")
    g = Graph("t")
    x = g.input("x", "f32", ("T", K))
    a = g.op("matmul", x, g.weight("wg", "Q8_0", (N, K)), name="a")
    b = g.op("matmul", x, g.weight("wu", "Q4_0", (N, K)), name="b")
    g.op("swiglu", a, b, name="o")
    ctx = recipe_context(g, formats={"wg": FORMATS["Q8_0"], "wu": FORMATS["Q4_0"]}, lanes=128, matrix_units=True)
    ctx.t_max, ctx.knobs = 70, {"matmul": {"mma_min": 32, "mma_split": 4, "mma_chunk": 64, "mma_split_each": each}}
    launches = recipe("matmul_swiglu").lower(g.nodes, ctx)
    sb, so = plan_scratch(ctx)
    parts = ["w0", "w1"] if each else ["k4"]
    assert [la.kernel.name.rsplit("_", 1)[1] for la in launches[1:]] == ["mma", *parts, "sum4", "q8"]
    (_, bg, dg), (_, bu, du) = weight("Q8_0", N, K, 5), weight("Q4_0", N, K, 6)
    for t in (1, 7, 70):
        xv = np.random.default_rng(t).standard_normal((t, K)).astype(np.float32)
        out = run_launches(rt, launches, {"x": xv.reshape(-1), "wg": bg, "wu": bu, **sb}, {"T": t},
                           {"o": ((t, N), "f32"), **so})
        gate, up = q8_rounded(xv) @ dg.T, q8_rounded(xv) @ du.T
        ref = gate / (1 + np.exp(-gate)) * up
        np.testing.assert_allclose(out["o"], ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())


def test_stacked_qkv_keep_their_one_token_matvec_with_split_k(rt):
    """q, k and v of one input with knob mma_split: each takes its own split-K tile products in steps of more than
    mma_split_above (3) to 64 tokens, and shorter steps keep the one stacked matvec (gated to them), all after one
    quantize launch."""
    if rt.lanes == 1:
        pytest.skip("GPU-shaped: Numba compiles of their own")
    g = Graph("t")
    x = g.input("x", "f32", ("T", K))
    shapes = {"wq": ("Q8_0", N, 5), "wk": ("Q4_0", 24, 6), "wv": ("Q8_0", 24, 7)}
    for name, (fmt_name, n, _) in shapes.items():
        g.op("matmul", x, g.weight(name, fmt_name, (n, K)), name=f"y{name}")

    def lowered(t_max: int, mma_min: int) -> tuple[list, object]:
        ctx = recipe_context(g, formats={nm: FORMATS[f] for nm, (f, _, _) in shapes.items()}, lanes=128,
                             matrix_units=True)
        ctx.t_max, ctx.knobs = t_max, {"matmul": {"mma_min": mma_min, "mma_split": 2, "mma_split_above": 3,
                                                  "mma_chunk": 64}}
        launches = recipe("matmul_stack3").lower(g.nodes, ctx)
        for t in range(1, t_max + 1):  # one launch writes each output in each step
            for out in (f"y{nm}" for nm in shapes):
                writers = [la.kernel.name for la in launches if any(b == out for _, b in la.buffers)
                           and all(eval_int(e, {"T": t}) > 0 for e in la.kernel.grid)]
                assert len(writers) == 1, (t_max, t, out, writers)
        return launches, ctx

    # k and v too small for the tile products: each matmul alone; long steps in the plan: each alone too.
    assert not any("matmul_stack" in la.kernel.name for la in lowered(16, 32)[0] + lowered(70, 16)[0])
    launches, ctx = lowered(16, 16)
    names = [la.kernel.name for la in launches]
    assert names[0].startswith("quantize_x") and names[-1].endswith("_le3_q8") and "matmul_stack" in names[-1]
    assert sum(n.endswith("_mma_k2") for n in names) == 3 and sum(n.endswith("_sum2") for n in names) == 3, names
    weights = {nm: weight(f, n, K, seed) for nm, (f, n, seed) in shapes.items()}
    sb, so = plan_scratch(ctx)
    for t in (1, 3, 7):
        xv = np.random.default_rng(t).standard_normal((t, K)).astype(np.float32)
        out = run_launches(rt, launches, {"x": xv.reshape(-1), **{nm: w[1] for nm, w in weights.items()}, **sb},
                           {"T": t}, {**{f"y{nm}": ((t, n), "f32") for nm, (_, n, _) in shapes.items()}, **so})
        for nm, (_, _, wd) in weights.items():
            ref = q8_rounded(xv) @ wd.T
            np.testing.assert_allclose(out[f"y{nm}"], ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max(), err_msg=nm)

"""Recipe conformance, codegen/recipes/tile_matmul.py: the one-lane matmul decoding each weight block once for a
tile of tokens, against the numpy reference and, bit for bit, against `matmul_kernel`'s f32 path token by token."""

from __future__ import annotations

import numpy as np
import pytest
from recipe_cases import recipe, recipe_context, run, target_runtimes, weight

from polystrata.codegen.recipes.linear import matmul_kernel
from polystrata.codegen.recipes.tile_matmul import tile_matmul_kernel
from polystrata.ir.formats import FORMATS
from polystrata.ir.graph import Graph

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
    """One-lane plans of more than one token take the tile matmul, with the fused gate, up and activation as its
    epilogue; one-token plans and GPU-shaped ones do not."""
    g = Graph("t")
    x = g.input("x", "f32", ("T", 256))
    wg, wu = g.weight("wg", "Q4_1", (19, 256)), g.weight("wu", "Q4_1", (19, 256))
    g.op("swiglu", g.op("matmul", x, wg, name="a"), g.op("matmul", x, wu, name="b"), name="o")

    def kernel(lanes: int, t_max: int) -> str:
        ctx = recipe_context(g, formats={"wg": FORMATS["Q4_1"], "wu": FORMATS["Q4_1"]}, lanes=lanes)
        ctx.t_max = t_max
        return recipe("matmul_swiglu").lower(g.nodes, ctx)[-1].kernel.name

    assert kernel(1, 16) == "glu_swiglu_q4_1_q4_1_19x256_tile"
    assert kernel(1, 1) == "glu_swiglu_q4_1_q4_1_19x256"
    assert not kernel(128, 16).endswith("_tile")

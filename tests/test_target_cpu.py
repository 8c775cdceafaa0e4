"""The cpu target's own pieces: its native intrinsics and the fused multiply-adds it gives dot products."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from numba import njit

from polystrata.codegen.cpu import render
from polystrata.codegen.cpu_intrinsics import f16_to_f32, f32_to_f16
from polystrata.codegen.recipes.linear import matmul_kernel
from polystrata.ir.formats import FORMATS


@njit(cache=False)
def _convert_all(bits, out_f32, x, out_bits):
    for i in range(bits.size):
        out_f32[i] = f16_to_f32(np.int64(bits[i]))
    for i in range(x.size):
        out_bits[i] = f32_to_f16(x[i])


def test_f16_conversions_are_exact_for_every_pattern():
    """Every f16 bit pattern converts exactly (infinities, NaNs, subnormals), and f32 -> f16 rounds to nearest
    even as numpy does, near ties and overflow included."""
    bits = np.arange(1 << 16, dtype=np.uint16)
    rng = np.random.default_rng(0)
    ties = (bits[:0x7C00].view(np.float16).astype(np.float32).view(np.uint32) + (1 << 12)).view(np.float32)
    x = np.concatenate([rng.standard_normal(4096).astype(np.float32) * 1000,
                        ties, -ties, np.float32([65504, 65520, 65519.99, 1e-8, 6e-8, 3e-8, -0.0, np.inf, -np.inf])])
    out_f32 = np.full(bits.size, -1.0, np.float32)
    out_bits = np.zeros(x.size, np.uint32)
    _convert_all(bits, out_f32, x, out_bits)
    want = bits.view(np.float16).astype(np.float32)
    finite = ~np.isnan(want)
    np.testing.assert_array_equal(out_f32.view(np.uint32)[finite], want.view(np.uint32)[finite])
    assert np.isnan(out_f32[~finite]).all()
    with np.errstate(over="ignore"):
        want_bits = x.astype(np.float16).view(np.uint16).astype(np.uint32)
    np.testing.assert_array_equal(out_bits, want_bits)


def test_permissions_render_as_their_fastmath_flags_only():
    """A kernel with `contract` (the cpu policy's matmuls) is rendered with Numba's fastmath 'contract' flag (FMA
    only, no reassociation), one with `reassociate` with 'reassoc'; a kernel without them with no fastmath flag."""
    fmt = FORMATS["Q4_1"]
    fused = matmul_kernel("m", [fmt], 64, 64, rows=4, tokens=8, int8=False, split="rows", lanes=1, contract=1)
    plain = matmul_kernel("m", [fmt], 64, 64, rows=4, tokens=8, int8=False, split="rows", lanes=1)
    assert fused.contract and ("contract", 1) in fused.knobs
    assert "fastmath={'contract'}" in render(fused)
    assert "fastmath" not in render(plain)
    summed = replace(plain, reassociate=True)  # attention's q.k loops: reordered sums vectorize
    assert "fastmath={'reassoc'}" in render(summed)
    # Both, in a fixed order whatever the hash seed: the rendered source is the kernel cache's key.
    assert "fastmath={'contract', 'reassoc'}" in render(replace(fused, reassociate=True))

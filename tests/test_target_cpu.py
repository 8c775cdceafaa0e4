"""The cpu target's own pieces: its native intrinsics and the fused multiply-adds it gives dot products."""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import replace

import numpy as np
import pytest
from numba import njit

from polystrata.codegen.cpu import render
from polystrata.codegen.cpu_intrinsics import f16_to_f32, f32_to_f16
from polystrata.codegen.recipes.linear import matmul_kernel, matvec_q8_kernel
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


@pytest.mark.parametrize("module", ["numba.core.ssa", "numba.cuda.core.ssa"])
def test_ssa_in_one_sweep_matches_numba(module, tmp_path):
    """The runtimes' replacement of Numba's SSA reconstruction (`runtimes/numba_ssa.py`; numba's pass and
    numba-cuda's copy) gives the blocks numba's own gives, statement for statement, phis and fresh names
    included, on the IR of a generated kernel (an unrolled matvec of four tokens: a long block, dozens of
    reassigned accumulators, loops)."""
    if module.startswith("numba.cuda") and importlib.util.find_spec("numba_cuda") is None:
        pytest.skip("numba-cuda not installed")
    from numba.core.compiler import run_frontend

    from polystrata.codegen import cuda
    from polystrata.runtimes import numba_ssa
    from polystrata.runtimes.cpu import CPURuntime

    ssa = importlib.import_module(module)
    CPURuntime()  # installs it (as the cuda runtime does)
    theirs, ours = numba_ssa.replaced[module], ssa._run_ssa
    assert ours is not theirs and "numba_ssa" in ours.__doc__
    kern = matvec_q8_kernel("t_ssa", [FORMATS["Q4_0"]], 64, 256, tokens=4, lanes=32, runs=1, reuse=True)
    if module.startswith("numba.cuda"):
        from numba.cuda.compiler import run_frontend
    source = cuda.render(kern, shuffles=True, native=True) if module.startswith("numba.cuda") else render(kern)
    path = tmp_path / "k_ssa.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("polystrata_t_ssa", path)
    kernel_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kernel_module)
    fn = getattr(kernel_module, kern.name)
    blocks = [run_frontend(getattr(fn, "py_func", fn)).blocks for _ in range(2)]  # one each: the pass renames

    def listing(blocks: dict) -> list:
        scope = next(iter(blocks.values())).scope
        return [(label, [str(st) for st in b.body]) for label, b in blocks.items()] + list(scope.localvars._con)

    want, got = listing(theirs(blocks[0])), listing(ours(blocks[1]))
    assert got == want
    text = str(want)
    assert text.count(" = phi(") >= 2 and text.count(".1 = ") > 30, text[:2000]  # phis, many renamed variables



def test_tanh_is_a_rational_function_within_a_few_ulp():
    """The cpu renders `tanh` as its own arithmetic (`cpu.TANH_F32`, which vectorizes in a loop where a C library
    call does not), written into the modules of kernels that call it only: within 3.5e-7 of tanh (relative) from
    1e-30 to past its clamp, odd, never past +-1, +-1 at the infinities, NaN for NaN."""
    from recipe_cases import run

    from polystrata.ir.kernel import Buf, Call, Const, For, Kernel, Load, Scalar, Store, Var
    from polystrata.runtimes.cpu import CPURuntime

    j = Var("j")
    kern = Kernel("t_tanh", (Buf("x", "f32"), Buf("y", "f32", out=True), Scalar("n")), (Const(1),),
                  (For("j", Const(0), Var("n"), (Store("y", j, Call("tanh", Load("x", j))),)),), lanes=1)
    assert "def tanh_f32" in render(kern) and "math.tanh" not in render(kern)
    assert "tanh_f32" not in render(matmul_kernel("m", [FORMATS["Q4_1"]], 64, 64, rows=4, tokens=8, int8=False,
                                                  split="rows", lanes=1))
    pos = np.concatenate([np.linspace(0, 20, 100_001, dtype=np.float32), np.geomspace(1e-30, 1e-3, 2000,
                                                                                     dtype=np.float32)])
    x = np.concatenate([pos, -pos, np.float32([np.inf, -np.inf, np.nan])])
    y = run(CPURuntime(), kern, {"x": x}, {"n": x.size}, {"y": ((x.size,), "f32")})["y"]
    ref = np.tanh(x[:-3].astype(np.float64))
    assert np.all(np.abs(y[:-3] - ref) <= 3.5e-7 * np.abs(ref))
    np.testing.assert_array_equal(y[pos.size:2 * pos.size], -y[:pos.size])
    assert np.abs(y[:-3]).max() == 1.0
    assert list(y[-3:-1]) == [1.0, -1.0] and np.isnan(y[-1])

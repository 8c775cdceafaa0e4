"""Native forms of IR intrinsics for the CPU target, imported by its generated kernels (`codegen/cpu.py`).

The f16 conversions are LLVM `half` casts (`codegen/numba_intrinsics.py`): one vectorizable instruction on
hosts with f16 conversions (F16C on x86-64 since 2012, every AArch64), where the portable helper costs tens of
scalar instructions a scale in a quantized dot product's block loop.
"""

from __future__ import annotations

from numba.extending import intrinsic

from polystrata.codegen import numba_intrinsics

f16_to_f32 = intrinsic(numba_intrinsics.f16_to_f32)
f32_to_f16 = intrinsic(numba_intrinsics.f32_to_f16)

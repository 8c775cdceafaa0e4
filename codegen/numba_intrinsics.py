"""LLVM spellings of IR intrinsics that every Numba target shares: the f16 conversions as LLVM `half` casts.

Numba's Python has no f16 scalar type, and the portable definitions (`codegen/pyfamily.HELPERS`) are branchy
integer routines. A `half` cast is one instruction where the machine has one (x86 F16C `vcvtph2ps`, AArch64
`fcvt`, PTX `cvt`), exact in both directions (round to nearest even), and LLVM vectorizes it. These are
typing-and-codegen templates: each Numba target registers them with its own `intrinsic` decorator
(`numba.extending.intrinsic` for the CPU, `numba.cuda.extending.intrinsic` for numba-cuda).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types


def narrow(builder, v, width: int):
    """The integer LLVM value `v` truncated or zero-extended to `width` bits."""
    t = ir.IntType(width)
    return builder.trunc(v, t) if v.type.width > width else builder.zext(v, t) if v.type.width < width else v


def f16_to_f32(typingctx, h):
    """The f32 value of the f16 bits in the low 16 bits of `h` (exact, no branches)."""
    if not isinstance(h, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        half = builder.bitcast(narrow(builder, args[0], 16), ir.HalfType())
        return builder.fpext(half, ir.FloatType())

    return types.float32(h), codegen


def f32_to_f16(typingctx, x):
    """The f16 bits (in a u32) of `x` rounded to nearest even."""
    if not isinstance(x, types.Float):
        return None

    def codegen(context, builder, signature, args):
        v = args[0] if args[0].type == ir.FloatType() else builder.fptrunc(args[0], ir.FloatType())
        return builder.zext(builder.bitcast(builder.fptrunc(v, ir.HalfType()), ir.IntType(16)), ir.IntType(32))

    return types.uint32(x), codegen

"""Native forms of the IR intrinsics for numba-cuda, imported by the generated kernels (`codegen/cuda.py`).

Numba's Python has no spelling for PTX's `dp4a` nor for a 4-byte load from a byte array, and the portable
definitions (`codegen/pyfamily.HELPERS`) cost tens of 64-bit integer instructions each, in the innermost loop of
every quantized dot product. These are Numba intrinsics emitting the instruction itself (inline PTX for dp4a, LLVM
`half` casts for the f16 conversions) or an LLVM load of the wider type.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.cuda.extending import intrinsic

# The f16 conversions are LLVM `half` casts (NVVM emits one cvt each), not inline asm: asm conversions declared
# `readnone` made f16 attention come out wrong on the H200 (numba 0.68, CUDA 13) though each conversion alone was
# exact (caught by test_recipes.py::test_attention on the device). dp4a is asm declared `readnone`: without it
# NVVM must assume the asm touches memory, so it neither merges the loads on either side of it into vector
# loads nor reuses a loaded word across it (the Q4_K matvec's 49 scalar loads a lane become 13 16-byte ones).


@intrinsic
def dp4a(typingctx, a, b, acc):
    """acc + the sum of the products of the four signed bytes of `a` and `b` (all truncated to 32 bits)."""
    if not all(isinstance(t, types.Integer) for t in (a, b, acc)):
        return None
    sig = types.int32(a, b, acc)

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        vals = [_narrow(builder, v, 32) for v in args]
        asm = ir.InlineAsm(ir.FunctionType(i32, [i32, i32, i32]), "dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r")
        call = builder.call(asm, vals)
        call.attributes.add("readnone")
        return call

    return sig, codegen


def _narrow(builder, v, width: int):
    t = ir.IntType(width)
    return builder.trunc(v, t) if v.type.width > width else builder.zext(v, t) if v.type.width < width else v


@intrinsic
def f16_to_f32(typingctx, h):
    """The f32 value of the f16 bits in the low 16 bits of `h` (one PTX cvt: exact, no branches)."""
    if not isinstance(h, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        half = builder.bitcast(_narrow(builder, args[0], 16), ir.HalfType())
        return builder.fpext(half, ir.FloatType())

    return types.float32(h), codegen


@intrinsic
def f32_to_f16(typingctx, x):
    """The f16 bits (in a u32) of `x` rounded to nearest even (PTX cvt.rn)."""
    if not isinstance(x, types.Float):
        return None

    def codegen(context, builder, signature, args):
        v = args[0] if args[0].type == ir.FloatType() else builder.fptrunc(args[0], ir.FloatType())
        return builder.zext(builder.bitcast(builder.fptrunc(v, ir.HalfType()), ir.IntType(16)), ir.IntType(32))

    return types.uint32(x), codegen


def _element_pointer(context, builder, signature, args):
    """Pointer to element `args[1]` of the array `args[0]` (no bounds or wrap-around handling: IR indices are
    in bounds and non-negative)."""
    ary = context.make_array(signature.args[0])(context, builder, value=args[0])
    idx = builder.zext(args[1], ir.IntType(64)) if args[1].type.width < 64 else args[1]
    return builder.gep(ary.data, [idx])


def _word_load(width: int, count: int, align: int | None = None):
    """An intrinsic loading `count` little-endian `width`-bit words at a byte offset of a u8 array into a u32;
    the first load is declared aligned to `align` bytes (default: the word's), which lets NVVM merge it with
    loads of the words after it into one vector load."""

    @intrinsic
    def load(typingctx, arr, index):
        if not (isinstance(arr, types.Array) and arr.dtype == types.uint8 and isinstance(index, types.Integer)):
            return None
        sig = types.uint32(arr, index)

        def codegen(context, builder, signature, args):
            i64 = ir.IntType(64)
            byte_ptr = _element_pointer(context, builder, signature, args)
            wt = ir.IntType(width)
            ptr = builder.bitcast(byte_ptr, wt.as_pointer())
            out = None
            for k in range(count):
                p = builder.gep(ptr, [ir.Constant(i64, k)]) if k else ptr
                v = builder.load(p, align=(align or width // 8) if k == 0 else width // 8)
                v = builder.zext(v, ir.IntType(32)) if width < 32 else v
                if k:
                    v = builder.shl(v, ir.Constant(ir.IntType(32), width * k))
                out = v if out is None else builder.or_(out, v)
            return out

        return sig, codegen

    return load


load_u32_a2 = _word_load(16, 2)  # offset a multiple of 2: two 16-bit loads
load_u32_a4 = _word_load(32, 1)  # offset a multiple of 4: one 32-bit load
load_u32_a8 = _word_load(32, 1, 8)  # ... of 8 or 16: one 32-bit load that NVVM may widen with its neighbours
load_u32_a16 = _word_load(32, 1, 16)


def _aligned_element(align: int):
    """An intrinsic loading element `index` of an array of 4-byte elements, declared `align`-byte aligned (the
    IR's `Load.align` promise): NVVM merges it with loads of the elements after it into one vector load."""

    @intrinsic
    def load(typingctx, arr, index):
        if not (isinstance(arr, types.Array) and arr.dtype.bitwidth == 32 and isinstance(index, types.Integer)):
            return None
        sig = arr.dtype(arr, index)

        def codegen(context, builder, signature, args):
            return builder.load(_element_pointer(context, builder, signature, args), align=align)

        return sig, codegen

    return load


load_a8 = _aligned_element(8)
load_a16 = _aligned_element(16)


def _mma(ptx: str, n_a: int, n_b: int, floats: bool):
    """An intrinsic of one warp-wide `mma.sync` (`ptx`, its operand lists written as {A}, {B}, {C}, {D}): n_a and
    n_b operand words (u32, packed int8 or f16 pairs), four accumulators in and out (s32 or f32), returned as a
    4-tuple; the accumulator list in and out are separate registers."""
    acc = ir.FloatType() if floats else ir.IntType(32)
    acc_t = types.float32 if floats else types.int32
    c = "f" if floats else "r"
    count = n_a + n_b + 4
    regs = [f"${k}" for k in range(4 + count)]

    def group(lo: int, hi: int) -> str:
        return "{" + ", ".join(regs[lo:hi]) + "}"

    nb = 4 + n_a + n_b
    text = ptx.format(D=group(0, 4), A=group(4, 4 + n_a), B=group(4 + n_a, nb), C=group(nb, nb + 4))
    constraints = ",".join([f"={c}"] * 4 + ["r"] * (n_a + n_b) + [c] * 4)

    def typer(args):
        if len(args) != count or not all(isinstance(t, types.Integer) for t in args[:n_a + n_b]):
            return None
        return types.UniTuple(acc_t, 4)(*args)

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        words = [_narrow(builder, v, 32) for v in args[:n_a + n_b]]
        accs = []
        for v, t in zip(args[n_a + n_b:], signature.args[n_a + n_b:]):
            accs.append(context.cast(builder, v, t, acc_t))
        fn = ir.FunctionType(ir.LiteralStructType([acc] * 4), [i32] * (n_a + n_b) + [acc] * 4)
        call = builder.call(ir.InlineAsm(fn, text, constraints), words + accs)
        call.attributes.add("readnone")
        return context.make_tuple(builder, signature.return_type, [builder.extract_value(call, k) for k in range(4)])

    return typer, codegen


def _mma_intrinsic(name: str, ptx: str, n_a: int, n_b: int, floats: bool, doc: str):
    typer, codegen = _mma(ptx, n_a, n_b, floats)
    # Numba's intrinsics take named parameters only (no *args): the definition is written out for this arity, under
    # the intrinsic's own name and this module (numba names and caches intrinsics by them).
    names = ", ".join(f"x{k}" for k in range(n_a + n_b + 4))
    scope = {"typer": typer, "codegen": codegen, "__name__": __name__}
    exec(f"def {name}(typingctx, {names}):\n    sig = typer(({names},))\n"
         "    return (sig, codegen) if sig is not None else None\n", scope)
    scope[name].__doc__ = doc
    return intrinsic(scope[name])


# One warp's 16 x 8 tile product (`codegen/cuda.py`'s MMA_SYNC unit) on sm_80 and newer.
_MMA = "mma.sync.aligned.{shape}.row.col.{types} {{D}}, {{A}}, {{B}}, {{C}};"
mma_s8_k32 = _mma_intrinsic("mma_s8_k32", _MMA.format(shape="m16n8k32", types="s32.s8.s8.s32"), 4, 2, False,
                            "16 x 8 x 32 int8 tile product into s32 accumulators (mma.sync).")
mma_s8_k16 = _mma_intrinsic("mma_s8_k16", _MMA.format(shape="m16n8k16", types="s32.s8.s8.s32"), 2, 1, False,
                            "16 x 8 x 16 int8 tile product into s32 accumulators (mma.sync).")
mma_f16_k16 = _mma_intrinsic("mma_f16_k16", _MMA.format(shape="m16n8k16", types="f32.f16.f16.f32"), 4, 2, True,
                             "16 x 8 x 16 f16 tile product into f32 accumulators (mma.sync).")

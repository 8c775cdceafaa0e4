"""Native forms of the IR intrinsics for numba-cuda, imported by the generated kernels (`codegen/cuda.py`).

Numba's Python has no spelling for PTX's `dp4a` nor for a 4-byte load from a byte array, and the portable
definitions (`codegen/pyfamily.HELPERS`) cost tens of 64-bit integer instructions each, in the innermost loop of
every quantized dot product. These are Numba intrinsics emitting the instruction itself (inline PTX for dp4a and
the sm_80 `mma.sync` tile products, LLVM `half` casts for the f16 conversions) or an LLVM load of the wider type.
"""

from __future__ import annotations

from llvmlite import ir
from numba import cuda, types
from numba.cuda.extending import intrinsic

from polystrata.codegen import numba_intrinsics
from polystrata.codegen.numba_intrinsics import narrow

# The f16 conversions are LLVM `half` casts (NVVM emits one cvt each), not inline asm: asm conversions declared
# `readnone` made f16 attention come out wrong on the H200 (numba 0.68, CUDA 13) though each conversion alone was
# exact (caught by test_recipes.py::test_attention on the device). dp4a is asm declared `readnone`: without it
# NVVM must assume the asm touches memory, so it neither merges the loads on either side of it into vector
# loads nor reuses a loaded word across it (the Q4_K matvec's 49 scalar loads a lane become 13 16-byte ones).


def _asm(name: str, text: str, words: int, accs: int, floats: bool, doc: str):
    """An intrinsic `name` of inline PTX `text` declared `readnone`: `words` u32 operands (truncated to 32 bits),
    then `accs` accumulators (s32, or f32 with `floats`) in; the new accumulators out (a tuple where several), as
    `text`'s registers $0.. (out), then the words and the accumulators in."""
    acc = ir.FloatType() if floats else ir.IntType(32)
    acc_t = types.float32 if floats else types.int32
    c = "f" if floats else "r"
    constraints = ",".join([f"={c}"] * accs + ["r"] * words + [c] * accs)
    out_t = types.UniTuple(acc_t, accs) if accs > 1 else acc_t

    def typer(args):
        ints = args if not floats else args[:words]
        return out_t(*args) if all(isinstance(t, types.Integer) for t in ints) else None

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        ins = [narrow(builder, v, 32) for v in args[:words]]
        ins += [context.cast(builder, v, t, acc_t) if floats else narrow(builder, v, 32)
                for v, t in zip(args[words:], signature.args[words:])]
        fn = ir.FunctionType(ir.LiteralStructType([acc] * accs) if accs > 1 else acc, [i32] * words + [acc] * accs)
        call = builder.call(ir.InlineAsm(fn, text, constraints), ins)
        call.attributes.add("readnone")
        if accs == 1:
            return call
        return context.make_tuple(builder, out_t, [builder.extract_value(call, k) for k in range(accs)])

    # Numba's intrinsics take named parameters only (no *args): the definition is written out for this arity, under
    # the intrinsic's own name and this module (numba names and caches intrinsics by them).
    names = ", ".join(f"x{k}" for k in range(words + accs))
    scope = {"typer": typer, "codegen": codegen, "__name__": __name__}
    exec(f"def {name}(typingctx, {names}):\n    sig = typer(({names},))\n"
         "    return (sig, codegen) if sig is not None else None\n", scope)
    scope[name].__doc__ = doc
    return intrinsic(scope[name])


dp4a = _asm("dp4a", "dp4a.s32.s32 $0, $1, $2, $3;", 2, 1, False,
            "acc + the sum of the products of the four signed bytes of `a` and `b` (all truncated to 32 bits).")


def _mma(shape: str, kinds: str, n_a: int, n_b: int, floats: bool, doc: str):
    """One warp's 16 x 8 tile product (`codegen/policy.py`'s MMA_SYNC unit, sm_80 and newer): `mma.sync` with n_a
    and n_b operand words (packed int8 or f16 pairs) and four accumulators in and out, separate registers."""
    regs = [f"${k}" for k in range(8 + n_a + n_b)]
    d, a, b, c = (regs[:4], regs[4:4 + n_a], regs[4 + n_a:4 + n_a + n_b], regs[4 + n_a + n_b:])
    text = (f"mma.sync.aligned.{shape}.row.col.{kinds} " + ", ".join("{" + ", ".join(g) + "}" for g in (d, a, b, c))
            + ";")
    return _asm(f"mma_{'f16' if floats else 's8'}_{shape[-3:]}", text, n_a + n_b, 4, floats, doc)


mma_s8_k32 = _mma("m16n8k32", "s32.s8.s8.s32", 4, 2, False, "16 x 8 x 32 int8 tile product into s32 accumulators.")
mma_s8_k16 = _mma("m16n8k16", "s32.s8.s8.s32", 2, 1, False, "16 x 8 x 16 int8 tile product into s32 accumulators.")
mma_f16_k16 = _mma("m16n8k16", "f32.f16.f16.f32", 4, 2, True, "16 x 8 x 16 f16 tile product into f32 accumulators.")


# u8f16 (`ir.kernel.TileMMA`, `codegen/policy.py`'s MMA_SYNC): the A operand of an f16 m16n8k16 made from a row's
# word (a), row + 8's (a8) and their scale words (f16 S low, M high). Each byte q becomes the f16 1024 + q by a byte
# permute under the exponent byte 0x64, less 1024 (exact), then S * q + M in one f16x2 fma (one rounding). An
# intrinsic of its own, declared `readnone`, so that the tiles of one row share it (NVVM merges equal calls).
_U8F16_A = """{
.reg .b32 s0, m0, s1, m1, kb, kh;
mov.b32 kb, 0x64646464;
mov.b32 kh, 0x64006400;
prmt.b32 $0, $4, kb, 0x5140;
prmt.b32 $1, $5, kb, 0x5140;
prmt.b32 $2, $4, kb, 0x5342;
prmt.b32 $3, $5, kb, 0x5342;
sub.f16x2 $0, $0, kh;
sub.f16x2 $1, $1, kh;
sub.f16x2 $2, $2, kh;
sub.f16x2 $3, $3, kh;
prmt.b32 s0, $6, $6, 0x1010;
prmt.b32 m0, $6, $6, 0x3232;
prmt.b32 s1, $7, $7, 0x1010;
prmt.b32 m1, $7, $7, 0x3232;
fma.rn.f16x2 $0, $0, s0, m0;
fma.rn.f16x2 $1, $1, s1, m1;
fma.rn.f16x2 $2, $2, s0, m0;
fma.rn.f16x2 $3, $3, s1, m1;
}"""


def _words_asm(name: str, text: str, n_in: int, n_out: int, doc: str):
    """An intrinsic `name` of inline PTX `text` declared `readnone`: `n_in` u32 operands (truncated to 32 bits) in,
    a tuple of `n_out` u32 out, as `text`'s registers $0.. (out), then the operands."""
    out_t = types.UniTuple(types.uint32, n_out)

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        fn = ir.FunctionType(ir.LiteralStructType([i32] * n_out), [i32] * n_in)
        call = builder.call(ir.InlineAsm(fn, text, ",".join(["=r"] * n_out + ["r"] * n_in)),
                            [narrow(builder, v, 32) for v in args])
        call.attributes.add("readnone")
        return context.make_tuple(builder, out_t, [builder.extract_value(call, k) for k in range(n_out)])

    names = ", ".join(f"x{k}" for k in range(n_in))
    scope = {"codegen": codegen, "out_t": out_t, "types": types, "__name__": __name__}
    exec(f"def {name}(typingctx, {names}):\n"
         f"    if not all(isinstance(t, types.Integer) for t in ({names},)):\n        return None\n"
         f"    return out_t({names}), codegen\n", scope)
    scope[name].__doc__ = doc
    return intrinsic(scope[name])


u8f16_a = _words_asm("u8f16_a", _U8F16_A, 4, 4, "The f16 A operand words of a u8f16 step (see _U8F16_A).")


@cuda.jit(device=True, inline="always")
def mma_u8f16_k16(a, a8, s, s8, b0, b1, c0, c1, c2, c3):
    """16 x 8 x 16 tile product of unsigned bytes made f16 by their rows' scales, into f32 accumulators."""
    v = u8f16_a(a, a8, s, s8)
    return mma_f16_k16(v[0], v[1], v[2], v[3], b0, b1, c0, c1, c2, c3)


f16_to_f32 = intrinsic(numba_intrinsics.f16_to_f32)  # one PTX cvt each way
f32_to_f16 = intrinsic(numba_intrinsics.f32_to_f16)


def _load(width: int | None, count: int = 1, align: int | None = None):
    """An intrinsic `load(arr, index)`: with `width`, `count` little-endian `width`-bit words at byte offset
    `index` of a u8 array as a u32; without, element `index` of an array of 4-byte elements, addressed in bytes as
    the words are (NVVM merged neighbouring element loads into vector loads in one copy of a loop and not in the
    other when they were addressed by elements). The first load is declared aligned to `align` bytes (default: the
    word's; the IR's alignment promise), which lets NVVM merge it with the loads after it into one vector load.
    No bounds or wrap-around handling: IR indices are in bounds and non-negative."""

    @intrinsic
    def load(typingctx, arr, index):
        if not (isinstance(arr, types.Array) and isinstance(index, types.Integer)
                and (arr.dtype == types.uint8 if width else arr.dtype.bitwidth == 32)):
            return None

        def codegen(context, builder, signature, args):
            i64 = ir.IntType(64)
            ary = context.make_array(signature.args[0])(context, builder, value=args[0])
            index = builder.zext(args[1], i64) if args[1].type.width < 64 else args[1]
            if not width:  # as a byte offset, the form of the word loads (which NVVM merges into vector loads)
                data = builder.bitcast(ary.data, ir.IntType(8).as_pointer())
                ptr = builder.gep(data, [builder.shl(index, ir.Constant(i64, 2))])
                return builder.load(builder.bitcast(ptr, ary.data.type), align=align)
            ptr = builder.gep(ary.data, [index])
            ptr = builder.bitcast(ptr, ir.IntType(width).as_pointer())
            out = None
            for k in range(count):
                v = builder.load(builder.gep(ptr, [ir.Constant(i64, k)]) if k else ptr,
                                 align=(align or width // 8) if k == 0 else width // 8)
                v = builder.zext(v, ir.IntType(32)) if width < 32 else v
                if k:
                    v = builder.shl(v, ir.Constant(ir.IntType(32), width * k))
                out = v if out is None else builder.or_(out, v)
            return out

        return (types.uint32 if width else arr.dtype)(arr, index), codegen

    return load


load_u32_a2 = _load(16, 2)  # offset a multiple of 2: two 16-bit loads
load_u32_a4 = _load(32)  # offset a multiple of 4: one 32-bit load
load_u32_a8 = _load(32, 1, 8)  # ... of 8 or 16: one 32-bit load that NVVM may widen with its neighbours
load_u32_a16 = _load(32, 1, 16)
load_a4 = _load(None, align=4)
load_a8 = _load(None, align=8)  # a 4-byte element at an index promised a multiple of 2 (8 bytes) or 4 (16)
load_a16 = _load(None, align=16)

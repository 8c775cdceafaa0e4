"""Native forms of IR intrinsics for the CPU target, imported by its generated kernels (`codegen/cpu.py`).

The f16 conversions are LLVM `half` casts (`codegen/numba_intrinsics.py`): one vectorizable instruction on
hosts with f16 conversions (F16C on x86-64 since 2012, every AArch64), where the portable helper costs tens of
scalar instructions a scale in a quantized dot product's block loop.

`dot_i8_blocks` (the block-scaled int8 dot product of the CPU's prefill matmul, `tile_matmul_q8_kernel`) is a
loop of 32-byte steps written in LLVM IR: Numba's integer arithmetic is 64-bit and LLVM's vectorizer does not
turn a loop of it back into byte dot products. Each step leaves eight i32 sums of four byte products in a vector,
converted and scaled into eight f32 sums, added across once at the end. The weights' bytes are unsigned and the
activations' signed, as x86's `vpdpbusd` takes them: on a host with AVX-512 VNNI or AVX-VNNI (`policy.HOST_VNNI`)
a step's products are that one instruction; elsewhere plain LLVM integer vectors (widened, multiplied, added in
fours), which every LLVM target lowers correctly.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from polystrata.codegen import numba_intrinsics, policy

f16_to_f32 = intrinsic(numba_intrinsics.f16_to_f32)
f32_to_f16 = intrinsic(numba_intrinsics.f32_to_f16)


# Which form `dot_i8_blocks` takes, read when a kernel is compiled (Numba's cache keys machine code by the host CPU
# and its features): the host policy's finding; a test sets it False to compile the portable form on a VNNI host.
HOST_VNNI = policy.HOST_VNNI
STEP = 32  # bytes of a step: one 256-bit vector of codes


def _step_sums(builder, w, x, vnni: bool):
    """<8 x i32>: lane l the sum of the products of bytes 4l..4l+3 of the <32 x i8> vectors `w` (unsigned) and `x`
    (signed)."""
    i32 = ir.IntType(32)
    v8i32 = ir.VectorType(i32, 8)
    if vnni:
        fn = builder.module.declare_intrinsic("llvm.x86.avx512.vpdpbusd.256", (),
                                              ir.FunctionType(v8i32, [v8i32] * 3))
        return builder.call(fn, [ir.Constant(v8i32, None), builder.bitcast(w, v8i32), builder.bitcast(x, v8i32)])
    v32i32 = ir.VectorType(i32, STEP)
    prod = builder.mul(builder.zext(w, v32i32), builder.sext(x, v32i32))
    quads = [builder.shuffle_vector(prod, ir.Constant(v32i32, None),
                                    ir.Constant(v8i32, [4 * lane + j for lane in range(8)])) for j in range(4)]
    return builder.add(builder.add(quads[0], quads[1]), builder.add(quads[2], quads[3]))


class _Emit:
    """LLVM IR helpers over one intrinsic call's builder and arguments."""

    def __init__(self, context, builder, signature, args):
        self.context, self.b, self.sig, self.args = context, builder, signature, args
        self.intp = context.get_value_type(types.intp)

    def const(self, v: int):
        return ir.Constant(self.intp, v)

    def index(self, k: int):
        """Argument k (an integer) as an intp."""
        return self.context.cast(self.b, self.args[k], self.sig.args[k], types.intp)

    def load(self, k: int, elem, index, vec=None, align: int = 1):
        """A load of `elem` (or of vector type `vec`) at element offset argument k + 1 plus `index` of array
        argument k."""
        data = self.context.make_array(self.sig.args[k])(self.context, self.b, self.args[k]).data
        p = self.b.gep(self.b.bitcast(data, ir.PointerType(elem)), [self.b.add(self.index(k + 1), index)])
        return self.b.load(self.b.bitcast(p, ir.PointerType(vec)) if vec else p, align=align)

    def lanes(self, v, idx):
        """The vector of lanes `idx` of vector `v`."""
        return self.b.shuffle_vector(v, ir.Constant(v.type, None), ir.Constant(ir.VectorType(ir.IntType(32), len(idx)),
                                                                               idx))

    def pick(self, a, c, idx):
        """The vector of lanes `idx` of vectors `a` and `c` side by side (lanes of `c` from a's width on)."""
        return self.b.shuffle_vector(a, c, ir.Constant(ir.VectorType(ir.IntType(32), len(idx)), idx))

    def fma(self, a, x, acc):
        t = a.type
        fn = self.b.module.declare_intrinsic(f"llvm.fma.v{t.count}f32", (), ir.FunctionType(t, [t] * 3))
        return self.b.call(fn, [a, x, acc])

    def across(self, v):
        """The sum of the lanes of f32 vector `v`, added pairwise (an order fixed here)."""
        width = v.type.count
        while width > 1:
            width //= 2
            v = self.b.fadd(self.lanes(v, list(range(width))), self.lanes(v, list(range(width, 2 * width))))
        return self.b.extract_element(v, ir.Constant(ir.IntType(32), 0))

    def loop2(self, n, step, acc_type):
        """Two accumulators of `acc_type` (zero) over steps s < n, `step(s, acc)` giving the next, alternating
        (one accumulator's chain of multiply-adds would bound the loop by their latency); returns their sum."""
        b = self.b
        accs = [cgutils.alloca_once_value(b, ir.Constant(acc_type, None)) for _ in range(2)]
        with cgutils.for_range(b, b.sdiv(n, self.const(2)), intp=self.intp) as loop:
            s = b.mul(loop.index, self.const(2))
            for j, acc in enumerate(accs):
                b.store(step(b.add(s, self.const(j)) if j else s, b.load(acc)), acc)
        with b.if_then(b.icmp_signed("==", b.srem(n, self.const(2)), self.const(1))):
            b.store(step(b.sub(n, self.const(1)), b.load(accs[0])), accs[0])
        return b.fadd(b.load(accs[0]), b.load(accs[1]))


@intrinsic(prefer_literal=True)
def dot_i8_blocks(typingctx, w, wo, x, xo, sw, swo, sx, sxo, steps, group):
    """sum over s < steps, e < 32 of sw[swo + (32 s + e) / group] * sx[sxo + s] * w_e * x_e, with w_e the unsigned
    byte at byte offset wo + 32 s + e of array `w` and x_e the signed byte at xo + 32 s + e of array `x`, each
    group's byte products summed as integers (exact) and then scaled. `group` a literal 4, 8, 16 or 32."""
    if not (isinstance(w, types.Array) and isinstance(x, types.Array) and isinstance(group, types.IntegerLiteral)
            and group.literal_value in (4, 8, 16, 32)):
        return None
    g = group.literal_value

    def codegen(context, builder, signature, args):
        e = _Emit(context, builder, signature, args)
        f32, i8 = ir.FloatType(), ir.IntType(8)
        v8f32, code_t = ir.VectorType(f32, 8), ir.VectorType(i8, STEP)
        per_step = STEP // g  # weight scales a step
        scales_t = ir.VectorType(f32, per_step)

        def step(s, acc):
            at = builder.mul(s, e.const(STEP))
            sums = builder.sitofp(_step_sums(builder, e.load(0, i8, at, code_t), e.load(2, i8, at, code_t),
                                             HOST_VNNI), v8f32)
            # Lane l holds bytes 4l..4l+3: the weight scale of group 4l / g, times the step's activation scale.
            w_scales = e.lanes(e.load(4, f32, builder.mul(s, e.const(per_step)), scales_t, 4),
                               [4 * lane // g for lane in range(8)])
            x_scale = e.lanes(builder.insert_element(ir.Constant(v8f32, None), e.load(6, f32, s),
                                                     ir.Constant(ir.IntType(32), 0)), [0] * 8)
            return e.fma(sums, builder.fmul(w_scales, x_scale), acc)

        n = e.index(8)
        if g != STEP:
            return e.across(e.loop2(n, step, v8f32))

        def eight(b, acc):
            # Steps 8b .. 8b+7 (a scale each): their eight sum vectors added across into one vector of eight sums
            # (a transposing tree of shuffles and adds), converted and scaled at once.
            s0 = builder.mul(b, e.const(8))
            sums = [_step_sums(builder, e.load(0, i8, at, code_t), e.load(2, i8, at, code_t), HOST_VNNI)
                    for at in (builder.mul(builder.add(s0, e.const(j)), e.const(STEP)) for j in range(8))]
            for width in (1, 2, 4):  # pairs (a, c): lane i of a run from `a` (i // width even) or `c` (odd)
                first = [i if i // width % 2 == 0 else i + 8 - width for i in range(8)]
                second = [i + width if i // width % 2 == 0 else i + 8 for i in range(8)]
                sums = [builder.add(e.pick(a, c, first), e.pick(a, c, second)) for a, c in zip(sums[::2], sums[1::2])]
            scales = builder.fmul(e.load(4, f32, s0, v8f32, 4), e.load(6, f32, s0, v8f32, 4))
            return e.fma(builder.sitofp(sums[0], v8f32), scales, acc)

        whole = builder.mul(builder.sdiv(n, e.const(8)), e.const(8))
        acc = cgutils.alloca_once_value(builder, e.loop2(builder.sdiv(n, e.const(8)), eight, v8f32))
        with cgutils.for_range(builder, builder.sub(n, whole), intp=e.intp) as loop:
            builder.store(step(builder.add(whole, loop.index), builder.load(acc)), acc)
        return e.across(builder.load(acc))

    return types.float32(w, wo, x, xo, sw, swo, sx, sxo, steps, group), codegen


@intrinsic
def dot_f32(typingctx, a, ao, b, bo, n):
    """sum over i < n of a[ao + i] * b[bo + i], f32 arrays `a` and `b`: eight lanes at a time (in two vector
    accumulators), added across at the end, then the last n % 8 products in order."""
    if not (isinstance(a, types.Array) and isinstance(b, types.Array)):
        return None

    def codegen(context, builder, signature, args):
        e = _Emit(context, builder, signature, args)
        f32 = ir.FloatType()
        v8f32 = ir.VectorType(f32, 8)
        n = e.index(4)

        def step(s, acc):
            at = builder.mul(s, e.const(8))
            return e.fma(e.load(0, f32, at, v8f32, 4), e.load(2, f32, at, v8f32, 4), acc)

        total = cgutils.alloca_once_value(builder, e.across(e.loop2(builder.sdiv(n, e.const(8)), step, v8f32)))
        with cgutils.for_range(builder, builder.srem(n, e.const(8)), intp=e.intp) as loop:
            i = builder.add(builder.mul(builder.sdiv(n, e.const(8)), e.const(8)), loop.index)
            builder.store(builder.fadd(builder.load(total), builder.fmul(e.load(0, f32, i), e.load(2, f32, i))), total)
        return builder.load(total)

    return types.float32(a, ao, b, bo, n), codegen

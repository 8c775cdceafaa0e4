"""Native forms of IR intrinsics for the CPU target, imported by its generated kernels (`codegen/cpu.py`).

The f16 conversions are LLVM `half` casts (`codegen/numba_intrinsics.py`): one vectorizable instruction on
hosts with f16 conversions (F16C on x86-64 since 2012, every AArch64), where the portable helper costs tens of
scalar instructions a scale in a quantized dot product's block loop.

`dot_i8_pair` (the block-scaled int8 dot products of the CPU's prefill matmul, `tile_matmul_q8_kernel`: one
row against two tokens) is written in LLVM IR: Numba's integer arithmetic is 64-bit and LLVM's vectorizer does
not turn a loop of it back into byte dot products. The weights' bytes are unsigned and the activations' signed, as
x86's `vpdpbusd` takes them: on a host with AVX-512 VNNI or AVX-VNNI (`policy.HOST_VNNI`) four byte products a
lane are that one instruction; elsewhere plain LLVM integer vectors (widened, multiplied, added in fours), which
every LLVM target lowers correctly. Row and codes lie in chunks of eight 32-byte steps, a 32-byte load holding a
word of each step (`chunked_byte`), so that a chunk's eight products leave one sum vector, a lane a step, scaled
by one vector of scales: no adding across lanes per step (each step's eight partial sums were added across by a
tree of shuffles, about as many instructions as the products).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from polystrata.codegen import numba_intrinsics, policy

f16_to_f32 = intrinsic(numba_intrinsics.f16_to_f32)
f32_to_f16 = intrinsic(numba_intrinsics.f32_to_f16)


# Which form `dot_i8_pair` takes, read when a kernel is compiled (Numba's cache keys machine code by the host CPU
# and its features): the host policy's finding; a test sets it False to compile the portable form on a VNNI host.
HOST_VNNI = policy.HOST_VNNI
STEP = 32  # bytes of a step: one 256-bit vector of codes


def _step_sums(builder, w, x, vnni: bool, acc=None):
    """<8 x i32>: lane l the sum of the products of bytes 4l..4l+3 of the <32 x i8> vectors `w` (unsigned) and `x`
    (signed), plus lane l of `acc` (an <8 x i32>, or zero)."""
    i32 = ir.IntType(32)
    v8i32 = ir.VectorType(i32, 8)
    acc = acc if acc is not None else ir.Constant(v8i32, None)
    if vnni:
        fn = builder.module.declare_intrinsic("llvm.x86.avx512.vpdpbusd.256", (),
                                              ir.FunctionType(v8i32, [v8i32] * 3))
        return builder.call(fn, [acc, builder.bitcast(w, v8i32), builder.bitcast(x, v8i32)])
    v32i32 = ir.VectorType(i32, STEP)
    prod = builder.mul(builder.zext(w, v32i32), builder.sext(x, v32i32))
    quads = [builder.shuffle_vector(prod, ir.Constant(v32i32, None),
                                    ir.Constant(v8i32, [4 * lane + j for lane in range(8)])) for j in range(4)]
    return builder.add(acc, builder.add(builder.add(quads[0], quads[1]), builder.add(quads[2], quads[3])))


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

    def load(self, k: int, elem, index, vec=None, align: int = 1, base=None):
        """A load of `elem` (or of vector type `vec`) at element offset `base` (default: argument k + 1) plus
        `index` of array argument k."""
        data = self.context.make_array(self.sig.args[k])(self.context, self.b, self.args[k]).data
        base = self.index(k + 1) if base is None else base
        p = self.b.gep(self.b.bitcast(data, ir.PointerType(elem)), [self.b.add(base, index)])
        return self.b.load(self.b.bitcast(p, ir.PointerType(vec)) if vec else p, align=align)

    def lanes(self, v, idx):
        """The vector of lanes `idx` of vector `v`."""
        return self.b.shuffle_vector(v, ir.Constant(v.type, None), ir.Constant(ir.VectorType(ir.IntType(32), len(idx)),
                                                                               idx))

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


CHUNK = 8  # steps (32-byte blocks) of a chunk of `dot_i8_pair`'s layout


def chunked_byte(e, k: int):
    """Where byte `e` of a row of `k` (`e` an int or an IR expression) lies in `dot_i8_pair`'s layout: the row's
    first steps (32 bytes), a multiple of CHUNK, in chunks: in chunk c, word v of step 8c + l at bytes 256c + 32v +
    4l (so that one 32-byte load holds a word of each of the chunk's eight steps); the steps after them as they
    are."""
    full = k // STEP // CHUNK * CHUNK
    s, j = e // STEP, e % STEP
    inside = s // CHUNK * (CHUNK * STEP) + j // 4 * STEP + s % CHUNK * 4 + j % 4
    if isinstance(e, int):
        return inside if s < full else e
    if full * STEP == k:  # no steps after the chunks (rows of K-quants): no select for the compiler to unroll
        return inside
    from polystrata.ir.expr import Select

    return Select(s < full, inside, e)


@intrinsic(prefer_literal=True)
def dot_i8_pair(typingctx, out, oi, w, wo, x, xo0, xo1, sw, swo, sx, sxo0, sxo1, steps, group):
    """The block-scaled int8 dot products of a row of weights with two tokens' activations: returns token 0's and
    writes token 1's to out[oi]. Each is the sum over s < steps, e < 32 of sw[swo + (32 s + e) / group] *
    sx[sxo + s] * w_e * x_e, w_e the unsigned byte e of step s of array `w` from byte wo, x_e the signed byte of
    array `x` from byte xo (xo0, sxo0 for token 0, xo1, sxo1 for token 1), both in `chunked_byte`'s layout with
    full = steps // 8 * 8; each group's byte products summed as integers, then scaled. The weight scales of a chunk
    with `group` 16 lie as its first halves' eight, then its second halves' eight. `group` a literal 16 or 32.

    A chunk is 8 loads of each token's codes against 8 of the row's, one sum vector a token (a lane a step, no
    adding across) converted and scaled at once: the row's bytes and scales are loaded once for both tokens."""
    if not (isinstance(w, types.Array) and isinstance(x, types.Array) and isinstance(group, types.IntegerLiteral)
            and group.literal_value in (16, 32)):
        return None
    g = group.literal_value

    def codegen(context, builder, signature, args):
        e = _Emit(context, builder, signature, args)
        f32, i8, i32 = ir.FloatType(), ir.IntType(8), ir.IntType(32)
        v8f32, code_t, v8i32 = ir.VectorType(f32, 8), ir.VectorType(i8, STEP), ir.VectorType(i32, 8)
        n = e.index(12)
        xo = (e.index(5), e.index(6))
        sxo = (e.index(10), e.index(11))
        accs = [cgutils.alloca_once_value(builder, ir.Constant(v8f32, None)) for _ in range(2)]

        def codes(k, base, at):
            """The 32 bytes at byte offset `base` + `at` of array argument k."""
            return e.load(k, i8, at, code_t, base=base)

        def f32_at(k, base, at, vec=None):
            return e.load(k, f32, at, vec, 4, base)

        def broadcast(v):
            return e.lanes(builder.insert_element(ir.Constant(v8f32, None), v, ir.Constant(i32, 0)), [0] * 8)

        wo, swo = e.index(3), e.index(8)
        with cgutils.for_range(builder, builder.sdiv(n, e.const(CHUNK)), intp=e.intp) as loop:
            c = loop.index
            base = builder.mul(c, e.const(CHUNK * STEP))
            wv = [codes(2, wo, builder.add(base, e.const(STEP * v))) for v in range(8)]
            halves = 2 if g == 16 else 1  # sum vectors a token: a half-step's words each
            ws = [f32_at(7, swo, builder.add(builder.mul(c, e.const(CHUNK * halves)), e.const(CHUNK * h)), v8f32)
                  for h in range(halves)]
            for t in range(2):
                xs_scale = f32_at(9, sxo[t], builder.mul(c, e.const(CHUNK)), v8f32)
                acc = builder.load(accs[t])
                for h in range(halves):
                    sums = ir.Constant(v8i32, None)
                    for v in range(h * 8 // halves, (h + 1) * 8 // halves):
                        sums = _step_sums(builder, wv[v], codes(4, xo[t], builder.add(base, e.const(STEP * v))),
                                          HOST_VNNI, sums)
                    acc = e.fma(builder.sitofp(sums, v8f32), builder.fmul(ws[h], xs_scale), acc)
                builder.store(acc, accs[t])
        whole = builder.mul(builder.sdiv(n, e.const(CHUNK)), e.const(CHUNK))
        with cgutils.for_range(builder, builder.sub(n, whole), intp=e.intp) as loop:
            # The steps after the chunks: lane l of a step's sums holds bytes 4l..4l+3, of weight group 4l / g.
            st = builder.add(whole, loop.index)
            at = builder.mul(st, e.const(STEP))
            wv = codes(2, wo, at)
            per = STEP // g
            ws = e.lanes(f32_at(7, swo, builder.mul(st, e.const(per)), ir.VectorType(f32, per)),
                         [4 * lane // g for lane in range(8)])
            for t in range(2):
                sums = builder.sitofp(_step_sums(builder, wv, codes(4, xo[t], at), HOST_VNNI), v8f32)
                scale = builder.fmul(ws, broadcast(f32_at(9, sxo[t], st)))
                builder.store(e.fma(sums, scale, builder.load(accs[t])), accs[t])
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        builder.store(e.across(builder.load(accs[1])), builder.gep(data, [e.index(1)]))
        return e.across(builder.load(accs[0]))

    return types.float32(out, oi, w, wo, x, xo0, xo1, sw, swo, sx, sxo0, sxo1, steps, group), codegen


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

"""Building blocks shared by the matmul-like recipes: activation int8 quantization and per-block dot products.

Two dot-product paths, both generated from the format description (`codegen.dequant`):

* int8 path (formats whose value factors as `S_g * level + M_g`): the activations are quantized per 32 elements
  to int8 (`xq`, with scale `xd = max|x| / 127`) once per group into local arrays, and each weight group
  accumulates the integer `sum(level * xq)` (and `sum(xq)` when there is an offset), scaled once:
  `S_g * xd * isum + M_g * xd * xsum`. Integer sums vectorize without fast-math and avoid per-element floats.
* f32 path (everything else, or knob int8=0): per-element decoded values times f32 activations. With `part`
  (the CPU default, knob vert) the products go to per-element partial sums in a local array, `p[e] += w_e * x_e`
  over all blocks, summed once per dot product: a vertical update (no reduction inside the element loop), which
  a compiler vectorizes without reassociating float sums.

`nonneg` (with one lane) masks each block's base addresses with `NONNEG`, a no-op on valid indices that tells a
compiler the indices are non-negative (Numba otherwise wraps every signed index like Python, which defeats
vectorization).
"""

from __future__ import annotations

from polystrata.codegen.dequant import Decoder, affine, block_stride, groups, widen
from polystrata.ir.kernel import Assign, Call, Cast, Decl, For, If, LaneFor, Let, Load, Select, Store
from polystrata.ir.quant import Const, Expr, QuantFormat, Var

QB = 32  # activation quantization block
NONNEG = (1 << 31) - 1  # index mask: see the module docstring


def nonneg_mask(bound: int) -> int:
    """The NONNEG mask for indices below `bound`: 31 bits (a 32-bit constant every target takes) unless more."""
    return NONNEG if bound <= NONNEG + 1 else (1 << 62) - 1


def fmt_for(fmt: QuantFormat) -> QuantFormat:
    """The format as the kernels walk it (one-element formats widened to 32-element blocks)."""
    return widen(fmt, 32)


def use_int8(fmt: QuantFormat, want: bool) -> bool:
    """Whether the int8-activation path applies to `fmt` (affine with groups dividing the activation block)."""
    a = affine(fmt_for(fmt))
    return bool(want) and a is not None and QB % a.group == 0 and fmt_for(fmt).block_size % QB == 0


def quantize_x(x: str, xq: str, xd: str, t0: Expr, nt: Expr, tt_max: int, k: int, idx: str = "qa") -> list:
    """LaneFor quantizing x rows t0..t0+nt (row length k) to int8 `xq[tt*k + e]` with scales `xd[tt*k/32 + blk]`."""
    na = k // QB
    tt, blk = Var(f"{idx}_t"), Var(f"{idx}_b")
    xo = Var(f"{idx}_xo")
    e = Var(f"{idx}_e")
    amax, inv = f"{idx}_amax", f"{idx}_inv"
    v = Var(f"{idx}_v")
    body = (
        Let(tt.name, Var(idx) // na), Let(blk.name, Var(idx) % na),
        If(tt < nt, (
            Let(xo.name, (t0 + tt) * k + blk * QB),
            Decl(amax, "f32", Const(0.0)),
            For(e.name, Const(0), Const(QB), (Assign(amax, Call("max", Var(amax), Call("abs", Load(x, xo + e)))),)),
            Let(inv, Select(Var(amax) > 0.0, Const(127.0) / Var(amax), Const(0.0))),
            Store(xd, Var(idx), Var(amax) / 127.0),
            For(e.name, Const(0), Const(QB), (
                Let(v.name, Load(x, xo + e) * Var(inv)),
                # round half away from zero, as roundf
                Store(xq, tt * k + blk * QB + e, Cast("i32", v + Select(v < 0.0, Const(-0.5), Const(0.5)))),
            )),
        )),
    )
    return [LaneFor(idx, Const(tt_max * na), body)]


class Act:
    """Where a dot product's activations come from: an f32 buffer, or int8 codes + scales in local arrays."""

    def __init__(self, buf: str, k: int, xq: str | None = None, xd: str | None = None):
        self.buf, self.k, self.xq, self.xd = buf, k, xq, xd

    @property
    def int8(self) -> bool:
        return self.xq is not None


def block_dot(fmt: QuantFormat, wbuf: str, row_base: Expr, b: Expr, act: Act, t: Expr, acc: str,
              prefix: str, part: tuple[str, Expr] | None = None, nonneg: int = 0,
              f16_arith: bool = False) -> list:
    """Statements adding block `b` of the weight row at `row_base` dotted with activation row `t` into `acc`.

    `t` indexes the activation rows (a local token index for the int8 arrays, a buffer row otherwise).
    `part` = (local f32 array, offset): f32 path only, add the products to `array[offset + e]` (e < block size)
    instead of `acc` (see the module docstring); `nonneg`: 0, or the mask (`nonneg_mask` of the weight buffer's
    size) for the weight base address (activation addresses use NONNEG); `f16_arith` see `Decoder`.
    """
    wf = fmt_for(fmt)
    bs = wf.block_size
    wb = row_base + b * block_stride(wf)
    xo = t * act.k + b * bs
    head = []
    if nonneg:
        head.append(Let(f"{prefix}wb", wb & nonneg))
        wb = Var(f"{prefix}wb")
        xo = xo & NONNEG
    dec = Decoder(wf, wbuf, wb, prefix, f16_arith)
    xoff = Var(f"{prefix}xo")
    head.append(Let(xoff.name, xo))
    if act.int8:
        a = affine(wf)
        lvl_q = act.xq

        gs = groups(wf)
        finest = gs[-2] if len(gs) > 1 else 1

        def names(c):
            g = c - c % finest  # accumulators per group: unique names (C targets reject redeclaration)
            return f"{prefix}is{g}", f"{prefix}xs{g}"

        def chunk(c, L, i0, env, lw):
            q = Load(lvl_q, xoff + c + Var(i0))
            is_, xs = names(c)
            st = [Assign(is_, Var(is_) + lw.expr(a.level) * q)]
            if a.offset is not None:
                st.append(Assign(xs, Var(xs) + q))
            return st

        def group(start, size, env, inner):
            is_, xs = names(start)
            st = [Decl(is_, "i32", Const(0))]
            if a.offset is not None:
                st.append(Decl(xs, "i32", Const(0)))
            st += inner
            dx = Load(act.xd, (xoff + start) // QB)  # xoff is a multiple of 32; xd is indexed per 32 elements
            term = dec.group_expr(a.scale, start, env) * dx * Cast("f32", Var(is_))
            if a.offset is not None:
                term = term + dec.group_expr(a.offset, start, env) * dx * Cast("f32", Var(xs))
            return [*st, Assign(acc, Var(acc) + term)]

        return head + dec.walk(group, chunk)

    if part is not None:
        pbuf, poff = part

        def chunk_p(c, L, i0, env, lw):
            pi = poff + c + Var(i0)
            return [Store(pbuf, pi, Load(pbuf, pi) + dec.value(lw) * Load(act.buf, xoff + c + Var(i0)))]

        return head + dec.walk(lambda s, n, env, inner: inner, chunk_p, fuse=True)

    def chunk_f(c, L, i0, env, lw):
        return [Assign(acc, Var(acc) + dec.value(lw) * Load(act.buf, xoff + c + Var(i0)))]

    return head + dec.walk(lambda s, n, env, inner: inner, chunk_f)

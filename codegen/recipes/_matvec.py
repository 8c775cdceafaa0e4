"""Building blocks shared by the matmul-like recipes: activation int8 quantization and per-block dot products.

Two dot-product paths, both generated from the format description (`codegen.dequant`):

* int8 path (formats whose value factors as `S_g * level + M_g`): the activations are quantized per 32 elements
  to int8 (`xq`, with scale `xd = max|x| / 127`) once per group into local arrays, and each weight group
  accumulates the integer `sum(level * xq)` (and `sum(xq)` when there is an offset), scaled once:
  `S_g * xd * isum + M_g * xd * xsum`. Integer sums vectorize without fast-math and avoid per-element floats.
  With packed activations (`Act.packed`: codes in u32 words, from the GPU path's quantize kernel), formats whose
  level is a byte-wise function of weight bytes (shifts, masks, ors, a constant bias; `_vec_level`) accumulate
  4 elements at a time: `dot4_i8(level word, code word)` with the level word built from one 4-byte load.
  `split_row_dot` is the GPU form: a row's dot product as a group Reduce, several lanes sharing each block.
* f32 path (everything else, or knob int8=0): per-element decoded values times f32 activations. With `part`
  (the CPU default, knob vert) the products go to per-element partial sums in a local array, `p[e] += w_e * x_e`
  over all blocks, summed once per dot product: a vertical update (no reduction inside the element loop), which
  a compiler vectorizes without reassociating float sums.

`nonneg` (with one lane) masks each block's base addresses with `NONNEG`, a no-op on valid indices that tells a
compiler the indices are non-negative (Numba otherwise wraps every signed index like Python, which defeats
vectorization). What alignment the final addresses prove (for wide loads) is `_alignment.py`'s analysis.
"""

from __future__ import annotations

import math

from polystrata.codegen.dequant import Decoder, _Aff, _Lowerer, chunk_len
from polystrata.codegen.format_analysis import (
    Affine,
    affine,
    block_stride,
    finest_group,
    inline_elem_lets,
    weight_dtype,
    widen,
)
from polystrata.codegen.recipes._alignment import ALIGN_MAX, align_of, is_int, realign
from polystrata.ir.expr import Bin, Const, Expr, Var
from polystrata.ir.formats import QuantFormat
from polystrata.ir.kernel import (
    Assign,
    Call,
    Cast,
    Decl,
    For,
    If,
    LaneFor,
    Let,
    Load,
    Reduce,
    Select,
    Store,
    substitute,
)

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
                Store(xq, tt * k + blk * QB + e, round_half_away(v)),
            )),
        )),
    )
    return [LaneFor(idx, Const(tt_max * na), body)]


def sum_partials(buf: str, base: Expr, n: int, acc: str) -> list:
    """Statements adding the `n` partial sums `buf[base:base + n]` (the f32 path's per-element sums) into `acc`:
    halves added pairwise while `n` is even, then the rest in order. Each level is a loop of independent adds,
    which a vectorizing compiler turns into a few vector adds, where `n` adds in order form one chain of `n`
    dependent adds (with 32 to 256 partials a row, the chain took as long as the row's blocks on the CPU)."""
    e = Var("e")
    out: list = []
    while n % 2 == 0:
        n //= 2
        pair = Load(buf, base + e) + Load(buf, base + n + e)
        out.append(For(e.name, Const(0), Const(n), (Store(buf, base + e, pair),)))
    out.append(For(e.name, Const(0), Const(n), (Assign(acc, Var(acc) + Load(buf, base + e)),)))
    return out


def round_half_away(v: Expr) -> Expr:
    """The i32 nearest to f32 `v`, halves away from zero, as roundf: how every int8 code here is rounded."""
    return Cast("i32", v + Select(v < 0.0, Const(-0.5), Const(0.5)))


def code_word(value, inv: Expr, word: str) -> list:
    """Statements leaving in u32 `word` the int8 codes of value(e) * inv for e = 0..3 (an Expr per element index),
    packed little-endian as `quantize_x_kernel` writes them (the same codes as `quantize_x`)."""
    e, v, code = Var(f"{word}_e"), Var(f"{word}_v"), Var(f"{word}_c")
    return [Decl(word, "u32", Cast("u32", Const(0))),
            For(e.name, Const(0), Const(4), (
                Let(v.name, value(e) * inv),
                Let(code.name, round_half_away(v)),
                Assign(word, Var(word) | (Cast("u32", code & 255) << (e * 8))),
            ))]


class Act:
    """Where a dot product's activations come from: an f32 buffer, or int8 codes + scales in local arrays
    (`packed`: in buffers, `xq` an i32 buffer of words packing 4 codes little-endian, as `quantize_x_kernel`
    writes them)."""

    def __init__(self, buf: str, k: int, xq: str | None = None, xd: str | None = None, packed: bool = False):
        self.buf, self.k, self.xq, self.xd, self.packed = buf, k, xq, xd, packed

    @property
    def int8(self) -> bool:
        return self.xq is not None


def block_dot(fmt: QuantFormat, wbuf: str, row_base: Expr, b: Expr, act: Act, t: Expr, acc: str,
              prefix: str, part: tuple[str, Expr] | None = None, nonneg: int = 0,
              split: tuple | None = None, word_loads: bool = False) -> list:
    """Statements adding block `b` of the weight row at `row_base` dotted with activation row `t` into `acc`.

    `t` indexes the activation rows (a local token index for the int8 arrays, a buffer row otherwise).
    `part` = (local f32 array, offset): f32 path only, add the products to `array[offset + e]` (e < block size)
    instead of `acc` (see the module docstring); `nonneg`: 0, or the mask (`nonneg_mask` of the weight buffer's
    size) for the weight base address (activation addresses use NONNEG);
    `split` = (sub, S) or (sub, S, runs): S lanes share the block, this one adding its share (`Decoder.walk`)
    to `acc`; `word_loads` see `Decoder`. With packed activations the loads' alignment promises are raised to
    what the final addresses prove (`realign`), so a target can merge a run's words into 16-byte loads.
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
    dec = Decoder(wf, wbuf, wb, prefix, word_loads)
    xoff = Var(f"{prefix}xo")
    head.append(Let(xoff.name, xo))
    if act.int8:
        # Word and scale indices of the block's activations: constant offsets from these (xoff is a multiple of 32
        # as blocks are), which compilers fold into the loads' addresses.
        head += [Let(f"{prefix}xw", xoff // 4), Let(f"{prefix}xb", xoff // QB)]
        a = affine(wf)
        lvl_q = act.xq

        finest = finest_group(wf)

        def names(c):
            g = c - c % finest  # accumulators per group: unique names (C targets reject redeclaration)
            return f"{prefix}is{g}", f"{prefix}xs{g}"

        wide = _wide_levels(wf, a, prefix) if act.packed else None

        def chunk(c, L, i0, env, lw):
            if wide is not None:  # 4 levels per word against 4 packed codes: dot4_i8
                word, bias = _vec_level(wf, wbuf, lw, a.level, i0, dec.base)
                xw = Load(lvl_q, Var(f"{prefix}xw") + (c // 4 + Var(i0)))
                is_, xs = names(c)
                st = [Assign(is_, Call("dot4_i8", word, xw, Var(is_)))]
                if a.offset is not None or bias:
                    st.append(Assign(xs, Call("dot4_i8", Cast("u32", Const(0x01010101)), xw, Var(xs))))
                if bias:
                    wide[names(c)[0]] = bias
                return st
            if act.packed:  # byte e of word e // 4, sign-extended
                ix = xoff + c + Var(i0)
                q = ((Cast("i32", (Load(lvl_q, ix // 4) >> ((ix % 4) * 8)) & 255) + 128) & 255) - 128
            else:
                q = Load(lvl_q, xoff + c + Var(i0))
            is_, xs = names(c)
            st = [Assign(is_, Var(is_) + lw.expr(a.level) * q)]
            if a.offset is not None:
                st.append(Assign(xs, Var(xs) + q))
            return st

        def group(start, size, env, inner):
            is_, xs = names(start)
            bias = wide.get(is_, 0) if wide is not None else 0
            st = [Decl(is_, "i32", Const(0))]
            if a.offset is not None or bias:
                st.append(Decl(xs, "i32", Const(0)))
            st += inner
            dx = Load(act.xd, Var(f"{prefix}xb") + start // QB)  # xd is indexed per 32 elements
            isum = Var(is_) - Var(xs) * bias if bias else Var(is_)
            term = dec.group_expr(a.scale, start, env) * dx * Cast("f32", isum)
            if a.offset is not None:
                term = term + dec.group_expr(a.offset, start, env) * dx * Cast("f32", Var(xs))
            return [*st, Assign(acc, Var(acc) + term)]

        out = head + dec.walk(group, chunk, wide=4 if wide is not None else 1, split=split)
        if not act.packed:
            return out
        bs_align = min(ALIGN_MAX, block_stride(wf) & -block_stride(wf))  # block bases: multiples of the block size
        xw_align = max(1, align_of(xo, {}) // 4)  # words of 4 codes
        return realign(out, wbuf, {dec.base: bs_align}, act.xq, {f"{prefix}xw": xw_align})

    if part is not None:
        pbuf, poff = part

        def chunk_p(c, L, i0, env, lw):
            pi = poff + c + Var(i0)
            return [Store(pbuf, pi, Load(pbuf, pi) + dec.value(lw) * Load(act.buf, xoff + c + Var(i0)))]

        return head + dec.walk(lambda s, n, env, inner: inner, chunk_p, fuse=True)

    def chunk_f(c, L, i0, env, lw):
        return [Assign(acc, Var(acc) + dec.value(lw) * Load(act.buf, xoff + c + Var(i0)))]

    return head + dec.walk(lambda s, n, env, inner: inner, chunk_f, split=split)


def split_row_dot(name: str, fmt: QuantFormat, wbuf: str, row_base: Expr, act: Act, t: Expr, sub: int,
                  prefix: str, runs: bool | int | str = False) -> Reduce:
    """`name` = dot(weight row at `row_base`, activation row `t`) as a group `Reduce` over the row's (block, part)
    units: `sub` lanes share each block, lane `part` taking every `sub`-th word of each chunk, or with `runs`
    (see `use_runs`) a run of consecutive words of each chunk (`block_dot`'s split). Consecutive lanes take
    consecutive blocks: one sweep of the row, coalesced word by word (interleaved) or in 16-byte pieces (runs,
    on a target that merges a run's loads)."""
    (red,) = split_dots([(name, fmt, wbuf, row_base, prefix, sub)], act, t, runs)
    return red


def split_dots(parts, act: Act, t: Expr, runs: bool | int | str = False, spread: int = 1) -> list[Reduce]:
    """`split_row_dot` for several weight rows dotted with the same activation row: `parts` are (result name,
    format, weight buffer, row base, prefix, sub), optionally with a seventh item, the part's own activation row
    (instead of `t`: one weight row dotted with several tokens' activations, whose weight loads and decoding are
    the same expressions, which compilers compute once). Rows walked alike (same block size, lanes per block and runs)
    share one Reduce, whose body loads each activation word once for all of them (the same addresses: compilers
    merge the loads); others get a Reduce each.

    `spread` > 1: each part stands for `spread` rows, and the Reduce's units cover them all, the row's units one
    after the other: unit u works on row slot `u // units` (the variable `SLOT`, which a part's row base uses)
    and yields a result per slot, `{name}_{slot}` (lanes on other slots add 0 to it). For rows with fewer units
    than a group has lanes (the MoE experts' 768 columns: 6 units of a Q4_K row), which would leave lanes idle;
    neighbouring rows lie next to each other, so the group's loads stay one contiguous sweep."""
    groups: dict[tuple, list] = {}
    for p in parts:
        fmt, sub = p[1], p[5]
        groups.setdefault((fmt_for(fmt).block_size, sub, use_runs(fmt, runs)), []).append(p)
    out = []
    for (bs, sub, _), ps in groups.items():
        units = act.k // bs * sub
        u = Var(f"{ps[0][4]}u")
        uu = Var(f"{ps[0][4]}uu") if spread > 1 else u
        body = [Let(SLOT, u // units), Let(uu.name, u % units)] if spread > 1 else []
        results = []
        for name, fmt, wbuf, row_base, prefix, _, *own_t in ps:
            acc = f"{prefix}acc"
            body += [Decl(acc, "f32", Const(0.0)),
                     *block_dot(fmt, wbuf, row_base, uu // sub, act, own_t[0] if own_t else t, acc, prefix,
                                split=(uu % sub, sub, use_runs(fmt, runs)), word_loads=True)]
            if spread > 1:
                results += [(f"{name}_{r}", Select(Var(SLOT).eq(r), Var(acc), Const(0.0))) for r in range(spread)]
            else:
                results.append((name, Var(acc)))
        (first, value), *more = results
        out.append(Reduce(first, "+", u.name, Const(units * spread), tuple(body), value, tuple(more)))
    return out


SLOT = "slot"  # `split_dots` with spread: the row slot of a unit


def group_rows(first: Expr, rows: int, n: int) -> tuple[list[Expr], list]:
    """(row index of each of a group's `rows` rows starting at `first`, clamped to the last row so that loads stay
    in bounds; the store guards: conditions under which row r exists, None when it always does)."""
    if n % rows == 0:
        return [first + r if r else first for r in range(rows)], [None] * rows
    return ([first] + [Call("min", first + r, Const(n - 1)) for r in range(1, rows)],
            [None] + [first + r < n for r in range(1, rows)])


def slot_row(first: Expr, rows: int, n: int) -> Expr:
    """With `split_dots`' spread over the `rows` rows from `first`: the row of a unit's slot, clamped as
    `group_rows` clamps (its store guards apply)."""
    row = first + Var(SLOT)
    return row if n % rows == 0 else Call("min", row, Const(n - 1))


def guarded(cond, st):
    """`st`, under `cond` unless that is None (`group_rows`' store guards)."""
    return st if cond is None else If(cond, (st,))


def spread_rows(fmts, k: int, subgroup: int, sub: int | str = "auto", runs: bool | int | str = False) -> int:
    """Rows a group of `split_dots` spreads its lanes over (1: none): where a row has fewer units than a subgroup
    has lanes, as many rows as make the units a whole number of subgroups, at most `SPREAD_MAX`."""
    units = max(k // fmt_for(f).block_size * sub_lanes(f, sub, runs) for f in fmts)
    w = max(32, subgroup)
    if units >= w:
        return 1
    return min(SPREAD_MAX, w // math.gcd(units, w))


SPREAD_MAX = 16


SUB_MAX = 4  # "auto" sub, interleaved words: lanes per block up to this many (one word of each chunk per lane at most)
RUN_WORDS = 4  # "auto" sub with runs: each lane a run of 4 words (16 bytes) of each chunk


def use_runs(fmt: QuantFormat, runs: bool | int | str = "auto") -> bool:
    """Whether `split_row_dot` gives each lane runs of words (knob runs; "auto": where chunks have at least two
    runs of `RUN_WORDS`, so that at least two lanes share a block): faster on the wide-load targets for Q4_K and
    Q8_0, slower for Q6_K (one lane per block); the H200 figures are in docs/benchmarks.md ("Matvec schedule
    knobs")."""
    if runs == "auto":
        wf = fmt_for(fmt)
        return chunk_len(wf, finest_group(wf)) // 4 >= 2 * RUN_WORDS
    return bool(int(runs))


def runs_for_target(runs: bool | int | str, wide_loads: bool) -> bool | int | str:
    """The knob runs as a target takes it: "auto" (per format, `use_runs`) where the target merges aligned loads
    (`RecipeContext.wide_loads`), else off: runs of scalar loads coalesce worse than interleaved words where the
    compiler does not merge them (NVRTC; docs/benchmarks.md, "Matvec schedule knobs")."""
    return 0 if runs == "auto" and not wide_loads else runs


def sub_lanes(fmt: QuantFormat, sub: int | str = "auto", runs: bool | int | str = False) -> int:
    """Lanes sharing one block in `split_row_dot`: the knob `sub`, or by default ("auto") with `runs` as many as
    give each lane `RUN_WORDS` consecutive words of each chunk, else one lane per word of a chunk, up to
    `SUB_MAX`. More lanes per block means fewer blocks per warp, so each warp-wide load touches fewer cache
    lines (with interleaved words the matvec is bound by L1 requests); beyond 4 it did not pay. Runs cut the
    requests instead: one 16-byte load where interleaving issues four 4-byte ones. Figures: docs/benchmarks.md
    ("Matvec schedule knobs")."""
    if sub != "auto":
        return int(sub)
    wf = fmt_for(fmt)
    words = chunk_len(wf, finest_group(wf)) // 4
    if use_runs(fmt, runs):
        return max(1, words // RUN_WORDS)
    return max(1, min(SUB_MAX, words))


def split_lanes(fmts, k: int, subgroup: int, sub: int | str = "auto", runs: bool | int | str = False) -> int:
    """Group size for `split_row_dot`s over rows of length `k`: whole subgroups (at least 32 lanes) up to 128,
    as many as cover the units of the widest row."""
    units = max(k // fmt_for(f).block_size * sub_lanes(f, sub, runs) for f in fmts)
    w = max(32, subgroup)
    return w * max(1, min(128 // w, -(-units // w)))


# --- wide (4 elements per word) levels for dot4_i8 -------------------------------------------------------


class _NoWide(Exception):
    pass


def _wide_levels(wf: QuantFormat, a: Affine, prefix: str) -> dict | None:
    """A dict (filled by the chunks with each accumulator's level bias) when every chunk's level packs into
    words (see `_vec_level`), else None (per-element path)."""
    if weight_dtype(wf) != "u8":
        return None
    finest = finest_group(wf)
    L = chunk_len(wf, finest)
    if L % 4 or finest % 4:
        return None
    bias: dict[int, int] = {}
    try:
        for c in range(0, wf.block_size, L):
            lw = _Lowerer(wf, "_w", Var("_wb"), _ProbeEnv(), _Aff(1, c), L, "_i0")
            b = _vec_level(wf, "_w", lw, a.level, "_i0", Var("_wb"))[1]
            if bias.setdefault(c - c % finest, b) != b:
                return None  # one bias per accumulator group
    except (_NoWide, KeyError):
        return None
    return {}


class _ProbeEnv(dict):
    def __missing__(self, k):
        return Var(k)


def _vec_level(wf: QuantFormat, wbuf: str, lw, level: Expr, i0: str, base: Expr) -> tuple[Expr, int]:
    """(u32 word of the levels of elements 4*i0 .. 4*i0+3 of the chunk, bias): level_e = byte_e(word) - bias,
    each byte a signed int8 for `dot4_i8`. `base` is the block's byte address (a multiple of the block's size,
    as every row and expert offset is). Raises `_NoWide` when the level expression does not pack."""
    e = lw.expr(inline_elem_lets(wf, level))
    bs = block_stride(wf)
    ctx = (wbuf, i0, base, bs & -bs)
    bias = 0
    byte = _signed_byte(e)
    if byte is not None:
        return _vec(byte, ctx)[0], 0
    if isinstance(e, Bin) and e.op == "-" and is_int(e.b):
        e, bias = e.a, e.b.value
    w, mx = _vec(e, ctx)
    if mx > 127:
        raise _NoWide
    return w, bias


def _signed_byte(e: Expr) -> Expr | None:
    """b where level expression `e` is ((b + 128) & 255) - 128, the byte b read as a signed int8; else None."""
    if isinstance(e, Bin) and e.op == "-" and is_int(e.b, 128):
        x = e.a
        if (isinstance(x, Bin) and x.op == "&" and is_int(x.b, 255) and isinstance(x.a, Bin) and x.a.op == "+"
                and is_int(x.a.b, 128)):
            return x.a.a
    return None


def signed_byte_levels(wf: QuantFormat, lw, level: Expr) -> bool:
    """Whether `_vec_level`'s word for this chunk holds the levels as signed int8 bytes (Q8_0), not as bytes
    below 128 less a bias."""
    return _signed_byte(lw.expr(inline_elem_lets(wf, level))) is not None


_ONES = 0x01010101


def _vec(e: Expr, ctx: tuple) -> tuple[Expr, int]:
    """Packed-bytes form of a per-element integer expression in `i0`: (u32 word, max byte value).
    `ctx` = (weight buffer, i0, block base address, the power of two dividing the block's size)."""
    wbuf, i0, base, base_align = ctx
    if isinstance(e, Load):
        if e.buf != wbuf or _coef(e.index, i0) != 1:
            raise _NoWide
        index = substitute(e.index, i0, Var(i0) * 4)
        return Call("load_u32", Var(wbuf), index, Const(align_of(index, {base: base_align}, 4))), 255
    if isinstance(e, Bin) and is_int(e.b) and e.op in (">>", "<<", "&"):
        w, mx = _vec(e.a, ctx)
        s = e.b.value
        if e.op == ">>" and 0 <= s < 8:
            return (w if s == 0 else (w >> s) & ((255 >> s) * _ONES)), mx >> s
        if e.op == "<<" and 0 <= s < 8 and (mx << s) <= 255:
            return (w if s == 0 else w << s), mx << s
        if e.op == "&" and 0 <= s < 256:
            if s >= mx and (s + 1) & s == 0:
                return w, mx  # the mask keeps every bit a byte can hold
            if s < 128:
                return w & (s * _ONES), min(mx, s)
        raise _NoWide
    if isinstance(e, Bin) and e.op == "|":
        (wa, ma), (wb, mb) = _vec(e.a, ctx), _vec(e.b, ctx)
        if ma + mb > 255:
            raise _NoWide
        return wa | wb, ma + mb
    raise _NoWide


def _coef(e: Expr, i0: str) -> int | None:
    """Coefficient of Var(i0) in `e` when `e` is affine in it (+, -, * by constants), 0 when free of it."""
    if isinstance(e, Var):
        return 1 if e.name == i0 else 0
    if isinstance(e, Const):
        return 0
    if isinstance(e, Bin):
        a, b = _coef(e.a, i0), _coef(e.b, i0)
        if a is None or b is None:
            return None
        if e.op == "+":
            return a + b
        if e.op == "-":
            return a - b
        if e.op == "*" and a == 0 and is_int(e.a):
            return e.a.value * b
        if e.op == "*" and b == 0 and is_int(e.b):
            return a * e.b.value
        return 0 if a == 0 and b == 0 else None
    if isinstance(e, Load):
        return 0 if _coef(e.index, i0) == 0 else None
    if isinstance(e, Call):  # min / max of row indices (clamped rows): constant in i0 when their arguments are
        return 0 if all(_coef(a, i0) == 0 for a in e.args) else None
    return None

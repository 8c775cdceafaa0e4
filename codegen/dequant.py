"""Quantization formats (`ir.formats.QuantFormat`) -> kernel IR, derived from the description alone.

A format says how element `i` of a block decodes (`lets` + `value`). This module turns that into kernel IR that
reads a weight buffer (raw `u8` bytes; `f32` elements for the F32 format) at a run-time block address:

* `FieldLoad(field, idx)` becomes byte loads at `block_base + field.offset + idx * size`, assembled little-endian
  (u16/u32 by shifts and ors, i8 by sign extension); f16 fields go through the `f16_bits_to_f32` intrinsic and
  bf16 fields through exact arithmetic on their bits (no bit-cast intrinsic needed).
* Lets are hoisted by their `group`: block lets once per block, each group's lets once per group, per-element
  lets inside the element loop. The element loop is strip-mined: a group of `G` elements is walked in chunks
  `i = c + i0` (`c` a codegen-time constant, `0 <= i0 < L`), and index arithmetic is folded symbolically so
  that e.g. `qs[i % 16] >> 4 * (i // 16)` becomes `qs[base + i0] >> 4` for the chunk `c = 16`. `L` is picked
  as the largest power of two that keeps every index affine in `i0` (falls back to unfolded expressions).
* `Table` nodes stay as they are (targets render constant tables).

What it needs to know of a format first (let groups, index-only lets, buffer addressing, the affine factorization
dot products use) is `codegen/format_analysis.py`; where a sliced layout moves the loads, `ir/layout.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from polystrata.codegen.format_analysis import (
    block_stride,
    finest_group,
    groups,
    index_only_lets,
    inline_elem_lets,
    weight_dtype,
)
from polystrata.ir.expr import PY_OPS, Bin, Const, Expr, FieldLoad, Table, ToF32, Var
from polystrata.ir.formats import Field, QuantFormat
from polystrata.ir.kernel import Call, Cast, Decl, For, Let, Load, Select, expr_nodes, rewrite, substitute
from polystrata.ir.layout import code_field, place_slices

_SIZES = {"u8": 1, "i8": 1, "u16": 2, "bf16": 2, "f16": 2, "u32": 4, "i32": 4, "f32": 4}


# --- symbolic index values: ints, affine forms a*i0 + b (0 <= i0 < L), or opaque kernel expressions ---------


@dataclass(frozen=True)
class _Aff:
    a: int
    b: int


class _Lowerer:
    """Lowers format expressions for one element chunk `i = c + i0` (or a constant `i` for hoisted lets)."""

    def __init__(self, fmt: QuantFormat, buf: str, base: Expr, env: dict[str, Expr], i_val, span: int,
                 i0: str, word_loads: bool = False):
        self.fmt, self.buf, self.base, self.env = fmt, buf, base, env
        self.word_loads = word_loads  # fields at constant offsets out of aligned 4-byte words (see Decoder)
        self.i_val = i_val  # int or _Aff
        self.span = span  # L: the range of i0
        self.i0 = i0
        self.folded = True  # stays True while every index folds to int / affine

    # Symbolic values: int | bool | _Aff | Expr
    def sym(self, e: Expr):
        if isinstance(e, Const) and isinstance(e.value, int):
            return e.value
        if isinstance(e, Var) and e.name == "i":
            return self.i_val
        if isinstance(e, Var) and e.name in self._index_lets:
            return self.sym(self.fmt.let(e.name).expr)
        if isinstance(e, Bin) and e.op in ("+", "-", "*", "//", "%", ">>", "<<", "&", "|", "<", "<=", "==", "!="):
            a, b = self.sym(e.a), self.sym(e.b)
            r = _fold(e.op, a, b, self.span)
            if r is not None:
                return r
        if isinstance(e, Select):
            c = self.sym(e.cond)
            if isinstance(c, bool):
                return self.sym(e.a if c else e.b)
        return self.lower(e)

    @property
    def _index_lets(self) -> set[str]:
        # Integer lets whose value depends only on `i` (like K-quants' `j = i // 32`): fold them symbolically.
        return index_only_lets(self.fmt)

    def expr(self, e: Expr) -> Expr:
        """Kernel expression of a format expression."""
        return self.to_expr(self.sym(e))

    def to_expr(self, s) -> Expr:
        if isinstance(s, bool):
            return Bin("==", Const(0), Const(0 if s else 1))
        if isinstance(s, int):
            return Const(s)
        if isinstance(s, _Aff):
            v = Var(self.i0)
            if s.a != 1:
                v = v * s.a
            return v + s.b if s.b else v
        return s

    def lower(self, e: Expr) -> Expr:
        if isinstance(e, Const):
            return e
        if isinstance(e, Var):
            if e.name == "i":
                return self.to_expr(self.i_val)
            if e.name in self._index_lets:
                return self.expr(self.fmt.let(e.name).expr)
            return self.env[e.name]
        if isinstance(e, FieldLoad):
            f = self.fmt.field(e.field)
            idx = self.sym(e.index)
            if not isinstance(idx, int | _Aff):
                self.folded = False
            return self.load_field(f, idx)
        if isinstance(e, Bin):
            return Bin(e.op, self.expr(e.a), self.expr(e.b))
        if isinstance(e, Select):
            return Select(self.expr(e.cond), self.expr(e.a), self.expr(e.b))
        if isinstance(e, ToF32):
            a = e.a
            if isinstance(a, FieldLoad) and self.fmt.field(a.field).dtype in ("f16", "bf16", "f32"):
                return self.lower(a)  # float loads already decode to f32
            return Cast("f32", self.expr(a))
        if isinstance(e, Table):
            return Table(e.name, self.expr(e.index))
        raise TypeError(f"cannot lower {e!r}")

    def load_field(self, f: Field, idx) -> Expr:
        size = _SIZES[f.dtype]
        if weight_dtype(self.fmt) == "f32":  # F32 format: the buffer holds floats (base counts elements)
            return Load(self.buf, self.base + self.to_expr(idx) if idx != 0 else self.base)
        off = _add(_mul(idx, size), f.offset)

        def byte(k: int) -> Expr:  # the block base plus one offset (what `place_slices` moves)
            at = _add(off, k)
            return Load(self.buf, self.base + self.to_expr(at) if at != 0 else self.base)

        if f.dtype == "f32":
            raise NotImplementedError(f"{self.fmt.name}: f32 fields inside byte blocks need a bit-cast")
        bs = block_stride(self.fmt)
        align = min(4, bs & -bs)  # block bases are multiples of the block size
        if self.word_loads and isinstance(off, int) and size < 4 and align >= 2:
            w0 = off - off % align
            if off + size <= w0 + 4 <= self.fmt.block_bytes:  # one word inside the block holds the field
                at = self.base + w0 if w0 else self.base
                # The promise: what divides both the block's size and w0 (16 at most, the widest load).
                promise = min(16, bs & -bs, w0 & -w0 if w0 else 16)
                bits = Call("load_u32", Var(self.buf), at, Const(promise))
                word = (bits >> 8 * (off - w0) if off > w0 else bits) & ((1 << 8 * size) - 1)
                # A signed int, as a byte load is: the format's arithmetic on it may go negative.
                return _field_value(f.dtype, Cast("i32", word))
        if f.dtype in ("u8", "i8"):
            return _field_value(f.dtype, byte(0))
        word = byte(0)
        for k in range(1, size):
            word = word | (byte(k) << (8 * k))
        return _field_value(f.dtype, word)


def _field_value(dtype: str, word: Expr) -> Expr:
    """The value of a field from its little-endian bits `word`."""
    if dtype == "i8":
        return ((word + 128) & 255) - 128  # sign-extend without branches
    if dtype == "f16":
        return Call("f16_bits_to_f32", word)
    if dtype == "bf16":
        return bf16_bits_to_f32(word)
    return word  # u8 / u16 / u32 / i32: integer bits (shifts and masks see the same bits)


def bf16_bits_to_f32(h: Expr) -> Expr:
    """Exact f32 of bf16 bits `h` from integer arithmetic: (-1)^s * (128 + m) * 2^(e - 134) (subnormals too).

    Infinities and NaNs (e == 255) are not special-cased: weights never hold them.
    """
    e = (h >> 7) & 255
    m = h & 127
    mag = Select(e.eq(0), Cast("f32", m) * float(2.0**-133),
                 Cast("f32", m + 128) * Call("pow", 2.0, Cast("f32", e - 134)))
    return Select(((h >> 15) & 1).eq(1), Const(0.0) - mag, mag)


def _mul(x, k: int):
    if isinstance(x, int):
        return x * k
    if isinstance(x, _Aff):
        return _Aff(x.a * k, x.b * k)
    return x * k if k != 1 else x


def _add(x, k: int):
    if isinstance(x, int):
        return x + k
    if isinstance(x, _Aff):
        return _Aff(x.a, x.b + k)
    return x + k if k else x


def _fold(op: str, a, b, span: int):
    """Constant / affine folding of `a op b`; None when the result is not int, bool or affine."""
    ints = isinstance(a, int) and not isinstance(a, bool) and isinstance(b, int) and not isinstance(b, bool)
    if ints:
        return PY_OPS[op](a, b)
    if isinstance(a, _Aff) and isinstance(b, int) and not isinstance(b, bool):
        lo, hi = a.b, a.b + a.a * (span - 1)  # a.a >= 0 in every format
        if op == "+":
            return _Aff(a.a, a.b + b)
        if op == "-":
            return _Aff(a.a, a.b - b)
        if op == "*":
            return _Aff(a.a * b, a.b * b)
        if op in ("//", ">>") and lo >= 0:
            m = b if op == "//" else 1 << b
            if lo // m == hi // m:
                return lo // m
            if a.b % m == 0 and a.a % m == 0:
                return _Aff(a.a // m, a.b // m)
        if op in ("%", "&") and lo >= 0:
            m = b if op == "%" else b + 1
            if op == "&" and (m & (m - 1)):
                return None
            if lo // m == hi // m:
                return _Aff(a.a, a.b - (lo // m) * m)
        if op in ("<", "<=", "==", "!="):
            vals = [PY_OPS[op](lo, b), PY_OPS[op](hi, b)]
            if op in ("<", "<=") and vals[0] == vals[1]:
                return vals[0]
    if isinstance(a, int) and isinstance(b, _Aff) and op == "+":
        return _Aff(b.a, b.b + a)
    if isinstance(a, int) and isinstance(b, _Aff) and op == "*":
        return _Aff(b.a * a, b.b * a)
    return None


# --- hoisting plan -----------------------------------------------------------------------------------------


def chunk_len(fmt: QuantFormat, group: int) -> int:
    """Largest power-of-two chunk L dividing `group` for which every per-element index folds to affine form."""
    exprs = [lt.expr for lt in fmt.lets if lt.group == 1] + ([fmt.value] if fmt.value is not None else [])
    cand = group
    while cand > 1:
        if group % cand == 0 and all(_chunk_folds(fmt, e, cand, c) for c in range(0, fmt.block_size, cand)
                                     for e in exprs):
            return cand
        cand //= 2
    return 1


def _chunk_folds(fmt: QuantFormat, e: Expr, span: int, c: int) -> bool:
    lw = _Lowerer(fmt, "_w", Const(0), _FakeEnv(), _Aff(1, c), span, "_i0")
    lw.expr(e)
    return lw.folded


class _FakeEnv(dict):
    def __missing__(self, k):
        return Var(k)


@dataclass(frozen=True)
class Decoder:
    """Kernel IR for decoding one block of `fmt` from buffer `buf` at element address `base`.

    Names of emitted lets are prefixed with `prefix` so several decoders can share a kernel body.
    """

    fmt: QuantFormat
    buf: str
    base: Expr
    prefix: str
    # Fields at constant offsets (scales, sub-block metadata) read out of aligned 4-byte words of the block: one
    # load (shared by the fields in it) instead of a load per byte (GPU paths; the base is a multiple of the
    # block size, as row, expert and cache-row bases are).
    word_loads: bool = False

    def _env_name(self, let: str) -> str:
        return f"{self.prefix}{let}"

    def lets_for(self, group: int, start: int, env: dict[str, Expr], i_val=None, span: int = 1,
                 i0: str = "_i0", names: set[str] | None = None, suffix: str = "") -> list:
        """`Let` statements for the lets of exactly `group` (evaluated at element `start`); updates env."""
        out = []
        lw = _Lowerer(self.fmt, self.buf, self.base, env, start if i_val is None else i_val, span, i0,
                       self.word_loads)
        idx_only = index_only_lets(self.fmt)
        for lt in self.fmt.lets:
            if lt.group != group or lt.name in idx_only or (names is not None and lt.name not in names):
                continue
            name = self._env_name(lt.name) + (suffix if group == 1 else f"_{start}")
            out.append(Let(name, lw.expr(lt.expr)))
            env[lt.name] = Var(name)
        return out

    def walk(self, emit_group: Callable, emit_chunk: Callable, lo: int = 0, hi: int | None = None,
             fuse: bool = False, wide: int = 1, split: tuple | None = None) -> list:
        """Statements visiting the block's elements [lo, hi) with hoisted lets.

        `emit_group(start, size, env, stmts_inside)` wraps the statements of the finest group (it can add
        per-group accumulators); `emit_chunk(c, L, i0, env, lowerer)` returns statements for one chunk's inner
        loop body (i = c + i0).

        `fuse`: all group lets first, then ONE loop over i0 whose body holds every chunk's statements (per-element
        lets get a per-chunk suffix); `emit_group` is not called. For chunk bodies that do not depend on each
        other's order: one longer loop body is what a CPU compiler vectorizes (several 16-trip loops get fully
        unrolled instead, and then stay scalar).

        `wide` > 1 (dividing every chunk length): each chunk loop runs `L // wide` times, `i0` counting words of
        `wide` elements, and per-element lets are not emitted: `emit_chunk` gets the lowerer of the element
        index `c + i0` and builds its word-wise statements itself (e.g. with `inline_elem_lets`).

        `split` = (sub, S) or (sub, S, runs): the block is shared by S lanes, lane `sub` (0 <= sub < S) taking the
        chunk iterations i0 = sub, sub + S, ... (neighbouring lanes read neighbouring words), or with `runs` (and
        `wide` > 1, chunk bodies without lets) a run of consecutive ones, i0 = sub * R .. sub * R + R - 1,
        unrolled with i0 substituted so that each address is a run start plus a constant (what a target needs
        to merge the run's loads into one wide load). Group lets are evaluated by every lane; `emit_group`'s
        accumulation must be linear in the chunk statements (partial sums per lane).
        """
        if fuse:
            return self._walk_fused(emit_chunk, lo, self.fmt.block_size if hi is None else hi)
        return place_slices(self._walk(emit_group, emit_chunk, lo, hi, wide, split), self.buf, self.base, self.fmt)

    def _walk(self, emit_group: Callable, emit_chunk: Callable, lo: int, hi: int | None, wide: int,
              split: tuple | None) -> list:
        hi = self.fmt.block_size if hi is None else hi
        gs = groups(self.fmt)
        finest = finest_group(self.fmt)
        L = chunk_len(self.fmt, finest)
        i0 = f"{self.prefix}i0"
        env: dict[str, Expr] = {}
        stmts = self.lets_for(gs[0], 0, env) if gs[0] != 1 else []

        def rec(level: int, start: int, size: int) -> list:
            # level indexes gs; the group of `size` elements at `start` has had its lets emitted.
            if size == finest:
                inner = []
                for c in range(start, start + size, L):
                    if c + L <= lo or c >= hi:
                        continue
                    once = split is not None and split[1] == L // wide  # one iteration per lane: no loop
                    ic = f"{i0}_{c}" if once else i0  # (a name per chunk: C rejects redeclared names)
                    lw = _Lowerer(self.fmt, self.buf, self.base, dict(env), _Aff(1, c), L, ic,
                                  self.word_loads)
                    body = (self.lets_for(1, c, lw.env, _Aff(1, c), L, ic, suffix=f"_c{c}" if once else "")
                            if finest != 1 and wide == 1 else [])
                    body += emit_chunk(c, L, ic, lw.env, lw)
                    runs = split is not None and len(split) > 2 and split[2] and wide > 1 \
                        and (L // wide) % split[1] == 0 and not any(isinstance(s, Let | Decl) for s in body)
                    if split is None:
                        inner.append(For(i0, Const(0), Const(L // wide), tuple(body)))
                    elif runs:  # this lane's run of R consecutive words, unrolled: addresses base + constant
                        r = L // wide // split[1]
                        run0 = split[0] * r if r > 1 else split[0]
                        for m in range(r):
                            inner += substitute(body, ic, run0 + m if m else run0)
                    elif once:
                        inner += [Let(ic, split[0]), *body]
                    elif (L // wide) % split[1] == 0:  # a constant trip count (unrolled by compilers)
                        m = f"{i0}m"
                        inner.append(For(m, Const(0), Const(L // wide // split[1]),
                                         (Let(i0, split[0] + Var(m) * split[1]), *body)))
                    else:
                        inner.append(For(i0, split[0], Const(L // wide), tuple(body), step=split[1]))
                return emit_group(start, size, dict(env), inner)
            out = []
            sub = gs[level + 1]
            for s in range(start, start + size, sub):
                if s + sub <= lo or s >= hi:
                    continue
                out += self.lets_for(sub, s, env)
                out += rec(level + 1, s, sub)
            return out

        return stmts + rec(0, 0, self.fmt.block_size)

    def _walk_fused(self, emit_chunk: Callable, lo: int, hi: int) -> list:
        gs = groups(self.fmt)
        finest = finest_group(self.fmt)
        L = chunk_len(self.fmt, finest)
        i0 = f"{self.prefix}i0"
        env: dict[str, Expr] = {}
        lets = self.lets_for(gs[0], 0, env) if gs[0] != 1 else []
        body: list = []

        def rec(level: int, start: int, size: int) -> None:
            if size == finest:
                for c in range(start, start + size, L):
                    if c + L <= lo or c >= hi:
                        continue
                    lw = _Lowerer(self.fmt, self.buf, self.base, dict(env), _Aff(1, c), L, i0,
                                  self.word_loads)
                    if finest != 1:
                        body.extend(self.lets_for(1, c, lw.env, _Aff(1, c), L, i0, suffix=f"_c{c}"))
                    body.extend(emit_chunk(c, L, i0, lw.env, lw))
                return
            sub = gs[level + 1]
            for s in range(start, start + size, sub):
                if s + sub <= lo or s >= hi:
                    continue
                lets.extend(self.lets_for(sub, s, env))
                rec(level + 1, s, sub)

        rec(0, 0, self.fmt.block_size)
        return place_slices([*lets, For(i0, Const(0), Const(L), tuple(body))], self.buf, self.base, self.fmt)

    def group_expr(self, e: Expr, start: int, env: dict[str, Expr]) -> Expr:
        """A group-level format expression (scale, offset) as kernel IR, at group start `start`."""
        return _Lowerer(self.fmt, self.buf, self.base, env, start, 1, "_unused",
                        self.word_loads).expr(e)

    def value(self, lw: _Lowerer) -> Expr:
        """The element value (f32) inside a chunk."""
        return lw.expr(self.fmt.value)

    def group_lets(self) -> tuple[list, list[dict[str, Expr]]]:
        """The `Let`s of every group above single elements, hoisted as `walk` hoists them, and for each of the
        finest groups the env its elements' values see (for `code_words` picking a group at run time)."""
        gs = groups(self.fmt)
        env: dict[str, Expr] = {}
        out, envs = [], []
        for s in range(0, self.fmt.block_size, finest_group(self.fmt)):
            for g in gs[:-1]:
                if s % g == 0:
                    out += self.lets_for(g, s, env)
            envs.append(dict(env))
        return out, envs

    def code_words(self, first: Expr, envs: list[dict[str, Expr]], word: str) -> tuple[list, list[Expr]]:
        """For a format whose codes are a byte an element in aligned words (`word_codes`): statements leaving in
        u32 `word` the codes of elements `first` .. `first` + 3 (`first` a multiple of 4), one 4-byte load, and
        those elements' values (f32): the format's value with each code's byte taken out of the word. `envs`: the
        group lets' env of one group holding the elements, or of every finest group (`group_lets`), the elements'
        group's then picked at run time (into lets named after `word`)."""
        env, out = envs[0], []
        if len(envs) > 1:
            g, env = first // finest_group(self.fmt), dict(envs[-1])
            for name in [n for n in env if any(e[n] != env[n] for e in envs)]:
                pick = env[name]
                for k in range(len(envs) - 2, -1, -1):
                    pick = Select(g.eq(k), envs[k][name], pick)
                out.append(Let(f"{word}_{name}", pick))
                env[name] = Var(f"{word}_{name}")
        qf = code_field(self.fmt)
        lw = _Lowerer(self.fmt, self.buf, self.base, env, first, 1, "_unused")
        value = lw.expr(inline_elem_lets(self.fmt, self.fmt.value))  # the code a byte load at base + first
        if sum(1 for n in expr_nodes(value) if isinstance(n, Load) and n.buf == self.buf) != 1:
            raise ValueError(f"{self.fmt.name}: values read more than their code byte")
        at = self.base + (first + qf.offset if qf.offset else first)
        out.append(Let(word, Call("load_u32", Var(self.buf), at, Const(4))))
        # Each byte as a signed int, as a byte load is (the format's arithmetic on it may go negative).
        return out, [rewrite(value, lambda e, k=k: Cast("i32", (Var(word) >> 8 * k) & 255) if isinstance(e, Load)
                              and e.buf == self.buf else e) for k in range(4)]


def word_codes(fmt: QuantFormat) -> bool:
    """Whether `fmt`'s codes are a byte an element (`ir.layout.code_field`) in whole aligned 4-byte words of its
    blocks (`ir.layout.split_rows` keeps q8_0's and q8_g64's so), which `Decoder.code_words` reads."""
    qf = code_field(fmt)
    return qf is not None and qf.offset % 4 == 0 and block_stride(fmt) % 4 == 0

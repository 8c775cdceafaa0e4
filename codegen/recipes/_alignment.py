"""Alignment analysis of kernel IR addresses for the matvec recipes: the largest power of two that provably divides
an index (`align_of`), and load promises raised to it once addresses are final (`realign`), so a target can merge a
lane's run of words into one wide load.
"""

from __future__ import annotations

from polystrata.ir.expr import Bin, Const, Expr, Var
from polystrata.ir.kernel import Call, Load, rewrite


def is_int(e: Expr, v: int | None = None) -> bool:
    """Whether `e` is an integer constant (equal to `v` when given)."""
    return isinstance(e, Const) and isinstance(e.value, int) and (v is None or e.value == v)


ALIGN_MAX = 16  # the widest load a target merges (16 bytes)


def align_of(e: Expr, known: dict, cap: int = ALIGN_MAX) -> int:
    """The largest power of two up to `cap` known to divide the integer `e` (`known`: expression or variable
    name -> a power of two dividing it)."""
    if e in known:
        return min(cap, known[e])
    if isinstance(e, Var):
        return min(cap, known.get(e.name, 1))
    if isinstance(e, Const) and isinstance(e.value, int) and not isinstance(e.value, bool):
        v = e.value
        return cap if v == 0 else min(cap, v & -v)
    if isinstance(e, Bin) and e.op in ("+", "-"):
        return min(align_of(e.a, known, cap), align_of(e.b, known, cap))
    if isinstance(e, Bin) and e.op == "*":
        return min(cap, align_of(e.a, known, cap) * align_of(e.b, known, cap))
    if isinstance(e, Bin) and e.op == "<<" and is_int(e.b) and 0 <= e.b.value < 8:
        return min(cap, align_of(e.a, known, cap) << e.b.value)
    return 1


def realign(stmts: list, wbuf: str, wknown: dict, act_buf: str | None, aknown: dict) -> list:
    """`stmts` with the alignment promises of `load_u32` calls on `wbuf` (byte addresses) and of loads from
    `act_buf` (u32 words, at most 4: 16 bytes) raised to what `align_of` proves (never lowered): run once the
    addresses are final, after `Decoder.walk` has substituted each lane's word index."""

    def fn(e):
        if isinstance(e, Call) and e.fn == "load_u32" and e.args[0] == Var(wbuf):
            a = align_of(e.args[1], wknown)
            return Call("load_u32", e.args[0], e.args[1], Const(a)) if a > e.args[2].value else e
        if isinstance(e, Load) and e.buf == act_buf:
            a = align_of(e.index, aknown, 4)
            return Load(e.buf, e.index, a) if a > e.align else e
        return e

    return rewrite(stmts, fn)

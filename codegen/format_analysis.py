"""What codegen derives from a format description before lowering it: buffer addressing, let groups, the
integer lets that depend only on the element index, and the affine factorization of the value.

`affine(fmt)` factors `value` as `S_g * level + M_g` (S_g, M_g group-level, level an integer per element, a code
or a table lookup) when the tree has that shape, so dot products can accumulate `sum(level * x)` per group and
scale once (the int8-activation matvec path); `None` when it does not.
"""

from __future__ import annotations

from dataclasses import dataclass

from polystrata.ir.expr import Bin, Const, Expr, FieldLoad, Select, Table, ToF32, Var, expr_children
from polystrata.ir.formats import SLICE, Field, QuantFormat


def weight_dtype(fmt: QuantFormat) -> str:
    """IR dtype of a weight buffer of this format (the plan stores F32 tensors as f32, all else as u8 bytes)."""
    return "f32" if all(f.dtype == "f32" for f in fmt.fields) else "u8"


def elements_per_row_bytes(fmt: QuantFormat, cols: int) -> int:
    """Row stride of a [rows, cols] weight in buffer elements (bytes, or floats for F32)."""
    return cols if weight_dtype(fmt) == "f32" else cols // fmt.block_size * fmt.block_bytes


def block_stride(fmt: QuantFormat) -> int:
    """Buffer elements from one block's start to the next's: the block's size, or in a `sliced` layout one slice
    (the blocks' first slices lie side by side)."""
    if weight_dtype(fmt) == "f32":
        return fmt.block_size
    return SLICE if fmt.row_blocks else fmt.block_bytes


_INDEX_CACHE: dict[str, set[str]] = {}


def index_only_lets(fmt: QuantFormat) -> set[str]:
    """Names of the integer lets whose value depends only on `i` (like K-quants' `j = i // 32`)."""
    if fmt.name in _INDEX_CACHE:
        return _INDEX_CACHE[fmt.name]
    out: set[str] = set()
    for lt in fmt.lets:
        if _depends_only_on_i(lt.expr, out):
            out.add(lt.name)
    _INDEX_CACHE[fmt.name] = out
    return out


def _depends_only_on_i(e: Expr, ok: set[str]) -> bool:
    if isinstance(e, Const):
        return isinstance(e.value, int)
    if isinstance(e, Var):
        return e.name == "i" or e.name in ok
    if isinstance(e, Bin):
        return _depends_only_on_i(e.a, ok) and _depends_only_on_i(e.b, ok)
    if isinstance(e, Select):
        return all(_depends_only_on_i(x, ok) for x in (e.cond, e.a, e.b))
    return False


def widen(fmt: QuantFormat, n: int = 32) -> QuantFormat:
    """A one-element format (F32/F16/BF16) seen as blocks of `n` elements, so loops get a chunk to work on."""
    if fmt.block_size != 1:
        return fmt
    (f,) = fmt.fields
    return QuantFormat(f"{fmt.name}x{n}", None, n, n * f.nbytes, (Field(f.name, 0, f.dtype, n),), (),
                       _subst_i(fmt.value))


def _subst_i(e: Expr) -> Expr:
    # Field indices of one-element formats are `i` already (FieldLoad("v", i)); nothing to rewrite but keep a copy.
    return e


def groups(fmt: QuantFormat) -> tuple[int, ...]:
    """Nested let group sizes, block first, ending at 1: e.g. (256, 32, 1)."""
    return tuple(sorted({fmt.block_size, 1, *(lt.group for lt in fmt.lets)}, reverse=True))


def finest_group(fmt: QuantFormat) -> int:
    """Size of the format's smallest let group above single elements (the block size when there is none)."""
    gs = groups(fmt)
    return gs[-2] if len(gs) > 1 else 1


def inline_elem_lets(fmt: QuantFormat, e: Expr) -> Expr:
    """`e` with every per-element let (group 1, not an index-only let) replaced by its definition, recursively."""
    idx = index_only_lets(fmt)
    if isinstance(e, Var) and e.name != "i" and e.name not in idx:
        lt = fmt.let(e.name)
        return inline_elem_lets(fmt, lt.expr) if lt.group == 1 else e
    if isinstance(e, Bin):
        return Bin(e.op, inline_elem_lets(fmt, e.a), inline_elem_lets(fmt, e.b))
    if isinstance(e, Select):
        return Select(inline_elem_lets(fmt, e.cond), inline_elem_lets(fmt, e.a), inline_elem_lets(fmt, e.b))
    if isinstance(e, ToF32):
        return ToF32(inline_elem_lets(fmt, e.a))
    if isinstance(e, FieldLoad):
        return FieldLoad(e.field, inline_elem_lets(fmt, e.index))
    if isinstance(e, Table):
        return Table(e.name, inline_elem_lets(fmt, e.index))
    return e


# --- affine factorization -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Affine:
    """value = scale * ToF32(level) + offset, with scale/offset constant over groups of `group` elements."""

    scale: Expr
    level: Expr  # integer per-element expression (format expression language)
    offset: Expr | None
    group: int


def _group_of(fmt: QuantFormat, e: Expr) -> int:
    """Largest group over which `e` is constant (block size if it uses no per-element part)."""
    g = fmt.block_size
    stack = [e]
    while stack:
        x = stack.pop()
        if isinstance(x, Var):
            if x.name == "i":
                return 1
            g = min(g, fmt.let(x.name).group)
        elif isinstance(x, FieldLoad):
            return 1 if not _const_index(x.index) else g
        stack.extend(expr_children(x))
    return g


def _const_index(e: Expr) -> bool:
    return all(not (isinstance(x, Var)) for x in _iter(e))


def _iter(e: Expr):
    yield e
    for c in expr_children(e):
        yield from _iter(c)


def affine(fmt: QuantFormat) -> Affine | None:
    """Factor `fmt.value` as S_g * level + M_g when its expression tree allows it (see module docstring)."""
    v = fmt.value
    if v is None or fmt.block_size == 1:
        return None
    offset = None
    if isinstance(v, Bin) and v.op in ("+", "-"):
        prod, off = v.a, v.b
        offset = off if v.op == "+" else Bin("-", Const(0.0), off)
        v = prod
    if not (isinstance(v, Bin) and v.op == "*"):
        return None
    for s, lvl in ((v.a, v.b), (v.b, v.a)):
        if isinstance(lvl, ToF32) and _group_of(fmt, s) > 1 and not _is_float_load(fmt, lvl.a):
            g = _group_of(fmt, s)
            if offset is not None:
                g = min(g, _group_of(fmt, offset))
                if g == 1:
                    return None
            return Affine(s, lvl.a, offset, g)
    return None


def _is_float_load(fmt: QuantFormat, e: Expr) -> bool:
    return isinstance(e, FieldLoad) and fmt.field(e.field).dtype in ("f16", "bf16", "f32")


_FIELD_RANGES = {"u8": (0, 255), "i8": (-128, 127), "u16": (0, 65535), "u32": (0, (1 << 32) - 1),
                 "i32": (-(1 << 31), (1 << 31) - 1)}


def level_range(fmt: QuantFormat) -> tuple[int, int] | None:
    """(least, greatest) value the integer level of `affine(fmt)` can take, by interval arithmetic over its
    expression (fields by their dtypes, tables by their entries); None where the format has no affine level or
    the expression holds an operation the analysis does not bound."""
    a = affine(fmt)
    if a is None:
        return None
    from polystrata.ir.expr import TABLES

    def rng(e: Expr) -> tuple[int, int] | None:
        if isinstance(e, Const):
            return (e.value, e.value) if isinstance(e.value, int) else None
        if isinstance(e, Var):  # the element index, or a let of it
            return (0, fmt.block_size - 1) if e.name == "i" else rng(fmt.let(e.name).expr)
        if isinstance(e, FieldLoad):
            return _FIELD_RANGES.get(fmt.field(e.field).dtype)
        if isinstance(e, Table):
            return min(TABLES[e.name]), max(TABLES[e.name])
        if isinstance(e, Select):
            x, y = rng(e.a), rng(e.b)
            return None if x is None or y is None else (min(x[0], y[0]), max(x[1], y[1]))
        if not isinstance(e, Bin):
            return None
        x, y = rng(e.a), rng(e.b)
        if x is None or y is None:
            return None
        if e.op == "+":
            return x[0] + y[0], x[1] + y[1]
        if e.op == "-":
            return x[0] - y[1], x[1] - y[0]
        if e.op == "*":
            ends = [p * q for p in x for q in y]
            return min(ends), max(ends)
        if e.op == "&" and y[0] == y[1] and y[0] >= 0:  # a mask keeps at most its bits
            return (0, y[0]) if x[0] < 0 else (0, min(x[1], y[0]))
        if x[0] < 0 or y[0] < 0:
            return None
        if e.op == ">>":
            return x[0] >> y[1], x[1] >> y[0]
        if e.op == "<<":
            return x[0] << y[0], x[1] << y[1]
        if e.op == "|":
            return max(x[0], y[0]), (1 << max(x[1], y[1]).bit_length()) - 1
        if e.op == "//" and y[0] > 0:
            return x[0] // y[1], x[1] // y[0]
        if e.op == "%" and y[0] > 0:
            return 0, min(x[1], y[1] - 1)
        return None

    return rng(inline_elem_lets(fmt, a.level))

"""Quantization formats as data: one declarative description per format, everything else derived.

Each format is a `QuantFormat`: the byte layout of one block (`Field`s), a few `GroupLet` bindings and a final
`value` expression (the language of `ir/expr.py`) saying how element `i` (0 <= i < block_size) of a block decodes
to float32, plus an encoding `Scheme`. The same expression trees drive the numpy evaluator (`ir/evaluate.py`), the
generic encoder (`ir/encode.py`) and the kernel generators (`codegen/dequant.py`). Float expressions are written
in the exact operation order of gguf-py so results are bit identical; generated kernels must therefore not
contract `a*b+c` into FMAs.

`GroupLet(name, expr, group)`: `group` is how many consecutive elements share the value (1 = per element,
block_size = per block). A let is evaluated once per group with `i` = the group's first element, so kernels
can hoist it; it may only use lets whose group is a multiple of its own.

Encoding (`Scheme`): the integer code of element i is the let `scheme.code`, written in a canonical bit-slice
form `(s0 | s1 << k | ...) - offset`, each slice `(FieldLoad(f, idx) >> shift) & mask` (or a bare load), where
`Select` conditions and indices depend only on `i`. The encoder inverts that form to pack bits. Each group of
`scheme.group` elements decodes as `x = step * level + min`; `step` and `min` are `GroupParam`s stored either as an
f16 field directly or as f16 super-block field times a small integer code (another bit-slice let).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from polystrata.errors import GGUFError, UnsupportedError
from polystrata.ir.expr import (
    CMP_OPS,
    INT_OPS,
    TABLES,
    Bin,
    Const,
    Expr,
    FieldLoad,
    Select,
    Table,
    ToF32,
    Var,
    as_expr,
    i,
    walk_expr,
)

FIELD_DTYPES: dict[str, str] = {  # a block field's dtype name -> little-endian numpy dtype
    "u8": "u1", "i8": "i1", "u16": "<u2", "u32": "<u4", "i32": "<i4",
    "f16": "<f2", "bf16": "<u2", "f32": "<f4",
}
INT_DTYPES = ("u8", "i8", "u16", "u32", "i32")
SLICE = 16  # bytes: the slices of a `sliced` layout (the widest load a GPU target makes)


@dataclass(frozen=True)
class Field:
    """`count` consecutive values of `dtype` at byte `offset` of every block."""

    name: str
    offset: int
    dtype: str
    count: int = 1

    @property
    def nbytes(self) -> int:
        """Bytes the field occupies in a block."""
        return np.dtype(FIELD_DTYPES[self.dtype]).itemsize * self.count


@dataclass(frozen=True)
class GroupLet:
    """A named binding shared by `group` consecutive elements (see the module docstring)."""

    name: str
    expr: Expr
    group: int = 1


@dataclass(frozen=True)
class GroupParam:
    """How a group's step or min is stored: `sign * f16 field` or `sign * f16 field * int let`."""

    field: str
    code: str | None = None
    sign: int = 1


@dataclass(frozen=True)
class Scheme:
    """Encoding metadata: groups of `group` elements decode as `step * level + min`.

    `level` is the value of the code let (linear formats) or `TABLES[table][code]`. Without `min`, the
    format is symmetric and the group's largest-|x| element maps to level `anchor` (a negative anchor uses
    the sign of that element, as Q4_0 does, reaching one extra level).
    """

    code: str
    group: int
    step: GroupParam
    min: GroupParam | None = None
    anchor: int = 0
    table: str | None = None


@dataclass(frozen=True)
class QuantFormat:
    """One tensor/KV-cache storage format, described purely as data."""

    name: str
    ggml_type: int | None
    block_size: int
    block_bytes: int
    fields: tuple[Field, ...]
    lets: tuple[GroupLet, ...] = ()
    value: Expr | None = None
    scheme: Scheme | None = None
    # Blocks per row of a `sliced` device layout (`ir/layout.py`; 0: blocks stored whole, as GGUF keeps them).
    row_blocks: int = 0

    def __post_init__(self):
        _validate(self)

    def field(self, name: str) -> Field:
        """The block field called `name`."""
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(name)

    def let(self, name: str) -> GroupLet:
        """The let binding called `name`."""
        for lt in self.lets:
            if lt.name == name:
                return lt
        raise KeyError(name)

    @property
    def tables(self) -> dict[str, tuple[int, ...]]:
        """Constant tables the decode expressions use (codegen emits these)."""
        names: set[str] = set()
        for e in [lt.expr for lt in self.lets] + ([self.value] if self.value is not None else []):
            walk_expr(e, lambda n: names.add(n.name) if isinstance(n, Table) else None)
        return {n: TABLES[n] for n in sorted(names)}


def _typeof(fmt: QuantFormat, e: Expr, env: dict[str, tuple[str, int]], group: int) -> str:
    """Static type of `e` ('int', 'bool', 'f32', 'f16', 'bf16'); checks let scoping on the way."""
    def t(x):
        return _typeof(fmt, x, env, group)

    if isinstance(e, Const):
        return "int" if isinstance(e.value, int) else "f32"
    if isinstance(e, Var):
        if e.name == "i":
            return "int"
        if e.name not in env:
            raise ValueError(f"{fmt.name}: unknown variable {e.name!r}")
        typ, g = env[e.name]
        if g % group:
            raise ValueError(f"{fmt.name}: let with group {group} uses {e.name!r} of group {g}")
        return typ
    if isinstance(e, FieldLoad):
        if t(e.index) != "int":
            raise ValueError(f"{fmt.name}: non-int index into {e.field}")
        dt = fmt.field(e.field).dtype
        return "int" if dt in INT_DTYPES else dt
    if isinstance(e, Table):
        if e.name not in TABLES or t(e.index) != "int":
            raise ValueError(f"{fmt.name}: bad table lookup {e.name!r}")
        return "int"
    if isinstance(e, ToF32):
        if t(e.a) not in ("int", "f16", "bf16", "f32"):
            raise ValueError(f"{fmt.name}: ToF32 of a bool")
        return "f32"
    if isinstance(e, Select):
        ta, tb = t(e.a), t(e.b)
        if t(e.cond) != "bool" or ta != tb:
            raise ValueError(f"{fmt.name}: ill-typed Select")
        return ta
    if isinstance(e, Bin):
        ta, tb = t(e.a), t(e.b)
        ok = ta == tb and (ta == "int" or (ta == "f32" and e.op not in INT_OPS))
        if not ok:
            raise ValueError(f"{fmt.name}: operator {e.op!r} on {ta} and {tb}")
        return "bool" if e.op in CMP_OPS else ta
    raise TypeError(f"not an expression: {e!r}")


def _validate(fmt: QuantFormat) -> None:
    end = 0
    for f in fmt.fields:
        if f.dtype not in FIELD_DTYPES or f.offset < end:
            raise ValueError(f"{fmt.name}: bad or overlapping field {f.name}")
        end = f.offset + f.nbytes
    if end != fmt.block_bytes:
        raise ValueError(f"{fmt.name}: fields cover {end} bytes, block has {fmt.block_bytes}")
    if fmt.row_blocks and (fmt.block_bytes % SLICE or fmt.row_blocks < 1):
        raise ValueError(f"{fmt.name}: {fmt.block_bytes}-byte blocks cannot be cut into {SLICE}-byte slices")
    env: dict[str, tuple[str, int]] = {}
    for lt in fmt.lets:
        if fmt.block_size % lt.group:
            raise ValueError(f"{fmt.name}: let {lt.name} group {lt.group} does not divide the block")
        env[lt.name] = (_typeof(fmt, lt.expr, env, lt.group), lt.group)
    if fmt.value is not None and _typeof(fmt, fmt.value, env, 1) != "f32":
        raise ValueError(f"{fmt.name}: value must be float32")
    groups = sorted({fmt.block_size, 1, *(lt.group for lt in fmt.lets)}, reverse=True)
    if any(a % b for a, b in zip(groups, groups[1:])):
        raise ValueError(f"{fmt.name}: let groups {groups} do not nest")
    s = fmt.scheme
    if s is not None:
        params = [s.step] + ([s.min] if s.min is not None else [])
        ok = (
            env.get(s.code, ("", 0)) == ("int", 1)
            and fmt.block_size % s.group == 0
            and all(fmt.field(p.field).dtype == "f16" for p in params)
            and all(p.code is None or env.get(p.code, ("", 0)) == ("int", s.group) for p in params)
            and (s.min is not None or s.anchor != 0)
            and (s.min is None or s.min.code is None or s.min.sign == -1)
        )
        if not ok:
            raise ValueError(f"{fmt.name}: inconsistent encoding scheme {s}")


def _layout(*specs: tuple) -> dict:
    """Fields laid out back to back in order: (name, dtype) or (name, dtype, count)."""
    fields, off = [], 0
    for name, dtype, *count in specs:
        f = Field(name, off, dtype, count[0] if count else 1)
        fields.append(f)
        off += f.nbytes
    return {"fields": tuple(fields), "block_bytes": off}


def bits(field: str, index: Expr | int, shift: Expr | int, width: int) -> Expr:
    """`width` bits of `field[index]` starting at bit `shift` (the canonical slice form)."""
    return (FieldLoad(field, index) >> as_expr(shift)) & ((1 << width) - 1)


def f16(field: str) -> Expr:
    """The block's single f16 `field` as float32."""
    return ToF32(FieldLoad(field, 0))


def _plain(name: str, ggml_type: int, dtype: str) -> QuantFormat:
    value = None if dtype == "i32" else FieldLoad("v", i) if dtype == "f32" else ToF32(FieldLoad("v", i))
    return QuantFormat(name, ggml_type, 1, **_layout(("v", dtype)), value=value)


def _q8(name: str, ggml_type: int | None, block: int) -> QuantFormat:
    return QuantFormat(
        name, ggml_type, block, **_layout(("d", "f16"), ("qs", "i8", block)),
        lets=(GroupLet("d", f16("d"), block), GroupLet("q", FieldLoad("qs", i))),
        value=ToF32(Var("q")) * Var("d"),
        scheme=Scheme("q", block, step=GroupParam("d"), anchor=127),
    )


d, dmin, j = Var("d"), Var("dmin"), Var("j")  # shorthands for the common lets below
_nib32 = bits("qs", i % 16, 4 * (i // 16), 4)  # 32-element blocks: low nibbles first, then high nibbles

# --------------------------------------------------------------------------------------------------
# The formats
# --------------------------------------------------------------------------------------------------

F32 = _plain("F32", 0, "f32")
F16 = _plain("F16", 1, "f16")
BF16 = _plain("BF16", 30, "bf16")
I32 = _plain("I32", 26, "i32")  # raw integer tensor: sizes only, no decode

Q4_0 = QuantFormat(
    "Q4_0", 2, 32, **_layout(("d", "f16"), ("qs", "u8", 16)),
    lets=(GroupLet("d", f16("d"), 32), GroupLet("q", _nib32 - 8)),
    value=d * ToF32(Var("q")),
    scheme=Scheme("q", 32, step=GroupParam("d"), anchor=-8),
)

Q4_1 = QuantFormat(
    "Q4_1", 3, 32, **_layout(("d", "f16"), ("m", "f16"), ("qs", "u8", 16)),
    lets=(GroupLet("d", f16("d"), 32), GroupLet("m", f16("m"), 32), GroupLet("q", _nib32)),
    value=d * ToF32(Var("q")) + Var("m"),
    scheme=Scheme("q", 32, step=GroupParam("d"), min=GroupParam("m")),
)

Q5_0 = QuantFormat(
    "Q5_0", 6, 32, **_layout(("d", "f16"), ("qh", "u32"), ("qs", "u8", 16)),
    lets=(GroupLet("d", f16("d"), 32), GroupLet("q", (_nib32 | (bits("qh", 0, i, 1) << 4)) - 16)),
    value=d * ToF32(Var("q")),
    scheme=Scheme("q", 32, step=GroupParam("d"), anchor=-16),
)

Q5_1 = QuantFormat(
    "Q5_1", 7, 32, **_layout(("d", "f16"), ("m", "f16"), ("qh", "u32"), ("qs", "u8", 16)),
    lets=(GroupLet("d", f16("d"), 32), GroupLet("m", f16("m"), 32), GroupLet("q", _nib32 | (bits("qh", 0, i, 1) << 4))),
    value=d * ToF32(Var("q")) + Var("m"),
    scheme=Scheme("q", 32, step=GroupParam("d"), min=GroupParam("m")),
)

Q8_0 = _q8("Q8_0", 8, 32)
Q8_G64 = _q8("q8_g64", None, 64)  # KV cache only

# K-quants: 256-element super-blocks; 2-bit codes packed 4 per byte across 32-byte runs, per 128 elements.
_crumb = bits("qs", 32 * (i // 128) + i % 32, 2 * ((i // 32) % 4), 2)

Q2_K = QuantFormat(
    "Q2_K", 10, 256, **_layout(("scales", "u8", 16), ("qs", "u8", 64), ("d", "f16"), ("dmin", "f16")),
    lets=(
        GroupLet("d", f16("d"), 256), GroupLet("dmin", f16("dmin"), 256),
        GroupLet("sc", bits("scales", i // 16, 0, 4), 16), GroupLet("m", bits("scales", i // 16, 4, 4), 16),
        GroupLet("dl", d * ToF32(Var("sc")), 16), GroupLet("ml", dmin * ToF32(Var("m")), 16),
        GroupLet("q", _crumb),
    ),
    value=Var("dl") * ToF32(Var("q")) - Var("ml"),
    scheme=Scheme("q", 16, step=GroupParam("d", "sc"), min=GroupParam("dmin", "m", sign=-1)),
)

Q3_K = QuantFormat(
    "Q3_K", 11, 256, **_layout(("hmask", "u8", 32), ("qs", "u8", 64), ("scales", "u8", 12), ("d", "f16")),
    lets=(
        GroupLet("d", f16("d"), 256),
        GroupLet("j", i // 16, 16),
        # 6-bit scales: low nibbles in bytes 0-7, top 2 bits in bytes 8-11.
        GroupLet("sc", (bits("scales", j % 8, 4 * (j // 8), 4) | (bits("scales", 8 + j % 4, 2 * (j // 4), 2) << 4))
            - 32, 16),
        GroupLet("dl", d * ToF32(Var("sc")), 16),
        # The hmask bit adds 4; written as a plain bit slice (equivalent to gguf's "subtract 4 when clear").
        GroupLet("q", (_crumb | (bits("hmask", i % 32, i // 32, 1) << 2)) - 4),
    ),
    value=Var("dl") * ToF32(Var("q")),
    scheme=Scheme("q", 16, step=GroupParam("d", "sc"), anchor=-4),
)

# Q4_K/Q5_K: 8 sub-blocks of 32 with 6-bit scale and min codes packed in 12 bytes.
_k_scale_lets = (
    GroupLet("d", f16("d"), 256), GroupLet("dmin", f16("dmin"), 256),
    GroupLet("j", i // 32, 32),
    GroupLet("sc", Select(j < 4, bits("scales", j, 0, 6),
                     bits("scales", j + 4, 0, 4) | (bits("scales", j % 4, 6, 2) << 4)), 32),
    GroupLet("m", Select(j < 4, bits("scales", j + 4, 0, 6),
                    bits("scales", j + 4, 4, 4) | (bits("scales", j, 6, 2) << 4)), 32),
    GroupLet("dl", d * ToF32(Var("sc")), 32), GroupLet("ml", dmin * ToF32(Var("m")), 32),
)
_k_nibble = bits("qs", 32 * (i // 64) + i % 32, 4 * ((i // 32) % 2), 4)
_k_scheme = Scheme("q", 32, step=GroupParam("d", "sc"), min=GroupParam("dmin", "m", sign=-1))

Q4_K = QuantFormat(
    "Q4_K", 12, 256, **_layout(("d", "f16"), ("dmin", "f16"), ("scales", "u8", 12), ("qs", "u8", 128)),
    lets=(*_k_scale_lets, GroupLet("q", _k_nibble)),
    value=Var("dl") * ToF32(Var("q")) - Var("ml"),
    scheme=_k_scheme,
)

Q5_K = QuantFormat(
    "Q5_K", 13, 256,
    **_layout(("d", "f16"), ("dmin", "f16"), ("scales", "u8", 12), ("qh", "u8", 32), ("qs", "u8", 128)),
    lets=(*_k_scale_lets, GroupLet("q", _k_nibble | (bits("qh", i % 32, i // 32, 1) << 4))),
    value=Var("dl") * ToF32(Var("q")) - Var("ml"),
    scheme=_k_scheme,
)

Q6_K = QuantFormat(
    "Q6_K", 14, 256, **_layout(("ql", "u8", 128), ("qh", "u8", 64), ("scales", "i8", 16), ("d", "f16")),
    lets=(
        GroupLet("d", f16("d"), 256),
        GroupLet("sc", FieldLoad("scales", i // 16), 16),
        GroupLet("dl", d * ToF32(Var("sc")), 16),
        GroupLet("q", (bits("ql", 64 * (i // 128) + i % 64, 4 * ((i // 64) % 2), 4)
                  | (bits("qh", 32 * (i // 128) + i % 32, 2 * ((i // 32) % 4), 2) << 4)) - 32),
    ),
    value=Var("dl") * ToF32(Var("q")),
    scheme=Scheme("q", 16, step=GroupParam("d", "sc"), anchor=-32),
)

IQ4_NL = QuantFormat(
    "IQ4_NL", 20, 32, **_layout(("d", "f16"), ("qs", "u8", 16)),
    lets=(GroupLet("d", f16("d"), 32), GroupLet("q", _nib32)),
    value=d * ToF32(Table("iq4nl", Var("q"))),
    scheme=Scheme("q", 32, step=GroupParam("d"), anchor=-127, table="iq4nl"),
)

IQ4_XS = QuantFormat(
    "IQ4_XS", 23, 256, **_layout(("d", "f16"), ("scales_h", "u16"), ("scales_l", "u8", 4), ("qs", "u8", 128)),
    lets=(
        GroupLet("d", f16("d"), 256),
        GroupLet("j", i // 32, 32),
        GroupLet("sc", (bits("scales_l", j // 2, 4 * (j % 2), 4) | (bits("scales_h", 0, 2 * j, 2) << 4)) - 32, 32),
        GroupLet("dl", d * ToF32(Var("sc")), 32),
        GroupLet("q", bits("qs", 16 * (i // 32) + i % 16, 4 * ((i // 16) % 2), 4)),
    ),
    value=Var("dl") * ToF32(Table("iq4nl", Var("q"))),
    scheme=Scheme("q", 32, step=GroupParam("d", "sc"), anchor=-127, table="iq4nl"),
)

# --------------------------------------------------------------------------------------------------
# Registry and sizes
# --------------------------------------------------------------------------------------------------

FORMATS: dict[str, QuantFormat] = {
    f.name: f for f in (F32, F16, BF16, I32, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
                        Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS)
}
"""GGUF tensor types by upper-case GGML name."""

KV_FORMATS: dict[str, QuantFormat] = {"f16": F16, "q8_0": Q8_0, "q8_g64": Q8_G64}
"""KV-cache storage types by lower-case name (f16 and q8_0 share the GGUF layouts)."""

_BY_ID = {f.ggml_type: f for f in FORMATS.values()}


def by_ggml_type(type_id: int) -> QuantFormat:
    """The format of GGML tensor type `type_id`; GGUFError if this build does not know it."""
    try:
        return _BY_ID[int(type_id)]
    except KeyError:
        known = ", ".join(f"{f.name}={f.ggml_type}" for f in FORMATS.values())
        raise GGUFError(f"unknown tensor type id {type_id} (supported: {known})") from None


def by_name(name: str) -> QuantFormat:
    """The format called `name`, case-insensitively (GGUF types first, then KV-cache types)."""
    fmt = FORMATS.get(name.upper()) or KV_FORMATS.get(name.lower())
    if fmt is None:
        known = ", ".join([*FORMATS, *KV_FORMATS])
        raise UnsupportedError(f"unknown quantization format {name!r}; known formats: {known}")
    return fmt



def row_bytes(fmt: QuantFormat, n: int) -> int:
    """Bytes in one row of `n` elements; GGUFError unless `n` is a multiple of the block size."""
    if n % fmt.block_size:
        raise GGUFError(f"row of {n} elements is not a multiple of {fmt.name}'s block size {fmt.block_size}")
    return n // fmt.block_size * fmt.block_bytes


def tensor_bytes(fmt: QuantFormat, shape: int | Sequence[int]) -> int:
    """Bytes of a tensor of `shape` (last dimension = row length)."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if not shape:
        return row_bytes(fmt, 1)
    return math.prod(shape[:-1]) * row_bytes(fmt, shape[-1])

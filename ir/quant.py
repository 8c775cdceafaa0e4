"""Quantization formats as data: one declarative description per format, everything else derived.

Each format is a `QuantFormat`: the byte layout of one block (`Field`s), a few `Let` bindings and a final
`value` expression saying how element `i` (0 <= i < block_size) of a block decodes to float32, plus an
encoding `Scheme`. The same expression trees drive the numpy evaluator here (`dequantize`), the generic
encoder (`quantize`) and, later, the OpenCL/CUDA/HIP kernel generators.

Expression language (all nodes are small frozen dataclasses):

* `Const(v)`: an int (int32) or float (float32) literal.
* `Var(name)`: `"i"`, the element index within the block, or the name of an earlier `Let`.
* `Load(field, index)`: element `index` of a block field, as its dtype. Integer dtypes (u8/i8/u16/u32) read
  as int32 (u32 wraps); f16/bf16 values are opaque until converted with `ToF32`; f32 reads as float32.
* `Bin(op, a, b)`: `+ - *` on two ints or two floats; `// % >> << & |` on ints (operands are never negative
  where `//`/`%` are used, so C and Python semantics agree); `< <= == !=` give a bool.
* `Select(cond, a, b)`: `cond ? a : b`. Both branches must be safe to evaluate (in-range loads).
* `ToF32(a)`: int / f16 / bf16 -> float32 (exact for every value a block can hold).
* `Table(name, index)`: entry of the named int constant table in `TABLES`.

Python operators build nodes (`Load("qs", i % 16) >> 4`); use `.eq()`/`.ne()` for equality tests since `==`
compares trees. Float expressions are written in the exact operation order of gguf-py so results are bit
identical; generated kernels must therefore not contract `a*b+c` into FMAs.

`Let(name, expr, group)`: `group` is how many consecutive elements share the value (1 = per element,
block_size = per block). A let is evaluated once per group with `i` = the group's first element, so kernels
can hoist it; it may only use lets whose group is a multiple of its own.

Encoding (`Scheme`): the integer code of element i is the let `scheme.code`, written in a canonical bit-slice
form `(s0 | s1 << k | ...) - offset`, each slice `(Load(f, idx) >> shift) & mask` (or a bare load), where
`Select` conditions and indices depend only on `i`. The encoder inverts that form to pack bits. Each group of
`scheme.group` elements decodes as `x = step * level + min`; `step` and `min` are `Param`s stored either as an
f16 field directly or as f16 super-block field times a small integer code (another bit-slice let).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from polystrata.errors import GGUFError, UnsupportedError

# --------------------------------------------------------------------------------------------------
# Expression language
# --------------------------------------------------------------------------------------------------

INT_OPS = ("//", "%", ">>", "<<", "&", "|")
ARITH_OPS = ("+", "-", "*")
FLOAT_OPS = ("/",)  # used by kernel IR only; formats never divide
CMP_OPS = ("<", "<=", "==", "!=")


def _e(x: Expr | int | float) -> Expr:
    if isinstance(x, Expr):
        return x
    if isinstance(x, bool) or not isinstance(x, int | float):
        raise TypeError(f"cannot use {x!r} in an expression")
    return Const(x)


class Expr:
    """Base of expression nodes; Python operators build `Bin` nodes."""

    __slots__ = ()

    def __add__(self, o):
        return Bin("+", self, _e(o))

    def __radd__(self, o):
        return Bin("+", _e(o), self)

    def __sub__(self, o):
        return Bin("-", self, _e(o))

    def __rsub__(self, o):
        return Bin("-", _e(o), self)

    def __mul__(self, o):
        return Bin("*", self, _e(o))

    def __rmul__(self, o):
        return Bin("*", _e(o), self)

    def __truediv__(self, o):
        return Bin("/", self, _e(o))

    def __rtruediv__(self, o):
        return Bin("/", _e(o), self)

    def __floordiv__(self, o):
        return Bin("//", self, _e(o))

    def __rfloordiv__(self, o):
        return Bin("//", _e(o), self)

    def __mod__(self, o):
        return Bin("%", self, _e(o))

    def __rmod__(self, o):
        return Bin("%", _e(o), self)

    def __rshift__(self, o):
        return Bin(">>", self, _e(o))

    def __lshift__(self, o):
        return Bin("<<", self, _e(o))

    def __rlshift__(self, o):
        return Bin("<<", _e(o), self)

    def __and__(self, o):
        return Bin("&", self, _e(o))

    def __or__(self, o):
        return Bin("|", self, _e(o))

    def __lt__(self, o):
        return Bin("<", self, _e(o))

    def __le__(self, o):
        return Bin("<=", self, _e(o))

    def __gt__(self, o):
        return Bin("<", _e(o), self)

    def __ge__(self, o):
        return Bin("<=", _e(o), self)

    def eq(self, o) -> Bin:
        """Equality test node (`==` itself compares trees)."""
        return Bin("==", self, _e(o))

    def ne(self, o) -> Bin:
        """Inequality test node."""
        return Bin("!=", self, _e(o))


@dataclass(frozen=True)
class Const(Expr):
    """Integer (int32) or float (float32) literal."""

    value: int | float


@dataclass(frozen=True)
class Var(Expr):
    """`i` (element index in the block) or the name of an earlier let."""

    name: str


@dataclass(frozen=True)
class Load(Expr):
    """Element `index` of block field `field`, as the field's dtype."""

    field: str
    index: Expr

    def __init__(self, field: str, index: Expr | int):
        object.__setattr__(self, "field", field)
        object.__setattr__(self, "index", _e(index))


@dataclass(frozen=True)
class Bin(Expr):
    """Binary operator: arithmetic, integer bit/div ops or comparison."""

    op: str
    a: Expr
    b: Expr

    def __post_init__(self):
        if self.op not in ARITH_OPS + FLOAT_OPS + INT_OPS + CMP_OPS:
            raise ValueError(f"unknown operator {self.op!r}")


@dataclass(frozen=True)
class Select(Expr):
    """`cond ? a : b`."""

    cond: Expr
    a: Expr
    b: Expr

    def __init__(self, cond: Expr, a: Expr | int | float, b: Expr | int | float):
        object.__setattr__(self, "cond", cond)
        object.__setattr__(self, "a", _e(a))
        object.__setattr__(self, "b", _e(b))


@dataclass(frozen=True)
class ToF32(Expr):
    """Conversion of an int, f16, bf16 (or f32) value to float32."""

    a: Expr


@dataclass(frozen=True)
class Table(Expr):
    """Entry `index` of the int constant table `TABLES[name]`."""

    name: str
    index: Expr


i = Var("i")

# Non-linear 4-bit levels shared by IQ4_NL and IQ4_XS.
TABLES: dict[str, tuple[int, ...]] = {
    "iq4nl": (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113),
}

# --------------------------------------------------------------------------------------------------
# Format description
# --------------------------------------------------------------------------------------------------

DTYPES: dict[str, str] = {  # our dtype name -> little-endian numpy dtype
    "u8": "u1", "i8": "i1", "u16": "<u2", "u32": "<u4", "i32": "<i4",
    "f16": "<f2", "bf16": "<u2", "f32": "<f4",
}
_INT_DTYPES = ("u8", "i8", "u16", "u32", "i32")


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
        return np.dtype(DTYPES[self.dtype]).itemsize * self.count


@dataclass(frozen=True)
class Let:
    """A named binding shared by `group` consecutive elements (see module docstring)."""

    name: str
    expr: Expr
    group: int = 1


@dataclass(frozen=True)
class Param:
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
    step: Param
    min: Param | None = None
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
    lets: tuple[Let, ...] = ()
    value: Expr | None = None
    scheme: Scheme | None = None
    # Blocks per row of a `sliced` device layout (0: blocks stored whole, as GGUF keeps them).
    row_blocks: int = 0

    def __post_init__(self):
        _validate(self)

    def field(self, name: str) -> Field:
        """The block field called `name`."""
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(name)

    def let(self, name: str) -> Let:
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
            _walk(e, lambda n: names.add(n.name) if isinstance(n, Table) else None)
        return {n: TABLES[n] for n in sorted(names)}


def _walk(e: Expr, fn) -> None:
    fn(e)
    for child in _children(e):
        _walk(child, fn)


def _children(e: Expr) -> tuple[Expr, ...]:
    if isinstance(e, Load | Table):
        return (e.index,)
    if isinstance(e, Bin):
        return (e.a, e.b)
    if isinstance(e, Select):
        return (e.cond, e.a, e.b)
    if isinstance(e, ToF32):
        return (e.a,)
    return ()


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
    if isinstance(e, Load):
        if t(e.index) != "int":
            raise ValueError(f"{fmt.name}: non-int index into {e.field}")
        dt = fmt.field(e.field).dtype
        return "int" if dt in _INT_DTYPES else dt
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
        if f.dtype not in DTYPES or f.offset < end:
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
    return (Load(field, index) >> _e(shift)) & ((1 << width) - 1)


def f16(field: str) -> Expr:
    """The block's single f16 `field` as float32."""
    return ToF32(Load(field, 0))


def _plain(name: str, ggml_type: int, dtype: str) -> QuantFormat:
    value = None if dtype == "i32" else Load("v", i) if dtype == "f32" else ToF32(Load("v", i))
    return QuantFormat(name, ggml_type, 1, **_layout(("v", dtype)), value=value)


def _q8(name: str, ggml_type: int | None, block: int) -> QuantFormat:
    return QuantFormat(
        name, ggml_type, block, **_layout(("d", "f16"), ("qs", "i8", block)),
        lets=(Let("d", f16("d"), block), Let("q", Load("qs", i))),
        value=ToF32(Var("q")) * Var("d"),
        scheme=Scheme("q", block, step=Param("d"), anchor=127),
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
    lets=(Let("d", f16("d"), 32), Let("q", _nib32 - 8)),
    value=d * ToF32(Var("q")),
    scheme=Scheme("q", 32, step=Param("d"), anchor=-8),
)

Q4_1 = QuantFormat(
    "Q4_1", 3, 32, **_layout(("d", "f16"), ("m", "f16"), ("qs", "u8", 16)),
    lets=(Let("d", f16("d"), 32), Let("m", f16("m"), 32), Let("q", _nib32)),
    value=d * ToF32(Var("q")) + Var("m"),
    scheme=Scheme("q", 32, step=Param("d"), min=Param("m")),
)

Q5_0 = QuantFormat(
    "Q5_0", 6, 32, **_layout(("d", "f16"), ("qh", "u32"), ("qs", "u8", 16)),
    lets=(Let("d", f16("d"), 32), Let("q", (_nib32 | (bits("qh", 0, i, 1) << 4)) - 16)),
    value=d * ToF32(Var("q")),
    scheme=Scheme("q", 32, step=Param("d"), anchor=-16),
)

Q5_1 = QuantFormat(
    "Q5_1", 7, 32, **_layout(("d", "f16"), ("m", "f16"), ("qh", "u32"), ("qs", "u8", 16)),
    lets=(Let("d", f16("d"), 32), Let("m", f16("m"), 32), Let("q", _nib32 | (bits("qh", 0, i, 1) << 4))),
    value=d * ToF32(Var("q")) + Var("m"),
    scheme=Scheme("q", 32, step=Param("d"), min=Param("m")),
)

Q8_0 = _q8("Q8_0", 8, 32)
Q8_G64 = _q8("q8_g64", None, 64)  # KV cache only

# K-quants: 256-element super-blocks; 2-bit codes packed 4 per byte across 32-byte runs, per 128 elements.
_crumb = bits("qs", 32 * (i // 128) + i % 32, 2 * ((i // 32) % 4), 2)

Q2_K = QuantFormat(
    "Q2_K", 10, 256, **_layout(("scales", "u8", 16), ("qs", "u8", 64), ("d", "f16"), ("dmin", "f16")),
    lets=(
        Let("d", f16("d"), 256), Let("dmin", f16("dmin"), 256),
        Let("sc", bits("scales", i // 16, 0, 4), 16), Let("m", bits("scales", i // 16, 4, 4), 16),
        Let("dl", d * ToF32(Var("sc")), 16), Let("ml", dmin * ToF32(Var("m")), 16),
        Let("q", _crumb),
    ),
    value=Var("dl") * ToF32(Var("q")) - Var("ml"),
    scheme=Scheme("q", 16, step=Param("d", "sc"), min=Param("dmin", "m", sign=-1)),
)

Q3_K = QuantFormat(
    "Q3_K", 11, 256, **_layout(("hmask", "u8", 32), ("qs", "u8", 64), ("scales", "u8", 12), ("d", "f16")),
    lets=(
        Let("d", f16("d"), 256),
        Let("j", i // 16, 16),
        # 6-bit scales: low nibbles in bytes 0-7, top 2 bits in bytes 8-11.
        Let("sc", (bits("scales", j % 8, 4 * (j // 8), 4) | (bits("scales", 8 + j % 4, 2 * (j // 4), 2) << 4))
            - 32, 16),
        Let("dl", d * ToF32(Var("sc")), 16),
        # The hmask bit adds 4; written as a plain bit slice (equivalent to gguf's "subtract 4 when clear").
        Let("q", (_crumb | (bits("hmask", i % 32, i // 32, 1) << 2)) - 4),
    ),
    value=Var("dl") * ToF32(Var("q")),
    scheme=Scheme("q", 16, step=Param("d", "sc"), anchor=-4),
)

# Q4_K/Q5_K: 8 sub-blocks of 32 with 6-bit scale and min codes packed in 12 bytes.
_k_scale_lets = (
    Let("d", f16("d"), 256), Let("dmin", f16("dmin"), 256),
    Let("j", i // 32, 32),
    Let("sc", Select(j < 4, bits("scales", j, 0, 6),
                     bits("scales", j + 4, 0, 4) | (bits("scales", j % 4, 6, 2) << 4)), 32),
    Let("m", Select(j < 4, bits("scales", j + 4, 0, 6),
                    bits("scales", j + 4, 4, 4) | (bits("scales", j, 6, 2) << 4)), 32),
    Let("dl", d * ToF32(Var("sc")), 32), Let("ml", dmin * ToF32(Var("m")), 32),
)
_k_nibble = bits("qs", 32 * (i // 64) + i % 32, 4 * ((i // 32) % 2), 4)
_k_scheme = Scheme("q", 32, step=Param("d", "sc"), min=Param("dmin", "m", sign=-1))

Q4_K = QuantFormat(
    "Q4_K", 12, 256, **_layout(("d", "f16"), ("dmin", "f16"), ("scales", "u8", 12), ("qs", "u8", 128)),
    lets=(*_k_scale_lets, Let("q", _k_nibble)),
    value=Var("dl") * ToF32(Var("q")) - Var("ml"),
    scheme=_k_scheme,
)

Q5_K = QuantFormat(
    "Q5_K", 13, 256,
    **_layout(("d", "f16"), ("dmin", "f16"), ("scales", "u8", 12), ("qh", "u8", 32), ("qs", "u8", 128)),
    lets=(*_k_scale_lets, Let("q", _k_nibble | (bits("qh", i % 32, i // 32, 1) << 4))),
    value=Var("dl") * ToF32(Var("q")) - Var("ml"),
    scheme=_k_scheme,
)

Q6_K = QuantFormat(
    "Q6_K", 14, 256, **_layout(("ql", "u8", 128), ("qh", "u8", 64), ("scales", "i8", 16), ("d", "f16")),
    lets=(
        Let("d", f16("d"), 256),
        Let("sc", Load("scales", i // 16), 16),
        Let("dl", d * ToF32(Var("sc")), 16),
        Let("q", (bits("ql", 64 * (i // 128) + i % 64, 4 * ((i // 64) % 2), 4)
                  | (bits("qh", 32 * (i // 128) + i % 32, 2 * ((i // 32) % 4), 2) << 4)) - 32),
    ),
    value=Var("dl") * ToF32(Var("q")),
    scheme=Scheme("q", 16, step=Param("d", "sc"), anchor=-32),
)

IQ4_NL = QuantFormat(
    "IQ4_NL", 20, 32, **_layout(("d", "f16"), ("qs", "u8", 16)),
    lets=(Let("d", f16("d"), 32), Let("q", _nib32)),
    value=d * ToF32(Table("iq4nl", Var("q"))),
    scheme=Scheme("q", 32, step=Param("d"), anchor=-127, table="iq4nl"),
)

IQ4_XS = QuantFormat(
    "IQ4_XS", 23, 256, **_layout(("d", "f16"), ("scales_h", "u16"), ("scales_l", "u8", 4), ("qs", "u8", 128)),
    lets=(
        Let("d", f16("d"), 256),
        Let("j", i // 32, 32),
        Let("sc", (bits("scales_l", j // 2, 4 * (j % 2), 4) | (bits("scales_h", 0, 2 * j, 2) << 4)) - 32, 32),
        Let("dl", d * ToF32(Var("sc")), 32),
        Let("q", bits("qs", 16 * (i // 32) + i % 16, 4 * ((i // 16) % 2), 4)),
    ),
    value=Var("dl") * ToF32(Table("iq4nl", Var("q"))),
    scheme=Scheme("q", 32, step=Param("d", "sc"), anchor=-127, table="iq4nl"),
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


def padded(fmt: QuantFormat, align: int) -> QuantFormat:
    """`fmt` with each block padded with zero bytes to a multiple of `align` bytes (itself where it already is): a
    device storage layout, not a GGUF type, whose blocks, and so every field the format aligns, start aligned.
    `repack` lays GGUF data out in it."""
    nbytes = -(-fmt.block_bytes // align) * align
    if nbytes == fmt.block_bytes:
        return fmt
    pad = Field("pad", fmt.block_bytes, "u8", nbytes - fmt.block_bytes)
    return dataclasses.replace(fmt, name=f"{fmt.name}_A{align}", ggml_type=None, block_bytes=nbytes,
                               fields=(*fmt.fields, pad))


SLICE = 16  # bytes: the slices of a `sliced` layout (the widest load a GPU target makes)


def sliced(fmt: QuantFormat, cols: int) -> QuantFormat:
    """`fmt` in rows of `cols` elements, each row's blocks cut into 16-byte slices and the slices transposed: slice
    s of block b at row offset (s * blocks + b) * 16. A device storage layout for formats whose blocks are whole
    slices (Q4_K: the header, then 8 slices of quants): where neighbouring lanes work on neighbouring blocks, the
    same slice of each lies side by side, so a warp's 16-byte loads cover whole cache lines (in the GGUF layout
    they touch a line per block). Rows keep their size and place; `repack` lays GGUF data out in it."""
    nb = cols // fmt.block_size
    if fmt.row_blocks or cols % fmt.block_size or fmt.block_bytes % SLICE:
        raise ValueError(f"{fmt.name} rows of {cols} cannot be sliced")
    return dataclasses.replace(fmt, name=f"{fmt.name}_S{nb}", ggml_type=None, row_blocks=nb)


def _unsliced(fmt: QuantFormat) -> QuantFormat:
    """The layout a `sliced` format slices (itself when not sliced)."""
    if not fmt.row_blocks:
        return fmt
    return dataclasses.replace(fmt, name=fmt.name.rsplit("_S", 1)[0], row_blocks=0)


def _slice_rows(raw: np.ndarray, fmt: QuantFormat, inverse: bool = False) -> np.ndarray:
    """Bytes of whole rows of sliced `fmt` from its unsliced layout (`inverse`: back)."""
    shape = (-1, fmt.row_blocks, fmt.block_bytes // SLICE, SLICE)
    if inverse:
        shape = (shape[0], shape[2], shape[1], shape[3])
    rows = np.asarray(raw).reshape(-1).view(np.uint8).reshape(shape)
    return np.ascontiguousarray(rows.transpose(0, 2, 1, 3)).reshape(-1)


def repack(raw: np.ndarray, src: QuantFormat, dst: QuantFormat) -> np.ndarray:
    """The blocks of `src` data (its raw bytes) laid out as `dst`, a `padded` and/or `sliced` form of `src`: each
    block's bytes, then zeros; then, where sliced, each row's slices transposed."""
    if dst.row_blocks:
        return _slice_rows(repack(raw, src, _unsliced(dst)), dst)
    if dst.name == src.name:
        return raw
    if dst.fields[: len(src.fields)] != src.fields or dst.block_size != src.block_size:
        raise ValueError(f"{dst.name} is not a padded layout of {src.name}")
    blocks = np.asarray(raw).reshape(-1).view(np.uint8).reshape(-1, src.block_bytes)
    out = np.zeros((blocks.shape[0], dst.block_bytes), np.uint8)
    out[:, : src.block_bytes] = blocks
    return out.reshape(-1)


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


# --------------------------------------------------------------------------------------------------
# Generic numpy evaluator
# --------------------------------------------------------------------------------------------------

_CHUNK_ELEMENTS = 1 << 18  # keeps temporaries cache-friendly and memory bounded
_TABLE_ARRAYS = {k: np.array(v, dtype=np.int32) for k, v in TABLES.items()}
_NP_OPS = {
    "+": np.add, "-": np.subtract, "*": np.multiply, "//": np.floor_divide, "%": np.remainder,
    ">>": np.right_shift, "<<": np.left_shift, "&": np.bitwise_and, "|": np.bitwise_or,
    "<": np.less, "<=": np.less_equal, "==": np.equal, "!=": np.not_equal,
}


@functools.cache
def _axes(fmt: QuantFormat) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Nested group sizes (block, ..., 1) and the element axes they induce, e.g. (256, 32, 1) -> (8, 32)."""
    groups = tuple(sorted({fmt.block_size, 1, *(lt.group for lt in fmt.lets)}, reverse=True))
    return groups, tuple(a // b for a, b in zip(groups, groups[1:]))


def _index_arrays(fmt: QuantFormat) -> dict[int, np.ndarray]:
    """For each group size, `i` of each group's first element, shaped to broadcast over the element axes."""
    groups, axes = _axes(fmt)
    k = len(axes)
    out = {groups[0]: np.zeros((1,) + (1,) * k, dtype=np.int32)}
    acc = out[groups[0]]
    for m in range(1, len(groups)):
        shape = [1] * (k + 1)
        shape[m] = axes[m - 1]
        acc = acc + (np.arange(axes[m - 1], dtype=np.int32) * groups[m]).reshape(shape)
        out[groups[m]] = acc
    return out


def _block_fields(fmt: QuantFormat, blocks: np.ndarray) -> dict[str, np.ndarray]:
    out = {}
    for f in fmt.fields:
        raw = np.ascontiguousarray(blocks[:, f.offset:f.offset + f.nbytes]).view(DTYPES[f.dtype])
        if f.dtype == "u32":
            raw = raw.view("<i4")  # int32 math; shifts and masks see the same bits
        elif f.dtype in ("u8", "i8", "u16"):
            raw = raw.astype(np.int32)
        out[f.name] = raw
    return out


def _ev(e: Expr, env: dict, fields: dict, n: int, ndim: int):
    if isinstance(e, Const):
        return np.int32(e.value) if isinstance(e.value, int) else np.float32(e.value)
    if isinstance(e, Var):
        return env[e.name]
    if isinstance(e, Load):
        arr = fields[e.field]
        idx = np.asarray(_ev(e.index, env, fields, n, ndim))
        if idx.ndim == 0:
            return arr[:, int(idx)].reshape((n,) + (1,) * (ndim - 1))
        if idx.shape[0] == 1:  # same index in every block: a plain gather (or none for field[i])
            if idx.size == arr.shape[1] and np.array_equal(idx.ravel(), np.arange(idx.size)):
                return arr.reshape((n,) + idx.shape[1:])
            return arr[:, idx[0]]
        idx = np.broadcast_to(idx, (n,) + idx.shape[1:])
        return np.take_along_axis(arr, idx.reshape(n, -1), axis=1).reshape(idx.shape)
    if isinstance(e, Bin):
        return _NP_OPS[e.op](_ev(e.a, env, fields, n, ndim), _ev(e.b, env, fields, n, ndim))
    if isinstance(e, Select):
        c = _ev(e.cond, env, fields, n, ndim)
        return np.where(c, _ev(e.a, env, fields, n, ndim), _ev(e.b, env, fields, n, ndim))
    if isinstance(e, ToF32):
        a = np.asarray(_ev(e.a, env, fields, n, ndim))
        if a.dtype == np.uint16:  # bf16 loads are carried as raw bits
            return (a.astype(np.uint32) << np.uint32(16)).view(np.float32)
        return a.astype(np.float32)
    if isinstance(e, Table):
        return _TABLE_ARRAYS[e.name][_ev(e.index, env, fields, n, ndim)]
    raise TypeError(f"not an expression: {e!r}")


def _evaluate(fmt: QuantFormat, blocks: np.ndarray, exprs: Sequence[Expr], hoist: bool = True) -> list:
    """Evaluate per-element `exprs` over (n_blocks, block_bytes) bytes -> list of (n_blocks, block_size)."""
    n = blocks.shape[0]
    groups, axes = _axes(fmt)
    index = _index_arrays(fmt)
    fields = _block_fields(fmt, blocks)
    ndim = len(axes) + 1
    env: dict = {}
    for lt in fmt.lets:
        env["i"] = index[lt.group if hoist else 1]
        env[lt.name] = _ev(lt.expr, env, fields, n, ndim)
    env["i"] = index[1]
    full = (n,) + axes
    return [np.broadcast_to(_ev(e, env, fields, n, ndim), full).reshape(n, fmt.block_size) for e in exprs]


def _blocks_of(fmt: QuantFormat, raw: np.ndarray, shape) -> tuple[np.ndarray, tuple[int, ...]]:
    raw = np.asarray(raw)
    if raw.dtype != np.uint8:
        raw = raw.view(np.uint8)
    if shape is None:
        if raw.ndim == 0 or raw.shape[-1] % fmt.block_bytes:
            raise GGUFError(f"{fmt.name}: rows of {raw.shape[-1:]} bytes are not whole blocks")
        shape = raw.shape[:-1] + (raw.shape[-1] // fmt.block_bytes * fmt.block_size,)
    shape = (int(shape),) if np.isscalar(shape) else tuple(int(s) for s in shape)
    want = tensor_bytes(fmt, shape)
    if raw.size != want:
        raise GGUFError(f"{fmt.name} tensor of shape {shape} needs {want} bytes, got {raw.size}")
    if fmt.row_blocks:
        raw = _slice_rows(raw, fmt, inverse=True)
    return raw.reshape(-1, fmt.block_bytes), shape


def dequantize(fmt: QuantFormat, raw: np.ndarray, shape: int | Sequence[int] | None = None,
               *, hoist: bool = True) -> np.ndarray:
    """Decode `raw` bytes of format `fmt` to float32 of `shape` (default: rows = last dim of `raw`).

    Bit-identical to gguf-py. `hoist=False` evaluates every let per element (a check on the declared
    groups; results must not change).
    """
    if fmt.value is None:
        raise UnsupportedError(f"{fmt.name} tensors hold raw integers and cannot be dequantized")
    blocks, shape = _blocks_of(fmt, raw, shape)
    out = np.empty((blocks.shape[0], fmt.block_size), dtype=np.float32)
    step = max(1, _CHUNK_ELEMENTS // fmt.block_size)
    with np.errstate(invalid="ignore", over="ignore"):  # inf/nan scales decode to inf/nan, as in ggml
        for s in range(0, blocks.shape[0], step):
            out[s:s + step] = _evaluate(fmt, blocks[s:s + step], [fmt.value], hoist)[0]
    return out.reshape(shape)


def _param_expr(p: Param) -> Expr:
    e = f16(p.field) if p.code is None else f16(p.field) * ToF32(Var(p.code))
    return e if p.sign == 1 else Const(0.0) - e


def element_steps(fmt: QuantFormat, raw: np.ndarray, shape=None) -> tuple[np.ndarray, np.ndarray]:
    """Per element, the decoded group `step` and `min` of the scheme (for error bounds and diagnostics)."""
    if fmt.scheme is None:
        raise UnsupportedError(f"{fmt.name} has no quantization step")
    blocks, shape = _blocks_of(fmt, raw, shape)
    s = fmt.scheme
    mn = _param_expr(s.min) if s.min is not None else Const(0.0)
    step, mins = _evaluate(fmt, blocks, [_param_expr(s.step), mn])
    return step.reshape(shape), mins.reshape(shape)


# --------------------------------------------------------------------------------------------------
# Bit-slice analysis (inverse of the canonical code form) and the generic encoder
# --------------------------------------------------------------------------------------------------


_PY_OPS = {
    "+": operator.add, "-": operator.sub, "*": operator.mul, "//": operator.floordiv, "%": operator.mod,
    ">>": operator.rshift, "<<": operator.lshift, "&": operator.and_, "|": operator.or_,
    "<": operator.lt, "<=": operator.le, "==": operator.eq, "!=": operator.ne,
}


def _index_value(fmt: QuantFormat, e: Expr, i_val: int) -> int | bool:
    """Concrete value of an expression that depends only on `i` (indices, shifts, conditions)."""
    if isinstance(e, Const):
        return e.value
    if isinstance(e, Var):
        return i_val if e.name == "i" else _index_value(fmt, fmt.let(e.name).expr, i_val)
    if isinstance(e, Bin):
        a, b = _index_value(fmt, e.a, i_val), _index_value(fmt, e.b, i_val)
        return _PY_OPS[e.op](a, b)
    if isinstance(e, Select):
        return _index_value(fmt, e.a if _index_value(fmt, e.cond, i_val) else e.b, i_val)
    raise UnsupportedError(f"{fmt.name}: {type(e).__name__} where an index-only expression is needed")


@dataclass(frozen=True)
class _Slice:
    field: str
    elem: int  # element of the field
    shift: int  # bit position within that element
    width: int
    code_pos: int  # bit position within the code
    signed: bool


def _slices(fmt: QuantFormat, e: Expr, i_val: int, pos: int = 0) -> list[_Slice]:
    if isinstance(e, Var) and e.name != "i":
        return _slices(fmt, fmt.let(e.name).expr, i_val, pos)
    if isinstance(e, Select):
        return _slices(fmt, e.a if _index_value(fmt, e.cond, i_val) else e.b, i_val, pos)
    if isinstance(e, Bin) and e.op == "|":
        return _slices(fmt, e.a, i_val, pos) + _slices(fmt, e.b, i_val, pos)
    if isinstance(e, Bin) and e.op == "<<":
        return _slices(fmt, e.a, i_val, pos + _index_value(fmt, e.b, i_val))
    if isinstance(e, Load):
        f = fmt.field(e.field)
        width = 8 * np.dtype(DTYPES[f.dtype]).itemsize
        return [_Slice(f.name, _index_value(fmt, e.index, i_val), 0, width, pos, f.dtype == "i8")]
    if isinstance(e, Bin) and e.op == "&" and isinstance(e.b, Const):
        width = int(e.b.value + 1).bit_length() - 1
        if (1 << width) - 1 == e.b.value:
            src, shift = e.a, 0
            if isinstance(src, Bin) and src.op == ">>":
                src, shift = src.a, _index_value(fmt, src.b, i_val)
            if isinstance(src, Load):
                return [_Slice(src.field, _index_value(fmt, src.index, i_val), shift, width, pos, False)]
    raise UnsupportedError(f"{fmt.name}: code expression is not in bit-slice form: {e!r}")


@functools.cache
def _code_layout(fmt: QuantFormat, let_name: str):
    """(offset, (lo, hi) code range, slice groups) of an integer code let, for packing."""
    lt = fmt.let(let_name)
    e, offset = lt.expr, 0
    if isinstance(e, Bin) and e.op in "+-" and isinstance(e.b, Const):
        e, offset = e.a, (e.b.value if e.op == "-" else -e.b.value)
    rows, ranges = [], set()
    for p in range(fmt.block_size // lt.group):
        sl = _slices(fmt, e, p * lt.group)
        nbits = max(s.code_pos + s.width for s in sl)
        signed = any(s.signed for s in sl)
        ranges.add((-(1 << (nbits - 1)), (1 << (nbits - 1)) - 1) if signed else (0, (1 << nbits) - 1))
        rows += [(s, p) for s in sl]
    if len(ranges) != 1:
        raise UnsupportedError(f"{fmt.name}: code {let_name} has a different width per position")
    lo, hi = ranges.pop()
    # Within one (field, shift, width, code_pos) class each field element is written once: vectorizable.
    classes: dict[tuple, list[tuple[int, int]]] = {}
    for s, p in rows:
        classes.setdefault((s.field, s.shift, s.width, s.code_pos), []).append((p, s.elem))
    groups = tuple((key, np.array([p for p, _ in v]), np.array([el for _, el in v])) for key, v in classes.items())
    return offset, (lo - offset, hi - offset), groups


def code_range(fmt: QuantFormat, let_name: str) -> tuple[int, int]:
    """Smallest and largest value the integer code let `let_name` can take."""
    return _code_layout(fmt, let_name)[1]


def levels(fmt: QuantFormat) -> np.ndarray:
    """The values a code can decode to before `step`/`min` (sorted, float64)."""
    s = fmt.scheme
    if s is None:
        raise UnsupportedError(f"{fmt.name} has no quantization levels")
    if s.table is not None:
        return np.array(TABLES[s.table], dtype=np.float64)
    lo, hi = code_range(fmt, s.code)
    return np.arange(lo, hi + 1, dtype=np.float64)


def error_bound_steps(fmt: QuantFormat) -> float:
    """Worst-case |dequantize(quantize(x)) - x| of round-to-nearest, in units of the element's |step|.

    Affine groups cover [min, max] exactly, so half a step. Symmetric groups map x/step into
    [-|anchor|, |anchor|]: the bound is half the widest gap between levels or how far that interval reaches
    beyond the outermost levels (Q4_0's -8..7 levels with anchor -8 give 1 step for x = -max).
    """
    s = fmt.scheme
    if s is None:
        return 0.0
    lv = levels(fmt)
    half_gap = float(np.max(np.diff(lv))) / 2
    if s.min is not None:
        return half_gap
    a = abs(s.anchor)
    return max(half_gap, a - lv[-1], lv[0] + a)


def _f16_away(v: np.ndarray) -> np.ndarray:
    """Nearest f16 with magnitude >= |v| (so a stored scale never shrinks the covered range)."""
    h = v.astype(np.float16)
    short = np.abs(h.astype(np.float64)) < np.abs(v)
    h[short] = np.nextafter(h[short], np.copysign(np.inf, v[short]).astype(np.float16))
    return h


def _f16_down(v: np.ndarray) -> np.ndarray:
    """Largest f16 <= v (a stored min must not rise above the group's minimum)."""
    h = v.astype(np.float16)
    high = h.astype(np.float64) > v
    h[high] = np.nextafter(h[high], np.float16(-np.inf))
    return h


def _store_param(fmt: QuantFormat, p: Param, target: np.ndarray, ints: dict, floats: dict) -> np.ndarray:
    """Store per-group `target` (n, groups) as `p`, rounding magnitudes up; return the decoded float32."""
    if p.code is None:
        if target.shape[1] != 1:
            raise UnsupportedError(f"{fmt.name}: a direct f16 parameter needs one group per block")
        h = _f16_away(target[:, 0])
        floats[p.field] = h
        return h.astype(np.float32)[:, None]
    lo, hi = code_range(fmt, p.code)
    sup = _f16_away(np.abs(target).max(axis=1) / hi)
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.sign(target) * np.ceil(np.abs(target) / sup.astype(np.float64)[:, None])
    codes = np.clip(np.nan_to_num(codes), lo, hi).astype(np.int64)
    floats[p.field] = sup
    ints[p.code] = codes
    # Same float32 operations as the decoder: f32(super) * f32(code).
    return sup.astype(np.float32)[:, None] * codes.astype(np.float32)


def _encode_blocks(fmt: QuantFormat, xb: np.ndarray) -> np.ndarray:
    s = fmt.scheme
    n = xb.shape[0]
    xg = xb.astype(np.float64).reshape(n, fmt.block_size // s.group, s.group)
    ints: dict[str, np.ndarray] = {}
    floats: dict[str, np.ndarray] = {}
    lv = levels(fmt)
    if s.min is None:
        amax_at = np.abs(xg).argmax(axis=-1)[..., None]
        peak = np.take_along_axis(xg, amax_at, axis=-1)[..., 0]
        ideal = (np.abs(peak) if s.anchor > 0 else peak) / s.anchor
        mins = np.zeros((n, 1), dtype=np.float32)
    else:
        lo_x = xg.min(axis=-1)
        if s.min.code is None:  # min stored as is (Q4_1): round down so it stays <= the group minimum
            h = _f16_down(lo_x[:, 0])
            floats[s.min.field] = h
            mins = h.astype(np.float32)[:, None]
        else:  # K-quants: min = -(dmin * code) with code >= 0, so only non-positive mins are representable
            mins = s.min.sign * _store_param(fmt, s.min, np.maximum(s.min.sign * lo_x, 0.0), ints, floats)
        ideal = (xg.max(axis=-1) - mins) / lv[-1]
    steps = _store_param(fmt, s.step, ideal, ints, floats).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = (xg - mins[..., None]) / steps[..., None]
    r = np.where(steps[..., None] == 0, 0.0, r)
    if s.table is None:
        q = np.clip(np.rint(r), lv[0], lv[-1])
    else:
        q = np.searchsorted((lv[1:] + lv[:-1]) / 2, r)
    ints[s.code] = q.reshape(n, fmt.block_size).astype(np.int64)
    return _pack(fmt, ints, floats, n)


def _pack(fmt: QuantFormat, ints: dict, floats: dict, n: int) -> np.ndarray:
    acc = {f.name: np.zeros((n, f.count), dtype=np.int64) for f in fmt.fields if f.dtype in _INT_DTYPES}
    for name, codes in ints.items():
        offset, _, groups = _code_layout(fmt, name)
        stored = codes + offset
        for (field, shift, width, code_pos), pos, elems in groups:
            acc[field][:, elems] |= ((stored[:, pos] >> code_pos) & ((1 << width) - 1)) << shift
    out = np.zeros((n, fmt.block_bytes), dtype=np.uint8)
    for f in fmt.fields:
        dt = np.dtype(DTYPES[f.dtype])
        if f.name in floats:
            vals = floats[f.name].astype(dt).reshape(n, f.count)
        else:
            unsigned = np.dtype(f"<u{dt.itemsize}")
            vals = (acc[f.name] & ((1 << 8 * dt.itemsize) - 1)).astype(unsigned)
        out[:, f.offset:f.offset + f.nbytes] = vals.view(np.uint8).reshape(n, f.nbytes)
    return out


def _to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits, round to nearest even; NaNs stay (quiet) NaNs."""
    u = x.view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, (u >> 16) | 0x40, rounded).astype(np.uint16)


def quantize(fmt: QuantFormat, x: np.ndarray) -> np.ndarray:
    """Encode float32 `x` (last dim a multiple of the block size) to bytes shaped (..., row_bytes).

    Round-to-nearest with scales chosen from each group's range (see `Scheme` and `error_bound_steps`).
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    rb = row_bytes(fmt, x.shape[-1] if x.ndim else 1)
    xb = x.reshape(-1, fmt.block_size)
    if fmt.scheme is None:
        dt = fmt.fields[0].dtype
        if dt == "bf16":
            out = _to_bf16_bits(xb)
        elif dt == "i32":
            out = np.rint(xb).astype("<i4")
        else:
            out = xb.astype(DTYPES[dt])
        return out.view(np.uint8).reshape(x.shape[:-1] + (rb,))
    out = np.empty((xb.shape[0], fmt.block_bytes), dtype=np.uint8)
    step = max(1, _CHUNK_ELEMENTS // 4 // fmt.block_size)  # float64 temporaries: smaller chunks
    for s in range(0, xb.shape[0], step):
        out[s:s + step] = _encode_blocks(fmt, xb[s:s + step])
    return out.reshape(x.shape[:-1] + (rb,))

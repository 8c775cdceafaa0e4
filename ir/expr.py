"""The expression language of quantization formats, which the kernel IR extends.

All nodes are small frozen dataclasses:

* `Const(v)`: an int (int32) or float (float32) literal.
* `Var(name)`: `"i"`, the element index within the block, or the name of an earlier let.
* `FieldLoad(field, index)`: element `index` of a block field, as its dtype. Integer dtypes (u8/i8/u16/u32) read
  as int32 (u32 wraps); f16/bf16 values are opaque until converted with `ToF32`; f32 reads as float32.
* `Bin(op, a, b)`: `+ - *` on two ints or two floats; `// % >> << & |` on ints (operands are never negative
  where `//`/`%` are used, so C and Python semantics agree); `< <= == !=` give a bool.
* `Select(cond, a, b)`: `cond ? a : b`. Both branches must be safe to evaluate (in-range loads).
* `ToF32(a)`: int / f16 / bf16 -> float32 (exact for every value a block can hold).
* `Table(name, index)`: entry of the named int constant table in `TABLES`.

Python operators build nodes (`FieldLoad("qs", i % 16) >> 4`); use `.eq()`/`.ne()` for equality tests since `==`
compares trees. The formats (`ir/formats.py`) are written in it; the kernel IR (`ir/kernel.py`) reuses `Const`,
`Var`, `Bin`, `Select`, `ToF32` and `Table` and adds buffer loads, casts and calls.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

INT_OPS = ("//", "%", ">>", "<<", "&", "|")
ARITH_OPS = ("+", "-", "*")
FLOAT_OPS = ("/",)  # used by kernel IR only; formats never divide
CMP_OPS = ("<", "<=", "==", "!=")


def as_expr(x: Expr | int | float) -> Expr:
    """`x` as an expression node: nodes as they are, Python ints and floats as `Const`."""
    if isinstance(x, Expr):
        return x
    if isinstance(x, bool) or not isinstance(x, int | float):
        raise TypeError(f"cannot use {x!r} in an expression")
    return Const(x)


class Expr:
    """Base of expression nodes; Python operators build `Bin` nodes."""

    __slots__ = ()

    def __add__(self, o):
        return Bin("+", self, as_expr(o))

    def __radd__(self, o):
        return Bin("+", as_expr(o), self)

    def __sub__(self, o):
        return Bin("-", self, as_expr(o))

    def __rsub__(self, o):
        return Bin("-", as_expr(o), self)

    def __mul__(self, o):
        return Bin("*", self, as_expr(o))

    def __rmul__(self, o):
        return Bin("*", as_expr(o), self)

    def __truediv__(self, o):
        return Bin("/", self, as_expr(o))

    def __rtruediv__(self, o):
        return Bin("/", as_expr(o), self)

    def __floordiv__(self, o):
        return Bin("//", self, as_expr(o))

    def __rfloordiv__(self, o):
        return Bin("//", as_expr(o), self)

    def __mod__(self, o):
        return Bin("%", self, as_expr(o))

    def __rmod__(self, o):
        return Bin("%", as_expr(o), self)

    def __rshift__(self, o):
        return Bin(">>", self, as_expr(o))

    def __lshift__(self, o):
        return Bin("<<", self, as_expr(o))

    def __rlshift__(self, o):
        return Bin("<<", as_expr(o), self)

    def __and__(self, o):
        return Bin("&", self, as_expr(o))

    def __or__(self, o):
        return Bin("|", self, as_expr(o))

    def __lt__(self, o):
        return Bin("<", self, as_expr(o))

    def __le__(self, o):
        return Bin("<=", self, as_expr(o))

    def __gt__(self, o):
        return Bin("<", as_expr(o), self)

    def __ge__(self, o):
        return Bin("<=", as_expr(o), self)

    def eq(self, o) -> Bin:
        """Equality test node (`==` itself compares trees)."""
        return Bin("==", self, as_expr(o))

    def ne(self, o) -> Bin:
        """Inequality test node."""
        return Bin("!=", self, as_expr(o))


@dataclass(frozen=True)
class Const(Expr):
    """Integer (int32) or float (float32) literal."""

    value: int | float


@dataclass(frozen=True)
class Var(Expr):
    """`i` (element index in the block) or the name of an earlier let."""

    name: str


@dataclass(frozen=True)
class FieldLoad(Expr):
    """Element `index` of block field `field`, as the field's dtype."""

    field: str
    index: Expr

    def __init__(self, field: str, index: Expr | int):
        object.__setattr__(self, "field", field)
        object.__setattr__(self, "index", as_expr(index))


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
        object.__setattr__(self, "a", as_expr(a))
        object.__setattr__(self, "b", as_expr(b))


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


def expr_children(e: Expr) -> tuple[Expr, ...]:
    """The direct sub-expressions of a node of this language."""
    if isinstance(e, FieldLoad | Table):
        return (e.index,)
    if isinstance(e, Bin):
        return (e.a, e.b)
    if isinstance(e, Select):
        return (e.cond, e.a, e.b)
    if isinstance(e, ToF32):
        return (e.a,)
    return ()


def walk_expr(e: Expr, fn) -> None:
    """Call `fn` on every node of `e`, the root first."""
    fn(e)
    for child in expr_children(e):
        walk_expr(child, fn)


PY_OPS = {
    "+": operator.add, "-": operator.sub, "*": operator.mul, "//": operator.floordiv, "%": operator.mod,
    ">>": operator.rshift, "<<": operator.lshift, "&": operator.and_, "|": operator.or_,
    "<": operator.lt, "<=": operator.le, "==": operator.eq, "!=": operator.ne,
}
"""Python's operator per integer operator (constant folding of index arithmetic)."""

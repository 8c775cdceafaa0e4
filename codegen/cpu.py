"""CPU renderer: kernel IR -> Python source compiled by Numba (`@njit(parallel=True)`).

Each grid point becomes one iteration of a `prange` loop; lanes do not exist on the CPU, so `LaneFor` and
`Reduce` become ordinary loops (the sequential semantics of the IR, taken literally). Integers are computed
in int64 (a superset of the IR's i32/u32 behaviour for the values kernels produce); every float literal and
conversion is float32 so Numba never widens arithmetic to float64. f16 buffers are stored as uint16 and
converted with the portable intrinsics below.
"""

from __future__ import annotations

from polystrata.ir.kernel import (
    Assign,
    Bin,
    Buf,
    Call,
    Cast,
    Const,
    Decl,
    For,
    If,
    Kernel,
    LaneFor,
    Let,
    Load,
    Reduce,
    Select,
    Store,
    ToF32,
    Var,
)
from polystrata.ir.quant import TABLES, Table

# Storage dtype of each IR buffer dtype on the CPU (numpy names).
NUMPY_DTYPES = {"f32": "float32", "f16": "uint16", "i32": "int32", "u32": "uint32", "i16": "int16",
                "u16": "uint16", "i8": "int8", "u8": "uint8"}

PRELUDE = '''\
import math
import numpy as np
from numba import njit, prange

@njit(inline="always", cache=True)
def f16_bits_to_f32(h):
    h = np.int64(h) & 0xFFFF
    s = -1.0 if h >> 15 else 1.0
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 0:
        return np.float32(s * m * 5.960464477539063e-08)
    if e == 31:
        return np.float32(s * np.inf) if m == 0 else np.float32(np.nan)
    return np.float32(s * (1024 + m) * 2.0 ** (e - 25))

@njit(inline="always", cache=True)
def f32_to_f16_bits(x):
    # Round to nearest even, from the exact float64 value of x (Numba has no float16 type).
    x = float(x)
    if x != x:
        return 0x7E00
    s = 0x8000 if math.copysign(1.0, x) < 0 else 0
    a = abs(x)
    if a >= 65520.0:
        return s | 0x7C00
    if a < 6.103515625e-05:
        return s | np.int64(np.rint(a * 16777216.0))
    f, e = math.frexp(a)
    m = np.int64(np.rint((f * 2.0 - 1.0) * 1024.0))
    e = e - 1 + 15
    if m == 1024:
        m = 0
        e += 1
    return s | (e << 10) | m

@njit(inline="always", cache=True)
def dot4_i8(a, b, acc):
    s = acc
    for k in range(4):
        x = (np.int64(a) >> (8 * k)) & 0xFF
        y = (np.int64(b) >> (8 * k)) & 0xFF
        s += (x - 256 if x > 127 else x) * (y - 256 if y > 127 else y)
    return s

@njit(inline="always", cache=True)
def load_u32(buf, i):
    return (np.int64(buf[i]) | (np.int64(buf[i + 1]) << 8) | (np.int64(buf[i + 2]) << 16)
            | (np.int64(buf[i + 3]) << 24))
'''

_MATH = {"exp": "math.exp", "tanh": "math.tanh", "sqrt": "math.sqrt", "cos": "math.cos", "sin": "math.sin",
         "log": "math.log", "pow": "math.pow", "abs": "abs", "max": "max", "min": "min"}
_FLOAT_RESULT = {"exp", "tanh", "sqrt", "cos", "sin", "log", "pow", "rsqrt"}


class _Renderer:
    def __init__(self, k: Kernel):
        self.k = k
        self.lines: list[str] = []
        self.f16 = {p.name for p in k.params if isinstance(p, Buf) and p.dtype == "f16"}
        self.f16 |= {a.name for a in k.local if a.dtype == "f16"}
        self.tables: set[str] = set()

    def e(self, x) -> str:
        if isinstance(x, Const):
            return f"np.float32({x.value!r})" if isinstance(x.value, float) else repr(x.value)
        if isinstance(x, Var):
            return x.name
        if isinstance(x, Bin):
            op = x.op
            if op == "/":
                return f"np.float32({self.e(x.a)} / {self.e(x.b)})"
            return f"({self.e(x.a)} {op} {self.e(x.b)})"
        if isinstance(x, Select):
            return f"({self.e(x.a)} if {self.e(x.cond)} else {self.e(x.b)})"
        if isinstance(x, ToF32):
            return f"np.float32({self.e(x.a)})"
        if isinstance(x, Cast):
            if x.dtype == "f32":
                return f"np.float32({self.e(x.a)})"
            return f"np.int64({self.e(x.a)})"
        if isinstance(x, Load):
            v = f"{x.buf}[{self.e(x.index)}]"
            if x.buf in self.f16:
                return f"f16_bits_to_f32({v})"
            return v if self._is_float_buf(x.buf) else f"np.int64({v})"
        if isinstance(x, Table):
            self.tables.add(x.name)
            return f"_TABLE_{x.name}[{self.e(x.index)}]"
        if isinstance(x, Call):
            args = ", ".join(self.e(a) for a in x.args)
            if x.fn == "rsqrt":
                return f"np.float32(np.float32(1.0) / math.sqrt({args}))"
            if x.fn in _MATH:
                call = f"{_MATH[x.fn]}({args})"
                return f"np.float32({call})" if x.fn in _FLOAT_RESULT else call
            return f"{x.fn}({args})"
        raise TypeError(f"cannot render {x!r}")

    def _is_float_buf(self, name: str) -> bool:
        return self.k.dtype_of(name) in ("f32", "f16")

    def emit(self, depth: int, text: str) -> None:
        self.lines.append("    " * depth + text)

    def body(self, stmts, depth: int) -> None:
        if not stmts:
            self.emit(depth, "pass")
        for s in stmts:
            self.stmt(s, depth)

    def stmt(self, s, d: int) -> None:
        if isinstance(s, Let | Assign):
            self.emit(d, f"{s.name} = {self.e(s.expr)}")
        elif isinstance(s, Decl):
            conv = "np.float32" if s.dtype == "f32" else "np.int64"
            self.emit(d, f"{s.name} = {conv}({self.e(s.init)})")
        elif isinstance(s, Store):
            v = self.e(s.value)
            if s.buf in self.f16:
                v = f"f32_to_f16_bits({v})"
            self.emit(d, f"{s.buf}[{self.e(s.index)}] = {v}")
        elif isinstance(s, For):
            step = f", {s.step}" if s.step != 1 else ""
            self.emit(d, f"for {s.var} in range({self.e(s.start)}, {self.e(s.stop)}{step}):")
            self.body(s.body, d + 1)
        elif isinstance(s, LaneFor):
            self.emit(d, f"for {s.var} in range({self.e(s.stop)}):")
            self.body(s.body, d + 1)
        elif isinstance(s, Reduce):
            init = "np.float32(0.0)" if s.op == "+" else "np.float32(-np.inf)"
            acc = f"_acc_{s.name}"
            self.emit(d, f"{acc} = {init}")
            self.emit(d, f"for {s.var} in range({self.e(s.stop)}):")
            for sub in s.body:
                self.stmt(sub, d + 1)
            if s.op == "+":
                self.emit(d + 1, f"{acc} += {self.e(s.value)}")
            else:
                self.emit(d + 1, f"{acc} = max({acc}, {self.e(s.value)})")
            self.emit(d, f"{s.name} = {acc}")
        elif isinstance(s, If):
            self.emit(d, f"if {self.e(s.cond)}:")
            self.body(s.then, d + 1)
            if s.orelse:
                self.emit(d, "else:")
                self.body(s.orelse, d + 1)
        else:
            raise TypeError(f"cannot render {s!r}")

    def kernel(self) -> str:
        k = self.k
        names = [p.name for p in k.params]
        dims = [f"_G{i}" for i in range(len(k.grid))]
        self.emit(0, "@njit(parallel=True, cache=True)")
        self.emit(0, f"def {k.name}({', '.join(names + dims)}):")
        total = " * ".join(dims)
        self.emit(1, f"for _g in prange({total}):")
        rest = "_g"
        for i in range(len(dims) - 1, -1, -1):
            if i == 0:
                self.emit(2, f"g0 = {rest}")
            else:
                self.emit(2, f"g{i} = {rest} % {dims[i]}")
                self.emit(2, f"_r{i} = {rest} // {dims[i]}")
                rest = f"_r{i}"
        for a in k.local:
            self.emit(2, f"{a.name} = np.empty({a.size}, np.{NUMPY_DTYPES[a.dtype]})")
        self.body(k.body, 2)
        return "\n".join(self.lines)


def render(k: Kernel) -> str:
    """Python/Numba source of one kernel: a module with the prelude and one `@njit` function `k.name`."""
    r = _Renderer(k)
    body = r.kernel()
    # Module-level arrays are frozen into the compiled code as constants.
    tables = "".join(f"_TABLE_{n} = np.array({list(TABLES[n])}, np.int64)\n" for n in sorted(r.tables))
    return PRELUDE + "\n" + tables + "\n\n" + body + "\n"

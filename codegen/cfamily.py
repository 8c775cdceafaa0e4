"""One printer for C-family kernel languages (OpenCL C, CUDA C++, HIP, C for the host): kernel IR -> source text.

`CPrinter` renders a kernel after `codegen/lanes.py` has made its lane semantics explicit: it spells `For`
loops that start at `LaneId()`, `Barrier`s, `SubgroupReduce`s and the lane-0 `If`s the lowering wrote, and
decides nothing about lanes itself. A target subclasses it and overrides only what differs: type names,
qualifiers, ids, the barrier, f16 conversions, bit casts, subgroup reductions, the unroll pragma, the kernel
signature, the host-side launcher, native replacements of intrinsics. A target that runs a group as one
thread passes `ONE_LANE` and needs no lane id, barrier or local-memory spelling.
Arithmetic is int / uint / float only (never double), mirroring the IR's i32 / u32 / f32.
"""

from __future__ import annotations

import math
import re

import numpy as np

from polystrata.codegen.lanes import Barrier, LaneAbilities, LaneId, MatrixOp, SubgroupReduce, lower
from polystrata.ir.expr import TABLES, Table
from polystrata.ir.kernel import (
    INTRINSICS,
    MATH,
    NUMBA_ONLY_INTRINSICS,
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
    KernelError,
    Let,
    Load,
    Scalar,
    Select,
    Store,
    ToF32,
    Var,
    promised_bytes,
)

# Value types of expressions: "i" (int), "u" (unsigned int), "f" (float).
_VALUE_TYPE = {"f32": "f", "f16": "f", "u32": "u"}
_CMP = ("<", "<=", "==", "!=")

# Portable C definitions of the intrinsics. `{fn}` is the function qualifier, `{f2u}` / `{u2f}` the target's
# bit casts float <-> uint. All of them are exact (bit-for-bit equal to numpy).
# The bit casts float <-> uint in standard C (`CPrinter.bitcast_helpers`), for targets without builtin ones.
BITCASTS = """\
{fn} uint ps_float_as_uint(float f) {{ union {{ float f; uint u; }} c; c.f = f; return c.u; }}
{fn} float ps_uint_as_float(uint u) {{ union {{ float f; uint u; }} c; c.u = u; return c.f; }}
"""

_PORTABLE = {
    "f16_bits_to_f32": """\
{fn} float ps_f16_bits_to_f32(uint x) {{
    uint h = x & 0xFFFFu, s = (h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    if (e == 0u) return {u2f}({f2u}((float)m * 5.9604644775390625e-08f) | s);  /* zero, subnormal: m * 2^-24 */
    if (e == 31u) return {u2f}(s | 0x7F800000u | (m << 13));  /* inf, nan (payload kept) */
    return {u2f}(s | ((e + 112u) << 23) | (m << 13));
}}
""",
    "f32_to_f16_bits": """\
{fn} uint ps_f32_to_f16_bits(float f) {{
    uint x = {f2u}(f), sign = (x >> 16) & 0x8000u, ax = x & 0x7FFFFFFFu;
    if (ax > 0x7F800000u) {{  /* nan: keep the top payload bits, stay a nan */
        uint r = 0x7C00u | ((ax & 0x7FFFFFu) >> 13);
        return sign | (r == 0x7C00u ? 0x7C01u : r);
    }}
    if (ax >= 0x477FF000u) return sign | 0x7C00u;  /* >= 65520 rounds to inf */
    if (ax < 0x38800000u) {{  /* below 2^-14: f16 subnormal or zero */
        if (ax < 0x33000000u) return sign;
        uint sh = 126u - (ax >> 23), m = (ax & 0x7FFFFFu) | 0x800000u;
        uint r = m >> sh, rem = m & ((1u << sh) - 1u), hb = 1u << (sh - 1u);
        return sign | (r + ((rem > hb || (rem == hb && (r & 1u))) ? 1u : 0u));
    }}
    uint r = (ax >> 13) - (112u << 10), rem = ax & 0x1FFFu;  /* rebias exponent, keep 10 mantissa bits */
    return sign | (r + ((rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ? 1u : 0u));
}}
""",
    "dot4_i8": """\
{fn} int ps_dot4_i8(uint a, uint b, int acc) {{
    for (uint k = 0u; k < 4u; k++)  /* sign-extend byte k of each word by shifting it to the top */
        acc += ((int)(a << (24u - 8u * k)) >> 24) * ((int)(b << (24u - 8u * k)) >> 24);
    return acc;
}}
""",
    # A macro, so it works on a buffer in any address space.
    "load_u32": """\
#define ps_load_u32(p, i) ((uint)(p)[(i)] | ((uint)(p)[(i) + 1] << 8) | ((uint)(p)[(i) + 2] << 16) \\
    | ((uint)(p)[(i) + 3] << 24))
""",
}


class CPrinter:
    """Renders one `Kernel` as C-family source; subclasses supply the target's spellings."""

    # IR dtype -> C type (storage types for buffers; int/uint/float for values).
    ctypes = {"f32": "float", "f16": "unsigned short", "i32": "int", "u32": "unsigned int", "i16": "short",
              "u16": "unsigned short", "i8": "signed char", "u8": "unsigned char"}
    func_qualifier = "static inline"
    const_array_qualifier = "static const"
    # Float math: IR name -> C function (float versions).
    float_math = {"exp": "expf", "tanh": "tanhf", "sqrt": "sqrtf", "cos": "cosf", "sin": "sinf", "log": "logf",
                  "pow": "powf", "abs": "fabsf", "max": "fmaxf", "min": "fminf"}
    # Intrinsics the target renders natively: name -> format string over the rendered arguments.
    native_intrinsics: dict[str, str] = {}
    # `load_u32` at a promised alignment (2, 4, 8, 16; 8 and 16 fall back to 4's): format strings over (buffer,
    # byte offset); others: bytes. The defaults are GCC / Clang C (hiprtc and NVRTC too): word loads, little-endian,
    # and at 8 and 16 bytes the promise told to the compiler, which may merge a run of words into one vector load.
    aligned_loads: dict[int, str] = {
        16: "(*(const unsigned int *)__builtin_assume_aligned({0} + ({1}), 16))",
        8: "(*(const unsigned int *)__builtin_assume_aligned({0} + ({1}), 8))",
        4: "(*(const unsigned int *)({0} + ({1})))",
        2: "((unsigned int)*(const unsigned short *)({0} + ({1})) "
           "| ((unsigned int)*(const unsigned short *)({0} + ({1}) + 2) << 16))",
    }
    # A 4-byte element load whose `align` promises 8 or 16 bytes (`ir.kernel.promised_bytes`): format string over
    # (C type, pointer expression, bytes); None: a plain load.
    aligned_element: str | None = "(*(const {0} *)__builtin_assume_aligned({1}, {2}))"
    # f16 elements of global buffers in the target's own conversions: format strings over (buffer, index) and
    # (buffer, index, value); None: the portable bit conversions.
    f16_load: str | None = None
    f16_store: str | None = None
    # The target's butterfly step over a subgroup, a format string over (value, lane mask) (e.g. HIP's
    # `__shfl_xor({0}, {1})`): `subgroup_reduce` is then a helper function of these steps.
    shuffle_xor: str | None = None

    def __init__(self, kernel: Kernel, abilities: LaneAbilities | None = None):
        """`abilities`: what the target does with lanes (`codegen/lanes.py`): the default is a group of
        `kernel.lanes` concurrent lanes combined through local memory; `ONE_LANE` renders a group as one thread."""
        abilities = abilities or LaneAbilities()
        self.k = lower(kernel, abilities)
        self.lanes = kernel.lanes
        self.parallel = abilities.parallel and kernel.lanes > 1
        self.lines: list[str] = []
        self.scopes: list[dict[str, tuple[str, str]]] = [{}]
        self.used_intrinsics: set[str] = set()
        self.tables: set[str] = set()
        self.counter = 0
        self.used_bitcasts = False
        self.subgroup_helpers: dict[str, int] = {}  # op -> lanes its butterfly helper reduces
        self.local_names = {a.name for a in self.k.local}

    # --- target hooks ---------------------------------------------------------------------------------

    def ctype(self, t: str) -> str:
        """C type of a value type "i" / "u" / "f"."""
        return {"i": self.ctypes["i32"], "u": self.ctypes["u32"], "f": "float"}[t]

    # Bit casts float <-> uint (function names; the defaults are defined by `bitcast_helpers`).
    f2u = "ps_float_as_uint"
    u2f = "ps_uint_as_float"

    def bitcast_helpers(self) -> str:
        """Definitions of the `f2u` / `u2f` functions, put before the intrinsics that use them (default: standard
        C through a union; a target whose language has builtin bit casts names those and returns "")."""
        return self.portable(BITCASTS) if self.f2u == "ps_float_as_uint" else ""

    def portable(self, template: str) -> str:
        """A portable C definition (`_PORTABLE`, `BITCASTS`) spelled for this target."""
        text = template.format(fn=self.func_qualifier, f2u=self.f2u, u2f=self.u2f)
        return re.sub(r"\buint\b", self.ctypes["u32"], text)

    # Pointer element type of f16 buffer parameters (None: the storage type `ctypes["f16"]`).
    f16_buffer_type: str | None = None

    def group_id(self, d: int) -> str:
        """Id of this group in grid dimension `d`."""
        raise NotImplementedError

    def local_id(self) -> str:
        """Id of this lane within its group (dimension 0)."""
        raise NotImplementedError

    def barrier(self, local: bool, global_: bool) -> str:
        """Group barrier statement making local and/or global memory writes visible."""
        raise NotImplementedError

    def local_decl(self, ctype: str, name: str, size: int) -> str:
        """Declaration of a group-shared array (default: a plain array, right for a one-lane target)."""
        return f"{ctype} {name}[{size}];"

    def unroll(self, n: int | None = None) -> str:
        """The line asking the compiler to unroll the next loop `n` times (None: fully); "" for none."""
        return "#pragma unroll" + (f" {n}" if n else "")

    def load_f16(self, buf: str, index: str) -> str:
        """f16 element of a global buffer as float (`f16_load`, else the portable bit conversion)."""
        if self.f16_load:
            return self.f16_load.format(buf, index)
        self.used_intrinsics.add("f16_bits_to_f32")
        return f"ps_f16_bits_to_f32({buf}[{index}])"

    def store_f16(self, buf: str, index: str, value: str) -> str:
        """Statement storing float `value` as f16 (round to nearest even) into a global buffer (`f16_store`, else
        the portable bit conversion)."""
        if self.f16_store:
            return self.f16_store.format(buf, index, value)
        self.used_intrinsics.add("f32_to_f16_bits")
        return f"{buf}[{index}] = ({self.ctypes['f16']})ps_f32_to_f16_bits({value});"

    def subgroup_reduce(self, op: str, x: str, width: int) -> str:
        """Reduction of float `x` (op "+" or "max") over the first `width` lanes of the subgroup, result in every
        lane (only called where the target's `LaneAbilities` declare a subgroup). Default: a helper of
        `shuffle_xor` butterfly steps, which leaves the same bits in every lane (a + b == b + a)."""
        if not self.shuffle_xor:
            raise NotImplementedError(f"{type(self).__name__} declares a subgroup but spells no reduction")
        self.subgroup_helpers[op] = width  # one width per kernel: its lanes decide
        return f"ps_subgroup_{'add' if op == '+' else 'max'}({x})"

    def subgroup_helper(self, op: str, width: int) -> str:
        """The butterfly helper function behind `subgroup_reduce`."""
        name, step = ("add", "x = x + {};") if op == "+" else ("max", "x = fmaxf(x, {});")
        return (f"{self.func_qualifier} float ps_subgroup_{name}(float x) {{\n{self.unroll()}\n"
                f"    for (int o = {width // 2}; o > 0; o >>= 1) {step.format(self.shuffle_xor.format('x', 'o'))}\n"
                "    return x;\n}\n")

    def matrix_op(self, op: str, accs: list[str], a: list[str], b: list[str]) -> str:
        """One instruction of the target's `MatrixUnit` (`lanes.MatrixOp`): accumulator variables and operand words
        (unsigned int expressions); only called where the target declared one."""
        raise NotImplementedError(f"{type(self).__name__} declares no matrix unit")

    def prelude(self) -> str:
        """Text before everything else (pragmas, includes)."""
        return ""

    def signature(self, params: list[str]) -> str:
        """The kernel function's header, up to and excluding the opening brace."""
        raise NotImplementedError

    def launcher(self, params: list[str]) -> str:
        """Text after the kernel function: a host target's entry point looping over the grid and calling the
        kernel once per grid point (whose `group_id` then reads that point); "" where the device launches."""
        return ""

    def param_decl(self, p: Buf | Scalar) -> str:
        """One kernel parameter."""
        if isinstance(p, Scalar):
            return f"{'float' if p.dtype == 'f32' else self.ctypes['i32']} {p.name}"
        const = "" if p.out else "const "
        t = self.f16_buffer_type if p.dtype == "f16" and self.f16_buffer_type else self.ctypes[p.dtype]
        return f"{const}{t}* {p.name}"

    # --- names and types ------------------------------------------------------------------------------

    def lookup(self, name: str) -> tuple[str, str]:
        for scope in reversed(self.scopes):
            if name in scope:
                return scope[name]
        raise KernelError(f"{self.k.name}: unknown variable {name!r}")

    def bind(self, name: str, t: str) -> str:
        """Declare IR variable `name` of value type `t` in the current scope; returns its C name."""
        taken = any(name in s for s in self.scopes)
        cname = name
        if taken or name.startswith("ps_") or name.startswith("_"):
            # A re-bound name (legal in the IR, not in one C block) gets a fresh spelling.
            self.counter += 1
            cname = f"{name.lstrip('_')}_{self.counter}"
        self.scopes[-1][name] = (cname, t)
        return cname

    def typeof(self, e) -> str:
        """Value type of an expression."""
        if isinstance(e, int | float) and not isinstance(e, bool):
            e = Const(e)
        if isinstance(e, Const):
            if isinstance(e.value, float):
                return "f"
            return "i" if -(2**31) <= e.value < 2**31 else "u"
        if isinstance(e, Var):
            return self.lookup(e.name)[1]
        if isinstance(e, LaneId):
            return "i"
        if isinstance(e, Bin):
            if e.op in _CMP:
                return "i"
            if e.op == "/":
                return "f"
            if e.op in (">>", "<<"):
                return self.typeof(e.a)
            return _join(self.typeof(e.a), self.typeof(e.b))
        if isinstance(e, Select):
            return _join(self.typeof(e.a), self.typeof(e.b))
        if isinstance(e, ToF32):
            return "f"
        if isinstance(e, Cast):
            return _VALUE_TYPE.get(e.dtype, "i")
        if isinstance(e, Load):
            return _VALUE_TYPE.get(self.k.dtype_of(e.buf), "i")
        if isinstance(e, Table):
            return "i"
        if isinstance(e, Call):
            res = (MATH.get(e.fn) or INTRINSICS[e.fn])[1]
            if res is None:
                ts = [self.typeof(a) for a in e.args]
                return ts[0] if len(ts) == 1 else _join(*ts)
            return _VALUE_TYPE.get(res, "i")
        raise TypeError(f"cannot type {e!r}")

    # --- expressions ----------------------------------------------------------------------------------

    def float_lit(self, v: float) -> str:
        if not math.isfinite(v):
            self.used_bitcasts = True
        if math.isnan(v):
            return f"{self.u2f}(0x7FC00000u)"
        if math.isinf(v):
            return f"{self.u2f}({'0x7F800000u' if v > 0 else '0xFF800000u'})"
        # Shortest decimal of the float32 value: parses back to exactly that float.
        s = repr(float(np.float32(v)))
        return f"{s}f" if ("." in s or "e" in s) else f"{s}.0f"

    def as_type(self, e, t: str) -> str:
        """`e` rendered and converted to value type `t` where it is not already."""
        s = self.e(e)
        return s if self.typeof(e) == t else f"(({self.ctype(t)})({s}))"

    def e(self, x) -> str:
        """Render an expression."""
        if isinstance(x, int | float) and not isinstance(x, bool):
            x = Const(x)
        if isinstance(x, Const):
            v = x.value
            if isinstance(v, float):
                return self.float_lit(v)
            if -(2**31) <= v < 2**31:
                return str(v) if v >= 0 else ("(-2147483647 - 1)" if v == -(2**31) else f"({v})")
            if 0 <= v < 2**32:
                return f"{v}u"
            raise KernelError(f"{self.k.name}: integer constant {v} does not fit 32 bits")
        if isinstance(x, Var):
            return self.lookup(x.name)[0]
        if isinstance(x, LaneId):
            return self.lid
        if isinstance(x, Bin):
            if x.op == "/":
                return f"({self.as_type(x.a, 'f')} / {self.as_type(x.b, 'f')})"
            op = "/" if x.op == "//" else x.op  # the IR guarantees non-negative operands for // and %
            return f"({self.e(x.a)} {op} {self.e(x.b)})"
        if isinstance(x, Select):
            t = self.typeof(x)
            return f"({self.e(x.cond)} ? {self.as_type(x.a, t)} : {self.as_type(x.b, t)})"
        if isinstance(x, ToF32):
            return self.as_type(x.a, "f")
        if isinstance(x, Cast):
            return f"(({self.ctype(_VALUE_TYPE.get(x.dtype, 'i'))})({self.e(x.a)}))"
        if isinstance(x, Load):
            dt = self.k.dtype_of(x.buf)
            buf, idx = self.lookup_buf(x.buf), self.e(x.index)
            if dt == "f16":
                if x.buf in self.local_names:
                    self.used_intrinsics.add("f16_bits_to_f32")
                    return f"ps_f16_bits_to_f32({buf}[{idx}])"
                return self.load_f16(buf, idx)
            if self.aligned_element and promised_bytes(self.k, x):
                return self.aligned_element.format(self.ctypes[dt], f"{buf} + ({idx})", promised_bytes(self.k, x))
            if dt in ("f32", "i32", "u32"):
                return f"{buf}[{idx}]"
            return f"(({self.ctypes['i32']}){buf}[{idx}])"  # narrow integers widen to int
        if isinstance(x, Table):
            if x.name not in TABLES:
                raise KernelError(f"{self.k.name}: unknown table {x.name}")
            self.tables.add(x.name)
            return f"ps_table_{x.name}[{self.e(x.index)}]"
        if isinstance(x, Call):
            return self.call(x)
        raise TypeError(f"cannot render {x!r}")

    def lookup_buf(self, name: str) -> str:
        return name

    def call(self, x: Call) -> str:
        if x.fn in NUMBA_ONLY_INTRINSICS:
            raise KernelError(f"{self.k.name}: {x.fn} has no C-family form (the CPU target's kernels use it)")
        if x.fn in INTRINSICS:
            if x.fn == "load_u32":
                if not isinstance(x.args[0], Var) or self.k.dtype_of(x.args[0].name) != "u8":
                    raise KernelError(f"{self.k.name}: load_u32 needs a u8 buffer as first argument")
                align = x.args[2].value if isinstance(x.args[2], Const) else 0
                if align not in (1, 2, 4, 8, 16):
                    raise KernelError(f"{self.k.name}: load_u32 needs a constant alignment of 1, 2, 4, 8 or 16")
                args = [x.args[0].name, self.as_type(x.args[1], "i")]
                form = self.aligned_loads.get(align) or self.aligned_loads.get(min(align, 4))
                if form:
                    return form.format(*args)
            else:
                want = {"f16_bits_to_f32": "u", "f32_to_f16_bits": "f", "dot4_i8": "uui"}[x.fn]
                args = [self.as_type(a, t) for a, t in zip(x.args, want)]
            if x.fn in self.native_intrinsics:
                return self.native_intrinsics[x.fn].format(*args)
            self.used_intrinsics.add(x.fn)
            return f"ps_{x.fn}({', '.join(args)})"
        t = self.typeof(x)
        if t == "f":
            if x.fn == "rsqrt":
                return self.rsqrt(self.as_type(x.args[0], "f"))
            return f"{self.float_math[x.fn]}({', '.join(self.as_type(a, 'f') for a in x.args)})"
        a = [self.as_type(arg, t) for arg in x.args]
        return self.int_math(x.fn, a, t)

    def rsqrt(self, x: str) -> str:
        """1/sqrt(x) (the portable definition; targets may use a native rsqrt)."""
        return f"(1.0f / {self.float_math['sqrt']}({x}))"

    def int_math(self, fn: str, a: list[str], t: str) -> str:
        """abs / max / min on int or uint values (portable ternaries; operands are side-effect free)."""
        if fn == "abs":
            return a[0] if t == "u" else f"({a[0]} < 0 ? -{a[0]} : {a[0]})"
        cmp = ">" if fn == "max" else "<"
        return f"({a[0]} {cmp} {a[1]} ? {a[0]} : {a[1]})"

    # --- statements -----------------------------------------------------------------------------------

    def emit(self, d: int, text: str) -> None:
        self.lines.append("    " * d + text)

    def block(self, stmts, d: int) -> None:
        self.scopes.append({})
        for s in stmts:
            self.stmt(s, d)
        self.scopes.pop()

    def stmt(self, s, d: int) -> None:
        """Render one statement of the lowered kernel."""
        if isinstance(s, Let):
            t = self.typeof(s.expr)
            value = self.e(s.expr)
            self.emit(d, f"const {self.ctype(t)} {self.bind(s.name, t)} = {value};")
        elif isinstance(s, Decl):
            t = _VALUE_TYPE.get(s.dtype, "i")
            value = self.as_type(s.init, t)
            self.emit(d, f"{self.ctype(t)} {self.bind(s.name, t)} = {value};")
        elif isinstance(s, Assign):
            cname, t = self.lookup(s.name)
            self.emit(d, f"{cname} = {self.as_type(s.expr, t)};")
        elif isinstance(s, Store):
            self.emit(d, self.store(s))
        elif isinstance(s, For):
            self.scopes.append({})
            start, stop = self.e(s.start), self.e(s.stop)
            v = self.bind(s.var, "i")
            cmp = "<" if s.step > 0 else ">"
            if s.unroll > 1 and self.unroll(s.unroll):
                self.emit(d, self.unroll(s.unroll))
            self.emit(d, f"for (int {v} = {start}; {v} {cmp} {stop}; {v} += {s.step}) {{")
            self.block(s.body, d + 1)
            self.scopes.pop()
            self.emit(d, "}")
        elif isinstance(s, If):
            self.emit(d, f"if ({self.e(s.cond)}) {{")
            self.block(s.then, d + 1)
            if s.orelse:
                self.emit(d, "} else {")
                self.block(s.orelse, d + 1)
            self.emit(d, "}")
        elif isinstance(s, Barrier):
            self.emit(d, self.barrier(s.local, s.global_))
        elif isinstance(s, SubgroupReduce):
            cname = self.lookup(s.var)[0]
            self.emit(d, f"{cname} = {self.subgroup_reduce(s.op, cname, s.width)};")
        elif isinstance(s, MatrixOp):
            self.emit(d, self.matrix_op(s.op, [self.lookup(a)[0] for a in s.accs],
                                        [self.as_type(x, "u") for x in s.a], [self.as_type(x, "u") for x in s.b]))
        else:
            raise TypeError(f"cannot render {s!r}")

    def store(self, s: Store) -> str:
        dt = self.k.dtype_of(s.buf)
        buf, idx = self.lookup_buf(s.buf), self.e(s.index)
        if dt == "f16":
            value = self.as_type(s.value, "f")
            if s.buf in self.local_names:
                self.used_intrinsics.add("f32_to_f16_bits")
                return f"{buf}[{idx}] = ({self.ctypes['f16']})ps_f32_to_f16_bits({value});"
            return self.store_f16(buf, idx, value)
        value = self.as_type(s.value, _VALUE_TYPE.get(dt, "i"))
        return f"{buf}[{idx}] = ({self.ctypes[dt]})({value});"

    # --- whole kernel ---------------------------------------------------------------------------------

    lid = "ps_lid"

    def render(self) -> str:
        """The complete source: prelude, tables, intrinsic definitions, the kernel and its launcher."""
        k = self.k
        for p in k.params:
            self.scopes[0][p.name] = (p.name, "f" if isinstance(p, Scalar) and p.dtype == "f32" else
                                      ("i" if isinstance(p, Scalar) else "ptr"))
        for a in k.local:
            self.scopes[0][a.name] = (a.name, "ptr")
        self.scopes.append({})
        for dim in range(len(k.grid)):
            self.scopes[-1][f"g{dim}"] = (f"g{dim}", "i")
        if self.parallel:
            self.emit(1, f"const int {self.lid} = {self.local_id()};")
        for dim in range(len(k.grid)):
            self.emit(1, f"const int g{dim} = {self.group_id(dim)};")
        for a in k.local:
            self.emit(1, self.local_decl(self.ctypes[a.dtype], a.name, a.size))
        for s in k.body:
            self.stmt(s, 1)
        body = self.lines
        head = [self.prelude()]
        for n in sorted(self.tables):
            vals = ", ".join(str(v) for v in TABLES[n])
            head.append(f"{self.const_array_qualifier} int ps_table_{n}[{len(TABLES[n])}] = {{{vals}}};\n")
        if self.used_bitcasts or self.used_intrinsics & {"f16_bits_to_f32", "f32_to_f16_bits"}:
            head.append(self.bitcast_helpers())
        head += [self.portable(_PORTABLE[n]) for n in sorted(self.used_intrinsics)]
        head += [self.subgroup_helper(op, width) for op, width in sorted(self.subgroup_helpers.items())]
        params = [self.param_decl(p) for p in k.params]
        about = f"{k.name}: lanes {k.lanes}, grid ({len(k.grid)} dims), knobs {dict(k.knobs)}".replace("*/", "* /")
        doc = f"/* {about} */\n"  # a knob's text cannot end the comment
        return ("".join(head) + doc + self.signature(params) + " {\n" + "\n".join(body) + "\n}\n"
                + self.launcher(params))


def _join(a: str, b: str) -> str:
    """C's usual arithmetic conversions on int / uint / float."""
    if "f" in (a, b):
        return "f"
    if "u" in (a, b):
        return "u"
    return "i"

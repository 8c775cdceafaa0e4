"""One printer for Python-source targets compiled by Numba (CPU `@njit`, CUDA `@cuda.jit`): kernel IR -> source.

`PyPrinter` renders expressions with a float32 discipline (every float literal and conversion is `np.float32`,
so Numba never widens arithmetic to float64; integers are int64, a superset of the IR's i32 / u32 for the
values kernels produce), statements, tables (module-level int64 arrays, frozen into the compiled code) and the
portable intrinsics (`HELPERS`: exact integer bit manipulation, valid in Numba on the CPU and on CUDA).

A target subclasses it the way `codegen/cfamily.py` targets subclass `CPrinter`, overriding only what differs:
the imports and helper decorator, the kernel header (how a grid point and its lane are found, where local
arrays live), and the spellings of the lane constructs `codegen/lanes.py` lowers `LaneFor`, `Reduce` and
uniform stores into (the lane id, `Barrier`, `SubgroupReduce`); a one-lane target (the CPU) gets none of them.
"""

from __future__ import annotations

import math
from collections import Counter

from polystrata.codegen.lanes import ONE_LANE, Barrier, LaneAbilities, LaneId, MatrixOp, SubgroupReduce, lower
from polystrata.ir.expr import TABLES, Table
from polystrata.ir.kernel import (
    DTYPE_BYTES,
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
    Select,
    Store,
    ToF32,
    Var,
    promised_bytes,
)

# Storage dtype of each IR buffer dtype (numpy names); f16 is kept as its bits.
NUMPY_DTYPES = {"f32": "float32", "f16": "uint16", "i32": "int32", "u32": "uint32", "i16": "int16",
                "u16": "uint16", "i8": "int8", "u8": "uint8"}

# The intrinsics' portable definitions; `{dec}` is the target's decorator for an inlined helper function.
HELPERS = '''\
@{dec}
def f16_bits_to_f32(h):
    h = np.int64(h) & 0xFFFF
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 31:
        v = np.float32(np.inf) if m == 0 else np.float32(np.nan)
    elif e == 0:
        v = np.float32(m) * np.float32(5.960464477539063e-08)
    else:
        v = np.float32(1024 + m) * np.float32(np.int64(1) << e) * np.float32(2.9802322387695312e-08)  # exact
    return -v if h >> 15 else v

@{dec}
def f32_to_f16_bits(x):
    # Round to nearest even with integer arithmetic only (no float16 type, no rint on every target).
    x = np.float32(x)
    s = 0x8000 if math.copysign(np.float32(1.0), x) < 0 else 0
    a = abs(x)
    if a != a:
        return 0x7E00
    if a >= np.float32(65520.0):
        return s | 0x7C00
    if a == 0:
        return s
    f, e = math.frexp(a)
    q = np.int64(f * np.float32(16777216.0))
    sh = max(13, -np.int64(e))
    if sh > 30:
        return s
    r = q >> sh
    rem = q & ((np.int64(1) << sh) - 1)
    half = np.int64(1) << (sh - 1)
    if rem > half or (rem == half and (r & 1) == 1):
        r += 1
    return s | (r + ((max(np.int64(e), -13) + 13) << 10))

@{dec}
def dot4_i8(a, b, acc):
    s = acc
    for k in range(4):
        x = (np.int64(a) >> (8 * k)) & 0xFF
        y = (np.int64(b) >> (8 * k)) & 0xFF
        s += (x - 256 if x > 127 else x) * (y - 256 if y > 127 else y)
    return s

@{dec}
def load_u32(buf, i, align):
    return (np.int64(buf[i]) | (np.int64(buf[i + 1]) << 8) | (np.int64(buf[i + 2]) << 16)
            | (np.int64(buf[i + 3]) << 24))
'''

_MATH = {"exp": "math.exp", "tanh": "math.tanh", "sqrt": "math.sqrt", "cos": "math.cos", "sin": "math.sin",
         "log": "math.log", "pow": "math.pow", "abs": "abs", "max": "max", "min": "min"}
_FLOAT_RESULT = {"exp", "tanh", "sqrt", "cos", "sin", "log", "pow", "rsqrt"}


def prelude(imports: str, decorator: str) -> str:
    """Module header of a Numba target: its imports, then the intrinsic helpers under `decorator`."""
    return imports + "\n" + HELPERS.format(dec=decorator)


def _operands(x) -> tuple:
    """The subexpressions `PyPrinter.e` renders inside `x` (not the buffer name of a load)."""
    if isinstance(x, Bin):
        return x.a, x.b
    if isinstance(x, Select):
        return x.cond, x.a, x.b
    if isinstance(x, ToF32 | Cast):
        return (x.a,)
    if isinstance(x, Load | Table):
        return (x.index,)
    if isinstance(x, Call):
        return x.args[1:] if x.fn == "load_u32" else x.args
    return ()


def _index_of(x):
    """The index operand of a load (of a buffer, a table, or a word by `load_u32`), else None."""
    if isinstance(x, Load | Table):
        return x.index
    return x.args[1] if isinstance(x, Call) and x.fn == "load_u32" else None


def _reads_memory(x) -> bool:
    return isinstance(x, Load) or isinstance(x, Call) and x.fn == "load_u32"


def _reads(x, local: frozenset, memo: dict) -> tuple | None:
    """The variables `x` reads ("" for memory, through a load), sorted; None where it must not be shared (it
    loads from a local array). `memo`: earlier answers, by expression."""
    if x in memo:
        return memo[x]
    names: set[str] | None = set()
    for a in _operands(x):
        if isinstance(a, Var):
            names.add(a.name)
        elif not isinstance(a, LaneId | Const):
            r = _reads(a, local, memo)
            if r is None:
                names = None
                break
            names.update(r)
    buf = x.buf if isinstance(x, Load) else x.args[0].name if isinstance(x, Call) and x.fn == "load_u32" else None
    if names is not None and buf is not None:
        names = None if buf in local else names | {""}  # "": memory
    memo[x] = out = None if names is None else tuple(sorted(names))
    return out


class PyPrinter:
    """Renders one `Kernel` as a Python module for Numba; subclasses supply the target's execution mapping."""

    imports = "import math\nimport numpy as np\n"
    helper_decorator = ""
    # Intrinsics a target renders with its own functions (imported in `imports`): IR name -> function name.
    native_intrinsics: dict[str, str] = {}
    # Math functions a target renders with helpers of its own, written into a kernel's module where it calls them
    # (so the kernel's source, its cache key, holds them): IR name -> (function name, source with `{dec}`).
    native_math: dict[str, tuple[str, str]] = {}
    # Loads at a promised alignment through the target's own functions of (buffer, np.uint64 index): `load_u32`
    # by its alignment argument, and 4-byte element loads of buffer parameters by the bytes their `align` promises
    # (`promised_bytes`; 4 where it promises nothing more).
    aligned_loads: dict[int, str] = {}
    aligned_elements: dict[int, str] = {}
    # Repeated loads and their index arithmetic computed once within a run of statements (`straight`): for
    # NVVM's long unrolled kernels; the CPU's kernels are short, and gained nothing measurable.
    share_reads = False

    def __init__(self, k: Kernel, abilities: LaneAbilities = ONE_LANE):
        """`abilities`: what the target does with lanes (`codegen/lanes.py`; default: one thread per group)."""
        self.k = k = lower(k, abilities)
        self.lines: list[str] = []
        self.f16 = {p.name for p in k.params if isinstance(p, Buf) and p.dtype == "f16"}
        self.f16 |= {a.name for a in k.local if a.dtype == "f16"}
        self.tables: set[str] = set()
        self.math_helpers: set[str] = set()  # `native_math` names called
        # Repeated subexpressions of the straight-line run being rendered, bound to temporaries (`straight`).
        self.shared: dict[tuple, str] | None = None
        self.versions: dict[str, int] = {}  # variable (or "" for memory) -> assignments so far in the run
        self.single: set[str] = set()
        self.depth = 0
        self.in_index = False  # rendering the index of a load
        self.temps = 0
        self.local_names = frozenset(a.name for a in k.local)
        self.reads: dict = {}  # `_reads` memo

    # --- target hooks ---------------------------------------------------------------------------------

    def header(self) -> int:
        """Emit the decorator, `def` line and per-grid-point setup (g0.., local arrays); returns body depth."""
        raise NotImplementedError

    # Spellings of the lane constructs (targets with lanes only): the lane id, a barrier statement.
    lane_id = ""
    barrier = ""

    def subgroup_reduce(self, s: SubgroupReduce, d: int) -> None:
        """Emit the statements of a `SubgroupReduce` at depth `d`."""
        raise NotImplementedError

    # --- expressions ----------------------------------------------------------------------------------

    def e(self, x) -> str:
        """Render an expression (a repeated subexpression of the run being rendered: its temporary)."""
        if self.shared and (self.in_index or _reads_memory(x)) and (key := self.cse_key(x)) in self.shared:
            name = self.shared[key]
            if not name:  # its first use: bind it just before the statement being rendered
                read = self.memory_read(x) if _reads_memory(x) else ""
                self.shared[key] = name = f"_cse{self.temps}"
                self.temps += 1
                self.emit(self.depth, f"{name} = {read or self.render_expr(x)}")
            return self.widening(x).format(name) if _reads_memory(x) else name
        return self.render_expr(x)

    def memory_read(self, x) -> str:
        """A load (`Load`, `load_u32`) as its read of memory, before `widening`."""
        if isinstance(x, Call):
            i = self.index(x.args[1])
            if isinstance(x.args[2], Const) and x.args[2].value in self.aligned_loads:
                return f"{self.aligned_loads[x.args[2].value]}({x.args[0].name}, np.uint64({i}))"
            return f"load_u32({x.args[0].name}, {i}, {self.e(x.args[2])})"
        # Indices are never negative in the IR; an unsigned index spares Numba its wrap-around check, which
        # otherwise keeps loops over consecutive elements from vectorizing.
        i = self.index(x.index)
        promised = promised_bytes(self.k, x)
        if not promised and DTYPE_BYTES[self.k.dtype_of(x.buf)] == 4 and x.buf not in self.local_names:
            promised = 4  # a 4-byte element of a buffer parameter: in the same form as the promised ones
        if promised in self.aligned_elements:
            return f"{self.aligned_elements[promised]}({x.buf}, np.uint64({i}))"
        return f"{x.buf}[np.uint64({i})]"

    def widening(self, x) -> str:
        """The format that takes a load's read to the load's value (int64, f16 converted); a shared read keeps it
        at each use, where LLVM can narrow the arithmetic on it."""
        if isinstance(x, Call):
            aligned = isinstance(x.args[2], Const) and x.args[2].value in self.aligned_loads
            return "np.int64({})" if aligned else "{}"  # the portable helper returns an int64
        if x.buf in self.f16:
            return f"{self.native_intrinsics.get('f16_bits_to_f32', 'f16_bits_to_f32')}({{}})"
        return "{}" if self.k.dtype_of(x.buf) in ("f32", "f16") else "np.int64({})"

    def render_expr(self, x) -> str:
        if isinstance(x, Const):
            if isinstance(x.value, float):
                # repr gives 'inf'/'nan' for non-finite values, which are not Python names.
                v = x.value
                if math.isfinite(v):
                    return f"np.float32({v!r})"
                return "np.float32(np.nan)" if v != v else f"np.float32({'-' if v < 0 else ''}np.inf)"
            return repr(x.value)
        if isinstance(x, Var):
            return x.name
        if isinstance(x, LaneId):
            return self.lane_id
        if isinstance(x, Bin):
            op = x.op
            if op == "/":
                return f"np.float32({self.e(x.a)} / {self.e(x.b)})"
            return f"({self.e(x.a)} {op} {self.e(x.b)})"
        if isinstance(x, Select):
            cond = self.e(x.cond)
            shared, self.shared = self.shared, None  # a branch may not run: nothing in it is hoisted
            try:
                return f"({self.e(x.a)} if {cond} else {self.e(x.b)})"
            finally:
                self.shared = shared
        if isinstance(x, ToF32):
            return f"np.float32({self.e(x.a)})"
        if isinstance(x, Cast):
            if x.dtype == "f32":
                return f"np.float32({self.e(x.a)})"
            return f"np.int64({self.e(x.a)})"
        if isinstance(x, Load):
            return self.widening(x).format(self.memory_read(x))
        if isinstance(x, Table):
            self.tables.add(x.name)
            return f"_TABLE_{x.name}[{self.index(x.index)}]"
        if isinstance(x, Call):
            if x.fn == "load_u32":
                return self.widening(x).format(self.memory_read(x))
            args = ", ".join(self.e(a) for a in x.args)
            if x.fn == "rsqrt":
                return f"np.float32(np.float32(1.0) / math.sqrt({args}))"
            if x.fn in self.native_math:
                self.math_helpers.add(x.fn)
                return f"{self.native_math[x.fn][0]}({args})"
            if x.fn in _MATH:
                call = f"{_MATH[x.fn]}({args})"
                return f"np.float32({call})" if x.fn in _FLOAT_RESULT else call
            if x.fn in NUMBA_ONLY_INTRINSICS and x.fn not in self.native_intrinsics:
                raise KernelError(f"{self.k.name}: {x.fn} has no form on this target (the CPU's kernels use it)")
            return f"{self.native_intrinsics.get(x.fn, x.fn)}({args})"
        raise TypeError(f"cannot render {x!r}")

    # --- statements -----------------------------------------------------------------------------------

    def emit(self, depth: int, text: str) -> None:
        self.lines.append("    " * depth + text)

    def body(self, stmts, depth: int) -> None:
        if not stmts:
            self.emit(depth, "pass")
        run: list = []  # straight-line statements, rendered together (`straight`)
        for s in stmts:
            if isinstance(s, Let | Assign | Decl | Store) and self.share_reads:
                run.append(s)
            else:
                self.straight(run, depth)
                run = []
                self.stmt(s, depth)
        self.straight(run, depth)

    # --- repeated reads ------------------------------------------------------------------------------
    # Unrolled generated code repeats its loads (the same weight word read for each field it holds, each row's
    # scales for every token) and their index arithmetic (a block's address in every load of its words): Numba
    # types and lowers each copy, with its calls and casts, before NVVM merges them, which made long kernels
    # slow to compile (docs/benchmarks.md, "Compile time of the generated kernels"). Within a run of straight-line
    # statements, a load met more than once with the same values of its index's variables and no store in
    # between (buffers may alias) is read once into a temporary, just before the statement that first uses it,
    # and so is repeated index arithmetic. Each use keeps its own widening of the read (`memory_read`): LLVM
    # narrows integer arithmetic to 32 bits only on a value with one use. Branches of a select are left alone
    # (they may not run), as are loads of local arrays (other lanes write them).

    def straight(self, run: list, depth: int) -> None:
        """Render the straight-line statements `run` at `depth`, repeated subexpressions bound once."""
        self.versions = {}
        seen: dict[tuple, int] = {}
        for s in run:
            for x in self.stmt_exprs(s):
                self.count(x, seen)
            self.advance(s)
        self.versions = {}
        self.shared, self.depth = {key: "" for key, n in seen.items() if n > 1}, depth
        bound = Counter(s.name for s in run if not isinstance(s, Store))
        self.single = {n for n, times in bound.items() if times == 1}  # names bound once in the run
        try:
            for s in run:
                self.stmt(s, depth)
                self.advance(s)
        finally:
            self.shared = None

    @staticmethod
    def stmt_exprs(s) -> tuple:
        return (s.index, s.value) if isinstance(s, Store) else (s.init,) if isinstance(s, Decl) else (s.expr,)

    def advance(self, s) -> None:
        """What statement `s` changes: its variable, or memory (a store: buffers may alias)."""
        name = "" if isinstance(s, Store) else s.name
        self.versions[name] = self.versions.get(name, 0) + 1

    def count(self, x, seen: dict, in_index: bool = False) -> None:
        """Count the occurrences of the subexpressions of `x` that `e` would share: loads, and the arithmetic of
        their indices (those inside an occurrence already seen are not counted again: the temporary covers
        them). Other arithmetic stays where it is (shared, a decoded field would keep its uses in 64 bits)."""
        key = self.cse_key(x) if in_index or _reads_memory(x) else None
        if key is not None:
            seen[key] = seen.get(key, 0) + 1
            if seen[key] > 1:
                return
        index = _index_of(x)
        for a in (x.cond,) if isinstance(x, Select) else _operands(x):
            self.count(a, seen, in_index or a is index)

    def index(self, x) -> str:
        """Render the index of a load (its arithmetic shared within the run)."""
        inside, self.in_index = self.in_index, True
        try:
            return self.e(x)
        finally:
            self.in_index = inside

    def cse_key(self, x) -> tuple | None:
        """`x` with the versions of what it reads, if it is worth a temporary (an operation reading a variable or
        memory) and may have one; else None."""
        if not isinstance(x, Bin | Cast | ToF32 | Load | Call | Table):
            return None
        reads = _reads(x, self.local_names, self.reads)
        if not reads:
            return None
        return x, tuple(self.versions.get(n, 0) for n in reads)

    def store_text(self, s: Store) -> str:
        v = self.e(s.value)
        if s.buf in self.f16:
            v = f"{self.native_intrinsics.get('f32_to_f16_bits', 'f32_to_f16_bits')}({v})"
        return f"{s.buf}[np.uint64({self.e(s.index)})] = {v}"

    def stmt(self, s, d: int) -> None:
        """Render one statement of the lowered kernel."""
        if isinstance(s, Store):
            self.emit(d, self.store_text(s))
        elif (isinstance(s, Let) and s.name in self.single and not _reads_memory(s.expr)
              and self.shared.get(key := self.cse_key(s.expr)) == ""):
            self.shared[key] = s.name  # repeated index arithmetic bound by a let: the let's name is its temporary
            self.emit(d, f"{s.name} = {self.render_expr(s.expr)}")
        elif isinstance(s, Let | Assign):
            self.emit(d, f"{s.name} = {self.e(s.expr)}")
        elif isinstance(s, Decl):
            conv = "np.float32" if s.dtype == "f32" else "np.int64"
            self.emit(d, f"{s.name} = {conv}({self.e(s.init)})")
        elif isinstance(s, For) and s.unroll > 1 and s.step == 1:
            # Python has no unroll pragma: the body `unroll` times a trip (each copy re-binds the body's names),
            # so the copies' loads can be in flight together, then the remaining iterations one at a time.
            u, start, stop, trip, end = s.unroll, self.e(s.start), self.e(s.stop), f"_{s.var}_u", f"_{s.var}_end"
            self.emit(d, f"{end} = {start} + max(0, {stop} - {start}) // {u} * {u}")
            self.emit(d, f"for {trip} in range({start}, {end}, {u}):")
            for k in range(u):
                self.emit(d + 1, f"{s.var} = {trip} + {k}" if k else f"{s.var} = {trip}")
                self.body(s.body, d + 1)
            self.emit(d, f"for {s.var} in range({end}, {stop}):")
            self.body(s.body, d + 1)
        elif isinstance(s, For):
            step = f", {s.step}" if s.step != 1 else ""
            self.emit(d, f"for {s.var} in range({self.e(s.start)}, {self.e(s.stop)}{step}):")
            self.body(s.body, d + 1)
        elif isinstance(s, If):
            self.emit(d, f"if {self.e(s.cond)}:")
            self.body(s.then, d + 1)
            if s.orelse:
                self.emit(d, "else:")
                self.body(s.orelse, d + 1)
        elif isinstance(s, Barrier):
            self.emit(d, self.barrier)
        elif isinstance(s, SubgroupReduce):
            self.subgroup_reduce(s, d)
        elif isinstance(s, MatrixOp):
            # The target's instruction function returns the new accumulators.
            args = ", ".join([self.e(x) for x in s.a + s.b] + list(s.accs))
            self.emit(d, f"{', '.join(s.accs)} = {s.op}({args})")
        else:
            raise TypeError(f"cannot render {s!r}")

    # --- whole module ---------------------------------------------------------------------------------

    def render(self) -> str:
        """The module: prelude, the math helpers it calls, tables, then the kernel function `k.name`."""
        depth = self.header()
        self.body(self.k.body, depth)
        head = prelude(self.imports, self.helper_decorator)
        head += "".join("\n" + self.native_math[fn][1].format(dec=self.helper_decorator)
                        for fn in sorted(self.math_helpers))
        # Module-level arrays are frozen into the compiled code as constants.
        tables = "".join(f"_TABLE_{n} = np.array({list(TABLES[n])}, np.int64)\n" for n in sorted(self.tables))
        return head + "\n" + tables + "\n\n" + "\n".join(self.lines) + "\n"

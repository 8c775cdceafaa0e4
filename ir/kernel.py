"""Kernel IR: one target-neutral description of a compute kernel, rendered by every codegen target.

Execution model (what a recipe writer may assume, and what every target must honour):

* A kernel runs its `body` once per point of its `grid` (1 to 3 dims; grid variables `g0`, `g1`, `g2`). Grid
  points are independent and may run in any order or in parallel. On a GPU each grid point is one work-group
  of `lanes` work-items; on the CPU each grid point is one iteration of a parallel loop.
* The body has **sequential semantics**: read it as if one thread ran it. Targets with lanes make that true:
  - `LaneFor` loops are distributed over the lanes of the group (iterations must be independent);
  - `Reduce` is split over the lanes, then combined (subgroup shuffles where the target has them, local memory
    otherwise); its result is a *uniform* value that every lane sees;
  - every other statement is *uniform*: all lanes compute it redundantly, so it may only depend on grid
    variables, scalars, loads, uniform lets and `Reduce` results; a uniform `Store` is performed by lane 0;
  - a target inserts a barrier after every `LaneFor` and every uniform store into a `LocalArray`, so data
    written there is visible to whatever follows.
* `LaneFor` and `Reduce` appear only at group level (not inside each other, nor inside `For`/`If` bodies whose
  condition is not uniform). Inside them: `Let`, `Decl`, `Assign`, `Store`, `For`, `If`.
* Tile products (matrix units): a `Fragment` is a rows x cols accumulator tile (i32 or f32) owned by the group;
  `TileMMA` adds to it the product of two tiles of packed words in local arrays (int8 x int8 -> i32, or
  f16 x f16 -> f32); `TileEach` visits its elements (reading them with `FragElem`, writing them with `FragSet`),
  e.g. to scale, clear or store them. Read sequentially, these are plain loops, which is how a target without
  matrix units renders them (`codegen/lanes.py`: the fragment becomes a local array, each element owned by one
  lane). A target with matrix units keeps each fragment in the registers of its subgroups, in the layout its
  instruction wants, so `TileEach` must not assume which lane holds which element or in which order they come:
  its iterations are independent, and it reads local arrays and buffers, writes fragments, buffers and local
  arrays (each element its own places; what a `TileEach` stores into local arrays is visible after it).
  Like `LaneFor`, both appear only at group level; a target makes the local arrays a `TileMMA` or `TileEach`
  reads safe to overwrite afterwards (a barrier before the next write).

Expressions reuse the quantization expression nodes (`Const`, `Var`, `Bin`, `Select`, `ToF32`) from
`ir/expr.py` and add buffer loads, casts and calls. Calls are math functions and **intrinsics**; each intrinsic
has a portable definition (`INTRINSICS`) that a target without a native instruction renders instead.

Schedule knobs (`Kernel.knobs`) are the named choices a recipe made (lanes, rows per group, unroll, tile
sizes, ...): the autotuner searches them, and compile manifests record them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from polystrata.ir.expr import Bin, Const, Expr, Select, ToF32, Var, as_expr

# Element types of buffers and values. Arithmetic happens in i32 / u32 / f32; narrower types are storage.
DTYPES = ("f32", "f16", "i32", "u32", "i16", "u16", "i8", "u8")
DTYPE_BYTES = {"f32": 4, "f16": 2, "i32": 4, "u32": 4, "i16": 2, "u16": 2, "i8": 1, "u8": 1}

# name -> (arity, result type or None for "same as the first argument", portable definition for targets
# lacking a native form; None where every target has it natively).
MATH = {
    "exp": (1, "f32", None),
    "tanh": (1, "f32", None),
    "sqrt": (1, "f32", None),
    "rsqrt": (1, "f32", "1.0f / sqrt(x)"),
    "cos": (1, "f32", None),
    "sin": (1, "f32", None),
    "log": (1, "f32", None),
    "pow": (2, "f32", None),
    "abs": (1, None, None),
    "max": (2, None, None),
    "min": (2, None, None),
}
INTRINSICS = {
    # f16 bits (u16 in an i32/u32) -> f32: sign, exponent and mantissa rebuilt bit by bit; exact.
    "f16_bits_to_f32": (1, "f32", "bit manipulation (see codegen)"),
    # f32 -> f16 bits, round to nearest even (KV cache stores).
    "f32_to_f16_bits": (1, "u32", "bit manipulation (see codegen)"),
    # Sum of the four products of the signed bytes of two packed i32 words, plus acc (CUDA __dp4a).
    "dot4_i8": (3, "i32", "four byte extracts, multiplies and adds"),
    # Little-endian u32 from 4 bytes at byte offset i of a u8 buffer: load_u32(buf, i, align), `align` a
    # constant 1, 2, 4, 8 or 16 the caller promises divides i (buffers start 16-byte aligned): a 4-byte or two
    # 2-byte loads; at 8 or 16 a target may merge it with the words after it into one wide load.
    "load_u32": (3, "u32", "four byte loads, shifted and or-ed"),
    # Block-scaled int8 dot products of one row with two tokens: dot_i8_pair(out, oi, w, wo, x, xo0, xo1, sw, swo, sx,
    # sxo0, sxo1, steps, group) = token 0's, and token 1's written to local array out[oi]: each the sum over
    # s < steps, e < 32 of sw[swo + (32 s + e) / group] * sx[sxo + s] * w_e * x_e, w_e the unsigned byte e of step
    # s of buffer or local array w from byte wo, x_e the signed byte of x from byte xo (xo0 / sxo0, xo1 / sxo1),
    # both in the chunked layout of `codegen/cpu_intrinsics.chunked_byte`; `group` (a constant 16 or 32) elements'
    # products summed as integers, then scaled. Numba targets only (the CPU's prefill matmul,
    # `tile_matmul_q8_kernel`): there a loop in LLVM IR (`codegen/cpu_intrinsics.py`).
    "dot_i8_pair": (14, "f32", "integer vector products and sums in LLVM IR"),
    # dot_f32(a, ao, b, bo, n) = the sum over i < n of a[ao + i] * b[bo + i] (f32 buffers or local arrays), summed in
    # an order of the target's choosing (a short dot product that a compiler would unroll rather than vectorize).
    # Numba targets only, as dot_i8_pair.
    "dot_f32": (5, "f32", "f32 vector multiply-adds in LLVM IR"),
}
# Intrinsics that only the Numba targets render (the others raise a KernelError naming them).
NUMBA_ONLY_INTRINSICS = ("dot_i8_pair", "dot_f32")
# The intrinsics that read buffers or local arrays named by their arguments: name -> the arguments' positions.
BUFFER_ARGS = {"load_u32": (0,), "dot_i8_pair": (2, 4, 7, 9), "dot_f32": (0, 2)}
REDUCE_OPS = ("+", "max")


@dataclass(frozen=True)
class Buf:
    """A buffer parameter: pointer to `dtype` elements. `out` marks buffers the kernel writes."""

    name: str
    dtype: str
    out: bool = False


@dataclass(frozen=True)
class Scalar:
    """A scalar parameter (i32 or f32), passed by value at launch."""

    name: str
    dtype: str = "i32"


Param = Buf | Scalar


@dataclass(frozen=True)
class Load(Expr):
    """Element `index` of buffer or local array `buf`, widened: integers to i32 (u32 stays u32), f16 to f32.

    `align` (a power of two) promises that `index` is a multiple of it (buffers start 16-byte aligned): a target
    may merge the load with the elements after it into one wide load (the CUDA target's 16-byte loads)."""

    buf: str
    index: Expr
    align: int = 1

    def __init__(self, buf: str, index: Expr | int, align: int = 1):
        if align < 1 or align & (align - 1):
            raise ValueError(f"load alignment {align} is not a power of two")
        object.__setattr__(self, "buf", buf)
        object.__setattr__(self, "index", as_expr(index))
        object.__setattr__(self, "align", align)


@dataclass(frozen=True)
class Cast(Expr):
    """Conversion to `dtype` (i32, u32 or f32); float -> int truncates toward zero."""

    dtype: str
    a: Expr

    def __init__(self, dtype: str, a: Expr | int | float):
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "a", as_expr(a))


@dataclass(frozen=True)
class Call(Expr):
    """A math function or intrinsic from `MATH` / `INTRINSICS`."""

    fn: str
    args: tuple[Expr, ...]

    def __init__(self, fn: str, *args: Expr | int | float):
        if fn not in MATH and fn not in INTRINSICS:
            raise ValueError(f"unknown function {fn!r}")
        arity = (MATH.get(fn) or INTRINSICS[fn])[0]
        if len(args) != arity:
            raise ValueError(f"{fn} takes {arity} arguments, got {len(args)}")
        object.__setattr__(self, "fn", fn)
        object.__setattr__(self, "args", tuple(as_expr(a) for a in args))


# --- statements ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Let:
    """Bind `name` to `expr` (immutable) for the rest of the enclosing block."""

    name: str
    expr: Expr


@dataclass(frozen=True)
class Decl:
    """Declare mutable variable `name` of `dtype` with an initial value."""

    name: str
    dtype: str
    init: Expr


@dataclass(frozen=True)
class Assign:
    """`name = expr` for a variable introduced by `Decl`."""

    name: str
    expr: Expr


@dataclass(frozen=True)
class Store:
    """`buf[index] = value`, converted to the buffer's dtype (f32 -> f16 rounds to nearest even)."""

    buf: str
    index: Expr
    value: Expr


@dataclass(frozen=True)
class For:
    """Serial loop `for var in range(start, stop, step)`; `unroll` is a hint."""

    var: str
    start: Expr
    stop: Expr
    body: tuple
    step: int = 1
    unroll: int = 1


@dataclass(frozen=True)
class LaneFor:
    """`for var in range(stop)` with iterations spread over the group's lanes (independent iterations)."""

    var: str
    stop: Expr
    body: tuple


@dataclass(frozen=True)
class Reduce:
    """`name = op over var in range(stop) of value`, after `body` (statements computing `value` per var).

    `more`: further (name, value) pairs reduced the same way over the same iterations, so that one body (and the
    loads in it) serves several results, e.g. the dot products of two weight rows with one activation row."""

    name: str
    op: str
    var: str
    stop: Expr
    body: tuple
    value: Expr
    more: tuple[tuple[str, Expr], ...] = ()

    @property
    def results(self) -> tuple[tuple[str, Expr], ...]:
        """Every (name, value) pair this reduction yields, `name`'s first."""
        return ((self.name, self.value), *self.more)


@dataclass(frozen=True)
class If:
    """`if cond: then else: orelse`."""

    cond: Expr
    then: tuple
    orelse: tuple = ()


Stmt = Let | Decl | Assign | Store | For | LaneFor | Reduce | If


@dataclass(frozen=True)
class LocalArray:
    """Scratch memory shared by the lanes of one group (OpenCL __local, CUDA __shared__)."""

    name: str
    dtype: str
    size: int


TILE_KINDS = {"i8": "i32", "f16": "f32", "u8f16": "f32"}  # a TileMMA's kind -> its accumulator's dtype
TILE_PACK = {"i8": 4, "f16": 2, "u8f16": 4}  # elements in one A word (little-endian: element 0 in the low bits)


@dataclass(frozen=True)
class Fragment:
    """An accumulator tile of `rows` x `cols` values of `dtype` (i32 or f32) owned by the group; undefined until a
    `TileEach` sets it. Where it lives (local memory, the registers of several subgroups) is the target's choice.
    `deal` (a hint, the same for all of a kernel's fragments): where subgroups share the tile, how its hardware
    tiles are dealt to them: "cols", each a column of them (B's operands and per-column values loaded once for all
    its tiles), "rows", each a row (A's), "blocks", each a block as square as the tile allows (fewest of both)."""

    name: str
    dtype: str
    rows: int
    cols: int
    deal: str = "cols"


@dataclass(frozen=True)
class TileMMA:
    """`acc[i, j] += sum over w < words of dot(a[a_base + i * a_stride + w], b[b_base + j * b_stride + w])` for
    every element (i, j) of fragment `acc`: a tile product of `acc.rows` x K by K x `acc.cols`, K = words * the
    elements of a word (`TILE_PACK`). `a` and `b` are u32 local arrays of packed words (`kind` "i8": four signed
    bytes, products summed exactly into i32; "f16": two f16 halves, products summed into f32 in an order the target
    chooses); row i of A and column j of B are K-contiguous. `a_base` / `b_base` are uniform; the strides (in
    words) are constants, so a target can check its access pattern (a stride of words + 4 keeps a warp's fragment
    loads off each other's banks).

    Kind "u8f16" (quantized weights times f16 activations, with no per-group rescaling of the sums): A words hold
    four unsigned bytes q, each element's value is f16(S * q + M) with the f16 pair (S low, M high) of word
    `scales[i * scale_stride + w // group_words]` (a scale and offset per row and `group_words` words of A), and
    B's words are f16 pairs, eight for each four words of A: the elements of A word 4s + c (c < 4) pair with the
    halves of b[b_base + j * b_stride + 8s + c] (elements 0, 1) and of the word 4 after it (2, 3), the order in
    which an f16 matrix unit's lanes take them. `words` is a multiple of 4. Products are summed into f32."""

    acc: str
    kind: str
    a: str
    a_base: Expr
    a_stride: int
    b: str
    b_base: Expr
    b_stride: int
    words: int
    scales: str | None = None
    scale_stride: int = 0
    group_words: int = 0


@dataclass(frozen=True)
class TileEach:
    """`for i in range(rows): for j in range(cols): body` over the shape of the kernel's fragments, with element
    (i, j) of any fragment read by `FragElem` and written by `FragSet`. Iterations are independent and may run in
    any order, spread over the lanes (see the module docstring)."""

    i: str
    j: str
    body: tuple


@dataclass(frozen=True)
class FragElem(Expr):
    """Inside a `TileEach`: the current element of fragment `frag`."""

    frag: str


@dataclass(frozen=True)
class FragSet:
    """Inside a `TileEach`: set the current element of fragment `frag` (converted to its dtype)."""

    frag: str
    value: Expr


Stmt = Stmt | TileMMA | TileEach | FragSet


@dataclass(frozen=True)
class Kernel:
    """One kernel: parameters, grid, group size, local arrays, body, and the schedule knobs chosen."""

    name: str
    params: tuple[Param, ...]
    grid: tuple[Expr, ...]
    body: tuple
    lanes: int = 1
    local: tuple[LocalArray, ...] = ()
    knobs: tuple[tuple[str, Any], ...] = ()
    doc: str = ""
    fragments: tuple[Fragment, ...] = ()
    # Multiply-adds may be fused into one rounding (FMA): a permission a target may use or ignore, given to
    # dot-product kernels, whose outputs are compared within a tolerance (never to dequantization, which must be
    # bit-exact). The CPU, where those kernels are bound by arithmetic, uses it.
    contract: bool = False
    # Sums accumulated in a loop may be reordered (so a compiler may vectorize a reduction): the same kind of
    # permission, for kernels whose long dot products are loops (attention's q.k over a head on the CPU).
    reassociate: bool = False

    def __post_init__(self):
        verify(self)

    @property
    def knob_dict(self) -> dict[str, Any]:
        return dict(self.knobs)

    def param(self, name: str) -> Param:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(name)

    def dtype_of(self, buf: str) -> str:
        """Element type of a buffer parameter or local array."""
        for p in self.params:
            if p.name == buf and isinstance(p, Buf):
                return p.dtype
        for a in self.local:
            if a.name == buf:
                return a.dtype
        raise KeyError(buf)

    def once(self, what: str, compute: Callable[[], Any]) -> Any:
        """`compute()`, kept on this kernel under `what`: a kernel is immutable and shared by every launch of it
        (`codegen.recipes.kernel_builder`), and walking its body again for each launch is what planning a model's
        dozens of layers would spend its time on."""
        memo = self.__dict__.setdefault("_once", {})
        if what not in memo:
            memo[what] = compute()
        return memo[what]

    def __getstate__(self) -> dict:  # memos stay in their process: string hashes are salted per process
        return {k: v for k, v in self.__dict__.items() if k != "_once"}

    def __hash__(self) -> int:  # the generated hash of the fields, computed once
        return self.once("hash", lambda: hash(tuple(getattr(self, f) for f in self.__dataclass_fields__)))

    def fingerprint(self) -> str:
        """A stable hash of the whole description (for caches keyed by kernel)."""
        return self.once("fingerprint", lambda: stable_digest(self))


GRID_VARS = ("g0", "g1", "g2")


def stable_digest(value: Any, length: int = 16) -> str:
    """A hex digest of `repr(value)`, the same in every process: for kernel names and cache keys, where `hash()`
    will not do (salted per process for strings, and on Python 3.11 `hash(None)` is an address)."""
    return hashlib.sha256(repr(value).encode()).hexdigest()[:length]


_TAG_CHARS = str.maketrans({".": "p", "-": "m", "+": "", " ": ""})


def name_tag(value: Any) -> str:
    """`value` (a number, or text of numbers) spelled for a kernel name: '.' -> 'p', '-' -> 'm', '+' dropped, so
    that 1e-06 and 1e+38 give identifiers (`1em06`, `1e38`) in every printer."""
    return str(value).translate(_TAG_CHARS)


class KernelError(ValueError):
    """A malformed kernel: a bug in a recipe."""


def walk(body: tuple) -> Iterator[Stmt]:
    """Every statement of `body`, nested ones included, in order."""
    for s in body:
        yield s
        for sub in _children(s):
            yield from walk(sub)


def _children(s) -> tuple:
    if isinstance(s, For | LaneFor | Reduce | TileEach):
        return (s.body,)
    if isinstance(s, If):
        return (s.then, s.orelse)
    return ()


def verify(k: Kernel) -> None:
    """Check structure: known buffers and dtypes, grid rank, lanes, and where LaneFor/Reduce may appear."""
    if not 1 <= len(k.grid) <= 3:
        raise KernelError(f"{k.name}: grid must have 1 to 3 dims")
    if k.lanes < 1:
        raise KernelError(f"{k.name}: lanes must be >= 1")
    names = [p.name for p in k.params] + [a.name for a in k.local] + [f.name for f in k.fragments]
    if len(set(names)) != len(names):
        raise KernelError(f"{k.name}: duplicate parameter, local array or fragment names")
    frags = {f.name: f for f in k.fragments}
    for f in k.fragments:
        if f.dtype not in ("i32", "f32") or f.rows < 1 or f.cols < 1:
            raise KernelError(f"{k.name}: fragment {f.name} must be i32 or f32 with rows, cols >= 1")
    if len({(f.rows, f.cols) for f in k.fragments}) > 1:
        raise KernelError(f"{k.name}: fragments of one kernel share one shape (TileEach walks it)")
    u32_local = {a.name for a in k.local if a.dtype in ("u32", "i32")}
    for p in k.params:
        if isinstance(p, Buf) and p.dtype not in DTYPES:
            raise KernelError(f"{k.name}: buffer {p.name} has unknown dtype {p.dtype}")
    bufs = {p.name for p in k.params if isinstance(p, Buf)} | {a.name for a in k.local}
    outs = {p.name for p in k.params if isinstance(p, Buf) and p.out} | {a.name for a in k.local}

    def check_group(body: tuple, top: bool, each: bool = False) -> None:
        for s in body:
            if isinstance(s, TileMMA):
                f = frags.get(s.acc)
                if not top or f is None or TILE_KINDS.get(s.kind) != f.dtype:
                    raise KernelError(f"{k.name}: TileMMA into {s.acc} must be at group level, into a fragment "
                                      f"of dtype {TILE_KINDS.get(s.kind, '(kind i8 or f16)')}")
                if s.a not in u32_local or s.b not in u32_local or s.words < 1:
                    raise KernelError(f"{k.name}: TileMMA operands {s.a}, {s.b} must be u32 local arrays")
                if (s.kind == "u8f16") != (s.scales is not None) or (s.scales and (
                        s.scales not in u32_local or s.group_words < 1 or s.words % s.group_words or s.words % 4)):
                    raise KernelError(f"{k.name}: a u8f16 TileMMA (and only one) takes scales: a u32 local array, "
                                      f"a scale per row and group of words dividing its {s.words} words")
            if isinstance(s, TileEach):
                if not top or not frags:
                    raise KernelError(f"{k.name}: TileEach must be at group level, in a kernel with fragments")
                check_group(s.body, False, True)
            if isinstance(s, FragSet) and (not each or s.frag not in frags):
                raise KernelError(f"{k.name}: FragSet of {s.frag} outside a TileEach or of no fragment")
            for e in stmt_exprs(s):
                for fe in expr_nodes(e):
                    if isinstance(fe, FragElem) and (not each or fe.frag not in frags):
                        raise KernelError(f"{k.name}: FragElem of {fe.frag} outside a TileEach or of no fragment")
            if isinstance(s, LaneFor | Reduce):
                if not top:
                    raise KernelError(f"{k.name}: {type(s).__name__} over {s.var} must be at group level")
                if isinstance(s, Reduce) and s.op not in REDUCE_OPS:
                    raise KernelError(f"{k.name}: unknown reduction {s.op}")
                check_group(s.body, False)
            elif isinstance(s, For):
                check_group(s.body, top, each)
            elif isinstance(s, If):
                check_group(s.then, top, each)
                check_group(s.orelse, top, each)
            if isinstance(s, Store):
                if s.buf not in outs:
                    raise KernelError(f"{k.name}: store to {s.buf}, which is not an output buffer or local array")
            for e in stmt_exprs(s):
                for ld in loads(e):
                    if ld.buf not in bufs:
                        raise KernelError(f"{k.name}: load from unknown buffer {ld.buf}")

    check_group(k.body, True)


def stmt_exprs(s) -> tuple[Expr, ...]:
    """The expressions a statement evaluates itself (not those of nested statements)."""
    if isinstance(s, Let | Assign):
        return (s.expr,)
    if isinstance(s, Decl):
        return (s.init,)
    if isinstance(s, Store):
        return (s.index, s.value)
    if isinstance(s, For):
        return (s.start, s.stop)
    if isinstance(s, LaneFor):
        return (s.stop,)
    if isinstance(s, Reduce):
        return (s.stop, *(v for _, v in s.results))
    if isinstance(s, If):
        return (s.cond,)
    if isinstance(s, TileMMA):
        return (s.a_base, s.b_base)
    if isinstance(s, FragSet):
        return (s.value,)
    return ()


def expr_nodes(e: Expr) -> Iterator[Expr]:
    """Every node of an expression tree, the root first."""
    yield e
    for f in getattr(e, "__dataclass_fields__", {}):
        v = getattr(e, f)
        if isinstance(v, Expr):
            yield from expr_nodes(v)
        elif isinstance(v, tuple):
            for x in v:
                if isinstance(x, Expr):
                    yield from expr_nodes(x)


def rewrite(node, fn):
    """`node` (an expression, a statement or a tuple/list of them) with `fn` applied to every expression node,
    children first; `fn` returns the node or its replacement. Unchanged subtrees are returned as they are."""
    if isinstance(node, list | tuple):
        out = [rewrite(x, fn) for x in node]
        return out if isinstance(node, list) else tuple(out)
    fields = getattr(node, "__dataclass_fields__", None)
    if not fields:
        return node
    new = {f: rewrite(getattr(node, f), fn) for f in fields}
    if any(new[f] is not getattr(node, f) for f in fields):
        node = object.__new__(type(node))  # frozen nodes with custom constructors: set the fields directly
        for f, v in new.items():
            object.__setattr__(node, f, v)
    return fn(node) if isinstance(node, Expr) else node


def substitute(node, name: str, repl: Expr):
    """`node` with every `Var(name)` replaced by `repl` (see `rewrite`). Names a statement binds are left as
    they are: substitute a name no statement inside rebinds."""
    return rewrite(node, lambda e: repl if isinstance(e, Var) and e.name == name else e)


def loads(e: Expr) -> list[Load]:
    """The buffer loads in an expression."""
    return [n for n in expr_nodes(e) if isinstance(n, Load)]


def buffers_read(k: Kernel) -> frozenset[str]:
    """Names of the buffers and local arrays a kernel reads (`Load`s and the intrinsics of `BUFFER_ARGS`)."""
    return k.once("buffers_read", lambda: frozenset(_buffers_read(k)))


def _buffers_read(k: Kernel) -> set[str]:
    out: set[str] = set()
    for s in walk(k.body):
        for e in stmt_exprs(s):
            for n in expr_nodes(e):
                if isinstance(n, Load):
                    out.add(n.buf)
                elif isinstance(n, Call) and n.fn in BUFFER_ARGS:
                    out.update(n.args[i].name for i in BUFFER_ARGS[n.fn] if isinstance(n.args[i], Var))
    return out


def promised_bytes(k: Kernel, load: Load) -> int:
    """The byte alignment a load's `align` promises (4 bytes an element, 16 at most) where a target may act on
    it: a load from a buffer parameter of 4-byte elements; 0 otherwise (no promise, a local array, a narrower
    dtype)."""
    if load.align == 1 or any(a.name == load.buf for a in k.local) or k.dtype_of(load.buf) not in ("f32", "i32", "u32"):
        return 0
    return min(16, 4 * load.align)


def dump(k: Kernel) -> str:
    """Readable text form of a kernel (for artifacts and debugging)."""
    lines = [f"kernel {k.name}({', '.join(_pstr(p) for p in k.params)})"]
    lines.append(f"  grid ({', '.join(expr_str(g) for g in k.grid)}) lanes {k.lanes}")
    if k.knobs:
        lines.append("  knobs " + ", ".join(f"{n}={v}" for n, v in k.knobs))
    for a in k.local:
        lines.append(f"  local {a.dtype} {a.name}[{a.size}]")
    for f in k.fragments:
        lines.append(f"  fragment {f.dtype} {f.name}[{f.rows}x{f.cols}]")
    _dump_body(k.body, lines, 1)
    return "\n".join(lines)


def _pstr(p: Param) -> str:
    if isinstance(p, Buf):
        return f"{'out ' if p.out else ''}{p.dtype}* {p.name}"
    return f"{p.dtype} {p.name}"


def _dump_body(body: tuple, lines: list[str], depth: int) -> None:
    pad = "  " * depth
    for s in body:
        if isinstance(s, Let):
            lines.append(f"{pad}let {s.name} = {expr_str(s.expr)}")
        elif isinstance(s, Decl):
            lines.append(f"{pad}var {s.dtype} {s.name} = {expr_str(s.init)}")
        elif isinstance(s, Assign):
            lines.append(f"{pad}{s.name} = {expr_str(s.expr)}")
        elif isinstance(s, Store):
            lines.append(f"{pad}{s.buf}[{expr_str(s.index)}] = {expr_str(s.value)}")
        elif isinstance(s, For):
            lines.append(f"{pad}for {s.var} in {expr_str(s.start)}..{expr_str(s.stop)} step {s.step}:")
            _dump_body(s.body, lines, depth + 1)
        elif isinstance(s, LaneFor):
            lines.append(f"{pad}lanes for {s.var} in 0..{expr_str(s.stop)}:")
            _dump_body(s.body, lines, depth + 1)
        elif isinstance(s, Reduce):
            names = ", ".join(n for n, _ in s.results)
            lines.append(f"{pad}{names} = reduce {s.op} over {s.var} in 0..{expr_str(s.stop)}:")
            _dump_body(s.body, lines, depth + 1)
            lines.append(f"{pad}  yield {', '.join(expr_str(v) for _, v in s.results)}")
        elif isinstance(s, TileMMA):
            scaled = f" scaled by {s.scales}[i*{s.scale_stride} + w/{s.group_words}]" if s.scales else ""
            lines.append(f"{pad}{s.acc} += tile {s.kind} {s.a}[{expr_str(s.a_base)} + i*{s.a_stride}]{scaled} . "
                         f"{s.b}[{expr_str(s.b_base)} + j*{s.b_stride}] over {s.words} words")
        elif isinstance(s, TileEach):
            lines.append(f"{pad}tile for {s.i}, {s.j}:")
            _dump_body(s.body, lines, depth + 1)
        elif isinstance(s, FragSet):
            lines.append(f"{pad}{s.frag}[.] = {expr_str(s.value)}")
        elif isinstance(s, If):
            lines.append(f"{pad}if {expr_str(s.cond)}:")
            _dump_body(s.then, lines, depth + 1)
            if s.orelse:
                lines.append(f"{pad}else:")
                _dump_body(s.orelse, lines, depth + 1)


def expr_str(e: Expr) -> str:
    """Infix text of an expression."""
    if isinstance(e, Const):
        return repr(e.value)
    if isinstance(e, Var):
        return e.name
    if isinstance(e, Bin):
        return f"({expr_str(e.a)} {e.op} {expr_str(e.b)})"
    if isinstance(e, Select):
        return f"({expr_str(e.cond)} ? {expr_str(e.a)} : {expr_str(e.b)})"
    if isinstance(e, ToF32):
        return f"f32({expr_str(e.a)})"
    if isinstance(e, Cast):
        return f"{e.dtype}({expr_str(e.a)})"
    if isinstance(e, Load):
        return f"{e.buf}[{expr_str(e.index)}]" + (f"@{e.align}" if e.align > 1 else "")
    if isinstance(e, Call):
        return f"{e.fn}({', '.join(expr_str(a) for a in e.args)})"
    if isinstance(e, FragElem):
        return f"{e.frag}[.]"
    return repr(e)


__all__ = [
    "Assign", "Bin", "Buf", "Call", "Cast", "Const", "Decl", "For", "FragElem", "FragSet", "Fragment", "GRID_VARS",
    "If", "Kernel", "KernelError", "LaneFor", "Let", "Load", "LocalArray", "Reduce", "Scalar", "Select", "Store",
    "TileEach", "TileMMA", "ToF32", "Var", "dump",
    "expr_nodes", "expr_str", "loads", "promised_bytes", "rewrite", "stmt_exprs", "substitute", "verify", "walk",
]


# --- launches: kernels bound to the buffers of a plan ----------------------------------------------------


@dataclass(frozen=True)
class Launch:
    """A kernel with its arguments bound, as the compiler's plan holds it.

    `buffers` maps each `Buf` parameter to a plan buffer name (see `polystrata/compiler/plan.py`); `scalars`
    maps each `Scalar` parameter to a constant or to a step symbol resolved at run time: "T" (tokens in this
    step), "n_past" (tokens already in the KV cache), "n_kv" (n_past + T), "T_last" (the rows the graph's
    `last_rows n` op keeps: min(T, n), the row count of every value after it; T in a graph without one).

    `provides`: launches whose whole effect this one also has (a norm that also writes its output quantized for
    the next matmuls): the compiler drops later copies of them, as it drops repeated launches.
    """

    kernel: Kernel
    buffers: tuple[tuple[str, str], ...]
    scalars: tuple[tuple[str, int | float | str], ...] = ()
    provides: tuple[Launch, ...] = ()

    def __post_init__(self):
        bound = {n for n, _ in self.buffers} | {n for n, _ in self.scalars}
        want = {p.name for p in self.kernel.params}
        if bound != want:
            raise KernelError(f"{self.kernel.name}: launch binds {sorted(bound)}, kernel takes {sorted(want)}")


STEP_SYMBOLS = ("T", "n_past", "n_kv", "T_last")

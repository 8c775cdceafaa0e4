"""Lane lowering: the one place that maps `ir/kernel.py`'s sequential group semantics onto a group of lanes.

`lower(kernel, abilities)` returns a kernel whose body holds no `LaneFor` and no `Reduce`, only constructs a
printer spells one to one:

* `LaneFor v < n` -> `For v in range(LaneId(), n, lanes)`, then a `Barrier` (a global fence too where the loop
  stores into a buffer the kernel also reads);
* `Reduce` -> a `Decl`ared accumulator per result, the same strided `For` adding each lane's share, then a
  combine chosen from the target's declared `LaneAbilities` (never from the lane count alone):
  - a `SubgroupReduce` when one subgroup is the whole group (or, where the target reduces part of a subgroup,
    a power-of-two group narrower than it);
  - a `SubgroupReduce` per subgroup, each subgroup's first lane storing its total into the local array
    `SCRATCH`, a `Barrier`, and every lane folding the totals in one fixed order (the same bits in every lane),
    where the target folds several whole subgroups;
  - else the portable tree: partials stored into `SCRATCH`, halving steps (`If LaneId() < half`) each followed
    by a `Barrier`, the result read back from `SCRATCH[0]`;
* a uniform `Store` -> `If LaneId() == 0` around it, followed by a `Barrier` where it writes a local array or a
  buffer the kernel reads; a `Barrier` also precedes a lane loop or uniform store that overwrites a local array
  uniform code may still be reading.

A target that runs each group as one thread (`ONE_LANE`: the CPU, a C compiler for the host) gets the IR's
sequential semantics literally: plain loops, plain stores, no barriers, no `LaneId`.

Tile products (`Fragment`, `TileMMA`, `TileEach`) come first:

* portable (no `MatrixUnit` declared, or a kernel whose shapes it does not take): each fragment becomes a local
  array, element e owned by lane e % lanes; `TileEach` a `LaneFor` over the elements, `TileMMA` a `LaneFor` whose
  lane sums its elements' products word by word (`dot4_i8` for int8, so a target with a native dot product --
  dp4a, sdot4 -- uses it; u8f16 each byte's value rounded to f16, as a matrix unit's operand), both then lowered
  as above;
* native (the target's `MatrixUnit`): each fragment is a set of per-lane registers (`Decl`s named
  `{fragment}_{tile}_{register}`), the hardware tiles of each fragment dealt round-robin to the group's subgroups;
  `TileEach` is unrolled over a lane's registers (the element's (i, j) from the unit's accumulator layout),
  `TileMMA` becomes per hardware tile a `For` over K steps of `MatrixOp`s whose operand words are loaded from the
  local arrays where the unit's operand layout says; a `Barrier` precedes the next write into local arrays a
  `TileMMA` or `TileEach` read, and follows a `TileEach` that writes local arrays.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from polystrata.ir.expr import Expr
from polystrata.ir.kernel import (
    Assign,
    Bin,
    Call,
    Const,
    Decl,
    For,
    FragElem,
    FragSet,
    If,
    Kernel,
    LaneFor,
    Let,
    Load,
    LocalArray,
    Reduce,
    Store,
    TileEach,
    TileMMA,
    ToF32,
    Var,
    buffers_read,
    loads,
    rewrite,
    stmt_exprs,
    walk,
)

# The local array the lowering adds for reductions that combine through local memory.
SCRATCH = "ps_red"


@dataclass(frozen=True)
class MatrixInstr:
    """One tile-product instruction of a `MatrixUnit`: `kind` ("i8", "f16") operands, `words` packed words of K
    per step; `a(lane)` / `b(lane)`: the (row or column, word) of each operand word a lane of the subgroup passes,
    within the hardware tile and the K step; `op` names it for the printer (`MatrixOp`)."""

    kind: str
    words: int
    op: str
    a: Callable[[Expr], tuple[tuple[Expr, Expr], ...]]
    b: Callable[[Expr], tuple[tuple[Expr, Expr], ...]]


@dataclass(frozen=True)
class MatrixUnit:
    """A target's matrix unit: one subgroup of `width` lanes computes an `m` x `n` accumulator tile, `regs` values a
    lane, value r of lane l at `acc(l, r)` = (i, j); `instrs` in order of preference."""

    width: int
    m: int
    n: int
    regs: int
    acc: Callable[[Expr, int], tuple[Expr, Expr]]
    instrs: tuple[MatrixInstr, ...]

    def instr(self, kind: str, words: int) -> MatrixInstr | None:
        """The first instruction for `kind` whose K step divides `words`."""
        return next((i for i in self.instrs if i.kind == kind and words % i.words == 0), None)

    def takes(self, k: Kernel) -> bool:
        """Whether kernel `k`'s tile products fit: fragment tiles a multiple of m x n, dealt evenly to whole
        subgroups, and every TileMMA's K a multiple of an instruction's."""
        if not k.fragments or k.lanes % self.width:
            return False
        f = k.fragments[0]
        tiles = (f.rows // self.m) * (f.cols // self.n)
        if f.rows % self.m or f.cols % self.n or tiles % (k.lanes // self.width):
            return False
        return all(self.instr(s.kind, s.words) for s in walk(k.body) if isinstance(s, TileMMA))


@dataclass(frozen=True)
class MatrixOp:
    """`accs += A . B` on one hardware tile: instruction `op` of a `MatrixUnit` (only in lowered kernels), `accs` the
    lane's accumulator variables, `a` / `b` its operand words (u32 values)."""

    op: str
    accs: tuple[str, ...]
    a: tuple[Expr, ...]
    b: tuple[Expr, ...]


@dataclass(frozen=True)
class LaneAbilities:
    """What a target declares about the lanes of a group; the lowering picks every combine from it.

    `parallel`: the lanes run concurrently (False: one thread runs the whole group). `subgroup`: the width of the
    subgroup reduction the target spells (`SubgroupReduce`), 0 for none. `partial`: it also reduces the first
    `w` lanes of a subgroup, `w` a power of two below the width. `several`: it combines groups of several whole
    subgroups (a reduction per subgroup, then local memory)."""

    parallel: bool = True
    subgroup: int = 0
    partial: bool = False
    several: bool = False
    matrix: MatrixUnit | None = field(default=None, compare=False)


ONE_LANE = LaneAbilities(parallel=False)


@dataclass(frozen=True)
class LaneId(Expr):
    """This lane's index within its group (i32; only in lowered kernels)."""


@dataclass(frozen=True)
class Barrier:
    """Every lane of the group waits here; writes to local (and with `global_`, global) memory become visible."""

    local: bool = True
    global_: bool = False


@dataclass(frozen=True)
class SubgroupReduce:
    """`var = op over the first `width` lanes of this lane's subgroup of var` (f32; op "+" or "max").
    `broadcast`: every lane needs the result; otherwise only the subgroup's first lane does."""

    var: str
    op: str
    width: int
    broadcast: bool = True


def lower(k: Kernel, abilities: LaneAbilities) -> Kernel:
    """`k` with its lane semantics made explicit for a target with `abilities` (see the module docstring)."""
    unit = abilities.matrix if abilities.parallel else None
    if k.fragments and not (unit and unit.takes(k)):
        k = portable_tiles(k)
    return _Lowering(k, abilities).kernel()


def portable_tiles(k: Kernel) -> Kernel:
    """`k` with its fragments as local arrays and `TileEach` / `TileMMA` as `LaneFor`s over their elements."""
    if not k.fragments:
        return k
    f0 = k.fragments[0]
    cols, size = f0.cols, f0.rows * f0.cols
    e = Var("_te")

    def element(i: str, j: str, body: tuple) -> tuple:
        return (Let(i, e // cols), Let(j, e % cols), *body)

    def each_body(body: tuple) -> tuple:
        return _fragments_as(body, lambda f: Load(f, e), lambda s: Store(s.frag, e, s.value))

    def tiles(body: tuple) -> tuple:
        out = []
        for s in body:
            if isinstance(s, TileEach | TileMMA):
                if isinstance(s, TileEach):
                    part = element(s.i, s.j, each_body(s.body))
                else:
                    part = element("_ti", "_tj", _portable_product(s, Var("_ti"), Var("_tj"), e))
                # A run of tile statements is one lane loop: each lane only touches its own elements, so they
                # need no barrier between them.
                if out and isinstance(out[-1], LaneFor) and out[-1].var == e.name:
                    out[-1] = LaneFor(e.name, Const(size), out[-1].body + part)
                else:
                    out.append(LaneFor(e.name, Const(size), part))
                continue
            if isinstance(s, For):
                s = replace(s, body=tiles(s.body))
            elif isinstance(s, If):
                s = If(s.cond, tiles(s.then), tiles(s.orelse))
            out.append(s)
        return tuple(out)

    local = tuple(LocalArray(f.name, f.dtype, f.rows * f.cols) for f in k.fragments)
    return replace(k, body=tiles(k.body), local=k.local + local, fragments=())


def _half(word: Expr, hi: bool) -> Expr:
    """The high or low f16 half of u32 `word`, as f32."""
    return Call("f16_bits_to_f32", (word >> 16) if hi else (word & 0xFFFF))


def _portable_product(s: TileMMA, i: Expr, j: Expr, e: Expr) -> tuple:
    """Element (i, j) of `s`'s product added to its fragment (stored at e), word by word."""
    w = Var("_tw")
    a, b = Load(s.a, s.a_base + i * s.a_stride + w), Load(s.b, s.b_base + j * s.b_stride + w)
    if s.kind == "i8":
        step = (Assign("_tacc", Call("dot4_i8", a, b, Var("_tacc"))),)
    elif s.kind == "u8f16":
        # Each byte's value rounded to f16 as the matrix unit's operand is; B's two words for each word of A.
        sw = Var("_tws")
        at = s.b_base + j * s.b_stride + w // 4 * 8 + w % 4
        b2 = (Load(s.b, at), Load(s.b, at + 4))
        total: Expr = Const(0.0)
        for x in range(4):
            q = ToF32((Var("_twa") >> (8 * x)) & 255)
            value = Call("f16_bits_to_f32", Call("f32_to_f16_bits", _half(sw, False) * q + _half(sw, True)))
            total = total + value * _half(Var(f"_twb{x // 2}"), x % 2 == 1)
        step = (Let("_twa", a), Let(sw.name, Load(s.scales, i * s.scale_stride + w // s.group_words)),
                Let("_twb0", b2[0]), Let("_twb1", b2[1]), Assign("_tacc", Var("_tacc") + total))
    else:
        step = (Let("_twa", a), Let("_twb", b),
                Assign("_tacc", Var("_tacc") + (_half(Var("_twa"), False) * _half(Var("_twb"), False)
                                                + _half(Var("_twa"), True) * _half(Var("_twb"), True))))
    return (Decl("_tacc", "i32" if s.kind == "i8" else "f32", Load(s.acc, e)),
            For(w.name, Const(0), Const(s.words), step),
            Store(s.acc, e, Var("_tacc")))


def _combine(op: str, a: Expr, b: Expr) -> Expr:
    return Bin("+", a, b) if op == "+" else Call("max", a, b)


class _Lowering:
    def __init__(self, k: Kernel, abilities: LaneAbilities):
        self.k = k
        self.abilities = abilities
        self.lanes = k.lanes if abilities.parallel else 1
        self.local = {a.name for a in k.local}
        self.loaded = buffers_read(k)
        self.uniform_local_reads = _uniform_local_reads(k, self.local)
        self.unit = abilities.matrix  # native tile products (`portable_tiles` has removed any it does not take)
        self.frags = {f.name: f for f in k.fragments}
        self.deal = k.fragments[0].deal if k.fragments else "cols"
        self.last_barrier = False  # whether the statement just emitted was a barrier
        self.scratch = 0  # floats of SCRATCH needed

    def kernel(self) -> Kernel:
        body = tuple(self.registers() + self.group(self.k.body))
        scratch = (LocalArray(SCRATCH, "f32", self.scratch),) if self.scratch else ()
        return replace(self.k, body=body, local=self.k.local + scratch, fragments=())

    # --- native tile products ---------------------------------------------------------------------------

    def per_lane(self) -> int:
        """Hardware tiles of a fragment each subgroup holds."""
        f = next(iter(self.frags.values()))
        return (f.rows // self.unit.m) * (f.cols // self.unit.n) // (self.lanes // self.unit.width)

    def registers(self) -> list:
        if not self.frags:
            return []
        return [Decl(f"{f.name}_{p}_{r}", f.dtype, Const(0 if f.dtype == "i32" else 0.0))
                for f in self.frags.values() for p in range(self.per_lane()) for r in range(self.unit.regs)]

    def tile_origin(self, p: int) -> tuple[Expr, Expr]:
        """(first row, first column) of the p-th hardware tile this lane's subgroup holds."""
        u, f = self.unit, next(iter(self.frags.values()))
        groups = self.lanes // u.width
        across = f.cols // u.n
        # Tile t = subgroup + p * groups, at row t // across, column t % across, written so that tiles of one row or
        # column of tiles get one expression for it: compilers then share the loads that depend on it alone (operand
        # words, per-row or per-column scales) between the tiles.
        sg = LaneId() // u.width
        per = self.per_lane()
        # `Fragment.deal` "rows": a subgroup's tiles along rows of tiles, so that each A operand (u8f16: made f16
        # from its bytes, most of the instructions) and each per-row value serves all of them; "blocks": r rows of
        # c tiles each, as square as the tile allows (r a power of two), A's shared by c tiles and B's by r.
        if self.deal == "blocks":
            down, r = f.rows // u.m, 1
            while per % (2 * r) == 0 and down % (2 * r) == 0 and 4 * r * r <= per and across % (per // (2 * r)) == 0:
                r *= 2
            c = per // r
            if r > 1 and across % c == 0:
                blocks_across = across // c
                return (sg // blocks_across * r + p // c) * u.m, (sg % blocks_across * c + p % c) * u.n
        rows_first = self.deal in ("rows", "blocks")  # "blocks" of one row: rows
        if rows_first and per % across == 0:  # each subgroup's tiles whole rows of tiles
            return (sg * (per // across) + p // across) * u.m, Const(p % across * u.n)
        if rows_first and across % per == 0:  # each subgroup's tiles part of one row of tiles
            return (sg // (across // per)) * u.m, (sg % (across // per) * per + p) * u.n
        if groups > 1 and groups % across == 0:  # each subgroup's tiles in one column of tiles
            return (sg // across + p * (groups // across)) * u.m, (sg % across) * u.n
        if groups > 1 and across % groups == 0:  # each subgroup's tiles in across / groups columns, rows in turn
            per_row = across // groups
            return Const(p // per_row * u.m), (sg + p % per_row * groups) * u.n
        t = sg + p * groups if groups > 1 else Const(p)
        return (t // across) * u.m, (t % across) * u.n

    def tile_each(self, s: TileEach) -> list:
        out = []
        lane = LaneId() % self.unit.width
        for p in range(self.per_lane()):
            i0, j0 = self.tile_origin(p)
            for r in range(self.unit.regs):
                names = {f: f"{f}_{p}_{r}" for f in self.frags}
                di, dj = self.unit.acc(lane, r)
                out += [Let(s.i, i0 + di), Let(s.j, j0 + dj), *_registers_for(s.body, names)]
        return out

    def tile_mma(self, s: TileMMA) -> list:
        ins = self.unit.instr(s.kind, s.words)
        lane, w = LaneId() % self.unit.width, Var("_tk")
        out = []
        for p in range(self.per_lane()):
            i0, j0 = self.tile_origin(p)
            a = tuple(Load(s.a, s.a_base + (i0 + r) * s.a_stride + w + c) for r, c in ins.a(lane))
            # u8f16: B has two words for each of A's, and each A word comes with its row's group scales.
            kb = 2 * w if s.kind == "u8f16" else w
            b = tuple(Load(s.b, s.b_base + (j0 + r) * s.b_stride + kb + c) for r, c in ins.b(lane))
            if s.scales:
                a += tuple(Load(s.scales, (i0 + r) * s.scale_stride + (w + c) // s.group_words)
                           for r, c in ins.a(lane))
            accs = tuple(f"{s.acc}_{p}_{r}" for r in range(self.unit.regs))
            out.append(For(w.name, Const(0), Const(s.words), (MatrixOp(ins.op, accs, a, b),), step=ins.words))
        return out

    def group(self, body) -> list:
        """Group-level statements, lowered."""
        out: list = []
        for s in body:
            if isinstance(s, LaneFor):
                out += self.pre_barrier(s)
                out.append(For(s.var, self.first_lane(), s.stop, s.body, step=self.lanes))
                out += self.barrier(True, self.writes_read_global(s))
                continue
            if isinstance(s, Reduce):
                out += self.reduce(s)
                continue
            if isinstance(s, Store):
                out += self.store(s)
                continue
            if isinstance(s, TileEach | TileMMA):
                # A TileEach storing into local arrays (each element its own place) publishes them to what follows.
                local = isinstance(s, TileEach) and any(isinstance(st, Store) and st.buf in self.local
                                                        for st in walk(s.body))
                out += self.pre_barrier(s) if local else []
                out += self.tile_each(s) if isinstance(s, TileEach) else self.tile_mma(s)
                self.last_barrier = False
                out += self.barrier() if local else []
                continue
            self.last_barrier = False
            if isinstance(s, For):
                s = replace(s, body=tuple(self.group(s.body)))
            elif isinstance(s, If):
                then = tuple(self.group(s.then))
                self.last_barrier = False
                s = If(s.cond, then, tuple(self.group(s.orelse)))
            out.append(s)
            self.last_barrier = False
        return out

    def first_lane(self) -> Expr:
        return LaneId() if self.lanes > 1 else Const(0)

    def barrier(self, local: bool = True, global_: bool = False) -> list:
        if self.lanes == 1:
            return []
        self.last_barrier = True
        return [Barrier(local, global_)]

    def pre_barrier(self, s) -> list:
        """A barrier before a lane loop that overwrites local data that uniform code may still be reading."""
        written = {st.buf for st in walk(s.body) if isinstance(st, Store)}
        return self.barrier() if written & self.uniform_local_reads and not self.last_barrier else []

    def writes_read_global(self, s) -> bool:
        """Whether lane loop `s` stores into a global buffer that the kernel also loads (needs a global fence)."""
        return any(isinstance(st, Store) and st.buf not in self.local and st.buf in self.loaded
                   for st in walk(s.body))

    def store(self, s: Store) -> list:
        """A uniform store: lane 0 writes; a barrier publishes it to the lanes that read it next."""
        if self.lanes == 1:
            return [s]
        local = s.buf in self.local
        out = []
        if local and s.buf in self.uniform_local_reads and not self.last_barrier:
            out += self.barrier()  # other lanes may still be reading the old value
        out.append(If(Bin("==", LaneId(), Const(0)), (s,)))
        self.last_barrier = False
        if local or s.buf in self.loaded:
            out += self.barrier(local, not local)
        return out

    def reduce(self, s: Reduce) -> list:
        out = self.pre_barrier(s)
        accs = [f"_acc_{name}" for name, _ in s.results]
        init = Const(0.0) if s.op == "+" else Const(-math.inf)
        out += [Decl(acc, "f32", init) for acc in accs]
        shares = tuple(Assign(acc, _combine(s.op, Var(acc), value)) for acc, (_, value) in zip(accs, s.results))
        out.append(For(s.var, self.first_lane(), s.stop, s.body + shares, step=self.lanes))
        names = [name for name, _ in s.results]
        n, w, ab = self.lanes, self.abilities.subgroup, self.abilities
        publish = self.writes_read_global(s)
        if n == 1:
            out += [Let(name, Var(acc)) for name, acc in zip(names, accs)]
            return out
        if w and (n == w or (ab.partial and n < w and n & (n - 1) == 0)):
            for name, acc in zip(names, accs):
                out += [SubgroupReduce(acc, s.op, n), Let(name, Var(acc))]
            self.last_barrier = False
            if any(isinstance(st, Store) for st in walk(s.body)):
                out += self.barrier(True, publish)  # the body's stores are read after the Reduce
            return out
        several = bool(w) and ab.several and n > w and n % w == 0
        self.scratch = max(self.scratch, n // w if several else n)
        for name, acc in zip(names, accs):
            out += self.fold_subgroups(s.op, acc, w) if several else self.tree(s.op, acc)
            out.append(Let(name, Var(acc)))
            out += self.barrier(True, publish)  # the scratch is reused next: everyone must have read it first
        return out

    def fold_subgroups(self, op: str, acc: str, w: int) -> list:
        """Each subgroup's total into SCRATCH, then every lane folds them in the same order into `acc`."""
        lid = LaneId()
        out = [SubgroupReduce(acc, op, w, broadcast=False),
               If(Bin("==", Bin("%", lid, Const(w)), Const(0)), (Store(SCRATCH, Bin("//", lid, Const(w)), Var(acc)),))]
        out += self.barrier()
        out.append(Assign(acc, Load(SCRATCH, 0)))
        out += [Assign(acc, _combine(op, Var(acc), Load(SCRATCH, j))) for j in range(1, self.lanes // w)]
        return out

    def tree(self, op: str, acc: str) -> list:
        """The lanes' partials combined in SCRATCH by halving steps (any lane count: the lanes above the largest
        power of two fold in first); the result into `acc`."""
        lid, n = LaneId(), self.lanes
        p = 1 << (n.bit_length() - 1)
        out = [Store(SCRATCH, lid, Var(acc))] + self.barrier()
        steps = ([(p, n - p)] if p != n else []) + [(1 << i, 1 << i) for i in range(p.bit_length() - 2, -1, -1)]
        for half, limit in steps:
            step = Store(SCRATCH, lid, _combine(op, Load(SCRATCH, lid), Load(SCRATCH, lid + half)))
            out.append(If(Bin("<", lid, Const(limit)), (step,)))
            out += self.barrier()
        out.append(Assign(acc, Load(SCRATCH, 0)))
        return out


def _registers_for(body: tuple, names: dict[str, str]) -> list:
    """A `TileEach` body for one element: `FragElem` / `FragSet` of fragment f as the register `names[f]`."""
    return list(_fragments_as(body, lambda f: Var(names[f]), lambda s: Assign(names[s.frag], s.value)))


def _fragments_as(body: tuple, elem, set_) -> tuple:
    """A `TileEach` body with each `FragElem(f)` replaced by `elem(f)` and each `FragSet` statement by `set_(s)`,
    in nested `For` and `If` bodies too."""
    out = []
    for s in rewrite(body, lambda x: elem(x.frag) if isinstance(x, FragElem) else x):
        if isinstance(s, FragSet):
            s = set_(s)
        elif isinstance(s, For):
            s = replace(s, body=_fragments_as(s.body, elem, set_))
        elif isinstance(s, If):
            s = If(s.cond, _fragments_as(s.then, elem, set_), _fragments_as(s.orelse, elem, set_))
        out.append(s)
    return tuple(out)


def _uniform_local_reads(k: Kernel, local: set[str]) -> set[str]:
    """Local arrays read by uniform (group-level) statements, and by tile products (native ones read them from
    every lane, with no barrier after)."""
    out: set[str] = set()

    def visit(body):
        for s in body:
            if isinstance(s, TileMMA):
                out.update(x for x in (s.a, s.b, s.scales) if x)
            if isinstance(s, TileEach):
                out.update(ld.buf for st in walk(s.body) for e in stmt_exprs(st) for ld in loads(e)
                           if ld.buf in local)
            exprs = (s.stop,) if isinstance(s, LaneFor | Reduce) else stmt_exprs(s)
            for e in exprs:
                out.update(ld.buf for ld in loads(e) if ld.buf in local)
            if isinstance(s, For):
                visit(s.body)
            elif isinstance(s, If):
                visit(s.then)
                visit(s.orelse)

    visit(k.body)
    return out

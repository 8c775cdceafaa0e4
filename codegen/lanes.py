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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from polystrata.ir.expr import Expr
from polystrata.ir.kernel import (
    Assign,
    Bin,
    Call,
    Const,
    Decl,
    For,
    If,
    Kernel,
    LaneFor,
    Let,
    Load,
    LocalArray,
    Reduce,
    Store,
    Var,
    buffers_read,
    loads,
    stmt_exprs,
    walk,
)

# The local array the lowering adds for reductions that combine through local memory.
SCRATCH = "ps_red"


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
    return _Lowering(k, abilities).kernel()


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
        self.last_barrier = False  # whether the statement just emitted was a barrier
        self.scratch = 0  # floats of SCRATCH needed

    def kernel(self) -> Kernel:
        body = tuple(self.group(self.k.body))
        scratch = (LocalArray(SCRATCH, "f32", self.scratch),) if self.scratch else ()
        return replace(self.k, body=body, local=self.k.local + scratch)

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


def _uniform_local_reads(k: Kernel, local: set[str]) -> set[str]:
    """Local arrays read by uniform (group-level) statements."""
    out: set[str] = set()

    def visit(body):
        for s in body:
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

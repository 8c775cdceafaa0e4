"""Numba's SSA reconstruction, driven over an index of the statements instead of whole-function sweeps.

Numba's `ReconstructSSA` pass (`numba.core.ssa._run_ssa`, copied as `numba.cuda.core.ssa._run_ssa` in numba-cuda)
fixes one variable assigned more than once (a "violator") at a time, and for each it walks every statement of the
function twice: once to give its assignments fresh names, once to point its uses at the reaching definition. It
also finds a statement's position by scanning its block from the top, for each use. Generated kernels are tens of
thousands of statements with hundreds of violators (the accumulators of unrolled dot products, reassigned once per
word), so the pass is quadratic there and was most of a long kernel's compile (docs/benchmarks.md, "Compile time
of the generated kernels").

`ssa_in_one_sweep(ssa)` returns a drop-in for the `_run_ssa` of numba's module `ssa` that computes the same blocks:
it runs numba's own handlers (`_FreshVarHandler`, `_FixSSAVars`) on the same statements, in the same order, with
the same states, but only on the statements a handler can change (an assignment to the violator, a statement
that names it; for any other the handlers return the statement itself and change no state), found from one index
of every statement's variables; and `_stmt_index` answers from a table of positions, with the result numba's scan
gives (including its `stop=-1` default, which leaves a block's last statement unfound). Fresh names are drawn from
the scope in the same order (one variable at a time, its assignments then its phis), so even the names agree; phi
nodes are prepended to their blocks as numba does, the last variable's first. Why this is exact, step by step, is
in the comments below; `tests/test_target_cpu.py` checks it against numba's pass on a generated kernel.

Also here, for numba-cuda's lowering: `linear_lowering_scan()` puts a one-pass count of the block-local variables
(`singly_assigned_in_one_pass`) in place of a scan that was quadratic in a block's length.
"""

from __future__ import annotations

import contextlib
from collections import Counter, defaultdict
from types import ModuleType, SimpleNamespace
from typing import Any


def ssa_in_one_sweep(ssa: ModuleType) -> Any:
    """A replacement for `ssa._run_ssa` (numba's `numba.core.ssa` or numba-cuda's copy) with the same results."""
    ir = ssa.ir
    # What `_run_ssa_block_pass` dispatches on (numba-cuda widened numba's `ir.Assign` to a tuple of classes).
    assign_types = getattr(ir, "assign_types", ir.Assign)

    class IndexedFixSSAVars(ssa._FixSSAVars):
        """numba's handler, with statement positions looked up instead of scanned for."""

        def __init__(self, cache_list_vars, positions: dict[int, tuple]) -> None:
            super().__init__(cache_list_vars)
            # id(statement) -> (the statement, its index in the block numba would scan); holding the statement
            # keeps its id from being reused by a statement made later.
            self.positions = positions

        def _stmt_index(self, defstmt, block, stop=-1):
            # numba: the first i in range(len(block.body))[:stop] with block.body[i] is defstmt, else len(body).
            stmt, pos = self.positions.get(id(defstmt), (None, None))
            return pos if stmt is defstmt and pos < len(range(block.size)[:stop]) else block.size

    def run_ssa(blocks):
        if not blocks:
            return {}
        cfg = ssa.compute_cfg_from_blocks(blocks)
        df_plus = ssa._iterated_domfronts(cfg)
        violators = ssa._find_defs_violators(blocks, cfg)
        cache_list_vars = ssa._CacheListVars()
        labels = list(blocks)
        # The statements of each block (replaced in place as numba's passes replace them) and, in front of them,
        # the phi nodes inserted so far (numba prepends each variable's phis to the body it then rescans).
        body = {label: list(blocks[label].body) for label in labels}
        phis: dict[Any, list] = {label: [] for label in labels}
        # Where each violator is assigned and where it is named, in block order then statement order (the order
        # numba's sweeps meet them). A statement names a variable iff its `list_vars()` does; what the handlers
        # look at (`list_vars()` of an assignment's value, the value itself, or a statement's `list_vars()`) is a
        # part of that, so a statement outside the index is one they return unchanged. Renaming never makes a
        # statement name a violator it did not name: fresh names are new to the scope.
        defs, uses = defaultdict(list), defaultdict(list)
        for label in labels:
            for i, stmt in enumerate(body[label]):
                if isinstance(stmt, assign_types) and stmt.target.name in violators:
                    defs[stmt.target.name].append((label, i))
                for name in {v.name for v in stmt.list_vars()}:
                    if name in violators:
                        uses[name].append((label, i))
        for varname in violators:
            # numba's `_fresh_vars`: its handler on each assignment to `varname`, in order.
            states = ssa._make_states(blocks)
            states["varname"] = varname
            states["defmap"] = defmap = defaultdict(list)
            fresh = ssa._FreshVarHandler()
            for label, i in defs[varname]:
                states["label"] = label
                body[label][i] = fresh.on_assign(states, body[label][i])
            # numba's `_fix_ssa_vars`: its handler on each statement naming `varname`, each block scanned as it
            # stands before this variable's phis go in (the positions, its size).
            states = ssa._make_states(blocks)
            states.update(varname=varname, defmap=defmap, phimap=defaultdict(list), cfg=cfg,
                          phi_locations=ssa._compute_phi_locations(df_plus, defmap))
            positions = {id(body[label][i]): (body[label][i], len(phis[label]) + i) for label, i in defs[varname]}
            fix = IndexedFixSSAVars(cache_list_vars, positions)
            for label, i in uses[varname]:
                stmt = body[label][i]
                positions[id(stmt)] = (stmt, len(phis[label]) + i)
                states["label"] = label
                states["block"] = SimpleNamespace(loc=blocks[label].loc, size=len(phis[label]) + len(body[label]))
                body[label][i] = fix.on_assign(states, stmt) if isinstance(stmt, assign_types) \
                    else fix.on_other(states, stmt)
            for label, philist in states["phimap"].items():
                phis[label][:0] = philist
        out = {}
        for label in labels:
            old = blocks[label]
            out[label] = block = ir.Block(scope=old.scope, loc=old.loc)
            block.body = phis[label] + body[label]
        if ssa.compute_cfg_from_blocks(out) != cfg:
            raise ssa.errors.CompilerError("CFG mutated in SSA pass")
        return out

    run_ssa.__doc__ = f"`{ssa.__name__}._run_ssa`, the same blocks from one index of the statements (numba_ssa.py)."
    return run_ssa


replaced: dict[str, Any] = {}  # module name -> numba's own `_run_ssa`, once replaced (tests compare the two)


def install() -> None:
    """Put `ssa_in_one_sweep` in place of `_run_ssa` in numba's SSA module and numba-cuda's copy (each once, and only
    where the module has the functions and handlers it was written against: numba 0.68, numba-cuda 0.30)."""
    import importlib

    for name in ("numba.core.ssa", "numba.cuda.core.ssa"):
        try:
            ssa = importlib.import_module(name)
        except ImportError:  # no numba-cuda, or an older one without its own copy of the pass
            continue
        if name in replaced or not all(hasattr(ssa, n) for n in _USED):
            continue
        replaced[name], ssa._run_ssa = ssa._run_ssa, ssa_in_one_sweep(ssa)


# What `ssa_in_one_sweep` takes from numba's module.
_USED = ("_run_ssa", "_FixSSAVars", "_FreshVarHandler", "_CacheListVars", "_find_defs_violators",
         "_iterated_domfronts", "_compute_phi_locations", "_make_states", "compute_cfg_from_blocks", "errors", "ir")


def singly_assigned_in_one_pass(lower) -> None:
    """numba-cuda's `Lower._find_singly_assigned_variable` (the variables defined once, in one block, and used
    only there, which lowering keeps in registers rather than stack slots), computed with one count of each
    block's assignments. numba-cuda 0.30 rescans a variable's whole block for each variable, quadratic in the
    block's length, and generated kernels are long single blocks (unrolled chunks): that scan was most of a K-quant
    matvec's compile (docs/benchmarks.md). Numba fixed the same scan upstream."""
    from numba.cuda import lowering as lw

    blocks, found = lower.func_ir.blocks, set()
    if not lower.func_ir.func_id.is_generator:
        use_defs = lw.compute_use_defs(blocks)
        # Kept on the stack, or read in a block before any write there: not block-local.
        skip = lw.must_use_alloca(blocks).union(*use_defs.usemap.values())
        blocks_of = Counter(var for names in use_defs.defmap.values() for var in names)
        for label, names in use_defs.defmap.items():
            if once := [var for var in names if blocks_of[var] == 1 and var not in skip]:
                assigned = Counter(st.target.name for st in blocks[label].find_insts(lw.ir.assign_types))
                found.update(var for var in once if assigned[var] == 1)
    lower._singly_assigned_vars = found
    lower._blk_local_varmap = {}


numba_cuda_scan = None  # numba-cuda's own scan, once replaced (tests compare the two)


def linear_lowering_scan() -> None:
    """Put `singly_assigned_in_one_pass` in place of numba-cuda's scan (once, where numba-cuda's lowering has the
    shape it was written for): the cuda runtime, before it compiles."""
    global numba_cuda_scan
    with contextlib.suppress(ImportError):  # older numba-cuda
        from numba.cuda import lowering as lw

        scan = getattr(lw.Lower, "_find_singly_assigned_variable", None)
        if scan not in (None, singly_assigned_in_one_pass) and all(
                hasattr(lw, n) for n in ("compute_use_defs", "must_use_alloca", "ir")):
            numba_cuda_scan, lw.Lower._find_singly_assigned_variable = scan, singly_assigned_in_one_pass

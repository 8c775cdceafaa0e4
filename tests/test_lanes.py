"""The lane lowering (`codegen/lanes.py`) and the C-family hooks a new target fills in (here: C for the host
through the system's C compiler, one thread per group, written with hooks only)."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest
from ir_constructs import cases, check_case, reduce_kernel, shared_kernel

from polystrata.codegen.cfamily import CPrinter
from polystrata.codegen.lanes import ONE_LANE, SCRATCH, Barrier, LaneAbilities, LaneId, SubgroupReduce, lower
from polystrata.codegen.pyfamily import NUMPY_DTYPES
from polystrata.ir.kernel import Buf, LaneFor, Reduce, expr_nodes, stmt_exprs, walk


def _scratch(k) -> int:
    return sum(a.size for a in k.local if a.name == SCRATCH)


def test_lowering_leaves_only_explicit_constructs():
    k = shared_kernel(64)
    for abilities in (LaneAbilities(), LaneAbilities(subgroup=64), LaneAbilities(subgroup=32, several=True), ONE_LANE):
        body = list(walk(lower(k, abilities).body))
        assert not any(isinstance(s, LaneFor | Reduce) for s in body)
        lane_ids = any(isinstance(n, LaneId) for s in body for e in stmt_exprs(s) for n in expr_nodes(e))
        assert lane_ids == abilities.parallel
        assert any(isinstance(s, Barrier) for s in body) == abilities.parallel


@pytest.mark.parametrize("abilities, lanes, subgroup_reduces, scratch", [
    (LaneAbilities(), 64, 0, 64),                                  # the portable tree
    (LaneAbilities(subgroup=64), 64, 2, 0),                        # one subgroup is the group
    (LaneAbilities(subgroup=64), 32, 0, 32),                       # narrower: only where `partial` says so
    (LaneAbilities(subgroup=64, partial=True), 32, 2, 0),
    (LaneAbilities(subgroup=32), 128, 0, 128),                     # several subgroups: only where `several` says so
    (LaneAbilities(subgroup=32, several=True), 128, 2, 4),         # a slot per subgroup
    (LaneAbilities(subgroup=32, several=True), 24, 0, 24),         # not whole subgroups: the tree
    (ONE_LANE, 64, 0, 0),
])
def test_combine_follows_the_declared_abilities(abilities, lanes, subgroup_reduces, scratch):
    low = lower(reduce_kernel(lanes), abilities)
    assert sum(isinstance(s, SubgroupReduce) for s in walk(low.body)) == subgroup_reduces
    assert _scratch(low) == scratch


class HostCPrinter(CPrinter):
    """C for the host (gcc, clang): each group runs as one thread; the launcher loops over the grid. Only hooks."""

    def prelude(self) -> str:
        return "#include <math.h>\n"

    def group_id(self, d: int) -> str:
        return f"ps_g{d}"

    def unroll(self, n: int | None = None) -> str:
        return f"#pragma GCC unroll {n or 32}"

    def _dims(self, prefix: str) -> list[str]:
        return [f"{prefix}{d}" for d in range(len(self.k.grid))]

    def signature(self, params: list[str]) -> str:
        return f"static void {self.k.name}_group({', '.join(params + [f'int {g}' for g in self._dims('ps_g')])})"

    def launcher(self, params: list[str]) -> str:
        loops = "".join(f"    for (int {g} = 0; {g} < {n}; {g}++)\n"
                        for g, n in zip(self._dims("ps_g"), self._dims("ps_n")))
        args = [p.name for p in self.k.params] + self._dims("ps_g")
        return (f"void {self.k.name}({', '.join(params + [f'int {n}' for n in self._dims('ps_n')])}) {{\n"
                f"{loops}        {self.k.name}_group({', '.join(args)});\n}}\n")


@pytest.mark.skipif(not shutil.which("cc"), reason="no C compiler")
def test_a_one_lane_c_target_needs_only_hooks(tmp_path):
    """Every IR construct case (GPU-shaped kernels included) runs through `HostCPrinter` and the system's C
    compiler, and matches numpy."""
    libs = {}
    for label, kernel, inputs, outputs, scalars, grid, want in cases():
        if kernel.name not in libs:
            src = tmp_path / f"{kernel.name}.c"
            src.write_text(HostCPrinter(kernel, ONE_LANE).render())
            lib = tmp_path / f"{kernel.name}.so"
            subprocess.run(["cc", "-O1", "-ffp-contract=off", "-shared", "-fPIC", "-o", lib, src, "-lm"],
                           check=True, capture_output=True)
            libs[kernel.name] = ctypes.CDLL(str(lib))
        arrays = {name: np.ascontiguousarray(a) for name, a in inputs.items()}
        for name, (size, dt) in outputs.items():
            arrays[name] = np.full(size, np.nan, np.float32) if dt == "f32" else \
                np.full(size, -1).astype(NUMPY_DTYPES[dt])
        args = []
        for p in kernel.params:
            if isinstance(p, Buf):
                args.append(arrays[p.name].ctypes.data_as(ctypes.c_void_p))
            else:
                args.append(ctypes.c_float(scalars[p.name]) if p.dtype == "f32" else ctypes.c_int(scalars[p.name]))
        getattr(libs[kernel.name], kernel.name)(*args, *(ctypes.c_int(g) for g in grid))
        check_case({name: arrays[name] for name in outputs}, want, outputs, f"host C: {label}")

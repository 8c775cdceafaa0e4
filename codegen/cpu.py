"""CPU renderer: kernel IR -> Python source compiled by Numba (`@njit(parallel=True)`).

Each grid point is one call of the kernel's group function, from a `prange` loop (or a plain loop where a launch
does not pay for waking the thread pool: `runtimes/cpu.py`); lanes do not exist on the CPU, so `LaneFor` and
`Reduce` become ordinary loops (the sequential semantics of the IR, taken literally: `codegen/lanes.py` with
`ONE_LANE`) and local arrays are per-iteration numpy arrays. The f16 conversions are LLVM casts
(`codegen/cpu_intrinsics.py`). Everything else (expressions with float32 discipline, statements, tables, the
other intrinsic helpers) is the shared Numba printer of `codegen/pyfamily.py`.
"""

from __future__ import annotations

from polystrata.codegen.pyfamily import NUMPY_DTYPES, PyPrinter, prelude
from polystrata.ir.kernel import Kernel

_IMPORTS = "import math\nimport numpy as np\nfrom numba import njit, prange\n"
_DECORATOR = 'njit(inline="always", cache=True)'
PRELUDE = prelude(_IMPORTS, _DECORATOR)

__all__ = ["NUMPY_DTYPES", "PRELUDE", "render"]


class CPUPrinter(PyPrinter):
    """`PyPrinter` for the CPU: a `prange` over the flattened grid; lanes are plain loops (the defaults)."""

    imports = _IMPORTS + "from polystrata.codegen.cpu_intrinsics import f16_to_f32, f32_to_f16\n"
    helper_decorator = _DECORATOR
    native_intrinsics = {"f16_bits_to_f32": "f16_to_f32", "f32_to_f16_bits": "f32_to_f16"}

    def header(self) -> int:
        """The group function `_group_<name>(_g, params, grid sizes, local arrays)`: one group's work."""
        k = self.k
        dims = [f"_G{i}" for i in range(len(k.grid))]
        self.emit(0, "@njit(cache=True" + (", fastmath={'contract'})" if k.contract else ")"))
        self.emit(0, f"def _group_{k.name}({', '.join(['_g', *self.signature(), *(a.name for a in k.local)])}):")
        rest = "_g"
        for i in range(len(dims) - 1, -1, -1):
            if i == 0:
                self.emit(1, f"g0 = {rest}")
            else:
                self.emit(1, f"g{i} = {rest} % {dims[i]}")
                self.emit(1, f"_r{i} = {rest} // {dims[i]}")
                rest = f"_r{i}"
        return 1

    def signature(self) -> list[str]:
        return [*(p.name for p in self.k.params), *(f"_G{i}" for i in range(len(self.k.grid)))]

    def render(self) -> str:
        """The module: the group function, then the two ways to run every group: `<name>`, a `prange` over them
        on Numba's threads, and `<name>_serial`, a plain loop (no thread pool to wake: what a launch of one group,
        or any launch with one thread, should take)."""
        k = self.k
        args = ", ".join(self.signature())
        # `np.int64(_g)`: prange's index is unsigned, range's signed; one type, so the group compiles once.
        call = f"_group_{k.name}({', '.join(['np.int64(_g)', *self.signature(), *(a.name for a in k.local)])})"
        groups = " * ".join(f"_G{i}" for i in range(len(k.grid)))
        local = [f"{a.name} = np.empty({a.size}, np.{NUMPY_DTYPES[a.dtype]})" for a in k.local]
        parallel = [f"def {k.name}({args}):", f"    for _g in prange({groups}):",
                    *(f"        {line}" for line in local), f"        {call}"]
        serial = [f"def {k.name}_serial({args}):", *(f"    {line}" for line in local),
                  f"    for _g in range({groups}):", f"        {call}"]
        return (super().render() + "\n\n@njit(parallel=True, cache=True)\n" + "\n".join(parallel)
                + "\n\n\n@njit(cache=True)\n" + "\n".join(serial) + "\n")


def render(k: Kernel) -> str:
    """Python/Numba source of one kernel: a module with the prelude, the group function and the `@njit`
    functions `k.name` (parallel) and `k.name + "_serial"`, both taking the parameters and then the grid sizes."""
    return CPUPrinter(k).render()

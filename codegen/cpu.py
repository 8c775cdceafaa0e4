"""CPU renderer: kernel IR -> Python source compiled by Numba (`@njit(parallel=True)`).

Each grid point becomes one iteration of a `prange` loop; lanes do not exist on the CPU, so `LaneFor` and
`Reduce` become ordinary loops (the sequential semantics of the IR, taken literally: `codegen/lanes.py` with
`ONE_LANE`) and local arrays are per-iteration numpy arrays. The f16 conversions are LLVM casts and
`dot_i8_blocks` and `dot_f32` loops in LLVM IR (`codegen/cpu_intrinsics.py`). Everything else (expressions with float32
discipline, statements, tables, the other intrinsic helpers) is the shared Numba printer of `codegen/pyfamily.py`.
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

    imports = _IMPORTS + ("from polystrata.codegen.cpu_intrinsics import dot_f32, dot_i8_blocks, f16_to_f32, "
                          "f32_to_f16\n")
    helper_decorator = _DECORATOR
    native_intrinsics = {"f16_bits_to_f32": "f16_to_f32", "f32_to_f16_bits": "f32_to_f16",
                         "dot_i8_blocks": "dot_i8_blocks", "dot_f32": "dot_f32"}

    def header(self) -> int:
        k = self.k
        names = [p.name for p in k.params]
        dims = [f"_G{i}" for i in range(len(k.grid))]
        fast = [flag for flag, given in (("contract", k.contract), ("reassoc", k.reassociate)) if given]
        flags = ", ".join(repr(flag) for flag in fast)  # in a fixed order: the source is the cache key
        self.emit(0, "@njit(parallel=True, cache=True" + (f", fastmath={{{flags}}})" if fast else ")"))
        self.emit(0, f"def {k.name}({', '.join(names + dims)}):")
        self.emit(1, f"for _g in prange({' * '.join(dims)}):")
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
        return 2


def render(k: Kernel) -> str:
    """Python/Numba source of one kernel: a module with the prelude and one `@njit` function `k.name`."""
    return CPUPrinter(k).render()

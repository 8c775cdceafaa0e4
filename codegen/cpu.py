"""CPU renderer: kernel IR -> Python source compiled by Numba (`@njit(parallel=True)`).

Each grid point becomes one iteration of a `prange` loop; lanes do not exist on the CPU, so `LaneFor` and
`Reduce` become ordinary loops (the sequential semantics of the IR, taken literally: `codegen/lanes.py` with
`ONE_LANE`) and local arrays are per-iteration numpy arrays. The f16 conversions are LLVM casts and
`dot_i8_pair` and `dot_f32` loops in LLVM IR (`codegen/cpu_intrinsics.py`). Everything else (expressions with float32
discipline, statements, tables, the other intrinsic helpers) is the shared Numba printer of `codegen/pyfamily.py`.
"""

from __future__ import annotations

from polystrata.codegen.pyfamily import NUMPY_DTYPES, PyPrinter, prelude
from polystrata.ir.kernel import Kernel

_IMPORTS = "import math\nimport numpy as np\nfrom numba import njit, prange\n"
_DECORATOR = 'njit(inline="always", cache=True)'
PRELUDE = prelude(_IMPORTS, _DECORATOR)

# tanh as Eigen's rational function (`generic_fast_tanh_float`: odd degree 13 over even degree 6 on inputs clamped
# to +-7.905, where it reaches 1.0 in f32; within 3.5e-7 of tanh, relative): plain arithmetic, which LLVM
# vectorizes in a loop over a tile's values (a GLU's activation, `tile_matmul_q8_kernel`), where `math.tanh` is a
# call into the C library per value (docs/benchmarks.md, "Prefill on the CPU: the GELU, ...").
TANH_F32 = """\
@{dec}
def tanh_f32(x):
    c = np.float32(7.90531110763549805) if x > np.float32(7.90531110763549805) else x  # NaN stays NaN
    c = np.float32(-7.90531110763549805) if c < np.float32(-7.90531110763549805) else c
    c2 = c * c
    p = np.float32(-2.76076847742355e-16) * c2 + np.float32(2.00018790482477e-13)
    p = p * c2 + np.float32(-8.60467152213735e-11)
    p = p * c2 + np.float32(5.12229709037114e-08)
    p = p * c2 + np.float32(1.48572235717979e-05)
    p = p * c2 + np.float32(6.37261928875436e-04)
    p = p * c2 + np.float32(4.89352455891786e-03)
    q = np.float32(1.19825839466702e-06) * c2 + np.float32(1.18534705686654e-04)
    q = q * c2 + np.float32(2.26843463243900e-03)
    q = q * c2 + np.float32(4.89352518554385e-03)
    return np.float32(c * p / q)
"""

__all__ = ["NUMPY_DTYPES", "PRELUDE", "render"]


class CPUPrinter(PyPrinter):
    """`PyPrinter` for the CPU: a `prange` over the flattened grid; lanes are plain loops (the defaults)."""

    imports = _IMPORTS + ("from polystrata.codegen.cpu_intrinsics import dot_f32, dot_i8_pair, f16_to_f32, "
                          "f32_to_f16\n")
    helper_decorator = _DECORATOR
    native_intrinsics = {"f16_bits_to_f32": "f16_to_f32", "f32_to_f16_bits": "f32_to_f16",
                         "dot_i8_pair": "dot_i8_pair", "dot_f32": "dot_f32"}
    native_math = {"tanh": ("tanh_f32", TANH_F32)}

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

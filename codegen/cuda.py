"""CUDA renderer: kernel IR -> Python source for numba-cuda (`@cuda.jit`), on the shared Numba printer.

One grid point is one block (`g0..g2` = `cuda.blockIdx.x/y/z`) of `kernel.lanes` threads, lane =
`cuda.threadIdx.x`; local arrays are `cuda.shared.array`s. `codegen/lanes.py` lowers the lane semantics; this
file spells its constructs: the barrier is `cuda.syncthreads()`, and with `shuffles` the target declares warps
(32 lanes, several per block) whose `SubgroupReduce` is a `shfl_down_sync` chain (then `shfl_sync` from lane 0
where every lane needs the result). Without shuffles (the simulator has none) reductions take the portable tree
in shared memory.

With `mma` (sm_80 and newer) the target declares the `MMA_SYNC` matrix unit (`codegen/policy.py`): tile products
(`TileMMA`) become warp `mma.sync` instructions on 16 x 8 tiles (int8 m16n8k32 / m16n8k16 into s32, f16 m16n8k16
into f32), through the inline-PTX intrinsics of `codegen/cuda_intrinsics.py`; the operand words come from shared
memory as single 32-bit loads (no `ldmatrix`: its 8 x 8 b16 layout would need the f16 operands transposed for B).
"""

from __future__ import annotations

from polystrata.codegen.lanes import LaneAbilities, SubgroupReduce
from polystrata.codegen.policy import MMA_SYNC
from polystrata.codegen.pyfamily import NUMPY_DTYPES, PyPrinter
from polystrata.ir.kernel import Kernel

WARP = 32
_FULL = "0xFFFFFFFF"


class CUDAPrinter(PyPrinter):
    """`PyPrinter` for numba-cuda: blocks of `lanes` threads, shared memory, barriers, warp shuffles."""

    imports = "import math\nimport numpy as np\nfrom numba import cuda\n"
    helper_decorator = 'cuda.jit(device=True, inline="always")'
    lane_id = "_lid"
    barrier = "cuda.syncthreads()"
    share_reads = True

    def __init__(self, k: Kernel, shuffles: bool = False, native: bool = False, mma: bool = False):
        super().__init__(k, LaneAbilities(subgroup=WARP if shuffles else 0, several=True,
                                          matrix=MMA_SYNC if mma and native else None))
        self.native = native  # intrinsics as PTX (`codegen/cuda_intrinsics.py`); the simulator runs the portable ones
        if native:
            self.native_intrinsics = {"dot4_i8": "dp4a", "f16_bits_to_f32": "f16_to_f32",
                                      "f32_to_f16_bits": "f32_to_f16"}
            # Word loads as one 32-bit or two 16-bit loads; at 8 and 16 bytes NVVM is told, and merges runs of
            # them into vector loads.
            self.aligned_loads = {n: f"load_u32_a{n}" for n in (2, 4, 8, 16)}
            self.aligned_elements = {n: f"load_a{n}" for n in (4, 8, 16)}
            self.imports += ("from polystrata.codegen.cuda_intrinsics import dp4a, f16_to_f32, f32_to_f16, "
                             "load_a4, load_a8, load_a16, load_u32_a2, load_u32_a4, load_u32_a8, load_u32_a16, "
                             "mma_f16_k16, mma_s8_k16, mma_s8_k32, mma_u8f16_k16\n")

    def header(self) -> int:
        k = self.k
        self.emit(0, "@cuda.jit")  # compiled to PTX (runtimes/cuda.py), which the kernel cache keeps: no Numba cache
        self.emit(0, f"def {k.name}({', '.join(p.name for p in k.params)}):")
        self.emit(1, f"{self.lane_id} = cuda.threadIdx.x")
        for d in range(len(k.grid)):
            self.emit(1, f"g{d} = cuda.blockIdx.{'xyz'[d]}")
        for a in k.local:
            self.emit(1, f"{a.name} = cuda.shared.array({a.size}, np.{NUMPY_DTYPES[a.dtype]})")
        return 1

    def subgroup_reduce(self, s: SubgroupReduce, d: int) -> None:
        """Within each warp: lane 0 ends with the total (`shfl_down_sync`), then every lane gets it if asked."""
        v = s.var
        off = s.width // 2
        while off:
            down = f"cuda.shfl_down_sync({_FULL}, {v}, {off})"
            self.emit(d, f"{v} = {v} + {down}" if s.op == "+" else f"{v} = max({v}, {down})")
            off //= 2
        if s.broadcast:
            self.emit(d, f"{v} = cuda.shfl_sync({_FULL}, {v}, 0)")


def render(kernel: Kernel, shuffles: bool = False, native: bool = False, mma: bool = False) -> str:
    """numba-cuda source of `kernel`: a module with the f16/intrinsic device functions and one `@cuda.jit`
    kernel `kernel.name` taking its parameters in order (1-D arrays and int32/float32 scalars); launch it on
    `grid` blocks of `kernel.lanes` threads. `shuffles` selects warp shuffles for `Reduce` (lanes a multiple of
    32; not available in the simulator), otherwise the shared-memory tree; `native` the PTX forms of the
    intrinsics (`dp4a`, word loads; not in the simulator), otherwise their portable definitions; `mma` (with
    `native`, sm_80+) tile products on the `MMA_SYNC` unit, otherwise their portable loops."""
    return CUDAPrinter(kernel, shuffles, native, mma).render()

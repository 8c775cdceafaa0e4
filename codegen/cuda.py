"""CUDA renderer: kernel IR -> Python source for numba-cuda (`@cuda.jit`), on the shared Numba printer.

Only the lane mapping lives here (the rules of `codegen/cfamily.py`, spelled for numba-cuda): one grid point
is one block (`g0..g2` = `cuda.blockIdx.x/y/z`) of `kernel.lanes` threads, lane = `cuda.threadIdx.x`;
local arrays are `cuda.shared.array`s;

* `LaneFor v < n` -> `for v in range(lane, n, LANES)`, then `cuda.syncthreads()`;
* `Reduce` -> a per-lane partial over the same strided range, then a combine: with `shuffles` (and lanes a
  multiple of 32) `shfl_down_sync` within each warp and the warps' totals through shared memory, otherwise a
  tree in shared memory (the portable path: any lane count, and the only one the simulator runs);
* uniform statements run on every lane; a uniform `Store` is done by lane 0, followed by a barrier when it
  goes to a local array or a buffer the kernel reads; a barrier also precedes a lane loop or uniform store
  that overwrites a local array uniform code reads.
"""

from __future__ import annotations

import math

from polystrata.codegen.cfamily import CPrinter
from polystrata.codegen.pyfamily import NUMPY_DTYPES, PyPrinter
from polystrata.ir.kernel import Call, Const, Kernel, LaneFor, Load, Reduce, Store, buffers_read, promised_bytes, walk

WARP = 32
_FULL = "0xFFFFFFFF"
_SYNC = "cuda.syncthreads()"


class CUDAPrinter(PyPrinter):
    """`PyPrinter` for numba-cuda: blocks of `lanes` threads, shared memory, barriers, warp shuffles."""

    imports = "import math\nimport numpy as np\nfrom numba import cuda\n"
    helper_decorator = 'cuda.jit(device=True, inline="always")'

    def __init__(self, k: Kernel, shuffles: bool = False, native: bool = False):
        super().__init__(k)
        self.native = native  # intrinsics as PTX (`codegen/cuda_intrinsics.py`); the simulator runs the portable ones
        if native:
            self.native_intrinsics = {"dot4_i8": "dp4a", "f16_bits_to_f32": "f16_to_f32",
                                      "f32_to_f16_bits": "f32_to_f16"}
            self.imports += ("from polystrata.codegen.cuda_intrinsics import dp4a, f16_to_f32, f32_to_f16, "
                             "load_a8, load_a16, load_u32_a2, load_u32_a4, load_u32_a8, load_u32_a16\n")
        self.lanes = k.lanes
        # Warp shuffles need whole warps: a group that is a multiple of 32 lanes.
        self.shuffles = shuffles and k.lanes % WARP == 0
        self.local_names = {a.name for a in k.local}
        self.loaded = buffers_read(k)
        # The C printer's analysis only reads `k` and `local_names`: reuse it rather than copy it.
        self.uniform_local_reads = CPrinter._uniform_local_reads(self)
        has_reduce = any(isinstance(s, Reduce) for s in walk(k.body)) and k.lanes > 1
        self.scratch = 0 if not has_reduce else (k.lanes // WARP if self.shuffles else k.lanes)
        if self.scratch == 1:
            self.scratch = 0  # one warp: the shuffle result is broadcast, no shared memory

    def e(self, x) -> str:
        # load_u32 at a promised alignment is one 32-bit or two 16-bit loads (the others: `native_intrinsics`),
        # and loads promised 8- or 16-byte aligned say so to NVVM, which merges runs of them into vector loads.
        if (self.native and isinstance(x, Call) and x.fn == "load_u32" and isinstance(x.args[2], Const)
                and x.args[2].value in (2, 4, 8, 16)):
            return f"np.int64(load_u32_a{x.args[2].value}({x.args[0].name}, np.uint64({self.e(x.args[1])})))"
        if self.native and isinstance(x, Load) and promised_bytes(self.k, x):
            v = f"load_a{promised_bytes(self.k, x)}({x.buf}, np.uint64({self.e(x.index)}))"
            return v if self.k.dtype_of(x.buf) == "f32" else f"np.int64({v})"
        return super().e(x)

    def header(self) -> int:
        k = self.k
        self.emit(0, "@cuda.jit(cache=True)")
        self.emit(0, f"def {k.name}({', '.join(p.name for p in k.params)}):")
        self.emit(1, "_lid = cuda.threadIdx.x")
        for d in range(len(k.grid)):
            self.emit(1, f"g{d} = cuda.blockIdx.{'xyz'[d]}")
        for a in k.local:
            self.emit(1, f"{a.name} = cuda.shared.array({a.size}, np.{NUMPY_DTYPES[a.dtype]})")
        if self.scratch:
            self.emit(1, f"_red = cuda.shared.array({self.scratch}, np.float32)")
        return 1

    def barrier(self, d: int) -> None:
        self.emit(d, _SYNC)
        self.last_barrier = True

    def lane_range(self, stop: str) -> str:
        return f"range(_lid, {stop}, {self.lanes})"

    def pre_barrier(self, s, d: int) -> None:
        """Barrier before a lane loop overwriting a local array that uniform code may still be reading."""
        written = {st.buf for st in walk(s.body) if isinstance(st, Store)}
        if written & self.uniform_local_reads and not self.last_barrier:
            self.barrier(d)

    def lane_for(self, s: LaneFor, d: int) -> None:
        self.pre_barrier(s, d)
        super().lane_for(s, d)
        self.barrier(d)

    def reduce(self, s: Reduce, d: int) -> None:
        self.pre_barrier(s, d)
        super().reduce(s, d)

    def store(self, s: Store, d: int, lane: bool) -> None:
        if lane:
            self.emit(d, self.store_text(s))
            return
        local = s.buf in self.local_names
        if local and s.buf in self.uniform_local_reads and not self.last_barrier:
            self.barrier(d)  # other lanes may still be reading the old value
        self.emit(d, "if _lid == 0:")
        self.emit(d + 1, self.store_text(s))
        self.last_barrier = False
        if local or s.buf in self.loaded:
            self.barrier(d)  # syncthreads also orders global memory within the block

    def op(self, s: Reduce, a: str, b: str) -> str:
        return f"{a} + {b}" if s.op == "+" else f"max({a}, {b})"

    def combine(self, s: Reduce, acc: str, d: int) -> str:
        stores = any(isinstance(st, Store) for st in walk(s.body))
        if self.lanes == 1:
            self.last_barrier = False
            return acc
        if self.shuffles:
            for off in (16, 8, 4, 2, 1):  # lane 0 of each warp ends with the warp's total
                self.emit(d, f"{acc} = {self.op(s, acc, f'cuda.shfl_down_sync({_FULL}, {acc}, {off})')}")
            if self.lanes == WARP:
                self.emit(d, f"{acc} = cuda.shfl_sync({_FULL}, {acc}, 0)")
                self.last_barrier = False
                if stores:
                    self.barrier(d)  # the body's stores are read after the Reduce
                return acc
            self.emit(d, f"if _lid % {WARP} == 0:")
            self.emit(d + 1, f"_red[_lid // {WARP}] = {acc}")
            self.barrier(d)
            # Every lane adds the warps' totals in the same order: the result is the same in all lanes.
            self.emit(d, f"{acc} = _red[0]")
            for w in range(1, self.lanes // WARP):
                self.emit(d, f"{acc} = {self.op(s, acc, f'_red[{w}]')}")
        else:
            self.tree(s, acc, d)
            self.emit(d, f"{acc} = _red[0]")
        self.barrier(d)  # the scratch is reused by the next Reduce: everyone must have read it first
        return acc

    def tree(self, s: Reduce, acc: str, d: int) -> None:
        """Combine the lanes' partials in shared memory (any lane count, not only powers of two)."""
        p = 1 << (self.lanes.bit_length() - 1)
        self.emit(d, f"_red[_lid] = {acc}")
        self.barrier(d)
        steps = ([p] if p != self.lanes else []) + [1 << i for i in range(int(math.log2(p)) - 1, -1, -1)]
        for i, half in enumerate(steps):
            # The first step folds the lanes above the largest power of two (when lanes is not one).
            limit = self.lanes - p if i == 0 and p != self.lanes else half
            self.emit(d, f"if _lid < {limit}:")
            self.emit(d + 1, f"_red[_lid] = {self.op(s, '_red[_lid]', f'_red[_lid + {half}]')}")
            self.barrier(d)


def render(kernel: Kernel, shuffles: bool = False, native: bool = False) -> str:
    """numba-cuda source of `kernel`: a module with the f16/intrinsic device functions and one `@cuda.jit`
    kernel `kernel.name` taking its parameters in order (1-D arrays and int32/float32 scalars); launch it on
    `grid` blocks of `kernel.lanes` threads. `shuffles` selects warp shuffles for `Reduce` (lanes a multiple of
    32; not available in the simulator), otherwise the shared-memory tree; `native` the PTX forms of the
    intrinsics (`dp4a`, word loads; not in the simulator), otherwise their portable definitions."""
    return CUDAPrinter(kernel, shuffles, native).render()

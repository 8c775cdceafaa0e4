"""CUDA runtime: kernels rendered to numba-cuda source, compiled by numba-cuda, launched through the driver.

Buffers are 1-D numba device arrays holding the IR storage dtypes. Compilation is the Numba targets' source entry
(`Runtime._compile_python`; numba-cuda keeps its cubins beside the source). Launches bypass numba's dispatcher (tens
of µs of Python per launch, docs/benchmarks.md): the kernel's CUfunction is called with `cuLaunchKernel`, with
arguments flattened the way numba-cuda does it (an array is 7 words: meminfo, parent, nitems, itemsize, data,
shape[0], strides[0]) and packed once per `prepare`. `begin_capture` / `end_capture` record those launches into a
CUDA graph that `replay` re-runs with one driver call; the graph holds the arguments as they were at capture (buffer
pointers and scalar values), so new inputs go into the same buffers. With `NUMBA_ENABLE_CUDASIM=1` (set before
numba.cuda is imported) everything runs in numba-cuda's simulator: launches go through the dispatcher, reductions
take the shared-memory tree, and a graph is the base class's list of recorded launches.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from polystrata.codegen.cuda import render
from polystrata.codegen.policy import device_policy, matrix_unit
from polystrata.codegen.pyfamily import NUMPY_DTYPES
from polystrata.errors import PolystrataError
from polystrata.ir.kernel import Buf, Kernel
from polystrata.runtimes import cuda_driver, numba_ssa
from polystrata.runtimes.base import CompiledKernel, PackedLaunch, Runtime, cache_key, numba_signature, scalar_value
from polystrata.runtimes.cuda_driver import DeviceEvent, Graph, check, device_pointer, driver


def _singly_assigned_in_one_pass(lower) -> None:
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


_numba_cuda_scan = None  # numba-cuda's own scan, once replaced (tests compare the two)


def _linear_lowering_scan() -> None:
    """Put `_singly_assigned_in_one_pass` in place of numba-cuda's scan (once, where numba-cuda's lowering has the
    shape it was written for)."""
    global _numba_cuda_scan
    with contextlib.suppress(ImportError):  # older numba-cuda
        from numba.cuda import lowering as lw

        scan = getattr(lw.Lower, "_find_singly_assigned_variable", None)
        if scan not in (None, _singly_assigned_in_one_pass) and all(
                hasattr(lw, n) for n in ("compute_use_defs", "must_use_alloca", "ir")):
            _numba_cuda_scan, lw.Lower._find_singly_assigned_variable = scan, _singly_assigned_in_one_pass


class CUDARuntime(Runtime):
    """One NVIDIA GPU (the current numba-cuda device) with one stream, or numba-cuda's simulator."""

    name = "cuda"
    # 4 warps per group; NVVM merges loads with the alignment the generated loads declare; dp4a.
    policy = device_policy(lanes=128, subgroup=32, wide_loads=True, int8_dot=True)
    source_ext = "py"
    graphs = True

    @classmethod
    def present(cls) -> bool:
        """A GPU that numba-cuda can use (never the simulator: it is for tests)."""
        from numba import config, cuda

        return not config.ENABLE_CUDASIM and cuda.is_available()

    def __init__(self, shuffles: bool | None = None) -> None:
        """`shuffles`: warp shuffles for Reduce (default: on a GPU yes, in the simulator no, it has none)."""
        super().__init__()
        try:
            import numba_cuda
            from numba import config, cuda
        except ImportError as e:  # pragma: no cover - optional dependency
            raise PolystrataError(f"no CUDA GPU found: numba-cuda is not installed ({e})") from None
        self.cuda = cuda
        self.simulator = bool(config.ENABLE_CUDASIM)
        self.compiler = f"numba-cuda {numba_cuda.__version__}"
        if self.simulator:
            self.device = "numba-cuda simulator"
        else:
            _linear_lowering_scan()
            numba_ssa.install()  # numba-cuda's SSA pass, linear in a kernel's length
            try:
                cuda.current_context()  # initialises the driver and the primary context
                name, arch = cuda_driver.device_name_arch(check(driver.cuCtxGetDevice())[0])
            except Exception as e:  # CudaSupportError, missing libcuda or cuda-bindings, no device, ...
                raise PolystrataError(f"no CUDA GPU found: {e}") from None
            self.device = f"{name} ({arch})"
            self.policy = replace(self.policy, matrix_units=matrix_unit(arch) is not None)  # mma.sync from sm_80
        self.shuffles = (not self.simulator) if shuffles is None else shuffles
        self.fast = not self.simulator  # driver launches; False: numba's dispatcher (for comparisons)
        self.stream = cuda.stream()  # a real stream: the legacy default stream cannot be captured
        self._copy_stream = None  # the second stream of `copy_async`, made at its first call

    def compiler_version(self) -> str:
        """numba-cuda's version and the CUDA version of the driver (a new driver may schedule kernels anew)."""
        if self.simulator:
            return self.compiler
        return f"{self.compiler}, CUDA driver {check(driver.cuDriverGetVersion())[0]}"

    # --- compilation ----------------------------------------------------------------------------------

    def compile_workers(self) -> int:
        return 1 if self.simulator else super().compile_workers()  # the simulator compiles nothing

    def render(self, kernel: Kernel, shuffles: bool | None = None) -> str:
        return render(kernel, self.shuffles if shuffles is None else shuffles, native=not self.simulator,
                      mma=self.matrix_units)

    def compile(self, kernel: Kernel, shuffles: bool | None = None) -> CompiledKernel:
        source = self.render(kernel, shuffles)
        key = cache_key(source, self.name, self.device, self.compiler)
        # The simulator compiles nothing; on a GPU compile now (or load numba-cuda's cubin), not at a first launch.
        ck = self._compile_python(kernel, source, key, None if self.simulator else numba_signature(kernel))
        if not hasattr(ck, "cufunc"):  # first use in this process
            ck.cufunc = None if self.simulator else self._cufunc(ck.handle, kernel)
        return ck

    def _cufunc(self, disp: Any, kernel: Kernel) -> Any:
        """The CUfunction of a compiled dispatcher, for launches through the driver."""
        try:  # compile() of a signature already compiled returns its kernel
            handle = disp.compile(numba_signature(kernel))._codelibrary.get_cufunc().handle  # a CUkernel (cuda.core)
        except Exception as e:
            raise PolystrataError(f"CUDA build of kernel {kernel.name} failed on {self.device}:\n{e}") from None
        try:
            return check(driver.cuKernelGetFunction(handle))[0]
        except (PolystrataError, TypeError):
            return handle  # already a CUfunction (older cuda.core)

    # --- buffers --------------------------------------------------------------------------------------

    def alloc(self, shape: Sequence[int], dtype: str) -> Any:
        n = max(int(np.prod(shape)), 1)  # no empty device arrays: every buffer has a pointer
        if self.simulator:
            return self.cuda.to_device(np.zeros(n, NUMPY_DTYPES[dtype]))
        buf = self.cuda.device_array(n, NUMPY_DTYPES[dtype], stream=self.stream)
        check(driver.cuMemsetD8Async(device_pointer(buf), 0, buf.nbytes, self.stream.handle))  # zeros, like the CPU
        return buf

    def free(self, buf: Any) -> None:
        """Release a device buffer now, and flush numba-cuda's batch of deferred frees: a resized expert cache
        frees its old slots while bound launches still name them. The simulator's arrays are host memory."""
        if self.simulator:
            return
        buf.gpu_data.free()
        self.cuda.current_context().deallocations.clear()

    def upload(self, array: np.ndarray) -> Any:
        host = np.ascontiguousarray(array).reshape(-1)
        if host.size == 0:
            host = np.zeros(1, host.dtype)
        return self.cuda.to_device(host, stream=self.stream)

    def read_bytes(self, buf: Any, out: np.ndarray, offset: int = 0) -> None:
        if self.simulator:
            out[:] = buf.view(np.uint8)[offset : offset + out.size].copy_to_host(stream=self.stream)
            self.stream.synchronize()
            return
        # Through the driver into a pinned staging buffer: numba's slice-and-copy costs far more Python a
        # call, and a pageable copy is slower; a decode step downloads its logits every token.
        staging = self.staging(out.size)
        check(driver.cuMemcpyDtoHAsync(staging.ctypes.data, device_pointer(buf) + offset, out.size,
                                       self.stream.handle))
        check(driver.cuStreamSynchronize(self.stream.handle))
        out[:] = staging[: out.size]

    def write_bytes(self, buf: Any, offset: int, host: np.ndarray) -> None:
        if self.simulator:
            buf.view(np.uint8)[offset : offset + host.size].copy_to_device(host, stream=self.stream)
        else:  # the driver copies pageable memory into its own staging before it returns, so `host` may go
            ptr = device_pointer(buf) + offset
            check(driver.cuMemcpyHtoDAsync(ptr, host.ctypes.data, host.size, self.stream.handle))

    def alloc_host(self, nbytes: int) -> np.ndarray:
        """Page-locked host memory: copies from it run at the link's speed (pageable ones several times slower)."""
        return np.empty(nbytes, np.uint8) if self.simulator else self.cuda.pinned_array(nbytes, np.uint8)

    def copy_async(self, buf: Any, offset: int, host: np.ndarray) -> Any:
        """`cuMemcpyHtoDAsync` on a second stream, then an event (the simulator: a synchronous copy, no event)."""
        if self.simulator:
            return super().copy_async(buf, offset, host)
        self._check_fits(buf, offset, host.nbytes, "copy")
        if self._copy_stream is None:
            self._copy_stream = self.cuda.stream()
        check(driver.cuMemcpyHtoDAsync(device_pointer(buf) + offset, host.ctypes.data, host.nbytes,
                                       self._copy_stream.handle))
        return DeviceEvent(self._copy_stream.handle)

    def wait_for(self, event: Any) -> None:
        if event is not None:
            check(driver.cuStreamWaitEvent(self.stream.handle, event.handle, 0))

    # --- launches -------------------------------------------------------------------------------------

    def prepare(self, ck: CompiledKernel, args: Sequence[Any], grid: Sequence[int]) -> Any:
        if not self.fast:
            return super().prepare(ck, args, grid)
        values: list = []
        for p, a in zip(ck.kernel.params, args):
            if isinstance(p, Buf):
                # numba-cuda's flattened array: meminfo, parent, nitems, itemsize, data, shape[0], strides[0].
                n, size = int(a.size), int(a.dtype.itemsize)
                values += [ctypes.c_int64(v) for v in (0, 0, n, size)]
                values += [ctypes.c_uint64(device_pointer(a)), ctypes.c_int64(n), ctypes.c_int64(size)]
            else:
                values.append(scalar_value(p, a))
        return PackedLaunch(ck.cufunc, grid, ck.kernel.lanes, values)

    def launch_prepared(self, h: Any) -> None:  # on the runtime's stream, which captures it while a capture is open
        if not self.fast:
            super().launch_prepared(h)
        elif not h.empty:
            cuda_driver.launch(h, self.stream.handle)

    def launch(self, ck: CompiledKernel, args: Sequence[Any], grid: Sequence[int]) -> None:
        if self.fast:
            self.launch_prepared(self.prepare(ck, args, grid))
        elif min(grid) > 0:  # numba's dispatcher
            ck.handle[tuple(grid), ck.kernel.lanes, self.stream](*args)

    # --- graphs ---------------------------------------------------------------------------------------

    def begin_capture(self) -> None:
        super().begin_capture()  # marks the open capture; driver launches are captured by the stream
        if self.fast:
            mode = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
            check(driver.cuStreamBeginCapture(self.stream.handle, mode))

    def end_capture(self) -> Any:
        launches = super().end_capture()
        if not self.fast:
            return launches
        return Graph(check(driver.cuStreamEndCapture(self.stream.handle))[0])

    def replay(self, graph: Any) -> None:
        if self.fast:
            check(driver.cuGraphLaunch(graph.exe, self.stream.handle))
        else:
            super().replay(graph)

    # --- device ---------------------------------------------------------------------------------------

    def sync(self) -> None:
        self.stream.synchronize()  # numba's stream: cuStreamSynchronize on a GPU, the simulator's own otherwise

    def mark(self) -> DeviceEvent | None:
        """A device event after the work queued so far (None in the simulator, which has no clock)."""
        return None if self.simulator else DeviceEvent(self.stream.handle)

    def memory_info(self) -> tuple[int, int] | None:
        return None if self.simulator else cuda_driver.memory_info()

    def kernel_resources(self, ck: CompiledKernel) -> dict[str, int]:
        return {} if ck.cufunc is None else cuda_driver.function_resources(ck.cufunc, ck.kernel.lanes)

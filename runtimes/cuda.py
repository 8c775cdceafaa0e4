"""CUDA runtime: kernels rendered to numba-cuda source, compiled to PTX by numba-cuda and NVVM, launched through the
driver. Buffers are 1-D numba device arrays holding the IR storage dtypes. A kernel's cache entry is its PTX for the
GPU's architecture (`sm_XY`), which the driver loads (compiling it for the device, with its own cache of the
result). The PTX needs no GPU to make: with `arch` and no GPU the runtime is compile-only (`polystrata compile
--target cuda --arch sm_90`), and the artifact it writes spares a GPU machine NVVM's work, the slow part of a cold
start. Launches bypass numba's dispatcher (tens of µs of Python per launch, docs/benchmarks.md): the kernel's
CUfunction is called with `cuLaunchKernel`, with arguments flattened the way numba-cuda does it (an array is 7
words: meminfo, parent, nitems, itemsize, data, shape[0], strides[0]) and packed once per `prepare`. `begin_capture`
/ `end_capture` record those launches into a CUDA graph that `replay` re-runs with one driver call; the graph holds
the arguments as they were at capture (buffer pointers and scalar values), so new inputs go into the same buffers.
On sm_90 and later the launches captured into a graph are programmatic (`cuda_driver.launch_programmatic`: each
kernel's PTX first waits for the kernel before it, which may then hand over early), saving part of the gap between
the short kernels of a decode step. With `NUMBA_ENABLE_CUDASIM=1` (set before numba.cuda is imported) everything
runs in numba-cuda's simulator: kernels are the rendered source's dispatchers (`Runtime._compile_python`), launches
go through them, reductions take the shared-memory tree, and a graph is the base class's list of recorded launches.
"""

from __future__ import annotations

import ctypes
import os
import re
import types
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from polystrata.codegen.cuda import render
from polystrata.codegen.policy import device_policy, matrix_kinds, matrix_unit
from polystrata.codegen.pyfamily import NUMPY_DTYPES
from polystrata.errors import PolystrataError
from polystrata.ir.kernel import Buf, Kernel
from polystrata.runtimes import cuda_driver, numba_ssa
from polystrata.runtimes.base import (
    CompiledKernel,
    PackedLaunch,
    Runtime,
    cache_key,
    log_head,
    numba_signature,
    scalar_value,
)
from polystrata.runtimes.cuda_driver import DeviceEvent, Graph, check, device_pointer, driver


class CUDARuntime(Runtime):
    """One NVIDIA GPU (the current numba-cuda device) with one stream, compile-only for an `sm_XY` architecture
    where there is none, or numba-cuda's simulator."""

    name = "cuda"
    # 4 warps per group; NVVM merges loads with the alignment the generated loads declare; dp4a.
    policy = device_policy(lanes=128, subgroup=32, wide_loads=True, int8_dot=True)
    source_ext = "py"
    graphs = True
    takes_arch = True

    @classmethod
    def present(cls) -> bool:
        """A GPU that numba-cuda can use (never the simulator: it is for tests)."""
        from numba import config, cuda

        return not config.ENABLE_CUDASIM and cuda.is_available()

    def __init__(self, shuffles: bool | None = None, arch: str | None = None, compile_only: bool = False) -> None:
        """`shuffles`: warp shuffles for Reduce (default: on a GPU yes, in the simulator no, it has none). `arch`:
        the `sm_XY` to compile for (default: the GPU's); with it, no GPU (or `compile_only`) makes a runtime that
        compiles but holds no buffers and launches nothing."""
        super().__init__()
        try:
            import numba_cuda
            from numba import config, cuda
        except ImportError as e:  # pragma: no cover - optional dependency
            raise PolystrataError(f"no CUDA GPU found: numba-cuda is not installed ({e})") from None
        self.cuda = cuda
        self.simulator = bool(config.ENABLE_CUDASIM)
        self.compiler = f"numba-cuda {numba_cuda.__version__}"
        if arch is not None and not re.fullmatch(r"sm_\d{2,3}", arch):
            raise PolystrataError(f"unknown CUDA architecture '{arch}': name one as sm_XY, e.g. sm_90")
        self.arch = arch
        if self.simulator:
            self.device = "numba-cuda simulator"
        else:
            numba_ssa.linear_lowering_scan()
            numba_ssa.install()  # numba-cuda's SSA pass, linear in a kernel's length
            self.compile_only = compile_only or (arch is not None and cuda_driver.gpu_count() == 0)
            if self.compile_only and arch is None:
                raise PolystrataError("no CUDA GPU to compile for: give an architecture (--arch sm_90)")
            if self.compile_only:
                self.device = f"{arch} (compile only)"
            else:
                try:
                    cuda.current_context()  # initialises the driver and the primary context
                    name, found = cuda_driver.device_name_arch(check(driver.cuCtxGetDevice())[0])
                except Exception as e:  # CudaSupportError, missing libcuda or cuda-bindings, no device, ...
                    raise PolystrataError(f"no CUDA GPU found: {e}") from None
                self.arch = arch or found
                self.device = f"{name} ({found})"
                # Kernels for another architecture: compiled for it, never loaded on this GPU.
                self.compile_only = self.arch != found
            unit = matrix_unit(self.arch)  # mma.sync: sm_80+
            self.policy = replace(self.policy, matrix_kinds=matrix_kinds(unit))
        self.shuffles = (not self.simulator) if shuffles is None else shuffles
        self.fast = not self.simulator  # driver launches (the simulator's go through numba's dispatcher)
        # Programmatic launches (`cuda_driver.launch_programmatic`) into graphs on sm_90 and later (decode 3 % faster
        # on an H100, docs/benchmarks.md); POLYSTRATA_NO_PDL=1: off.
        self.programmatic = (self.fast and not self.compile_only and int(self.arch[3:]) >= 90
                             and not os.environ.get("POLYSTRATA_NO_PDL"))
        self._waiting: set[int] = set()  # the CUfunctions loaded with `cuda_driver.with_grid_dependency`
        self.stream = None if self.compile_only else cuda.stream()  # a real stream: the legacy one can't be captured
        self._copy_stream = None  # the second stream of `copy_async`, made at its first call

    def compiler_version(self) -> str:
        """numba-cuda's version and the CUDA version of the driver (a new driver may schedule kernels anew)."""
        if self.simulator or self.compile_only:
            return self.compiler
        return f"{self.compiler}, CUDA driver {check(driver.cuDriverGetVersion())[0]}"

    def no_device(self) -> str:
        """The error of a compile-only runtime asked for buffers or launches."""
        return f"no CUDA GPU: the cuda target can compile (polystrata compile --target cuda --arch {self.arch}) " \
               "but not run here"

    # --- compilation ----------------------------------------------------------------------------------

    def compile_workers(self) -> int:
        return 1 if self.simulator else super().compile_workers()  # the simulator compiles nothing

    def render(self, kernel: Kernel, shuffles: bool | None = None) -> str:
        return render(kernel, self.shuffles if shuffles is None else shuffles, native=not self.simulator,
                      mma=self.matrix_units)

    def compile(self, kernel: Kernel, shuffles: bool | None = None) -> CompiledKernel:
        """The kernel's PTX from the cache, else from numba-cuda and NVVM (`_ptx`); loaded on a GPU, where
        `cufunc` is its CUfunction (compile-only: None, and the handle is the PTX). The simulator's kernels are the
        source's dispatchers."""
        source = self.render(kernel, shuffles)
        if self.simulator:
            ck = self._compile_python(kernel, source, cache_key(source, self.name, self.device, self.compiler), None)
            ck.cufunc = None
            return ck

        def load(ptx: bytes) -> Any:  # compile-only: the PTX itself (a handle is never None)
            if self.compile_only:
                return ptx
            entry = re.search(rb"\.entry\s+([\w$]+)\s*\(", ptx)
            if entry is None:
                raise PolystrataError(f"the PTX of kernel {kernel.name} has no entry")
            self.cuda.current_context()  # the module loads into the calling thread's context: numba's, made current
            waiting = cuda_driver.with_grid_dependency(ptx) if self.programmatic else None
            try:
                fn = cuda_driver.load_function((waiting or ptx) + b"\0", entry.group(1).decode())  # PTX ends in a NUL
            except PolystrataError as e:  # e.g. PTX of a newer CUDA than this driver's
                raise PolystrataError(f"the CUDA driver refused the PTX of kernel {kernel.name}: {e}") from None
            if waiting is not None:
                self._waiting.add(int(fn))
            return fn

        def build() -> tuple[bytes, Any]:
            ptx = self._ptx(kernel, source)
            return ptx, load(ptx)

        ck = self._compile_code(kernel, source, cache_key(source, self.name, self.arch, self.compiler), "ptx", load,
                                build)
        ck.cufunc = None if self.compile_only else ck.handle
        return ck

    def _ptx(self, kernel: Kernel, source: str) -> bytes:
        """numba-cuda's PTX of the rendered `source` for `self.arch`: its kernel as its dispatcher would compile it,
        which needs no GPU."""
        module = types.ModuleType(f"polystrata_cuda_{kernel.name}")
        digits = self.arch.removeprefix("sm_")
        from numba.cuda.core import config

        # The kernels allocate nothing: numba's runtime (NUMBA_CUDA_ENABLE_NRT) would be symbols PTX alone lacks.
        nrt, config.CUDA_ENABLE_NRT = getattr(config, "CUDA_ENABLE_NRT", False), False
        try:
            exec(compile(source, f"<cuda kernel {kernel.name}>", "exec"), module.__dict__)
            ptx, _ = self.cuda.compile_ptx(getattr(module, kernel.name).py_func, numba_signature(kernel),
                                           cc=(int(digits[:-1]), int(digits[-1])))
        except Exception as e:  # Numba's typing and lowering errors, NVVM's, whatever their class
            raise PolystrataError(f"cuda build of kernel {kernel.name} failed for {self.arch}:\n"
                                  f"{log_head(str(e))}") from None
        finally:
            config.CUDA_ENABLE_NRT = nrt
        return ptx.encode()

    # --- buffers --------------------------------------------------------------------------------------

    def _need_gpu(self) -> None:
        if self.compile_only:
            raise PolystrataError(self.no_device())

    def alloc(self, shape: Sequence[int], dtype: str) -> Any:
        self._need_gpu()
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
        self._need_gpu()
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
        """Page-locked host memory: copies from it run at the link's speed (pageable ones several times slower).
        Mapped into the device's address space too (`device_view`)."""
        self._need_gpu()
        if self.simulator:
            return np.empty(nbytes, np.uint8)
        buffer = self.cuda.current_context().memhostalloc(max(nbytes, 1), mapped=True)
        return np.ndarray(shape=(nbytes,), dtype=np.uint8, buffer=buffer)

    def device_view(self, host: np.ndarray, dtype: str) -> Any:
        """Pinned host memory read in place by the kernels, at the device address the driver maps it to (none in
        the simulator)."""
        if self.simulator or self.compile_only:
            return None
        ptr = cuda_driver.host_device_pointer(host)
        return None if ptr is None else cuda_driver.HostView(host, ptr, np.dtype(NUMPY_DTYPES[dtype]))

    def copy_async(self, buf: Any, offset: int, host: np.ndarray) -> Any:
        """`cuMemcpyHtoDAsync` on a second stream, then an event (the simulator: a synchronous copy, no event)."""
        self._need_gpu()
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
        self._need_gpu()
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
        packed = PackedLaunch(ck.cufunc, grid, ck.kernel.lanes, values)
        # Only a kernel that waits for the one before it may start early.
        packed.programmatic = int(ck.cufunc) in self._waiting
        return packed

    def launch_prepared(self, h: Any) -> None:  # on the runtime's stream, which captures it while a capture is open
        if not self.fast:
            super().launch_prepared(h)
        elif not h.empty:
            # Programmatic only into a graph (one-token steps): prompt chunks, launched directly, ran 10 % slower.
            programmatic = h.programmatic and self._recording is not None
            (cuda_driver.launch_programmatic if programmatic else cuda_driver.launch)(h, self.stream.handle)

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
        if self.stream is not None:  # none in compile-only mode
            self.stream.synchronize()  # numba's stream: cuStreamSynchronize on a GPU, the simulator's own otherwise

    def mark(self) -> DeviceEvent | None:
        """A device event after the work queued so far (None in the simulator, which has no clock)."""
        return None if self.simulator or self.compile_only else DeviceEvent(self.stream.handle)

    def memory_info(self) -> tuple[int, int] | None:
        return None if self.simulator or self.compile_only else cuda_driver.memory_info()

    def kernel_resources(self, ck: CompiledKernel) -> dict[str, int]:
        return {} if ck.cufunc is None else cuda_driver.function_resources(ck.cufunc, ck.kernel.lanes)

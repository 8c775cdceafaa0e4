"""CUDA runtime: kernels rendered to numba-cuda source, compiled by numba-cuda, launched through the driver.

Buffers are 1-D numba device arrays holding the IR storage dtypes. `compile` writes the source into the kernel
cache and imports it from there (numba-cuda keeps its cubins beside it in `__pycache__`), then compiles eagerly
for the kernel's signature. Launches bypass numba's dispatcher (about 30-125 µs of Python per launch): the
kernel's CUfunction is called with `cuLaunchKernel`, with arguments flattened the way numba-cuda does it (an
array is 7 words: meminfo, parent, nitems, itemsize, data, shape[0], strides[0]) and packed once per `prepare`.

CUDA graphs: `begin_capture()`, then launches (`launch` / `launch_prepared`), then `end_capture()` returns a
graph that `replay(graph)` re-runs with one driver call. The graph holds the arguments as they were at capture
(buffer pointers and scalar values): capture once per set of bindings, write new inputs into the same buffers.
With `NUMBA_ENABLE_CUDASIM=1` (set before numba.cuda is imported) everything runs in numba-cuda's simulator:
launches go through the dispatcher, the shared-memory Reduce is used, and a graph is a recorded launch list.
"""

from __future__ import annotations

import ctypes
import importlib.util
import sys
import weakref
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from polystrata.codegen.cuda import render
from polystrata.codegen.pyfamily import NUMPY_DTYPES
from polystrata.errors import PolystrataError
from polystrata.ir.kernel import Buf, Kernel
from polystrata.paths import atomic_write
from polystrata.runtimes.base import CompiledKernel, Runtime, cache_key


def _check(result) -> tuple:
    """The values of a cuda.bindings call, raising on a CUresult other than success."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err:
        raise PolystrataError(f"CUDA driver error {err!r}")
    return tuple(rest)


class Prepared:
    """A launch with its arguments packed: what `launch_prepared` re-runs without touching the arguments."""

    def __init__(self, fn: Any, grid: tuple[int, int, int], lanes: int, values: list, call: Any = None):
        self.fn, self.grid, self.lanes, self.call = fn, grid, lanes, call
        self.values = values  # keep the ctypes scalars alive: the pointer array refers to them
        self.ptrs = (ctypes.c_void_p * max(len(values), 1))(*[ctypes.addressof(v) for v in values])
        self.empty = min(grid) <= 0


class CUDAGraph:
    """A captured sequence of launches (`exe` on a GPU; `launches` in the simulator)."""

    def __init__(self, graph: Any = None, exe: Any = None, launches: list | None = None):
        self.graph, self.exe, self.launches = graph, exe, launches
        if exe is not None:
            from cuda.bindings import driver

            weakref.finalize(self, _destroy_graph, driver, graph, exe)


def _destroy_graph(driver, graph, exe) -> None:
    driver.cuGraphExecDestroy(exe)
    driver.cuGraphDestroy(graph)


def _singly_assigned_in_one_pass(lower) -> None:
    """numba-cuda's `Lower._find_singly_assigned_variable` (the variables defined once, in one block, and used
    only there, which lowering keeps in registers rather than stack slots), computed with one count of each
    block's assignments. numba-cuda 0.30 rescans a variable's whole block for each variable, quadratic in the
    block's length; generated kernels are long single blocks (unrolled chunks), and on the Q4_K matvec with two
    rows a group that scan was most of a 51 s compile (17 s with this). Numba fixed the same scan upstream."""
    from numba.cuda import lowering as lw

    blocks = lower.func_ir.blocks
    found: set[str] = set()
    if not lower.func_ir.func_id.is_generator:
        use_defs = lw.compute_use_defs(blocks)
        on_stack = lw.must_use_alloca(blocks)
        defined_in: dict[str, set] = {}
        for label, names in use_defs.defmap.items():
            for var in names:
                defined_in.setdefault(var, set()).add(label)
        live_in = {var for names in use_defs.usemap.values() for var in names}  # read in a block before any write
        counts: dict = {}
        for var, labels in defined_in.items():
            if var in on_stack or var in live_in or len(labels) != 1:
                continue
            (label,) = labels
            if label not in counts:
                counts[label] = Counter(st.target.name for st in blocks[label].find_insts(lw.ir.assign_types))
            if counts[label][var] == 1:
                found.add(var)
    lower._singly_assigned_vars = found
    lower._blk_local_varmap = {}


_numba_cuda_scan = None  # numba-cuda's own scan, once replaced (tests compare the two)


def _linear_lowering_scan() -> None:
    """Put `_singly_assigned_in_one_pass` in place of numba-cuda's scan (once; left alone where numba-cuda's
    lowering has another shape)."""
    global _numba_cuda_scan
    try:
        from numba.cuda import lowering as lw
    except ImportError:  # pragma: no cover - older numba-cuda
        return
    scan = getattr(lw.Lower, "_find_singly_assigned_variable", None)
    if scan is None or scan is _singly_assigned_in_one_pass:
        return
    if all(hasattr(lw, n) for n in ("compute_use_defs", "must_use_alloca", "ir")):
        _numba_cuda_scan = scan
        lw.Lower._find_singly_assigned_variable = _singly_assigned_in_one_pass


class CUDARuntime(Runtime):
    """One NVIDIA GPU (the current numba-cuda device) with one stream, or numba-cuda's simulator."""

    name = "cuda"
    lanes = 128  # 4 warps per group
    subgroup = 32
    wide_loads = True  # NVVM, with the alignment the generated loads declare

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
            self.driver = None
        else:
            _linear_lowering_scan()
            try:
                cuda.current_context()  # initialises the driver and the primary context
                dev = cuda.get_current_device()
                from cuda.bindings import driver
            except Exception as e:  # CudaSupportError, missing libcuda, no device, ...
                raise PolystrataError(f"no CUDA GPU found: {e}") from None
            name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
            cc = ".".join(str(v) for v in dev.compute_capability)
            self.device = f"{name} (sm {cc})"
            self.driver = driver
        self.shuffles = (not self.simulator) if shuffles is None else shuffles
        self.fast = not self.simulator  # driver launches; False: numba's dispatcher (for comparisons)
        self.stream = cuda.stream()  # a real stream: the legacy default stream cannot be captured
        self._recording: list | None = None
        self._pinned: np.ndarray | None = None  # download staging, see `_staging`
        self._copy_stream = None  # the second stream of `copy_async`, made at its first call

    # --- compilation ----------------------------------------------------------------------------------

    def render(self, kernel: Kernel, shuffles: bool | None = None) -> str:
        return render(kernel, self.shuffles if shuffles is None else shuffles, native=not self.simulator)

    def compile(self, kernel: Kernel, shuffles: bool | None = None) -> CompiledKernel:
        source = self.render(kernel, shuffles)
        key = cache_key(source, self.name, self.device, self.compiler)

        def load(path: Path) -> Any:
            name = f"polystrata_cuda_kernel_{key}"
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module  # numba's cache finds the module by name
            spec.loader.exec_module(module)
            disp = getattr(module, kernel.name)
            if not self.simulator:  # compile now (or load from numba-cuda's cache), not at the first launch
                disp.compile(_signature(kernel))
            return disp

        def build(path: Path) -> Any:
            atomic_write(path, source)
            try:  # numba-cuda keeps its cubins in __pycache__ beside the source; the simulator compiles nothing
                return load(path)
            except Exception as e:
                raise PolystrataError(f"CUDA build of kernel {kernel.name} failed on {self.device}:\n{e}") from None

        ck = self._compile_cached(kernel, source, key, f"k_{key}.py", load, build)
        if not hasattr(ck, "cufunc"):  # first use in this process
            ck.cufunc = None if self.simulator else self._cufunc(ck.handle, kernel)
        return ck

    def _cufunc(self, disp: Any, kernel: Kernel) -> Any:
        """The CUfunction of a compiled dispatcher, for launches through the driver."""
        try:  # compile() of a signature already compiled returns its kernel
            handle = disp.compile(_signature(kernel))._codelibrary.get_cufunc().handle  # a CUkernel (cuda.core)
        except Exception as e:
            raise PolystrataError(f"CUDA build of kernel {kernel.name} failed on {self.device}:\n{e}") from None
        try:
            return _check(self.driver.cuKernelGetFunction(handle))[0]
        except (PolystrataError, TypeError):
            return handle  # already a CUfunction (older cuda.core)

    # --- buffers --------------------------------------------------------------------------------------

    def alloc(self, shape: Sequence[int], dtype: str) -> Any:
        n = max(int(np.prod(shape)), 1)  # no empty device arrays: every buffer has a pointer
        if self.simulator:
            return self.cuda.to_device(np.zeros(n, NUMPY_DTYPES[dtype]))
        buf = self.cuda.device_array(n, NUMPY_DTYPES[dtype], stream=self.stream)
        _check(self.driver.cuMemsetD8Async(_ptr(buf), 0, buf.nbytes, self.stream.handle))  # zeros, like the CPU
        return buf

    def free(self, buf: Any) -> None:
        """Release a device buffer now. numba-cuda frees an array's memory only after its last reference goes,
        and then defers it to a batch; the memory manager frees a resized expert cache's old slot buffers before
        it allocates the new ones while the bound launches still refer to them (until they are rebound), so the
        memory is forced free and the batch flushed here. The simulator's arrays are host memory: nothing to do."""
        if self.simulator:
            return
        buf.gpu_data.free()
        self.cuda.current_context().deallocations.clear()

    def upload(self, array: np.ndarray) -> Any:
        host = np.ascontiguousarray(array).reshape(-1)
        if host.size == 0:
            host = np.zeros(1, host.dtype)
        return self.cuda.to_device(host, stream=self.stream)

    def download(self, buf: Any, shape: Sequence[int], dtype: str) -> np.ndarray:
        n = int(np.prod(shape))
        host_dtype = np.dtype(NUMPY_DTYPES[dtype])
        if not n:
            out = np.empty(0, host_dtype)
        elif self.simulator:
            out = buf[:n].copy_to_host(stream=self.stream)
            self.stream.synchronize()
        else:
            # Through the driver into a pinned staging buffer: numba's slice-and-copy costs about 100 µs of Python
            # a call, and a pageable copy is slower; a decode step downloads its logits every token.
            nbytes = n * host_dtype.itemsize
            if nbytes > buf.nbytes:
                raise PolystrataError(f"download of {nbytes} bytes from a {buf.nbytes}-byte CUDA buffer")
            staging = self._staging(nbytes)
            _check(self.driver.cuMemcpyDtoHAsync(staging.ctypes.data, _ptr(buf), nbytes, self.stream.handle))
            _check(self.driver.cuStreamSynchronize(self.stream.handle))
            out = staging[:nbytes].view(host_dtype).copy()
        out = out.view(host_dtype).reshape(tuple(shape))
        return out.view(np.float16).astype(np.float32) if dtype == "f16" else out

    def _staging(self, nbytes: int) -> np.ndarray:
        """A pinned host buffer of at least `nbytes`, kept and grown (doubling) across downloads."""
        if self._pinned is None or self._pinned.nbytes < nbytes:
            size = max(nbytes, 2 * (self._pinned.nbytes if self._pinned is not None else 0), 1 << 16)
            self._pinned = self.cuda.pinned_array(size, np.uint8)
        return self._pinned

    def write(self, buf: Any, array: np.ndarray) -> None:
        host = np.ascontiguousarray(array).reshape(-1)
        if not host.size:
            return
        host = host.view(buf.dtype) if host.dtype.itemsize == buf.dtype.itemsize else host.astype(buf.dtype)
        if host.nbytes > buf.nbytes:
            raise PolystrataError(f"write of {host.nbytes} bytes into a {buf.nbytes}-byte CUDA buffer")
        if self.simulator:
            buf[: host.size].copy_to_device(host, stream=self.stream)
        else:
            # The driver copies pageable memory into its own staging before it returns, so `host` may go.
            _check(self.driver.cuMemcpyHtoDAsync(_ptr(buf), host.ctypes.data, host.nbytes, self.stream.handle))

    def write_region(self, buf: Any, offset: int, array: np.ndarray) -> None:
        host = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        if offset + host.nbytes > buf.nbytes:
            raise PolystrataError(f"write of {host.nbytes} bytes at {offset} into a {buf.nbytes}-byte CUDA buffer")
        if not host.nbytes:
            return
        if self.simulator:
            bytes_view = buf.view(np.uint8) if buf.dtype != np.uint8 else buf
            bytes_view[offset : offset + host.nbytes].copy_to_device(host, stream=self.stream)
        else:
            _check(self.driver.cuMemcpyHtoDAsync(_ptr(buf) + offset, host.ctypes.data, host.nbytes,
                                                 self.stream.handle))

    def alloc_host(self, nbytes: int) -> np.ndarray:
        """Page-locked host memory (`cuda.pinned_array`): host-to-device copies from it run at the link's speed,
        several times faster than from pageable memory (figures in docs/benchmarks.md)."""
        return np.empty(nbytes, np.uint8) if self.simulator else self.cuda.pinned_array(nbytes, np.uint8)

    def copy_async(self, buf: Any, offset: int, host: np.ndarray) -> Any:
        """`cuMemcpyHtoDAsync` on a second stream, with an event recorded after it (the simulator: a synchronous
        copy, no event)."""
        if self.simulator:
            self.write_region(buf, offset, host)
            return None
        if offset + host.nbytes > buf.nbytes:
            raise PolystrataError(f"copy of {host.nbytes} bytes at {offset} into a {buf.nbytes}-byte CUDA buffer")
        if self._copy_stream is None:
            self._copy_stream = self.cuda.stream()
        _check(self.driver.cuMemcpyHtoDAsync(_ptr(buf) + offset, host.ctypes.data, host.nbytes,
                                             self._copy_stream.handle))
        return DeviceEvent(self.driver, self._copy_stream.handle)

    def wait_for(self, event: Any) -> None:
        if event is not None:
            _check(self.driver.cuStreamWaitEvent(self.stream.handle, event.handle, 0))

    def wait_host(self, event: Any) -> None:
        if event is not None:
            _check(self.driver.cuEventSynchronize(event.handle))

    # --- launches -------------------------------------------------------------------------------------

    def prepare(self, ck: CompiledKernel, args: Sequence[Any], grid: Sequence[int]) -> Prepared:
        """Pack one launch (kernel, arguments, grid) for `launch_prepared`; the buffers must stay alive."""
        g = tuple(int(v) for v in grid) + (1,) * (3 - len(grid))
        lanes = ck.kernel.lanes
        if not self.fast:
            call = ck.handle[g, lanes, self.stream]  # numba's dispatcher, configured once
            return Prepared(None, g, lanes, [], lambda: call(*args))
        values: list = []
        for p, a in zip(ck.kernel.params, args):
            if isinstance(p, Buf):
                # numba-cuda's flattened array: meminfo, parent, nitems, itemsize, data, shape[0], strides[0].
                n, size = int(a.size), int(a.dtype.itemsize)
                values += [ctypes.c_int64(v) for v in (0, 0, n, size)]
                values += [ctypes.c_uint64(_ptr(a)), ctypes.c_int64(n), ctypes.c_int64(size)]
            elif p.dtype == "f32":
                values.append(ctypes.c_float(float(a)))
            else:
                values.append(ctypes.c_int32(int(a)))
        return Prepared(ck.cufunc, g, lanes, values)

    def launch_prepared(self, h: Prepared) -> None:
        """Run a prepared launch on the runtime's stream (captured instead when a capture is open)."""
        if h.empty:
            return
        if h.call is not None:
            if self._recording is not None:
                self._recording.append(h)
            else:
                h.call()
            return
        gx, gy, gz = h.grid
        err, = self.driver.cuLaunchKernel(h.fn, gx, gy, gz, h.lanes, 1, 1, 0, self.stream.handle,
                                          ctypes.addressof(h.ptrs), 0)
        if err:
            raise PolystrataError(f"CUDA launch failed: {err!r}")

    def launch(self, ck: CompiledKernel, args: Sequence[Any], grid: Sequence[int]) -> None:
        self.launch_prepared(self.prepare(ck, args, grid))

    # --- graphs ---------------------------------------------------------------------------------------

    def begin_capture(self) -> None:
        """Start recording launches on the runtime's stream into a graph (they do not run until `replay`)."""
        if self._recording is not None:
            raise PolystrataError("a CUDA graph capture is already open")
        if self.fast:
            mode = self.driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
            _check(self.driver.cuStreamBeginCapture(self.stream.handle, mode))
            self._recording = []  # marks the open capture; driver launches are captured by the stream
        else:
            self._recording = []

    def end_capture(self) -> CUDAGraph:
        """Close the capture; returns the graph, ready for `replay`."""
        if self._recording is None:
            raise PolystrataError("end_capture without begin_capture")
        launches, self._recording = self._recording, None
        if not self.fast:
            return CUDAGraph(launches=launches)
        graph, = _check(self.driver.cuStreamEndCapture(self.stream.handle))
        exe, = _check(self.driver.cuGraphInstantiate(graph, 0))
        return CUDAGraph(graph, exe)

    def replay(self, graph: CUDAGraph) -> None:
        """Launch a captured graph on the runtime's stream (asynchronous, like a launch)."""
        if graph.launches is not None:
            for h in graph.launches:
                h.call()
        else:
            _check(self.driver.cuGraphLaunch(graph.exe, self.stream.handle))

    # --- device ---------------------------------------------------------------------------------------

    def sync(self) -> None:
        if self.simulator:
            self.stream.synchronize()
        else:
            _check(self.driver.cuStreamSynchronize(self.stream.handle))

    def mark(self) -> DeviceEvent | None:
        """A device event recorded after the work queued so far (None in the simulator, which has no clock)."""
        return None if self.simulator else DeviceEvent(self.driver, self.stream.handle)

    def elapsed(self, start: DeviceEvent | None, end: DeviceEvent | None) -> float | None:
        """Seconds of device time between two marks, once `end` is reached; None in the simulator."""
        return None if start is None or end is None else end.seconds_since(start)

    def memory_info(self) -> tuple[int, int] | None:
        if self.simulator:
            return None
        free, total = _check(self.driver.cuMemGetInfo())
        return int(free), int(total)

    def kernel_resources(self, ck: CompiledKernel) -> dict[str, int]:
        """What a compiled kernel holds per thread and group (registers, local and shared bytes) and how many of
        its groups fit on one multiprocessor: the occupancy facts behind a kernel's bandwidth. Empty in the
        simulator."""
        if self.simulator or ck.cufunc is None:
            return {}
        attr = self.driver.CUfunction_attribute
        out = {name: int(_check(self.driver.cuFuncGetAttribute(a, ck.cufunc))[0]) for name, a in (
            ("regs", attr.CU_FUNC_ATTRIBUTE_NUM_REGS), ("local_bytes", attr.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES),
            ("shared_bytes", attr.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES))}
        out["groups_per_sm"] = int(_check(self.driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(
            ck.cufunc, ck.kernel.lanes, 0))[0])
        return out


class DeviceEvent:
    """A CUDA driver event recorded on a stream when made (timing enabled), destroyed with the object."""

    def __init__(self, driver: Any, stream: Any) -> None:
        self.driver = driver
        self.handle, = _check(driver.cuEventCreate(0))
        _check(driver.cuEventRecord(self.handle, stream))

    def seconds_since(self, start: DeviceEvent) -> float:
        """Device time from `start` to this event; waits until this event is reached."""
        _check(self.driver.cuEventSynchronize(self.handle))
        ms, = _check(self.driver.cuEventElapsedTime(start.handle, self.handle))
        return ms / 1e3

    def __del__(self) -> None:
        self.driver.cuEventDestroy(self.handle)


def _ptr(buf: Any) -> int:
    return int(buf.__cuda_array_interface__["data"][0])


def _signature(kernel: Kernel) -> tuple:
    """numba argument types of a kernel: 1-D C arrays of the storage dtypes, int32 / float32 scalars."""
    import numba

    return tuple(numba.types.Array(numba.from_dtype(np.dtype(NUMPY_DTYPES[p.dtype])), 1, "C") if isinstance(p, Buf)
                 else (numba.types.float32 if p.dtype == "f32" else numba.types.int32) for p in kernel.params)

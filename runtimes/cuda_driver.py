"""The CUDA driver API (`cuda.bindings.driver`) as both NVIDIA paths use it: the cuda target (runtimes/cuda.py)
and the hip target's NVRTC path on NVIDIA GPUs (runtimes/hip_nvrtc.py). Nothing is loaded until a first call."""

from __future__ import annotations

import ctypes
import re
import weakref
from typing import Any

from polystrata.errors import PolystrataError
from polystrata.runtimes.base import PackedLaunch

try:
    from cuda.bindings import driver
except ImportError:  # no cuda-bindings: the hip target on AMD alone, or the cuda target in its simulator
    driver = None


def check(result) -> tuple:
    """The values of a driver call, raising on a CUresult other than success."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err:
        raise PolystrataError(f"CUDA driver error {err!r}")
    return tuple(rest)


def gpu_count() -> int:
    """NVIDIA GPUs that the CUDA driver sees (0 without cuda-bindings, a driver or a device)."""
    try:
        check(driver.cuInit(0))
        return int(check(driver.cuDeviceGetCount())[0])
    except Exception:  # ImportError, the driver library not found, CUDA_ERROR_NO_DEVICE, ...
        return 0


def device_name_arch(dev: Any) -> tuple[str, str]:
    """(name, `sm_XY`) of a CUdevice."""
    attr = driver.CUdevice_attribute
    cc = [check(driver.cuDeviceGetAttribute(getattr(attr, f"CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_{w}"), dev))[0]
          for w in ("MAJOR", "MINOR")]
    name = check(driver.cuDeviceGetName(256, dev))[0].split(b"\0", 1)[0].decode(errors="replace")
    return name, f"sm_{cc[0]}{cc[1]}"


def load_function(code: bytes, name: str) -> Any:
    """Kernel `name` of a cubin or PTX module (PTX: the driver compiles it for the current device), loaded into
    the current context, where it stays."""
    module, = check(driver.cuModuleLoadData(code))
    return check(driver.cuModuleGetFunction(module, name.encode()))[0]


def memory_info() -> tuple[int, int]:
    """(free, total) bytes of the current context's device."""
    free, total = check(driver.cuMemGetInfo())
    return int(free), int(total)


class HostView:
    """Page-locked host memory as the device's kernels address it (`host_device_pointer`), with what a launch
    reads of an array: its element count, dtype and the CUDA array interface. It keeps `host` alive."""

    def __init__(self, host: Any, ptr: int, dtype: Any):
        self.host = host
        self.dtype = dtype
        self.size = host.nbytes // dtype.itemsize
        self.nbytes = host.nbytes
        self.__cuda_array_interface__ = {"shape": (self.size,), "typestr": dtype.str, "data": (ptr, True),
                                         "version": 3, "strides": None}


def host_device_pointer(host: Any) -> int | None:
    """The device address of page-locked host memory (`cuMemHostAlloc`'s: with unified addressing every such
    allocation is mapped into the device's address space), or None where it is not mapped."""
    err, ptr = driver.cuMemHostGetDevicePointer(host.ctypes.data, 0)
    return None if err else int(ptr)


def device_pointer(array: Any) -> int:
    """The device address of an array with the CUDA array interface (numba-cuda's device arrays)."""
    return int(array.__cuda_array_interface__["data"][0])


def launch(p: PackedLaunch, stream: Any) -> None:
    """Queue a packed launch of a CUfunction on `stream` (0: the null stream). The hot path of every launch that
    is not replayed from a graph: no more Python than the driver call."""
    gx, gy, gz = p.grid
    err, = driver.cuLaunchKernel(p.fn, gx, gy, gz, p.lanes, 1, 1, 0, stream, ctypes.addressof(p.ptrs), 0)
    if err:
        raise PolystrataError(f"CUDA launch failed: {err!r}")


def launch_programmatic(p: PackedLaunch, stream: Any) -> None:
    """`launch` with programmatic stream serialization (sm_90+): the launch may start while the one before it on
    the stream still runs, its kernel waiting at `griddepcontrol.wait` (`with_grid_dependency`) until that one has
    finished and its writes are visible. What it saves is the gap between two short kernels, also between the
    nodes of a graph captured from such launches. The launch's configuration is made once and kept on `p`."""
    config = p.config
    if config is None:
        attr = driver.CUlaunchAttribute()
        attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        config = driver.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = p.grid
        config.blockDimX, config.blockDimY, config.blockDimZ = p.lanes, 1, 1
        config.sharedMemBytes, config.hStream = 0, stream
        config.attrs, config.numAttrs = [attr], 1
        p.config = config
    err, = driver.cuLaunchKernelEx(config, p.fn, ctypes.addressof(p.ptrs), 0)
    if err:
        raise PolystrataError(f"CUDA launch failed: {err!r}")


# The PTX ISA that has griddepcontrol (7.8, with sm_90).
_GRID_DEPENDENCY_ISA = (7, 8)


def with_grid_dependency(ptx: bytes) -> bytes | None:
    """The PTX with `griddepcontrol.wait` and then `griddepcontrol.launch_dependents` before the entry's first
    instruction, or None where its ISA or target lacks them (before PTX 7.8 or sm_90). The wait keeps every kernel
    from reading or writing anything before the kernel it follows has finished, so launching it early
    (`launch_programmatic`) changes no result; the trigger after it lets the next launch start while this kernel
    runs (without it, the next one could start only as this one's groups exit)."""
    version = re.search(rb"^\s*\.version\s+(\d+)\.(\d+)", ptx, re.M)
    target = re.search(rb"^\s*\.target\s+sm_(\d+)", ptx, re.M)
    if not version or not target or (int(version[1]), int(version[2])) < _GRID_DEPENDENCY_ISA \
            or int(target[1]) < 90:
        return None
    entry = re.search(rb"\.entry\s+[\w$]+\s*\([^)]*\)\s*\{[^\n]*\n", ptx)
    if not entry:
        return None
    # The body opens with declarations (.reg, .local, .shared, ...): the first line after them is an instruction.
    pos = entry.end()
    for line in ptx[pos:].splitlines(keepends=True):
        text = line.strip()
        if text and not text.startswith((b".", b"//")):
            break
        pos += len(line)
    return ptx[:pos] + b"\tgriddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;\n" + ptx[pos:]


def function_resources(fn: Any, lanes: int) -> dict[str, int]:
    """What a CUfunction holds per thread and group (registers, local and shared bytes) and how many of its groups
    of `lanes` threads fit on one multiprocessor: the occupancy facts behind a kernel's bandwidth."""
    attr = driver.CUfunction_attribute
    out = {name: int(check(driver.cuFuncGetAttribute(a, fn))[0]) for name, a in (
        ("regs", attr.CU_FUNC_ATTRIBUTE_NUM_REGS), ("local_bytes", attr.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES),
        ("shared_bytes", attr.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES))}
    out["groups_per_sm"] = int(check(driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(fn, lanes, 0))[0])
    return out


class Graph:
    """An instantiated CUDA graph of a finished stream capture, destroyed with the object."""

    def __init__(self, graph: Any):
        self.graph, self.exe = graph, check(driver.cuGraphInstantiate(graph, 0))[0]
        weakref.finalize(self, _destroy_graph, graph, self.exe)


def _destroy_graph(graph: Any, exe: Any) -> None:
    driver.cuGraphExecDestroy(exe)
    driver.cuGraphDestroy(graph)


class DeviceEvent:
    """A driver event recorded on a stream when made (timing enabled), destroyed with the object: what `mark`
    returns, and what `copy_async` hands to `wait_for` / `wait_host`."""

    def __init__(self, stream: Any) -> None:
        self.handle, = check(driver.cuEventCreate(0))
        self._destroy = driver.cuEventDestroy  # held: at interpreter exit the module's globals may be gone first
        check(driver.cuEventRecord(self.handle, stream))

    def wait(self) -> None:
        """Block the host until the event is reached."""
        check(driver.cuEventSynchronize(self.handle))

    def seconds_since(self, start: DeviceEvent) -> float:
        """Device time from `start` to this event; waits until this event is reached."""
        self.wait()
        ms, = check(driver.cuEventElapsedTime(start.handle, self.handle))
        return ms / 1e3

    def __del__(self) -> None:
        self._destroy(self.handle)

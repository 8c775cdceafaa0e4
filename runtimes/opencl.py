"""OpenCL runtime: kernels rendered to OpenCL C, built by the driver, cached as program binaries.

Works with any ICD: GPU drivers, PoCL on the CPU (CI), Oclgrind (the checking simulator). Buffers are
`pyopencl.Buffer`s holding the IR storage dtypes (f16 as 2 bytes, u8 as bytes, ...).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from polystrata.codegen.opencl import render
from polystrata.codegen.policy import device_policy
from polystrata.errors import PolystrataError
from polystrata.ir.kernel import DTYPE_BYTES, Kernel
from polystrata.runtimes.base import CompiledKernel, Runtime, cache_key, log_head

try:
    import pyopencl as cl
except ImportError:  # pragma: no cover - optional dependency
    cl = None

_NO_DEVICE = "no OpenCL device found; install an ICD such as pocl-opencl-icd"


def _devices() -> list:
    if cl is None:
        raise PolystrataError(_NO_DEVICE + " (and the pyopencl package)")
    try:
        platforms = cl.get_platforms()
    except cl.Error:  # the ICD loader reports "no platform" as an error
        platforms = []
    out = []
    for p in platforms:
        try:
            out.extend(p.get_devices())
        except cl.Error:
            continue
    return out


def pick_device(want: str | None = None):
    """An OpenCL device: the first whose platform/device name contains `want` (or $POLYSTRATA_OPENCL_DEVICE),
    else the first GPU, else the first device."""
    devices = _devices()
    if not devices:
        raise PolystrataError(_NO_DEVICE)
    want = want or os.environ.get("POLYSTRATA_OPENCL_DEVICE")
    if want:
        hits = [d for d in devices if want.lower() in f"{d.platform.name} {d.name}".lower()]
        if not hits:
            names = ", ".join(d.name for d in devices)
            raise PolystrataError(f"no OpenCL device matches {want!r}; devices: {names}")
        return hits[0]
    gpus = [d for d in devices if d.type & cl.device_type.GPU]
    return (gpus or devices)[0]


def has_gpu() -> bool:
    """Whether an OpenCL GPU is present (what `--target auto` prefers over the CPU)."""
    try:
        return any(d.type & cl.device_type.GPU for d in _devices())
    except PolystrataError:
        return False


def _has_subgroups(dev) -> bool:
    if "cl_khr_subgroups" in dev.extensions:
        return True
    major, minor = (int(v) for v in dev.version.split()[1].split(".")[:2])
    if (major, minor) < (2, 1):  # asking a 1.2 device for a 2.1 property is an API error (Oclgrind flags it)
        return False
    try:  # OpenCL >= 2.1 core (optional again in 3.0: max_num_sub_groups is 0 then)
        return dev.max_num_sub_groups > 0
    except (cl.Error, AttributeError):
        return False


class OpenCLRuntime(Runtime):
    """One OpenCL device with one in-order queue."""

    name = "opencl"
    source_ext = "cl"
    # GPU schedules; no wide loads or int8 dot product assumed (OpenCL C has no portable one). Lanes and subgroup
    # width come from the device (`__init__`).
    policy = device_policy(lanes=64, subgroup=1)

    @classmethod
    def present(cls) -> bool:
        """An OpenCL GPU (a CPU driver such as PoCL is never `auto`'s choice over the cpu target)."""
        return has_gpu()

    def __init__(self, device: Any = None, subgroups: bool | None = None, build_options: Sequence[str] = ()) -> None:
        """`device`: a `pyopencl.Device` or a name substring (default: see `pick_device`). `subgroups=False`
        forces the local-memory combine even where the device has subgroups. `build_options` go to the driver's
        compiler after the standard's (e.g. `-cl-opt-disable` for kernels launched once: faster to build); they are
        part of the kernel cache's key."""
        super().__init__()
        dev = device if cl is not None and isinstance(device, cl.Device) else pick_device(device)
        self.dev = dev
        self.ctx = cl.Context([dev])
        self.queue = cl.CommandQueue(self.ctx)
        self.copy_queue = None  # the second queue of `copy_async`
        self._host_maps: list = []
        self.device = f"{dev.name.strip()} ({dev.platform.name.strip()}, driver {dev.driver_version})"
        gpu = bool(dev.type & cl.device_type.GPU)
        # PoCL's CPU driver runs a group's lanes as a vectorised loop in one thread: small groups are fastest.
        self.policy = self.policy.with_shape(min(64 if gpu else 16, dev.max_work_group_size), 1)
        self.has_subgroups = _has_subgroups(dev) if subgroups is None else subgroups and _has_subgroups(dev)
        self.options = [*self._std_option(), *build_options]
        self.compiler = f"opencl driver {dev.driver_version} {' '.join(self.options)}".strip()
        self.policy = self.policy.with_shape(self.lanes, self._probe_subgroup() if self.has_subgroups else 1)

    def _std_option(self) -> list[str]:
        # sub_group_* built-ins are only declared for OpenCL C 2.0+.
        if not self.has_subgroups:
            return []
        return ["-cl-std=CL3.0" if "3." in self.dev.version.split()[1] else "-cl-std=CL2.0"]

    def _probe_subgroup(self) -> int:
        """Subgroup width for a group of `lanes` work-items (compiles a one-line kernel)."""
        src = "__kernel void probe(__global int* x) { x[get_global_id(0)] = 0; }"
        try:
            k = cl.Program(self.ctx, src).build(self.options).probe
            info = cl.kernel_sub_group_info.MAX_SUB_GROUP_SIZE_FOR_NDRANGE
            return int(k.get_sub_group_info(self.dev, info, (self.lanes,)))
        except (cl.Error, AttributeError):
            self.has_subgroups = False
            return 1

    def render(self, kernel: Kernel, subgroups: bool | None = None) -> str:
        """OpenCL C for `kernel` (the subgroup combine where the device has one of width `kernel.lanes`)."""
        if subgroups is None:
            subgroups = self.has_subgroups and kernel.lanes == self.subgroup
        return render(kernel, subgroups)

    def compile(self, kernel: Kernel, subgroups: bool | None = None) -> CompiledKernel:
        source = self.render(kernel, subgroups)
        options = " ".join(self.options)
        key = cache_key(source, self.name, f"{self.dev.name} {self.dev.driver_version}", f"opencl {options}")

        def load(binary: bytes) -> Any:
            return cl.Kernel(cl.Program(self.ctx, [self.dev], [binary]).build(options), kernel.name)

        def build() -> tuple[bytes, Any]:
            try:
                program = cl.Program(self.ctx, source).build(options)
            except cl.Error as err:
                raise PolystrataError(f"OpenCL build of kernel {kernel.name} failed on {self.device}:\n"
                                      f"{log_head(str(err))}") from None
            return program.binaries[0], cl.Kernel(program, kernel.name)

        return self._compile_code(kernel, source, key, "bin", load, build)

    def alloc(self, shape: Sequence[int], dtype: str) -> Any:
        nbytes = int(np.prod(shape)) * DTYPE_BYTES[dtype]
        buf = cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE, max(nbytes, 4))  # OpenCL has no empty buffers
        cl.enqueue_fill_buffer(self.queue, buf, np.uint8(0), 0, max(nbytes, 4))  # zeros, like the CPU target
        return buf

    def upload(self, array: np.ndarray) -> Any:
        host = np.ascontiguousarray(array).reshape(-1)
        if host.nbytes == 0:
            return self.alloc((1,), "u32")
        return cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR, hostbuf=host)

    def buffer_bytes(self, buf: Any) -> int:
        return int(buf.size)

    def read_bytes(self, buf: Any, out: np.ndarray, offset: int = 0) -> None:
        cl.enqueue_copy(self.queue, out, buf, src_offset=offset, is_blocking=True)

    def write_bytes(self, buf: Any, offset: int, host: np.ndarray) -> None:
        cl.enqueue_copy(self.queue, buf, host, dst_offset=offset, is_blocking=True)

    def free(self, buf: Any) -> None:
        buf.release()

    def alloc_host(self, nbytes: int) -> np.ndarray:
        """Host memory the driver allocates (ALLOC_HOST_PTR: page-locked on GPU drivers), mapped for writing;
        the mapping keeps its buffer alive."""
        buf = cl.Buffer(self.ctx, cl.mem_flags.READ_ONLY | cl.mem_flags.ALLOC_HOST_PTR, max(nbytes, 4))
        host, _ = cl.enqueue_map_buffer(self.queue, buf, cl.map_flags.WRITE, 0, (max(nbytes, 4),), np.uint8,
                                        is_blocking=True)
        self._host_maps.append((buf, host))  # mapped for the runtime's life: staging buffers are made once
        return host[:nbytes]

    def device_view(self, host: np.ndarray, dtype: str) -> Any:
        """On a device sharing the host's memory (PoCL's CPU device, integrated GPUs): a buffer over `host` itself
        (USE_HOST_PTR). Elsewhere None: a discrete GPU's driver would copy it into device memory."""
        try:
            shared = bool(self.dev.host_unified_memory)
        except cl.Error:  # a query OpenCL 3.0 drivers may leave out
            shared = False
        if not shared:
            return None
        return cl.Buffer(self.ctx, cl.mem_flags.READ_ONLY | cl.mem_flags.USE_HOST_PTR, hostbuf=host)

    def copy_async(self, buf: Any, offset: int, host: np.ndarray) -> Any:
        """A non-blocking copy on a second in-order queue (made at the first call); returns its event."""
        if self.copy_queue is None:
            self.copy_queue = cl.CommandQueue(self.ctx)
        ev = cl.enqueue_copy(self.copy_queue, buf, host, dst_offset=offset, is_blocking=False)
        self.copy_queue.flush()  # start it now, not at the next blocking call
        return ev

    def wait_for(self, event: Any) -> None:
        cl.enqueue_barrier(self.queue, wait_for=[event])

    def launch(self, ck: CompiledKernel, args: Sequence[Any], grid: Sequence[int]) -> None:
        grid = [int(g) for g in grid]
        if not grid or min(grid) <= 0:
            return
        lanes = ck.kernel.lanes
        gsize = (grid[0] * lanes, *grid[1:])
        ck.handle(self.queue, gsize, (lanes,) + (1,) * (len(grid) - 1), *args)

    def sync(self) -> None:
        self.queue.finish()

    def memory_info(self) -> tuple[int, int] | None:
        """(free, total): OpenCL does not report free memory (AMD's extension aside), so free is the total."""
        total = int(self.dev.global_mem_size)
        try:
            free = int(self.dev.global_free_memory_amd[0]) * 1024
        except (cl.Error, AttributeError, TypeError, IndexError):
            free = total
        return free, total

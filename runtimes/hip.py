"""HIP runtime: kernels rendered to HIP C++, compiled by hiprtc (ctypes) into AMD code objects, cached on disk.

Without an AMD GPU (`hipGetDeviceCount` fails or finds none) the runtime is compile-only: `compile()` returns
code objects, buffers and launches raise. hiprtc runs in a child process (`base.compile_in_child`) because ROCm
5.2's hiprtc aborts the whole process on architectures it does not know; the parent turns a crash into a
`PolystrataError`. Buffers are device pointers holding the IR storage
dtypes (f16 as 2 bytes, u8 as bytes, ...). NVIDIA GPUs and `sm_XX` archs: runtimes/hip_nvrtc.py (NVRTC).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from polystrata.codegen.hip import MATRIX_ARCHS, base_arch, render, wave_of
from polystrata.codegen.policy import device_policy
from polystrata.errors import PolystrataError
from polystrata.ir.kernel import DTYPE_BYTES, Buf, Kernel
from polystrata.paths import atomic_write
from polystrata.runtimes.base import (
    CompiledKernel,
    DeviceBuffer,
    PackedLaunch,
    Runtime,
    cache_key,
    compile_in_child,
    scalar_value,
)

# Sonames, newest first: ROCm 6 ships hiprtc as its own library, ROCm 5.2 (Debian) inside libamdhip64.
_HIP_LIBS = ("libamdhip64.so.6", "libamdhip64.so.5", "libamdhip64.so")
_RTC_LIBS = ("libhiprtc.so.6", "libhiprtc.so.5", "libhiprtc.so", *_HIP_LIBS)
# What hiprtc of ROCm <= 5.2 compiles (measured); anything else (gfx940+, gfx11) aborts the process there.
KNOWN_ROCM52 = ("gfx803", "gfx900", "gfx902", "gfx906", "gfx908", "gfx909", "gfx90a", "gfx90c", "gfx1010",
                "gfx1011", "gfx1012", "gfx1013", "gfx1030", "gfx1031", "gfx1032", "gfx1033", "gfx1034", "gfx1035",
                "gfx1036")
# Set to 1 to skip the up-front refusal (tests: the subprocess must survive the crash that follows).
FORCE_ENV = "POLYSTRATA_HIP_FORCE_ARCH"
_NO_GPU = "no AMD GPU: the hip target can compile (polystrata compile --target hip --arch {arch}) but not run here"
_LIBS: dict[str, ctypes.CDLL] = {}


def _load(kind: str) -> ctypes.CDLL:
    if kind not in _LIBS:
        for name in _HIP_LIBS if kind == "hip" else _RTC_LIBS:
            with contextlib.suppress(OSError):
                _LIBS[kind] = ctypes.CDLL(name)
                break
        else:
            raise PolystrataError("HIP libraries not found (libamdhip64.so.5); on Debian: "
                                  "apt-get install libamdhip64-5 libhiprtc-builtins5")
    return _LIBS[kind]


def available() -> bool:
    """Whether the HIP runtime library can be loaded (compiling needs nothing more)."""
    try:
        _load("hip")
        return True
    except PolystrataError:
        return False


def rocm_version() -> tuple[int, int, int]:
    """(major, minor, patch) of the loaded HIP runtime (HIP_VERSION = major * 10^7 + minor * 10^5 + patch)."""
    v = ctypes.c_int()
    if _load("hip").hipRuntimeGetVersion(ctypes.byref(v)) != 0:
        return (0, 0, 0)
    return v.value // 10_000_000, v.value // 100_000 % 100, v.value % 100_000


def supported_archs() -> tuple[str, ...] | None:
    """Architectures this ROCm's hiprtc is known to compile for; None where it is newer than 5.2 (no list)."""
    return KNOWN_ROCM52 if rocm_version()[:2] <= (5, 2) else None


def check_arch(arch: str) -> None:
    """Refuse up front an architecture that this ROCm's hiprtc would crash on."""
    try:
        wave_of(arch)
    except ValueError as e:
        raise PolystrataError(str(e)) from None
    known = supported_archs()
    if known is not None and base_arch(arch) not in known and os.environ.get(FORCE_ENV) != "1":
        major, minor, _ = rocm_version()
        raise PolystrataError(f"hiprtc in ROCm {major}.{minor} cannot compile for {arch}; supported here: "
                              f"{', '.join(known)}")


def _check(err: int, what: str) -> None:
    if err != 0:
        lib = _load("hip")
        lib.hipGetErrorString.restype = ctypes.c_char_p
        raise PolystrataError(f"HIP {what} failed: {(lib.hipGetErrorString(err) or b'').decode()} ({err})")


def hiprtc_compile(source: str, name: str, *options: str) -> bytes:
    """Compile in THIS process (the child's side): code object bytes, or PolystrataError with the log."""
    rtc = _load("rtc")
    rtc.hiprtcGetErrorString.restype = ctypes.c_char_p
    prog = ctypes.c_void_p()
    err = rtc.hiprtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.hip".encode(), 0, None, None)
    if err != 0:
        raise PolystrataError(f"hiprtcCreateProgram failed: {rtc.hiprtcGetErrorString(err).decode()}")
    try:
        opts = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
        err = rtc.hiprtcCompileProgram(prog, len(options), opts)
        if err != 0:
            size = ctypes.c_size_t()
            rtc.hiprtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value + 1)
            rtc.hiprtcGetProgramLog(prog, log)
            raise PolystrataError(f"{rtc.hiprtcGetErrorString(err).decode()}\n{log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        rtc.hiprtcGetCodeSize(prog, ctypes.byref(size))
        code = ctypes.create_string_buffer(size.value)
        rtc.hiprtcGetCode(prog, code)
        return code.raw
    finally:
        rtc.hiprtcDestroyProgram(ctypes.byref(prog))


@dataclass
class HIPCode:
    """A compiled kernel: the code object and, on a GPU, its loaded module and function."""

    code: bytes
    module: int | None = None
    function: int | None = None


def _gpu_count() -> int:
    n = ctypes.c_int()
    return n.value if _load("hip").hipGetDeviceCount(ctypes.byref(n)) == 0 else 0


def _device_arch(lib: ctypes.CDLL) -> tuple[str, str]:
    """(gcnArchName, name) of device 0; the struct layout varies across ROCm, so both are searched for."""
    props = ctypes.create_string_buffer(16384)
    _check(lib.hipGetDeviceProperties(props, 0), "hipGetDeviceProperties")
    name = props.raw[:256].split(b"\0", 1)[0].decode(errors="replace")
    i = props.raw.find(b"gfx", 256)
    return (props.raw[i:].split(b"\0", 1)[0].decode() if i >= 0 else ""), name


class HIPRuntime(Runtime):
    """One AMD GPU, or compile-only for `arch` when there is none (or with `compile_only=True`)."""

    name = "hip"
    source_ext = "hip"
    # GPU schedules, a group of one wave (`__init__`: the arch's width); no load merging assumed; sdot4 / dp4a.
    policy = device_policy(lanes=64, subgroup=64, int8_dot=True)
    takes_arch = True
    no_gpu = _NO_GPU  # the error of a compile-only runtime asked to run

    @classmethod
    def present(cls) -> bool:
        return available() and _gpu_count() > 0

    def __new__(cls, arch: str | None = None, compile_only: bool = False, native_f16: bool = True):
        """An `sm_XX` arch, or no arch on an NVIDIA GPU and no AMD one: `hip_nvrtc.NVRTCRuntime`."""
        from polystrata.runtimes import hip_nvrtc

        return super().__new__(hip_nvrtc.NVRTCRuntime if hip_nvrtc.wanted(cls, arch, compile_only) else cls)

    def __init__(self, arch: str | None = None, compile_only: bool = False, native_f16: bool = True) -> None:
        """`arch`: the gfx target (the GPU's by default); `native_f16=False`: f16 by the portable bit conversions."""
        super().__init__()
        self.native_f16 = native_f16
        self.compile_only = compile_only or self._gpu_count() == 0
        found, dev_name = self._open() if self.gpu else (None, "")
        if not (arch or found):
            raise PolystrataError(self.no_gpu.format(arch=self.example_arch) + "; give an arch to compile for")
        self.arch = arch or found
        self._configure(found, dev_name)  # refuses an unknown arch
        wave = wave_of(self.arch)  # 64 on wave64 (CDNA, GCN), 32 on wave32 (RDNA and CUDA)
        self.policy = replace(self.policy.with_shape(wave, wave), matrix_units=base_arch(self.arch) in MATRIX_ARCHS)

    example_arch = "gfx1030"  # for the message of a compile-only runtime without an arch

    @property
    def gpu(self) -> bool:
        """A GPU runs this runtime's kernels (not compile-only)."""
        return not self.compile_only

    def _gpu_count(self) -> int:
        return _gpu_count()

    def _open(self) -> tuple[str, str]:
        """Make device 0 current: (its arch, its name)."""
        self.lib = _load("hip")
        self.lib.hipFree.argtypes = [ctypes.c_void_p]  # the buffers' finaliser
        _check(self.lib.hipSetDevice(0), "hipSetDevice")
        return _device_arch(self.lib)

    def _configure(self, found: str | None, dev_name: str) -> None:
        """The device description and the compiler's options for `self.arch`."""
        check_arch(self.arch)
        ver = ".".join(map(str, rocm_version()))
        self.device = f"{dev_name} ({found}, ROCm {ver})" if found else f"{self.arch} (compile only, ROCm {ver})"
        self.options = [f"--offload-arch={self.arch}", "-O3", "-ffp-contract=off"]
        self.compiler = f"rocm {ver} {' '.join(self.options)}"

    def render(self, kernel: Kernel) -> str:
        """HIP C++ for `kernel` on this runtime's architecture."""
        return render(kernel, self.arch, self.subgroup, self.native_f16)

    def compile(self, kernel: Kernel) -> CompiledKernel:
        """Code object of `kernel` from the cache, else from the compiler (`_build`); loaded on a GPU."""
        source = self.render(kernel)
        key = cache_key(source, self.name, self.arch, self.compiler)

        def load(path: Path) -> HIPCode:
            code = path.read_bytes()
            return HIPCode(code, *(self._load_module(code, kernel.name) if self.gpu else ()))

        def build(path: Path) -> HIPCode:
            atomic_write(path, self._build(source, kernel.name))
            return load(path)

        return self._compile_cached(kernel, source, key, f"{kernel.name}_{key}.co", load, build)

    def _build(self, source: str, name: str) -> bytes:
        return compile_in_child(f"{__name__}:hiprtc_compile", source, [name, *self.options], "hiprtc", name, self.arch)

    def _load_module(self, code: bytes, name: str) -> tuple[Any, Any]:
        module, fn = ctypes.c_void_p(), ctypes.c_void_p()
        _check(self.lib.hipModuleLoadData(ctypes.byref(module), code), "hipModuleLoadData")
        _check(self.lib.hipModuleGetFunction(ctypes.byref(fn), module, name.encode()), "hipModuleGetFunction")
        return module.value, fn.value

    def _need_gpu(self) -> None:
        if not self.gpu:
            raise PolystrataError(self.no_gpu.format(arch=self.arch))

    def alloc(self, shape: Sequence[int], dtype: str) -> DeviceBuffer:
        self._need_gpu()
        return self._malloc(max(int(np.prod(shape)) * DTYPE_BYTES[dtype], 4))

    def _malloc(self, nbytes: int) -> DeviceBuffer:  # zeroed, like the CPU target's buffers
        ptr = ctypes.c_void_p()
        _check(self.lib.hipMalloc(ctypes.byref(ptr), ctypes.c_size_t(nbytes)), "hipMalloc")
        buf = DeviceBuffer(ptr.value, nbytes, self.lib.hipFree)
        _check(self.lib.hipMemset(ctypes.c_void_p(buf.ptr), 0, ctypes.c_size_t(nbytes)), "hipMemset")
        return buf

    def _copy(self, to_device: bool, dev: int, host: int, nbytes: int) -> None:
        what, dst, src = ("hipMemcpyHtoD", dev, host) if to_device else ("hipMemcpyDtoH", host, dev)
        _check(getattr(self.lib, what)(ctypes.c_void_p(dst), ctypes.c_void_p(src), ctypes.c_size_t(nbytes)), what)

    def read_bytes(self, buf: DeviceBuffer, out: np.ndarray) -> None:
        self._copy(False, buf.ptr, out.ctypes.data, out.size)

    def write_bytes(self, buf: DeviceBuffer, offset: int, host: np.ndarray) -> None:
        """A synchronous copy (the base class's `copy_async` uses it too: no second stream or pinned staging here
        yet, so expert uploads do not overlap with kernels on this target)."""
        self._copy(True, buf.ptr + offset, host.ctypes.data, host.size)

    def prepare(self, ck: CompiledKernel, args: Sequence[Any], grid: Sequence[int]) -> PackedLaunch:
        self._need_gpu()
        values = [ctypes.c_void_p(a.ptr) if isinstance(p, Buf) else scalar_value(p, a)
                  for p, a in zip(ck.kernel.params, args)]
        return PackedLaunch(ck.handle.function, grid, ck.kernel.lanes, values)

    def launch_prepared(self, p: PackedLaunch) -> None:
        if self._recording is not None:
            super().launch_prepared(p)
        elif not p.empty:
            self._launch(p)

    def launch(self, ck: CompiledKernel, args: Sequence[Any], grid: Sequence[int]) -> None:
        self.launch_prepared(self.prepare(ck, args, grid))

    def _launch(self, p: PackedLaunch) -> None:
        _check(self.lib.hipModuleLaunchKernel(
            ctypes.c_void_p(p.fn), *(ctypes.c_uint(g) for g in p.grid), ctypes.c_uint(p.lanes), ctypes.c_uint(1),
            ctypes.c_uint(1), ctypes.c_uint(0), None, p.ptrs, None), "hipModuleLaunchKernel")

    def sync(self) -> None:  # the null stream
        if self.gpu:
            _check(self.lib.hipDeviceSynchronize(), "hipDeviceSynchronize")

    def memory_info(self) -> tuple[int, int] | None:  # None in compile-only mode
        if not self.gpu:
            return None
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        _check(self.lib.hipMemGetInfo(ctypes.byref(free), ctypes.byref(total)), "hipMemGetInfo")
        return free.value, total.value

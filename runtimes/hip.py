"""HIP runtime: kernels rendered to HIP C++, compiled by hiprtc (ctypes) into AMD code objects, cached on disk.

Without an AMD GPU the runtime is compile-only (buffers and launches raise). hiprtc runs in a child process
(`base.compile_in_child`): ROCm 5.2's hiprtc aborts the whole process on architectures it does not know, and the
parent turns that into a `PolystrataError`. NVIDIA GPUs and `sm_XX` archs: runtimes/hip_nvrtc.py (NVRTC, whose C
API hiprtc copies: `rtc_compile` serves both)."""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, NamedTuple

from polystrata.codegen.hip import render, wave_of
from polystrata.codegen.policy import MATRIX_ARCHS, base_arch, device_policy, matrix_kinds
from polystrata.errors import PolystrataError
from polystrata.ir.kernel import Kernel
from polystrata.runtimes import base

# Sonames, newest first: ROCm 6 ships hiprtc as its own library, ROCm 5.2 (Debian) inside libamdhip64.
_HIP_LIBS = ("libamdhip64.so.6", "libamdhip64.so.5", "libamdhip64.so")
_RTC_LIBS = ("libhiprtc.so.6", "libhiprtc.so.5", "libhiprtc.so", *_HIP_LIBS)
_NO_HIP = "HIP libraries not found (libamdhip64.so.5); on Debian: apt-get install libamdhip64-5 libhiprtc-builtins5"
# What hiprtc of ROCm <= 5.2 compiles (measured); anything else (gfx940+, gfx11) aborts the process there.
KNOWN_ROCM52 = tuple("gfx803 gfx900 gfx902 gfx906 gfx908 gfx909 gfx90a gfx90c gfx1010 gfx1011 gfx1012 gfx1013 "
                     "gfx1030 gfx1031 gfx1032 gfx1033 gfx1034 gfx1035 gfx1036".split())
# Set to 1 to skip the up-front refusal (tests: the subprocess must survive the crash that follows).
FORCE_ENV = "POLYSTRATA_HIP_FORCE_ARCH"


def _load(kind: str) -> ctypes.CDLL:
    return base.load_library(kind, _HIP_LIBS if kind == "hip" else _RTC_LIBS, _NO_HIP)


def available() -> bool:
    """Whether the HIP runtime library can be loaded (compiling needs nothing more)."""
    with contextlib.suppress(PolystrataError):
        return bool(_load("hip"))
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


def rtc_compile(lib: ctypes.CDLL, api: str, source: str, name: str, options: Sequence[str], code: str) -> bytes:
    """`source` compiled in this process by hiprtc or NVRTC (`api`: "hiprtc" or "nvrtc", one C API under two
    prefixes): the bytes of its `code` ("Code" of hiprtc, "CUBIN" or "PTX" of NVRTC), or PolystrataError with
    the compiler's log."""
    call = lambda fn, *args: getattr(lib, api + fn)(*args)  # noqa: E731
    getattr(lib, api + "GetErrorString").restype = ctypes.c_char_p
    prog, size = ctypes.c_void_p(), ctypes.c_size_t()
    if err := call("CreateProgram", ctypes.byref(prog), source.encode(), f"{name}.hip".encode(), 0, None, None):
        raise PolystrataError(f"{api}CreateProgram failed: {call('GetErrorString', err).decode()}")
    try:
        err = call("CompileProgram", prog, len(options), (ctypes.c_char_p * len(options))(*map(str.encode, options)))
        what = "ProgramLog" if err else code
        call(f"Get{what}Size", prog, ctypes.byref(size))
        out = ctypes.create_string_buffer(size.value)
        call(f"Get{what}", prog, out)
        if err:
            raise PolystrataError(f"{call('GetErrorString', err).decode()}\n{out.value.decode(errors='replace')}")
        return out.raw
    finally:
        call("DestroyProgram", ctypes.byref(prog))


def hiprtc_compile(source: str, name: str, *options: str) -> bytes:
    """hiprtc's code object of `source` (the child's side of `base.compile_in_child`)."""
    return rtc_compile(_load("rtc"), "hiprtc", source, name, options, "Code")


class HIPCode(NamedTuple):
    """A compiled kernel: the code object and, on a GPU, its loaded function."""

    code: bytes
    function: Any = None


def _gpu_count() -> int:
    n = ctypes.c_int()
    return n.value if _load("hip").hipGetDeviceCount(ctypes.byref(n)) == 0 else 0


class HIPRuntime(base.DriverRuntime):
    """One AMD GPU, or compile-only for `arch` when there is none (or with `compile_only=True`)."""

    name = "hip"
    source_ext = "hip"
    # GPU schedules, a group of one wave (`__init__`: the arch's width); no load merging assumed; sdot4 / dp4a.
    policy = device_policy(lanes=64, subgroup=64, int8_dot=True)
    takes_arch = True
    vendor, example_arch = "AMD", "gfx1030"  # for the error of a compile-only runtime asked to run
    source_prelude = ""  # text before the rendered kernel

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
            raise PolystrataError(self.no_device(self.example_arch) + "; give an arch to compile for")
        self.arch = arch or found
        self._configure(found, dev_name)  # refuses an unknown arch
        wave = wave_of(self.arch)  # 64 on wave64 (CDNA, GCN), 32 on wave32 (RDNA and CUDA)
        unit = MATRIX_ARCHS.get(base_arch(self.arch))
        self.policy = replace(self.policy.with_shape(wave, wave), matrix_kinds=matrix_kinds(unit))

    def no_device(self, arch: str | None = None) -> str:
        return (f"no {self.vendor} GPU: the hip target can compile (polystrata compile --target hip --arch "
                f"{arch or self.arch}) but not run here")

    def _gpu_count(self) -> int:
        return _gpu_count()

    def _open(self) -> tuple[str, str]:
        """Make device 0 current: (its arch, its name). The properties struct's layout varies across ROCm, so the
        arch name is searched for in it."""
        self.lib = _load("hip")
        self.lib.hipFree.argtypes = [ctypes.c_void_p]  # the buffers' finaliser
        _check(self.lib.hipSetDevice(0), "hipSetDevice")
        props = ctypes.create_string_buffer(16384)
        _check(self.lib.hipGetDeviceProperties(props, 0), "hipGetDeviceProperties")
        i = props.raw.find(b"gfx", 256)
        return ((props.raw[i:].split(b"\0", 1)[0].decode() if i >= 0 else ""),
                props.raw[:256].split(b"\0", 1)[0].decode(errors="replace"))

    def _configure(self, found: str | None, dev_name: str) -> None:
        """The device description and the compiler's options for `self.arch`."""
        check_arch(self.arch)
        ver = ".".join(map(str, rocm_version()))
        self.device = f"{dev_name} ({found}, ROCm {ver})" if found else f"{self.arch} (compile only, ROCm {ver})"
        self.options = [f"--offload-arch={self.arch}", "-O3", "-ffp-contract=off"]
        self.compiler = f"rocm {ver} {' '.join(self.options)}"

    def render(self, kernel: Kernel) -> str:
        """HIP C++ for `kernel` on this runtime's architecture."""
        return self.source_prelude + render(kernel, self.arch, self.subgroup, self.native_f16)

    def compile(self, kernel: Kernel) -> base.CompiledKernel:
        """Code object of `kernel` from the cache, else from the compiler (`_build`); loaded on a GPU."""
        source = self.render(kernel)

        def load(code: bytes) -> HIPCode:
            return HIPCode(code, self._load_function(code, kernel.name) if self.gpu else None)

        def build() -> tuple[bytes, HIPCode]:
            code = self._build(source, kernel.name)
            return code, load(code)

        key = base.cache_key(source, self.name, self.arch, self.compiler)
        return self._compile_code(kernel, source, key, "co", load, build)

    def _build(self, source: str, name: str) -> bytes:
        args = [name, *self.options]
        return base.compile_in_child(f"{__name__}:hiprtc_compile", source, args, "hiprtc", name, self.arch)

    def _load_function(self, code: bytes, name: str) -> Any:
        """Kernel `name` of a code object, loaded as a module that stays loaded."""
        module, fn = ctypes.c_void_p(), ctypes.c_void_p()
        _check(self.lib.hipModuleLoadData(ctypes.byref(module), code), "hipModuleLoadData")
        _check(self.lib.hipModuleGetFunction(ctypes.byref(fn), module, name.encode()), "hipModuleGetFunction")
        return fn.value

    def _malloc(self, nbytes: int) -> base.DeviceBuffer:
        ptr = ctypes.c_void_p()
        _check(self.lib.hipMalloc(ctypes.byref(ptr), ctypes.c_size_t(nbytes)), "hipMalloc")
        buf = base.DeviceBuffer(ptr.value, nbytes, self.lib.hipFree)
        _check(self.lib.hipMemset(ctypes.c_void_p(buf.ptr), 0, ctypes.c_size_t(nbytes)), "hipMemset")
        return buf

    def _copy(self, to_device: bool, dev: int, host: int, nbytes: int) -> None:
        """Synchronous (the base class's `copy_async` uses it too: no second stream or pinned staging here yet, so
        expert uploads do not overlap with kernels on this target)."""
        what, dst, src = ("hipMemcpyHtoD", dev, host) if to_device else ("hipMemcpyDtoH", host, dev)
        _check(getattr(self.lib, what)(ctypes.c_void_p(dst), ctypes.c_void_p(src), ctypes.c_size_t(nbytes)), what)

    def _launch(self, p: base.PackedLaunch) -> None:
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

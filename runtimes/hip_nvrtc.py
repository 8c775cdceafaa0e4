"""hip on NVIDIA (`HIPRuntime()` with an NVIDIA GPU and no AMD one, or `HIPRuntime("sm_XX")`): codegen/hip.py's source
behind `cuda_prelude()`, NVRTC -> cubin (PTX where the GPU is newer than NVRTC), `--fmad=false`; `HIPRuntime`'s cache,
buffers and launches over `cuda.bindings.driver` (device 0's primary context, the null stream)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
from typing import Any

from polystrata.codegen.hip import cuda_prelude, render
from polystrata.errors import PolystrataError
from polystrata.ir.kernel import Kernel
from polystrata.runtimes import hip
from polystrata.runtimes.cuda import DeviceEvent, _check

try:  # nothing is loaded until a first call: libcuda and libnvrtc may still be missing
    from cuda.bindings import driver, nvrtc
except ImportError:  # the hip target on AMD alone
    driver = nvrtc = None

_NO_GPU = "no NVIDIA GPU: the hip target can compile (polystrata compile --target hip --arch {arch}) but not run here"


def gpu_count() -> int:
    """NVIDIA GPUs that the CUDA driver sees (0 without cuda-bindings, a driver or a device)."""
    try:
        _check(driver.cuInit(0))
        return int(_check(driver.cuDeviceGetCount())[0])
    except Exception:  # ImportError, the driver library not found, CUDA_ERROR_NO_DEVICE, ...
        return 0


def wanted(cls: type, arch: str | None, compile_only: bool) -> bool:
    """Whether `HIPRuntime(arch, compile_only)` is an `NVRTCRuntime`."""
    return cls is hip.HIPRuntime and (arch.startswith("sm_") if arch is not None else not compile_only and not (
        hip.available() and hip._gpu_count() > 0) and gpu_count() > 0)


def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of NVRTC; PolystrataError where cuda-bindings or libnvrtc cannot be loaded."""
    try:
        major, minor = _check(nvrtc.nvrtcVersion())
    except Exception as e:
        msg = (str(e).splitlines() or [type(e).__name__])[0]
        raise PolystrataError(f"NVRTC not available ({msg}); pip install cuda-bindings nvidia-cuda-nvrtc") from None
    return int(major), int(minor)


def include_dirs() -> list[str]:
    """Folders holding cuda_fp16.h (NVRTC has no built-in copy): cuda-pathfinder's, $CUDA_HOME's, /usr/local/cuda."""
    dirs = [os.path.join(os.environ.get(v, "/usr/local/cuda"), "include") for v in ("CUDA_HOME", "CUDA_PATH")]
    with contextlib.suppress(Exception):  # no cuda-pathfinder, or it finds no headers
        from cuda.pathfinder import find_nvidia_header_directory

        dirs.insert(0, find_nvidia_header_directory("cudart"))
    return [d for d in dict.fromkeys(dirs) if d and os.path.isfile(os.path.join(d, "cuda_fp16.h"))]


def arch_option(arch: str) -> tuple[str, bool]:
    """(`--gpu-architecture`, PTX?): a cubin, or PTX for the newest older arch where `arch` is newer than NVRTC."""
    m = re.fullmatch(r"sm_(\d+)", arch)
    if m is None:
        raise PolystrataError(f"unknown NVIDIA architecture {arch!r} (expected sm_NN, e.g. sm_90)")
    cc, known = int(m.group(1)), [int(a) for a in _check(nvrtc.nvrtcGetSupportedArchs())[0]]
    below = [a for a in known if a < cc]
    return (f"--gpu-architecture={arch}", False) if cc in known or not below else \
        (f"--gpu-architecture=compute_{max(below)}", True)


def nvrtc_compile(source: str, name: str, arch: str, options: list[str], ptx: bool = False) -> bytes:
    """A cubin (or PTX) of `source`; PolystrataError with the first lines of NVRTC's log when it does not compile."""
    prog, = _check(nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], []))
    try:
        err, = nvrtc.nvrtcCompileProgram(prog, len(options), [o.encode() for o in options])
        if err:
            buf = b" " * _check(nvrtc.nvrtcGetProgramLogSize(prog))[0]
            _check(nvrtc.nvrtcGetProgramLog(prog, buf))
            log = [ln for ln in buf.rstrip(b"\0").decode(errors="replace").splitlines() if ln.strip()]
            text = "\n".join(log[:20]) + ("\n..." if len(log) > 20 else "")
            raise PolystrataError(f"NVRTC build of kernel {name} failed for {arch} ({err.name}):\n{text}")
        kind = "PTX" if ptx else "CUBIN"
        code = b" " * _check(getattr(nvrtc, f"nvrtcGet{kind}Size")(prog))[0]
        _check(getattr(nvrtc, f"nvrtcGet{kind}")(prog, code))
        return code
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


class NVRTCRuntime(hip.HIPRuntime):
    """The hip target on NVIDIA GPU 0 through NVRTC, or compile-only for `arch` (sm_XX)."""

    def __init__(self, arch: str | None = None, compile_only: bool = False, native_f16: bool = True) -> None:
        super(hip.HIPRuntime, self).__init__()  # Runtime's: no HIP library here
        ver = ".".join(map(str, nvrtc_version()))
        self.gpu = not compile_only and gpu_count() > 0
        if self.gpu:
            self.driver = driver
            dev, = _check(driver.cuDeviceGet(0))
            cc = [_check(driver.cuDeviceGetAttribute(
                getattr(driver.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_{w}"), dev))[0]
                for w in ("MAJOR", "MINOR")]
            found = f"sm_{cc[0]}{cc[1]}"
            arch = arch or found
            dev_name = _check(driver.cuDeviceGetName(256, dev))[0].split(b"\0", 1)[0].decode(errors="replace")
            _check(driver.cuCtxSetCurrent(_check(driver.cuDevicePrimaryCtxRetain(dev))[0]))
            self.device = f"{dev_name} via NVRTC (HIP source; {found}, NVRTC {ver})"
        elif arch is None:
            raise PolystrataError(_NO_GPU.format(arch="sm_90") + "; give an arch to compile for")
        else:
            self.device = f"{arch} (compile only, NVRTC {ver}, HIP source)"
        target, self.ptx = arch_option(arch)
        self.arch = arch
        self.lanes = self.subgroup = 32  # a warp
        self.native_f16 = native_f16
        self.options = [target, "--fmad=false", *(f"-I{d}" for d in include_dirs())]
        self.compiler = f"nvrtc {ver} {target} --fmad=false"

    def render(self, kernel: Kernel) -> str:  # what NVRTC compiles
        return cuda_prelude() + render(kernel, self.arch, self.subgroup, self.native_f16)

    def _need_gpu(self) -> None:
        if not self.gpu:
            raise PolystrataError(_NO_GPU.format(arch=self.arch))

    def _build(self, source: str, name: str) -> bytes:
        return nvrtc_compile(source, name, self.arch, self.options, self.ptx)

    def _load_module(self, code: bytes, name: str) -> tuple[Any, Any]:
        module, = _check(self.driver.cuModuleLoadData(code))
        return module, _check(self.driver.cuModuleGetFunction(module, name.encode()))[0]

    def _malloc(self, nbytes: int) -> hip.HIPBuffer:  # zeroed, like the CPU target's buffers
        ptr, = _check(self.driver.cuMemAlloc(nbytes))
        buf = hip.HIPBuffer(int(ptr), nbytes, self.driver.cuMemFree)
        _check(self.driver.cuMemsetD8(buf.ptr, 0, nbytes))
        return buf

    def _copy(self, to_device: bool, dev: int, host: int, nbytes: int) -> None:
        _check(self.driver.cuMemcpyHtoD(dev, host, nbytes) if to_device else
               self.driver.cuMemcpyDtoH(host, dev, nbytes))

    def _launch(self, fn: Any, grid: list[int], lanes: int, params: ctypes.Array) -> None:
        _check(self.driver.cuLaunchKernel(fn, *grid, lanes, 1, 1, 0, 0, ctypes.addressof(params), 0))

    def sync(self) -> None:
        if self.gpu:
            _check(self.driver.cuCtxSynchronize())

    def mark(self) -> DeviceEvent:
        """A device event recorded after the work queued so far (the null stream)."""
        self._need_gpu()
        return DeviceEvent(self.driver, 0)

    def elapsed(self, start: DeviceEvent, end: DeviceEvent) -> float:
        """Seconds of device time between two marks, once `end` is reached."""
        return end.seconds_since(start)

    def memory_info(self) -> tuple[int, int] | None:
        return tuple(int(v) for v in _check(self.driver.cuMemGetInfo())) if self.gpu else None

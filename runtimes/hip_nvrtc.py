"""hip on NVIDIA (`HIPRuntime()` with an NVIDIA GPU and no AMD one, or `HIPRuntime("sm_XX")`): codegen/hip.py's source
behind `cuda_prelude()`, NVRTC -> cubin (PTX where the GPU is newer than NVRTC), `--fmad=false`; `HIPRuntime`'s cache,
buffers and launches over `cuda.bindings.driver` (device 0's primary context, the null stream)."""

from __future__ import annotations

import contextlib
import os
import re
from typing import Any

from polystrata.codegen.hip import cuda_prelude, render
from polystrata.errors import PolystrataError
from polystrata.ir.kernel import Kernel
from polystrata.runtimes import hip
from polystrata.runtimes.base import CompiledKernel, DeviceBuffer, PackedLaunch, log_head
from polystrata.runtimes.cuda_driver import (
    DeviceEvent,
    check,
    device_name_arch,
    driver,
    function_resources,
    gpu_count,
    launch,
    memory_info,
)

try:  # nothing is loaded until a first call: libnvrtc may still be missing
    from cuda.bindings import nvrtc
except ImportError:  # the hip target on AMD alone
    nvrtc = None

_NO_GPU = "no NVIDIA GPU: the hip target can compile (polystrata compile --target hip --arch {arch}) but not run here"


def wanted(cls: type, arch: str | None, compile_only: bool) -> bool:
    """Whether `HIPRuntime(arch, compile_only)` is an `NVRTCRuntime`."""
    return cls is hip.HIPRuntime and (arch.startswith("sm_") if arch is not None else
                                      not compile_only and not hip.HIPRuntime.present() and gpu_count() > 0)


def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of NVRTC; PolystrataError where cuda-bindings or libnvrtc cannot be loaded."""
    try:
        major, minor = check(nvrtc.nvrtcVersion())
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
    cc, known = int(m.group(1)), [int(a) for a in check(nvrtc.nvrtcGetSupportedArchs())[0]]
    below = [a for a in known if a < cc]
    return (f"--gpu-architecture={arch}", False) if cc in known or not below else \
        (f"--gpu-architecture=compute_{max(below)}", True)


def nvrtc_compile(source: str, name: str, arch: str, options: list[str], ptx: bool = False) -> bytes:
    """A cubin (or PTX) of `source`; PolystrataError with the first lines of NVRTC's log when it does not compile."""
    prog, = check(nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], []))
    try:
        err, = nvrtc.nvrtcCompileProgram(prog, len(options), [o.encode() for o in options])
        if err:
            buf = b" " * check(nvrtc.nvrtcGetProgramLogSize(prog))[0]
            check(nvrtc.nvrtcGetProgramLog(prog, buf))
            text = log_head(buf.rstrip(b"\0").decode(errors="replace"))
            raise PolystrataError(f"NVRTC build of kernel {name} failed for {arch} ({err.name}):\n{text}")
        kind = "PTX" if ptx else "CUBIN"
        code = b" " * check(getattr(nvrtc, f"nvrtcGet{kind}Size")(prog))[0]
        check(getattr(nvrtc, f"nvrtcGet{kind}")(prog, code))
        return code
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


class NVRTCRuntime(hip.HIPRuntime):
    """The hip target on NVIDIA GPU 0 through NVRTC, or compile-only for `arch` (sm_XX)."""

    no_gpu = _NO_GPU

    example_arch = "sm_90"

    def _gpu_count(self) -> int:
        return gpu_count()

    def _open(self) -> tuple[str, str]:
        """Make device 0's primary context current: (its arch, its name)."""
        dev, = check(driver.cuDeviceGet(0))
        check(driver.cuCtxSetCurrent(check(driver.cuDevicePrimaryCtxRetain(dev))[0]))
        name, arch = device_name_arch(dev)
        return arch, name

    def _configure(self, found: str | None, dev_name: str) -> None:
        ver = ".".join(map(str, nvrtc_version()))
        self.device = (f"{dev_name} via NVRTC (HIP source; {found}, NVRTC {ver})" if found else
                       f"{self.arch} (compile only, NVRTC {ver}, HIP source)")
        target, self.ptx = arch_option(self.arch)
        self.options = [target, "--fmad=false", *(f"-I{d}" for d in include_dirs())]
        self.compiler = f"nvrtc {ver} {target} --fmad=false"

    def render(self, kernel: Kernel) -> str:  # what NVRTC compiles
        return cuda_prelude() + render(kernel, self.arch, self.subgroup, self.native_f16)

    def _build(self, source: str, name: str) -> bytes:
        return nvrtc_compile(source, name, self.arch, self.options, self.ptx)

    def _load_module(self, code: bytes, name: str) -> tuple[Any, Any]:
        module, = check(driver.cuModuleLoadData(code))
        return module, check(driver.cuModuleGetFunction(module, name.encode()))[0]

    def _malloc(self, nbytes: int) -> DeviceBuffer:  # zeroed, like the CPU target's buffers
        ptr, = check(driver.cuMemAlloc(nbytes))
        buf = DeviceBuffer(int(ptr), nbytes, driver.cuMemFree)
        check(driver.cuMemsetD8(buf.ptr, 0, nbytes))
        return buf

    def _copy(self, to_device: bool, dev: int, host: int, nbytes: int) -> None:
        check(driver.cuMemcpyHtoD(dev, host, nbytes) if to_device else driver.cuMemcpyDtoH(host, dev, nbytes))

    def _launch(self, p: PackedLaunch) -> None:
        launch(p, 0)

    def sync(self) -> None:
        if self.gpu:
            check(driver.cuCtxSynchronize())

    def mark(self) -> DeviceEvent:
        """A device event after the work queued so far (the null stream)."""
        self._need_gpu()
        return DeviceEvent(0)

    def memory_info(self) -> tuple[int, int] | None:
        return memory_info() if self.gpu else None

    def kernel_resources(self, ck: CompiledKernel) -> dict[str, int]:
        return function_resources(ck.handle.function, ck.kernel.lanes) if self.gpu else {}

"""hip on NVIDIA (`HIPRuntime()` with an NVIDIA GPU and no AMD one, or `HIPRuntime("sm_XX")`): codegen/hip.py's source
behind `CUDA_PRELUDE`, NVRTC (`hip.rtc_compile`) -> cubin (PTX where the GPU is newer than NVRTC), `--fmad=false`;
buffers and launches through `cuda.bindings.driver` (device 0's primary context, the null stream)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
from typing import Any

from polystrata.codegen.hip import CUDA_PRELUDE
from polystrata.errors import PolystrataError
from polystrata.runtimes import base, cuda_driver, hip
from polystrata.runtimes.cuda_driver import check, driver, gpu_count


def wanted(cls: type, arch: str | None, compile_only: bool) -> bool:
    """Whether `HIPRuntime(arch, compile_only)` is an `NVRTCRuntime`."""
    return cls is hip.HIPRuntime and (arch.startswith("sm_") if arch is not None else
                                      not compile_only and not hip.HIPRuntime.present() and gpu_count() > 0)


def _nvrtc() -> ctypes.CDLL:
    """libnvrtc: where cuda-pathfinder finds it (the nvidia-cuda-nvrtc wheel, or the system's), else by soname."""
    names = ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
    with contextlib.suppress(Exception):  # no cuda-pathfinder, or it finds no libnvrtc (it keeps what it found)
        from cuda.pathfinder import load_nvidia_dynamic_lib

        names.insert(0, load_nvidia_dynamic_lib("nvrtc").abs_path)
    return base.load_library("nvrtc", names, "NVRTC not available; pip install nvidia-cuda-nvrtc")


def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of NVRTC; PolystrataError where libnvrtc cannot be loaded."""
    major, minor = ctypes.c_int(), ctypes.c_int()
    _nvrtc().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return major.value, minor.value


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
    n = ctypes.c_int()
    _nvrtc().nvrtcGetNumSupportedArchs(ctypes.byref(n))
    known = (ctypes.c_int * n.value)()
    _nvrtc().nvrtcGetSupportedArchs(known)
    cc, below = int(m.group(1)), [a for a in known if a < int(m.group(1))]
    return (f"--gpu-architecture={arch}", False) if cc in known or not below else \
        (f"--gpu-architecture=compute_{max(below)}", True)


class NVRTCRuntime(hip.HIPRuntime):
    """The hip target on NVIDIA GPU 0 through NVRTC, or compile-only for `arch` (sm_XX)."""

    vendor, example_arch = "NVIDIA", "sm_90"
    source_prelude = CUDA_PRELUDE  # what NVRTC compiles

    _gpu_count = staticmethod(gpu_count)

    def _open(self) -> tuple[str, str]:
        """Make device 0's primary context current: (its arch, its name)."""
        dev, = check(driver.cuDeviceGet(0))
        check(driver.cuCtxSetCurrent(check(driver.cuDevicePrimaryCtxRetain(dev))[0]))
        name, arch = cuda_driver.device_name_arch(dev)
        return arch, name

    def _configure(self, found: str | None, dev_name: str) -> None:
        ver = ".".join(map(str, nvrtc_version()))
        self.device = (f"{dev_name} via NVRTC (HIP source; {found}, NVRTC {ver})" if found else
                       f"{self.arch} (compile only, NVRTC {ver}, HIP source)")
        target, self.ptx = arch_option(self.arch)
        self.options = [target, "--fmad=false", *(f"-I{d}" for d in include_dirs())]
        self.compiler = f"nvrtc {ver} {target} --fmad=false"

    def _build(self, source: str, name: str, ptx: bool = False) -> bytes:
        """A cubin, or PTX (with `ptx`, and where the arch is newer than NVRTC)."""
        try:
            return hip.rtc_compile(_nvrtc(), "nvrtc", source, name, self.options, "PTX" if ptx or self.ptx else "CUBIN")
        except PolystrataError as e:  # with the first lines of NVRTC's log
            raise PolystrataError(f"NVRTC build of kernel {name} failed for {self.arch}:\n{base.log_head(str(e))}") \
                from None

    def _load_function(self, code: bytes, name: str) -> Any:
        return cuda_driver.load_function(code, name)

    def _malloc(self, nbytes: int) -> base.DeviceBuffer:  # zeroed, like the CPU target's buffers
        ptr, = check(driver.cuMemAlloc(nbytes))
        buf = base.DeviceBuffer(int(ptr), nbytes, driver.cuMemFree)
        check(driver.cuMemsetD8(buf.ptr, 0, nbytes))
        return buf

    def _copy(self, to_device: bool, dev: int, host: int, nbytes: int) -> None:
        check(driver.cuMemcpyHtoD(dev, host, nbytes) if to_device else driver.cuMemcpyDtoH(host, dev, nbytes))

    def _launch(self, p: base.PackedLaunch) -> None:
        cuda_driver.launch(p, 0)

    def sync(self) -> None:
        if self.gpu:
            check(driver.cuCtxSynchronize())

    def mark(self) -> cuda_driver.DeviceEvent:  # on the null stream
        self._need_gpu()
        return cuda_driver.DeviceEvent(0)

    def memory_info(self) -> tuple[int, int] | None:
        return cuda_driver.memory_info() if self.gpu else None

    def kernel_resources(self, ck: base.CompiledKernel) -> dict[str, int]:
        return cuda_driver.function_resources(ck.handle.function, ck.kernel.lanes) if self.gpu else {}

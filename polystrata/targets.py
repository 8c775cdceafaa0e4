"""Targets by name: the runtime behind each, and what `auto` picks on this machine."""

from __future__ import annotations

import os

from polystrata.errors import PolystrataError, UnsupportedError
from polystrata.runtimes.base import Runtime

# `reference` is the numpy oracle (no kernels); the others run generated kernels.
TARGETS = ("auto", "reference", "cpu", "cuda", "hip", "opencl")
KERNEL_TARGETS = ("cpu", "cuda", "hip", "opencl")
TARGET_HELP = ("where kernels run: auto (cuda, else hip, else a GPU through OpenCL, else cpu), cpu, cuda, hip, "
               "opencl, or reference (numpy oracle)")


def _has_cuda_gpu() -> bool:
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":  # the simulator is for tests, never a choice of `auto`
        return False
    try:
        from numba import cuda

        return cuda.is_available()
    except Exception:  # noqa: BLE001 - any import or driver failure means no usable CUDA GPU
        return False


def _has_amd_gpu() -> bool:
    try:
        from polystrata.runtimes import hip

        return hip.available() and hip._gpu_count() > 0
    except (ImportError, OSError, PolystrataError):
        return False


def _has_opencl_gpu() -> bool:
    try:
        from polystrata.runtimes.opencl import has_gpu

        return has_gpu()
    except (ImportError, PolystrataError):
        return False


def resolve_target(name: str) -> str:
    """The concrete target for `name`: `auto` picks an NVIDIA GPU (cuda), an AMD GPU (hip), a GPU through OpenCL,
    else the CPU."""
    if name not in TARGETS:
        raise UnsupportedError(f"target '{name}' is not available (available: {', '.join(TARGETS)})")
    if name != "auto":
        return name
    for target, present in (("cuda", _has_cuda_gpu), ("hip", _has_amd_gpu), ("opencl", _has_opencl_gpu)):
        if present():
            return target
    return "cpu"


def make_runtime(name: str, arch: str | None = None) -> Runtime:
    """A fresh runtime of a kernel target; `arch` names the GPU architecture to compile for (hip)."""
    if arch is not None and name != "hip":
        raise UnsupportedError(f"--arch applies to the hip target, not '{name}'")
    if name == "cpu":
        from polystrata.runtimes.cpu import CPURuntime

        return CPURuntime()
    if name == "opencl":
        from polystrata.runtimes.opencl import OpenCLRuntime

        return OpenCLRuntime()
    if name == "cuda":
        from polystrata.runtimes.cuda import CUDARuntime

        return CUDARuntime()
    if name == "hip":
        from polystrata.runtimes.hip import HIPRuntime

        return HIPRuntime(arch=arch)
    raise UnsupportedError(f"target '{name}' has no kernel runtime (kernel targets: {', '.join(KERNEL_TARGETS)})")


def available_kernel_targets() -> list[str]:
    """Kernel targets that can run here (a runtime starts and can launch), in `KERNEL_TARGETS` order."""
    out = []
    for name in KERNEL_TARGETS:
        try:
            rt = make_runtime(name)
        except (ImportError, OSError, PolystrataError):
            continue
        if getattr(rt, "gpu", True) is False:  # compile-only (hip without a GPU) cannot run kernels
            continue
        out.append(name)
    return out

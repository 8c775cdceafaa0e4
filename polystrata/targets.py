"""Targets by name: the runtime behind each, and what `auto` picks on this machine."""

from __future__ import annotations

from polystrata.errors import PolystrataError, UnsupportedError
from polystrata.runtimes.base import Runtime

# `reference` is the numpy oracle (no kernels); the others run generated kernels.
TARGETS = ("auto", "reference", "cpu", "opencl", "hip")
KERNEL_TARGETS = ("cpu", "opencl", "hip")


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
    """The concrete target for `name`: `auto` picks an AMD GPU (hip), then a GPU through OpenCL, else the CPU."""
    if name not in TARGETS:
        raise UnsupportedError(f"target '{name}' is not available (available: {', '.join(TARGETS)})")
    if name != "auto":
        return name
    for target, present in (("hip", _has_amd_gpu), ("opencl", _has_opencl_gpu)):
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
    if name == "hip":
        from polystrata.runtimes.hip import HIPRuntime

        return HIPRuntime(arch=arch)
    raise UnsupportedError(f"target '{name}' has no kernel runtime (kernel targets: {', '.join(KERNEL_TARGETS)})")

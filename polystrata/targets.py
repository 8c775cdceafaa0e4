"""Targets by name: the runtime behind each, and what `auto` picks on this machine."""

from __future__ import annotations

from polystrata.errors import PolystrataError, UnsupportedError
from polystrata.runtimes.base import Runtime

# `reference` is the numpy oracle (no kernels); the others run generated kernels.
TARGETS = ("auto", "reference", "cpu", "opencl")
KERNEL_TARGETS = ("cpu", "opencl")


def resolve_target(name: str) -> str:
    """The concrete target for `name`: `auto` is a GPU through OpenCL when one is present, else the CPU."""
    if name not in TARGETS:
        raise UnsupportedError(f"target '{name}' is not available (available: {', '.join(TARGETS)})")
    if name != "auto":
        return name
    try:
        from polystrata.runtimes.opencl import has_gpu

        if has_gpu():
            return "opencl"
    except (ImportError, PolystrataError):
        pass
    return "cpu"


def make_runtime(name: str) -> Runtime:
    """A fresh runtime of a kernel target."""
    if name == "cpu":
        from polystrata.runtimes.cpu import CPURuntime

        return CPURuntime()
    if name == "opencl":
        from polystrata.runtimes.opencl import OpenCLRuntime

        return OpenCLRuntime()
    raise UnsupportedError(f"target '{name}' has no kernel runtime (kernel targets: {', '.join(KERNEL_TARGETS)})")

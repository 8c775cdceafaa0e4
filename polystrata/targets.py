"""Targets by name: the runtime behind each, and what `auto` picks on this machine."""

from __future__ import annotations

import importlib

from polystrata.errors import PolystrataError, UnsupportedError
from polystrata.runtimes.base import Runtime

# Every target, registered here and nowhere else: its name -> its runtime class ("module:Class", imported on first
# use), None for `reference`, the numpy oracle (no kernels). Kernel targets stand in the order `auto` tries them
# (the first whose class finds its device `present`). Anything else the project needs to know about a target
# (host or device, source file extension, threads, compile-only) it asks the runtime class.
_RUNTIMES: dict[str, str | None] = {
    "reference": None,
    "cuda": "polystrata.runtimes.cuda:CUDARuntime",
    "hip": "polystrata.runtimes.hip:HIPRuntime",
    "opencl": "polystrata.runtimes.opencl:OpenCLRuntime",
    "cpu": "polystrata.runtimes.cpu:CPURuntime",
}
TARGETS = ("auto", *_RUNTIMES)
KERNEL_TARGETS = tuple(name for name, cls in _RUNTIMES.items() if cls)
TARGET_HELP = (f"where kernels run: auto (the first of {', '.join(KERNEL_TARGETS)} whose device is here), "
               f"{', '.join(KERNEL_TARGETS)}, or reference (numpy oracle)")


def runtime_class(name: str) -> type[Runtime]:
    """The runtime class of kernel target `name` (imports its module)."""
    spec = _RUNTIMES.get(name)
    if spec is None:
        raise UnsupportedError(f"target '{name}' has no kernel runtime (kernel targets: {', '.join(KERNEL_TARGETS)})")
    module, cls = spec.split(":")
    return getattr(importlib.import_module(module), cls)


def is_host(name: str) -> bool:
    """Whether target `name` computes on the host CPU (the reference executor does)."""
    return _RUNTIMES.get(name) is None or runtime_class(name).host


def _present(name: str) -> bool:
    """Whether `auto` finds a device of target `name` here (any import or driver failure: no)."""
    try:
        return runtime_class(name).present()
    except Exception:  # noqa: BLE001 - a missing package, library or driver, whatever it raises: no device
        return False


def resolve_target(name: str) -> str:
    """The concrete target for `name`: `auto` picks an NVIDIA GPU (cuda), an AMD GPU (hip), a GPU through OpenCL,
    else the CPU."""
    if name not in TARGETS:
        raise UnsupportedError(f"target '{name}' is not available (available: {', '.join(TARGETS)})")
    if name != "auto":
        return name
    return next((target for target in KERNEL_TARGETS if _present(target)), "cpu")


def make_runtime(name: str, arch: str | None = None) -> Runtime:
    """A fresh runtime of a kernel target; `arch` names the GPU architecture to compile for (targets whose
    runtime class `takes_arch`: hip, cuda)."""
    cls = runtime_class(name)
    if arch is None:
        return cls()
    if not cls.takes_arch:
        raise UnsupportedError(f"--arch applies to the hip and cuda targets, not '{name}'")
    return cls(arch=arch)


def available_kernel_targets() -> list[str]:
    """Kernel targets that can run here (a runtime starts and can launch), in `KERNEL_TARGETS` order."""
    out = []
    for name in KERNEL_TARGETS:
        try:
            rt = make_runtime(name)
        except (ImportError, OSError, PolystrataError):
            continue
        if rt.compile_only:  # hip without a GPU cannot run kernels
            continue
        out.append(name)
    return out

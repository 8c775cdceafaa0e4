"""What every target runtime provides: device buffers, kernel compilation through a binary cache, launches.

A target is one renderer (`codegen/<target>.py`: kernel IR -> source) and one runtime (`runtimes/<target>.py`:
a `Runtime` subclass). The executor (`polystrata/compiler/executor.py`) drives any runtime through this
interface only.
"""

from __future__ import annotations

import hashlib
import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from polystrata.ir.kernel import Buf, Call, Kernel, Scalar, expr_str
from polystrata.ir.quant import Bin, Const, Expr, Var


def cache_dir(target: str) -> Path:
    """Where compiled kernels of `target` are kept: `$POLYSTRATA_HOME/kernels/<target>`."""
    home = Path(os.environ.get("POLYSTRATA_HOME", Path.home() / ".cache" / "polystrata"))
    d = home / "kernels" / target
    d.mkdir(parents=True, exist_ok=True)
    return d


def cache_key(source: str, target: str, device: str, compiler: str) -> str:
    """Binary-cache key: a hash of the source, target, device and compiler version."""
    return hashlib.sha256("\0".join((source, target, device, compiler)).encode()).hexdigest()[:24]


def host_memory() -> tuple[int, int] | None:
    """(available, total) bytes of host memory, where the system says."""
    try:
        pages, avail = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_AVPHYS_PAGES")
        size = os.sysconf("SC_PAGE_SIZE")
        return avail * size, pages * size
    except (ValueError, OSError):
        return None


def eval_int(e: Expr, env: dict[str, int]) -> int:
    """Evaluate an integer expression of scalars (grid sizes) on the host."""
    if isinstance(e, Const):
        return int(e.value)
    if isinstance(e, Var):
        return int(env[e.name])
    if isinstance(e, Bin):
        a, b = eval_int(e.a, env), eval_int(e.b, env)
        ops = {"+": a + b, "-": a - b, "*": a * b}
        if e.op in ops:
            return ops[e.op]
        if e.op == "//":
            return a // b
        if e.op == "%":
            return a % b
    if isinstance(e, Call) and e.fn in ("min", "max"):
        vals = [eval_int(a, env) for a in e.args]
        return min(vals) if e.fn == "min" else max(vals)
    raise ValueError(f"grid size {expr_str(e)} is not a host integer expression")


class CompiledKernel:
    """A kernel ready to launch on one runtime; `stats` counts cache hits for `compile`'s report."""

    def __init__(self, kernel: Kernel, handle: Any, source: str, cached: bool):
        self.kernel = kernel
        self.handle = handle
        self.source = source
        self.cached = cached


class Runtime(ABC):
    """A device: buffers, compilation (with a binary cache) and launches."""

    name: str = ""
    device: str = ""
    # Lanes per group that recipes should use on this device (1 on the CPU), and the subgroup (warp) width.
    lanes: int = 1
    subgroup: int = 1
    # Whether the compiler merges runs of aligned neighbouring loads into 16-byte loads (recipes then give each
    # lane runs of consecutive words: `codegen/recipes/_matvec.use_runs`).
    wide_loads: bool = False

    def __init__(self) -> None:
        self.cache_hits = 0
        self.cache_misses = 0
        self._compiled: dict[str, CompiledKernel] = {}  # cache key -> kernel compiled in this process

    def _remember(self, key: str, ck: CompiledKernel) -> CompiledKernel:
        """Keep a compiled kernel for this process and count where it came from (binary cache or a build)."""
        if ck.cached:
            self.cache_hits += 1
        else:
            self.cache_misses += 1
        self._compiled[key] = ck
        return ck

    @abstractmethod
    def render(self, kernel: Kernel) -> str:
        """Source of `kernel` for this target."""

    @abstractmethod
    def compile(self, kernel: Kernel) -> CompiledKernel:
        """Compile (or fetch from the binary cache) one kernel."""

    @abstractmethod
    def alloc(self, shape: Sequence[int], dtype: str) -> Any:
        """A device buffer of IR dtype `dtype`."""

    @abstractmethod
    def upload(self, array: np.ndarray) -> Any:
        """A device buffer holding a copy of `array` (storage dtype as the IR expects)."""

    @abstractmethod
    def download(self, buf: Any, shape: Sequence[int], dtype: str) -> np.ndarray:
        """Copy a device buffer back to the host."""

    @abstractmethod
    def write(self, buf: Any, array: np.ndarray) -> None:
        """Overwrite a device buffer's leading bytes with `array` (inputs for one step)."""

    @abstractmethod
    def launch(self, ck: CompiledKernel, args: Sequence[Any], grid: Sequence[int]) -> None:
        """Run `ck` on `grid` groups with `args` in the kernel's parameter order (buffers and scalars)."""

    def sync(self) -> None:  # noqa: B027 - targets without queues have nothing to wait for
        """Wait for queued work."""

    def memory_info(self) -> tuple[int, int] | None:
        """(free, total) bytes of device memory, where known."""
        return None

    # --- memory mechanisms (runtimes/memory.py decides; these only move bytes) ---------------------------------

    def free(self, buf: Any) -> None:  # noqa: B027 - by default a buffer goes with its last reference
        """Release a device buffer now (the caller holds no other reference to it)."""

    def alloc_host(self, nbytes: int) -> np.ndarray:
        """A host staging buffer of `nbytes` bytes (uint8) for `copy_async`: page-locked where the target has
        such memory (copies from it run at the link's full speed), else an ordinary array."""
        return np.empty(nbytes, np.uint8)

    def write_region(self, buf: Any, offset: int, array: np.ndarray) -> None:
        """Overwrite bytes [offset, offset + array.nbytes) of a device buffer, in order with the compute queue."""
        raise NotImplementedError(f"the {self.name} runtime cannot write part of a buffer")

    def copy_async(self, buf: Any, offset: int, host: np.ndarray) -> Any:
        """Start copying `host`'s bytes into `buf` at byte `offset` on a second queue, beside the compute queue's
        work; returns an event for `wait_for` / `wait_host`, or None when the copy is already complete. `host`
        (an `alloc_host` buffer) must not change until then. Default: a synchronous `write_region`."""
        self.write_region(buf, offset, host)
        return None

    def wait_for(self, event: Any) -> None:  # noqa: B027 - synchronous copies leave nothing to wait for
        """Make launches queued after this call wait until `event` (from `copy_async`) completes."""

    def wait_host(self, event: Any) -> None:  # noqa: B027 - synchronous copies leave nothing to wait for
        """Block the host until `event` (from `copy_async`) completes."""

    def args_for(self, kernel: Kernel, buffers: dict[str, Any], scalars: dict[str, int | float]) -> list[Any]:
        """Launch arguments in parameter order: buffer handles and scalars converted to their dtype."""
        out: list[Any] = []
        for p in kernel.params:
            if isinstance(p, Buf):
                out.append(buffers[p.name])
            else:
                assert isinstance(p, Scalar)
                v = scalars[p.name]
                out.append(np.float32(v) if p.dtype == "f32" else np.int32(v))
        return out

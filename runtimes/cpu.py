"""CPU runtime: kernels rendered to Numba source, compiled with `@njit(parallel=True)`; buffers are numpy arrays.

Each kernel's source is written to the kernel cache under a name derived from the cache key (source, target,
CPU, Numba version) and imported from there, so Numba's own on-disk cache of the machine code sits beside it:
a second `compile` of the same model finds both (checked against their recorded digests) and compiles nothing.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numba
import numpy as np

from polystrata import threads
from polystrata.codegen.cpu import NUMPY_DTYPES, render
from polystrata.codegen.policy import HOST_POLICY
from polystrata.ir.kernel import Kernel
from polystrata.runtimes import numba_ssa
from polystrata.runtimes.base import CompiledKernel, Runtime, cache_key, cpu_name, host_memory, numba_signature


class CPURuntime(Runtime):
    """The host CPU through Numba."""

    name = "cpu"
    host = True
    # One lane (a group is a loop iteration of Numba's prange), the host's schedules; no wide loads or int8 dot
    # product assumed (LLVM vectorizes the f32 path better: docs/benchmarks.md).
    policy = HOST_POLICY
    source_ext = "py"

    @classmethod
    def present(cls) -> bool:
        return True  # what `auto` falls back to

    def threads(self) -> int:
        """Numba's thread count (its `prange` loops run a kernel's groups on that many threads)."""
        return int(numba.get_num_threads())

    def __init__(self) -> None:
        super().__init__()
        threads.configure()  # before Numba's pool starts: the CLI's -t, else the default (polystrata.threads)
        numba_ssa.install()  # numba's SSA pass, linear in a kernel's length
        self.device = f"{cpu_name()} ({os.cpu_count()} threads, numba {numba.__version__})"
        # The optimization level (NUMBA_OPT, which the test suite lowers) is part of the binary: a cache entry built
        # at one level is not another's.
        self.compiler = f"numba {numba.__version__} -O{int(numba.core.config.OPT)}"

    def render(self, kernel: Kernel) -> str:
        return render(kernel)

    def compile(self, kernel: Kernel) -> CompiledKernel:
        source = render(kernel)
        key = cache_key(source, self.name, self.device, self.compiler)
        return self._compile_python(kernel, source, key, numba_signature(kernel, grid_sizes=True))

    def alloc(self, shape: Sequence[int], dtype: str) -> np.ndarray:
        return np.zeros(tuple(shape), dtype=NUMPY_DTYPES[dtype]).reshape(-1)

    def upload(self, array: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(array).reshape(-1).copy()

    def read_bytes(self, buf: np.ndarray, out: np.ndarray, offset: int = 0) -> None:
        out[:] = buf.view(np.uint8)[offset : offset + out.size]

    def write_bytes(self, buf: np.ndarray, offset: int, host: np.ndarray) -> None:
        buf.view(np.uint8)[offset : offset + host.size] = host

    def launch(self, ck: CompiledKernel, args: Sequence[Any], grid: Sequence[int]) -> None:
        if min(grid) <= 0:
            return
        ck.handle(*args, *grid)

    def memory_info(self) -> tuple[int, int] | None:
        return host_memory()

"""CPU runtime: kernels rendered to Numba source, compiled with `@njit(parallel=True)`; buffers are numpy arrays.

Each kernel's source is written to the kernel cache under a name derived from the cache key (source, target,
CPU, Numba version) and imported from there, so Numba's own on-disk cache of the machine code sits beside it:
a second `compile` of the same model finds both (checked against their recorded digests) and compiles nothing.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numba
import numpy as np

from polystrata import threads
from polystrata.codegen.cpu import NUMPY_DTYPES, render
from polystrata.ir.kernel import Buf, Kernel
from polystrata.paths import atomic_write
from polystrata.runtimes.base import CompiledKernel, Runtime, cache_key, host_memory


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _signature(kernel: Kernel) -> tuple:
    """Numba argument types of a kernel: 1-D C arrays, int32/float32 scalars, then int64 grid sizes."""
    types = []
    for p in kernel.params:
        if isinstance(p, Buf):
            types.append(numba.types.Array(numba.from_dtype(np.dtype(NUMPY_DTYPES[p.dtype])), 1, "C"))
        else:
            types.append(numba.types.float32 if p.dtype == "f32" else numba.types.int32)
    return tuple(types) + (numba.types.int64,) * len(kernel.grid)


class CPURuntime(Runtime):
    """The host CPU through Numba."""

    name = "cpu"

    def __init__(self) -> None:
        super().__init__()
        threads.configure()  # before Numba's pool starts: the CLI's -t, else the default (polystrata.threads)
        self.device = f"{_cpu_name()} ({os.cpu_count()} threads, numba {numba.__version__})"

    def render(self, kernel: Kernel) -> str:
        return render(kernel)

    def compile(self, kernel: Kernel) -> CompiledKernel:
        source = render(kernel)
        key = cache_key(source, self.name, self.device, f"numba {numba.__version__}")

        def load(path: Path) -> Any:
            name = f"polystrata_kernel_{key}"
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            # Numba's cache re-imports the module by name when it loads a parallel kernel in a new process.
            sys.modules[name] = module
            spec.loader.exec_module(module)
            fn = getattr(module, kernel.name)
            # Compile now (or load from Numba's cache), not at the first launch: `compile` means compiled.
            fn.compile(_signature(kernel))
            return fn

        def build(path: Path) -> Any:
            atomic_write(path, source)
            return load(path)  # Numba compiles and keeps its machine code in __pycache__ beside the source

        return self._compile_cached(kernel, source, key, f"k_{key}.py", load, build)

    def alloc(self, shape: Sequence[int], dtype: str) -> np.ndarray:
        return np.zeros(tuple(shape), dtype=NUMPY_DTYPES[dtype]).reshape(-1)

    def upload(self, array: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(array).reshape(-1).copy()

    def download(self, buf: np.ndarray, shape: Sequence[int], dtype: str) -> np.ndarray:
        n = int(np.prod(shape))
        out = buf[:n].reshape(tuple(shape))
        if dtype == "f16":
            return out.view(np.float16).astype(np.float32)
        return out.copy()

    def write(self, buf: np.ndarray, array: np.ndarray) -> None:
        flat = np.ascontiguousarray(array).reshape(-1)
        buf[: flat.size] = flat

    def write_region(self, buf: np.ndarray, offset: int, array: np.ndarray) -> None:
        flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        buf.view(np.uint8)[offset : offset + flat.size] = flat

    def launch(self, ck: CompiledKernel, args: Sequence[Any], grid: Sequence[int]) -> None:
        if min(grid) <= 0:
            return
        ck.handle(*args, *grid)

    def memory_info(self) -> tuple[int, int] | None:
        return host_memory()

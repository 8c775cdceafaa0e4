"""Run a Python script's OpenCL work under oclgrind (out-of-bounds accesses, data races, uninitialized reads)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

# What the uninitialized-value check needs of oclgrind 21.10 (Debian 12): its shadow memory keeps a buffer zeroed by
# clEnqueueFillBuffer (the runtime's `alloc`) uninitialized even after a kernel writes all of it, and it aborts a
# kernel at LLVM's `freeze`, which its optimiser emits. Under that check, then, buffers are zeroed by a copy from
# the host and kernels build unoptimised.
_UNINITIALIZED_PRELUDE = """
import numpy as _np
import pyopencl as _cl
from polystrata.ir.kernel import DTYPE_BYTES as _BYTES
from polystrata.runtimes.opencl import OpenCLRuntime as _Runtime


def _alloc_zeroed_by_copy(self, shape, dtype):
    nbytes = max(int(_np.prod(shape)) * _BYTES[dtype], 4)
    flags = _cl.mem_flags.READ_WRITE | _cl.mem_flags.COPY_HOST_PTR
    return _cl.Buffer(self.ctx, flags, hostbuf=_np.zeros(nbytes, _np.uint8))


_init = _Runtime.__init__


def _init_unoptimised(self, device=None, subgroups=None, build_options=()):
    _init(self, device, subgroups, (*build_options, "-cl-opt-disable"))


_Runtime.alloc, _Runtime.__init__ = _alloc_zeroed_by_copy, _init_unoptimised
"""


def oclgrind_problems(script: str, tmp_path, timeout: int = 1200, uninitialized: bool = True) -> list[str]:
    """Run `script` (Python source printing OK at the end) on oclgrind's device; return its problem reports.

    oclgrind always checks memory accesses against buffer bounds; `--data-races` adds races between work-items
    and groups; `uninitialized` adds reads of memory nothing wrote."""
    if shutil.which("oclgrind") is None:
        pytest.skip("oclgrind not installed")
    path = tmp_path / "under_oclgrind.py"
    path.write_text(_UNINITIALIZED_PRELUDE + script if uninitialized else script)
    env = dict(os.environ, POLYSTRATA_HOME=str(tmp_path / "home"))
    flags = ["--check-api", "--data-races"] + (["--uninitialized"] if uninitialized else [])
    proc = subprocess.run(["oclgrind", *flags, sys.executable, str(path)],
                          capture_output=True, text=True, env=env, timeout=timeout)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr
    # pyopencl itself probes optional device properties oclgrind lacks (clGetDeviceInfo CL_INVALID_VALUE), and
    # its Program.__getattr__ tries attribute names such as `_source` as kernel names (clCreateKernel
    # CL_INVALID_KERNEL_NAME): those reports are pyopencl's, not the kernels', so they are dropped.
    pyopencl_own = ("Function: clGetDeviceInfo", "Kernel '_source' not found")
    blocks = [b for b in proc.stderr.split("\n\n") if b.strip() and not any(m in b for m in pyopencl_own)]
    return [b for b in blocks if any(w in b.lower() for w in ("invalid", "data race", "uninitialized", "error"))]

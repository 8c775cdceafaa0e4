"""Run a Python script's OpenCL work under oclgrind (out-of-bounds accesses, data races, uninitialized reads)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest


def oclgrind_problems(script: str, tmp_path, timeout: int = 1200) -> list[str]:
    """Run `script` (Python source printing OK at the end) on oclgrind's device; return its problem reports."""
    if shutil.which("oclgrind") is None:
        pytest.skip("oclgrind not installed")
    path = tmp_path / "under_oclgrind.py"
    path.write_text(script)
    env = dict(os.environ, POLYSTRATA_HOME=str(tmp_path / "home"))
    proc = subprocess.run(["oclgrind", "--check-api", "--data-races", "--uninitialized", sys.executable, str(path)],
                          capture_output=True, text=True, env=env, timeout=timeout)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr
    # pyopencl's program build probes optional device properties oclgrind lacks (clGetDeviceInfo
    # CL_INVALID_VALUE); that is pyopencl's, not ours, so those reports are dropped.
    blocks = [b for b in proc.stderr.split("\n\n") if b.strip() and "Function: clGetDeviceInfo" not in b]
    return [b for b in blocks if any(w in b.lower() for w in ("invalid", "data race", "uninitialized", "error"))]

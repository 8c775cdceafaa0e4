"""Host threads of the cpu target: how many compute a kernel, and how idle workers wait.

Numba's parallel kernels run on its thread pool (the `omp` layer: GNU OpenMP). A decode step is a few hundred
short parallel regions. By default an OpenMP worker spins for a while after each region before it sleeps: on an
idle machine that is the fastest, but on a machine busy with other processes the spinning workers take the cores
the next region needs and decode collapses, where workers that sleep at once (`OMP_WAIT_POLICY=PASSIVE`) keep most
of their speed (figures in docs/benchmarks.md). So the wait is chosen when the pool starts: passive where other
processes are running then (`machine_busy`), OpenMP's default otherwise. Set `OMP_WAIT_POLICY` to choose yourself.

The pool reads these settings once, when it starts (the first parallel kernel compiled or run, or the first
`numba.get_num_threads()`): `configure` must come before that. The CLI calls it with `-t/--threads` before any
command runs; the cpu runtime calls it (without a count) when it starts, for programs that use the engine directly.
"""

from __future__ import annotations

import os
import sys

# Environment settings of the OpenMP runtimes, applied unless the user set them (or set a spin count): GNU
# OpenMP's wait policy, and Intel OpenMP's time a worker spins before sleeping (ms), should Numba load that one.
WAIT_SETTINGS = {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}

_configured: int | None = None


def machine_busy(n_threads: int, samples: int = 10, interval_s: float = 0.01) -> bool:
    """Whether `n_threads` threads would share the CPUs with other processes now: the runnable tasks that
    /proc/loadavg counts, less this one, average more than the CPUs the threads leave free (by half a task or
    more) over `samples` readings. False where there is no /proc/loadavg."""
    import time

    others = 0
    for i in range(samples):
        try:
            with open("/proc/loadavg") as f:
                others += int(f.read().split()[3].split("/")[0]) - 1
        except (OSError, ValueError, IndexError):
            return False
        if i + 1 < samples:
            time.sleep(interval_s)
    return others / samples >= usable_cpus() - n_threads + 0.5


def usable_cpus() -> int:
    """CPUs this process may run on (taskset/cgroup affinity respected, unlike `os.cpu_count()`)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def configure(n_threads: int | None = None) -> int:
    """Set up the cpu target's threads before Numba starts its pool; returns the thread count kernels use.

    `n_threads` None: the first call's choice stands, else every usable CPU. Where other processes are running
    (`machine_busy`), idle workers sleep at once instead of spinning (`WAIT_SETTINGS`, unless the environment sets
    a wait policy or spin count). A call after the pool started can only lower the count (the pool has as many
    threads as it started with); a higher one is cut with a warning."""
    global _configured
    if n_threads is not None and n_threads < 1:
        raise ValueError(f"the thread count must be at least 1, not {n_threads}")
    if n_threads is None and _configured is not None:
        return _configured
    n = n_threads or int(os.environ.get("NUMBA_NUM_THREADS") or 0) or usable_cpus()
    import numba
    from numba.np.ufunc import parallel

    chosen = "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ
    if not parallel._is_initialized and not chosen and machine_busy(n):
        for name, value in WAIT_SETTINGS.items():
            os.environ.setdefault(name, value)

    if not parallel._is_initialized:
        # Numba re-reads its configuration from the environment before each compile: set both.
        os.environ["NUMBA_NUM_THREADS"] = str(n)
        numba.config.NUMBA_NUM_THREADS = n
    pool = numba.config.NUMBA_NUM_THREADS
    if n > pool:
        print(f"warning: {n} threads asked, but the thread pool already started with {pool}; using {pool}",
              file=sys.stderr)
        n = pool
    numba.set_num_threads(n)
    _configured = n
    return n

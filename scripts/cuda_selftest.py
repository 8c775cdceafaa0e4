"""CUDA target self-test on a real GPU: the conformance cases of tests/ir_constructs.py with warp shuffles
and the driver launch path, compared with numpy and the CPU target; then launch overheads.

    python scripts/cuda_selftest.py [--scale N] [--no-cpu]

Prints a table of max errors (relative for f32, count of differing values for integers / f16 bits) for the
shuffle path and the shared-memory path, then µs per launch for `launch` (pack + driver
launch), `launch_prepared` (driver launch only) and graph replay (100 launches captured, per launch).
Exits 1 when a case is wrong.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
try:
    import polystrata.codegen.cuda  # noqa: F401 - an installed (editable) polystrata
except ImportError:  # a bare checkout: map polystrata.ir / .codegen / .runtimes onto the top-level folders
    sys.path.insert(0, str(ROOT))
    import polystrata

    polystrata.__path__.append(str(ROOT))

import ir_constructs as t  # noqa: E402

from polystrata.ir.kernel import Buf, Const, Kernel, Scalar, Store  # noqa: E402
from polystrata.runtimes.cuda import CUDARuntime  # noqa: E402


def check(rt, cpu, scale: int) -> bool:
    ok = True
    print(f"{'case':34s} {'output':6s} {'shuffle':>10s} {'tree':>10s} {'vs cpu':>10s}")
    for label, kernel, inputs, outputs, scalars, grid, ref in t.cases(scale):
        shuf = t.run(rt, kernel, inputs, outputs, scalars, grid, shuffles=True)
        tree = t.run(rt, kernel, inputs, outputs, scalars, grid, shuffles=False)
        host = t.run(cpu, kernel, inputs, outputs, scalars, grid) if cpu else None
        for name, (_, dt) in outputs.items():
            tol = 1e-5 if dt == "f32" else 0
            errs = [t.max_error(shuf[name], ref[name], dt), t.max_error(tree[name], ref[name], dt),
                    t.max_error(shuf[name], host[name], dt) if host else 0.0]
            bad = not all(e <= tol for e in errs)  # NaN fails too
            ok &= not bad
            print(f"{label:34s} {name:6s} " + " ".join(f"{e:10.3g}" for e in errs) + ("  FAIL" if bad else ""))
    return ok


def graph_check(rt) -> bool:
    """A captured Reduce launch runs only at replay, and a replay sees new contents of the same buffers."""
    kern = t.reduce_kernel(128)
    x, s, m = rt.upload(np.arange(300, dtype=np.float32)), rt.alloc((1,), "f32"), rt.alloc((1,), "f32")
    h = rt.prepare(rt.compile(kern), rt.args_for(kern, {"x": x, "s": s, "m": m}, {"n": 300, "rows": 1}), (1,))
    rt.begin_capture()
    rt.launch_prepared(h)
    graph = rt.end_capture()
    before = rt.download(s, (1,), "f32")[0]
    rt.replay(graph)
    first = rt.download(s, (1,), "f32")[0]
    rt.write(x, np.ones(300, np.float32))
    rt.replay(graph)
    ok = before == 0 and first == 44850 and rt.download(s, (1,), "f32")[0] == 300
    print(f"graph capture/replay: {'ok' if ok else 'FAIL'}")
    return ok


def timing(rt, nargs: int, reps: int = 2000) -> tuple[float, ...]:
    """µs per launch of a one-block kernel with `nargs` parameters (one buffer, the rest int scalars)."""
    params = (Buf("y", "f32", True),) + tuple(Scalar(f"a{i}") for i in range(nargs - 1))
    kern = Kernel(f"tiny{nargs}", params, (1,), (Store("y", Const(0), Const(1.0)),), lanes=rt.lanes)
    ck = rt.compile(kern)
    y = rt.alloc((1,), "f32")
    args = rt.args_for(kern, {"y": y}, {f"a{i}": i for i in range(nargs - 1)})

    def per_launch(fn, n=reps) -> float:
        fn()
        rt.sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        rt.sync()
        return (time.perf_counter() - t0) / n * 1e6

    launch = per_launch(lambda: rt.launch(ck, args, (1,)))
    h = rt.prepare(ck, args, (1,))
    prepared = per_launch(lambda: rt.launch_prepared(h))
    rt.begin_capture()
    for _ in range(100):
        rt.launch_prepared(h)
    graph = rt.end_capture()
    replay = per_launch(lambda: rt.replay(graph), reps // 100) / 100
    return launch, prepared, replay


def compile_cases(rt, scale: int) -> int:
    """Compile what `check` and `graph_check` launch (both Reduce paths), as a GPU run would, without running it."""
    kernels = [kernel for _, kernel, *_ in t.cases(scale)]
    for kernel in kernels:
        rt.compile(kernel, shuffles=True)
        rt.compile(kernel, shuffles=False)
    rt.compile(t.reduce_kernel(128))
    print(f"{rt.cache_hits + rt.cache_misses} distinct kernels for {rt.arch}: {rt.cache_misses} compiled, "
          f"{rt.cache_hits} from the cache")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=int, default=4, help="grow the test sizes")
    ap.add_argument("--no-cpu", action="store_true", help="skip the CPU target comparison")
    ap.add_argument("--compile-only", metavar="ARCH", help="no GPU needed: only compile the cases' kernels for ARCH "
                    "(e.g. sm_90) into the kernel cache (scripts/device_kernels.sh ships them to the GPU machine)")
    a = ap.parse_args()
    if a.compile_only:
        return compile_cases(CUDARuntime(arch=a.compile_only, compile_only=True), a.scale)
    rt = CUDARuntime()
    print(f"device: {rt.device}  {rt.compiler}  memory free/total: {rt.memory_info()}")
    cpu = None
    if not a.no_cpu:
        from polystrata.runtimes.cpu import CPURuntime

        cpu = CPURuntime()
    ok = check(rt, cpu, a.scale)
    ok &= graph_check(rt)
    copied = t.copy_region_check(rt)
    print(f"copy_async into a region, waited for by a launch: {'ok' if copied else 'FAIL'}")
    ok &= copied
    print(f"\n{'args':>4s} {'launch':>9s} {'prepared':>9s} {'graph/launch':>13s}   (µs)")
    for nargs in (1, 12):
        print(f"{nargs:4d} " + " ".join(f"{v:{w}.2f}" for v, w in zip(timing(rt, nargs), (9, 9, 13))))
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Micro-benchmark of the CPU matmul kernels (decode: T = 1) per shape, format and schedule knobs.

Builds each kernel with `matmul_kernel` (the recipe's code), compiles it on the CPU runtime, checks it against
numpy on the dequantized weights, then times many launches after warm-up, interleaving the variants and keeping
the best round (the machine may be shared: compare variants within one run).

    python scripts/cpu_matvec_bench.py                       # smollm2-135m shapes, default knobs
    python scripts/cpu_matvec_bench.py --fmt Q8_0 --shape 49152x576 --knobs int8=1,vert=0 --knobs ''
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from polystrata.codegen.policy import HOST_POLICY
from polystrata.codegen.recipes.linear import MATMUL_SPACE, matmul_kernel, matmul_kernel_knobs, with_policy_defaults
from polystrata.ir.encode import quantize
from polystrata.ir.evaluate import dequantize
from polystrata.ir.formats import FORMATS
from polystrata.runtimes.base import eval_int
from polystrata.runtimes.cpu import CPURuntime

SMOLLM2 = [("Q4_1", 576, 576), ("Q4_1", 192, 576), ("Q4_1", 576, 1536), ("Q4_1", 1536, 576), ("Q8_0", 49152, 576)]


def _parse_knobs(s: str) -> dict:
    out = {}
    for kv in filter(None, s.split(",")):
        name, v = kv.split("=")
        out[name] = int(v) if v.lstrip("-").isdigit() else v
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fmt", help="format name (default: the smollm2 shapes)")
    ap.add_argument("--shape", help="NxK")
    ap.add_argument("--knobs", action="append", help="comma-separated name=value overrides, one variant each")
    ap.add_argument("--T", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--seconds", type=float, default=0.02, help="time per round per variant")
    a = ap.parse_args()
    shapes = [(a.fmt, *map(int, a.shape.split("x")))] if a.fmt else SMOLLM2
    variants = a.knobs or [""]
    rt = CPURuntime()
    rng = np.random.default_rng(0)
    for fmt_name, n, k in shapes:
        fmt = FORMATS[fmt_name]
        raw = quantize(fmt, rng.standard_normal((n, k)).astype(np.float32))
        wd = dequantize(fmt, raw, (n, k))
        wb = raw.reshape(-1).view(np.float32) if fmt.name == "F32" else raw.reshape(-1)
        x = rng.standard_normal((a.T, k)).astype(np.float32)
        ref = x @ wd.T
        runs = {}
        for v in variants:
            kn = with_policy_defaults({**MATMUL_SPACE.defaults(), **_parse_knobs(v)}, HOST_POLICY)
            kern = matmul_kernel(f"bench_{fmt_name.lower()}_{n}x{k}", [fmt], n, k, lanes=1, **matmul_kernel_knobs(kn))
            dev = {"x": rt.upload(x.reshape(-1)), "w0": rt.upload(wb), "y": rt.alloc((a.T, n), "f32")}
            scal = {"T": a.T}
            ck = rt.compile(kern)
            args = rt.args_for(kern, dev, scal)
            grid = [eval_int(g, scal) for g in kern.grid]
            rt.launch(ck, args, grid)
            rt.sync()
            y = rt.download(dev["y"], (a.T, n), "f32")
            err = float(np.abs(y - ref).max() / np.abs(ref).max())
            runs[v or "default"] = (ck, args, grid, err, dict(kern.knobs))
        reps = {}
        for name, (ck, args, grid, _, _) in runs.items():
            t = time.perf_counter()
            rt.launch(ck, args, grid)
            rt.sync()
            reps[name] = max(3, int(a.seconds / max(time.perf_counter() - t, 1e-6)))
        best = {name: float("inf") for name in runs}
        for _ in range(a.rounds):
            for name, (ck, args, grid, _, _) in runs.items():
                t = time.perf_counter()
                for _ in range(reps[name]):
                    rt.launch(ck, args, grid)
                rt.sync()
                best[name] = min(best[name], (time.perf_counter() - t) / reps[name])
        for name, (_, _, _, err, knobs) in runs.items():
            dt = best[name]
            print(f"{fmt_name:5s} {n:6d}x{k:<5d} T={a.T} {name:24s} {dt * 1e6:9.1f} us  "
                  f"{raw.nbytes / dt / 1e9:6.2f} GB/s"
                  f"  rel.err {err:.1e}  {knobs}", flush=True)


if __name__ == "__main__":
    main()

"""Per-kernel GPU time of one decode step: which kernels a token's time goes to.

Loads a model on a target, runs a prompt, then times every launch of the one-token plan on its own (`--reps`
launches between synchronizations; the KV row they write is the same each time) and prints the kernels grouped by
name with their time per token, launch count and share, largest first, then the sum.

    python scripts/profile_decode.py MODEL.gguf --target cuda [--prompt 64] [--reps 20] [--top 15]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import numpy as np

from polystrata.engine import Engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--target", default="cuda")
    ap.add_argument("--prompt", type=int, default=64, help="tokens in the cache before the profiled step")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args()
    eng = Engine(a.model, target=a.target, n_ctx=max(512, a.prompt + 8))
    ids = np.random.default_rng(0).integers(0, eng.hparams.n_vocab, a.prompt + 1)
    eng.forward(ids[:-1])
    ex, rt = eng.executor, eng.runtime
    pid = id(eng.graph_last)
    step = {"T": 1, "n_past": ex.n_past, "n_kv": ex.n_past + 1}
    per_kernel: dict[str, list[float]] = defaultdict(list)
    for b in ex.bound[pid]:
        b.run(rt, step)  # warm (compiles, packs)
        rt.sync()
        t0 = time.perf_counter()
        for _ in range(a.reps):
            b.run(rt, step)
        rt.sync()
        per_kernel[b.ck.kernel.name].append((time.perf_counter() - t0) / a.reps)
    total = sum(sum(v) for v in per_kernel.values())
    print(f"decode step on {rt.device}: {len(ex.bound[pid])} launches, {total * 1e3:.3f} ms summed "
          f"(each launch timed alone, so launch gaps are included)")
    rows = sorted(per_kernel.items(), key=lambda kv: -sum(kv[1]))
    for name, ts in rows[:a.top]:
        print(f"  {sum(ts) * 1e6:9.1f} us  {len(ts):4d}x  {100 * sum(ts) / total:5.1f}%  {name}")


if __name__ == "__main__":
    main()

"""Wall time of one mixed serving step on each plan that can run it: what a prompt joining running streams costs.

Loads a model with the serving setup of `serve -np N -ub UB` (N sequence slots; the plan of the last N rows'
logits), fills N - 1 slots with short prompts and the last with a `--depth`-token prompt, then times, interleaved
`--reps` times, steps from that same state (the slots' lengths are put back after each):

- last: the UB prompt rows of the joiner alone, on the last-logits plan (the prompt alone, the floor);
- all-K / rows-K: the N - 1 decode rows and UB - N + 1 rows of the joiner, on the all-logits plan (which batched
  steps took before the plan of the last rows; the engine is made with it here) and on the plan of the last N
  rows' logits, K rows wanted (K = N - 1: the joiner's chunk is not its last; K = N: it is).

With `--decode`, steps of decode rows only instead: all-K / rows-K, a decode row of each of K of the N sequences
(K = 2..N; the joiner's slot among them) on either plan: what a step costs while fewer sequences run than `-np`.

    python scripts/mixed_step_bench.py MODEL.gguf [--target cpu] [--parallel 4] [--ubatch 256] [--depth 1000]
                                       [--decode] [--reps 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from polystrata.batch import BatchDecoder
from polystrata.engine import Engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--target", default="cpu")
    ap.add_argument("--parallel", type=int, default=4, help="sequence slots (serve -np)")
    ap.add_argument("--ubatch", type=int, default=256, help="rows of a step (serve -ub)")
    ap.add_argument("--depth", type=int, default=1000, help="tokens in the joiner's slot before the timed step")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--decode", action="store_true", help="time steps of K decode rows (K = 2..N) instead")
    a = ap.parse_args()
    n = a.parallel
    eng = Engine(a.model, target=a.target, n_ctx=n * (a.depth + a.ubatch + 16), n_ubatch=a.ubatch, logit_rows=n,
                 all_logits=True)
    bd = BatchDecoder(eng, n)
    rng = np.random.default_rng(0)

    def tokens(k: int) -> list[int]:
        return [int(i) for i in rng.integers(3, min(1000, eng.hparams.n_vocab), size=k)]

    slots = [bd.open() for _ in range(n)]
    for s in slots[:-1]:
        bd.prefill(s, tokens(16))
    bd.prefill(slots[-1], tokens(a.depth))
    saved, step = list(bd.n_past), eng.executor.step

    def on_all_logits(graph, ids, positions, starts, rows):
        """The step `BatchDecoder` gives the plan of the last rows' logits, on the all-logits plan: the wanted rows
        are the step's last ones there too."""
        t = len(ids)
        return step(eng.graph_all, ids, positions, starts, rows=list(range(t - len(rows), t)))

    decode, prompt = [tokens(1) for _ in slots], tokens(a.ubatch)

    def run(kind: str) -> float:
        bd.n_past[:] = saved
        if a.decode:
            k = int(kind.split("-")[1])
            runs, need = [*zip(slots[n - k:], decode[n - k:])], [True] * k
        elif kind == "last":
            runs, need = [(slots[-1], prompt)], [True]
        else:
            runs = [*zip(slots[:-1], decode), (slots[-1], prompt[: a.ubatch - n + 1])]
            need = [True] * (n - 1) + [kind.endswith(str(n))]
        eng.executor.step = on_all_logits if kind.startswith("all") else step
        t0 = time.perf_counter()
        bd.step(runs, need)
        return time.perf_counter() - t0

    if a.decode:
        kinds = [f"{plan}-{k}" for k in range(2, n + 1) for plan in ("all", "rows")]
    else:
        kinds = ["last", f"all-{n - 1}", f"rows-{n - 1}", f"all-{n}", f"rows-{n}"]
    for k in kinds:
        run(k)  # compiles, warms
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(a.reps):
        for k in kinds:
            times[k].append(run(k))
    for k in kinds:
        med = statistics.median(times[k])
        base = statistics.median(times["last" if "last" in times else k.replace("rows", "all")])
        print(f"{k:>8}: median {1000 * med:.1f} ms ({med / base - 1:+.0%} vs {'last' if 'last' in times else 'all'}), "
              f"min {1000 * min(times[k]):.1f} ms")


if __name__ == "__main__":
    main()

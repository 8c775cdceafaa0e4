#!/usr/bin/env python3
"""How random is a MoE model's routing? Records the experts each layer picks while the numpy reference executor
decodes, then prints, per model: the share of picks that land on each layer's most used quarter of the experts,
how many of a token's experts the previous token also used, and the hit rate an LRU and an LFU cache of S slots
per layer would have on that trace. Run on the CPU, by hand:

    python3 scripts/routing_stats.py MODEL.gguf [-n 64] [--slots 32,64] [--feed greedy|random]
"""

from __future__ import annotations

import argparse
import collections
import sys

import numpy as np

from polystrata.engine import Engine
from polystrata.runtimes import reference


def record_routes(path: str, n_tokens: int, seed: int, feed: str) -> dict[str, list[np.ndarray]]:
    """Router node name -> the expert ids ([k] each) of every decoded token, in order. `feed`: the next input is
    the argmax (`greedy`, as `polystrata bench` decodes) or a random token (`random`, as llama-bench does)."""
    routes: dict[str, list[np.ndarray]] = collections.defaultdict(list)
    router = reference._IMPLS["router"]

    def recording(ex, node, a):
        ids, w = router(ex, node, a)
        routes[node.output.name].extend(ids)
        return ids, w

    reference._IMPLS["router"] = recording
    try:
        eng = Engine(path, target="reference", n_ctx=n_tokens + 1)
        rng = np.random.default_rng(seed)
        tok = int(rng.integers(0, eng.hparams.n_vocab))
        for _ in range(n_tokens):
            logits = eng.forward([tok])[-1]
            tok = int(np.argmax(logits)) if feed == "greedy" else int(rng.integers(0, eng.hparams.n_vocab))
    finally:
        reference._IMPLS["router"] = router
    return routes


def hit_rate(trace: list[np.ndarray], slots: int, policy: str) -> float:
    """Hits / lookups of a cache of `slots` experts under `policy` (lru or lfu) over one layer's trace."""
    resident: collections.OrderedDict[int, None] = collections.OrderedDict()
    uses: collections.Counter[int] = collections.Counter()
    hits = total = 0
    for ids in trace:
        step = {int(e) for e in ids}
        for e in step:
            total += 1
            uses[e] += 1
            if e in resident:
                hits += 1
                resident.move_to_end(e)
                continue
            if len(resident) >= slots:
                victims = [v for v in resident if v not in step]
                if policy == "lfu":
                    victim = min(victims, key=lambda v: uses[v])
                else:
                    victim = victims[0]
                del resident[victim]
            resident[e] = None
    return hits / max(total, 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("-n", type=int, default=64, help="decoded tokens")
    ap.add_argument("--slots", default="32,64", help="cache sizes per layer to simulate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--feed", choices=("greedy", "random"), default="greedy", help="next input: argmax or random")
    a = ap.parse_args()
    routes = record_routes(a.model, a.n, a.seed, a.feed)
    top_share, overlap = [], []
    sims: dict[tuple[int, str], list[float]] = collections.defaultdict(list)
    for trace in routes.values():
        counts = np.bincount(np.concatenate(trace))
        n_exp = max(len(counts), 1)
        quarter = np.sort(counts)[::-1][: max(n_exp // 4, 1)]
        top_share.append(quarter.sum() / counts.sum())
        k = len(trace[0])
        overlap.append(np.mean([len(set(x) & set(y)) / k for x, y in zip(trace, trace[1:])]))
        for s in (int(v) for v in a.slots.split(",")):
            for policy in ("lru", "lfu"):
                sims[(s, policy)].append(hit_rate(trace, s, policy))
    print(f"{len(routes)} MoE layers, {a.n} decoded tokens, {a.feed} feed")
    print(f"picks on each layer's most used quarter of the experts: {np.mean(top_share):.1%} (uniform: 25%)")
    print(f"experts shared with the previous token: {np.mean(overlap):.1%}")
    for (s, policy), rates in sorted(sims.items()):
        print(f"simulated {policy} hit rate, {s} slots a layer: {np.mean(rates):.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

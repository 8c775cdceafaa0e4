"""Per-kernel GPU time of one decode step (or one prompt step): which kernels a step's time goes to.

Loads a model on a target, runs a prompt, then times every launch of the one-token plan on its own (`--reps`
launches between synchronizations; the KV row they write is the same each time) and prints the kernels grouped by
name with their time per token, launch count and share, largest first, then the sum.

    python scripts/profile_decode.py MODEL.gguf --target cuda [--prompt 64] [--reps 20] [--top 15] [--trace]
                                     [--knob SPACE.NAME=VALUE]
    python scripts/profile_decode.py MODEL.gguf --target cuda --tokens 512   # a 512-token prompt step instead
    python scripts/profile_decode.py MODEL.gguf --target cuda --tokens 288 --sequences 16  # 16 prompts joining

`--sequences N` makes the prompt step's rows N sequences' prompts of --tokens / N tokens each, in their own cache
slots, as a server's requests arriving together join one step (`BatchDecoder.step`: each prompt's last row at the
end, its logits wanted).

`--trace` (CUDA, needs PyTorch for its CUPTI profiler) instead records the kernels' own device times while whole
decode steps replay from the CUDA graph, as `run` and `bench` execute them: no launch gaps, caches as they are.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import numpy as np

from polystrata.batch import BatchDecoder
from polystrata.bench import parse_knobs
from polystrata.engine import Engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--target", default="cuda")
    ap.add_argument("--prompt", type=int, default=64, help="tokens in the cache before the profiled step")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--trace", action="store_true", help="device times of graph-replayed steps (CUPTI via torch)")
    ap.add_argument("--tokens", type=int, default=1, help="profile a prompt step of this many tokens (the plan "
                    "that prefill runs, after --prompt tokens) instead of a decode step")
    ap.add_argument("--knob", action="append", default=[], metavar="SPACE.NAME=VALUE",
                    help="schedule knob override, as bench takes it (repeatable)")
    ap.add_argument("--sequences", type=int, default=1, help="the prompt step's rows are this many sequences' "
                    "prompts joining at once (each --tokens / N tokens, in a cache slot of its own)")
    a = ap.parse_args()
    if a.trace and a.tokens > 1:
        ap.error("--trace profiles decode steps only")
    if a.sequences > 1 and (a.tokens < 2 * a.sequences or a.tokens % a.sequences):
        ap.error("--sequences N takes --tokens of at least 2 N, a multiple of N")
    n_ctx = max(512, a.prompt + a.tokens + 8) * a.sequences
    eng = Engine(a.model, target=a.target, n_ctx=n_ctx, knobs=parse_knobs(a.knob), logit_rows=a.sequences,
                 n_ubatch=a.tokens if a.sequences > 1 else None)
    ids = np.random.default_rng(0).integers(0, eng.hparams.n_vocab, a.prompt + a.tokens)
    ex, rt = eng.executor, eng.runtime
    if a.sequences > 1:  # the prompts of N new sequences in one step, as a server's joining requests
        batch = BatchDecoder(eng, a.sequences)
        per = a.tokens // a.sequences
        batch.step([(batch.open(), ids[j * per:(j + 1) * per]) for j in range(a.sequences)])
        pid, step = id(eng.graph_rows), ex.plans[id(eng.graph_rows)].step_symbols(a.tokens, 0)
    else:
        eng.forward(ids[:a.prompt])
        if a.tokens > 1:  # compile and bind the prompt plan on a step of that size, then time its launches again
            eng.forward(ids[a.prompt:])
            ex.n_past = a.prompt
        # Each launch of the profiled plan runs with the plan's own step sizes (a launch of another plan, given
        # these, would read and write past its buffers).
        pid = id(eng.graph_step if a.tokens == 1 else eng.graph_last)
        step = ex.plans[pid].step_symbols(a.tokens, ex.n_past)
    if a.trace:
        trace(eng, ids[-1], a.reps, a.top)
        return
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
    kind = "decode step" if a.tokens == 1 else f"{a.tokens}-token prompt step" + (
        f" of {a.sequences} sequences" if a.sequences > 1 else "")
    print(f"{kind} on {rt.device}: {len(ex.bound[pid])} launches, {total * 1e3:.3f} ms summed "
          f"(each launch timed alone, so launch gaps are included)")
    rows = sorted(per_kernel.items(), key=lambda kv: -sum(kv[1]))
    for name, ts in rows[:a.top]:
        print(f"  {sum(ts) * 1e6:9.1f} us  {len(ts):4d}x  {100 * sum(ts) / total:5.1f}%  {name}")


def trace(eng, tok: int, reps: int, top: int) -> None:
    """Kernel device times over `reps` graph-replayed decode steps (CUPTI through torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):  # capture the graph, warm
        eng.forward([int(tok)])
    eng.runtime.sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(reps):
            eng.forward([int(tok)])
        eng.runtime.sync()
        wall = (time.perf_counter() - t0) / reps
    names = sorted({b.ck.kernel.name for b in eng.executor.bound[id(eng.graph_step)]}, key=len, reverse=True)
    per: dict[str, list[float]] = defaultdict(list)
    for ev in prof.events():
        dt = ev.device_time_total
        if dt:  # numba's mangled symbol holds the kernel's name; else keep the event's name (copies)
            per[next((n for n in names if n in ev.name), ev.name[:60])].append(dt / 1e6)
    total = sum(sum(v) for v in per.values()) / reps
    print(f"graph-replayed decode: {wall * 1e3:.3f} ms a token (wall), kernels {total * 1e3:.3f} ms a token")
    for name, ts in sorted(per.items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(f"  {sum(ts) / reps * 1e6:9.1f} us  {len(ts) // reps:4d}x  {100 * sum(ts) / reps / total:5.1f}%  "
              f"{name[:90]}")


if __name__ == "__main__":
    main()

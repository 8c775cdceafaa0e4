#!/usr/bin/env python3
"""Decode speed of the cpu target on a quiet and on a busy machine, beside llama.cpp's (issue 22).

Each configuration runs in a fresh process (a thread pool reads its settings once, when it starts): PolyStrata
through `polystrata.bench.run_bench` (decode only), llama.cpp through llama-cpp-python with the same loop
(scripts/bench_vs_llamacpp.py). "Busy" adds `--load` processes that spin (`while True: pass`) for the whole
measurement, as a parallel build or another engineer's job would. Run by hand, not by CI:

    python scripts/threads_bench.py [MODEL] [-n 64] [-r 3] [--load 2] [--json]

Configurations: `before` is the setup PolyStrata had before issue 22 (every CPU, GNU OpenMP's default wait: spin
300,000 times, about 3 ms, before sleeping; `GOMP_SPINCOUNT=300000` is that default written out); `default` is
what PolyStrata does now (polystrata/threads.py); `passive` sleeps at once (`OMP_WAIT_POLICY=PASSIVE`); `-t 1`
and `-t 2` are explicit thread counts with the default wait; `spin 1k`, `spin 10k` and `spin 30k` spin that many
times (about 0.01, 0.1 and 0.3 ms) before sleeping; `workqueue` is Numba's own threading layer; `llama.cpp -t N`
is llama.cpp with N threads. The table's last column is the machine's load average during each measurement
(quiet / busy): other users' work counts too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
# name -> (engine, extra environment, threads)
CONFIGS: dict[str, tuple[str, dict[str, str], int | None]] = {
    "before": ("polystrata", {"GOMP_SPINCOUNT": "300000"}, None),
    "default": ("polystrata", {}, None),
    "passive": ("polystrata", {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}, None),
    "-t 1": ("polystrata", {}, 1),
    "-t 2": ("polystrata", {}, 2),
    "spin 1k": ("polystrata", {"GOMP_SPINCOUNT": "1000"}, None),
    "spin 10k": ("polystrata", {"GOMP_SPINCOUNT": "10000"}, None),
    "spin 30k": ("polystrata", {"GOMP_SPINCOUNT": "30000"}, None),
    "workqueue": ("polystrata", {"NUMBA_THREADING_LAYER": "workqueue"}, None),
    "llama.cpp -t 1": ("llama.cpp", {}, 1),
    "llama.cpp -t 2": ("llama.cpp", {}, 2),
}


def _child(engine: str, model: str, n_gen: int, reps: int, threads: int | None) -> dict:
    """One measurement in this (fresh) process: the decode entry of run_bench's JSON, with the thread count."""
    from polystrata import zoo

    path = zoo.resolve_model(model)
    if engine == "llama.cpp":
        sys.path.insert(0, str(SCRIPTS))
        from bench_vs_llamacpp import _llamacpp_bench

        return {**_llamacpp_bench(path, 0, n_gen, reps, threads, 0)["tg"], "threads": threads}
    from polystrata import threads as host_threads
    from polystrata.bench import run_bench

    host_threads.configure(threads)
    r = run_bench(path, "cpu", n_prompt=0, n_gen=n_gen, repetitions=reps)
    return {**r["tg"], "threads": r["n_threads"]}


def _measure(name: str, model: str, n_gen: int, reps: int) -> dict:
    engine, env, threads = CONFIGS[name]
    cmd = [sys.executable, __file__, "--child", engine, model, "-n", str(n_gen), "-r", str(reps)]
    if threads:
        cmd += ["--threads", str(threads)]
    out = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"error: {name} failed: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _busy(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def main(argv: list[str] | None = None) -> int:
    """Measure every configuration quiet and busy; print a markdown table (or JSON)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("-n", "--n-gen", type=int, default=64, help="decoded tokens per repetition")
    ap.add_argument("-r", "--repetitions", type=int, default=3)
    ap.add_argument("--load", type=int, default=2, help="busy-loop processes on the busy machine (0: quiet only)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names of CONFIGS")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", choices=["polystrata", "llama.cpp"], help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(_child(a.child, a.model, a.n_gen, a.repetitions, a.threads)))
        return 0
    names = list(dict.fromkeys(c.strip() for c in a.configs.split(",")))  # each once: results are keyed by name
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        ap.error(f"unknown configuration {unknown[0]!r}; known: {', '.join(CONFIGS)}")
    results: dict[str, dict[str, dict]] = {}
    states = ("quiet", "busy") if a.load else ("quiet",)
    for state in states:
        load = _busy(a.load) if state == "busy" else []
        try:
            for name in names:
                print(f"{state}: {name} ...", file=sys.stderr, flush=True)
                load_before = os.getloadavg()[0]
                r = _measure(name, a.model, a.n_gen, a.repetitions)
                # The machine's own load (other users) says how quiet "quiet" was.
                r["loadavg"] = (load_before + os.getloadavg()[0]) / 2
                results.setdefault(name, {})[state] = r
        finally:
            for p in load:
                p.kill()
                p.wait()
    if a.json:
        print(json.dumps(results))
        return 0
    heads = ["quiet tok/s", f"busy ({a.load} spinning processes) tok/s"][: len(states)]
    print(f"| configuration | threads | {' | '.join(heads)} | load average |")
    print("|---" * (len(heads) + 3) + "|")
    for name, r in results.items():
        cells = [f"{r[s]['tok_s_mean']:.1f} ± {r[s]['tok_s_sd']:.1f}" for s in states]
        loads = " / ".join(f"{r[s]['loadavg']:.1f}" for s in states)
        print(f"| {name} | {r['quiet']['threads']} | {' | '.join(cells)} | {loads} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

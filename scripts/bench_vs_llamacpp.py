#!/usr/bin/env python3
"""PolyStrata vs llama.cpp, side by side in one run on one machine: prefill (pp) and decode (tg) tok/s.

PolyStrata is measured by `polystrata.bench.run_bench` (what `polystrata bench --json` prints); llama.cpp through
llama-cpp-python with the same thread count and n_batch 512, timed like llama-bench: pp is one eval of p tokens,
tg is n single-token evals from an empty context. Both see the same seeded random token ids, get one untimed
warm-up pass per shape, and are repeated r times (mean ± sd). Run by hand, not by CI:

    python scripts/bench_vs_llamacpp.py [MODEL] [--target cpu] [-p 512] [-n 128] [-r 3] [--tuning both] [--json]

`--tuning both` measures PolyStrata twice, without and with the tuning database's knobs (`polystrata tune`), before
llama.cpp, so both sit beside the same anchor (issue 20's benchmark).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from polystrata import bench, zoo
from polystrata.errors import PolystrataError
from polystrata.runtimes.base import cpu_name
from polystrata.targets import TARGETS


def _llamacpp_bench(path, n_prompt: int, n_gen: int, reps: int, threads: int, seed: int,
                    n_ctx: int | None = None) -> dict:
    """llama.cpp numbers through llama-cpp-python, in the same shape as PolyStrata's pp/tg entries (a context of
    `n_ctx` tokens, default just what the tests need)."""
    try:
        from llama_cpp import Llama
    except ImportError as e:
        raise PolystrataError(f"llama-cpp-python is not installed ({e}); pip install llama-cpp-python") from None

    llm = Llama(
        model_path=str(path),
        n_ctx=n_ctx or max(n_prompt, n_gen, 1) + 8,
        n_batch=512,
        n_ubatch=512,
        n_threads=threads,
        n_threads_batch=threads,
        logits_all=False,
        verbose=False,
    )
    n_vocab = llm.n_vocab()
    # The same draws as run_bench with the same seed: pp ids first, then the first decode token and the offsets.
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, n_vocab, size=n_prompt, dtype=np.int32).tolist() if n_prompt else []
    first = int(rng.integers(0, n_vocab))
    offsets = rng.integers(0, n_vocab, size=(reps + 1, n_gen)) if n_gen else None

    def prefill() -> float:
        llm.reset()  # eval() drops the KV cells past n_tokens, so this empties the context
        t0 = time.perf_counter()
        llm.eval(ids)
        return time.perf_counter() - t0

    def decode(row: np.ndarray) -> float:
        llm.reset()
        tok = first
        t0 = time.perf_counter()
        for off in row:
            llm.eval([tok])
            # The same feedback as PolyStrata's decode loop: argmax plus a random offset.
            tok = (int(np.argmax(llm.scores[llm.n_tokens - 1])) + int(off)) % n_vocab
        return time.perf_counter() - t0

    out: dict = {"pp": None, "tg": None, "version": _llamacpp_version()}
    if n_prompt:
        prefill()
        rates = [n_prompt / prefill() for _ in range(reps)]
        out["pp"] = bench.rate_stats(n_prompt, rates)
    if n_gen:
        decode(offsets[0, :4])
        rates = [n_gen / decode(offsets[i + 1]) for i in range(reps)]
        out["tg"] = bench.rate_stats(n_gen, rates)
    if hasattr(llm, "close"):  # frees the model now rather than at interpreter exit
        llm.close()
    return out


def _llamacpp_version() -> str:
    try:
        import llama_cpp

        return getattr(llama_cpp, "__version__", "?")
    except ImportError:
        return "?"


def _fmt(e: dict | None) -> str:
    return "-" if e is None else f"{e['tok_s_mean']:.2f} ± {e['tok_s_sd']:.2f}"


def main(argv: list[str] | None = None) -> int:
    """Run both engines and print the comparison; returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=zoo.DEFAULT_MODEL, help="GGUF path or zoo name (default: %(default)s)")
    ap.add_argument("--target", default="cpu", help="PolyStrata target (default: cpu; reference works everywhere)")
    ap.add_argument("-p", "--n-prompt", type=int, default=512)
    ap.add_argument("-n", "--n-gen", type=int, default=128)
    ap.add_argument("-r", "--repetitions", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-c", "--ctx-size", type=int, default=None,
                    help="both engines' context (default: what the tests need); kernels tuned for a context"
                         " (attention's) apply at that context only")
    ap.add_argument("--tuning", choices=("on", "off", "both"), default="on",
                    help="PolyStrata with the tuning database's knobs, without, or both runs (default: %(default)s)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    a = ap.parse_args(argv)

    known = tuple(TARGETS)
    if a.target not in known:
        print(
            f"error: PolyStrata target '{a.target}' is not available in this checkout yet "
            f"(available: {', '.join(known)}); try --target reference",
            file=sys.stderr,
        )
        return 2
    say = None if a.json else (lambda msg: print(f"polystrata {msg}", file=sys.stderr, flush=True))
    try:
        path = zoo.resolve_model(a.model)
        runs = {}
        for tuned in {"on": (True,), "off": (False,), "both": (False, True)}[a.tuning]:
            try:
                runs["tuned" if tuned else "untuned"] = bench.run_bench(
                    path, a.target, a.n_prompt, a.n_gen, a.repetitions, a.seed, progress=say, tuning=tuned,
                    n_ctx=a.ctx_size)
            except PolystrataError as e:
                # A target listed but not working yet (kernels still being written) fails at load or first run.
                print(f"error: PolyStrata target '{a.target}' cannot run this model yet: {e}", file=sys.stderr)
                return 1
        ps = next(iter(runs.values()))
        if not a.json:
            print(f"llama.cpp: {ps['n_threads']} threads, n_batch 512 ...", file=sys.stderr, flush=True)
        lc = _llamacpp_bench(path, a.n_prompt, a.n_gen, a.repetitions, ps["n_threads"], a.seed, a.ctx_size)
    except PolystrataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1

    ratio = {name: {t: (r[t]["tok_s_mean"] / lc[t]["tok_s_mean"] if r[t] and lc[t] else None) for t in ("pp", "tg")}
             for name, r in runs.items()}
    machine = {"cpu": cpu_name(), "threads": ps["n_threads"]}
    if a.json:
        if a.tuning != "both":
            print(json.dumps({"model": str(path), "machine": machine, "polystrata": ps, "llamacpp": lc,
                              "ratio": next(iter(ratio.values()))}))
        else:
            print(json.dumps({"model": str(path), "machine": machine, "polystrata": runs, "llamacpp": lc,
                              "ratio": ratio, "tuned_over_untuned": bench.tuning_ratios(runs["untuned"],
                                                                                          runs["tuned"])}))
        return 0

    print(f"model:   {path.name} ({ps['model_label']})")
    print(f"machine: {machine['cpu']}, {machine['threads']} threads")
    print(f"polystrata: target {ps['target']} on {ps['device']}; llama.cpp: llama-cpp-python {lc['version']}")
    for name, r in runs.items():
        if name == "tuned":
            print(f"tuned: {len(r['tuned_kernels'])} kernel instances with the tuning database's knobs")
    print()
    rows = [("test", "polystrata t/s", "llama.cpp t/s", "ratio")]
    for t in ("pp", "tg"):
        for name, r in runs.items():
            if r[t] is None:
                continue
            x = ratio[name][t]
            label = f"{t}{r[t]['n']}" + (f" {name}" if a.tuning == "both" else "")
            rows.append((label, _fmt(r[t]), _fmt(lc[t]), "-" if x is None else f"{x:.3f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for j, row in enumerate(rows):
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if j == 0:
            print("  ".join("-" * w for w in widths))
    print()
    print("ratio = PolyStrata / llama.cpp (higher is better for PolyStrata)")
    if ps["roofline_pct"] is not None:
        print(f"polystrata tg at {ps['roofline_pct']:.1f}% of the roofline ({ps['bandwidth_source']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

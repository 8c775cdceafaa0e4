"""`polystrata bench`: prefill and decode speed of a model on a target, in the spirit of llama-bench.

Prefill (pp) times one forward over `p` random tokens; decode (tg) times `n` single-token forwards, each fed the
argmax of the last plus a random offset (`_decode_once`). Both start after `depth` tokens of context (llama-bench's
`-d`; 0, an empty context, by default): the depth is filled once, untimed (`_fill_depth`), and every timed run
rewinds the cache to it. Each shape is run once untimed first so JIT compilation and first-touch allocation are not
measured. Decode is also put against the memory-bandwidth roofline: every decoded token must stream the weights of
the decode graph from memory once.

For MoE models `--json` has "experts": the expert cache's policy, slots per layer, hit rate, bytes over the host
link and milliseconds stalled on uploads per decoded token (policy "resident": every expert on the device); and
"gpu_mem", the device-memory budget in bytes (None without one).

The `--json` keys are read by other tools (scripts/bench_vs_llamacpp.py among them): keep them stable.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from polystrata import progress as progress_lines
from polystrata.cli import (
    ctx_arg,
    knob_arg,
    memory_args,
    memory_kwargs,
    model_arg,
    seed_arg,
    target_arg,
    threads_arg,
    ubatch_arg,
)
from polystrata.errors import PolystrataError, UsageError
from polystrata.runtimes.base import cpu_name
from polystrata.runtimes.memory import fmt_bytes
from polystrata.targets import is_host
from polystrata.threads import usable_cpus

BANDWIDTH_ENV = "POLYSTRATA_BANDWIDTH"

# Read bandwidth in bytes/s of devices we know, matched by substring of the device description (case-insensitive).
KNOWN_BANDWIDTH: dict[str, float] = {
    "H200": 4.29e12,  # measured read bandwidth, not the 4.8 TB/s datasheet figure
}

_MEASURE_BYTES = 256 * 2**20
_MEASURE_REPS = 4


# --- machine ---------------------------------------------------------------------------------------------------


def engine_threads(engine) -> int:
    """Threads the engine computes with: what it says, else what its runtime says (host targets), else the
    usable CPUs."""
    n = getattr(engine, "n_threads", None)
    if isinstance(n, int) and n > 0:
        return n
    runtime = getattr(engine, "runtime", None)
    return (runtime.threads() if runtime is not None else None) or usable_cpus()


def measure_cpu_bandwidth(nbytes: int | None = None, reps: int = _MEASURE_REPS, threads: int | None = None) -> float:
    """Host memory read bandwidth in bytes/s: best of `reps` threaded numpy sums over an `nbytes` array.

    numpy reductions release the GIL, so one slice per thread reads memory in parallel, as a multi-threaded
    decode would. The array is far larger than any cache, so this measures DRAM, not cache.
    """
    threads = threads or usable_cpus()
    nbytes = nbytes or _MEASURE_BYTES
    a = np.ones(max(nbytes // 8, threads), dtype=np.float64)  # np.ones touches every page: no faults in the timing
    chunks = np.array_split(a, threads)
    best = float("inf")
    with ThreadPoolExecutor(threads) as ex:
        for _ in range(reps):
            t0 = time.perf_counter()
            list(ex.map(np.sum, chunks))
            best = min(best, time.perf_counter() - t0)
    return a.nbytes / best


def describe_device(engine, target: str) -> str:
    """What runs the model: the engine's own description, with the CPU model name added for host targets."""
    dev = getattr(engine, "device", None)
    if not is_host(target):
        return str(dev) if dev else target
    name = cpu_name()
    if not dev or str(dev) == name:
        return name
    # The reference engine says only "host CPU (...)"; the hardware is what makes numbers comparable.
    return str(dev) if name in str(dev) else f"{name}, {dev}"


def resolve_bandwidth(device: str, is_host_cpu: bool, threads: int) -> tuple[float | None, str | None]:
    """(bytes/s, where it came from): the env override, else the known-device table, else measured for a CPU."""
    env = os.environ.get(BANDWIDTH_ENV)
    if env:
        try:
            bw = float(env)
        except ValueError:
            bw = 0.0
        if not bw > 0:
            raise PolystrataError(f"{BANDWIDTH_ENV} must be a positive number of bytes/s, got '{env}'")
        return bw, f"env {BANDWIDTH_ENV}"
    for key, bw in KNOWN_BANDWIDTH.items():
        if key.lower() in device.lower():
            return bw, f"table ({key})"
    if is_host_cpu:
        mib = _MEASURE_BYTES // 2**20
        return measure_cpu_bandwidth(threads=threads), f"measured (numpy sum over {mib} MiB, {threads} threads)"
    return None, None


# --- model -----------------------------------------------------------------------------------------------------


def decode_bytes_per_token(engine) -> int:
    """Weight bytes one decoded token must read: every decode weight once, except that an embedding table that
    is not also the output matrix contributes one row (a gather), and routed expert tensors contribute the
    share of experts a token uses (k of n)."""
    tensors = engine.file.tensors
    hp = engine.hparams
    tied = "output.weight" not in tensors
    total = 0
    for name in engine.graph_last.weights:
        t = tensors[name]
        if name == "token_embd.weight" and not tied:
            total += t.nbytes // t.shape[0]
        elif "_exps." in name and hp.n_expert:
            total += t.nbytes * hp.n_expert_used // hp.n_expert
        else:
            total += t.nbytes
    return total


def _model_label(engine) -> str:
    """llama-bench-like model column: architecture, parameter count and dominant weight format."""
    by_fmt: dict[str, int] = {}
    for t in engine.file.tensors.values():
        by_fmt[t.fmt.name] = by_fmt.get(t.fmt.name, 0) + t.nbytes
    fmt = max(by_fmt, key=by_fmt.get) if by_fmt else "?"
    return f"{engine.hparams.arch} {_params(engine) / 1e6:.0f}M {fmt}"


def _params(engine) -> int:
    return sum(int(np.prod(t.shape)) for t in engine.file.tensors.values())


# --- timing ----------------------------------------------------------------------------------------------------


def tuned_instances(engine) -> list[str]:
    """The kernel instances whose knobs came from the tuning database in `engine`'s plans (none on the
    reference)."""
    from polystrata.tuning import tuned_signatures

    return tuned_signatures(engine.executor.plans) if getattr(engine, "runtime", None) is not None else []


def rate_stats(n: int, rates: list[float]) -> dict:
    """The pp/tg JSON entry: token count, mean and sample standard deviation of tok/s, and every repetition."""
    return {
        "n": n,
        "tok_s_mean": statistics.fmean(rates),
        "tok_s_sd": statistics.stdev(rates) if len(rates) > 1 else 0.0,
        "tok_s": rates,
    }


def time_steps(rt, step: Callable[[int], None], iters: int) -> tuple[float, bool]:
    """Seconds per call of `step(i)` (launches on runtime `rt`) over `iters` calls, and whether they were replayed
    from one captured device graph: where the runtime has graphs (`rt.graphs`) they are, so the time is the
    device's, not the host's per-launch cost (which a graph-replayed decode step does not pay either)."""
    graph = None
    if rt.graphs:
        rt.begin_capture()
        for i in range(iters):
            step(i)
        graph = rt.end_capture()
        rt.replay(graph)  # the first replay uploads the graph
        rt.sync()
    t0 = time.perf_counter()
    if graph is not None:
        rt.replay(graph)
    else:
        for i in range(iters):
            step(i)
    rt.sync()
    return (time.perf_counter() - t0) / iters, graph is not None


# `-d`: tokens prefilled for real; the rest of the depth repeats their K/V rows (see `_fill_depth`).
DEPTH_PREFILL = 512


def _fill_depth(engine, depth: int, rng: np.random.Generator) -> None:
    """Put `depth` tokens of context in the cache: the first DEPTH_PREFILL prefilled from random tokens and, on
    kernel targets, their K/V rows repeated up to `depth`. Attention reads every visible row and does the same
    arithmetic whatever the rows hold, so decode and prefill after the depth take the time they take after a real
    prefill, without the minutes a real 32k-token prefill costs (llama-bench's -d prefills for real)."""
    ex = engine.executor
    real = depth if engine.runtime is None else min(depth, DEPTH_PREFILL)
    engine.reset()
    engine.forward(rng.integers(0, engine.hparams.n_vocab, size=real, dtype=np.int32))
    if real == depth:
        return
    rt = ex.rt
    kv = {name: spec for plan in ex.plans.values() for name, spec in plan.buffers.items() if spec.kind == "kv"}
    for name, spec in kv.items():
        row = spec.count // ex.n_ctx  # bytes of one token's row
        prefix = rt.download(ex.handles[name], (real * row,), spec.dtype)
        rt.write_region(ex.handles[name], 0, np.resize(prefix, depth * row))
    ex.n_past = depth


def _prefill_once(engine, ids: np.ndarray, depth: int = 0) -> float:
    engine.rewind(depth)
    t0 = time.perf_counter()
    logits = engine.forward(ids)
    np.asarray(logits)  # a lazy/asynchronous target must have finished before the clock stops
    return time.perf_counter() - t0


def _decode_once(engine, first: int, offsets: np.ndarray, host: list[float] | None = None, depth: int = 0) -> float:
    """Seconds for `len(offsets)` decode steps after `depth` tokens of context; appends each step's host time (wall
    less device time) to `host`. Step i feeds (argmax + offsets[i]) mod n_vocab: each step depends on the previous
    one's logits, as real decoding does, while the tokens are as random as llama-bench's (a random model's argmax
    repeats itself, which would make MoE routing, and so an expert cache, look better than it is)."""
    engine.rewind(depth)
    n_vocab = engine.hparams.n_vocab
    tok = first
    t0 = time.perf_counter()
    for off in offsets:
        t_step = time.perf_counter()
        tok = (int(np.argmax(engine.forward([tok])[-1])) + int(off)) % n_vocab
        device_s = getattr(engine.executor, "last_device_s", None)
        if host is not None and device_s is not None:
            host.append(time.perf_counter() - t_step - device_s)
    return time.perf_counter() - t0


def run_bench(
    model: str | os.PathLike[str],
    target: str = "auto",
    n_prompt: int = 512,
    n_gen: int = 128,
    repetitions: int = 3,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    kv_type: str = "f16",
    depth: int = 0,
    n_ctx: int | None = None,
    memory: dict | None = None,
    tuning: bool = True,
    knobs: dict | None = None,
    n_ubatch: int | None = None,
) -> dict:
    """Benchmark `model` on `target` with a KV cache of `kv_type` holding `n_ctx` tokens (default: just what the
    tests need, depth + max(p, n)); returns the `--json` object (see the module docstring for its meaning).
    `memory`: the Engine's memory options (gpu_mem, expert_slots, expert_policy). `tuning`: the tuning
    database's knobs (`polystrata.tuning`), recorded in the result with how many kernel instances they set.
    `knobs`: knob space -> knob -> value for every kernel of the space (`parse_knobs`; the Engine's). `n_ubatch`:
    the step size (llama-bench's -ub; the Engine's, whose default the result's "n_ubatch" then names); the default
    context holds at least one step of it."""
    from polystrata import zoo
    from polystrata.engine import Engine

    if n_prompt < 0 or n_gen < 0:
        raise PolystrataError("-p and -n must be >= 0")
    if n_prompt == 0 and n_gen == 0:
        raise PolystrataError("nothing to measure: -p and -n are both 0")
    if repetitions < 1:
        raise PolystrataError("-r must be at least 1")
    if depth < 0:
        raise PolystrataError("-d must be >= 0")
    need = depth + max(n_prompt, n_gen)
    if n_ctx is not None and n_ctx < need:
        raise PolystrataError(f"the context (-c {n_ctx}) must hold depth + max(p, n) = {need} tokens")
    say = progress or (lambda _msg: None)

    path = zoo.resolve_model(model)
    # Every test starts after `depth` tokens, so the cache only needs to hold that and the longest test (and a
    # step size asked for: its plans are what -ub measures, even where the test's prompt is shorter).
    engine = Engine(path, target=target, n_ctx=n_ctx or max(need, n_ubatch or 0), kv_type=kv_type, tuning=tuning,
                    knobs=knobs, n_ubatch=n_ubatch, **(memory or {}))
    target = getattr(engine, "target", target)  # `auto` resolved to what actually runs
    threads = engine_threads(engine)
    device = describe_device(engine, target)
    is_host_cpu = is_host(target)

    rng = np.random.default_rng(seed)
    n_vocab = engine.hparams.n_vocab
    result: dict = {
        "model": str(path),
        "model_label": _model_label(engine),
        "model_size_bytes": sum(t.nbytes for t in engine.file.tensors.values()),
        "n_params": _params(engine),
        "target": target,
        "device": device,
        "n_threads": threads,
        "repetitions": repetitions,
        "seed": seed,
        "kv_type": kv_type if target != "reference" else "f32",  # the reference executor keeps f32 K and V
        "depth": depth,
        "n_ctx": engine.n_ctx,
        "n_ubatch": engine.n_ubatch,
        "tuning": tuning,
        "knobs": knobs or {},
        "tuned_kernels": tuned_instances(engine),
        "pp": None,
        "tg": None,
    }

    if depth:
        say(f"depth {depth}: filling the cache")
        t0 = time.perf_counter()
        _fill_depth(engine, depth, rng)
        engine.checkpoint()  # where each run rewinds to (models with a recurrent state need it)
        say(f"depth {depth}: filled in {time.perf_counter() - t0:.1f} s")

    if n_prompt:
        ids = rng.integers(0, n_vocab, size=n_prompt, dtype=np.int32)
        say(f"pp{n_prompt}: warm-up")
        _prefill_once(engine, ids, depth)
        rates = []
        for i in range(repetitions):
            rates.append(n_prompt / _prefill_once(engine, ids, depth))
            say(f"pp{n_prompt}: {i + 1}/{repetitions} {rates[-1]:.2f} tok/s")
        result["pp"] = rate_stats(n_prompt, rates)

    if n_gen:
        first = int(rng.integers(0, n_vocab))
        # A row of token offsets for the warm-up and one for each repetition: no two runs route alike.
        offsets = rng.integers(0, n_vocab, size=(repetitions + 1, n_gen))
        say(f"tg{n_gen}: warm-up")
        _decode_once(engine, first, offsets[0, :4], depth=depth)  # the shape-1 graph at a few cache lengths
        rates, host = [], []
        streamer = getattr(engine.executor, "streamer", None)
        if streamer is not None:  # the expert statistics are those of the timed decode runs
            streamer.reset_stats()
        engine.executor.time_device = True  # executors without device timing ignore it
        for i in range(repetitions):
            rates.append(n_gen / _decode_once(engine, first, offsets[i + 1], host, depth))
            say(f"tg{n_gen}: {i + 1}/{repetitions} {rates[-1]:.2f} tok/s")
        engine.executor.time_device = False
        result["tg"] = rate_stats(n_gen, rates)
        # Host time per token: a decode step's wall time (the argmax included) less its device time, on runtimes
        # that time device work with events (cuda, hip); None elsewhere.
        result["host_ms_per_token"] = round(1e3 * statistics.median(host), 4) if host else None

    bpt = decode_bytes_per_token(engine)
    bw, source = resolve_bandwidth(device, is_host_cpu, threads)
    roof = None
    if bw and result["tg"]:
        roof = 100.0 * bpt * result["tg"]["tok_s_mean"] / bw
    result.update(bytes_per_token=bpt, bandwidth_bytes_s=bw, bandwidth_source=source, roofline_pct=roof)
    mem = getattr(engine, "memory", None)
    result["gpu_mem"] = mem.budget if mem is not None else None
    if engine.hparams.n_expert:
        streamer = getattr(engine.executor, "streamer", None)
        result["experts"] = streamer.summary() if streamer is not None else {
            "policy": "resident", "slots": engine.hparams.n_expert, "hit_rate": 1.0, "link_bytes_per_token": 0.0,
            "stall_ms_per_token": 0.0, "device_resolved": 0.0}
    return result


# --- output ----------------------------------------------------------------------------------------------------


def format_table(r: dict) -> str:
    """llama-bench-style markdown table, then the roofline line and, where measured, the host time a token."""
    head = ["model", "size", "params", "target", "device", "threads", "n_ubatch", "test", "t/s"]
    rows = []
    for test in ("pp", "tg"):
        e = r[test]
        if e is None:
            continue
        rows.append(
            [
                r["model_label"],
                fmt_bytes(r["model_size_bytes"]),
                f"{r['n_params'] / 1e6:.1f} M",
                r["target"],
                r["device"],
                str(r["n_threads"] or "-"),
                str(r["n_ubatch"]),
                f"{test}{e['n']}" + (f" @ d{r['depth']}" if r.get("depth") else ""),
                f"{e['tok_s_mean']:.2f} ± {e['tok_s_sd']:.2f}",
            ]
        )
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    right = {1, 2, 5, 6, 8}  # numbers right-aligned, as llama-bench does

    def line(cells: list[str]) -> str:
        return (
            "| "
            + " | ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
            + " |"
        )

    sep = "| " + " | ".join("-" * (w - 1) + (":" if i in right else "-") for i, w in enumerate(widths)) + " |"
    out = [line(head), sep, *(line(row) for row in rows), ""]
    bw = r["bandwidth_bytes_s"]
    mem = f"decode reads {fmt_bytes(r['bytes_per_token'])} of weights per token"
    if bw:
        mem += f"; memory bandwidth {bw / 1e9:.1f} GB/s, {r['bandwidth_source']}"
        if r["roofline_pct"] is not None:
            mem += f"; tg at {r['roofline_pct']:.1f}% of the bandwidth roofline"
    else:
        mem += f"; bandwidth of this device unknown (set {BANDWIDTH_ENV} in bytes/s for a roofline)"
    out.append(mem)
    out.append(f"KV cache: {r['kv_type']}, {r['n_ctx']} tokens")
    if r.get("host_ms_per_token") is not None:
        out.append(f"host time per decoded token: {r['host_ms_per_token']:.3f} ms (step wall time less device time)")
    return "\n".join(out)


CSV_FIELDS = ("model", "size_bytes", "n_params", "target", "device", "n_threads", "kv_type", "n_ctx", "n_ubatch",
              "depth", "test", "n_tokens", "tok_s_mean", "tok_s_sd", "bytes_per_token", "roofline_pct")


def format_csv(r: dict) -> str:
    """A CSV header and one row per test (pp, tg), as llama-bench -o csv; the fields of `CSV_FIELDS`."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_FIELDS)
    for test in ("pp", "tg"):
        e = r[test]
        if e is not None:
            w.writerow([r["model_label"], r["model_size_bytes"], r["n_params"], r["target"], r["device"],
                        r["n_threads"], r["kv_type"], r["n_ctx"], r["n_ubatch"], r.get("depth", 0), test, e["n"],
                        e["tok_s_mean"], e["tok_s_sd"], r["bytes_per_token"],
                        r["roofline_pct"] if test == "tg" else None])
    return buf.getvalue().rstrip("\n")


OUTPUT_FORMATS = ("md", "json", "csv")


# --- CLI -------------------------------------------------------------------------------------------------------


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `bench` subcommand and its options to `subparsers`; returns its parser."""
    p = subparsers.add_parser("bench", help="prefill and decode speed (tok/s), like llama-bench")
    model_arg(p)
    target_arg(p)
    ctx_arg(p, "depth + max(p, n), and at least -ub")
    ubatch_arg(p)
    threads_arg(p)
    p.add_argument("-d", "--depth", type=int, default=0, help="tokens of context before each test (llama-bench -d)")
    p.add_argument("-p", "--n-prompt", type=int, default=512, help="prefill test tokens; 0 skips it")
    p.add_argument("-n", "--n-gen", type=int, default=128, help="decode test tokens; 0 skips it")
    p.add_argument("-r", "--repetitions", type=int, default=3, help="timed runs of each test")
    p.add_argument("--seed", type=seed_arg, default=0, help="seed of the random token ids")
    p.add_argument("-o", "--output", dest="output_format", choices=OUTPUT_FORMATS, default="md",
                   help="md: the table; json: one JSON object; csv: a header and one row per test (llama-bench -o)")
    p.add_argument("--json", dest="output_format", action="store_const", const="json", help="the same as -o json")
    p.add_argument("--tuning", choices=("on", "off", "both"), default="on",
                   help="the tuning database's knobs (polystrata tune): on, off (= --no-tuning), or both: the model "
                        "benched without them, then with them, and the ratios")
    knob_arg(p)
    memory_args(p)
    return p


def parse_knobs(items: list[str]) -> dict:
    """SPACE.NAME=VALUE strings -> {space: {name: value}} (integers where they parse), each knob one that a
    recipe's knob space declares."""
    from polystrata.codegen.recipes import RECIPES, load_all

    load_all()
    spaces = {r.knobs.name: r.knobs for r in RECIPES if r.knobs is not None}
    knobs: dict = {}
    for item in items:
        key, eq, val = item.partition("=")
        space, _, name = key.partition(".")
        if not eq or space not in spaces or name not in spaces[space].defaults():
            known = ", ".join(sorted(spaces))
            raise UsageError(f"--knob {item!r}: expected SPACE.NAME=VALUE with a knob of one of the spaces {known}")
        knobs.setdefault(space, {})[name] = int(val) if val.lstrip("-").isdigit() else val
    return knobs


def tuning_ratios(untuned: dict, tuned: dict) -> dict:
    """Tuned over untuned tok/s of each test both ran."""
    return {test: tuned[test]["tok_s_mean"] / untuned[test]["tok_s_mean"]
            for test in ("pp", "tg") if untuned[test] and tuned[test] and untuned[test]["tok_s_mean"] > 0}


def cmd_bench(a) -> int:
    """Run `polystrata bench`: the table (or one JSON object) on stdout, progress on stderr. `--tuning both`:
    the untuned run, then the tuned one; md prints both tables and the ratios, json an object {"untuned",
    "tuned", "ratio"}."""
    mode = "off" if a.no_tuning else a.tuning
    if mode == "both" and a.output_format == "csv":
        raise UsageError("--tuning both prints md or json, not csv")
    progress = (lambda msg: print(f"bench: {msg}", file=sys.stderr, flush=True)) if progress_lines.enabled else None
    knobs = parse_knobs(a.knob)
    runs = {}
    for tuning in {"on": (True,), "off": (False,), "both": (False, True)}[mode]:
        runs[tuning] = run_bench(
            a.model,
            target=a.target,
            n_prompt=a.n_prompt,
            n_gen=a.n_gen,
            repetitions=a.repetitions,
            seed=a.seed,
            progress=progress,
            kv_type=a.kv_type,
            depth=a.depth,
            n_ctx=a.ctx,
            memory=memory_kwargs(a),
            tuning=tuning,
            knobs=knobs,
            n_ubatch=a.n_ubatch,
        )
    if mode != "both":
        (r,) = runs.values()
        print({"json": json.dumps, "csv": format_csv, "md": format_table}[a.output_format](r))
        return 0
    ratio = tuning_ratios(runs[False], runs[True])
    if a.output_format == "json":
        print(json.dumps({"untuned": runs[False], "tuned": runs[True], "ratio": ratio}))
        return 0
    for tuning, r in runs.items():
        print(f"tuning {'on' if tuning else 'off'} ({len(r['tuned_kernels'])} tuned kernel instances):")
        print(format_table(r) + "\n")
    print("tuned / untuned: " + ", ".join(f"{test} x{v:.3f}" for test, v in ratio.items()))
    return 0

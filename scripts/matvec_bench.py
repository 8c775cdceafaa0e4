"""Decode-shaped dequantize x matrix-vector product through the compiler and a target: achieved weight bandwidth.

The weight is [rows, cols] in a GGUF format (default Q4_K 4096 x 14336, llama3-8b's ffn_down), quantized from
random data; several copies of it, each in its own device buffer, rotate so that consecutive launches do not find
the weight in the L2 cache (it caches addresses, not contents: one quantization serves every copy). The result is
checked against numpy on the dequantized weight before timing.

    python scripts/matvec_bench.py --target cuda [--format Q4_K] [--rows 4096] [--cols 14336] [--bandwidth 4.29e12]

`--tokens T` (> 1) measures the prefill matmul of T tokens instead (the plan's prompt-chunk kernels: tile products
on matrix units where the target has them) and reports its TFLOP/s (2 x rows x cols x T per step).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from polystrata.bench import time_steps
from polystrata.compiler import build_plan
from polystrata.ir.encode import quantize
from polystrata.ir.evaluate import dequantize
from polystrata.ir.formats import FORMATS, KV_FORMATS, by_name
from polystrata.ir.graph import Graph
from polystrata.ir.layout import repack
from polystrata.runtimes.base import eval_int
from polystrata.targets import make_runtime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="cuda")
    ap.add_argument("--format", default="Q4_K")
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=14336)
    ap.add_argument("--copies", type=int, default=4, help="weight copies rotated to defeat the L2 cache")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=1, help="tokens a step (> 1: a prefill matmul, reported in TFLOP/s)")
    ap.add_argument("--bandwidth", type=float, default=4.29e12, help="bytes/s to compare with (H200 measured read)")
    ap.add_argument("--knob", action="append", default=[], metavar="RECIPE.NAME=VALUE",
                    help="schedule knob override, e.g. matmul.sub=2 (repeatable)")
    ap.add_argument("--arch", help="only compile the kernels, for this GPU architecture (e.g. sm_90; no GPU needed), "
                    "into the kernel cache (scripts/device_kernels.sh)")
    a = ap.parse_args()
    knobs: dict = {}
    for kv in a.knob:
        key, val = kv.split("=", 1)
        recipe, name = key.split(".", 1)
        knobs.setdefault(recipe, {})[name] = int(val) if val.lstrip("-").isdigit() else val
    fmt = by_name(a.format)
    rt = make_runtime(a.target, arch=a.arch)
    # tokens -> one row of an F32 table (the activation) -> the matmul under test; only the latter is timed.
    g = Graph(arch="bench")
    tok = g.input("tokens", "i32", ("T",))
    g.input("positions", "i32", ("T",))
    x = g.op("embed", g.weight("table", "F32", (1, a.cols)), tok)
    y = g.op("matmul", x, g.weight("w", fmt.name, (a.rows, a.cols)))
    g.outputs.append(y)
    nt = a.tokens
    plan = build_plan(g, {"w": fmt, "table": FORMATS["F32"]}, KV_FORMATS["f16"], 16, nt, knobs=knobs,
                      policy=rt.policy)
    if rt.compile_only:
        for la in plan.launches:
            rt.compile(la.kernel)
        print(f"{rt.cache_hits + rt.cache_misses} distinct kernels for {rt.arch}: {rt.cache_misses} compiled, "
              f"{rt.cache_hits} from the cache")
        return
    rng = np.random.default_rng(0)
    raw = quantize(fmt, rng.standard_normal((a.rows, a.cols)).astype(np.float32))
    xs = rng.standard_normal(a.cols).astype(np.float32)
    bufs = {name: rt.alloc((spec.count,), spec.dtype) for name, spec in plan.buffers.items() if spec.kind != "weight"}
    rt.write(bufs["tokens"], np.zeros(nt, np.int32))
    bufs["table"] = rt.upload(xs)
    packed = repack(raw, fmt, plan.buffers["w"].fmt)  # in the layout the plan reads
    weights = [rt.upload(packed) for _ in range(a.copies)]
    embed, *rest = plan.launches
    launches = []
    started = time.perf_counter()
    for c in range(a.copies):
        handles = dict(bufs, w=weights[c])
        step = []
        for la in [embed, *rest]:
            env = {n: (nt if v == "T" else v) for n, v in la.scalars}
            args = rt.args_for(la.kernel, {p: handles[b] for p, b in la.buffers}, env)
            ck = rt.compile(la.kernel)
            grid = [eval_int(e, env) for e in la.kernel.grid]
            step.append(rt.prepare(ck, args, grid))
        launches.append(step)
    compile_s = time.perf_counter() - started  # the kernels' compiles (cache hits: ~0)

    def run(c: int, first: int = 1) -> None:
        for h in launches[c][first:]:
            rt.launch_prepared(h)

    run(0, first=0)
    rt.sync()
    got = rt.download(bufs[plan.output], (nt, a.rows), "f32")
    want = np.broadcast_to(dequantize(fmt, raw, (a.rows, a.cols)) @ xs, (nt, a.rows))
    err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    for c in range(a.copies):
        run(c)
    rt.sync()

    def timed(first: int) -> tuple[float, bool]:
        """Seconds per step of launches[first:] (rotating the weight copies), graph-replayed where possible."""
        return time_steps(rt, lambda i: run(i % a.copies, first), a.iters)

    dt, graphed = timed(1)
    nbytes = raw.nbytes
    # Registers and occupancy, where the runtime's driver says (cuda); a prefill run prints them first, so that its
    # last two lines stay the figures (what scripts/device_check.sh's summary takes).
    resources = "\n".join(f"  {la.kernel.name}: lanes {la.kernel.lanes}, {rt.kernel_resources(rt.compile(la.kernel))}"
                          for la in rest)
    if nt > 1:
        print(resources)
        flops = 2 * a.rows * a.cols * nt
        print(f"matmul {a.format} {a.rows}x{a.cols} x {nt} tokens on {rt.device}: {dt * 1e6:.1f} us, "
              f"{flops / dt / 1e12:.1f} TFLOP/s, rel. error {err:.1e}, kernels "
              f"{', '.join(la.kernel.name for la in rest)}{' ' + ' '.join(a.knob) if a.knob else ''}")
        # The matmul without the activations' quantize launch before it: the kernels with groups at this row count
        # (the row count picks between gated kernels: tile products, split-K and their sum, matvecs).
        first = 2 if rest[0].kernel.name.startswith("quantize_x") else 1
        busy = [la.kernel for la in rest[first - 1:] if all(eval_int(e, {"T": nt}) > 0 for e in la.kernel.grid)]
        alone, _ = timed(first)
        print(f"  {' + '.join(k.name for k in busy)} alone: {alone * 1e6:.1f} us, {flops / alone / 1e12:.1f} "
              f"TFLOP/s, knobs {busy[0].knob_dict}, compiled in {compile_s:.0f} s")
    else:
        bw = nbytes / dt
        print(f"matvec {a.format} {a.rows}x{a.cols} on {rt.device}: {dt * 1e6:.1f} us, {bw / 1e9:.0f} GB/s = "
              f"{100 * bw / a.bandwidth:.0f}% of {a.bandwidth / 1e12:.2f} TB/s, rel. error {err:.1e}, "
              f"{len(rest)} launch(es){' (graph)' if graphed else ''}{' ' + ' '.join(a.knob) if a.knob else ''}")
        if len(rest) > 1:  # the activations quantized once, before: the matvec kernel on its own
            alone, _ = timed(len(rest))
            print(f"  {rest[-1].kernel.name} alone: {alone * 1e6:.1f} us, {100 * nbytes / alone / a.bandwidth:.0f}% "
                  f"(the quantize launch before it: {(dt - alone) * 1e6:.1f} us)")
        print(resources)


if __name__ == "__main__":
    main()

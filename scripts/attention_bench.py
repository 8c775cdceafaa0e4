"""One-token attention at depth through the compiler and a target: time per layer and achieved KV bandwidth.

Builds `--layers` attention ops (llama3-8b's heads by default: 32 query heads, 8 KV heads of 128) over KV caches
holding `--depth` tokens of random keys and values in a KV type, checks the output of each against numpy on the
dequantized cache, then times the step's attention launches (K/V store, attention, split-K combine) replayed from
a captured graph where the target captures them. Several layers' caches (each its own buffer) keep the L2 cache
from holding the keys between launches. `--knob attention.splits=N` etc. compare schedules; `--gguf-kv` keeps
the cache rows in the KV type's own blocks where the target's policy would split them (`Policy.kv_layout`).

    python scripts/attention_bench.py --target cuda --depth 8192 --kv-type q8_g64 [--knob attention.splits=130]
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np

from polystrata.bench import parse_knobs, time_steps
from polystrata.compiler import build_plan
from polystrata.ir.encode import quantize
from polystrata.ir.evaluate import dequantize
from polystrata.ir.formats import FORMATS, KV_FORMATS
from polystrata.ir.graph import Graph
from polystrata.ir.layout import repack
from polystrata.runtimes.base import eval_int
from polystrata.targets import make_runtime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="cuda")
    ap.add_argument("--kv-type", default="f16", choices=sorted(KV_FORMATS))
    ap.add_argument("--depth", type=int, default=8192, help="tokens in the cache before the timed one")
    ap.add_argument("--heads", default="32,8,128", help="query heads, KV heads, head size")
    ap.add_argument("--layers", type=int, default=4, help="caches rotated to defeat the L2 cache")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--bandwidth", type=float, default=4.29e12, help="bytes/s to compare with (H200 measured read)")
    ap.add_argument("--knob", action="append", default=[], metavar="RECIPE.NAME=VALUE")
    ap.add_argument("--gguf-kv", action="store_true", help="KV rows in the type's own blocks, not split")
    a = ap.parse_args()
    hq, hkv, d = (int(x) for x in a.heads.split(","))
    kvf = KV_FORMATS[a.kv_type]
    rt = make_runtime(a.target)
    if a.gguf_kv:
        rt.policy = dataclasses.replace(rt.policy, split_kv_formats=())
    n_ctx = a.depth + 64
    g = Graph(arch="bench")
    tok = g.input("tokens", "i32", ("T",))
    pos = g.input("positions", "i32", ("T",))
    outs = []
    for il in range(a.layers):
        qkv = [g.op("reshape", g.op("embed", g.weight(f"{n}{il}", "F32", (1, h * d)), tok), shape=("T", h, d))
               for n, h in (("q", hq), ("k", hkv), ("v", hkv))]
        o = g.op("attention", *qkv, pos, layer=il, scale=1.0 / np.sqrt(d), window=0, softcap=0.0)
        outs.append(g.op("reshape", o, shape=("T", hq * d)))
    g.outputs.extend(outs)
    weights = {w: FORMATS["F32"] for w in g.weights}
    plan = build_plan(g, weights, kvf, n_ctx, 1, knobs=parse_knobs(a.knob), policy=rt.policy)
    rng = np.random.default_rng(0)
    bufs, want = {}, []
    for name, spec in plan.buffers.items():
        if spec.kind == "weight":
            bufs[name] = rt.upload(rng.standard_normal(spec.count).astype(np.float32))
        elif spec.kind != "kv":
            bufs[name] = rt.alloc((spec.count,), spec.dtype)
    tables = {name: rt.download(bufs[name], (plan.buffers[name].count,), "f32") for name in g.weights}
    for il in range(a.layers):
        q, k, v = (tables[f"{n}{il}"] for n in "qkv")
        caches = []
        for n, new in (("k", k), ("v", v)):
            rows = rng.standard_normal((n_ctx, hkv * d)).astype(np.float32)
            raw = quantize(kvf, rows)
            deq = dequantize(kvf, raw, rows.shape)
            deq[a.depth] = dequantize(kvf, quantize(kvf, new[None]), (1, hkv * d))[0]  # the step's own row
            spec = plan.buffers[f"kv.{il}.{n}"]
            raw = repack(raw, kvf, rt.policy.kv_layout(kvf, d))  # the rows as the target keeps them
            bufs[spec.name] = rt.upload(np.frombuffer(raw.tobytes(), np.uint8)[:spec.count].copy())
            caches.append(deq[: a.depth + 1].reshape(-1, hkv, d))
        kc, vc = caches
        s = np.einsum("hd,thd->ht", q.reshape(hkv, hq // hkv, d).reshape(hq, d),
                      np.repeat(kc, hq // hkv, axis=1)) / np.sqrt(d)
        p = np.exp(s - s.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        want.append(np.einsum("ht,thd->hd", p, np.repeat(vc, hq // hkv, axis=1)).reshape(-1))
    rt.write(bufs["tokens"], np.zeros(1, np.int32))
    rt.write(bufs["positions"], np.array([a.depth], np.int32))
    if "starts" in bufs:  # one sequence, from the cache's first row
        rt.write(bufs["starts"], np.zeros(plan.buffers["starts"].count, np.int32))
    step = []
    for la in plan.launches:
        env = {n: (1 if v == "T" else v) for n, v in la.scalars}
        args = rt.args_for(la.kernel, {p: bufs[b] for p, b in la.buffers}, env)
        ck = rt.compile(la.kernel)
        grid = [eval_int(e, env) for e in la.kernel.grid]
        step.append((la.kernel, rt.prepare(ck, args, grid)))
    attn = [h for k, h in step if not k.name.startswith("embed")]

    def run(handles) -> None:
        for h in handles:
            rt.launch_prepared(h)

    run([h for _, h in step])
    rt.sync()
    # Each layer's result: the buffer its last attention launch (the combine, or the only one) writes as `out`.
    got = [b for la in plan.launches if la.kernel.name.startswith("attn") for p, b in la.buffers if p == "out"]
    err = max(float(np.abs(rt.download(bufs[b], (hq * d,), "f32") - w).max()) for b, w in zip(got, want))
    dt, graphed = time_steps(rt, lambda _i: run(attn), a.iters)
    per_layer = dt / a.layers
    kv_bytes = 2 * (a.depth + 1) * hkv * d // kvf.block_size * kvf.block_bytes
    names = " + ".join(dict.fromkeys(k.name for k, _ in step if not k.name.startswith("embed")))
    print(f"attention d{a.depth} {a.kv_type} on {rt.device}: {per_layer * 1e6:.1f} us/layer, "
          f"{kv_bytes / per_layer / 1e9:.0f} GB/s ({100 * kv_bytes / per_layer / a.bandwidth:.0f}%), "
          f"max abs err {err:.1e}{' (graph)' if graphed else ''} {' '.join(a.knob)}{' gguf-kv' if a.gguf_kv else ''}"
          f"  [{names}]", flush=True)


if __name__ == "__main__":
    main()

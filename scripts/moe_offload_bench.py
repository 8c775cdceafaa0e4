#!/usr/bin/env python3
"""MoE decode with experts that do not all fit in device memory: PolyStrata's expert cache against llama.cpp's
`--n-cpu-moe` at equal device memory, side by side in one run (NVIDIA GPUs; run by hand or by device_check.sh).

For each N in --ncmoe, llama-bench runs with the experts of N layers on the CPU while nvidia-smi is polled; the
peak device memory it used (less what was in use before) is what PolyStrata may use too, in one `bench` per expert
policy, polled the same way. `--gpu-mem` budgets the plan (weights, KV cache, scratch, expert slots), not what the
process holds beside it (the CUDA context, kernels, graphs): where a run used more than llama.cpp did, it runs
again with the budget less the excess, until it fits (the budget that did is reported). Fully resident runs of both
come first as the anchor. Prints one table:

    python3 scripts/moe_offload_bench.py MODEL.gguf --llama-bench PATH [--ncmoe 24,36] [--policies lru,lfu,prefetch]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time


def _used_mib() -> int:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=True,
    ).stdout
    return int(out.split()[0])


def _run_polled(cmd: list[str], timeout: float) -> tuple[subprocess.CompletedProcess, int]:
    """Run `cmd`, polling device memory every 0.2 s; returns the process and its peak MiB above the idle level."""
    idle = _used_mib()
    peak = [idle]
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _used_mib())
            time.sleep(0.2)

    t = threading.Thread(target=poll, daemon=True)
    t.start()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    finally:
        done.set()
        t.join()
    return proc, peak[0] - idle


def llama_tg(llama_bench: str, model: str, ncmoe: int, n: int, reps: int) -> tuple[float, float, int]:
    """llama.cpp decode tok/s (mean, sd) with the experts of `ncmoe` layers on the CPU, and its device MiB."""
    cmd = [llama_bench, "-m", model, "-ngl", "99", "-fa", "1", "-p", "0", "-n", str(n), "-r", str(reps),
           "-ncmoe", str(ncmoe), "-o", "json"]
    proc, mib = _run_polled(cmd, 600)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench failed: {proc.stderr[-2000:]}")
    row = json.loads(proc.stdout)[0]
    return float(row["avg_ts"]), float(row["stddev_ts"]), mib


def polystrata_tg(model: str, n: int, reps: int, gpu_mem_mib: int | None, policy: str | None,
                  extra: list[str]) -> tuple[dict, int]:
    """PolyStrata's `bench --json` result for decode under a device-memory budget, and its device MiB."""
    cmd = [sys.executable, "-m", "polystrata", "bench", model, "--target", "cuda", "-p", "0", "-n", str(n),
           "-r", str(reps), "--json", *extra]
    if gpu_mem_mib is not None:
        cmd += ["--gpu-mem", f"{gpu_mem_mib}M"]
    if policy:
        cmd += ["--expert-policy", policy]
    proc, mib = _run_polled(cmd, 900)
    if proc.returncode != 0:
        raise RuntimeError(f"polystrata bench failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout), mib


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--llama-bench", required=True, help="path of llama.cpp's llama-bench (CUDA build)")
    ap.add_argument("--ncmoe", default="24,36", help="llama.cpp's --n-cpu-moe values (comma-separated)")
    ap.add_argument("--policies", default="lru,lfu,prefetch")
    ap.add_argument("-n", type=int, default=64, help="decoded tokens per repetition")
    ap.add_argument("-r", type=int, default=2, help="repetitions")
    ap.add_argument("--json", help="also write every result to this file")
    ap.add_argument("--no-resident", action="store_true", help="skip the fully resident anchor runs")
    a = ap.parse_args()

    rows: list[dict] = []

    def row(**kw) -> None:
        rows.append(kw)
        print(json.dumps(kw), flush=True)

    if not a.no_resident:
        tg, sd, mib = llama_tg(a.llama_bench, a.model, 0, a.n, a.r)
        row(engine="llama.cpp", setting="resident", tok_s=tg, sd=sd, device_mib=mib)
        res, mib = polystrata_tg(a.model, a.n, a.r, None, None, [])
        row(engine="polystrata", setting="resident", tok_s=res["tg"]["tok_s_mean"], sd=res["tg"]["tok_s_sd"],
            device_mib=mib)
    excess = 0  # MiB PolyStrata's process held beyond its budget in the last run that overran (kept: it recurs)
    for n_cpu in (int(x) for x in a.ncmoe.split(",")):
        tg, sd, mib = llama_tg(a.llama_bench, a.model, n_cpu, a.n, a.r)
        row(engine="llama.cpp", setting=f"-ncmoe {n_cpu}", tok_s=tg, sd=sd, device_mib=mib)
        for policy in a.policies.split(","):
            budget = mib - excess
            try:
                for _ in range(3):
                    res, used = polystrata_tg(a.model, a.n, a.r, budget, policy, [])
                    if used <= mib:
                        break
                    excess += used - mib
                    budget = mib - excess
            except RuntimeError as e:
                row(engine="polystrata", setting=f"--gpu-mem {budget}M {policy}", error=str(e)[-300:])
                continue
            ex = res.get("experts") or {}
            row(engine="polystrata", setting=f"--gpu-mem {budget}M {policy}", tok_s=res["tg"]["tok_s_mean"],
                sd=res["tg"]["tok_s_sd"], device_mib=used, vs_llama=res["tg"]["tok_s_mean"] / tg,
                slots=ex.get("slots"), hit_rate=ex.get("hit_rate"),
                link_mb_per_token=(ex.get("link_bytes_per_token") or 0) / 1e6,
                stall_ms_per_token=ex.get("stall_ms_per_token"), device_resolved=ex.get("device_resolved"))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    print("\nengine      setting                          tok/s        device MiB  hit rate  link MB/tok  stall ms/tok"
          "  on device")
    for r in rows:
        if "error" in r:
            print(f"{r['engine']:11s} {r['setting']:32s} error: {r['error'][-120:]}")
            continue
        hit = f"{r['hit_rate']:.3f}" if r.get("hit_rate") is not None else "-"
        link = f"{r['link_mb_per_token']:.1f}" if "link_mb_per_token" in r else "-"
        stall = f"{r['stall_ms_per_token']:.2f}" if r.get("stall_ms_per_token") is not None else "-"
        dev = f"{r['device_resolved']:.2f}" if r.get("device_resolved") is not None else "-"
        print(f"{r['engine']:11s} {r['setting']:32s} {r['tok_s']:7.1f} ± {r['sd']:5.1f}  {r['device_mib']:9d}  "
              f"{hit:>8s}  {link:>11s}  {stall:>12s}  {dev:>9s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

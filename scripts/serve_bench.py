#!/usr/bin/env python3
"""Serving throughput: `polystrata serve` and (with --llama-server PATH) llama-server on the same GGUF file, in one
run: for each count of concurrent streams (1, 4, 16), every stream asks /v1/completions for --tokens tokens
(streamed, greedy, `ignore_eos` so each gets all of them) at the same moment.

Reported per server and stream count: aggregate tok/s (all streams' tokens over the wall time from the first
request to the last token), per-stream tok/s (a stream's tokens after its first over the time since its first
token, averaged over the streams) and time to first token (mean and worst). Each server starts once, with
--parallel equal to the largest stream count and --slot-ctx tokens of context a slot, gets one untimed warm-up
request, and is stopped at the end. Run by hand, not by CI:

    python scripts/serve_bench.py MODEL [--target cuda] [--llama-server PATH [--llama-args "-ngl 99 -fa on"]]
        [--streams 1,4,16] [--tokens 128] [--join N] [--json FILE]

With --join N it measures continuous batching instead: max(streams) - 1 streams run, and once each has a few tokens
a request with a prompt of N tokens joins; reported: the streams' usual and longest gap between two tokens while it
joins, and its time to first token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Launched:
    """A server process on a free local port, stopped (SIGTERM, then SIGKILL) at the end."""

    def __init__(self, name: str, argv: list[str], port: int, log: Path):
        self.name, self.port, self.url = name, port, f"http://127.0.0.1:{port}"
        self.log = log
        print(f"{name}: {shlex.join(argv)}", file=sys.stderr, flush=True)
        self.proc = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT)

    async def ready(self, timeout_s: float) -> None:
        """Wait until /health answers 200 (kernels compile or weights load first)."""
        end = time.monotonic() + timeout_s
        async with aiohttp.ClientSession() as s:
            while time.monotonic() < end:
                if self.proc.poll() is not None:
                    raise SystemExit(f"error: {self.name} exited with {self.proc.returncode}; see {self.log}")
                try:
                    async with s.get(self.url + "/health") as r:
                        if r.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(1.0)
        raise SystemExit(f"error: {self.name} was not ready within {timeout_s:.0f} s; see {self.log}")

    def served_lines(self) -> list[str]:
        """The lines `polystrata serve` logs each time it goes idle ("served N requests: ...")."""
        return [ln.strip() for ln in self.log.read_text(errors="replace").splitlines() if ln.startswith("served ")]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # not SIGINT: a process started from a background job ignores it
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def one_stream(session: aiohttp.ClientSession, url: str, n_tokens: int, t0: float,
                     prompt: str | list[int] = PROMPT, times: list[float] | None = None) -> dict:
    """A streamed completion of `n_tokens` tokens: times (since t0) of its first and last token and its count;
    each token's time is appended to `times` as it arrives."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": n_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    times = [] if times is None else times
    first = last = None
    chunks, usage = 0, None
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise SystemExit(f"error: {url} answered {r.status}: {await r.text()}")
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            msg = json.loads(line[6:])
            if "error" in msg:
                raise SystemExit(f"error: {url}: {msg['error']}")
            if msg.get("usage"):
                usage = msg["usage"]
            if msg.get("choices") and msg["choices"][0].get("text"):
                now = time.perf_counter() - t0
                first = now if first is None else first
                last = now
                times.append(now)
                chunks += 1
    n = usage["completion_tokens"] if usage else chunks
    return {"ttft_s": first, "end_s": last, "tokens": n}


async def measure(url: str, n_streams: int, n_tokens: int) -> dict:
    """`n_streams` concurrent streams started together."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s:
        t0 = time.perf_counter()
        runs = await asyncio.gather(*(one_stream(s, url, n_tokens, t0) for _ in range(n_streams)))
    wall = max(r["end_s"] for r in runs)
    per = [(r["tokens"] - 1) / (r["end_s"] - r["ttft_s"]) for r in runs if r["end_s"] > r["ttft_s"]]
    return {
        "streams": n_streams,
        "tokens": sum(r["tokens"] for r in runs),
        "aggregate_tok_s": sum(r["tokens"] for r in runs) / wall,
        "per_stream_tok_s": statistics.mean(per) if per else 0.0,
        "ttft_ms_mean": 1000 * statistics.mean(r["ttft_s"] for r in runs),
        "ttft_ms_max": 1000 * max(r["ttft_s"] for r in runs),
    }


async def measure_join(url: str, n_streams: int, n_tokens: int, join_tokens: int) -> dict:
    """`n_streams` streams of `n_tokens` tokens; once each has 4, a request with a prompt of `join_tokens` token
    ids joins (4 tokens): the streams' longest gap between two tokens around its prefill (from its submission to
    its first token) against their usual gap (the median before it joined), and the joiner's time to first
    token."""
    joiner_ids = [1000 + (37 * i) % 20000 for i in range(join_tokens)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s:
        t0 = time.perf_counter()
        times: list[list[float]] = [[] for _ in range(n_streams)]
        tasks = [asyncio.create_task(one_stream(s, url, n_tokens, t0, times=t)) for t in times]
        while min(map(len, times)) < 4:
            await asyncio.sleep(0.005)
        t_join = time.perf_counter() - t0
        joiner = await one_stream(s, url, 4, t0, prompt=joiner_ids)
        await asyncio.gather(*tasks)
    t_first = joiner["ttft_s"]
    before = [b - a for t in times for a, b in zip(t, t[1:]) if b <= t_join]
    around = [b - a for t in times for a, b in zip(t, t[1:]) if b > t_join and a < t_first]
    return {
        "streams": n_streams,
        "join_tokens": join_tokens,
        "gap_ms_usual": 1000 * statistics.median(before),
        "gap_ms_longest": 1000 * max(around, default=0.0),
        "join_ttft_ms": 1000 * (t_first - t_join),
        "streams_outlasted_join": all(t[-1] > t_first for t in times),  # else the gaps miss part of the prefill
    }


async def bench_server(server: Launched, streams: list[int], n_tokens: int, timeout_s: float,
                       join_tokens: int = 0) -> list[dict]:
    try:
        await server.ready(timeout_s)
        await measure(server.url, 1, 8)  # warm-up: first launches, lazily built state
        rows = []
        if join_tokens:
            # Warm-up of the prompt steps' plans, then the join beside max(streams) - 1 streams.
            await measure_join(server.url, 1, 16, min(join_tokens, 64))
            row = {"server": server.name, **await measure_join(server.url, max(streams) - 1, n_tokens, join_tokens)}
            print(f"{server.name}: join of {join_tokens} tokens: longest gap {row['gap_ms_longest']:.0f} ms, "
                  f"TTFT {row['join_ttft_ms']:.0f} ms", file=sys.stderr, flush=True)
            return [row]
        for n in streams:
            seen = server.served_lines()
            row = {"server": server.name, **await measure(server.url, n, n_tokens)}
            print(f"{server.name}: {n} streams: {row['aggregate_tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
            for _ in range(50):  # PolyStrata logs where its steps' time went once it is idle again
                if (lines := server.served_lines()[len(seen):]) or server.name != "polystrata":
                    break
                await asyncio.sleep(0.1)
            if lines:
                row["timings"] = lines[-1]
                print(f"{server.name}: {lines[-1]}", file=sys.stderr, flush=True)
            rows.append(row)
        return rows
    finally:
        server.stop()


def table(rows: list[dict]) -> str:
    if rows and "join_tokens" in rows[0]:
        out = ["| server | streams | joining prompt tokens | usual gap ms | longest gap ms | joiner's TTFT ms |",
               "|---|---|---|---|---|---|"]
        out += [f"| {r['server']} | {r['streams']} | {r['join_tokens']} | {r['gap_ms_usual']:.0f} | "
                f"{r['gap_ms_longest']:.0f} | {r['join_ttft_ms']:.0f} |" for r in rows]
        return "\n".join(out)
    out = ["| server | streams | aggregate tok/s | per-stream tok/s | TTFT mean ms | TTFT max ms |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['server']} | {r['streams']} | {r['aggregate_tok_s']:.1f} | {r['per_stream_tok_s']:.1f} | "
                   f"{r['ttft_ms_mean']:.0f} | {r['ttft_ms_max']:.0f} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="GGUF file (or a zoo name, for PolyStrata only)")
    ap.add_argument("--target", default="auto", help="PolyStrata's target")
    ap.add_argument("--streams", default="1,4,16", help="comma-separated counts of concurrent streams")
    ap.add_argument("--tokens", type=int, default=128, help="tokens each stream generates")
    ap.add_argument("--slot-ctx", type=int, default=512, help="context tokens a parallel slot holds")
    ap.add_argument("--join", type=int, default=0, metavar="N",
                    help="instead: max(streams) - 1 streams, joined by a request with a prompt of N tokens (the "
                         "streams' longest gap between tokens and the joiner's time to first token)")
    ap.add_argument("--llama-server", default=None, metavar="PATH", help="a llama-server binary to compare with")
    ap.add_argument("--llama-args", default="", help="extra llama-server arguments, e.g. \"-ngl 99 -fa on\"")
    ap.add_argument("--polystrata-args", default="", help="extra `polystrata serve` arguments, e.g. \"--kv-type q8_0\"")
    ap.add_argument("--no-polystrata", action="store_true", help="measure llama-server only")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds a server may take to be ready")
    ap.add_argument("--logs", default=".", help="folder for the servers' logs")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON")
    a = ap.parse_args()
    streams = [int(s) for s in a.streams.split(",")]
    parallel = max(streams)
    ctx = parallel * a.slot_ctx
    logs = Path(a.logs)
    logs.mkdir(parents=True, exist_ok=True)
    servers = []
    if not a.no_polystrata:
        port = _free_port()
        servers.append(Launched("polystrata", [
            sys.executable, "-m", "polystrata", "serve", a.model, "--target", a.target, "--port", str(port),
            "--parallel", str(parallel), "-c", str(ctx), *shlex.split(a.polystrata_args)], port,
            logs / "serve_bench.polystrata.log"))
    rows = []
    for s in servers:
        rows += asyncio.run(bench_server(s, streams, a.tokens, a.timeout, a.join))
    if a.llama_server:
        port = _free_port()
        server = Launched("llama-server", [
            a.llama_server, "-m", a.model, "--port", str(port), "--parallel", str(parallel), "-c", str(ctx),
            "--cont-batching", *shlex.split(a.llama_args)], port, logs / "serve_bench.llama-server.log")
        rows += asyncio.run(bench_server(server, streams, a.tokens, a.timeout, a.join))
    print(table(rows))
    if a.json:
        Path(a.json).write_text(json.dumps({"model": os.path.abspath(a.model) if os.path.exists(a.model) else a.model,
                                            "target": a.target, "tokens": a.tokens, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

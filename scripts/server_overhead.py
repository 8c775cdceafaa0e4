"""The server's own throughput: `polystrata.server` (aiohttp, the scheduler thread, server-sent events) serving
streaming completions from an engine on scripts/host_overhead.py's null device, whose kernels do nothing. What it
reports is the most tok/s the server, the scheduler and the engine's host work can carry on this machine: a GPU
run below it is the device's (docs/benchmarks.md, "H200, 2026-12-05, eighth session").

    python scripts/server_overhead.py [MODEL] [--streams 16] [--tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from pathlib import Path

import aiohttp

from polystrata import server

_here = Path(__file__).resolve().parent
try:
    import host_overhead
except ImportError:  # run from elsewhere than scripts/
    import importlib.util

    _spec = importlib.util.spec_from_file_location("host_overhead", _here / "host_overhead.py")
    host_overhead = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(host_overhead)


async def completions(url: str, streams: int, tokens: int) -> tuple[int, float]:
    """(tokens streamed back, seconds) for `streams` concurrent streaming completions of `tokens` tokens each."""

    async def one(session: aiohttp.ClientSession) -> int:
        body = {"model": "m", "prompt": "hello", "max_tokens": tokens, "temperature": 0, "stream": True,
                "ignore_eos": True}
        got = 0
        async with session.post(url + "/v1/completions", json=body) as r:
            async for line in r.content:
                got += line.startswith(b"data: {")
        return got

    async with aiohttp.ClientSession() as session:
        start = time.perf_counter()
        got = await asyncio.gather(*(one(session) for _ in range(streams)))
        return sum(got), time.perf_counter() - start


def measure(model: str, streams: int, tokens: int) -> tuple[int, float]:
    """(data events streamed back, seconds) for `streams` streams of `tokens` tokens, after one warm-up round (the
    step graphs captured): a stream's events are its tokens and a last one with its finish reason."""
    engine = host_overhead.make_engine(model, "null", 512 * streams, rows=streams)
    sock, urls = server.listen("127.0.0.1", 0), []
    threading.Thread(target=server.serve, args=(engine, streams, sock, "m"), kwargs={"ready": urls.append},
                     daemon=True).start()
    while not urls:
        time.sleep(0.01)
    asyncio.run(completions(urls[0], streams, 4))
    return asyncio.run(completions(urls[0], streams, tokens))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m", help="a zoo name or a GGUF path")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()
    events, seconds = measure(a.model, a.streams, a.tokens)
    print(f"{a.streams} streams on the null device: {a.streams * a.tokens / seconds:.0f} tok/s aggregate "
          f"({events} events in {seconds:.2f} s)")


if __name__ == "__main__":
    main()

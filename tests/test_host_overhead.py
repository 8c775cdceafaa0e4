"""scripts/host_overhead.py: its null device runs bench's decode loop on a GPU-shaped plan, the one-token step
captured once and replayed after, as on cuda (what the script measures the host's share of; no timing asserted)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from polystrata.synth import synth_model

_spec = importlib.util.spec_from_file_location(
    "host_overhead", Path(__file__).resolve().parents[1] / "scripts" / "host_overhead.py")
host_overhead = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(host_overhead)


def test_null_device_replays_the_decode_step(tmp_path):
    model = synth_model("llama", tmp_path / "llama.gguf", preset="tiny", qtype="Q8_0", seed=7)
    engine = host_overhead.make_engine(str(model), "null", 32)
    rt, ex = engine.runtime, engine.executor
    assert isinstance(rt, host_overhead.NullDevice) and ex.use_graphs and ex.time_device
    assert max(b.ck.kernel.lanes for b in ex.bound[id(engine.graph_step)]) == rt.lanes == 128  # the cuda policy
    host = host_overhead.decode(engine, 10, np.random.default_rng(0))
    # The first step runs launch by launch, the second is captured and replayed, the rest replayed.
    assert len(host) == 10 and rt.replays == 9 and list(ex.graphs) == [(id(engine.graph_step), 1)]
    assert engine.n_past == 10 and ex.last_device_s == 0.0


def test_null_device_runs_the_servers_batched_steps(tmp_path):
    """--rows N: the server's batched step of N decode rows (the last rows' plan), from empty caches each run, the
    steps after the first replayed from a device graph of that row count."""
    from polystrata.batch import BatchDecoder

    model = synth_model("llama", tmp_path / "llama.gguf", preset="tiny", qtype="Q8_0", seed=7)
    engine = host_overhead.make_engine(str(model), "null", 64, rows=4)
    decoder = BatchDecoder(engine, 4)
    for _ in range(4):
        decoder.open()
    for _ in range(2):  # a second run starts from empty caches again (`batched` reopens the slots)
        host = host_overhead.batched(decoder, 5)
        assert len(host) == 5 and decoder.n_past == [5] * 4
    assert (id(engine.graph_rows), 4) in engine.executor.graphs and engine.runtime.replays >= 8


def test_server_on_the_null_device_streams_every_token(tmp_path):
    """scripts/server_overhead.py: the real server (aiohttp, scheduler thread, SSE) over the null device, each of
    the concurrent streams getting all its tokens and its last event."""
    spec = importlib.util.spec_from_file_location(
        "server_overhead", Path(__file__).resolve().parents[1] / "scripts" / "server_overhead.py")
    server_overhead = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(server_overhead)
    model = synth_model("llama", tmp_path / "llama.gguf", preset="tiny", qtype="Q8_0", seed=7)
    events, seconds = server_overhead.measure(str(model), 3, 6)
    assert events == 3 * (6 + 1) and seconds > 0

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

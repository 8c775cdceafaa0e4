"""`polystrata bench` on a tiny synthetic model and the reference target: JSON keys, values and the table."""

import argparse
import json
import re

import numpy as np
import pytest

from polystrata import bench
from polystrata.bench import add_bench_parser, cmd_bench
from polystrata.engine import tensor_table
from polystrata.errors import PolystrataError, UsageError
from polystrata.gguf import GGUFFile
from polystrata.models import build_graph
from polystrata.synth import synth_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return synth_model("llama", tmp_path_factory.mktemp("bench") / "m.gguf", preset="tiny", qtype="Q8_0")


@pytest.fixture(autouse=True)
def _known_bandwidth(monkeypatch):
    # A fixed bandwidth keeps the tests fast (no 256 MiB measurement) and the roofline checkable.
    monkeypatch.setenv(bench.BANDWIDTH_ENV, "1e11")


def _run(capsys, *argv: str) -> str:
    ap = argparse.ArgumentParser()
    add_bench_parser(ap.add_subparsers(dest="cmd"))
    assert cmd_bench(ap.parse_args(["bench", *argv])) == 0
    return capsys.readouterr().out


def _decode_weight_bytes(path) -> int:
    """Independently of the engine: every decode weight once, one row of an untied embedding table, and k of n
    experts of each routed expert tensor."""
    with GGUFFile(path) as f:
        graph = build_graph(f.metadata, tensor_table(f), all_logits=False)
        arch = f.metadata["general.architecture"]
        k, n = f.metadata.get(f"{arch}.expert_used_count", 1), f.metadata.get(f"{arch}.expert_count", 1)
        total = 0
        for name in set(graph.weights):
            t = f.tensors[name]
            if name == "token_embd.weight" and "output.weight" in f.tensors:
                total += t.nbytes // t.shape[0]
            elif name.endswith("_exps.weight"):
                total += t.nbytes * k // n
            else:
                total += t.nbytes
        return total


def test_moe_bytes_count_only_the_routed_experts(tmp_path, capsys):
    path = synth_model("qwen3moe", tmp_path / "moe.gguf", preset="tiny", qtype="Q8_0")
    r = json.loads(_run(capsys, str(path), "--target", "reference", "-p", "0", "-n", "2", "-r", "1", "--json"))
    with GGUFFile(path) as f:
        full = sum(f.tensors[n].nbytes for n in f.tensors)
    assert r["bytes_per_token"] == _decode_weight_bytes(path) < full


@pytest.mark.parametrize("forced", [False, True])
def test_json_keeps_stderr_quiet_unless_progress_is_asked_for(tiny_model, capsys, monkeypatch, forced):
    """`bench -o json` is for programs: no progress lines, unless POLYSTRATA_PROGRESS=1 (a device run's log)."""
    from polystrata.cli import main

    if forced:
        monkeypatch.setenv("POLYSTRATA_PROGRESS", "1")
    else:
        monkeypatch.delenv("POLYSTRATA_PROGRESS", raising=False)
    assert main(["bench", str(tiny_model), "--target", "reference", "-p", "4", "-n", "2", "-r", "1", "-o", "json"]) == 0
    out, err = capsys.readouterr()
    json.loads(out)
    assert ("bench: " in err) == forced


def test_json_keys_and_values(tiny_model, capsys):
    out = _run(capsys, str(tiny_model), "--target", "reference", "-p", "16", "-n", "4", "-r", "2", "--json")
    r = json.loads(out)  # exactly one JSON object on stdout
    for key in (
        "model", "target", "device", "pp", "tg", "bytes_per_token", "roofline_pct",
        "bandwidth_bytes_s", "bandwidth_source", "repetitions", "n_threads",
    ):  # fmt: skip
        assert key in r, key
    assert r["model"] == str(tiny_model)
    assert r["target"] == "reference"
    assert isinstance(r["device"], str) and r["device"]
    assert r["repetitions"] == 2 and r["n_threads"] >= 1
    for test, n in (("pp", 16), ("tg", 4)):
        e = r[test]
        assert e["n"] == n
        assert e["tok_s_mean"] > 0 and e["tok_s_sd"] >= 0
        assert len(e["tok_s"]) == 2 and all(x > 0 for x in e["tok_s"])
    assert r["bytes_per_token"] == _decode_weight_bytes(tiny_model) > 0
    assert r["bandwidth_bytes_s"] == 1e11 and bench.BANDWIDTH_ENV in r["bandwidth_source"]
    expected = 100 * r["bytes_per_token"] * r["tg"]["tok_s_mean"] / 1e11
    assert r["roofline_pct"] == pytest.approx(expected)


def test_skip_prefill(tiny_model, capsys):
    r = json.loads(_run(capsys, str(tiny_model), "--target", "reference", "-p", "0", "-n", "2", "-r", "1", "--json"))
    assert r["pp"] is None
    assert r["tg"]["n"] == 2 and r["tg"]["tok_s_sd"] == 0.0


def test_skip_decode_has_no_roofline(tiny_model, capsys):
    r = json.loads(_run(capsys, str(tiny_model), "--target", "reference", "-p", "4", "-n", "0", "-r", "1", "--json"))
    assert r["tg"] is None and r["roofline_pct"] is None
    assert r["pp"]["n"] == 4


def test_human_table(tiny_model, capsys):
    out = _run(capsys, str(tiny_model), "--target", "reference", "-p", "8", "-n", "3", "-r", "1")
    assert "pp8" in out and "tg3" in out
    assert "| model" in out and "t/s" in out and "reference" in out
    assert "roofline" in out


def test_measured_bandwidth_is_labelled(monkeypatch):
    monkeypatch.delenv(bench.BANDWIDTH_ENV)
    monkeypatch.setattr(bench, "_MEASURE_BYTES", 8 * 2**20)
    bw, source = bench.resolve_bandwidth("Some CPU", is_host_cpu=True, threads=1)
    assert bw > 0 and source.startswith("measured")
    assert bench.resolve_bandwidth("NVIDIA H200", is_host_cpu=False, threads=1) == (4.29e12, "table (H200)")
    assert bench.resolve_bandwidth("mystery GPU", is_host_cpu=False, threads=1) == (None, None)


@pytest.mark.parametrize(
    "argv",
    [["-p", "0", "-n", "0"], ["-r", "0"], ["-n", "-1"]],
)
def test_bad_options(tiny_model, capsys, argv):
    with pytest.raises(PolystrataError):
        _run(capsys, str(tiny_model), "--target", "reference", *argv)


def test_bad_bandwidth_env(monkeypatch):
    monkeypatch.setenv(bench.BANDWIDTH_ENV, "fast")
    with pytest.raises(PolystrataError):
        bench.resolve_bandwidth("x", is_host_cpu=False, threads=1)


def test_host_time_is_step_wall_less_device_time(tiny_model, capsys, monkeypatch):
    """Host time per token = a decode step's wall time less its device time, where the runtime marks device time
    (cuda, hip); here the CPU runtime gets marks whose device time is the wall time between them (its launches are
    synchronous), so the host's share is what the step spends outside its launches."""
    import time

    from polystrata.runtimes.cpu import CPURuntime

    r = json.loads(_run(capsys, str(tiny_model), "--target", "cpu", "-p", "0", "-n", "3", "-r", "1", "--json"))
    assert r["host_ms_per_token"] is None  # no device timer, no claim
    monkeypatch.setattr(CPURuntime, "mark", lambda self: time.perf_counter(), raising=False)
    monkeypatch.setattr(CPURuntime, "elapsed", lambda self, a, b: b - a, raising=False)
    r = json.loads(_run(capsys, str(tiny_model), "--target", "cpu", "-p", "0", "-n", "3", "-r", "1", "--json"))
    step_ms = 1e3 / r["tg"]["tok_s_mean"]
    assert 0 < r["host_ms_per_token"] < step_ms
    text = _run(capsys, str(tiny_model), "--target", "cpu", "-p", "0", "-n", "3", "-r", "1")
    assert "host time per decoded token:" in text


def test_depth_decodes_after_that_many_tokens(tiny_model, capsys, monkeypatch):
    """-d: the depth is prefilled once, and every timed test starts after it (the JSON says so)."""
    from polystrata.engine import Engine

    calls = []
    forward = Engine.forward

    def spy(self, ids, all_logits=False):
        calls.append((self.n_past, len(ids)))
        return forward(self, ids, all_logits)

    monkeypatch.setattr(Engine, "forward", spy)
    r = json.loads(_run(capsys, str(tiny_model), "--target", "reference", "-d", "9", "-p", "3", "-n", "2", "-r", "2",
                        "--json"))
    assert r["depth"] == 9 and r["n_ctx"] == 9 + 3 and r["kv_type"] == "f32"
    assert calls[0] == (0, 9)  # the depth, once
    prefills, steps = [c for c in calls[1:] if c[1] == 3], [c for c in calls[1:] if c[1] == 1]
    assert len(prefills) == 3 and all(n_past == 9 for n_past, _ in prefills)  # warm-up and 2 repetitions
    assert len(steps) == 2 + 2 * 2 and {n_past for n_past, _ in steps} == {9, 10}
    assert len(calls) == 1 + len(prefills) + len(steps)
    assert "tg2 @ d9" in _run(capsys, str(tiny_model), "--target", "reference", "-d", "9", "-p", "0", "-n", "2",
                              "-r", "1")


def test_depth_on_a_kernel_target_repeats_the_prefilled_rows(tiny_model, monkeypatch):
    """-d on a kernel target: DEPTH_PREFILL tokens prefilled for real, their K/V rows repeated up to the depth."""
    from polystrata.engine import Engine

    monkeypatch.setattr(bench, "DEPTH_PREFILL", 4)
    eng = Engine(tiny_model, target="cpu", n_ctx=16)
    fed = []
    forward = eng.forward
    monkeypatch.setattr(eng, "forward", lambda ids, all_logits=False: fed.append(len(ids)) or forward(ids))
    bench._fill_depth(eng, 10, np.random.default_rng(0))
    assert fed == [4] and eng.n_past == 10
    ex = eng.executor
    kv = [n for plan in ex.plans.values() for n, s in plan.buffers.items() if s.kind == "kv"]
    assert kv
    for name in kv:
        count = ex.plans[next(iter(ex.plans))].buffers[name].count
        rows = ex.rt.download(ex.handles[name], (count,), "u8").reshape(16, -1)
        assert rows[:4].any()
        assert np.array_equal(rows[4:8], rows[:4]) and np.array_equal(rows[8:10], rows[:2])


def test_kv_type_and_ctx_reach_the_plans(tiny_model, capsys, monkeypatch):
    import polystrata.compiler

    seen = {}

    class Planned(Exception):
        pass

    def spy(file, graphs, runtime, n_ctx, kv_type="f16", *args, **kw):
        seen.update(n_ctx=n_ctx, kv_type=kv_type)
        raise Planned  # what was asked for is all this test needs: no kernels compiled

    monkeypatch.setattr(polystrata.compiler, "compile_plans", spy)
    with pytest.raises(Planned):
        _run(capsys, str(tiny_model), "--target", "cpu", "--kv-type", "q8_g64", "-c", "100", "-d", "20", "-p", "0",
             "-n", "4")
    assert seen == {"n_ctx": 100, "kv_type": "q8_g64"}
    with pytest.raises(Planned):
        _run(capsys, str(tiny_model), "--target", "cpu", "-d", "20", "-p", "8", "-n", "4")
    assert seen == {"n_ctx": 28, "kv_type": "f16"}


def test_knobs_reach_the_plans(tiny_model, capsys, monkeypatch):
    """--knob SPACE.NAME=VALUE: overrides for every kernel of the space in the policy the plans are made with;
    anything but a declared knob of a declared space is a usage error."""
    import polystrata.compiler

    seen = {}

    class Planned(Exception):
        pass

    def spy(file, graphs, runtime, *args, **kw):
        seen.update(runtime.policy.tuned)
        raise Planned

    monkeypatch.setattr(polystrata.compiler, "compile_plans", spy)
    with pytest.raises(Planned):
        _run(capsys, str(tiny_model), "--target", "cpu", "--no-tuning", "-p", "8", "-n", "0", "--knob",
             "attention.mma=0", "--knob", "moe_ffn.mma_min=4096", "--knob", "matmul.split=rows")
    assert seen == {"attention": {"mma": 0}, "moe_ffn": {"mma_min": 4096}, "matmul": {"split": "rows"}}
    for bad in ("attention.nope=1", "nospace.mma=1", "attention.mma"):
        with pytest.raises(UsageError, match="expected SPACE.NAME=VALUE"):
            _run(capsys, str(tiny_model), "--target", "cpu", "--knob", bad)
    seen.clear()  # serve takes them the same way (the batched decode steps' schedules)
    from polystrata.cli import main

    with pytest.raises(Planned):
        main(["serve", str(tiny_model), "--target", "cpu", "--no-tuning", "--knob", "matmul.reuse=1", "--port", "0"])
    assert seen == {"matmul": {"reuse": 1}}


@pytest.mark.parametrize("argv, message", [(["-d", "-1"], "-d must be"), (["-c", "10", "-d", "8", "-n", "4"],
                                                                          "must hold depth + max(p, n) = 12")])
def test_bad_depth_or_context(tiny_model, capsys, argv, message):
    with pytest.raises(PolystrataError, match=re.escape(message)):
        _run(capsys, str(tiny_model), "--target", "reference", "-p", "0", *argv)


def test_decode_feeds_argmax_plus_a_random_offset():
    """Each decode step's input depends on the last logits (argmax) and is random (offset), as llama-bench's are."""
    import types

    fed = []

    class FakeEngine:
        hparams = types.SimpleNamespace(n_vocab=10)
        executor = None

        def rewind(self, n_past):
            assert n_past == 0

        def forward(self, ids):
            fed.append(ids[0])
            logits = np.zeros((1, 10), np.float32)
            logits[0, 7] = 1.0  # the argmax is always 7
            return logits

    bench._decode_once(FakeEngine(), 3, np.array([0, 5, 9]))
    assert fed == [3, 7, (7 + 5) % 10]

"""The step size, llama.cpp's -ub/--ubatch-size: the most tokens one step of a prompt computes. A prompt longer than
it runs in steps of that many with the same logits; the plans, the scratch memory, batched decoding, bench, the
artifact and every command that builds prompt plans follow it."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from test_chat_cli import polystrata  # `polystrata argv` in this process: exit code, stdout, stderr
from test_cli_habits import one_line_error

from polystrata.batch import BatchDecoder
from polystrata.compiler import DEFAULT_UBATCH
from polystrata.engine import Engine
from polystrata.errors import PolystrataError
from polystrata.ir.kernel import DTYPE_BYTES
from polystrata.synth import synth_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    # test_targets' and test_batch's model, at their context: the cpu kernels compile once per run.
    return synth_model("llama", tmp_path_factory.mktemp("ub") / "tiny.gguf", preset="tiny", qtype="Q8_0", seed=7)


def _tokens(n: int, seed: int = 0) -> list[int]:
    return [int(i) for i in np.random.default_rng(seed).integers(3, 1000, size=n)]


@pytest.mark.parametrize("target", ["reference", pytest.param("cpu", marks=pytest.mark.target("cpu"))])
def test_steps_of_16_and_64_give_the_same_logits(tiny, target):
    """A 50-token prompt in steps of 16 (16 + 16 + 16 + 2) and in one step of 64: the same logits, of every token
    and of the last, alone and in a sequence slot of batched decoding; the plans are made for the step size, and
    their scratch memory, inputs included, grows with it."""
    ids = _tokens(50)
    eng = {ub: Engine(tiny, target=target, n_ctx=64, n_ubatch=ub, all_logits=True, logit_rows=2) for ub in (16, 64)}
    steps: dict[int, list[int]] = {16: [], 64: []}
    for ub, e in eng.items():  # every step's rows, whether of `forward` or of a sequence slot's prefill
        step = e.executor.step
        e.executor.step = lambda graph, tokens, *args, ub=ub, step=step, **kw: (steps[ub].append(len(tokens)),
                                                                               step(graph, tokens, *args, **kw))[1]
    full = {ub: e.score(ids) for ub, e in eng.items()}
    assert steps == {16: [16, 16, 16, 2], 64: [50]}
    # The tolerance of test_models' chunked prefill (the kernel targets agree far closer).
    np.testing.assert_allclose(full[16], full[64], rtol=1e-3, atol=1e-3)
    for e in eng.values():
        e.reset()
    np.testing.assert_allclose(eng[16].forward(ids)[-1], eng[64].forward(ids)[-1], rtol=1e-3, atol=1e-3)
    # Batched decoding: a slot's prompt in steps of the engine's size; a step's rows (one per sequence) must fit it.
    bd = BatchDecoder(eng[16], 2)
    last = bd.prefill(bd.open(), ids[:30])
    np.testing.assert_allclose(last, full[64][29], rtol=1e-3, atol=1e-3)
    assert steps[16][-2:] == [16, 14]
    with pytest.raises(PolystrataError, match=r"^-np 17 does not fit a step of 16 rows \(-ub 16\)"):
        BatchDecoder(eng[16], 17)
    if target == "reference":
        return
    for ub, e in eng.items():
        plans = e.executor.plans
        assert [plans[id(g)].t_max for g in (e.graph_all, e.graph_last, e.graph_step)] == [ub, ub, 1]
        # The plans share one set of activation buffers (they never run at once): each plan's own are distinct,
        # and the set, counted once, is smaller than the plans' sum and no smaller than the largest plan's.
        acts = {pid: {n: e.executor.local[pid][n] for n, s in p.buffers.items() if s.kind == "activation"}
                for pid, p in plans.items()}
        assert all(len({id(h) for h in a.values()}) == len(a) for a in acts.values())
        shared = {id(h): h.nbytes for a in acts.values() for h in a.values()}
        per_plan = [sum(s.count * DTYPE_BYTES[s.dtype] for s in p.buffers.values() if s.kind == "activation")
                    for p in plans.values()]
        assert max(per_plan) <= sum(shared.values()) < sum(per_plan)
        assert e.memory.scratch_bytes >= sum(shared.values()) + 2 * 4 * ub  # tokens and positions of the largest step
        assert e.memory.scratch_bytes < sum(per_plan)
    assert eng[64].memory.scratch_bytes > eng[16].memory.scratch_bytes


def test_every_command_takes_the_step_size(tiny, tmp_path, capsys, monkeypatch):
    """-ub/--ubatch-size on run, chat, score, parity, bench, serve and compile, and an artifact's round trip:
    `compile -ub` records it, `run ARTIFACT` plans with it, and another -ub plans again, with a line saying so."""
    monkeypatch.setenv("POLYSTRATA_BANDWIDTH", "1e11")  # bench: no bandwidth measurement
    model, ref = str(tiny), ("--target", "reference")
    rc, _, err = polystrata(capsys, monkeypatch, "run", model, *ref, "-p", "hi", "-n", "1", "-ub", "4", "--verbose")
    assert rc == 0 and "step size: 4 tokens" in err, err
    rc, _, err = polystrata(capsys, monkeypatch, "chat", model, *ref, "-p", "hi", "-n", "1", "--ubatch-size", "5",
                            "--verbose")
    assert rc == 0 and "step size: 5 tokens" in err, err
    # score in steps of 4, then parity in steps of 64 against it: the score's npz is a fixture of the model.
    fixtures = tmp_path / "fixtures"
    text = "the quick brown fox jumps over the lazy dog"
    rc, _, err = polystrata(capsys, monkeypatch, "score", model, *ref, "--text", text, "-ub", "4", "-o",
                            str(fixtures / "fox.npz"))
    assert rc == 0, err
    (fixtures / "prompts.json").write_text(json.dumps({"fox": text}))
    rc, out, err = polystrata(capsys, monkeypatch, "parity", model, *ref, "--fixtures", str(fixtures), "-ub", "64")
    assert rc == 0 and out.startswith("parity tiny.gguf reference: "), err
    rc, out, _ = polystrata(capsys, monkeypatch, "bench", model, *ref, "-p", "8", "-n", "0", "-r", "1", "-ub", "24",
                            "-o", "json")
    r = json.loads(out)
    assert rc == 0 and r["n_ubatch"] == 24 and r["n_ctx"] == 24  # the default context holds a step
    rc, out, _ = polystrata(capsys, monkeypatch, "bench", model, *ref, "-p", "8", "-n", "0", "-r", "1", "-ub", "24",
                            "-o", "csv")
    assert rc == 0 and [row["n_ubatch"] for row in csv.DictReader(io.StringIO(out))] == ["24"]
    rc, out, _ = polystrata(capsys, monkeypatch, "bench", model, *ref, "-p", "8", "-n", "0", "-r", "1")
    assert rc == 0 and out.splitlines()[0].split("|")[7].strip() == "n_ubatch"
    assert out.splitlines()[2].split("|")[7].strip() == str(DEFAULT_UBATCH)
    rc, _, err = polystrata(capsys, monkeypatch, "serve", model, *ref, "-ub", "2", "-np", "3")
    assert rc == 1 and one_line_error(err).startswith("error: -np 3 does not fit a step of 2 rows (-ub 2)")
    # The artifact on the cpu target (its kernels as the test above compiled them: t_max does not change them).
    art = tmp_path / "art"
    rc, _, err = polystrata(capsys, monkeypatch, "compile", model, "--target", "cpu", "-c", "64", "-ub", "32", "-o",
                            str(art))
    assert rc == 0, err
    manifest = yaml.safe_load((art / "manifest.yaml").read_text())
    assert manifest["memory"]["n_ubatch"] == 32 and manifest["memory"]["n_ctx"] == 64
    rc, _, err = polystrata(capsys, monkeypatch, "run", str(art), "-p", "hi", "-n", "1", "--verbose")
    assert rc == 0 and "step size: 32 tokens" in err and "compiled for steps" not in err, err
    rc, _, err = polystrata(capsys, monkeypatch, "run", str(art), "-p", "hi", "-n", "1", "--verbose", "-ub", "16")
    assert rc == 0 and "step size: 16 tokens" in err, err
    assert f"{art} was compiled for steps of 32 tokens; -ub 16 plans its steps again" in err
    manifest["memory"]["n_ubatch"] = 0
    (art / "manifest.yaml").write_text(yaml.safe_dump(manifest))
    rc, _, err = polystrata(capsys, monkeypatch, "run", str(art), "-p", "hi", "-n", "1")
    assert rc == 1 and "memory.n_ubatch is not a positive step size" in one_line_error(err)


_COMMANDS = {  # each command's arguments, but -ub and the context; the reference target: nothing compiles
    "run": ("run", "-p", "hi", "-n", "1", "--target", "reference"),
    "chat": ("chat", "-p", "hi", "-n", "1", "--target", "reference"),
    "score": ("score", "--text", "hi", "-o", "unused.npz", "--target", "reference"),
    "bench": ("bench", "-p", "4", "-n", "0", "--target", "reference"),
    "serve": ("serve", "--target", "reference"),
    "compile": ("compile", "-o", "unused", "--target", "reference"),
    "tune": ("tune", "--target", "cpu"),
}


@pytest.mark.parametrize("cmd", list(_COMMANDS))
def test_step_size_refused_below_one_or_above_the_context(tiny, cmd, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # nothing is written, and nothing would land in the checkout
    args = (_COMMANDS[cmd][0], str(tiny), *_COMMANDS[cmd][1:])
    for bad in ("0", "-2", "x"):
        rc, _, err = polystrata(capsys, monkeypatch, *args, "-ub", bad)
        assert rc == 2 and one_line_error(err) == (f"error: argument -ub/--ubatch-size: expected a positive "
                                                   f"integer, got '{bad}'")
    if cmd == "tune":  # a kernel target's: its compile is more than this test needs
        return
    rc, _, err = polystrata(capsys, monkeypatch, *args, "-c", "8", "-ub", "9")
    assert rc == 1 and one_line_error(err) == ("error: the step size (-ub 9) is larger than the context (8 tokens): "
                                               "use -ub 8 or less, or a larger -c/--ctx-size")
    assert not list(tmp_path.iterdir())


def test_parity_refuses_a_step_size_above_the_context(tiny, capsys, monkeypatch, tmp_path):
    """parity takes the model's context (the reference's default: at most 4096 tokens)."""
    fixtures = tmp_path / "fixtures"
    rc, _, err = polystrata(capsys, monkeypatch, "score", str(tiny), "--target", "reference", "--text", "hi", "-o",
                            str(fixtures / "hi.npz"))
    (fixtures / "prompts.json").write_text(json.dumps({"hi": "hi"}))
    rc, _, err = polystrata(capsys, monkeypatch, "parity", str(tiny), "--target", "reference", "--fixtures",
                            str(fixtures), "-ub", "100000")
    assert rc == 1 and "error: the step size (-ub 100000) is larger than the context" in one_line_error(err)


@pytest.mark.parametrize("cmd", ["run", "chat", "serve", "score", "bench", "tune", "compile"])
def test_kernel_target_plans_take_the_step_size(tiny, cmd, capsys, monkeypatch, tmp_path):
    """On a kernel target every command plans its prompt steps (last logits; every token's for score alone) for -ub
    tokens and its decode steps for one; none is compiled here."""
    from polystrata import compiler

    class Planned(Exception):
        pass

    seen = []

    def spy(file, graphs, runtime, n_ctx, kv_type="f16", steps=None, **kw):
        seen.append(sorted((steps or {}).get(id(g), DEFAULT_UBATCH) for g in graphs))
        raise Planned

    monkeypatch.setattr(compiler, "compile_plans", spy)
    monkeypatch.chdir(tmp_path)
    args = {"run": ("-p", "hi"), "chat": ("-p", "hi"), "score": ("--text", "hi", "-o", "x.npz"),
            "bench": ("-p", "8", "-n", "4"), "compile": ("-o", "art"), "serve": ("--port", "0"), "tune": ()}[cmd]
    with pytest.raises(Planned):
        polystrata(capsys, monkeypatch, cmd, str(tiny), "--target", "cpu", "-c", "64", "-ub", "48", *args)
    assert seen == [[1, 48, 48] if cmd == "score" else [1, 48]]

"""Kernel autotuning: knob spaces, the tuning database, tuned knobs in plans and artifacts, `tune` sessions.

The tiny llama here is test_targets' (seed 7, n_ctx 64), so the engine's default kernels come from the run's
kernel cache; only candidates compile. Sessions tune the cheap instances (last_rows, embed) on opencl where PoCL
is present, else cpu.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import yaml

from polystrata.cli import main
from polystrata.codegen.policy import HOST_POLICY
from polystrata.codegen.recipes import RECIPES, Knob, KnobSpace, load_all
from polystrata.codegen.recipes import elementwise as ew
from polystrata.codegen.recipes.linear import MATMUL_SPACE
from polystrata.compiler.passes import build_plan
from polystrata.engine import Engine, tensor_table
from polystrata.errors import UsageError
from polystrata.gguf import GGUFFile
from polystrata.ir.formats import KV_FORMATS
from polystrata.ir.kernel import Kernel
from polystrata.models import build_graph
from polystrata.synth import synth_model
from polystrata.targets import available_kernel_targets
from polystrata.tuning import db as dbmod
from polystrata.tuning.db import TuningDB
from polystrata.tuning.tuner import Tuner, compare, parse_budget, parse_plans, work_in

TARGET = "opencl" if "opencl" in available_kernel_targets() else "cpu"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return synth_model("llama", tmp_path_factory.mktemp("tuning") / "llama-Q8_0.gguf", preset="tiny", qtype="Q8_0",
                       seed=7)


@pytest.fixture
def db(tmp_path, monkeypatch):
    """A tuning database of this test's own (the run's home is shared by every test)."""
    monkeypatch.setattr(dbmod, "db_path", lambda: tmp_path / "tuning.sqlite")
    return TuningDB()


def _row(sig="matmul.v6:matmul_q8_0_64x64:t1", device="dev A", compiler="c 1", knobs=None):
    return {"signature": sig, "target": "cpu", "device": device, "compiler": compiler,
            "knobs": {"rows": 2} if knobs is None else knobs, "best_s": 1e-5, "default_s": 2e-5, "spread": 0.01,
            "date": "2026-12-04T00:00:00Z"}


def test_knob_spaces_declare_candidates_within_their_constraints():
    load_all()
    spaces = {r.knobs.name: r.knobs for r in RECIPES if r.knobs is not None}
    assert {"matmul", "moe_ffn", "attention", "embed", "last_rows"} <= set(spaces)
    for space in spaces.values():
        for cand in space.candidates():
            full = {**space.defaults(), **cand}
            assert space.constraint is None or space.constraint(full)
            assert set(cand) <= set(space.defaults()) and 1 <= len(cand) <= 2
    singles = [c for c in MATMUL_SPACE.candidates() if len(c) == 1]
    # Each knob's extremes come before its middle values.
    rows = [c["rows"] for c in singles if "rows" in c]
    assert rows[:2] == [1, 8]
    assert MATMUL_SPACE.signature("matmul_q4_k_4096x4096", 1) == "matmul.v6:matmul_q4_k_4096x4096:t1"


def test_budget_and_plans_parse():
    assert parse_budget("30s") == 30 and parse_budget("10m") == 600 and parse_budget("1.5h") == 5400
    assert parse_budget("45") == 45
    for bad in ("", "0s", "-3m", "10 minutes", "m"):
        with pytest.raises(UsageError):
            parse_budget(bad)
    assert parse_plans("prefill, decode") == ("prefill", "decode")
    with pytest.raises(UsageError):
        parse_plans("decode,score")


def test_database_round_trip_and_keys(db, tmp_path):
    db.put_many([_row(), _row(device="dev B"), _row("embed.v1:embed_q8_0_64:t1", knobs={})])
    assert db.choices("cpu", "dev A", "c 1") == {"matmul.v6:matmul_q8_0_64x64:t1": {"rows": 2}}  # default rows left out
    assert db.choices("cpu", "dev C", "c 1") == {}  # another device misses
    assert db.choices("cpu", "dev A", "c 2") == {}  # another compiler version misses
    assert db.choices("opencl", "dev A", "c 1") == {}
    db.put(_row(knobs={"rows": 8}))  # the same key replaces
    assert db.choices("cpu", "dev A", "c 1")["matmul.v6:matmul_q8_0_64x64:t1"] == {"rows": 8}
    out = tmp_path / "export.json"
    assert db.export(out) == 3
    other = TuningDB(tmp_path / "other.sqlite")
    assert other.import_file(out) == 3
    assert other.rows() == db.rows()


@pytest.mark.parametrize("content,says", [
    (b"\xff\xfe garbage", "not JSON"),
    (b"[1, 2]", "not a tuning file"),
    (b'{"format": "polystrata-tuning/1", "rows": [{"signature": "x"}]}', "row 0: missing"),
    (json.dumps({"format": "polystrata-tuning/1", "rows": [_row(), {**_row(), "best_s": float("nan")}]}).encode(),
     "row 1: best_s"),
    (json.dumps({"format": "polystrata-tuning/1", "rows": [{**_row(), "knobs": {"rows": [1] * 3}}]}).encode(),
     "knob 'rows'"),
    (b"[" * 100000 + b"]" * 100000, "not JSON"),
    # Knob values reach generated kernel source (a C comment, a kernel's choices): only the space's own values.
    (json.dumps({"format": "polystrata-tuning/1", "rows": [{**_row(), "knobs": {"split": "*/ int x; /*"}}]}).encode(),
     "not one the knob space offers"),
    (json.dumps({"format": "polystrata-tuning/1", "rows": [{**_row(), "knobs": {"rows": 3}}]}).encode(),
     "knob 'rows' = '3'"),
    (json.dumps({"format": "polystrata-tuning/1", "rows": [{**_row(), "signature": "matmul.v99:x:t1"}]}).encode(),
     "names no knob space"),
], ids=["binary", "list", "missing", "nan", "knob-type", "deep", "knob-source", "knob-value", "space-version"])
def test_import_refuses_hostile_files(db, tmp_path, capsys, content, says):
    db.put(_row())
    before = db.rows()
    bad = tmp_path / "bad.json"
    bad.write_bytes(content)
    assert main(["tune", "--import", str(bad)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and says in err, err
    assert db.rows() == before  # nothing half-written


def test_tuned_knobs_reach_the_plan_and_the_manifest(tiny, db, tmp_path):
    with GGUFFile(tiny) as f:
        graph = build_graph(f.metadata, tensor_table(f), all_logits=False)
        formats = {n: t.fmt for n, t in f.tensors.items()}
    plan = build_plan(graph, formats, KV_FORMATS["f16"], 64, 1, policy=HOST_POLICY)
    sig = next(s.signature for sites in plan.group_sites for s in sites if s.signature.startswith("last_rows"))
    assert not any(k["tuned"] for k in plan.kernel_summary())
    tuned = build_plan(graph, formats, KV_FORMATS["f16"], 64, 1, policy=dataclasses.replace(
        HOST_POLICY, tuned={sig: {"chunk": 32}}))
    summary = {k["name"]: k for k in tuned.kernel_summary()}
    assert summary["last_rows_128"]["tuned"] and summary["last_rows_128"]["knobs"] == {"chunk": 32}
    assert sum(k["tuned"] for k in summary.values()) == 1

    # Through the database: compile picks the choice up for this device, and the manifest says so.
    from polystrata.targets import make_runtime
    from polystrata.tuning import machine_key

    target, device, compiler = machine_key(make_runtime("cpu"))
    db.put({**_row(sig, device, compiler, {"chunk": 32}), "target": target})
    assert main(["compile", str(tiny), "--target", "cpu", "-c", "64", "-o", str(tmp_path / "art")]) == 0
    kernels = yaml.safe_load((tmp_path / "art" / "manifest.yaml").read_text())["kernels"]
    mine = [k for k in kernels if k["plan"] == "decode" and k["name"] == "last_rows_128"]
    assert mine and mine[0]["tuned"] is True and mine[0]["knobs"] == {"chunk": 32}
    assert not any(k["tuned"] for k in kernels if k["name"] != "last_rows_128")
    assert main(["compile", str(tiny), "--target", "cpu", "-c", "64", "--no-tuning", "-o", str(tmp_path / "a2")]) == 0
    kernels = yaml.safe_load((tmp_path / "a2" / "manifest.yaml").read_text())["kernels"]
    assert not any(k["tuned"] for k in kernels)


def test_compare_tolerates_rounding_not_errors():
    want = {"y": np.array([1.0, -2.0, 3.0], np.float32), "kv": np.array([1, 2], np.uint8)}
    assert compare(want, {"y": want["y"] + 1e-4, "kv": want["kv"]}, 1e-3) is None
    assert "differs by" in compare(want, {"y": want["y"] * 1.01, "kv": want["kv"]}, 1e-3)
    assert "kv differs" in compare(want, {"y": want["y"], "kv": want["kv"] + 1}, 1e-3)
    assert "NaN" in compare(want, {"y": np.full(3, np.nan, np.float32), "kv": want["kv"]}, 1e-3)
    assert "does not write" in compare(want, {"y": want["y"]}, 1e-3)


def _corrupting_last_row(monkeypatch, request):
    """Give last_rows a fake knob `corrupt` whose candidate 1 adds 1 to every value it copies."""
    space = KnobSpace("last_rows", (Knob("chunk", ew.CHUNK, (32,)), Knob("corrupt", 0, (1,))))
    monkeypatch.setitem(ew._SPACES, "last_rows", space)
    i = next(i for i, r in enumerate(RECIPES) if r.name == "last_rows")
    lower = RECIPES[i].lower

    def corrupting(nodes, ctx):
        (la,) = lower(nodes, ctx)
        if not ctx.knobs.get(ctx.sites[-1].signature, {}).get("corrupt"):
            return [la]
        k = la.kernel
        (lanes,) = k.body
        (guard,) = lanes.body
        (store,) = guard.then
        wrong = dataclasses.replace(store, value=store.value + 1.0)
        body = (dataclasses.replace(lanes, body=(dataclasses.replace(guard, then=(wrong,)),)),)
        kern = Kernel(k.name + "_bad", k.params, k.grid, body, lanes=k.lanes, knobs=(*k.knobs, ("corrupt", 1)))
        return [dataclasses.replace(la, kernel=kern)]

    old = RECIPES[i]
    RECIPES[i] = dataclasses.replace(old, lower=corrupting, knobs=space)
    request.addfinalizer(lambda: RECIPES.__setitem__(i, old))


def test_tune_rejects_a_wrong_candidate_keeps_what_it_measured_and_resumes(tiny, db, monkeypatch, request):
    _corrupting_last_row(monkeypatch, request)
    engine = Engine(tiny, target=TARGET, n_ctx=64, tuning=False)
    logs = []
    tuner = Tuner(engine, db, 60.0, only="last_rows", log=logs.append)
    todo = tuner.jobs_todo()
    assert [j[2].split(":")[-1] for j in todo] == ["t1", "t256"]  # one last_rows instance per plan

    calls = []
    tune_site = Tuner._tune_site

    def interrupted_second(self, *args):
        calls.append(args[2])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return tune_site(self, *args)

    monkeypatch.setattr(Tuner, "_tune_site", interrupted_second)
    with pytest.raises(KeyboardInterrupt):
        tuner.run()
    (res,) = tuner.results
    # chunk 32 alone is right, corrupt=1 is not; the pair is not tried, as one of its changes alone was wrong
    assert res.tried == 2 and res.rejected == 1
    assert any("corrupt" in m and "rejected, wrong output" in m for m in logs)
    rows = db.rows()
    assert [r["signature"] for r in rows] == [calls[0]]  # the finished instance was kept
    assert "corrupt" not in rows[0]["knobs"]

    monkeypatch.setattr(Tuner, "_tune_site", tune_site)
    again = Tuner(engine, db, 60.0, only="last_rows", log=logs.append)
    assert [j[2] for j in again.jobs_todo()] == [calls[1]]  # resumes with what was left
    again.run()
    assert len(db.rows()) == 2 and not Tuner(engine, db, 60.0, only="last_rows").jobs_todo()


def test_an_instance_cut_short_goes_on_where_it_stopped(tiny, db, monkeypatch, request):
    _corrupting_last_row(monkeypatch, request)
    engine = Engine(tiny, target=TARGET, n_ctx=64, tuning=False)
    logs = []
    tuner = Tuner(engine, db, 60.0, plans=("decode",), only="last_rows", log=logs.append)
    put = db.put_tried

    def spent_after_one(*args):  # the budget runs out once the first candidate is measured
        put(*args)
        tuner.budget_s = 0.0

    monkeypatch.setattr(db, "put_tried", spent_after_one)
    (res,) = tuner.run()
    assert res.tried == 1 and not res.complete and len(res.candidate_s) == 1
    assert any("budget was spent after 1 candidates" in m for m in logs)
    sig = res.signature
    assert sig in db.unfinished(tuner.key) and [j[2] for j in tuner.jobs_todo()] == [sig]

    monkeypatch.setattr(db, "put_tried", put)
    again = Tuner(engine, db, 60.0, plans=("decode",), only="last_rows", log=logs.append)
    (res,) = again.run()
    # The first candidate's measurement is taken from the database; only the second is measured now.
    assert res.tried == 2 and res.rejected == 1 and res.complete and len(res.candidate_s) == 1
    assert not db.unfinished(again.key) and not again.jobs_todo()
    assert [r["signature"] for r in db.rows()] == [sig]


def test_attention_is_timed_on_a_short_and_a_deep_cache(tiny, db, monkeypatch):
    """A decode kernel that reads the cache's length is timed at the tuner's depth and deep in the context, so a
    choice that wins on a short cache only is not kept; kernels that do not read it run at the one depth."""
    from polystrata.compiler.executor import BoundLaunch

    engine = Engine(tiny, target=TARGET, n_ctx=64, tuning=False)
    seen: dict[str, set[int]] = {}
    run = BoundLaunch.run

    def spying(self, rt, step):
        seen.setdefault(self.ck.kernel.name, set()).add(step["n_kv"])
        return run(self, rt, step)

    monkeypatch.setattr(BoundLaunch, "run", spying)
    # One candidate that does not lower: the default's timing is what this looks at.
    monkeypatch.setattr(KnobSpace, "singles", lambda self: [{"chunk": 3}])
    monkeypatch.setattr(Tuner, "candidate_launches", lambda *a: (_ for _ in ()).throw(ValueError("no")))
    tuner = Tuner(engine, db, 60.0, plans=("decode",), only="attention|last_rows", log=lambda m: None)
    assert tuner.deep_depth() == 48
    seen.clear()
    tuner.run()
    decode = {la.kernel.name for la in engine.executor.plans[id(engine.graph_step)].launches}
    attn = [n for n in decode if n.startswith("attn")]
    assert attn and all(seen[n] == {33, 49} for n in attn), seen  # DECODE_DEPTH + 1 and deep_depth() + 1 keys
    assert 49 not in seen[next(n for n in decode if n.startswith("last_rows"))]


def test_candidates_that_change_only_kernels_gated_off_in_the_timed_step_are_skipped(tiny, db, monkeypatch):
    """A prefill plan holds kernels gated to other row counts (the short steps' matvecs): a candidate that changes
    only those changes nothing the tuner times at its step, so it is not compiled or measured."""
    from polystrata.ir.expr import Const

    engine = Engine(tiny, target=TARGET, n_ctx=64, tuning=False)
    monkeypatch.setattr(KnobSpace, "singles", lambda self: [{"chunk": 32}, {"chunk": 64}])
    made = Tuner.candidate_launches

    def with_gated(plan, m, first, sig, knobs):
        launches, specs = made(plan, m, first, sig, {})  # the default's own launches
        if knobs["chunk"] == 32:  # plus a kernel with no groups in this step: nothing that runs changes
            extra = dataclasses.replace(launches[0].kernel, name=launches[0].kernel.name + "_gated",
                                        grid=(Const(0),) * len(launches[0].kernel.grid))
            return [*launches, dataclasses.replace(launches[0], kernel=extra)], specs
        return launches, specs

    monkeypatch.setattr(Tuner, "candidate_launches", staticmethod(with_gated))
    (res,) = Tuner(engine, db, 60.0, plans=("decode",), only="last_rows", log=lambda m: None).run()
    assert res.tried == 0 and res.complete


def test_candidates_that_move_only_a_gate_beyond_the_timed_step_are_skipped(tiny, monkeypatch):
    """A candidate whose kernels differ from the default's only in their name and in a gate that keeps the grid
    the same at the timed step (knob mma_split_above, where split K is timed at 16 rows) does the same work there
    (`work_in`): skipped without compiling. One whose gate takes the kernel out of that step is not."""
    from polystrata.codegen.recipes.tile_matmul import step_gate

    engine = Engine(tiny, target=TARGET, n_ctx=64, tuning=False)
    plan = engine.executor.plans[id(engine.graph_last)]
    m = next(i for i, ss in enumerate(plan.group_sites) if any(s.signature.startswith("last_rows") for s in ss))
    first, sig = plan.groups.index(m), plan.group_sites[m][0].signature
    step = plan.step_symbols(16, 0)
    made = Tuner.candidate_launches

    def regated(plan, m, first, sig, knobs):
        launches, specs = made(plan, m, first, sig, {})  # the default's own launches, gated anew
        la = launches[0]
        assert ("T", "T") in la.scalars
        gate = (8, knobs["above"] > 8)  # steps of more than 8 rows, or of at most 8
        kernel = dataclasses.replace(la.kernel, name=f"{la.kernel.name}_{knobs['above']}",
                                     grid=(step_gate(la.kernel.grid[0], gate), *la.kernel.grid[1:]))
        return [dataclasses.replace(la, kernel=kernel), *launches[1:]], specs

    monkeypatch.setattr(Tuner, "candidate_launches", staticmethod(regated))
    seen = {work_in(Tuner.candidate_launches(plan, m, first, sig, {"above": 9})[0], step)}
    kept = Tuner.lower_candidates(engine.runtime, plan, m, first, sig, [{"above": 12}, {"above": 4}], step, seen,
                                  {})
    assert [knobs for knobs, _, _ in kept] == [{"above": 4}]  # 12: the same groups at 16 rows as 9's; 4: none


def test_an_instance_is_timed_at_the_steps_of_its_kernel_family(tiny, db, monkeypatch):
    """A prompt plan's instances of kernels that serve some of its steps only (`Site.rows`: split-K products for
    batched decoding, say) are timed at a step of those rows, not at the prompt chunk of `PREFILL_TOKENS`, where
    their kernels do not run."""
    engine = Engine(tiny, target=TARGET, n_ctx=64, tuning=False)
    plan = engine.executor.plans[id(engine.graph_last)]
    plan.group_sites[:] = [tuple(dataclasses.replace(s, rows=7) if s.signature.startswith("last_rows") else s
                                 for s in ss) for ss in plan.group_sites]
    tuner = Tuner(engine, db, 60.0, plans=("prefill",), only="last_rows|embed", log=lambda m: None)
    assert {j[2].split(".")[0]: j[5] for j in tuner.jobs_todo()} == {"last_rows": 7, "embed": None}
    assert set(tuner.step_times()) == {("prefill", 7), ("prefill", None)}
    steps = []
    step = Tuner._step

    def recorded(self, plan_name, rows=None):
        symbols = step(self, plan_name, rows)
        steps.append(symbols["T"])
        return symbols

    monkeypatch.setattr(Tuner, "_step", recorded)
    monkeypatch.setattr(KnobSpace, "singles", lambda self: [{"chunk": 3}])
    monkeypatch.setattr(Tuner, "candidate_launches", lambda *a: (_ for _ in ()).throw(ValueError("no")))
    done = {r.signature.split(".")[0]: t for r, t in zip(tuner.run(), steps[-2:])}
    assert done == {"last_rows": 7, "embed": 64}  # each at its own step: 7 rows; the context's 64 (a prompt chunk)


def test_a_much_slower_candidate_is_not_timed_further(tiny, db, monkeypatch):
    """A candidate whose first timed run takes SLOW times the default's keeps that run as its time: the rounds
    after it would only spend the budget (a prefill matmul on its f32 path ran seconds a round)."""
    import time

    from polystrata.compiler.executor import BoundLaunch

    engine = Engine(tiny, target=TARGET, n_ctx=64, tuning=False)
    monkeypatch.setattr(KnobSpace, "singles", lambda self: [{"chunk": 32}])
    made = Tuner.candidate_launches

    def renamed(plan, m, first, sig, knobs):  # the default's kernels, renamed and with a knob of their own
        launches, specs = made(plan, m, first, sig, {})
        return [dataclasses.replace(la, kernel=dataclasses.replace(la.kernel, name=la.kernel.name + "_slow",
                                                                   knobs=(*la.kernel.knobs, ("slow", 1))))
                for la in launches], specs

    runs = []
    run = BoundLaunch.run

    def slowed(self, rt, step):
        if self.ck.kernel.name.endswith("_slow"):
            runs.append(1)
            time.sleep(0.05)
        return run(self, rt, step)

    monkeypatch.setattr(Tuner, "candidate_launches", staticmethod(renamed))
    monkeypatch.setattr(BoundLaunch, "run", slowed)
    (res,) = Tuner(engine, db, 60.0, plans=("decode",), only="last_rows", log=lambda m: None).run()
    assert res.tried == 1 and not res.best and res.complete and res.best_time.spread == 0.0
    # last_rows is one launch of one match: the output check, then a warm-up and the one timed run twice (its
    # measurement, and the final one beside the default's as the only candidate); not the 5 rounds after.
    assert len(runs) == 5


def test_compile_workers_by_default(monkeypatch):
    """A host target times on the CPUs the workers compile on: half of them; a device times there: all CPUs but
    two, at most 8."""
    from polystrata.tuning.tuner import default_jobs

    for cpus, host, device in ((2, 1, 1), (16, 4, 8), (6, 3, 4), (64, 4, 8)):
        monkeypatch.setattr("os.sched_getaffinity", lambda pid, n=cpus: set(range(n)))
        assert (default_jobs(True), default_jobs(False)) == (host, device)


def test_pairs_are_tried_of_the_single_changes_that_were_faster():
    space = KnobSpace("s", (Knob("a", 1, (2, 3)), Knob("b", 1, (2,)), Knob("c", 1, (2,))),
                      constraint=lambda kn: not (kn["a"] == 3 and kn["c"] == 2))
    assert space.singles() == [{"a": 2}, {"a": 3}, {"b": 2}, {"c": 2}]
    assert space.pairs([{"c": 2}, {"a": 2}, {"a": 3}, {"b": 2}]) == [{"c": 2, "a": 2}, {"c": 2, "b": 2},
                                                                     {"a": 2, "b": 2}, {"a": 3, "b": 2}]
    assert space.candidates() == space.singles() + [{"a": 2, "b": 2}, {"a": 2, "c": 2}, {"a": 3, "b": 2},
                                                    {"b": 2, "c": 2}]


def test_tune_stops_at_its_budget(tiny, db):
    engine = Engine(tiny, target=TARGET, n_ctx=64, tuning=False)
    budget = 2.0
    tuner = Tuner(engine, db, budget, only="embed|last_rows", log=lambda m: None)
    todo = len(tuner.jobs_todo())
    tuner.run()
    starts = [t for r in tuner.results for t, _ in r.candidate_s]
    assert starts and all(t < budget for t in starts)  # no candidate starts once the budget is spent
    longest = max(s for r in tuner.results for _, s in r.candidate_s)
    setup = max(r.setup_s for r in tuner.results)
    assert tuner.elapsed() <= budget + longest + setup + 1.0  # + the last instance's final timing
    assert todo
    logs = []
    spent = Tuner(engine, TuningDB(db.path.with_name("other.sqlite")), 1e-9, only="embed|last_rows", log=logs.append)
    assert spent.run() == [] and "budget of 0 s spent; 4 kernel instances left" in logs[-1]


def test_gpu_renderers_ignore_contract_and_the_tuner_does_not_try_it(tiny, db, monkeypatch):
    """`contract` is inert on the GPU targets (their policies say so, and their renderers spell the same code
    either way but for the knob comment); the tuner does not spend a candidate on it there."""
    from polystrata.codegen import cuda, hip, opencl
    from polystrata.codegen.policy import device_policy

    assert "contract" in device_policy(64, 1).inert_knobs and "contract" not in HOST_POLICY.inert_knobs
    engine = Engine(tiny, target=TARGET, n_ctx=64, tuning=False)
    kernel = next(la.kernel for la in engine.executor.plans[id(engine.graph_step)].launches
                  if la.kernel.name.startswith("matmul") and not la.kernel.contract)
    fused = dataclasses.replace(kernel, contract=True, knobs=(*kernel.knobs, ("contract", 1)))
    for render in (cuda.render, lambda k: hip.render(k, "gfx90a"), opencl.render):
        plain, other = (render(k).replace(repr(dict(k.knobs)), "") for k in (kernel, fused))
        assert plain == other
    if TARGET != "opencl":
        return
    # The f32 path with contract: a kernel unlike the default's (int8 on a GPU), so only the policy skips it.
    fused_f32 = [{"int8": 0, "contract": 1}]
    monkeypatch.setattr(KnobSpace, "singles", lambda self: fused_f32 if self.name == "matmul" else [])
    tuner = Tuner(engine, db, 60.0, plans=("decode",), only=r"matmul_q8_0_128x128:t1$", log=lambda m: None)
    (res,) = tuner.run()
    assert res.tried == 0


def test_tune_takes_the_instances_with_the_largest_share_of_a_step_first(tiny, db, monkeypatch):
    engine = Engine(tiny, target=TARGET, n_ctx=64, tuning=False)
    tuner = Tuner(engine, db, 60.0, only="embed|last_rows", log=lambda m: None)
    jobs = tuner.jobs_todo()
    todo = [job[2] for job in jobs]
    steps = tuner.step_times()
    times = {sig: t for ts in steps.values() for sig, t in ts.items()}
    assert set(todo) <= set(times) and all(times[sig] > 0 for sig in todo)  # every instance's launches timed
    # The last in plan order the largest share of its step (each step's instances adding up to the same total).
    ranked: dict = {}
    for i, job in enumerate(jobs, 1):
        ranked.setdefault((job[0], job[5]), {})[job[2]] = i
    total = sum(range(len(jobs) + 1))
    for times_of in ranked.values():
        times_of["rest"] = total - sum(times_of.values())
    monkeypatch.setattr(Tuner, "step_times", lambda self: ranked)
    monkeypatch.setattr(KnobSpace, "singles", lambda self: [{"chunk": 3}])
    monkeypatch.setattr(Tuner, "candidate_launches", lambda *a: (_ for _ in ()).throw(ValueError("no")))
    assert [r.signature for r in tuner.run()] == todo[::-1]


def test_candidates_that_do_not_lower_are_logged_once_a_reason(tiny, db, monkeypatch):
    engine = Engine(tiny, target=TARGET, n_ctx=64, tuning=False)
    monkeypatch.setattr(KnobSpace, "singles", lambda self: [{"chunk": 3}, {"chunk": 5}, {"chunk": 7}])

    def refuse(plan, m, i, sig, knobs):
        raise ValueError("odd chunk" if knobs["chunk"] != 5 else "five")

    monkeypatch.setattr(Tuner, "candidate_launches", staticmethod(refuse))
    logs = []
    (res,) = Tuner(engine, db, 60.0, plans=("decode",), only="last_rows", log=logs.append).run()
    assert res.tried == 0
    skipped = [m for m in logs if "skipped" in m]
    assert len(skipped) == 2 and "2 candidates skipped" in skipped[0] and "odd chunk" in skipped[0]


# Per target: the extremes of rows, and the schedule the other kind of target takes by default.
EXTREMES = {"cpu": [{"rows": 1}, {"rows": 8}, {"int8": 1}],
            "opencl": [{"rows": 8}, {"xq": "inline"}, {"split": "rows", "xq": "inline"}]}


@pytest.mark.slow
@pytest.mark.parametrize("target", [t for t in EXTREMES if t in available_kernel_targets()])
def test_matmul_candidates_at_the_extremes_compile_and_agree(tiny, db, monkeypatch, target):
    """A sample of matmul candidates, extremes included, tuned for real: every one compiles (in two worker
    processes) and agrees with the default within the tolerance (none rejected)."""
    sample = EXTREMES[target]
    monkeypatch.setattr(KnobSpace, "singles", lambda self: sample if self.name == "matmul" else [])
    monkeypatch.setattr(KnobSpace, "pairs", lambda self, among: [])
    engine = Engine(tiny, target=target, n_ctx=64, tuning=False)
    logs = []
    tuner = Tuner(engine, db, 600.0, plans=("decode",), only=r"matmul_q8_0_128x128:t1$", jobs=2, log=logs.append)
    (res,) = tuner.run()
    assert res.rejected == 0, logs
    assert res.tried == len(sample)



def test_bench_tuning_both_runs_untuned_then_tuned(tiny, db, monkeypatch, capsys):
    from polystrata import bench
    from polystrata.targets import make_runtime
    from polystrata.tuning import machine_key

    monkeypatch.setenv(bench.BANDWIDTH_ENV, "1e11")  # no bandwidth measurement
    target, device, compiler = machine_key(make_runtime("cpu"))
    sig = "last_rows.v1:last_rows_128:t1"
    db.put({**_row(sig, device, compiler, {"chunk": 32}), "target": target})
    assert main(["bench", str(tiny), "--target", "cpu", "-c", "64", "-p", "4", "-n", "2", "-r", "1",
                 "--tuning", "both", "-o", "json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["untuned"]["tuned_kernels"] == [] and r["tuned"]["tuned_kernels"] == [sig]
    assert not r["untuned"]["tuning"] and r["tuned"]["tuning"] and set(r["ratio"]) == {"pp", "tg"}
    assert main(["bench", str(tiny), "--tuning", "both", "-o", "csv"]) == 2
    assert "md or json" in capsys.readouterr().err

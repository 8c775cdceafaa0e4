"""Batched decoding (polystrata/batch.py): sequences sharing each decode step give what each gives alone."""

from __future__ import annotations

import numpy as np
import pytest
from suite_plugin import targets_under_test

from polystrata.batch import BatchDecoder
from polystrata.engine import Engine
from polystrata.errors import PolystrataError
from polystrata.runtimes.cpu import CPURuntime
from polystrata.synth import synth_model


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    # The same model and context as test_targets' llama: the kernels compile once per run.
    return synth_model("llama", tmp_path_factory.mktemp("batch") / "llama.gguf", preset="tiny", qtype="Q8_0", seed=7)


def _tokens(n: int, seed: int) -> list[int]:
    return [int(i) for i in np.random.default_rng(seed).integers(3, 1000, size=n)]


class _GraphCPU(CPURuntime):
    """The cpu runtime with device graphs as the cuda simulator has them: captured launches are recorded with
    their arguments, and a replay runs them again (reading the buffers as they are then)."""

    graphs = True  # what runtimes that capture device graphs state

    def __init__(self) -> None:
        super().__init__()
        self.recording: list | None = None
        self.replays = 0

    def begin_capture(self) -> None:
        self.recording = []

    def launch(self, ck, args, grid) -> None:
        if self.recording is None:
            super().launch(ck, args, grid)
        else:
            self.recording.append((ck, args, grid))

    def end_capture(self) -> list:
        graph, self.recording = self.recording, None
        return graph

    def replay(self, graph: list) -> None:
        self.replays += 1
        for launch in graph:
            super().launch(*launch)


@pytest.mark.parametrize("target", ["reference", *targets_under_test(), "cpu-graphs"])
def test_batched_steps_match_each_sequence_alone(tiny_llama, target):
    """Three sequences prefilled one by one, then decoded together, leaving at different steps; a fourth joins in
    the slot the first left (its rows hold the first's stale K/V). Every sequence's logits equal those of the
    same tokens run alone: bit for bit on the kernel targets (the same kernels, rows independent), within float
    rounding on the reference (numpy's sums over other shapes). The decode steps, of 3 rows and then 2, run the
    plan of the last 4 rows' logits (`Engine(logit_rows=4)`, as `serve -np 4` makes it): fewer rows than it takes,
    it computes the logits of the step's rows only (T_last): on the kernel targets the rows of its logits buffer
    past them, poisoned before each step, stay NaN. The engine has no plan of every row's logits. cpu-graphs: the
    batched run's steps replayed as device graphs, one per plan and row count, as cuda does."""
    eng = Engine(tiny_llama, target=target.removesuffix("-graphs"), n_ctx=64, logit_rows=4)
    if target == "cpu-graphs":
        alone_eng = eng
        eng = Engine(tiny_llama, target="cpu", n_ctx=64, logit_rows=4)
        eng.runtime = _GraphCPU()
        eng.executor = eng._make_executor()
    else:
        alone_eng = eng
    prompts = [_tokens(n, s) for n, s in ((5, 1), (9, 2), (3, 3), (4, 4))]
    conts = [_tokens(n, s) for n, s in ((3, 5), (7, 6), (6, 7), (2, 8))]  # steps of 3, 3, 3, 2, 2, 1 rows
    alone = []
    for p, c in zip(prompts, conts):
        alone_eng.reset()
        alone.append(np.stack([alone_eng.forward(p)[-1], *(alone_eng.forward([t])[-1] for t in c[:-1])]))
    if target != "reference":  # the last_rows launch and every one after it take their rows from T_last
        plan = eng.executor.plans[id(eng.graph_rows)]
        first = next(i for i, la in enumerate(plan.launches) if la.kernel.name.startswith("last_rows"))
        assert ["T_last" in dict(la.scalars).values() for la in plan.launches] == [i >= first
                                                                                  for i in range(len(plan.launches))]
        assert [plan.step_symbols(t, 7)["T_last"] for t in (2, 3, 4, 9)] == [2, 3, 4, 4]
    bd = BatchDecoder(eng, 3)
    assert bd.n_ctx == 21
    got: dict[int, list] = {s: [] for s in range(4)}
    slot: dict[int, int] = {}
    rows_steps = []  # the row counts of the steps on the plan of the last rows

    def batched(runs: list) -> np.ndarray:
        """A step of decode rows; on the kernel targets, the rows plan's logits past the step's rows untouched."""
        if target == "reference" or len(runs) == 1:
            return bd.step(runs)
        plan = eng.executor.plans[id(eng.graph_rows)]
        logits, width = eng.executor.handles[(id(plan), plan.output)], plan.output_shape[1]
        eng.runtime.write(logits, np.full(4 * width, np.nan, np.float32))
        out = bd.step(runs)
        have = eng.runtime.download(logits, (4, width), "f32")
        assert np.isfinite(have[:len(runs)]).all() and np.isnan(have[len(runs):]).all()
        rows_steps.append(len(runs))
        return out

    def join(s: int) -> None:
        slot[s] = bd.open()
        got[s].append(bd.prefill(slot[s], prompts[s]))

    for s in range(3):
        join(s)
    step, done = 0, set()
    pending = {s: 0 for s in range(3)}  # sequence -> index of its next token
    while pending:
        seqs = sorted(pending, key=lambda s: (s + step) % 3)  # rows in a varying order
        out = batched([(slot[s], [conts[s][pending[s]]]) for s in seqs])
        for row, s in enumerate(seqs):
            got[s].append(out[row])
            pending[s] += 1
            if pending[s] == len(conts[s]) - 1:
                del pending[s]
                bd.close(slot[s])
                done.add(s)
        if 0 in done and 3 not in slot:
            join(3)
            assert slot[3] == slot[0]
            pending[3] = 0
        step += 1
    for s in range(4):
        have = np.stack(got[s])
        if target == "reference":
            np.testing.assert_allclose(have, alone[s], rtol=1e-4, atol=1e-4)
        else:
            np.testing.assert_array_equal(have, alone[s])
    assert target == "reference" or {2, 3} <= set(rows_steps)
    if target == "cpu-graphs":  # the steps of 3 and 2 rows of the last rows' plan after the first ran as graphs
        assert {(id(eng.graph_rows), 3), (id(eng.graph_rows), 2)} <= set(eng.executor.graphs)
        assert eng.runtime.replays >= 2


@pytest.mark.parametrize("target", ["reference", *targets_under_test(), "cpu-graphs",
                                    *(f"{t}-tiles" for t in targets_under_test() if t != "cpu")])
def test_mixed_steps_match_each_sequence_alone(tiny_llama, target):
    """Steps mixing decode rows with runs of prompt tokens (continuous batching): a run of several rows of one
    sequence attends causally to its own earlier rows of the same step and to its cache, not to the rows of other
    sequences or its own later ones; each wanted row's logits equal those of the same tokens run alone (bit for bit
    on the kernel targets, within float rounding on the reference), and only the wanted rows leave the device.
    Steps wanting several rows of more run the plan of the last 4 rows' logits (`Engine(logit_rows=4)`), the
    wanted runs' last tokens laid out last and their earlier ones first (a run split in two), also at a step of
    fewer than 4 rows; steps of decode rows only too: no step runs the plan of every row's logits (the cpu-graphs
    engine has none).
    -tiles: the prefill attention in tiles of 4 query rows at every step size (GPU targets take it for steps over 64
    rows), so tiles hold rows of several sequences. cpu-graphs: steps replayed as device graphs (as on cuda), the
    9-row graph captured at one mixed step replayed at another, of other sequences and positions."""
    knobs = {"attention": {"tiles": "1", "tiles_above": "0", "q_tile": "4"}} if target.endswith("-tiles") else None
    eng = alone_eng = Engine(tiny_llama, target=target.removesuffix("-tiles").removesuffix("-graphs"), n_ctx=64,
                             knobs=knobs, logit_rows=4, all_logits=True)  # all: the logits of each run alone
    if target == "cpu-graphs":
        eng = Engine(tiny_llama, target="cpu", n_ctx=64, logit_rows=4)
        eng.runtime = _GraphCPU()
        eng.executor = eng._make_executor()
    seqs = [_tokens(n, s) for n, s in ((19, 11), (17, 12), (18, 13))]  # each: its prompt, then what it decodes
    alone = []
    for ids in seqs:
        alone_eng.reset()
        alone.append(alone_eng.forward(ids, all_logits=True))
    bd = BatchDecoder(eng, 3)
    a, b, c = bd.open(), bd.open(), bd.open()
    slot_of = {a: 0, b: 1, c: 2}
    read: list[int] = []
    plans: list[str] = []
    graphs = {id(eng.graph_step): "step", id(eng.graph_last): "last", id(eng.graph_all): "all",
              id(eng.graph_rows): "rows"}
    step = eng.executor.step
    eng.executor.step = lambda graph, *a, **kw: (plans.append(graphs[id(graph)]), step(graph, *a, **kw))[1]
    if eng.runtime is not None:  # count the bytes that leave the device
        read_bytes = eng.runtime.read_bytes
        eng.runtime.read_bytes = lambda buf, out, offset=0: (read.append(out.size), read_bytes(buf, out, offset))[1]

    def check(runs: list[tuple[int, int, int]], need: list[bool], plan: str) -> None:
        """A step of runs (slot, first, end) of the sequences' tokens: the wanted rows against the runs alone, the
        step run with `plan`."""
        read.clear()
        out = bd.step([(s, seqs[slot_of[s]][i:j]) for s, i, j in runs], need)
        want = np.stack([alone[slot_of[s]][j - 1] for (s, _, j), w in zip(runs, need) if w])
        assert out.shape == want.shape
        if target == "reference":
            np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)
        else:
            np.testing.assert_array_equal(out, want)
            assert sum(read) == out.nbytes  # only the wanted rows were read
        for s, _, j in runs:
            assert bd.n_past[s] == j
        assert plans[-1] == plan

    check([(a, 0, 5)], [True], "last")  # a prompt alone
    check([(a, 5, 6), (b, 0, 4)], [True, False], "last")  # one row wanted: its run goes last
    check([(a, 6, 7), (b, 4, 9), (c, 0, 3)], [True, True, False], "rows")  # a chunk ending a prompt, one starting
    check([(b, 9, 10), (c, 3, 8), (a, 7, 8)], [True, True, True], "rows")  # a prompt's run between decode rows
    check([(a, 8, 9), (c, 8, 10)], [False, True], "last")
    check([(b, 10, 11)], [True], "step")  # one decode row
    check([(a, 9, 12), (c, 10, 15), (b, 11, 12)], [False, True, True], "rows")  # 9 rows again (captured)
    check([(a, 12, 17), (b, 12, 16)], [True, True], "rows")  # and again (replayed)
    check([(c, 15, 17), (a, 17, 18)], [True, True], "rows")  # 3 rows: the plan keeps 3
    check([(a, 18, 19), (b, 16, 17), (c, 17, 18)], [True, True, True], "rows")  # decode rows only
    assert "all" not in plans
    if target == "cpu-graphs":
        assert (id(eng.graph_rows), 9) in eng.executor.graphs and eng.runtime.replays >= 2


class _OrderedCPU(_GraphCPU):
    """_GraphCPU noting when work is queued (a launch, a graph's replay) and when results are read back."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[str] = []

    def launch(self, ck, args, grid) -> None:
        self.events.append("queued")
        super().launch(ck, args, grid)

    def replay(self, graph: list) -> None:
        self.events.append("queued")
        super().replay(graph)

    def download_rows(self, buf, width, rows, dtype):
        self.events.append("read")
        return super().download_rows(buf, width, rows, dtype)


def test_launched_is_called_between_the_work_and_its_results(tiny_llama):
    """`step(..., launched=f)` (a server hands the previous step's tokens to its clients in `f`) calls `f` once a
    step, after all of the step's work is queued and before its logits are read: steps of one and of two rows,
    launched one by one and replayed as graphs."""
    eng = Engine(tiny_llama, target="cpu", n_ctx=64, logit_rows=4)
    rt = eng.runtime = _OrderedCPU()
    eng.executor = eng._make_executor()
    bd = BatchDecoder(eng, 2)
    a, b = bd.open(), bd.open()
    bd.prefill(a, _tokens(4, 1))
    bd.prefill(b, _tokens(3, 2))
    for runs in ([(a, [5])], [(a, [6]), (b, [7])], [(a, [8]), (b, [9])], [(a, [10]), (b, [11])]):
        rt.events.clear()
        bd.step(runs, launched=lambda: rt.events.append("launched"))
        assert rt.events.count("launched") == 1
        i = rt.events.index("launched")
        assert "queued" in rt.events[:i] and rt.events[i + 1:] == ["read"]
    assert rt.replays >= 1  # the later two-row steps ran as a graph


def test_serve_makes_the_plan_of_its_parallel_rows(tiny_llama):
    """`serve -np N` asks the engine for the plan of the last N rows' logits; `run` makes none. Neither asks for
    the plan of every token's logits."""
    from polystrata.chat_cli import open_engine
    from polystrata.cli import build_parser

    args = ["--target", "reference", "-c", "64"]
    eng = open_engine(build_parser().parse_args(["serve", str(tiny_llama), "-np", "3", *args]))
    assert eng.logit_rows == 3 and eng.graph_rows.outputs[0].type.shape[0] == 3 and not eng.all_logits
    run = open_engine(build_parser().parse_args(["run", str(tiny_llama), *args]))
    assert run.graph_rows is None and not run.all_logits


def test_engine_plans_only_what_its_caller_runs(tiny_llama):
    """An engine plans prompt chunks and one-token steps (and with logit_rows=N the last N rows' logits); the plan
    of every token's logits only with all_logits (score, parity): without it the activation buffers shrink by its
    T x vocab logits, and asking for those logits is a caller's bug, refused in one PolystrataError on every
    target, as is a step of a graph the executor has no plan of. (The kernels: test_targets' llama's.)"""
    lean = Engine(tiny_llama, target="cpu", n_ctx=64)
    full = Engine(tiny_llama, target="cpu", n_ctx=64, all_logits=True)
    assert set(lean.executor.plans) == {id(lean.graph_last), id(lean.graph_step)}
    assert set(full.executor.plans) == {id(full.graph_all), id(full.graph_last), id(full.graph_step)}
    plan = full.executor.plans[id(full.graph_all)]
    logits = plan.buffers[plan.output]
    assert logits.count == full.n_ubatch * full.hparams.n_vocab
    assert lean.memory.scratch_bytes <= full.memory.scratch_bytes - 4 * logits.count // 2
    ids = _tokens(5, 1)
    want = full.score(ids)
    for eng in (lean, Engine(tiny_llama, target="reference", n_ctx=64)):
        with pytest.raises(PolystrataError, match=r"^the logits of every token were asked of an engine made without "
                                                  r"their plan: make it with Engine\(\.\.\., all_logits=True\)$"):
            eng.score(ids)
    lean.reset()
    np.testing.assert_array_equal(lean.forward(ids), want[-1:])  # the last token's logits it makes
    with pytest.raises(PolystrataError, match="^no plan was made for this graph"):
        lean.executor.step(lean.graph_all, np.asarray(ids, np.int32), np.arange(5, dtype=np.int32))


def test_slots_and_their_context(tiny_llama):
    """Each sequence holds n_ctx // N tokens; slots are refused when all are taken or the context is too small."""
    eng = Engine(tiny_llama, target="reference", n_ctx=16, logit_rows=2)
    bd = BatchDecoder(eng, 2)
    a, b = bd.open(), bd.open()
    with pytest.raises(PolystrataError, match="slots are busy"):
        bd.open()
    bd.prefill(a, _tokens(7, 1))
    bd.step([(a, [5])])
    with pytest.raises(PolystrataError, match="context length exceeded"):
        bd.step([(a, [5]), (b, [6])])
    with pytest.raises(PolystrataError, match="context length exceeded: 9 tokens > 8"):
        bd.prefill(b, _tokens(9, 2))
    bd.close(a)
    assert bd.open() == a
    with pytest.raises(PolystrataError, match="cannot hold 9 parallel sequences"):
        BatchDecoder(eng, 9)
    with pytest.raises(PolystrataError, match=r"^3 sequences share the steps of an engine made for the logits of 2 "
                                              r"rows a step: make it with Engine\(\.\.\., logit_rows=3\)$"):
        BatchDecoder(eng, 3)
    eng.n_ubatch = 4  # as -ub 4 gives (the reference executor has no plans of a step size)
    with pytest.raises(ValueError, match="a step of 5 tokens exceeds the step size 4"):
        bd.step([(a, [5, 6]), (b, [7, 8, 9])])
    with pytest.raises(ValueError, match="distinct sequences"):
        bd.step([(a, [5]), (a, [6])])

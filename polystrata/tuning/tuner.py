"""`polystrata tune`: search each kernel instance's knobs on this device, check, time, keep the winners.

For each plan asked for (decode: one-token steps; prefill: prompt chunks), the engine is loaded with its default
schedules and every kernel instance (`codegen.recipes.Site`) that a recipe's knob space names is tuned on the
first match that reads it:

1. The launches before that match run on random tokens (decode: after a prefill of `DECODE_DEPTH` tokens;
   prefill: `PREFILL_TOKENS`, or for a kernel family that serves some of the plan's steps only, `Site.rows`,
   such as split K's 16 rows), so the match's inputs hold what a real step gives it. What its launches read and
   write is saved and put back before each run below.
2. Candidates: first each knob changed alone (`KnobSpace.singles`), then pairs of the changes that were faster
   than the default (`KnobSpace.pairs`; every pair of a space would be over a thousand compiles), each lowered
   by compiling the plan with that instance's override. A candidate that sets a knob the target's policy calls
   inert (`Policy.inert_knobs`), whose launches that run in the timed step do the work of the default's or an
   earlier candidate's there (`work_at`: the target ignores the knob, or it sets kernels gated to other row
   counts, or only where a kernel's row counts end), whose lowering fails, or whose local memory exceeds the
   policy's, is skipped without compiling.
   The others are compiled (in worker processes with `jobs` > 1: the kernel cache receives them, and this
   process loads them from there).
3. Check: the candidate's outputs (every buffer the match writes but scratch) against the default's from the
   same inputs; f32 within `tolerance` relative to the largest |value| (looser where int8 activations are on
   either side), other buffers bit for bit. A wrong candidate is rejected and logged, never kept.
4. Time: the launches of every match that makes the instance (a layer each), one after the other, each on its own
   weights, so that they stream from memory as in a step (one layer's weights alone would sit in a cache and
   reward the wrong schedule: docs/benchmarks.md); a warm-up, then `ROUNDS` rounds of enough repetitions for
   `MIN_ROUND_S` (device marks where the target has them, else the wall clock after a sync); the median and the
   spread ((max - min) / 2 / median); a candidate whose first timed run takes `SLOW` times the default's gets
   that run as its time (its rounds would only spend the budget). Decode kernels that read the
   cache's length (attention) are timed at `DECODE_DEPTH` and deep in the context (`Tuner.deep_depth`), their
   time the sum of both. The best candidate and the default are timed once more at the end; the best is kept
   only if its median beats the default's by more than both spreads and `MIN_GAIN`.

The instances are tuned in order of their share of a step (`Tuner.step_times`: each launch of the plans timed
alone, at each step size the instances are timed at), the largest first, so a short budget goes where the time
is. Each finished instance is a row of the tuning database (the default's row when nothing won: not searched
again), and each candidate measured of an instance not yet finished is kept too (`TuningDB.put_tried`): a Ctrl-C
or a spent budget keeps what was measured, and a second `tune` goes on from there. The budget bounds the search
(the engine's load and its default kernels' compile come first and are not counted); a candidate already started
finishes.
"""

from __future__ import annotations

import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from polystrata.codegen.recipes import KnobSpace
from polystrata.compiler.executor import BoundLaunch
from polystrata.compiler.passes import kept_launches, launch_effects
from polystrata.compiler.plan import BufferSpec, Plan
from polystrata.errors import PolystrataError, UsageError
from polystrata.ir.expr import Const
from polystrata.ir.kernel import DTYPE_BYTES, Kernel, Launch
from polystrata.progress import Progress
from polystrata.runtimes.base import compile_pool, eval_int, stop_pool, submit_compile
from polystrata.tuning import machine_key
from polystrata.tuning.db import TuningDB, knob_key, today

PLANS = ("decode", "prefill")
DECODE_DEPTH = 32  # tokens in the KV cache when decode kernels are timed
RANK_REPS = 3  # runs of each launch when a step's time is shared out among the kernel instances (`step_times`)
# Tokens of the prompt step when prefill kernels are timed, at most the plan's step size and the context: a full
# step, as a long prompt runs them. Some kernels choose by the row count at run time (attention's tiles above
# TILES_ABOVE rows), so a short step would time another kernel than the one the knob changes.
PREFILL_TOKENS = 512
ROUNDS = 5
MIN_ROUND_S = 0.01
MIN_GAIN = 0.03  # a winner must be at least this much faster than the default, beyond the spreads
SLOW = 3.0  # a candidate whose first timed run takes this many times the default's is not timed further
TOLERANCE = 2e-3  # f32 outputs: max |candidate - default| / max |default|
TOLERANCE_INT8 = 3e-2  # the same where either side quantizes activations to int8


def parse_budget(text: str) -> float:
    """Seconds of a budget written as NUMBER[s|m|h] (`10m`, `30s`, `1.5h`; a bare number: seconds)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([smh]?)\s*", text or "")
    if not m or float(m.group(1)) <= 0:
        raise UsageError(f"--budget takes a positive time such as 30s, 10m or 1h, not {text!r}")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


def parse_plans(text: str) -> tuple[str, ...]:
    """The plans of `--plans decode,prefill`."""
    names = tuple(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    bad = [p for p in names if p not in PLANS]
    if not names or bad:
        raise UsageError(f"--plans takes a comma-separated list of {', '.join(PLANS)}, not {text!r}")
    return names


@dataclass
class Timing:
    """Seconds per run of the launches of every match of a kernel instance: median and relative spread of
    `ROUNDS` rounds."""

    median: float
    spread: float


@dataclass
class SiteResult:
    """What tuning one kernel instance found."""

    signature: str
    default: Timing | None = None
    best: dict[str, Any] = field(default_factory=dict)  # the winning knobs ({}: the default)
    best_time: Timing | None = None
    tried: int = 0
    rejected: int = 0
    # (session time at its start, wall time) of each candidate tried, its compile included
    candidate_s: list[tuple[float, float]] = field(default_factory=list)
    complete: bool = False  # every candidate measured (else the budget cut it short: the next run goes on)
    setup_s: float = 0.0  # running the plan up to the instance, saving its buffers, timing the default


def _local_bytes(kernel: Kernel) -> int:
    return sum(a.size * DTYPE_BYTES[a.dtype] for a in kernel.local)


def _is_scratch(name: str) -> bool:
    return name.startswith("scratch.")


def grid_at(la: Launch, step: dict[str, int]) -> tuple[int, ...] | None:
    """A launch's grid extents in a step of these step symbols (None: a grid of something else than the launch's
    scalars)."""
    env = {n: (step[v] if isinstance(v, str) else v) for n, v in la.scalars}
    try:
        return tuple(eval_int(g, env) for g in la.kernel.grid)
    except KeyError:
        return None


def runs_at(la: Launch, step: dict[str, int]) -> bool:
    """Whether a launch has work in a step of these step symbols (a kernel gated to other row counts has a grid
    of zero groups there; one whose grid is not known from its scalars is assumed to run)."""
    grid = grid_at(la, step)
    return grid is None or all(g > 0 for g in grid)


def work_at(la: Launch, step: dict[str, int]) -> Launch:
    """`la` as the work it does in a step of these step symbols: its kernel's name and grid (which a gate, the row
    counts a kernel runs for, sets, `tile_matmul.step_gate`) replaced by the grid's extents there. Two candidates
    whose launches differ only in their gates beyond the timed step (knob mma_split_above, timed at 16 rows) do the
    same work there."""
    grid = grid_at(la, step)
    if grid is None:
        return la
    return replace(la, kernel=replace(la.kernel, name="", grid=tuple(Const(g) for g in grid)))


def work_in(launches: Sequence[Launch], step: dict[str, int]) -> tuple[Launch, ...]:
    """The work the launches that run in a step of these step symbols do there (`runs_at`, `work_at`): what two
    candidates compare equal on when they would time the same."""
    return tuple(work_at(la, step) for la in launches if runs_at(la, step))


def timed_step(plan_name: str, plan: Plan, n_ctx: int, rows: int | None = None) -> tuple[int, int]:
    """(tokens, cached tokens before them) of the step `plan_name`'s kernels are timed at: decode, one token after
    `DECODE_DEPTH`; prefill, `rows` (a kernel family's step, `Site.rows`) or else `PREFILL_TOKENS`, at most the
    plan's step and the context, on an empty cache."""
    if plan_name == "decode":
        return 1, DECODE_DEPTH
    return min(PREFILL_TOKENS if rows is None else rows, plan.t_max, n_ctx), 0


def _uses_int8(launches: list[Launch]) -> bool:
    return any(dict(la.kernel.knobs).get("int8") == 1 or dict(la.kernel.knobs).get("xq") == "kernel"
               for la in launches)


def compare(default: dict[str, np.ndarray], candidate: dict[str, np.ndarray], tolerance: float) -> str | None:
    """Why `candidate`'s outputs differ from `default`'s (None: they agree): f32 buffers within `tolerance` of the
    largest |default value|, NaN where the default has none, other dtypes exactly."""
    for name, want in default.items():
        got = candidate.get(name)
        if got is None:
            return f"does not write {name}"
        if want.dtype == np.float32:
            if np.isnan(got).any() and not np.isnan(want).any():
                return f"NaN in {name}"
            scale = float(np.nanmax(np.abs(want))) if want.size else 0.0
            err = float(np.nanmax(np.abs(got - want))) if want.size else 0.0
            if err > tolerance * max(scale, 1e-6):
                return f"{name} differs by {err:.3g} (largest value {scale:.3g}, tolerance {tolerance:g})"
        elif not np.array_equal(got, want):
            return f"{name} differs"
    return None


class Tuner:
    """One tuning session of a loaded engine (`Engine(..., tuning=False)`: its plans hold the default knobs)."""

    def __init__(self, engine, db: TuningDB, budget_s: float, plans: tuple[str, ...] = PLANS,
                 only: str | None = None, jobs: int = 1, log: Callable[[str], None] | None = None,
                 seed: int = 0):
        if engine.runtime is None:
            raise UsageError("tune needs a kernel target (cpu, cuda, hip, opencl), not the reference executor")
        self.engine, self.db, self.budget_s = engine, db, budget_s
        self.rt = engine.runtime
        self.ex = engine.executor
        if getattr(self.ex, "streamer", None) is not None:
            raise PolystrataError("tune needs every MoE expert resident on the device; give more --gpu-mem")
        self.plan_names = plans
        self.only = re.compile(only) if only else None
        self.jobs = max(1, jobs)
        self.log = log or (lambda msg: print(msg, file=sys.stderr))
        self.rng = np.random.default_rng(seed)
        self.key = machine_key(self.rt)
        self.results: list[SiteResult] = []
        self.started = time.monotonic()
        self.pool: ProcessPoolExecutor | None = None
        self._extra: dict[tuple[str, str, int], Any] = {}  # buffers a candidate needs that the plan lacks

    # --- what to tune -------------------------------------------------------------------------------------

    def _graphs(self) -> list[tuple[str, Any]]:
        eng = self.engine
        return [(name, {"decode": eng.graph_step, "prefill": eng.graph_last}[name]) for name in self.plan_names]

    def jobs_todo(self) -> list[tuple[str, Any, str, KnobSpace, int, int | None]]:
        """(plan name, graph, signature, knob space, match index, rows: `Site.rows`) of every instance still to
        tune: in a knob space with candidates, matching `only`, not in the database for this machine or cut short
        there."""
        done = {r["signature"] for r in self.db.rows(*self.key)} - self.db.unfinished(self.key)
        out, seen = [], set()
        for plan_name, graph in self._graphs():
            plan = self.ex.plans[id(graph)]
            for m, sites in enumerate(plan.group_sites):
                for s in sites:
                    if s.signature in seen or s.signature in done or not s.space.singles():
                        continue
                    if self.only and not self.only.search(s.signature):
                        continue
                    seen.add(s.signature)
                    out.append((plan_name, graph, s.signature, s.space, m, s.rows))
        return out

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def step_times(self) -> dict[tuple[str, int | None], dict[str, float]]:
        """Seconds a step spends in each kernel instance (signature -> the sum over its matches), for each plan
        asked for and each step size its instances are timed at (`Site.rows`: (plan name, rows) -> ...), every
        launch timed alone after a warm-up run of the step: what orders the session, so that a budget too short
        for every instance goes to those that take most of their step."""
        rt, ex = self.rt, self.ex
        out: dict[tuple[str, int | None], dict[str, float]] = {}
        for plan_name, graph in self._graphs():
            plan, bound = ex.plans[id(graph)], ex.bound[id(graph)]
            for rows in dict.fromkeys(s.rows for sites in plan.group_sites for s in sites):
                times = out.setdefault((plan_name, rows), {})
                step = self._step(plan_name, rows)
                for b in bound:
                    b.run(rt, step)
                rt.sync()
                for b, m in zip(bound, plan.groups):
                    t0 = time.perf_counter()
                    for _ in range(RANK_REPS):
                        b.run(rt, step)
                    rt.sync()
                    dt = (time.perf_counter() - t0) / RANK_REPS
                    for site in plan.group_sites[m]:
                        if site.rows == rows:
                            times[site.signature] = times.get(site.signature, 0.0) + dt
        return out

    # --- the session ----------------------------------------------------------------------------------------

    def run(self) -> list[SiteResult]:
        """Tune every instance `jobs_todo` lists until the budget is spent; returns what was found."""
        todo = self.jobs_todo()
        if not todo:
            self.log("tune: nothing to tune (every kernel instance is in the tuning database for this device)")
            return []
        self.started = time.monotonic()
        steps = self.step_times()

        def share(job) -> float:
            """The instance's share of its step (a step of its plan, of its rows)."""
            times = steps.get((job[0], job[5]), {})
            return times.get(job[2], 0.0) / max(sum(times.values()), 1e-12)

        todo.sort(key=lambda job: -share(job))  # the largest share of a step first
        if self.jobs > 1:
            self.pool = compile_pool(self.jobs)
        try:
            with Progress("tuning kernels", len(todo)) as bar:
                for job in todo:
                    plan_name, graph, sig, space, m, rows = job
                    t, _ = timed_step(plan_name, self.ex.plans[id(graph)], self.engine.n_ctx, rows)
                    bar.update(0, note=f"{sig.split(':')[1]}: {share(job):.0%} of a {t}-token {plan_name} step")
                    if self.elapsed() >= self.budget_s:
                        self.log(f"tune: budget of {self.budget_s:.0f} s spent; {len(todo) - len(self.results)} "
                                 "kernel instances left for the next run")
                        break
                    self.results.append(self._tune_site(plan_name, graph, sig, space, m, rows))
                    left = max(0.0, self.budget_s - self.elapsed())
                    bar.update(note=f"{sig.split(':')[1]}; budget left {left:.0f} s")
        finally:
            if self.pool is not None:  # compiles still running are of candidates no longer wanted
                stop_pool(self.pool)
        return self.results

    def deep_depth(self) -> int:
        """The second cache depth decode kernels that read the cache's length are timed at: three quarters of
        the context (at least `DECODE_DEPTH`), where a long conversation's steps run."""
        return max(DECODE_DEPTH, self.engine.n_ctx * 3 // 4)

    def _step(self, plan_name: str, rows: int | None = None) -> dict[str, int]:
        """Inputs of a step of `plan_name` (of `rows` tokens: `timed_step`) written into the executor's buffers;
        returns its step symbols."""
        eng, rt = self.engine, self.rt
        n_vocab = eng.hparams.n_vocab
        eng.reset()
        plan = self.ex.plans[id(dict(self._graphs())[plan_name])]
        t, n_past = timed_step(plan_name, plan, eng.n_ctx, rows)
        if n_past:
            eng.forward(self.rng.integers(0, n_vocab, size=n_past))  # a real KV cache to attend to
        rt.write(self.ex.handles["tokens"], self.rng.integers(0, n_vocab, size=t).astype(np.int32))
        rt.write(self.ex.handles["positions"], np.arange(n_past, n_past + t, dtype=np.int32))
        if "starts" in self.ex.handles:
            rt.write(self.ex.handles["starts"], np.zeros(self.ex.starts_len, np.int32))
            self.ex.starts_zero = True
        return plan.step_symbols(t, n_past)

    @staticmethod
    def lower_candidates(rt, plan: Plan, m: int, first: int, sig: str, cands: list[dict], step: dict[str, int],
                         seen: set, unlowered: dict[str, list[dict]]) -> Iterator[tuple[dict, list[Launch], dict]]:
        """(knobs, launches, buffer specs) of each candidate of `cands` worth measuring for instance `sig` (match
        `m` of `plan`, its first launch at `first`): not one setting a knob the target's policy calls inert, nor
        one the recipe cannot build (its reason kept in `unlowered`), nor one whose launches that run in `step`
        do work in `seen` (`work_at`; added there: a knob the target ignores, one of kernels gated to other row
        counts, or of the row counts' bounds only), nor one whose local memory exceeds the policy's."""
        for knobs in cands:
            if any(k in rt.policy.inert_knobs for k in knobs):
                continue
            try:
                launches, specs = Tuner.candidate_launches(plan, m, first, sig, knobs)
            except Exception as e:  # a knob set the recipe cannot build (an assertion, a shape that does not divide)
                unlowered.setdefault(f"{type(e).__name__}: {e}", []).append(knobs)
                continue
            running = work_in(launches, step)
            if running in seen:
                continue
            seen.add(running)
            if rt.lanes > 1 and any(_local_bytes(la.kernel) > rt.policy.local_bytes for la in launches):
                continue
            yield knobs, launches, specs

    @staticmethod
    def candidate_launches(plan: Plan, m: int, first: int, sig: str, knobs: dict
                           ) -> tuple[list[Launch], dict[str, BufferSpec]]:
        """The launches match `m` of `plan` (its first launch at `first`) makes with `knobs` set for instance
        `sig`, less those the launches before it make redundant (as the compiler drops them), and the specs of
        the buffers they use."""
        base = plan.context
        ctx = replace(base, knobs={**base.knobs, sig: knobs}, scratch_buffers=dict(base.scratch_buffers),
                      expert_streams=[], sites=[])
        match = plan.matches[m]
        made = match.recipe.lower(match.nodes, ctx)
        before = plan.launches[:first]
        launches = [made[i - first] for i in kept_launches([*before, *made]) if i >= first]
        scratch = {n: BufferSpec(n, d, c, "activation") for n, (d, c) in ctx.scratch_buffers.items()}
        return launches, {**plan.buffers, **scratch}

    def _tune_site(self, plan_name: str, graph, sig: str, space: KnobSpace, m: int, rows: int | None) -> SiteResult:
        rt, ex = self.rt, self.ex
        pid = id(graph)
        plan = ex.plans[pid]
        res = SiteResult(sig)
        site_start = time.monotonic()
        idx = [i for i, g in enumerate(plan.groups) if g == m]
        step = self._step(plan_name, rows)
        for b in ex.bound[pid][: idx[0]]:
            b.run(rt, step)
        saved: dict[str, np.ndarray] = {}
        handles = ex.local[pid]
        default_launches = [plan.launches[i] for i in idx]

        def touch(launches: list[Launch], specs) -> dict[str, Any]:
            """Handles of what `launches` use, saving each buffer's contents before anything runs on it."""
            hs = dict(handles)
            for la in launches:
                for _, name in la.buffers:
                    spec = specs[name]
                    if spec.kind == "weight":
                        continue
                    have = plan.buffers.get(name)
                    if have is None or have.dtype != spec.dtype or have.count < spec.count:
                        k = (name, spec.dtype, spec.count)
                        if k not in self._extra:
                            self._extra[k] = rt.alloc((spec.count,), spec.dtype)
                        hs[name] = self._extra[k]
                    elif name not in saved:
                        saved[name] = rt.download(handles[name], (have.count,), have.dtype)
            return hs

        def restore() -> None:
            for name, data in saved.items():
                dtype = plan.buffers[name].dtype
                rt.write(handles[name], data.astype(np.float16) if dtype == "f16" else data)

        def outputs(launches: list[Launch], hs: dict[str, Any], specs) -> dict[str, np.ndarray]:
            out = {}
            for la in launches:
                for name in launch_effects(la)[1]:
                    if not _is_scratch(name):
                        spec = specs[name]
                        out[name] = rt.download(hs[name], (spec.count,), spec.dtype)
            return out

        def bind(launches: list[Launch], hs: dict[str, Any]) -> list[BoundLaunch]:
            compiled = [rt.compile(la.kernel) for la in launches]
            return [BoundLaunch(ck, hs, la) for ck, la in zip(compiled, launches)]

        def run(bound: list[BoundLaunch], at: dict[str, int] = step) -> None:
            for b in bound:
                b.run(rt, at)

        probes: dict[int | None, float] = {}  # the default's one run at each depth, wall clock after a sync

        def timed_at(bound: list[BoundLaunch], deep: int | None, default: bool) -> Timing:
            """Seconds a run of `bound`, with the cache `deep` tokens long (None: as the step left it). A candidate
            whose first timed run is `SLOW` times the default's is not run further: that run is its time."""
            restore()
            at = step
            if deep is not None:  # the kernels read the cache's length from the positions (and the step symbols)
                rt.write(handles["positions"], np.array([deep], np.int32))
                at = plan.step_symbols(1, deep)
            run(bound, at)  # warm-up
            rt.sync()
            t0 = time.perf_counter()
            run(bound, at)
            rt.sync()
            probe = time.perf_counter() - t0
            if default:
                probes[deep] = probe
            elif probe > SLOW * probes.get(deep, float("inf")):
                return Timing(probe, 0.0)
            reps = max(1, min(1000, int(MIN_ROUND_S / max(probe, 1e-7))))
            samples = []
            for _ in range(ROUNDS):
                start, t0 = rt.mark(), time.perf_counter()
                for _ in range(reps):
                    run(bound, at)
                end = rt.mark()
                rt.sync()
                dev = rt.elapsed(start, end)
                samples.append((dev if dev is not None else time.perf_counter() - t0) / reps)
            med = statistics.median(samples)
            return Timing(med, (max(samples) - min(samples)) / 2 / med if med > 0 else 0.0)

        # A decode kernel that reads the cache's length (attention: from the positions) is timed at the cache's
        # depth here and deep in the context, the sum of both its time: a choice that wins on a short cache only
        # (fewer splits of the keys, say) must not be kept for the long ones.
        depths: list[int | None] = [None]
        if plan_name == "decode" and any(b == "positions" for la in default_launches for _, b in la.buffers):
            depths.append(self.deep_depth())

        def timed(bound: list[BoundLaunch], default: bool = False) -> Timing:
            parts = [timed_at(bound, deep, default) for deep in depths]
            return Timing(sum(p.median for p in parts), max(p.spread for p in parts))

        # Every match of the plan that makes this instance (a layer each): the timing runs them all in turn, each
        # on its own weights, so that they stream from memory as in a step rather than sit in a cache.
        firsts = {}
        for i, g in enumerate(plan.groups):
            if any(st.signature == sig for st in plan.group_sites[g]):
                firsts.setdefault(g, i)
        others = [g for g in firsts if g != m]

        def bind_all(first: list[Launch], specs, lower) -> tuple[dict[str, Any], list[BoundLaunch]]:
            """Handles and bound launches of `first` (this match's) and of the other matches' (`lower(g)`)."""
            hs = touch(first, specs)
            bound = bind(first, hs)
            for g in others:
                launches, more = lower(g)
                bound += bind(launches, touch(launches, more))
            return hs, bound

        hs_default, bound_all_default = bind_all(default_launches, plan.buffers, lambda g: (
            [la for la, gg in zip(plan.launches, plan.groups) if gg == g], plan.buffers))
        bound_default = bound_all_default[: len(default_launches)]
        restore()
        run(bound_default)
        want = outputs(default_launches, hs_default, plan.buffers)
        res.default = timed(bound_all_default, default=True)
        int8_default = _uses_int8(default_launches)

        # Lower the candidates first (cheap), drop those that change nothing that runs in the timed step (a knob
        # of the kernels gated to other row counts: the short steps' matvecs in a prefill plan), start their
        # compiles.
        seen = {work_in(default_launches, step)}
        unlowered: dict[str, list[dict]] = {}  # why a candidate does not lower -> the candidates

        def lowered(cands: list[dict]) -> list[tuple[dict, list[Launch], dict, Future | None]]:
            out = []
            for knobs, launches, specs in self.lower_candidates(rt, plan, m, idx[0], sig, cands, step, seen,
                                                                unlowered):
                # Measured before: no compile (unless it wins and is timed again).
                future = None if self.pool is None or knob_key(knobs) in before else \
                    submit_compile(self.pool, rt.name, [la.kernel for la in launches], rt.arch)
                out.append((knobs, launches, specs, future))
            return out

        def measure_one(knobs: dict, launches: list[Launch], specs, future: Future | None) -> Timing | None:
            """One candidate: its compile (awaited where a worker started it), its outputs checked against the
            default's, then its time over every match; None where it is rejected (logged)."""
            try:
                if future is not None:
                    future.result()
                hs, bound_all = bind_all(launches, specs, lambda g: self.candidate_launches(
                    plan, g, firsts[g], sig, knobs))
                restore()
                run(bound_all[: len(launches)])
                got = outputs(launches, hs, specs)
            except PolystrataError as e:
                self.log(f"tune: {sig} {knobs}: rejected, does not compile ({str(e).splitlines()[0]})")
                return None
            tol = TOLERANCE_INT8 if int8_default or _uses_int8(launches) else TOLERANCE
            why = compare(want, got, tol)
            if why is not None:
                self.log(f"tune: {sig} {knobs}: rejected, wrong output: {why}")
                return None
            bound_of[knob_key(knobs)] = bound_all
            return timed(bound_all)

        before = self.db.tried(self.key, sig)  # candidates an earlier session measured (cut short by its budget)
        timings: dict[str, Timing | None] = {}  # knob_key -> the candidate's time (None: rejected)
        bound_of: dict[str, list[BoundLaunch]] = {}
        made: dict[str, tuple[dict, list[Launch], dict]] = {}  # knob_key -> its knobs, launches and buffer specs

        def measure(cands: list[tuple[dict, list[Launch], dict, Future | None]]) -> bool:
            """Measure `cands` (or take an earlier session's measurement) until the budget is spent; whether
            every one was."""
            for knobs, launches, specs, future in cands:
                key = knob_key(knobs)
                made[key] = (knobs, launches, specs)
                if key in before:
                    median, spread = before[key]
                    timings[key] = None if median is None else Timing(median, spread)
                    res.tried += 1
                    res.rejected += median is None
                    continue
                if self.elapsed() >= self.budget_s:
                    return False
                res.tried += 1
                started, at = time.monotonic(), self.elapsed()
                t = measure_one(knobs, launches, specs, future)
                res.candidate_s.append((at, time.monotonic() - started))
                timings[key] = t
                res.rejected += t is None
                self.db.put_tried(self.key, sig, knobs, None if t is None else t.median,
                                  0.0 if t is None else t.spread)
            return True

        # First every knob changed alone; then pairs of the changes that were faster than the default (the
        # largest gains first), not every pair of the space: a GPU's compile takes seconds a candidate.
        singles = lowered(space.singles())
        res.setup_s = time.monotonic() - site_start
        complete = measure(singles)
        if complete:
            faster = [(t, kn) for kn, *_ in singles
                      if (t := timings[knob_key(kn)]) is not None and t.median < res.default.median]
            faster.sort(key=lambda x: x[0].median)
            complete = measure(lowered(space.pairs([kn for _, kn in faster])))
        for why, cands in unlowered.items():  # one line a reason: a knob value the shape refuses skips many sets
            self.log(f"tune: {sig}: {len(cands)} candidate{'s' * (len(cands) > 1)} skipped, not lowering "
                     f"({why}; first {cands[0]})")
        res.complete = complete
        measured = [(t, made[k][0]) for k, t in timings.items() if t is not None]
        if measured:
            t_best, knobs_best = min(measured, key=lambda x: x[0].median)
            key = knob_key(knobs_best)
            if key not in bound_of:  # measured by an earlier session: bound (and compiled) only now
                _, launches, specs = made[key]
                _, bound_of[key] = bind_all(launches, specs, lambda g, kn=knobs_best: self.candidate_launches(
                    plan, g, firsts[g], sig, kn))
            # Once more, default and best back to back: a machine that got busier meanwhile misleads less.
            res.default = min(res.default, timed(bound_all_default, default=True), key=lambda x: x.median)
            again = timed(bound_of[key])  # an earlier session's time is not compared with this one's default
            res.best_time = again if key in before else min(t_best, again, key=lambda x: x.median)
            margin = max(MIN_GAIN, res.default.spread + res.best_time.spread)
            if res.best_time.median < res.default.median * (1 - margin):
                res.best = knobs_best
        if not complete:
            best = f"; the fastest so far {res.best or 'the default'}" if measured else ""
            self.log(f"tune: {sig}: the budget was spent after {res.tried} candidates{best}; the next run goes on "
                     "from there")
        self._record(res)
        return res

    def _record(self, res: SiteResult) -> None:
        """Write an instance's row: the winner, or the default (not searched again) once every candidate was
        tried. An instance cut short by the budget keeps its measured candidates (`TuningDB.put_tried`) and its
        winner so far, if any; the next run goes on with it (`jobs_todo`)."""
        if res.complete:
            self.db.forget_tried(self.key, res.signature)
        if not res.best and not res.complete:
            return
        target, device, compiler = self.key
        won = res.best_time if res.best else res.default
        self.db.put({"signature": res.signature, "target": target, "device": device, "compiler": compiler,
                     "knobs": res.best, "best_s": won.median, "default_s": res.default.median,
                     "spread": max(won.spread, res.default.spread), "date": today()})
        gain = res.default.median / won.median if won.median > 0 else 1.0
        verdict = f"{res.best} x{gain:.2f}" if res.best else "default kept"
        self.log(f"tune: {res.signature}: {verdict} ({res.tried} tried, {res.rejected} rejected, default "
                 f"{res.default.median * 1e6:.1f} us)")


def default_jobs(host: bool) -> int:
    """Compile workers by default: where kernels run on the host CPU (`Runtime.host`), half the usable CPUs, at
    most 4 (the other half times the candidates); on a device, whose kernels time there and whose compiles are
    the bottleneck, all but two, at most 8."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2
    return max(1, min(4, cpus // 2) if host else min(8, cpus - 2))

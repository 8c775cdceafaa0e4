"""Runs compiled plans on a target runtime: weights uploaded once, buffers allocated once, arguments bound once.

Per step the host only writes the token ids and positions, resolves the step symbols (T, n_past, n_kv, T_last:
`Plan.step_symbols`) in the few scalar arguments and grids that use them, and launches.

Plans made for expert streaming (`ExpertStream`s) run in segments: at each streamed MoE layer the host waits for
the router, reads the routed expert ids, has the memory manager (`runtimes/memory.ExpertStreamer`) make them
resident, and continues; when a step routes to more experts than the cache holds, the layer's expert launches
run once per group of experts that fits. Each segment between two such stops is captured as a device graph as a
whole step is (`_launch`): the expert kernels read their weights through the slot table, so a segment's graph stays
valid whatever the cache holds. One-token steps of plans with resolve kernels need no stop where the runtime lets
the device read host memory in place (`Runtime.device_view`) and the cache holds a token's experts: the device
keeps the cache itself (`moe.resolve_kernel`, `moe.fill_kernel`), and the step is one graph as a resident step is;
the cache's state moves between host and device when the kind of step changes (`ExpertStreamer.to_device`,
`to_host`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from polystrata.compiler.plan import Plan
from polystrata.errors import PolystrataError
from polystrata.gguf import GGUFFile
from polystrata.ir.graph import Graph
from polystrata.ir.kernel import Buf
from polystrata.ir.layout import repack
from polystrata.progress import Progress
from polystrata.runtimes.base import CompiledKernel, Runtime, eval_int
from polystrata.runtimes.memory import ExpertStreamer, VRAMGuard, expert_source, guard_step, shared_scratch
from polystrata.runtimes.reference import OneSequence

# Steps of at most this many tokens are replayed as device graphs (see `PlanExecutor`): decode steps of up to as
# many sequences at once; longer prompt chunks, whose lengths rarely repeat, run launch by launch.
GRAPH_ROWS = 64


class BoundLaunch:
    """A launch with buffer handles resolved; only symbol-valued scalars and grids vary per step.

    The launch as the runtime packs it (`prepare`) is kept per step shape, so a repeated launch costs the runtime
    nothing but the launch itself (`launch_prepared`).
    """

    def __init__(self, ck: CompiledKernel, handles: Mapping[str, Any], launch) -> None:
        self.ck = ck
        k = launch.kernel
        bufs = dict(launch.buffers)
        self.scalars = dict(launch.scalars)
        self.names = {p.name: bufs[p.name] for p in k.params if isinstance(p, Buf)}  # param -> plan buffer
        self.handles = {p: handles[b] for p, b in self.names.items()}
        self.symbols = sorted({v for v in self.scalars.values() if isinstance(v, str)})
        self.packed: dict[tuple, Any] = {}

    def rebind(self, handles: Mapping[str, Any]) -> None:
        """Point the launch at new handles of some plan buffers (a resized expert cache)."""
        changed = {p: handles[b] for p, b in self.names.items() if b in handles}
        if changed:
            self.handles.update(changed)
            self.packed.clear()

    def run(self, rt: Runtime, step: dict[str, int]) -> None:
        key = tuple(step[s] for s in self.symbols)
        packed = self.packed.get(key)
        if packed is None:
            env = {n: (step[v] if isinstance(v, str) else v) for n, v in self.scalars.items()}
            k = self.ck.kernel
            args = rt.args_for(k, self.handles, env)
            grid = [eval_int(g, env) for g in k.grid]
            packed = rt.prepare(self.ck, args, grid)
            if len(self.packed) < 64:  # prefill chunk lengths vary; keep a bounded set
                self.packed[key] = packed
        rt.launch_prepared(packed)


class PlanExecutor(OneSequence):
    """Executes plans of one model on one runtime, sharing weights, the KV cache and one set of activation buffers
    (`runtimes.memory.shared_scratch`: one plan runs at a time) between them.

    Same interface as the reference executor: `forward(graph, tokens)` (at most the plan's t_max tokens), `step`,
    `n_past`, `reset()`.
    """

    def __init__(self, runtime: Runtime, file: GGUFFile, plans: dict[int, Plan], n_ctx: int,
                 experts: dict[str, Any] | None = None):
        """`experts` (plans made for streaming): the expert cache's settings, `ExpertStreamer`'s keyword arguments
        `slots`, `policy`, `routers` (gate weight -> router weight name, for predictive policies) and `log`, and
        `guard`: a `VRAMGuard` (None: no guard)."""
        self.rt = runtime
        self.n_ctx = n_ctx
        self.n_past = 0
        # With `time_device` set, each step's device time is measured (where the runtime's `mark` gives events):
        # `last_device_s`. Benchmarks take the host's share of a token as its wall time less this.
        self.time_device = False
        self.last_device_s: float | None = None
        self.plans = plans  # id(graph) -> plan
        self.handles: dict[str, Any] = {}
        self.streamer = self._streamer(file, experts) if experts else None
        self.guard: VRAMGuard | None = experts.get("guard") if experts else None
        self.log = (experts or {}).get("log") or (lambda _msg: None)
        if self.streamer is not None:
            self.handles.update(self.streamer.handles())
        weights = {name for plan in plans.values() for name, spec in plan.buffers.items()
                   if spec.kind == "weight" and name not in self.handles}
        loading = Progress("loading weights", len(weights))  # closed below; an error ends the command
        pool, use = shared_scratch(plans)  # the plans' activations: one set for all of them
        scratch = [runtime.alloc((count,), dtype) for dtype, count in pool]
        for pid, plan in plans.items():
            for name, spec in plan.buffers.items():
                if spec.kind in ("weight", "kv", "state", "input", "slots", "host") and name in self.handles:
                    continue
                if spec.kind == "host":  # experts the device cannot read in place: their launches never run
                    self.handles[name] = runtime.alloc((1,), spec.dtype)
                    continue
                if spec.kind == "weight":
                    if spec.dtype == "f32":
                        data = file.dequantize(name)
                    else:  # in the layout the plan's kernels read
                        data = repack(np.asarray(file.raw(name)), file.tensors[name].fmt, spec.fmt)
                    self.handles[name] = runtime.upload(data)
                    loading.update()
                elif spec.kind == "activation":
                    self.handles[(id(plan), name)] = scratch[use[(pid, name)]]
                else:
                    self.handles[name] = runtime.alloc((spec.count,), spec.dtype)
        loading.close()
        # Recurrent states (name -> f32 count): zero at the start of every sequence.
        self.states = {name: spec.count for plan in plans.values() for name, spec in plan.buffers.items()
                       if spec.kind == "state"}
        self.reset()
        # Per plan: its buffer names -> handles.
        self.local = {pid: {name: self.handles[(id(plan), name)] if spec.kind == "activation" else self.handles[name]
                            for name, spec in plan.buffers.items()} for pid, plan in plans.items()}
        compiled = runtime.compile_all(la.kernel for plan in plans.values() for la in plan.launches)
        self.bound: dict[int, list[BoundLaunch]] = {
            pid: [BoundLaunch(compiled[la.kernel.fingerprint()], self.local[pid], la) for la in plan.launches]
            for pid, plan in plans.items()}
        # Streaming plans: which run device-resolved where they can (`device_resolved`), and for host-resolved
        # steps their launches without the resolve kernels (`host_bound`) and in them the (first launch, end,
        # stream, layer) of each streamed MoE layer's expert launches (`sections`).
        self.device_resolved: set[int] = set()
        self.host_bound: dict[int, list[BoundLaunch]] = {}
        self.sections: dict[int, list[tuple[int, int, Any, int]]] = {}
        for pid, plan in plans.items():
            if self.streamer is None:
                break
            resolve = {name for st in plan.expert_streams for name in st.resolve}
            if plan.expert_streams and all(st.resolve for st in plan.expert_streams):
                self.device_resolved.add(pid)
            keep = [i for i, la in enumerate(plan.launches) if la.kernel.name not in resolve]
            self.host_bound[pid] = [self.bound[pid][i] for i in keep]
            launches = [plan.launches[i] for i in keep]
            secs = []
            for st in plan.expert_streams:
                idx = [i for i, la in enumerate(launches) if {b for _, b in la.buffers} & set(st.weights)]
                secs.append((min(idx), max(idx) + 1, st, self.streamer.layer_of(st)))
            self.sections[pid] = secs
        # Steps of at most GRAPH_ROWS tokens (decode steps, of one sequence or a batch of them) are captured into a
        # device graph on their second run with a plan and row count, and replayed from then on, where the runtime
        # can: every kernel reads the positions and sequence starts from device memory and its launch depends on
        # the row count alone (T, and T_last, which the plan and T give), so the graph is the same for every such
        # step. A streamed step's segments likewise.
        self.use_graphs = runtime.graphs and not os.environ.get("POLYSTRATA_NO_GRAPHS")
        # (id(graph), rows), or (id(graph), rows, segment) for a streamed step's segment -> its captured graph
        self.graphs: dict[tuple[int, ...], Any] = {}
        self.runs: dict[tuple[int, ...], int] = {}  # the same keys -> runs before capture
        # The "starts" buffer (sequence starts in the KV cache, for batched decoding) holds zeros until a step
        # with other starts writes it; its length is that of the plan that allocated it (the first).
        self.starts_zero = False
        self.starts_len = next((p.buffers["starts"].count for p in plans.values() if "starts" in p.buffers), 0)

    def _streamer(self, file: GGUFFile, experts: dict[str, Any]) -> ExpertStreamer | None:
        streams, specs = {}, {}
        for plan in self.plans.values():
            for st in plan.expert_streams:
                if st.weights not in streams or st.host:  # a one-token plan's names the experts' host buffers
                    streams[st.weights] = st
                specs.update({w: plan.buffers[w] for w in st.weights})
        if not streams:
            return None

        routers = {gate: np.asarray(file.dequantize(r), np.float32)
                   for gate, r in (experts.get("routers") or {}).items() if r is not None}
        return ExpertStreamer(self.rt, lambda name: expert_source(file, specs[name]), list(streams.values()),
                              experts["slots"], experts.get("policy", "lru"), routers, experts.get("log"))

    def reset(self) -> None:
        """Start a new sequence: KV rows past n_past are never read, so only the recurrent states are cleared."""
        self.n_past = 0
        for name, count in self.states.items():
            self.rt.write(self.handles[name], np.zeros(count, np.float32))

    def save_state(self) -> dict[str, np.ndarray]:
        """A host copy of the recurrent states (for `Engine.checkpoint`)."""
        return {name: self.rt.download(self.handles[name], (count,), "f32") for name, count in self.states.items()}

    def load_state(self, saved: dict[str, np.ndarray]) -> None:
        """Put back states `save_state` returned."""
        for name, data in saved.items():
            self.rt.write(self.handles[name], data)

    def step(self, graph: Graph, tokens: np.ndarray, positions: np.ndarray,
             starts: np.ndarray | None = None, rows: Sequence[int] | None = None,
             launched: Callable[[], None] | None = None) -> np.ndarray:
        """One step over rows of (token, position in its sequence, cache row where its sequence begins: `starts`,
        None for all 0), whatever sequences they belong to (`polystrata/batch.py`); returns the logits, or with
        `rows` only those rows of them (the rest never leave the device). `n_past` is left as it is. `launched` is
        called once the step's work is queued, before its logits are waited for: a caller's host work (a server
        handing the previous step's tokens to its clients) then overlaps the device's."""
        plan = self.plans.get(id(graph))
        if plan is None:  # a caller's bug: the engine plans only the graphs its caller asked for
            raise PolystrataError("no plan was made for this graph: make the engine with the plans its caller runs "
                                  "(Engine's all_logits, logit_rows)")
        t = len(tokens)
        if t > plan.t_max:
            raise ValueError(f"step of {t} tokens exceeds the plan's {plan.t_max}")
        rt = self.rt
        rt.write(self.handles["tokens"], np.asarray(tokens, dtype=np.int32))
        rt.write(self.handles["positions"], np.asarray(positions, dtype=np.int32))
        if "starts" in self.handles:
            self._write_starts(starts)
        step = plan.step_symbols(t, int(positions[0]))
        pid = id(graph)
        timed = self.time_device
        start = rt.mark() if timed else None
        if pid in self.device_resolved and self.streamer.resolves_on_device(t):
            self.streamer.to_device()  # the whole step in one go: its kernels make the experts resident
            self.streamer.device_tokens += t
            self._launch((pid, t), self.bound[pid], step)
        elif self.sections.get(pid):
            self.streamer.to_host()
            self._run_streamed(pid, step)
        else:
            self._launch((pid, t), self.bound[pid], step)
        end = rt.mark() if timed else None
        if launched is not None:
            launched()
        logits, width = self.handles[(id(plan), plan.output)], int(plan.output_shape[1])
        if rows is None:
            out = rt.download(logits, (step["T_last"], width), "f32")  # T rows, or min(T, n) after last_rows
        else:
            out = rt.download_rows(logits, width, rows, "f32")
        self.last_device_s = rt.elapsed(start, end) if timed else None
        if self.streamer is not None:
            self.streamer.tokens += t
            self.streamer.settle()
            if self.guard is not None:
                self._watch_memory()
        return out

    def _launch(self, key: tuple[int, ...], launches: list[BoundLaunch], step: dict[str, int]) -> None:
        """Run `launches` (a step, or a segment of a streamed one: `key` names it with the step's row count second):
        replayed from the device graph captured on their second run, where the runtime has graphs and the step is
        at most GRAPH_ROWS rows; else launch by launch."""
        if not launches:
            return
        rt = self.rt
        graph = self.graphs.get(key)
        if graph is None and step["T"] <= GRAPH_ROWS and self.use_graphs and self.runs.get(key, 0) >= 1:
            # Captured launches do not run: capture, then replay to compute this step.
            rt.begin_capture()
            for b in launches:
                b.run(rt, step)
            graph = self.graphs[key] = rt.end_capture()
        if graph is not None:
            rt.replay(graph)
            return
        for b in launches:
            b.run(rt, step)
        if step["T"] <= GRAPH_ROWS:
            self.runs[key] = self.runs.get(key, 0) + 1

    def _write_starts(self, starts: np.ndarray | None) -> None:
        """The step's sequence starts into their buffer; zeros (the buffer's whole length) only when it holds
        others, so single-sequence steps, captured graphs included, do not pay for a write each."""
        if starts is not None and np.any(starts):
            self.rt.write(self.handles["starts"], np.asarray(starts, dtype=np.int32))
            self.starts_zero = False
        elif not self.starts_zero:
            self.rt.write(self.handles["starts"], np.zeros(self.starts_len, np.int32))
            self.starts_zero = True

    def _run_streamed(self, pid: int, step: dict[str, int]) -> None:
        """One step of a streaming plan: launches up to each streamed layer's experts, the routed experts made
        resident (in groups of at most the cache's slots), the expert launches once per group, and on."""
        rt, bound, local, streamer = self.rt, self.host_bound[pid], self.local[pid], self.streamer
        i = 0
        for n, (start, end, st, li) in enumerate(self.sections[pid]):
            self._launch((pid, step["T"], 2 * n), bound[i:start], step)
            n_tok = step[st.tokens]
            ids = rt.download(local[st.route], (n_tok * st.k,), "i32")  # waits for the router
            cache = streamer.layers[li].cache
            groups = cache.passes(ids)
            guess = None
            width = streamer.predicts_after(li)
            if n_tok == 1 and width:  # the layer's MoE input, for the next layer's router
                guess = rt.download(local[st.x], (1, width), "f32")
            for g, experts in enumerate(groups):
                if g:
                    rt.sync()  # the previous group's kernels read slots this group may take
                streamer.load(li, experts)
                if len(groups) > 1:  # list only this group's experts (the lists of their entries stand)
                    active = np.asarray([len(experts), *experts], np.int32)
                    rt.write_region(local[st.lists], 4 * st.n_expert * (1 + st.cap), active)
                self._launch((pid, step["T"], 2 * n + 1), bound[start:end], step)
            if guess is not None:  # uploads for the next layer, beside this layer's expert kernels
                streamer.predict(li, guess)
            i = end
        self._launch((pid, step["T"], 2 * len(self.sections[pid])), bound[i:], step)

    def _watch_memory(self) -> None:
        """The VRAM guard: a free-memory reading after a sync; the expert cache shrinks or grows on its word."""
        self.rt.sync()
        info = self.rt.memory_info()
        if info is None:
            return
        slots = guard_step(self.streamer, self.guard, info[0], self.log)
        if slots is not None:
            self.graphs.clear()  # they hold the old slot buffers
            handles = self.streamer.resize(slots)
            self.handles.update(handles)
            for pid, bound in self.bound.items():
                self.local[pid].update({n: h for n, h in handles.items() if n in self.local[pid]})
                for b in bound:
                    b.rebind(handles)

"""Runs compiled plans on a target runtime: weights uploaded once, buffers allocated once, arguments bound once.

Per step the host only writes the token ids and positions, resolves the step symbols (T, n_past, n_kv) in the
few scalar arguments and grids that use them, and launches.

Plans made for expert streaming (`ExpertStream`s) run in segments: at each streamed MoE layer the host waits for
the router, reads the routed expert ids, has the memory manager (`runtimes/memory.ExpertStreamer`) make them
resident, and continues; when a step routes to more experts than the cache holds, the layer's expert launches
run once per group of experts that fits. Such steps are launched directly, not through captured device graphs;
capturing each segment is the open lever (docs/benchmarks.md: launches and stops, not uploads, are most of a
streamed step's time).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from polystrata.compiler.plan import Plan
from polystrata.gguf import GGUFFile
from polystrata.ir.graph import Graph
from polystrata.ir.kernel import STEP_SYMBOLS, Buf
from polystrata.ir.quant import repack
from polystrata.progress import Progress
from polystrata.runtimes.base import CompiledKernel, Runtime, eval_int
from polystrata.runtimes.memory import ExpertStreamer, VRAMGuard, guard_step


class _BoundLaunch:
    """A launch with buffer handles resolved; only symbol-valued scalars and grids vary per step.

    On runtimes that can pre-pack a launch (`prepare` / `launch_prepared`), the packed form is kept per step
    shape, so a repeated launch costs the runtime nothing but the launch itself.
    """

    def __init__(self, rt: Runtime, ck: CompiledKernel, handles: Mapping[str, Any], launch) -> None:
        self.ck = ck
        k = launch.kernel
        bufs = dict(launch.buffers)
        self.scalars = dict(launch.scalars)
        self.names = {p.name: bufs[p.name] for p in k.params if isinstance(p, Buf)}  # param -> plan buffer
        self.handles = {p: handles[b] for p, b in self.names.items()}
        self.symbols = sorted({v for v in self.scalars.values() if isinstance(v, str)})
        self.packed: dict[tuple, Any] = {}
        self.can_prepare = hasattr(rt, "prepare")

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
            packed = rt.prepare(self.ck, args, grid) if self.can_prepare else (args, grid)
            if len(self.packed) < 64:  # prefill chunk lengths vary; keep a bounded set
                self.packed[key] = packed
        if self.can_prepare:
            rt.launch_prepared(packed)
        else:
            rt.launch(self.ck, *packed)


class PlanExecutor:
    """Executes plans of one model on one runtime, sharing weights and the KV cache between them.

    Same interface as the reference executor: `forward(graph, tokens)`, `n_past`, `reset()`.
    """

    def __init__(self, runtime: Runtime, file: GGUFFile, plans: dict[int, Plan], n_ctx: int,
                 experts: dict[str, Any] | None = None):
        """`experts` (plans made for streaming): the expert cache's settings, `ExpertStreamer`'s keyword arguments
        `slots`, `policy`, `routers` (gate weight -> router weight name, for predictive policies) and `log`, and
        `guard`: a `VRAMGuard` (None: no guard)."""
        self.rt = runtime
        self.n_ctx = n_ctx
        self.n_past = 0
        # With `time_device` set, each step's device time is measured (where the runtime has `mark` events):
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
        for plan in plans.values():
            for name, spec in plan.buffers.items():
                if spec.kind in ("weight", "kv", "input", "slots") and name in self.handles:
                    continue
                if spec.kind == "weight":
                    if spec.dtype == "f32":
                        data = file.dequantize(name)
                    else:  # in the layout the plan's kernels read
                        data = repack(np.asarray(file.raw(name)), file.tensors[name].fmt, spec.fmt)
                    self.handles[name] = runtime.upload(data)
                    loading.update()
                elif spec.kind == "activation":
                    self.handles[(id(plan), name)] = runtime.alloc((spec.count,), spec.dtype)
                else:
                    self.handles[name] = runtime.alloc((spec.count,), spec.dtype)
        loading.close()
        # Per plan: its buffer names -> handles.
        self.local = {pid: {name: self.handles[(id(plan), name)] if spec.kind == "activation" else self.handles[name]
                            for name, spec in plan.buffers.items()} for pid, plan in plans.items()}
        compiled = runtime.compile_all(la.kernel for plan in plans.values() for la in plan.launches)
        self.bound: dict[int, list[_BoundLaunch]] = {
            pid: [_BoundLaunch(runtime, compiled[la.kernel.fingerprint()], self.local[pid], la) for la in plan.launches]
            for pid, plan in plans.items()}
        # Per plan: (first launch, end, stream, layer) of each streamed MoE layer's expert launches.
        self.sections: dict[int, list[tuple[int, int, Any, int]]] = {}
        for pid, plan in plans.items():
            if self.streamer is None:
                break
            secs = []
            for st in plan.expert_streams:
                idx = [i for i, la in enumerate(plan.launches) if {b for _, b in la.buffers} & set(st.weights)]
                secs.append((min(idx), max(idx) + 1, st, self.streamer.layer_of(st)))
            self.sections[pid] = secs
        # Decode steps (one token) are captured once into a device graph and replayed, where the runtime can:
        # every kernel reads the positions from device memory, so the graph is the same for every token.
        self.use_graphs = (hasattr(runtime, "begin_capture") and not os.environ.get("POLYSTRATA_NO_GRAPHS")
                           and self.streamer is None)
        self.graphs: dict[int, Any] = {}
        self.decode_runs: dict[int, int] = {}

    def _streamer(self, file: GGUFFile, experts: dict[str, Any]) -> ExpertStreamer | None:
        streams, specs = {}, {}
        for plan in self.plans.values():
            for st in plan.expert_streams:
                streams.setdefault(st.weights, st)
                specs.update({w: plan.buffers[w] for w in st.weights})
        if not streams:
            return None

        def host_bytes(name: str) -> np.ndarray:
            spec = specs[name]
            if spec.dtype == "f32":
                return np.ascontiguousarray(file.dequantize(name), np.float32).view(np.uint8)
            return repack(np.asarray(file.raw(name)), file.tensors[name].fmt, spec.fmt)

        routers = {gate: np.asarray(file.dequantize(r), np.float32)
                   for gate, r in (experts.get("routers") or {}).items() if r is not None}
        return ExpertStreamer(self.rt, host_bytes, list(streams.values()), experts["slots"],
                              experts.get("policy", "lru"), routers, experts.get("log"),
                              {name: spec.dtype for name, spec in specs.items()})

    def reset(self) -> None:
        """Start a new sequence; KV rows past n_past are never read, so nothing is cleared."""
        self.n_past = 0

    def forward(self, graph: Graph, tokens: np.ndarray) -> np.ndarray:
        """One step over `tokens` (at most the plan's t_max) continuing the KV cache; returns the logits."""
        plan = self.plans[id(graph)]
        t = len(tokens)
        if t > plan.t_max:
            raise ValueError(f"step of {t} tokens exceeds the plan's {plan.t_max}")
        if self.n_past + t > self.n_ctx:
            raise ValueError(f"context full: {self.n_past} + {t} tokens > n_ctx {self.n_ctx}")
        rt = self.rt
        rt.write(self.handles["tokens"], np.asarray(tokens, dtype=np.int32))
        rt.write(self.handles["positions"], np.arange(self.n_past, self.n_past + t, dtype=np.int32))
        step = dict(zip(STEP_SYMBOLS, (t, self.n_past, self.n_past + t)))
        pid = id(graph)
        timed = self.time_device and hasattr(rt, "mark")
        start = rt.mark() if timed else None
        if self.sections.get(pid):
            self._run_streamed(pid, step)
        elif t == 1 and self.use_graphs and pid in self.graphs:
            rt.replay(self.graphs[pid])
        elif t == 1 and self.use_graphs and self.decode_runs.get(pid, 0) >= 1:
            # Captured launches do not run: capture, then replay to compute this step.
            rt.begin_capture()
            for b in self.bound[pid]:
                b.run(rt, step)
            self.graphs[pid] = rt.end_capture()
            rt.replay(self.graphs[pid])
        else:
            for b in self.bound[pid]:
                b.run(rt, step)
            if t == 1:
                self.decode_runs[pid] = self.decode_runs.get(pid, 0) + 1
        end = rt.mark() if timed else None
        rows = t if plan.output_shape[0] == "T" else int(plan.output_shape[0])
        out = rt.download(self.handles[(id(plan), plan.output)], (rows, int(plan.output_shape[1])), "f32")
        self.last_device_s = rt.elapsed(start, end) if timed else None
        self.n_past += t
        if self.streamer is not None:
            self.streamer.tokens += t
            if self.guard is not None:
                self._watch_memory()
        return out

    def _run_streamed(self, pid: int, step: dict[str, int]) -> None:
        """One step of a streaming plan: launches up to each streamed layer's experts, the routed experts made
        resident (in groups of at most the cache's slots), the expert launches once per group, and on."""
        rt, bound, local, streamer = self.rt, self.bound[pid], self.local[pid], self.streamer
        i = 0
        for start, end, st, li in self.sections[pid]:
            for b in bound[i:start]:
                b.run(rt, step)
            n_tok = step["T"] if st.tokens == "T" else int(st.tokens)
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
                for b in bound[start:end]:
                    b.run(rt, step)
            if guess is not None:  # uploads for the next layer, beside this layer's expert kernels
                streamer.predict(li, guess)
            i = end
        for b in bound[i:]:
            b.run(rt, step)

    def _watch_memory(self) -> None:
        """The VRAM guard: a free-memory reading after a sync; the expert cache shrinks or grows on its word."""
        self.rt.sync()
        info = self.rt.memory_info()
        if info is None:
            return
        slots = guard_step(self.streamer, self.guard, info[0], self.log)
        if slots is not None:
            handles = self.streamer.resize(slots)
            self.handles.update(handles)
            for pid, bound in self.bound.items():
                self.local[pid].update({n: h for n, h in handles.items() if n in self.local[pid]})
                for b in bound:
                    b.rebind(handles)

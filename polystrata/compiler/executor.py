"""Runs compiled plans on a target runtime: weights uploaded once, buffers allocated once, arguments bound once.

Per step the host only writes the token ids and positions, resolves the step symbols (T, n_past, n_kv) in the
few scalar arguments and grids that use them, and launches.
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
from polystrata.runtimes.base import CompiledKernel, Runtime, eval_int


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
        self.handles = {p.name: handles[bufs[p.name]] for p in k.params if isinstance(p, Buf)}
        self.symbols = sorted({v for v in self.scalars.values() if isinstance(v, str)})
        self.packed: dict[tuple, Any] = {}
        self.can_prepare = hasattr(rt, "prepare")

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

    def __init__(self, runtime: Runtime, file: GGUFFile, plans: dict[int, Plan], n_ctx: int):
        self.rt = runtime
        self.n_ctx = n_ctx
        self.n_past = 0
        # With `time_device` set, each step's device time is measured (where the runtime has `mark` events):
        # `last_device_s`. Benchmarks take the host's share of a token as its wall time less this.
        self.time_device = False
        self.last_device_s: float | None = None
        self.plans = plans  # id(graph) -> plan
        self.handles: dict[str, Any] = {}
        for plan in plans.values():
            for name, spec in plan.buffers.items():
                if spec.kind in ("weight", "kv", "input") and name in self.handles:
                    continue
                if spec.kind == "weight":
                    if spec.dtype == "f32":
                        data = file.dequantize(name)
                    else:  # in the layout the plan's kernels read
                        data = repack(np.asarray(file.raw(name)), file.tensors[name].fmt, spec.fmt)
                    self.handles[name] = runtime.upload(data)
                elif spec.kind == "activation":
                    self.handles[(id(plan), name)] = runtime.alloc((spec.count,), spec.dtype)
                else:
                    self.handles[name] = runtime.alloc((spec.count,), spec.dtype)
        self.bound: dict[int, list[_BoundLaunch]] = {}
        for pid, plan in plans.items():
            local = {
                name: self.handles[(id(plan), name)] if spec.kind == "activation" else self.handles[name]
                for name, spec in plan.buffers.items()
            }
            self.bound[pid] = [_BoundLaunch(runtime, runtime.compile(la.kernel), local, la) for la in plan.launches]
        # Decode steps (one token) are captured once into a device graph and replayed, where the runtime can:
        # every kernel reads the positions from device memory, so the graph is the same for every token.
        self.use_graphs = hasattr(runtime, "begin_capture") and not os.environ.get("POLYSTRATA_NO_GRAPHS")
        self.graphs: dict[int, Any] = {}
        self.decode_runs: dict[int, int] = {}

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
        if t == 1 and self.use_graphs and pid in self.graphs:
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
        return out

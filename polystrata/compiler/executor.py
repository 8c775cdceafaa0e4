"""Runs compiled plans on a target runtime: weights uploaded once, buffers allocated once, arguments bound once.

Per step the host only writes the token ids and positions, resolves the step symbols (T, n_past, n_kv) in the
few scalar arguments and grids that use them, and launches.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from polystrata.compiler.plan import Plan
from polystrata.gguf import GGUFFile
from polystrata.ir.graph import Graph
from polystrata.ir.kernel import STEP_SYMBOLS, Buf
from polystrata.runtimes.base import CompiledKernel, Runtime, eval_int


class _BoundLaunch:
    """A launch with buffer handles resolved; only symbol-valued scalars and grids vary per step."""

    def __init__(self, rt: Runtime, ck: CompiledKernel, handles: Mapping[str, Any], launch) -> None:
        self.ck = ck
        k = launch.kernel
        bufs = dict(launch.buffers)
        self.scalars = dict(launch.scalars)
        self.static = all(not isinstance(v, str) for v in self.scalars.values())
        self.handles = {p.name: handles[bufs[p.name]] for p in k.params if isinstance(p, Buf)}
        self.args = rt.args_for(k, self.handles, self.scalars) if self.static else None
        self.grid_static = None
        if self.static:
            self.grid_static = [eval_int(g, self.scalars) for g in k.grid]

    def run(self, rt: Runtime, step: dict[str, int]) -> None:
        if self.static:
            rt.launch(self.ck, self.args, self.grid_static)
            return
        env = {n: (step[v] if isinstance(v, str) else v) for n, v in self.scalars.items()}
        k = self.ck.kernel
        rt.launch(self.ck, rt.args_for(k, self.handles, env), [eval_int(g, env) for g in k.grid])


class PlanExecutor:
    """Executes plans of one model on one runtime, sharing weights and the KV cache between them.

    Same interface as the reference executor: `forward(graph, tokens)`, `n_past`, `reset()`.
    """

    def __init__(self, runtime: Runtime, file: GGUFFile, plans: dict[int, Plan], n_ctx: int):
        self.rt = runtime
        self.n_ctx = n_ctx
        self.n_past = 0
        self.plans = plans  # id(graph) -> plan
        self.handles: dict[str, Any] = {}
        for plan in plans.values():
            for name, spec in plan.buffers.items():
                if spec.kind in ("weight", "kv", "input") and name in self.handles:
                    continue
                if spec.kind == "weight":
                    data = file.dequantize(name) if spec.dtype == "f32" else np.asarray(file.raw(name))
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
        for b in self.bound[id(graph)]:
            b.run(rt, step)
        rows = t if plan.output_shape[0] == "T" else int(plan.output_shape[0])
        out = rt.download(self.handles[(id(plan), plan.output)], (rows, int(plan.output_shape[1])), "f32")
        self.n_past += t
        return out

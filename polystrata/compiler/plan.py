"""The compiled plan of one graph: buffers, launches, and what `compile` records about them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from polystrata.codegen.recipes import ExpertStream, Site
from polystrata.ir.formats import QuantFormat
from polystrata.ir.kernel import STEP_SYMBOLS, Launch, dump


@dataclass(frozen=True)
class BufferSpec:
    """A plan buffer: `count` elements of IR dtype `dtype` (sized for the largest step, `t_max` tokens); a quantized
    weight's `fmt` is the layout its kernels read (`ir.layout.repack` turns the file's into it)."""

    name: str
    dtype: str
    count: int
    # "activation", "input", "weight", "kv", "state" (a recurrent op's per-sequence state, `recipes.deltanet`),
    # "slots" (an expert cache's state of a streaming plan, its slot table first: `recipes.ExpertState`), "host" (a
    # streamed expert weight in host memory, which a one-token plan's fill kernel reads in place)
    kind: str
    fmt: QuantFormat | None = None


@dataclass
class Plan:
    """Launches in execution order over named buffers; `output` is the buffer holding the logits."""

    launches: list[Launch]
    buffers: dict[str, BufferSpec]
    output: str
    output_shape: tuple[Any, ...]  # ("T" or n, vocab)
    t_max: int
    last_rows: int | None = None  # the graph's `last_rows` n (`Graph.last_rows`)
    aliases: dict[str, str] = field(default_factory=dict)  # graph value buffer -> buffer it shares (reshapes)
    recipes: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)  # (recipe, node names) per match
    expert_streams: list[ExpertStream] = field(default_factory=list)  # streamed MoE layers, in launch order
    groups: list[int] = field(default_factory=list)  # per launch: the match (index into `recipes`) that made it
    group_sites: list[tuple[Site, ...]] = field(default_factory=list)  # per match: kernel instances it read
    # What lowered it, for lowering one match again with other knobs (the tuner): the recipe matches (`passes.Match`,
    # in `recipes` order) and the recipe context.
    matches: list[Any] = field(default_factory=list)
    context: Any = None

    def step_symbols(self, t: int, n_past: int) -> dict[str, int]:
        """The step symbols' values (`ir.kernel.STEP_SYMBOLS`) at a step of `t` tokens after `n_past` cached ones."""
        return dict(zip(STEP_SYMBOLS, (t, n_past, n_past + t, min(t, self.last_rows or t))))

    def tuned(self, index: int) -> bool:
        """Whether launch `index` comes from a match whose knobs a tuned choice set."""
        return bool(self.groups) and any(s.tuned for s in self.group_sites[self.groups[index]])

    def kernel_summary(self) -> list[dict[str, Any]]:
        """One entry per distinct kernel: name, grid, lanes, knobs, whether a tuned choice made it and how many
        launches use it."""
        seen: dict[str, dict[str, Any]] = {}
        for i, la in enumerate(self.launches):
            k = la.kernel
            key = k.fingerprint()
            if key in seen:
                seen[key]["launches"] += 1
                seen[key]["tuned"] = seen[key]["tuned"] or self.tuned(i)
                continue
            seen[key] = {"name": k.name, "lanes": k.lanes, "knobs": dict(k.knobs), "tuned": self.tuned(i),
                         "launches": 1, "id": key}
        return list(seen.values())

    def dump_kernels(self) -> str:
        """The kernel IR of every distinct kernel, for the artifact."""
        out, done = [], set()
        for la in self.launches:
            key = la.kernel.fingerprint()
            if key not in done:
                done.add(key)
                out.append(dump(la.kernel))
        return "\n\n".join(out) + "\n"

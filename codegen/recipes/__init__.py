"""Recipes: graph ops (or fusable chains of them) -> kernel IR launches. Target-neutral.

A `Recipe` matches a `pattern` of graph ops (one op, or a chain the compiler may fuse, e.g. ("add", "rms_norm")
or ("matmul", "matmul", "swiglu")) and lowers the matched nodes to a list of `Launch`es (kernel IR with its
arguments bound to plan buffer names). The compiler (`polystrata/compiler/passes.py`) tries recipes in
`RECIPES` order at each node, longest pattern first, and uses the first whose `match` accepts.

Plan buffer names a recipe reads and writes (`RecipeContext.buf(value)`):
- graph values: the plan decides (reshapes alias their input; the compiler handles that, not recipes);
- weights: the GGUF tensor name, holding the tensor's raw bytes as a `u8` buffer (F32 weights as `f32`);
- inputs: "tokens" and "positions" (i32, T entries), and for attention "starts" (i32, T entries: the KV cache row
  where each token's sequence begins, so token t's K/V go to row starts[t] + positions[t]; 0 but in batched
  decoding, where each sequence owns its own run of cache rows);
- the KV cache of layer L: "kv.L.k" and "kv.L.v", `u8` rows of the KV format (`RecipeContext.kv_format`),
  n_ctx rows of n_head_kv * head_dim values each.
- the recurrent state of layer L (linear-attention layers): "state.L.conv" and "state.L.delta", f32
  (`deltanet.state_buffer`), one per sequence, zeroed when it starts.
Step symbols usable as scalar bindings: "T", "n_past", "n_kv" (see `ir.kernel.Launch`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from polystrata.ir.formats import QuantFormat
from polystrata.ir.graph import Node, Value
from polystrata.ir.kernel import Launch


@dataclass(frozen=True)
class ExpertStream:
    """A MoE layer of a streaming plan: its expert weights live in a device cache of expert slots, which the
    expert kernels address through `slots` (i32 per expert: the slot holding it). The executor makes the layer's
    routed experts resident (`runtimes/memory.py`) between the launches that write the route and the first
    launch that reads `weights`."""

    weights: tuple[str, ...]  # the expert weight tensors (gate, up, down), [n_expert, rows, cols] each
    slots: str  # the slot table buffer
    route: str  # the route buffer (expert ids first: see codegen/recipes/moe.py)
    lists: str  # the expert list buffer (`moe.group_kernel`'s layout)
    x: str  # the layer's MoE input (what a predictive policy applies the next router to)
    n_expert: int
    k: int
    cap: int  # list capacity per expert
    tokens: str | int  # the launches' token binding ("T", or a fixed row count)


@dataclass
class RecipeContext:
    """What a recipe may know about the compilation: target shape, buffers, KV type, knob overrides."""

    lanes: int  # work-items per group the target wants (1 on the CPU)
    subgroup: int  # subgroup / warp width (1 on the CPU, 32 or 64 on GPUs)
    kv_format: QuantFormat
    n_ctx: int
    buffer_names: dict[int, str]  # id(Value) -> plan buffer name
    weight_formats: dict[str, QuantFormat]  # GGUF tensor name -> its format
    knobs: dict[str, dict[str, Any]] = field(default_factory=dict)  # recipe name -> knob overrides (tuner)
    scratch_buffers: dict[str, tuple[str, int]] = field(default_factory=dict)  # name -> (dtype, count)
    t_max: int = 256  # most tokens per step the plan serves (sizes per-token scratch buffers)
    wide_loads: bool = False  # the target merges runs of aligned loads into 16-byte loads (`Runtime.wide_loads`)
    matrix_units: bool = False  # the target renders tile products on matrix units (`Runtime.matrix_units`)
    # A plan for expert streaming: expert kernels read their weights through a slot table (`ExpertStream`), and
    # the recipes record each streamed MoE layer in `expert_streams`.
    stream_experts: bool = False
    expert_streams: list[ExpertStream] = field(default_factory=list)

    def buf(self, v: Value) -> str:
        """Plan buffer name of a graph value or weight."""
        if v.weight is not None:
            return v.weight
        return self.buffer_names[id(v)]

    def scratch(self, key: str, dtype: str, count: int) -> str:
        """A plan buffer for a recipe's temporaries (e.g. activations quantized once for several matmuls),
        shared by every recipe asking with the same `key` and dtype, sized for the largest request. Its contents
        live only between the launches of one recipe."""
        name = f"scratch.{key}"
        old = self.scratch_buffers.get(name)
        if old is not None and old[0] != dtype:
            raise ValueError(f"scratch buffer {name} requested as {dtype} and {old[0]}")
        self.scratch_buffers[name] = (dtype, max(count, old[1] if old else 0))
        return name

    def knob(self, recipe: str, name: str, default: Any) -> Any:
        """A schedule knob: the tuner's override, else the recipe's default."""
        return self.knobs.get(recipe, {}).get(name, default)


@dataclass(frozen=True)
class Recipe:
    """Lowers a chain of graph nodes matching `pattern` to kernel launches."""

    name: str
    pattern: tuple[str, ...]
    lower: Callable[[Sequence[Node], RecipeContext], list[Launch]]
    match: Callable[[Sequence[Node]], bool] | None = None
    knobs: tuple[tuple[str, Any], ...] = ()  # the knobs this recipe exposes, with defaults (for the tuner)


RECIPES: list[Recipe] = []


def token_binding(v: Value) -> str | int:
    """What a kernel's token-count scalar binds to for value `v`: the step symbol "T", or the fixed row count of a
    value whose first dimension is not the step's tokens (the last-row path of decode graphs)."""
    d0 = v.type.shape[0]
    return "T" if d0 == "T" else int(d0)


def register(recipe: Recipe) -> Recipe:
    """Add a recipe to `RECIPES` (each recipe module registers its own at import)."""
    RECIPES.append(recipe)
    return recipe


def load_all() -> None:
    """Import every recipe module of this package (each registers its recipes once, at import)."""
    import importlib
    import pkgutil

    for mod in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{mod.name}")


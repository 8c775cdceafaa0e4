"""Recipes: graph ops (or fusable chains of them) -> kernel IR launches. Target-neutral.

A `Recipe` matches a `pattern` of graph ops (one op, or a chain the compiler may fuse, e.g. ("add", "rms_norm")
or ("matmul", "matmul", "swiglu")) and lowers the matched nodes to a list of `Launch`es (kernel IR with its
arguments bound to plan buffer names). The compiler (`polystrata/compiler/passes.py`) tries recipes in
`RECIPES` order at each node, longest pattern first, and uses the first whose `match` accepts.

Plan buffer names a recipe reads and writes (`RecipeContext.buf(value)`):
- graph values: the plan decides (reshapes alias their input; the compiler handles that, not recipes);
- weights: the GGUF tensor name, holding the tensor's raw bytes as a `u8` buffer (F32 weights as `f32`);
- inputs: "tokens" and "positions" (i32, T entries);
- the KV cache of layer L: "kv.L.k" and "kv.L.v", `u8` rows of the KV format (`RecipeContext.kv_format`),
  n_ctx rows of n_head_kv * head_dim values each.
Step symbols usable as scalar bindings: "T", "n_past", "n_kv" (see `ir.kernel.Launch`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from polystrata.ir.graph import Node, Value
from polystrata.ir.kernel import Launch
from polystrata.ir.quant import QuantFormat


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

    def buf(self, v: Value) -> str:
        """Plan buffer name of a graph value or weight."""
        if v.weight is not None:
            return v.weight
        return self.buffer_names[id(v)]

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

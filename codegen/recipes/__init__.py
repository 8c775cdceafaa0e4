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
Step symbols usable as scalar bindings: "T", "n_past", "n_kv", "T_last" (see `ir.kernel.Launch`).
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from polystrata.codegen.policy import Policy, shape_policy
from polystrata.ir.formats import QuantFormat
from polystrata.ir.graph import Node, Value
from polystrata.ir.kernel import Launch


def _arg_key(v: Any) -> Any:
    """A hashable key that tells apart every argument value a kernel builder may render differently: scalars by
    type and exact value (1, 1.0 and True, or 0.0 and -0.0, hash alike but render differently), containers and
    dataclasses (formats, expressions) by their contents, functions (epilogues) by their code and what they close
    over. Raises TypeError for anything else unhashable."""
    if v is None or isinstance(v, str | bytes):
        return v
    if isinstance(v, bool | int | float):
        return (type(v).__name__, repr(v))
    if isinstance(v, list | tuple):
        return (type(v).__name__, tuple(_arg_key(x) for x in v))
    if isinstance(v, dict):
        return ("dict", tuple((_arg_key(k), _arg_key(x)) for k, x in v.items()))
    if isinstance(v, types.FunctionType):
        cells = tuple(_arg_key(c.cell_contents) for c in v.__closure__ or ())
        return ("fn", v.__code__, _arg_key(v.__defaults__), _arg_key(v.__kwdefaults__), cells)
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return (type(v), tuple(_arg_key(getattr(v, f.name)) for f in dataclasses.fields(v)))
    hash(v)
    return (type(v), v)


def kernel_builder(build: Callable[..., Any]) -> Callable[..., Any]:
    """Memoize a kernel builder: a pure function of its arguments, asked by every layer of a model for the same
    kernel (and every plan of an engine), whose lowering of the quantization formats is what planning spends
    its time on. Arguments `_arg_key` cannot key are built each time. A function argument is keyed by its code and
    what it closes over, not by the module globals it reads: a builder's epilogue must not read state that changes."""
    built: dict[Any, Any] = {}

    @functools.wraps(build)
    def memoized(*args, **kwargs):
        try:
            key = (_arg_key(args), _arg_key(kwargs))
        except (TypeError, ValueError, RecursionError):  # unhashable, an empty closure cell, a recursive function
            return build(*args, **kwargs)
        kernel = built.get(key)
        if kernel is None:
            if len(built) >= 4096:  # a long tuning session's candidates: keep the memory bounded
                built.clear()
            kernel = built[key] = build(*args, **kwargs)
        return kernel

    return memoized


@dataclass(frozen=True)
class Knob:
    """One schedule knob: its default ("auto": the recipe or the target's policy decides) and the values a tuner
    tries (`candidates`; the default is always tried too)."""

    name: str
    default: Any
    candidates: tuple[Any, ...] = ()


@dataclass(frozen=True)
class KnobSpace:
    """The knobs a recipe exposes, for the tuner: names, defaults, candidate values and `constraint` (which
    combinations of set knobs make sense; None: any). `version` goes into the tuning database's key: raise it
    when a knob's meaning changes, so that old measurements no longer apply."""

    name: str  # the space's name; overrides by this name apply to every kernel the space makes
    knobs: tuple[Knob, ...]
    version: int = 1
    constraint: Callable[[dict[str, Any]], bool] | None = None

    def defaults(self) -> dict[str, Any]:
        return {k.name: k.default for k in self.knobs}

    def signature(self, instance: str, t_max: int, family: str | None = None) -> str:
        """The key of one kernel instance of this space (its shapes and formats in `instance`, the plan's step
        size, and where a plan's steps are shared out among kernel families, the `family` whose knobs these are):
        what the tuning database and per-instance overrides are keyed by."""
        return f"{self.name}.v{self.version}:{instance}:t{t_max}" + (f":{family}" if family else "")

    def _changes(self) -> list[dict[str, Any]]:
        """Every one-knob change from the defaults, each knob's extremes first (`constraint` not applied)."""
        return [{k.name: v} for k in self.knobs for v in _extremes_first(k.candidates) if v != k.default]

    def singles(self) -> list[dict[str, Any]]:
        """The candidates that change one knob from the defaults (allowed by `constraint`), each knob's extremes
        first: the first round of a search."""
        return [c for c in self._changes() if self.constraint is None or self.constraint({**self.defaults(), **c})]

    def pairs(self, among: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The candidates that change two knobs, each change one of the single-knob candidates `among` (in their
        order: a search passes the singles that won, best first), allowed by `constraint`."""
        out = []
        for i, a in enumerate(among):
            for b in among[i + 1:]:
                if set(a).isdisjoint(b):
                    out.append({**a, **b})
        return [c for c in out if self.constraint is None or self.constraint({**self.defaults(), **c})]

    def candidates(self) -> list[dict[str, Any]]:
        """Every set of overrides the tuner may try: `singles`, then every allowed `pairs` of them."""
        return self.singles() + self.pairs(self._changes())


def _extremes_first(values: tuple) -> list:
    """`values` with the first and last first (the extremes, which a sampled check must not skip)."""
    if len(values) <= 2:
        return list(values)
    return [values[0], values[-1], *values[1:-1]]


@dataclass(frozen=True)
class Site:
    """Where a knob space was read while lowering: the kernel instance's signature, whether a per-instance
    override (a tuned choice) applied, and `rows`: where the plan's steps are shared out among kernel families
    by their row count (a matmul's tile products for prompt chunks, split-K products for batched decoding, matvecs
    for a few rows), a step size whose launches are this family's, which the tuner times it at (None: the
    plan's own step, as for kernels that serve every step)."""

    signature: str
    space: KnobSpace
    tuned: bool
    rows: int | None = None


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
    tokens: str  # the launches' token binding, a step symbol (`token_binding`)
    # One-token plans resolve misses on the device (`moe.resolve_kernel`, `moe.fill_kernel`): the names of those
    # kernels (the executor drops their launches where it resolves on the host instead), and per weight the
    # plan buffer of the experts in host memory that the fill kernel reads in place.
    resolve: tuple[str, ...] = ()
    host: tuple[str, ...] = ()

    @property
    def state(self) -> ExpertState:
        """The layout of the layer's cache state in the `slots` buffer."""
        return ExpertState(self.n_expert, self.k)


@dataclass(frozen=True)
class ExpertState:
    """The expert cache of one streamed MoE layer in one i32 buffer (the `ExpertStream.slots` buffer), laid out
    so that the host (`runtimes/memory.ExpertCache`) and the device's resolve kernel keep the same cache:
    the slot table first (expert -> slot, -1: not resident; what the expert kernels read), the expert in each
    slot (-1: empty), each expert's last use (the policy's clock) and count of uses, a header (`H_*`) and the
    (expert, slot) uploads of the last resolve, at most k of them (one-token steps)."""

    n_expert: int
    k: int

    # Header words: slots in use, the policy's clock, requests / hits / uploads counted since the host last read
    # them, the last resolve's number of uploads, and the policy (0: LRU, 1: LFU).
    H_SLOTS, H_CLOCK, H_REQUESTS, H_HITS, H_UPLOADS, H_LOADS, H_LFU = range(7)
    HEADER = 8

    @property
    def table(self) -> int:
        return 0

    @property
    def holds(self) -> int:
        return self.n_expert

    @property
    def last(self) -> int:
        return 2 * self.n_expert

    @property
    def count(self) -> int:
        return 3 * self.n_expert

    @property
    def header(self) -> int:
        return 4 * self.n_expert

    @property
    def loads(self) -> int:
        return 4 * self.n_expert + self.HEADER

    @property
    def size(self) -> int:
        return self.loads + 2 * self.k


@dataclass
class RecipeContext:
    """What a recipe may know about the compilation: target shape and policy, buffers, KV type, knob overrides."""

    lanes: int  # work-items per group the target wants (1 on the CPU)
    subgroup: int  # subgroup / warp width (1 on the CPU, 32 or 64 on GPUs)
    kv_format: QuantFormat
    n_ctx: int
    buffer_names: dict[int, str]  # id(Value) -> plan buffer name
    weight_formats: dict[str, QuantFormat]  # GGUF tensor name -> its format
    # Knob overrides: knob space name (every kernel of the space) or a kernel instance's signature
    # (`KnobSpace.signature`: the tuner's choices) -> knob -> value.
    knobs: dict[str, dict[str, Any]] = field(default_factory=dict)
    scratch_buffers: dict[str, tuple[str, int]] = field(default_factory=dict)  # name -> (dtype, count)
    t_max: int = 256  # most tokens per step the plan serves (sizes per-token scratch buffers)
    wide_loads: bool = False  # the target merges runs of aligned loads into 16-byte loads (`Runtime.wide_loads`)
    # A plan for expert streaming: expert kernels read their weights through a slot table (`ExpertStream`), and
    # the recipes record each streamed MoE layer in `expert_streams`.
    stream_experts: bool = False
    expert_streams: list[ExpertStream] = field(default_factory=list)
    # The target's policy (`codegen/policy.py`); None: the policy of the bare shape (`shape_policy`: kernel tests).
    policy: Policy | None = None
    # Kernel instances whose knobs were read while lowering the current match (`knobs_for`), for the plan.
    sites: list[Site] = field(default_factory=list)

    def target(self) -> Policy:
        """The target's policy (see `policy`)."""
        return self.policy or shape_policy(self.lanes, self.subgroup, self.wide_loads)

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

    def knobs_for(self, space: KnobSpace, instance: str | None, family: str | None = None) -> dict[str, Any]:
        """The knobs of `space` for one kernel instance (`instance`: its shapes and formats, `family`: the kernels
        of some of the plan's steps, see `KnobSpace.signature`): the instance's override (the tuner's), else the
        space's, else the space's default ("auto" where the recipe and the target's policy decide). Records the
        instance in `sites` (the step it is timed at, `Site.rows`, set by `timed_at` once the knobs that decide it
        are read); `instance` None (a recipe asking what another recipe would choose) records nothing."""
        values = {**space.defaults(), **self.knobs.get(space.name, {})}
        if instance is None:
            return values
        sig = space.signature(instance, self.t_max, family)
        tuned = self.knobs.get(sig)
        self.sites.append(Site(sig, space, tuned is not None))
        return {**values, **(tuned or {})}

    def timed_at(self, space: KnobSpace, instance: str, rows: int | None, family: str | None = None) -> None:
        """Set the step size the tuner times an instance recorded by `knobs_for` at (`Site.rows`)."""
        sig = space.signature(instance, self.t_max, family)
        self.sites = [dataclasses.replace(s, rows=rows) if s.signature == sig else s for s in self.sites]

    def max_rows(self, v: Value) -> int:
        """The most rows value `v` has in a step (sizes per-row scratch): t_max, or n after `last_rows n`."""
        d0 = v.type.shape[0]
        return self.t_max if d0 == "T" else min(int(d0), self.t_max)


@dataclass(frozen=True)
class Recipe:
    """Lowers a chain of graph nodes matching `pattern` to kernel launches."""

    name: str
    pattern: tuple[str, ...]
    lower: Callable[[Sequence[Node], RecipeContext], list[Launch]]
    match: Callable[[Sequence[Node]], bool] | None = None
    knobs: KnobSpace | None = None  # the knobs this recipe exposes (for the tuner)


RECIPES: list[Recipe] = []


def token_binding(v: Value) -> str:
    """The step symbol a kernel's token-count scalar binds to for value `v`: "T", or for a value after the graph's
    `last_rows n` op (its first dimension n, the most rows it has) "T_last", the min(T, n) rows it has."""
    return "T" if v.type.shape[0] == "T" else "T_last"


def register(recipe: Recipe) -> Recipe:
    """Add a recipe to `RECIPES` (each recipe module registers its own at import)."""
    RECIPES.append(recipe)
    return recipe


def recipe_named(name: str) -> Recipe:
    """The registered recipe `name`: how a fused recipe lowers the parts it does not change."""
    return next(r for r in RECIPES if r.name == name)


def load_all() -> None:
    """Import every recipe module of this package (each registers its recipes once, at import)."""
    import importlib
    import pkgutil

    for mod in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{mod.name}")


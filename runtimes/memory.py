"""The memory manager: where every weight, KV and scratch buffer of a model lives, within a device-memory budget.

`plan_memory` fits the weights, the KV cache, the plans' scratch buffers and an expert cache into the budget (or
says, before anything is uploaded, what does not fit). Where the MoE experts do not all fit, the plans are made
for streaming (`compile_plans(..., stream_experts=True)`: the expert kernels read their weights through a slot
table) and `ExpertStreamer` keeps each MoE layer's experts in host memory, a device cache of `slots` experts
per layer, and the slot tables; a policy (`POLICIES`, chosen by name) picks what to evict and may prefetch.
`VRAMGuard` shrinks the expert cache when free device memory stays low and grows it back when it recovers.

Runtimes supply only mechanisms (`runtimes/base.py`): `alloc`/`free`, `alloc_host` (page-locked staging),
`copy_async` (a host-to-device copy on a second queue, returning an event), `wait_for` / `wait_host` and
`memory_info`.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from polystrata.codegen.recipes import ExpertState
from polystrata.errors import PolystrataError
from polystrata.ir.evaluate import dequantize
from polystrata.ir.graph import Graph
from polystrata.ir.kernel import DTYPE_BYTES
from polystrata.ir.layout import repack
from polystrata.runtimes.base import host_memory

# What the default budget leaves free on the device (other processes, the driver's own allocations): the larger
# of this many bytes (a quarter of the device at most) and this fraction of the device's memory. It is also the VRAM
# guard's low-water mark (`vram_guard`). On the cpu target the device is the host, and the same margin of its
# memory is left to the rest of the system.
MARGIN_BYTES = 512 << 20
MARGIN_FRACTION = 0.05

_SUFFIX = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_gpu_mem(text: str, free_bytes: int | None) -> int:
    """Bytes of a `--gpu-mem` value: a byte count with an optional K/M/G/T suffix (powers of 1024; "KiB", "GB"
    and the like are read the same), or `NN%` of `free_bytes` (the device's free memory)."""
    s = str(text).strip()
    pct = re.fullmatch(r"(\d+(?:\.\d+)?)\s*%", s)
    if pct:
        if free_bytes is None:
            raise PolystrataError(f"--gpu-mem {s}: this device does not report its free memory; give a size")
        value = float(pct.group(1))
        if not 0 < value <= 100:
            raise PolystrataError(f"--gpu-mem {s}: a percentage must lie in (0, 100]")
        return int(free_bytes * value / 100)
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?", s.upper())
    if not m:
        raise PolystrataError(f"--gpu-mem {s!r}: expected a size such as 8G, 512M, 1.5G or a percentage such as 80%")
    n = int(float(m.group(1)) * _SUFFIX[m.group(2)])
    if n <= 0:
        raise PolystrataError(f"--gpu-mem {s}: the budget must be positive")
    return n


def default_budget(runtime: Any) -> int | None:
    """The device's free memory at start less a margin (on host targets: the host's available memory, their
    device memory); None where the runtime does not report it."""
    if runtime is None:
        return None
    info = runtime.memory_info()
    if info is None:
        return None
    free, total = info
    return max(free - margin(total), 0)


def margin(total: int) -> int:
    """Bytes the default budget leaves free on a device of `total` bytes (at most a quarter of a small one)."""
    return max(min(MARGIN_BYTES, total // 4), int(total * MARGIN_FRACTION))


def resolve_budget(runtime: Any, gpu_mem: str | None) -> int | None:
    """The budget in bytes: `--gpu-mem` where given (a percentage of the device's free memory), else
    `default_budget`."""
    if gpu_mem is None:
        return default_budget(runtime)
    info = runtime.memory_info() if runtime is not None else None
    return parse_gpu_mem(gpu_mem, info[0] if info else None)


def check_reference_flags(gpu_mem: str | None, expert_slots: int | None, expert_policy: str | None = None) -> None:
    """Refuse the memory options on the reference target: it runs the graph in numpy, every weight in host
    memory, with no device memory to plan and no expert cache."""
    given = [flag for flag, value in (("--gpu-mem", gpu_mem), ("--expert-slots", expert_slots),
                                      ("--expert-policy", expert_policy)) if value is not None]
    if given:
        raise PolystrataError(f"{', '.join(given)}: the reference target plans no device memory (numpy keeps every "
                              "weight in host memory); leave them out or pick a kernel target with --target")


def fmt_bytes(n: float) -> str:
    """A byte count for people: GiB, MiB or KiB."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}" if unit == "GiB" else f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


# --- the plan ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoELayer:
    """A MoE layer of the graph: its expert weight tensors (gate, up, down), expert count, experts a token uses,
    and the router's weight (for predictive policies)."""

    weights: tuple[str, ...]
    n_expert: int
    k: int
    router: str | None


def moe_layers(graph: Graph) -> list[MoELayer]:
    """The MoE layers of `graph` in order (moe_ffn nodes; the router weight traced through the router's matmul)."""
    producer = {id(n.output): n for n in graph.nodes}
    out = []
    for n in graph.nodes:
        if n.op != "moe_ffn":
            continue
        _, route, g, u, d = n.inputs
        router = producer.get(id(route))
        mm = producer.get(id(router.inputs[0])) if router is not None else None
        rw = mm.inputs[1].weight if mm is not None and mm.op == "matmul" else None
        out.append(MoELayer((g.weight, u.weight, d.weight), int(g.type.shape[0]), int(route.type.shape[1]), rw))
    return out


@dataclass
class MemoryPlan:
    """Where a model's bytes go on the device: resident weights, the expert cache (`slots` experts of each MoE
    layer; `n_expert` slots: all resident), the KV cache and the plans' scratch buffers, within `budget` bytes
    (None: no budget information, nothing was fitted)."""

    budget: int | None
    weight_bytes: int  # weights other than streamed experts
    expert_bytes: int  # one expert of one MoE layer: its gate, up and down matrices
    expert_layers: int  # MoE layers
    n_expert: int
    slots: int  # expert slots per MoE layer
    kv_bytes: int
    scratch_bytes: int
    n_ctx: int
    kv_type: str = "f16"

    @property
    def streaming(self) -> bool:
        """Whether the experts stream through a device cache (not all resident)."""
        return self.expert_layers > 0 and self.slots < self.n_expert

    @property
    def expert_cache_bytes(self) -> int:
        return self.slots * self.expert_bytes * self.expert_layers if self.streaming else 0

    @property
    def total(self) -> int:
        """Device bytes the plan uses."""
        return self.weight_bytes + self.expert_cache_bytes + self.kv_bytes + self.scratch_bytes

    def describe(self) -> list[str]:
        """The plan in a few lines, for `run --verbose` and `compile`."""
        budget = f"budget {fmt_bytes(self.budget)}" if self.budget is not None else "no budget (device memory unknown)"
        lines = [f"memory: {fmt_bytes(self.total)} of the device, {budget}"]
        if self.expert_layers and not self.streaming:
            lines.append(f"  weights: {fmt_bytes(self.weight_bytes)} resident, all {self.n_expert} experts of "
                         f"{self.expert_layers} MoE layers included")
        elif self.streaming:
            lines.append(f"  weights: {fmt_bytes(self.weight_bytes)} resident; experts stream from host memory: "
                         f"{self.slots} of {self.n_expert} slots per layer x {self.expert_layers} layers x "
                         f"{fmt_bytes(self.expert_bytes)} = {fmt_bytes(self.expert_cache_bytes)}")
        else:
            lines.append(f"  weights: {fmt_bytes(self.weight_bytes)} resident")
        lines.append(f"  KV cache: {fmt_bytes(self.kv_bytes)} ({self.kv_type}, n_ctx {self.n_ctx})")
        lines.append(f"  scratch: {fmt_bytes(self.scratch_bytes)} (one set of activation buffers shared by the plans)")
        return lines

    def manifest(self) -> dict[str, Any]:
        """The plan as the artifact manifest's `memory:` entries."""
        return {
            "budget_bytes": self.budget, "resident_weight_bytes": self.weight_bytes,
            "expert_bytes": self.expert_bytes, "expert_layers": self.expert_layers, "n_expert": self.n_expert,
            "expert_slots_per_layer": self.slots, "experts_streamed": self.streaming,
            "kv_bytes": self.kv_bytes, "scratch_bytes": self.scratch_bytes, "total_bytes": self.total,
        }


def _nbytes(spec: Any) -> int:
    return int(spec.count) * DTYPE_BYTES[spec.dtype]


def shared_scratch(plans: Mapping[int, Any]) -> tuple[list[tuple[str, int]], dict[tuple[int, str], int]]:
    """One set of activation buffers for all of an engine's plans: they never run at the same time (one step at a
    time, on one queue, its logits read before the next step) and no activation outlives its step, so the i-th
    largest activation buffer of a dtype of every plan takes shared buffer i of that dtype, as large as the largest
    it holds: the plans' scratch costs about that of the largest plan, not their sum. Returns the shared buffers,
    (dtype, count) each, and which one each plan's activation uses: (plan key, buffer name) -> index."""
    shared: list[tuple[str, int]] = []
    index: dict[str, list[int]] = {}  # dtype -> its shared buffers, by rank
    use: dict[tuple[int, str], int] = {}
    for pid, plan in plans.items():
        acts = sorted(((spec.dtype, -spec.count, name) for name, spec in plan.buffers.items()
                       if spec.kind == "activation"))
        rank: dict[str, int] = {}
        for dtype, neg, name in acts:
            i = rank[dtype] = rank.get(dtype, -1) + 1
            ranked = index.setdefault(dtype, [])
            if i == len(ranked):
                ranked.append(len(shared))
                shared.append((dtype, 0))
            use[(pid, name)] = j = ranked[i]
            shared[j] = (dtype, max(shared[j][1], -neg))
    return shared, use


def plan_memory(
    plans: Mapping[int, Any], layers: list[MoELayer], n_ctx: int, budget: int | None, *,
    expert_slots: int | None = None, stream: bool = True, kv_type: str = "f16", budget_flag: str = "--gpu-mem",
    check: bool = True,
) -> MemoryPlan:
    """Fit the plans' weights, KV cache and scratch buffers, and an expert cache, into `budget` bytes.

    `layers`: the graph's MoE layers (`moe_layers`). Experts stay resident where they all fit (or `stream` is
    False: the cpu target); otherwise each MoE layer gets as many expert slots as the rest of the budget holds
    (`expert_slots` sets them directly). Raises PolystrataError naming what does not fit (`check`; without it,
    the plan is returned as it would be, at least one slot a layer, for sizing the context)."""
    if expert_slots is not None and expert_slots < 1:
        raise PolystrataError("--expert-slots must be at least 1")
    weights: dict[str, int] = {}
    shared: dict[str, tuple[str, int]] = {}  # the KV cache, recurrent states, inputs: one buffer for every plan
    for plan in plans.values():
        for name, spec in plan.buffers.items():
            if spec.kind == "weight":
                weights[name] = _nbytes(spec)
            elif spec.kind in ("kv", "input", "state"):  # inputs: as large as the largest step's (-ub)
                shared[name] = (spec.kind, max(_nbytes(spec), shared.get(name, ("", 0))[1]))
    # Activations: one set shared by the plans (slot tables: counted below, with the cache).
    scratch = sum(count * DTYPE_BYTES[dtype] for dtype, count in shared_scratch(plans)[0])
    kv_bytes = sum(nb for kind, nb in shared.values() if kind == "kv")
    # Recurrent states do not grow with the context: counted with the fixed buffers.
    scratch += sum(nb for kind, nb in shared.values() if kind in ("input", "state"))
    expert_names = {w for la in layers for w in la.weights}
    n_expert = max((la.n_expert for la in layers), default=0)
    expert_bytes = max((sum(weights[w] for w in la.weights) // la.n_expert for la in layers), default=0)
    all_experts = sum(weights[w] for w in expert_names)
    other = sum(b for w, b in weights.items() if w not in expert_names)
    fixed = other + kv_bytes + scratch
    state_bytes = sum(ExpertState(la.n_expert, la.k).size * 4 for la in layers)
    plan = MemoryPlan(budget, other + all_experts, expert_bytes, len(layers), n_expert, n_expert, kv_bytes, scratch,
                      n_ctx, kv_type)
    if not layers or not stream:
        if check:
            _check_fits(plan, budget_flag)
        return plan
    if expert_slots is not None:
        slots = min(expert_slots, n_expert)
    elif budget is None or fixed + all_experts <= budget:
        slots = n_expert
    else:
        slots = max(budget - fixed - state_bytes, 0) // (expert_bytes * len(layers))
        if slots < 1 and not check:
            slots = 1
        elif slots < 1:
            raise PolystrataError(
                f"{budget_flag} {fmt_bytes(budget)} does not hold the model with one expert slot per MoE layer: "
                f"weights besides the experts {fmt_bytes(other)} + KV cache {fmt_bytes(kv_bytes)} (n_ctx {n_ctx}) + "
                f"scratch {fmt_bytes(scratch)} + {len(layers)} x {fmt_bytes(expert_bytes)} of experts; {_ADVICE}")
        slots = min(slots, n_expert)
    if slots < n_expert:
        plan.weight_bytes = other
        plan.slots = slots
        plan.scratch_bytes += state_bytes  # the caches' states (slot tables)
    if check:
        _check_fits(plan, budget_flag)
    return plan


def _check_fits(plan: MemoryPlan, flag: str) -> None:
    if plan.budget is None or plan.total <= plan.budget:
        return
    parts = [f"weights {fmt_bytes(plan.weight_bytes)}"]
    if plan.streaming:
        parts.append(f"expert cache {fmt_bytes(plan.expert_cache_bytes)} ({plan.slots} slots per layer)")
    parts += [f"KV cache {fmt_bytes(plan.kv_bytes)} (n_ctx {plan.n_ctx})", f"scratch {fmt_bytes(plan.scratch_bytes)}"]
    raise PolystrataError(f"{flag} {fmt_bytes(plan.budget)} is too small: {' + '.join(parts)} = "
                          f"{fmt_bytes(plan.total)}; {_ADVICE}")


_ADVICE = "give a larger --gpu-mem (where the device has it), a shorter context (--ctx) or fewer --expert-slots"


def fit_context(plan: MemoryPlan, n_ctx: int, slots: int = 1) -> int:
    """The default context: `n_ctx`, reduced where the budget cannot hold its KV cache beside the weights, the
    scratch buffers of `plan` (made at context `plan.n_ctx`, at least as large as at any shorter context) and an
    expert cache of `slots` experts a layer (the context comes first: one slot, unless --expert-slots says more or
    the experts cannot stream). Where not even one token fits, `n_ctx` (`plan_memory` then says what does not
    fit)."""
    if plan.budget is None or plan.kv_bytes == 0:
        return n_ctx
    per_token = plan.kv_bytes / max(plan.n_ctx, 1)
    layer_expert = plan.expert_bytes * plan.expert_layers
    others = plan.weight_bytes - (0 if plan.streaming else layer_expert * plan.n_expert) + plan.scratch_bytes
    fits = int((plan.budget - others - layer_expert * min(slots, plan.n_expert)) // per_token)
    return min(n_ctx, fits) if fits >= 1 else n_ctx


def fit_plans(
    file: Any, graphs: list[Graph], steps: dict[int, int], runtime: Any, n_ctx: int | None, n_ctx_train: int,
    kv_type: str, gpu_mem: str | None, expert_slots: int | None,
) -> tuple[dict[int, Any], MemoryPlan]:
    """Plans of `graphs` (`compile_plans`) that fit the device-memory budget, and their memory plan. `n_ctx` None:
    the model's context `n_ctx_train`, reduced to what the budget holds (`fit_context`, with a line on stderr;
    the attention kernels' local memory does not grow with the context: `codegen/recipes/attention.py`). The
    plans are made for streaming where the experts do not all fit. Raises PolystrataError, before anything is
    uploaded, when the budget cannot hold the model; on host targets only under an explicit `gpu_mem` (their
    default budget, the host's available memory less a margin, only sizes the default context: a model larger
    than that still runs from the mmapped file, as llama.cpp's does)."""
    import sys

    from polystrata.compiler import compile_plans

    budget = resolve_budget(runtime, gpu_mem)
    layers = moe_layers(graphs[0])
    on_host = runtime.host
    opts = {"stream": not on_host,  # host memory is a host target's device memory: experts stay resident
            "kv_type": kv_type, "expert_slots": expert_slots}
    reduced, plans = False, None
    if n_ctx is None:
        n_ctx = n_ctx_train
        if budget is not None:
            plans = compile_plans(file, graphs, runtime, n_ctx, kv_type, steps)
            sizing = plan_memory(plans, layers, n_ctx, budget, check=False, **opts)
            fitted = fit_context(sizing, n_ctx, sizing.n_expert if on_host else expert_slots or 1)
            if fitted < n_ctx:
                reduced, n_ctx, plans = True, fitted, None
    if plans is None:
        plans = compile_plans(file, graphs, runtime, n_ctx, kv_type, steps)
    flag = "--gpu-mem" if gpu_mem is not None else "the free device memory less a margin,"
    memory = plan_memory(plans, layers, n_ctx, budget, budget_flag=flag, check=not on_host or gpu_mem is not None,
                         **opts)
    if reduced:
        where = "--gpu-mem" if gpu_mem is not None else "host-memory" if on_host else "device-memory"
        print(f"context: {n_ctx} tokens (the model's is {n_ctx_train}): what the {where} budget "
              f"{fmt_bytes(budget)} holds beside the weights", file=sys.stderr)
    if memory.streaming:
        plans = compile_plans(file, graphs, runtime, n_ctx, kv_type, steps, stream_experts=True)
    return plans, memory


# --- the expert cache ------------------------------------------------------------------------------------------


class ExpertPolicy:
    """What an expert cache evicts (and, for predictive policies, prefetches). One instance per MoE layer.

    `touch` sees every use of a resident expert in order; `victim` picks which resident expert to evict among
    `candidates`. A predictive policy sets `predicts` and is asked for the experts a layer will likely need."""

    name = ""
    predicts = False

    def __init__(self, n_expert: int) -> None:
        self.clock = 0
        self.last = np.full(n_expert, -1, np.int64)
        self.count = np.zeros(n_expert, np.int64)

    def touch(self, expert: int) -> None:
        """Record a use of `expert`."""
        self.clock += 1
        self.last[expert] = self.clock
        self.count[expert] += 1

    def victim(self, candidates: Iterable[int]) -> int:
        """The resident expert to evict."""
        raise NotImplementedError


class LRUPolicy(ExpertPolicy):
    """Evict the least recently used expert."""

    name = "lru"

    def victim(self, candidates: Iterable[int]) -> int:
        return min(candidates, key=lambda e: self.last[e])


class LFUPolicy(ExpertPolicy):
    """Evict the least frequently used expert (uses counted since the start, over evictions; ties: the least
    recently used): experts the router favours stay pinned."""

    name = "lfu"

    def victim(self, candidates: Iterable[int]) -> int:
        return min(candidates, key=lambda e: (self.count[e], self.last[e]))


class PrefetchPolicy(LRUPolicy):
    """LRU, plus a prediction: when the host learns layer L's routes (one-token steps), layer L+1's router is
    applied on the host to layer L's MoE input, and its top-k experts are uploaded asynchronously while layer L
    computes. A wrong prediction costs link bytes, never results: layer L+1 still checks its actual routes."""

    name = "prefetch"
    predicts = True


POLICIES: dict[str, type[ExpertPolicy]] = {p.name: p for p in (LRUPolicy, LFUPolicy, PrefetchPolicy)}


def policy_class(name: str) -> type[ExpertPolicy]:
    """The policy called `name` (`--expert-policy`)."""
    if name not in POLICIES:
        raise PolystrataError(f"unknown expert policy '{name}' (known: {', '.join(POLICIES)})")
    return POLICIES[name]


@dataclass
class CacheStats:
    """Counts of expert requests (one per routed expert of a step, each distinct expert once), hits among them,
    experts uploaded (misses and prefetches), bytes over the host link, seconds the host waited for uploads."""

    requests: int = 0
    hits: int = 0
    uploads: int = 0
    prefetches: int = 0
    link_bytes: int = 0
    stall_s: float = 0.0

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.requests if self.requests else None


class ExpertCache:
    """The device slots of one MoE layer: which expert each slot holds, the policy's bookkeeping and statistics.
    Pure bookkeeping; `ExpertStreamer` moves the bytes."""

    def __init__(self, n_expert: int, slots: int, policy: ExpertPolicy, stats: CacheStats | None = None) -> None:
        self.n_expert = n_expert
        self.policy = policy
        self.stats = stats if stats is not None else CacheStats()
        self.slot_of = np.full(n_expert, -1, np.int32)
        self.holds: list[int] = [-1] * slots  # expert in each slot, -1: empty

    @property
    def slots(self) -> int:
        return len(self.holds)

    def resident(self, expert: int) -> bool:
        return bool(self.slot_of[expert] >= 0)

    def _place(self, expert: int, keep: set[int]) -> int:
        """A slot for `expert`: an empty one, else the policy's victim among residents not in `keep`."""
        if -1 in self.holds:
            slot = self.holds.index(-1)
        else:
            old = self.policy.victim(e for e in self.holds if e not in keep)
            slot = int(self.slot_of[old])
            self.slot_of[old] = -1
        self.holds[slot] = expert
        self.slot_of[expert] = slot
        return slot

    def request(self, experts: list[int]) -> list[tuple[int, int]]:
        """Make `experts` (distinct, at most `slots`) resident together; returns the (expert, slot) uploads."""
        if len(experts) > self.slots:
            raise ValueError(f"{len(experts)} experts requested at once from a cache of {self.slots} slots")
        keep = set(experts)
        loads = []
        for e in experts:
            self.stats.requests += 1
            if self.resident(e):
                self.stats.hits += 1
            else:
                loads.append((e, self._place(e, keep)))
            self.policy.touch(e)
        return loads

    def prefetch(self, experts: list[int]) -> list[tuple[int, int]]:
        """Make predicted `experts` resident (not counted as requests); returns the (expert, slot) uploads."""
        keep = set(experts[: self.slots])  # at most `slots` of them, so a slot outside them is always free to take
        want = [e for e in experts[: self.slots] if not self.resident(e)]
        loads = [(e, self._place(e, keep)) for e in want]
        self.stats.prefetches += len(loads)
        return loads

    def passes(self, experts: Iterable[int]) -> list[list[int]]:
        """The routed `experts` of a step in groups of at most `slots`, each made resident and computed in turn
        (one group when they fit); resident experts come first, so they are used before anything evicts them."""
        need = sorted(set(int(e) for e in experts), key=lambda e: (not self.resident(e), e))
        return [need[i : i + self.slots] for i in range(0, len(need), self.slots)]

    def resize(self, slots: int) -> list[int]:
        """Change the cache to `slots` slots, every one empty; returns the experts to keep (the policy evicts the
        rest), for the caller to load again (`prefetch`)."""
        kept = [e for e in self.holds if e >= 0]
        while len(kept) > slots:
            kept.remove(self.policy.victim(kept))
        self.slot_of[:] = -1
        self.holds = [-1] * slots
        return kept

    def state(self, k: int) -> np.ndarray:
        """The cache as the device keeps it (`ExpertState`'s layout, counters zero): the slot table the expert
        kernels read first (-1: not resident, which no kernel reads), then what the resolve kernel needs to go on
        exactly as `request` would."""
        lay = ExpertState(self.n_expert, k)
        out = np.zeros(lay.size, np.int32)
        out[lay.table : lay.table + self.n_expert] = self.slot_of
        out[lay.holds : lay.holds + self.n_expert] = -1
        out[lay.holds : lay.holds + self.slots] = self.holds
        out[lay.last : lay.last + self.n_expert] = self.policy.last
        out[lay.count : lay.count + self.n_expert] = self.policy.count
        out[lay.header + lay.H_SLOTS] = self.slots
        out[lay.header + lay.H_CLOCK] = self.policy.clock
        out[lay.header + lay.H_LFU] = int(self.policy.name == "lfu")
        return out

    def load_state(self, state: np.ndarray, k: int) -> int:
        """Take over the cache the device kept (`state`), adding its requests and hits to the statistics; returns
        the uploads it made (which the streamer counts, as it counts its own)."""
        lay = ExpertState(self.n_expert, k)
        self.slot_of[:] = state[lay.table : lay.table + self.n_expert]
        self.holds = [int(e) for e in state[lay.holds : lay.holds + self.slots]]
        self.policy.last[:] = state[lay.last : lay.last + self.n_expert]
        self.policy.count[:] = state[lay.count : lay.count + self.n_expert]
        self.policy.clock = int(state[lay.header + lay.H_CLOCK])
        self.stats.requests += int(state[lay.header + lay.H_REQUESTS])
        self.stats.hits += int(state[lay.header + lay.H_HITS])
        return int(state[lay.header + lay.H_UPLOADS])


# --- moving experts ----------------------------------------------------------------------------------------------


class _Staging:
    """A ring of pinned host buffers for uploads; a buffer is reused only after its last copy completed."""

    def __init__(self, rt: Any, nbytes: int, count: int = 4) -> None:
        self.rt = rt
        self.bufs = [rt.alloc_host(nbytes) for _ in range(count)]
        self.events: list[Any] = [None] * count
        self.next = 0

    def take(self) -> tuple[int, np.ndarray]:
        i = self.next
        self.next = (i + 1) % len(self.bufs)
        if self.events[i] is not None:
            self.rt.wait_host(self.events[i])
            self.events[i] = None
        return i, self.bufs[i]


@dataclass(frozen=True)
class ExpertSource:
    """One expert weight tensor of a GGUF file as the expert kernels read it: `expert(e)` is expert e's bytes
    (uint8, `nbytes` of them) in the plans' storage layout, for a slot buffer of IR dtype `dtype`. Where the plans
    keep the file's layout (`mapped`) that is a view of the mmapped file, read only when it is copied; otherwise a
    copy made on each call (rows repacked: sliced or padded; or dequantized to f32), never the whole tensor."""

    nbytes: int
    dtype: str
    mapped: bool
    expert: Callable[[int], np.ndarray]


def expert_source(file: Any, spec: Any) -> ExpertSource:
    """The `ExpertSource` of plan buffer `spec` (a `BufferSpec` of an expert weight) in GGUF file `file`."""
    info = file.tensors[spec.name]
    raw = file.raw(spec.name)  # [n_expert, rows, row bytes], a view of the mapping
    if spec.dtype == "f32":
        def expert(e: int) -> np.ndarray:
            values = dequantize(info.fmt, raw[e].reshape(-1), info.shape[1:])
            return np.ascontiguousarray(values, np.float32).reshape(-1).view(np.uint8)
        mapped = False
    elif spec.fmt.name == info.fmt.name:
        def expert(e: int) -> np.ndarray:
            return raw[e].reshape(-1)
        mapped = True
    else:
        def expert(e: int) -> np.ndarray:
            return repack(raw[e], info.fmt, spec.fmt)
        mapped = False
    return ExpertSource(int(expert(0).nbytes), spec.dtype, mapped, expert)


@dataclass
class _Layer:
    stream: Any  # codegen.recipes.ExpertStream
    host: list[ExpertSource]  # per weight
    cache: ExpertCache
    table_handle: Any
    device: list[Any] = field(default_factory=list)  # per weight: the slot buffer
    pinned: list[np.ndarray] | None = None  # per weight: [n_expert, bytes of one expert] in pinned host memory
    views: list[Any] | None = None  # per weight: `pinned` as the device's kernels read it (`Runtime.device_view`)
    router: np.ndarray | None = None  # [n_expert, n_embd] f32, for predictive policies
    pending: list[Any] = field(default_factory=list)  # prefetch events the next use must wait for
    stale: bool = True  # the device's slot table differs from the cache's


class ExpertStreamer:
    """Expert residency for an executor: every MoE layer's experts in host memory, a device cache of `slots`
    experts per layer, the slot tables, and the uploads between them, copied on the runtime's second queue.

    Where the streamed experts take at most half the host's available memory, they are copied once, expert by
    expert, into pinned host memory (`Runtime.alloc_host`) and every upload reads them there; otherwise each
    upload is copied through a ring of pinned buffers straight from its `ExpertSource` (the mmapped file, or one
    expert repacked), so host memory holds no copy of the experts beyond the file's pages. Statistics accumulate
    in `stats`."""

    def __init__(self, rt: Any, sources: Callable[[str], ExpertSource], streams: list[Any], slots: int,
                 policy: str = "lru", routers: Mapping[str, np.ndarray] | None = None,
                 log: Callable[[str], None] | None = None, pin: bool | None = None) -> None:
        """`sources(name)`: the `ExpertSource` of an expert weight tensor. `streams`: one `ExpertStream` per MoE
        layer, in layer order. `routers`: gate weight name -> the layer's router weights (f32 [n_expert,
        n_embd]), for predictive policies. `pin`: keep the experts in pinned host memory (default: where they
        take at most half the available host memory)."""
        cls = policy_class(policy)
        self.rt = rt
        self.policy = cls.name
        self.stats = CacheStats()
        self.log = log or (lambda _msg: None)
        self.layers: list[_Layer] = []
        self.planned_slots = slots
        for st in streams:
            cache = ExpertCache(st.n_expert, slots, cls(st.n_expert), self.stats)
            router = routers.get(st.weights[0]) if routers and cls.predicts else None
            layer = _Layer(st, [sources(w) for w in st.weights], cache, rt.alloc((st.state.size,), "i32"),
                           router=router)
            self._alloc_slots(layer, slots)
            self.layers.append(layer)
        total = sum(src.nbytes * la.stream.n_expert for la in self.layers for src in la.host)
        if pin is None:
            host = host_memory()
            pin = host is not None and total <= host[0] // 2
        self.staging: _Staging | None = None
        if pin:
            for layer in self.layers:
                layer.pinned = [self._pinned(src, layer.stream.n_expert) for src in layer.host]
                if layer.stream.host and not cls.predicts:
                    views = [rt.device_view(p.reshape(-1), src.dtype) for p, src in zip(layer.pinned, layer.host)]
                    layer.views = views if all(v is not None for v in views) else None
        else:
            self.staging = _Staging(rt, max((src.nbytes for la in self.layers for src in la.host), default=1))
        # Which side holds the caches' current state: the host (`ExpertCache`, host-resolved steps) or the device
        # (the state buffers, after device-resolved steps); `to_host` / `to_device` hand it over.
        self.on_device = False
        self.tokens = 0  # tokens stepped, for per-token statistics
        self.device_tokens = 0  # of which resolved on the device
        self._waits: list[tuple[Any, Any]] = []  # device marks around the compute queue's waits on uploads

    def _pinned(self, src: ExpertSource, n_expert: int) -> np.ndarray:
        out = self.rt.alloc_host(src.nbytes * n_expert).reshape(n_expert, src.nbytes)
        for e in range(n_expert):  # one expert at a time: no copy of the whole tensor on the way
            out[e] = src.expert(e)
        return out

    @property
    def slots(self) -> int:
        return self.layers[0].cache.slots if self.layers else 0

    def _alloc_slots(self, layer: _Layer, slots: int) -> None:
        layer.device = [self.rt.alloc((max(slots, 1) * src.nbytes // DTYPE_BYTES[src.dtype],), src.dtype)
                        for src in layer.host]
        # A new buffer's zero fill is queued on the compute queue; uploads go on the copy queue, which is not
        # ordered with it: the fill must have landed before the first upload, or it could overwrite that upload.
        self.rt.sync()

    def _free_slots(self, layer: _Layer) -> None:
        for buf in layer.device:
            self.rt.free(buf)
        layer.device = []

    def handles(self) -> dict[str, Any]:
        """Plan buffer name -> device handle, for the expert weights (slot buffers), the caches' states (slot
        tables) and, where the device reads them in place, the experts in host memory."""
        out = {}
        for layer in self.layers:
            out[layer.stream.slots] = layer.table_handle
            out.update(zip(layer.stream.weights, layer.device))
            if layer.views is not None:
                out.update(zip(layer.stream.host, layer.views))
        return out

    def resolves_on_device(self, t: int) -> bool:
        """Whether a step of `t` tokens of a plan with resolve kernels can make its experts resident on the device
        (one-token steps, every layer's experts in host memory the device reads, slots for a token's experts)."""
        return t == 1 and all(la.views is not None and la.cache.slots >= la.stream.k for la in self.layers)

    def to_device(self) -> None:
        """Before a device-resolved step: the caches' state into their state buffers, if the host has it."""
        if not self.on_device:
            for layer in self.layers:
                self.rt.write(layer.table_handle, layer.cache.state(layer.stream.k))
                layer.stale = False
            self.on_device = True

    def to_host(self) -> None:
        """Before a host-resolved step, a resize or statistics: the caches' state back from the device, if it has
        it (its counters added to the statistics)."""
        if self.on_device:
            for layer in self.layers:
                st = layer.stream
                self._count_uploads(layer, layer.cache.load_state(
                    self.rt.download(layer.table_handle, (st.state.size,), "i32"), st.k))
            self.on_device = False

    def layer_of(self, stream: Any) -> int:
        return next(i for i, la in enumerate(self.layers) if la.stream.weights == stream.weights)

    def _upload(self, layer: _Layer, loads: list[tuple[int, int]]) -> list[Any]:
        events = []
        for e, slot in loads:
            for w, (src, dev) in enumerate(zip(layer.host, layer.device)):
                nb = src.nbytes
                if layer.pinned is not None:
                    ev = self.rt.copy_async(dev, slot * nb, layer.pinned[w][e])
                else:
                    i, stage = self.staging.take()
                    stage[:nb] = src.expert(e)
                    ev = self.rt.copy_async(dev, slot * nb, stage[:nb])
                    self.staging.events[i] = ev
                if ev is not None:
                    events.append(ev)
        self._count_uploads(layer, len(loads))
        return events

    def _count_uploads(self, layer: _Layer, n: int) -> None:
        """Statistics of `n` experts of `layer` sent over the host link (by the host, or by a fill kernel)."""
        self.stats.uploads += n
        self.stats.link_bytes += n * sum(src.nbytes for src in layer.host)

    def load(self, li: int, experts: list[int]) -> None:
        """Make `experts` of layer `li` resident for the launches that follow on the compute queue: upload the
        misses, have the compute queue wait for them, update the slot table. The host goes on queueing meanwhile;
        the time the device waits counts as stall (two marks around the wait, read by `settle` after the step).
        Targets without a device clock wait on the host instead, timed there."""
        layer = self.layers[li]
        loads = layer.cache.request(experts)
        layer.stale |= bool(loads)
        if loads:
            events = self._upload(layer, loads)
            before = self.rt.mark()
            if before is None:
                t0 = time.perf_counter()
                for ev in events:
                    self.rt.wait_host(ev)
                self.stats.stall_s += time.perf_counter() - t0
            else:
                for ev in events:
                    self.rt.wait_for(ev)
                self._waits.append((before, self.rt.mark()))
        for ev in layer.pending:  # prefetches into this layer: the kernels must see them complete
            self.rt.wait_for(ev)
        layer.pending = []
        if layer.stale:  # a decode step whose experts all hit writes nothing
            self.rt.write(layer.table_handle, layer.cache.state(layer.stream.k))
            layer.stale = False

    def settle(self) -> None:
        """Count the device's waits on uploads since the last call as stall (once the step's work is done: the
        marks are then read without waiting)."""
        for before, after in self._waits:
            self.stats.stall_s += self.rt.elapsed(before, after) or 0.0
        self._waits = []

    def predicts_after(self, li: int) -> int:
        """With a predictive policy, the width of the hidden state layer li+1's router takes (0: no prediction)."""
        if li + 1 >= len(self.layers) or self.layers[li + 1].router is None:
            return 0
        return int(self.layers[li + 1].router.shape[1])

    def predict(self, li: int, x: np.ndarray) -> None:
        """With a predictive policy: start uploading the experts layer li+1's router picks for `x` (layer li's MoE
        input, one token), to overlap with layer li's expert kernels."""
        if li + 1 >= len(self.layers):
            return
        nxt = self.layers[li + 1]
        if nxt.router is None:
            return
        logits = nxt.router @ x.reshape(-1)
        picks = [int(e) for e in np.argsort(-logits, kind="stable")[: nxt.stream.k]]
        # The slot table is written when layer li+1 loads its routed experts, after these copies are waited for.
        loads = nxt.cache.prefetch(picks)
        nxt.stale |= bool(loads)
        nxt.pending += self._upload(nxt, loads)

    def resize(self, slots: int) -> dict[str, Any]:
        """Change every layer's cache to `slots` slots (new slot buffers; the most valuable experts re-uploaded),
        returning the new handles to bind. Every old slot buffer is freed before the first new one is allocated,
        so the device never holds both caches (the launches bound to the old buffers run no more: the caller
        rebinds them before the next step)."""
        self.to_host()
        self.rt.sync()
        for layer in self.layers:
            for ev in layer.pending:  # prefetches still copying into the buffers about to go
                self.rt.wait_host(ev)
            layer.pending = []
            self._free_slots(layer)
        for layer in self.layers:
            keep = layer.cache.resize(slots)
            self._alloc_slots(layer, slots)
            for ev in self._upload(layer, layer.cache.prefetch(keep)):
                self.rt.wait_host(ev)
            self.rt.write(layer.table_handle, layer.cache.state(layer.stream.k))
        return self.handles()

    def reset_stats(self) -> None:
        """Start counting afresh (a benchmark's timed runs)."""
        self.to_host()  # the device's counts so far belong to the old statistics
        self.stats = CacheStats()
        self.tokens = 0
        self.device_tokens = 0
        for layer in self.layers:
            layer.cache.stats = self.stats

    def summary(self) -> dict[str, Any]:
        """`bench --json`'s "experts" object. Stall is measured for host-resolved tokens only (a device-resolved
        step copies its misses inside its own kernels, which its time includes): null when every token was
        resolved on the device, whose share `device_resolved` gives."""
        self.to_host()
        n = max(self.tokens, 1)
        hr = self.stats.hit_rate
        host = self.tokens - self.device_tokens
        return {"policy": self.policy, "slots": self.slots, "hit_rate": None if hr is None else round(hr, 4),
                "link_bytes_per_token": round(self.stats.link_bytes / n, 1),
                "stall_ms_per_token": round(1e3 * self.stats.stall_s / host, 4) if host else None,
                "device_resolved": round(self.device_tokens / n, 4)}


# --- the VRAM guard ----------------------------------------------------------------------------------------------


def vram_guard(plan: MemoryPlan, info: tuple[int, int] | None, explicit: bool) -> VRAMGuard | None:
    """The VRAM guard of a streaming `plan`, from the device's (free, total) memory `info` read before anything
    was uploaded: low-water mark at the margin the default budget leaves free (`margin`), high-water mark at twice
    it. An `explicit` budget (`--gpu-mem`) may leave less free than the margin: then the marks are half and all of
    what it leaves (free memory less the budget), so the guard does not shrink the cache at once, only when
    another process takes half of that. None where the device does not report its memory, or the budget leaves
    nothing free to watch."""
    if info is None or plan.budget is None:
        return None
    free, total = info
    low = margin(total)
    if explicit:
        low = min(low, (free - plan.budget) // 2)
    return VRAMGuard(low, 2 * low) if low > 0 else None


class VRAMGuard:
    """Watches free device memory between steps (read after a stream sync): two consecutive readings below `low`
    bytes ask the expert cache to shrink; `patience` consecutive readings above `high` (> `low`: hysteresis) ask
    it to grow back. `reading` returns -1 (shrink), +1 (grow) or 0."""

    def __init__(self, low: int, high: int, patience: int = 4) -> None:
        if high <= low:
            raise ValueError("the high-water mark must lie above the low-water mark")
        self.low, self.high, self.patience = low, high, patience
        self.n_low = self.n_high = 0

    def reading(self, free: int) -> int:
        self.n_low = self.n_low + 1 if free < self.low else 0
        self.n_high = self.n_high + 1 if free > self.high else 0
        if self.n_low >= 2:
            self.n_low = 0
            return -1
        if self.n_high >= self.patience:
            self.n_high = 0
            return 1
        return 0


def guard_step(streamer: ExpertStreamer, guard: VRAMGuard, free: int, log: Callable[[str], None]) -> int | None:
    """Apply one free-memory reading: the new slot count per layer when the cache is to change, else None.
    Shrinking frees enough slots to lift free memory back over the low-water mark (at least one, never the last);
    growing adds one slot per layer at a time, up to the planned size."""
    move = guard.reading(free)
    slots = streamer.slots
    per_slot = sum(src.nbytes for la in streamer.layers for src in la.host)
    if move < 0 and slots > 1:
        drop = max(1, math.ceil((guard.low - free) / max(per_slot, 1)))
        new = max(1, slots - drop)
        log(f"vram guard: {fmt_bytes(free)} free (low-water {fmt_bytes(guard.low)}): expert cache {slots} -> {new} "
            "slots per layer")
        return new
    if move > 0 and slots < streamer.planned_slots:
        log(f"vram guard: {fmt_bytes(free)} free (high-water {fmt_bytes(guard.high)}): expert cache {slots} -> "
            f"{slots + 1} slots per layer")
        return slots + 1
    return None

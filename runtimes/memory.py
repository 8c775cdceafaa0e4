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

from polystrata.errors import PolystrataError
from polystrata.ir.graph import Graph
from polystrata.ir.kernel import DTYPE_BYTES
from polystrata.runtimes.base import host_memory

# What the default budget leaves free on the device (other processes, the driver's own allocations): the larger
# of this many bytes (a quarter of the device at most) and this fraction of the device's memory. It is also the VRAM
# guard's low-water mark.
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
    """The device's free memory at start less a margin; None where the runtime does not report it, and on the
    cpu target (host memory is its device memory: nothing is planned there)."""
    if runtime is None or runtime.name == "cpu":
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
        lines.append(f"  scratch: {fmt_bytes(self.scratch_bytes)}")
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
    scratch = 0
    for plan in plans.values():
        for name, spec in plan.buffers.items():
            if spec.kind == "weight":
                weights[name] = _nbytes(spec)
            elif spec.kind in ("kv", "input", "state"):
                shared[name] = (spec.kind, _nbytes(spec))
            elif spec.kind == "activation":  # each plan's own (slot tables: counted below, with the cache)
                scratch += _nbytes(spec)
    kv_bytes = sum(nb for kind, nb in shared.values() if kind == "kv")
    # Recurrent states do not grow with the context: counted with the fixed buffers.
    scratch += sum(nb for kind, nb in shared.values() if kind in ("input", "state"))
    expert_names = {w for la in layers for w in la.weights}
    n_expert = max((la.n_expert for la in layers), default=0)
    expert_bytes = max((sum(weights[w] for w in la.weights) // la.n_expert for la in layers), default=0)
    all_experts = sum(weights[w] for w in expert_names)
    other = sum(b for w, b in weights.items() if w not in expert_names)
    fixed = other + kv_bytes + scratch
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
        slots = max(budget - fixed - len(layers) * n_expert * 4, 0) // (expert_bytes * len(layers))
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
        plan.scratch_bytes += len(layers) * n_expert * 4  # the slot tables
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


def fit_context(plan: MemoryPlan, n_ctx: int) -> int:
    """The default context: `n_ctx`, reduced where the budget cannot hold its KV cache beside the weights, the
    scratch buffers of `plan` (made at context `plan.n_ctx`) and the smallest expert cache (one slot a layer).
    Where not even one token fits, `n_ctx` (`plan_memory` then says what does not fit)."""
    if plan.budget is None or plan.kv_bytes == 0:
        return n_ctx
    per_token = plan.kv_bytes / max(plan.n_ctx, 1)
    layer_expert = plan.expert_bytes * plan.expert_layers
    others = plan.weight_bytes - (0 if plan.streaming else layer_expert * plan.n_expert) + plan.scratch_bytes
    fits = int((plan.budget - others - layer_expert) // per_token)
    return min(n_ctx, fits) if fits >= 1 else n_ctx


def fit_plans(
    file: Any, graphs: list[Graph], steps: dict[int, int], runtime: Any, n_ctx: int | None, n_ctx_train: int,
    kv_type: str, gpu_mem: str | None, expert_slots: int | None, default_ctx: int,
) -> tuple[dict[int, Any], MemoryPlan]:
    """Plans of `graphs` (`compile_plans`) that fit the device-memory budget, and their memory plan. `n_ctx` None:
    min(n_ctx_train, default_ctx), reduced to what the budget holds (`fit_context`, with a line on stderr). The
    default stays below the trained context because the attention kernels keep a step's scores in local memory
    sized by the context (`codegen/recipes/attention.py`): a 128K context would not fit a GPU's shared memory.
    The plans are made for streaming where the experts do not all fit. Raises PolystrataError, before anything
    is uploaded, when the budget cannot hold the model."""
    import sys

    from polystrata.compiler import compile_plans

    budget = resolve_budget(runtime, gpu_mem)
    layers = moe_layers(graphs[0])
    opts = {"stream": runtime.name != "cpu",  # host memory is the cpu target's device memory: experts stay resident
            "kv_type": kv_type, "expert_slots": expert_slots}
    reduced = False
    if n_ctx is None:
        n_ctx = min(n_ctx_train, default_ctx)
        if budget is not None:
            sizing = plan_memory(compile_plans(file, graphs, runtime, n_ctx, kv_type, steps), layers, n_ctx, budget,
                                 check=False, **opts)
            fitted = fit_context(sizing, n_ctx)
            reduced, n_ctx = fitted < n_ctx, fitted
    plans = compile_plans(file, graphs, runtime, n_ctx, kv_type, steps)
    flag = "--gpu-mem" if gpu_mem is not None else "the free device memory less a margin,"
    memory = plan_memory(plans, layers, n_ctx, budget, budget_flag=flag, **opts)
    if reduced:
        print(f"context: {n_ctx} tokens (the model's is {n_ctx_train}): what the device-memory budget "
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

    def table(self) -> np.ndarray:
        """The slot table the expert kernels read: each expert's slot (0 for experts not resident, which no
        kernel reads: only routed experts are listed, and they are resident)."""
        return np.maximum(self.slot_of, 0).astype(np.int32)


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


@dataclass
class _Layer:
    stream: Any  # codegen.recipes.ExpertStream
    host: list[np.ndarray]  # per weight: [n_expert, bytes of one expert] in the plans' storage layout
    cache: ExpertCache
    table_handle: Any
    device: list[Any] = field(default_factory=list)  # per weight: the slot buffer
    router: np.ndarray | None = None  # [n_expert, n_embd] f32, for predictive policies
    pending: list[Any] = field(default_factory=list)  # prefetch events the next use must wait for
    stale: bool = True  # the device's slot table differs from the cache's


class ExpertStreamer:
    """Expert residency for an executor: host copies of every MoE layer's experts, a device cache of `slots`
    experts per layer, the slot tables, and the uploads between them, copied on the runtime's second queue.

    Where the streamed experts take at most half the host's available memory, they are copied once into pinned
    host memory (`Runtime.alloc_host`) and every upload reads them there; otherwise each upload is copied through
    a ring of pinned buffers from `host_experts`' arrays (views of the mmapped file where the plans keep the file's
    layout, host copies where the target repacks it: sliced or padded rows). Statistics accumulate in `stats`."""

    def __init__(self, rt: Any, host_experts: Callable[[str], np.ndarray], streams: list[Any], slots: int,
                 policy: str = "lru", routers: Mapping[str, np.ndarray] | None = None,
                 log: Callable[[str], None] | None = None, dtypes: Mapping[str, str] | None = None,
                 pin: bool | None = None) -> None:
        """`host_experts(name)`: an expert weight tensor as uint8 bytes in the plans' storage layout,
        [n_expert, bytes per expert]. `streams`: one `ExpertStream` per MoE layer, in layer order. `routers`:
        gate weight name -> the layer's router weights (f32 [n_expert, n_embd]), for predictive policies.
        `dtypes`: the IR dtype of each expert weight's buffer (default u8: quantized bytes). `pin`: keep the
        experts in pinned host memory (default: where they take at most half the available host memory)."""
        cls = policy_class(policy)
        self.rt = rt
        self.policy = cls.name
        self.stats = CacheStats()
        self.log = log or (lambda _msg: None)
        self.layers: list[_Layer] = []
        self.planned_slots = slots
        self.dtypes = dict(dtypes or {})
        biggest = 1
        for st in streams:
            host = [np.ascontiguousarray(host_experts(w)).reshape(st.n_expert, -1) for w in st.weights]
            biggest = max(biggest, *(h.shape[1] for h in host))
            cache = ExpertCache(st.n_expert, slots, cls(st.n_expert), self.stats)
            router = routers.get(st.weights[0]) if routers and cls.predicts else None
            layer = _Layer(st, host, cache, rt.alloc((st.n_expert,), "i32"), router=router)
            self._alloc_slots(layer, slots)
            self.layers.append(layer)
        total = sum(h.nbytes for layer in self.layers for h in layer.host)
        if pin is None:
            host = host_memory()
            pin = host is not None and total <= host[0] // 2
        self.staging: _Staging | None = None
        if pin:
            for layer in self.layers:
                layer.host = [self._pinned(h) for h in layer.host]
        else:
            self.staging = _Staging(rt, biggest)
        self.tokens = 0  # tokens stepped, for per-token statistics

    def _pinned(self, h: np.ndarray) -> np.ndarray:
        out = self.rt.alloc_host(h.nbytes).reshape(h.shape)
        out[:] = h
        return out

    @property
    def slots(self) -> int:
        return self.layers[0].cache.slots if self.layers else 0

    def _alloc_slots(self, layer: _Layer, slots: int) -> None:
        for buf in layer.device:
            self.rt.free(buf)
        layer.device = []
        for name, h in zip(layer.stream.weights, layer.host):
            dtype = self.dtypes.get(name, "u8")
            layer.device.append(self.rt.alloc((max(slots, 1) * h.shape[1] // DTYPE_BYTES[dtype],), dtype))

    def handles(self) -> dict[str, Any]:
        """Plan buffer name -> device handle, for the expert weights (slot buffers) and the slot tables."""
        out = {}
        for layer in self.layers:
            out[layer.stream.slots] = layer.table_handle
            out.update(zip(layer.stream.weights, layer.device))
        return out

    def layer_of(self, stream: Any) -> int:
        return next(i for i, la in enumerate(self.layers) if la.stream.weights == stream.weights)

    def _upload(self, layer: _Layer, loads: list[tuple[int, int]]) -> list[Any]:
        events = []
        for e, slot in loads:
            for h, dev in zip(layer.host, layer.device):
                nb = h.shape[1]
                if self.staging is None:  # pinned already
                    ev = self.rt.copy_async(dev, slot * nb, h[e])
                else:
                    i, stage = self.staging.take()
                    stage[:nb] = h[e]
                    ev = self.rt.copy_async(dev, slot * nb, stage[:nb])
                    self.staging.events[i] = ev
                if ev is not None:
                    events.append(ev)
                self.stats.link_bytes += nb
            self.stats.uploads += 1
        return events

    def load(self, li: int, experts: list[int]) -> None:
        """Make `experts` of layer `li` resident for the launches that follow on the compute queue: upload the
        misses, wait for them (the time counts as stall), update the slot table."""
        layer = self.layers[li]
        loads = layer.cache.request(experts)
        layer.stale |= bool(loads)
        if loads:
            events = self._upload(layer, loads)
            t0 = time.perf_counter()
            for ev in events:
                self.rt.wait_host(ev)
            self.stats.stall_s += time.perf_counter() - t0
        for ev in layer.pending:  # prefetches into this layer: the kernels must see them complete
            self.rt.wait_for(ev)
        layer.pending = []
        if layer.stale:  # a decode step whose experts all hit writes nothing
            self.rt.write(layer.table_handle, layer.cache.table())
            layer.stale = False

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
        returning the new handles to bind."""
        self.rt.sync()
        for layer in self.layers:
            for ev in layer.pending:  # prefetches still copying into the buffers about to go
                self.rt.wait_host(ev)
            keep = layer.cache.resize(slots)
            layer.pending = []
            self._alloc_slots(layer, slots)
            for ev in self._upload(layer, layer.cache.prefetch(keep)):
                self.rt.wait_host(ev)
            self.rt.write(layer.table_handle, layer.cache.table())
        return self.handles()

    def reset_stats(self) -> None:
        """Start counting afresh (a benchmark's timed runs)."""
        self.stats = CacheStats()
        self.tokens = 0
        for layer in self.layers:
            layer.cache.stats = self.stats

    def summary(self) -> dict[str, Any]:
        """`bench --json`'s "experts" object."""
        n = max(self.tokens, 1)
        hr = self.stats.hit_rate
        return {"policy": self.policy, "slots": self.slots, "hit_rate": None if hr is None else round(hr, 4),
                "link_bytes_per_token": round(self.stats.link_bytes / n, 1),
                "stall_ms_per_token": round(1e3 * self.stats.stall_s / n, 4)}


# --- the VRAM guard ----------------------------------------------------------------------------------------------


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
    per_slot = sum(h.shape[1] for la in streamer.layers for h in la.host)
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

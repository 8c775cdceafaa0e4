"""The memory manager (runtimes/memory.py): budgets, the memory plan, expert streaming through slot tables on the
opencl target (PoCL keeps device buffers apart from host arrays), the expert cache's policies and statistics, the
VRAM guard, and the cpu target left as it was. One tiny MoE (2 layers, 8 experts, top-2), shared by the module."""

from __future__ import annotations

import os

import numpy as np
import pytest
import yaml
from ir_constructs import copy_region_check, expert_cache_resize_check

from polystrata.errors import PolystrataError
from polystrata.runtimes.memory import (
    POLICIES,
    CacheStats,
    ExpertCache,
    LFUPolicy,
    LRUPolicy,
    PrefetchPolicy,
    VRAMGuard,
    expert_source,
    fit_plans,
    fmt_bytes,
    margin,
    parse_gpu_mem,
    plan_memory,
    shared_scratch,
    vram_guard,
)
from polystrata.synth import synth_model

# The kernel target the engine tests run on: opencl (PoCL in CI); scripts/device_check.sh also runs them on cuda.
TARGET = os.environ.get("POLYSTRATA_MEMORY_TARGET", "opencl")
pytestmark = pytest.mark.target(TARGET)

PROMPT = list(range(5, 40))  # 35 tokens: a prefill step routes to every expert, more than the cache holds
DECODE = [7, 9, 300, 11]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return synth_model("qwen3moe", tmp_path_factory.mktemp("m") / "moe.gguf", preset="tiny", qtype="Q8_0")


@pytest.fixture(scope="module")
def kernel_target():
    """The kernel target is present (else the module's engine tests skip)."""
    from polystrata.targets import make_runtime

    try:
        make_runtime(TARGET)
    except PolystrataError as e:
        pytest.skip(str(e))


def _engine(path, **kw):
    from polystrata.engine import Engine

    return Engine(path, target=TARGET, n_ctx=64, all_logits=True, **kw)  # `_outputs` reads the prompt's every row


def _outputs(eng) -> list[np.ndarray]:
    """Prefill logits of every prompt token, then the logits of each decode step."""
    eng.reset()
    out = [eng.forward(PROMPT, all_logits=True)]
    out += [eng.forward([t]) for t in DECODE]
    return out


@pytest.fixture(scope="module")
def resident(moe, kernel_target):
    eng = _engine(moe)
    return eng, _outputs(eng)


# --- budgets and the plan ----------------------------------------------------------------------------------------


def test_parse_gpu_mem():
    assert parse_gpu_mem("8G", None) == 8 << 30
    assert parse_gpu_mem("512M", None) == 512 << 20
    assert parse_gpu_mem("1.5g", None) == 3 << 29
    assert parse_gpu_mem("64KiB", None) == 64 << 10
    assert parse_gpu_mem("1000", None) == 1000
    assert parse_gpu_mem("50%", 1000) == 500
    for bad, free in (("lots", 10), ("0", 10), ("150%", 10), ("50%", None), ("-3G", 10)):
        with pytest.raises(PolystrataError, match="--gpu-mem"):
            parse_gpu_mem(bad, free)


def test_plan_resident_when_experts_fit(resident):
    eng, _ = resident
    mem = eng.memory
    assert not mem.streaming and mem.slots == mem.n_expert == 8 and mem.expert_layers == 2
    assert eng.executor.streamer is None
    assert all(not p.expert_streams for p in eng.executor.plans.values())
    # KV bytes come from the plans' KV buffers: 2 layers x (K, V) x 64 rows x 2 heads x 32 values x f16.
    assert mem.kv_bytes == 2 * 2 * 64 * 2 * 32 * 2
    assert any("all 8 experts" in line for line in mem.describe())


def test_budget_decides_the_slots(moe, resident):
    eng, want = resident
    mem = eng.memory
    # Room for everything but the experts, the slot tables and one expert of each layer, with half an expert spare.
    budget = mem.total - mem.expert_bytes * 2 * 8 + 2 * 8 * 4 + 2 * mem.expert_bytes + mem.expert_bytes // 2
    small = _engine(moe, gpu_mem=str(budget))
    assert small.memory.streaming and small.memory.slots == 1 and small.memory.total <= budget
    got = _outputs(small)
    assert all(np.array_equal(a, b) for a, b in zip(got, want))


def test_default_context_reduced_to_the_budget(moe, kernel_target, capsys):
    """Without --ctx: min(trained, 4096) = 2048 tokens here, unless the budget cannot hold their KV cache beside
    the weights and one expert slot a layer; then fewer, said on stderr."""
    from polystrata.engine import Engine

    full = Engine(moe, target=TARGET).memory
    assert full.n_ctx == 2048 and not full.streaming
    budget = full.total - full.expert_bytes * 2 * (8 - 1) + 2 * 8 * 4 - full.kv_bytes // 2
    capsys.readouterr()
    eng = Engine(moe, target=TARGET, gpu_mem=str(budget))
    assert 512 < eng.n_ctx < 2048 and eng.memory.n_ctx == eng.n_ctx and eng.memory.total <= budget
    assert eng.memory.streaming and eng.executor.n_ctx == eng.n_ctx
    assert f"context: {eng.n_ctx} tokens (the model's is 2048)" in capsys.readouterr().err


def test_over_budget_fails_before_any_upload(moe, kernel_target, monkeypatch):
    from polystrata.targets import make_runtime

    def no_upload(*_a, **_k):
        raise AssertionError("uploaded before the budget was checked")

    monkeypatch.setattr(type(make_runtime(TARGET)), "upload", no_upload)
    with pytest.raises(PolystrataError, match=r"--gpu-mem 1\.0 MiB does not hold the model .*KV cache"):
        _engine(moe, gpu_mem="1M")
    with pytest.raises(PolystrataError, match="too small: weights"):
        _engine(moe, gpu_mem="1M", expert_slots=8)


def test_cli_over_budget_is_one_line(moe, kernel_target, capsys):
    from polystrata.cli import main

    assert main(["run", str(moe), "--target", TARGET, "--gpu-mem", "2M", "-n", "1", "-p", "hi"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --gpu-mem 2.0 MiB does not hold the model")


def _fit(path, rt, n_ctx_train, gpu_mem=None, expert_slots=None):
    """`fit_plans` of the model's graphs (as `score`'s engine has them: all logits, last logits, one-token steps)
    with no context given: the plans (IR only, nothing compiled) and the memory plan."""
    from polystrata.engine import tensor_table
    from polystrata.gguf import GGUFFile
    from polystrata.models import build_graph

    with GGUFFile(path) as f:
        graphs = [build_graph(f.metadata, tensor_table(f), all_logits=a) for a in (True, False, False)]
        return fit_plans(f, graphs, {id(graphs[2]): 1}, rt, None, n_ctx_train, "f16", gpu_mem, expert_slots)


def test_cpu_target_unaffected(moe):
    """Host memory is the cpu target's device memory: experts resident, the same plans as before; the budget,
    the host's available memory less a margin, only sizes the default context."""
    from polystrata.compiler import compile_plans
    from polystrata.engine import tensor_table
    from polystrata.gguf import GGUFFile
    from polystrata.models import build_graph
    from polystrata.runtimes.base import host_memory
    from polystrata.runtimes.cpu import CPURuntime

    rt = CPURuntime()
    with GGUFFile(moe) as f:
        graphs = [build_graph(f.metadata, tensor_table(f), all_logits=a) for a in (True, False)]
        steps = {id(graphs[1]): 1}
        plans, mem = fit_plans(f, graphs, steps, rt, None, 2048, "f16", None, 1)
        before = compile_plans(f, graphs, rt, 2048, "f16", steps)
    total = host_memory()[1]  # what is available changes from one reading to the next on a shared machine
    assert 0 < mem.budget <= total - margin(total) and not mem.streaming and mem.n_ctx == 2048
    for g in graphs:
        assert [la.kernel.fingerprint() for la in plans[id(g)].launches] == \
               [la.kernel.fingerprint() for la in before[id(g)].launches]


def test_default_context_is_the_models(moe, kernel_target):
    """Without --ctx the context is the model's (here said to be 64K tokens), its KV cache within the budget; the
    attention kernels' local memory does not grow with it."""
    from polystrata.targets import make_runtime

    plans, mem = _fit(moe, make_runtime(TARGET), 65536)
    assert mem.n_ctx == 65536 and mem.kv_bytes == 2 * 2 * 65536 * 2 * 32 * 2
    for plan in plans.values():
        for la in plan.launches:
            if la.kernel.name.startswith("attn_f16"):
                assert sum(a.size for a in la.kernel.local if a.name == "s") * 4 <= 16 << 10


def test_default_context_on_the_cpu_is_what_host_memory_holds(moe, capsys, monkeypatch):
    """On the cpu target the host's available memory less a margin sizes the default context, with one line on
    stderr when it is reduced; a host too small for the model is no error there (the file is mmapped), unless
    --gpu-mem says so."""
    from polystrata.runtimes.cpu import CPURuntime

    rt = CPURuntime()
    full = _fit(moe, rt, 65536)[1]
    assert full.n_ctx == 65536
    per_token = full.kv_bytes // 65536
    host = full.total - full.kv_bytes + 1000 * per_token + margin(16 << 30)  # room for 1000 tokens of KV
    monkeypatch.setattr(rt, "memory_info", lambda: (host, 16 << 30))
    capsys.readouterr()
    mem = _fit(moe, rt, 65536)[1]
    assert 900 < mem.n_ctx <= 1000 and mem.total <= mem.budget
    assert capsys.readouterr().err.splitlines() == [
        f"context: {mem.n_ctx} tokens (the model's is 65536): what the host-memory budget "
        f"{fmt_bytes(mem.budget)} holds beside the weights"]
    monkeypatch.setattr(rt, "memory_info", lambda: (1 << 20, 16 << 30))
    assert _fit(moe, rt, 2048)[1].n_ctx == 2048  # nothing fits: no error, the model's context
    with pytest.raises(PolystrataError, match=r"--gpu-mem 1\.0 MiB is too small: weights"):
        _fit(moe, rt, 2048, gpu_mem="1M")


# --- streaming: bit-identical logits for every policy ---------------------------------------------------------


@pytest.mark.parametrize("slots", [1, 2])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_streaming_matches_resident(moe, resident, policy, slots):
    _, want = resident
    eng = _engine(moe, expert_slots=slots, expert_policy=policy)
    st = eng.executor.streamer
    assert eng.memory.streaming and st.slots == slots
    assert st.staging is None  # the tiny model's experts are copied into pinned host memory once
    got = _outputs(eng)
    for i, (a, b) in enumerate(zip(got, want)):
        assert np.array_equal(a, b), f"step {i} differs"
    s = st.stats
    assert s.requests > s.hits and s.uploads >= s.requests - s.hits and s.link_bytes > 0
    per_expert = sum(src.nbytes for src in st.layers[0].host)
    assert s.link_bytes == s.uploads * per_expert
    summary = st.summary()
    assert summary["policy"] == policy and summary["slots"] == slots
    assert 0 <= summary["hit_rate"] < 1 and summary["link_bytes_per_token"] > 0
    if policy == "prefetch":
        assert s.prefetches > 0  # layer 1's experts predicted at layer 0 of each decode step


class _Mark:
    """A device mark for a target without a clock (`Runtime.mark`): 1 ms after any earlier one."""

    def seconds_since(self, start) -> float:
        return 1e-3


@pytest.mark.parametrize("policy", ["lru", "prefetch"])
def test_uploads_waited_for_on_the_device(moe, resident, monkeypatch, policy):
    """Where the target has device marks (cuda), the compute queue waits for a layer's uploads (`wait_for`) while
    the host goes on, and the wait's marks count as stall after the step (`ExpertStreamer.settle`): forced here
    with marks that read 1 ms each (opencl's compute queue then waits on the copies' events), the logits are the
    resident run's, bit for bit."""
    _, want = resident
    eng = _engine(moe, expert_slots=1, expert_policy=policy)
    marks: list[_Mark] = []
    monkeypatch.setattr(type(eng.runtime), "mark", lambda rt: marks.append(_Mark()) or marks[-1])
    waited, host_waits = [], []
    wait_for, wait_host = type(eng.runtime).wait_for, type(eng.runtime).wait_host
    monkeypatch.setattr(type(eng.runtime), "wait_for", lambda rt, ev: waited.append(ev) or wait_for(rt, ev))
    monkeypatch.setattr(type(eng.runtime), "wait_host", lambda rt, ev: host_waits.append(ev) or wait_host(rt, ev))
    got = _outputs(eng)
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    st = eng.executor.streamer
    assert waited and not host_waits and not st._waits  # every step's marks were read
    assert marks and st.stats.stall_s == pytest.approx(1e-3 * len(marks) / 2)  # a pair of marks a wait


def test_streamed_segments_replay_as_graphs(moe, resident):
    """Where the runtime captures graphs, each segment of a streamed step (between the stops at the routers) is
    captured on its second run and replayed after: the same logits as the resident run, bit for bit, through
    the base runtime's recording graphs (the expert segment replayed once per group of experts that fits)."""
    _, want = resident
    eng = _engine(moe, expert_slots=1)
    ex = eng.executor
    ex.use_graphs = True  # as on cuda; the base runtime's graphs record the prepared launches and re-run them
    for _ in range(3):  # the first run counts, the second captures, the third replays
        got = _outputs(eng)
        assert all(np.array_equal(a, b) for a, b in zip(got, want))
    pid = id(eng.graph_step)
    segments = {k[2] for k in ex.graphs if k[:2] == (pid, 1)}
    assert segments == set(range(2 * len(ex.sections[pid]) + 1))  # every segment of the one-token step
    assert (id(eng.graph_all), len(PROMPT), 1) in ex.graphs  # the prefill's experts, in groups of one slot


def _host_bytes(monkeypatch, engine) -> list[int]:
    """Bytes of each host buffer that runtimes of `engine`'s kind allocate from now on (`alloc_host`), in a list
    that grows."""
    sizes: list[int] = []
    cls = type(engine.runtime)
    alloc_host = cls.alloc_host
    monkeypatch.setattr(cls, "alloc_host", lambda rt, n: sizes.append(n) or alloc_host(rt, n))
    return sizes


def test_streaming_staged_from_the_file(moe, resident, monkeypatch):
    """With little host memory free the experts are not copied into host memory at all: each upload is staged
    from the mmapped file (the plans keep the file's Q8_0 layout) through the ring of 4 buffers of one expert."""
    import polystrata.runtimes.memory as mm

    _, want = resident
    monkeypatch.setattr(mm, "host_memory", lambda: (1 << 20, 1 << 30))
    sizes = _host_bytes(monkeypatch, resident[0])
    eng = _engine(moe, expert_slots=2)
    st = eng.executor.streamer
    assert st.staging is not None and all(la.pinned is None for la in st.layers)
    assert all(src.mapped and src.expert(3).base is not None for la in st.layers for src in la.host)
    assert sizes == [max(src.nbytes for la in st.layers for src in la.host)] * 4
    assert all(np.array_equal(a, b) for a, b in zip(_outputs(eng), want))


def test_pinned_experts_copied_once_expert_by_expert(moe, resident, monkeypatch):
    """With host memory to spare the experts are copied into pinned memory, one expert at a time from the file:
    the host holds that copy (the size of the streamed tensors) and nothing else of them."""
    sizes = _host_bytes(monkeypatch, resident[0])
    eng = _engine(moe, expert_slots=2)
    st = eng.executor.streamer
    files = {w: eng.file.tensors[w].nbytes for la in st.layers for w in la.stream.weights}
    assert st.staging is None and sorted(sizes) == sorted(files.values())
    la = st.layers[1]
    assert np.array_equal(la.pinned[2][5], np.asarray(eng.file.raw(la.stream.weights[2])[5]).reshape(-1))


@pytest.mark.parametrize("fmt_name", ["Q4_K", "Q6_K", "Q8_0"])
def test_expert_source_repacks_one_expert(fmt_name):
    """Where a target keeps a layout of its own (sliced Q4_K, padded Q6_K rows on wide-load GPUs) or f32, an
    expert's bytes are repacked alone, the same bytes as that expert's share of the whole tensor repacked."""
    from types import SimpleNamespace

    from polystrata.compiler.passes import storage_format
    from polystrata.compiler.plan import BufferSpec
    from polystrata.ir.encode import quantize
    from polystrata.ir.evaluate import dequantize
    from polystrata.ir.formats import FORMATS, row_bytes
    from polystrata.ir.layout import repack

    fmt = FORMATS[fmt_name]
    shape = (3, 4, 512)  # experts, rows, columns
    raw = np.random.default_rng(0).integers(0, 256, (3, 4, row_bytes(fmt, 512)), dtype=np.uint8)
    if fmt_name == "Q8_0":  # decodable values for the f32 path
        raw = quantize(fmt, np.random.default_rng(1).standard_normal((12, 512)).astype(np.float32))
        raw = np.asarray(raw).reshape(3, 4, -1)
    file = SimpleNamespace(tensors={"w": SimpleNamespace(fmt=fmt, shape=shape)}, raw=lambda _name: raw)
    store = storage_format(fmt, 512)
    src = expert_source(file, BufferSpec("w", "u8", raw.size, "weight", store))
    whole = repack(raw, fmt, store).reshape(3, -1)
    assert src.mapped == (store == fmt) and src.nbytes == whole.shape[1]
    assert all(np.array_equal(src.expert(e), whole[e]) for e in range(3))
    if fmt_name == "Q8_0":
        f32 = expert_source(file, BufferSpec("w", "f32", 3 * 4 * 512, "weight", store))
        values = dequantize(fmt, raw.reshape(-1), shape).reshape(3, -1)
        assert not f32.mapped and f32.nbytes == 4 * 4 * 512
        assert all(np.array_equal(f32.expert(e).view(np.float32), values[e]) for e in range(3))


def test_streaming_kernels_only_in_streaming_plans(resident, moe):
    eng, _ = resident
    names = {la.kernel.name for p in eng.executor.plans.values() for la in p.launches}
    assert not any("slots" in n for n in names)
    streamed = _engine(moe, expert_slots=3)
    names = {la.kernel.name for p in streamed.executor.plans.values() for la in p.launches}
    assert {n.split("_")[1] for n in names if "_slots" in n} == {"gateup", "down"}


def test_runtime_copy_async_into_a_region(kernel_target):
    from polystrata.targets import make_runtime

    assert copy_region_check(make_runtime(TARGET))


def test_runtime_expert_cache_resize(kernel_target):
    from polystrata.targets import make_runtime

    assert expert_cache_resize_check(make_runtime(TARGET))


# --- the cache's bookkeeping against hand-computed traces --------------------------------------------------------


def _trace(policy, steps, slots=2, n=6):
    stats = CacheStats()
    cache = ExpertCache(n, slots, policy(n), stats)
    uploads = []
    for experts in steps:
        for group in cache.passes(experts):
            uploads.append(cache.request(group))
    return cache, stats, uploads


def test_lru_trace():
    # Two slots. [0 1]: two misses. [1 2]: 1 hits, 2 evicts 0 (the least recent) into slot 0. [0]: evicts 1 (used
    # before 2) from slot 1. [2 0]: two hits, resident experts in id order, so 0 is used before 2. [3]: evicts 0.
    cache, stats, uploads = _trace(LRUPolicy, [[0, 1], [1, 2], [0], [2, 0], [3]])
    assert uploads == [[(0, 0), (1, 1)], [(2, 0)], [(0, 1)], [], [(3, 1)]]
    assert (stats.requests, stats.hits) == (8, 3)
    assert stats.hit_rate == pytest.approx(3 / 8)
    assert cache.holds == [2, 3] and list(cache.state(1)[:4]) == [-1, -1, 0, 1]


def test_lfu_trace():
    # Uses: 0 x3, 1 x1 before 2 arrives; 2 evicts 1 (fewest uses), then 3 evicts 2 (1 use vs 0's 3).
    cache, stats, uploads = _trace(LFUPolicy, [[0, 1], [0], [0], [2], [3]])
    assert uploads == [[(0, 0), (1, 1)], [], [], [(2, 1)], [(3, 1)]]
    assert (stats.requests, stats.hits) == (6, 2)
    assert cache.holds == [0, 3]


@pytest.mark.parametrize("policy", [LRUPolicy, LFUPolicy])
def test_resolve_kernel_keeps_the_hosts_cache(kernel_target, policy):
    """The device's bookkeeping of one-token steps (`moe.resolve_kernel`) against `ExpertCache`'s on the same
    random routes (skewed, so that hits, empty slots and evictions all occur): after every step the state buffer
    equals the host cache's state with its counters, and the uploads it lists are the host's."""
    from polystrata.codegen.recipes import ExpertState
    from polystrata.codegen.recipes.moe import resolve_kernel
    from polystrata.targets import make_runtime

    n, k, slots = 16, 3, 5
    rt = make_runtime(TARGET)
    lay = ExpertState(n, k)
    kern = rt.compile(resolve_kernel("moe_resolve_test", n, k, rt.lanes))
    cache = ExpertCache(n, slots, policy(n), CacheStats())
    state = rt.upload(cache.state(k))
    route = rt.alloc((k,), "i32")
    rng = np.random.default_rng(7)
    weights = np.linspace(3, 1, n) / np.linspace(3, 1, n).sum()
    counted = np.zeros(3, np.int64)
    for _ in range(40):
        experts = [int(e) for e in rng.choice(n, size=k, replace=False, p=weights)]
        rt.write(route, np.asarray(experts, np.int32))
        rt.launch(kern, rt.args_for(kern.kernel, {"route": route, "state": state}, {}), [1])
        got = rt.download(state, (lay.size,), "i32")
        before = (cache.stats.requests, cache.stats.hits)
        (group,) = cache.passes(experts)
        uploads = cache.request(group)  # the streamer counts them as it copies
        want = cache.state(k)
        counted += (*np.subtract((cache.stats.requests, cache.stats.hits), before), len(uploads))
        h = lay.header
        assert np.array_equal(got[: h], want[: h]), "table, slots, uses or clock differ"
        assert got[h + lay.H_CLOCK] == want[h + lay.H_CLOCK] and got[h + lay.H_LOADS] == len(uploads)
        assert list(got[h + lay.H_REQUESTS : h + lay.H_UPLOADS + 1]) == list(counted)
        assert [tuple(got[lay.loads + 2 * i : lay.loads + 2 * i + 2]) for i in range(len(uploads))] == uploads
    assert 0 < counted[1] < counted[0] and counted[2] > slots  # hits, misses and evictions happened


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_device_resolved_steps_match_host_resolved(moe, resident, monkeypatch, policy):
    """Decode steps resolved on the device (the misses read from host memory in place, no stop at the routers)
    give the resident run's logits bit for bit and the same cache statistics as the same run resolved on the host,
    with a cache larger than a token's experts (so the policy's choice of victim matters); the prefill steps
    between run on the host, the cache's state handed over each way."""
    _, want = resident
    runs = []
    for device in (True, False):
        eng = _engine(moe, expert_slots=5, expert_policy=policy)
        st = eng.executor.streamer
        if not device:
            monkeypatch.setattr(st, "resolves_on_device", lambda t: False)
        for _ in range(2):  # the second prefill takes the state back from the device
            got = _outputs(eng)
            assert all(np.array_equal(a, b) for a, b in zip(got, want))
        share = st.summary()["device_resolved"]  # first: the statistics come back from the device
        runs.append((st.stats.requests, st.stats.hits, st.stats.uploads, st.stats.link_bytes,
                     [list(la.cache.holds) for la in st.layers], share))
    (*dev, dev_share), (*host, host_share) = runs
    assert dev == host and host_share == 0
    assert dev_share == pytest.approx(len(DECODE) / (len(PROMPT) + len(DECODE)), abs=1e-4)


def test_passes_split_a_step_bigger_than_the_cache():
    cache, stats, uploads = _trace(LRUPolicy, [[1, 1, 4], [5, 4, 0, 2, 3]], slots=2)
    # The second step: resident 4 first (with 0), then (2, 3), then 5; each group fits the two slots.
    assert [len(u) for u in uploads] == [2, 1, 2, 1]
    assert stats.requests == 2 + 5 and stats.hits == 1
    assert cache.holds == [3, 5] and cache.passes([5, 4, 0]) == [[5, 0], [4]]


def test_resize_keeps_what_the_policy_values():
    cache, _, _ = _trace(LRUPolicy, [[0, 1, 2, 3], [1], [3]], slots=4)
    assert sorted(cache.resize(2)) == [1, 3] and cache.holds == [-1, -1]
    assert cache.prefetch([1, 3]) == [(1, 0), (3, 1)] and cache.resident(3) and not cache.resident(0)
    cache, _, _ = _trace(LFUPolicy, [[0, 1, 2], [2], [2], [0]], slots=3)
    assert sorted(cache.resize(1)) == [2]


def test_prefetch_of_more_experts_than_slots():
    """A prediction of k experts into fewer slots keeps the first `slots` of them, evicting what is not predicted
    (here every resident expert is among the k predicted, but not among the first `slots`)."""
    cache = ExpertCache(8, 1, PrefetchPolicy(8), CacheStats())
    cache.request([5])
    assert cache.prefetch([3, 5]) == [(3, 0)] and cache.resident(3) and not cache.resident(5)


# --- the VRAM guard ----------------------------------------------------------------------------------------------


def test_guard_needs_two_low_readings_and_recovers_with_hysteresis():
    g = VRAMGuard(low=100, high=200, patience=3)
    moves = [g.reading(f) for f in (90, 150, 90, 90, 150, 250, 250, 90, 250, 250, 250)]
    assert moves == [0, 0, 0, -1, 0, 0, 0, 0, 0, 0, 1]


def test_guard_shrinks_and_grows_the_cache(moe, resident, monkeypatch):
    _, want = resident
    logs: list[str] = []
    eng = _engine(moe, expert_slots=4, verbose=False)
    ex = eng.executor
    ex.guard = VRAMGuard(low=1000, high=5000, patience=2)
    ex.log = logs.append
    readings = iter([(10**6, 10**7)] + [(500, 10**7)] * 2 + [(10**6, 10**7)] * 2)
    monkeypatch.setattr(eng.runtime, "memory_info", lambda: next(readings))
    moves: list[tuple[str, int]] = []  # device allocations and frees, in order
    alloc, free = eng.runtime.alloc, eng.runtime.free
    monkeypatch.setattr(eng.runtime, "alloc", lambda *a: moves.append(("alloc", id(buf := alloc(*a)))) or buf)
    monkeypatch.setattr(eng.runtime, "free", lambda buf: moves.append(("free", id(buf))) or free(buf))
    old = [id(b) for la in ex.streamer.layers for b in la.device]
    slots = []
    eng.reset()
    got = [eng.forward(PROMPT, all_logits=True)]
    slots.append(ex.streamer.slots)
    for t in DECODE:
        got.append(eng.forward([t]))
        slots.append(ex.streamer.slots)
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    # Readings after each step: high (patience 2: no move), low, low -> shrink to 3, high, high -> grow back to 4.
    assert slots == [4, 4, 3, 3, 4]
    # Each resize frees all 6 slot buffers (2 layers x gate, up, down) before it allocates the first new one.
    assert [m for m, _ in moves] == ["free"] * 6 + ["alloc"] * 6 + ["free"] * 6 + ["alloc"] * 6
    assert [b for _, b in moves[:6]] == old and [b for _, b in moves[12:18]] == [b for _, b in moves[6:12]]
    assert len(logs) == 2 and "4 -> 3" in logs[0] and "3 -> 4" in logs[1]


def test_guard_marks_follow_an_explicit_budget():
    """The marks are the default margin and twice it, unless an explicit budget leaves less free than the
    margin: then half and all of what it leaves; nothing left free (or no reading): no guard."""
    from polystrata.runtimes.memory import MemoryPlan

    def marks(budget, explicit, info=(4 << 30, 8 << 30)):
        g = vram_guard(MemoryPlan(budget, 0, 1, 1, 8, 2, 0, 0, 64), info, explicit)
        return None if g is None else (g.low, g.high)

    m = margin(8 << 30)
    assert m == 512 << 20
    assert marks((4 << 30) - m, False) == (m, 2 * m)
    assert marks(1 << 30, True) == (m, 2 * m)  # leaves 3 GiB: the default marks
    left = (4 << 30) - int(0.99 * (4 << 30))
    assert marks(int(0.99 * (4 << 30)), True) == (left // 2, left // 2 * 2)
    assert marks(4 << 30, True) is None and marks(5 << 30, True) is None
    assert marks(1 << 30, True, None) is None


def test_guard_under_an_explicit_budget_waits_for_real_pressure(moe, resident, monkeypatch):
    """--gpu-mem 99% of a (scripted) device leaves 41 MiB free: readings of 30 MiB, far below the default margin
    of 512 MiB, do not shrink the cache; two of 10 MiB (below half of what the budget left) do."""
    _, want = resident
    free, total = 4 << 30, 8 << 30
    state = {"free": free}
    monkeypatch.setattr(type(resident[0].runtime), "memory_info", lambda _rt: (state["free"], total))
    eng = _engine(moe, expert_slots=4, gpu_mem="99%")
    ex = eng.executor
    left = free - int(0.99 * free)
    assert eng.memory.budget == int(0.99 * free) and (ex.guard.low, ex.guard.high) == (left // 2, left // 2 * 2)
    slots, got = [], []
    eng.reset()
    for i, tokens in enumerate([PROMPT, *[[t] for t in DECODE]]):
        state["free"] = (30 << 20) if i < 3 else (10 << 20)
        got.append(eng.forward(tokens, all_logits=i == 0))
        slots.append(ex.streamer.slots)
    assert slots == [4, 4, 4, 4, 1]
    assert all(np.array_equal(a, b) for a, b in zip(got, want))


# --- the CLI's outputs -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cmd", [
    ["run", "-p", "hi", "--gpu-mem", "1G", "-n", "1"],
    ["score", "--text", "hi", "-o", "x.npz", "--expert-policy", "lfu"],
    ["compile", "--expert-slots", "2", "-o", "art"], ["bench", "--gpu-mem", "50%", "--expert-slots", "1"]])
def test_reference_target_refuses_the_memory_options(moe, capsys, tmp_path, monkeypatch, cmd):
    """The reference target has no device memory to plan: --gpu-mem, --expert-slots and --expert-policy are one
    line of error there, before the model is loaded, and nothing is written."""
    from polystrata.cli import main

    monkeypatch.chdir(tmp_path)
    assert main([cmd[0], str(moe), "--target", "reference", *cmd[1:]]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --") and "reference target plans no device memory" in err[0]
    assert not list(tmp_path.iterdir())


def test_run_verbose_prints_the_plan(moe, kernel_target, capsys):
    from polystrata.cli import main

    assert main(["run", str(moe), "--target", TARGET, "-n", "2", "--raw", "-p", "hi", "--ctx", "64",
                 "--expert-slots", "2", "--expert-policy", "lfu", "--verbose"]) == 0
    err = capsys.readouterr().err
    assert "experts stream from host memory: 2 of 8 slots per layer x 2 layers" in err
    assert "KV cache: 32.0 KiB (f16, n_ctx 64)" in err


def test_bench_json_reports_experts(moe, kernel_target):
    from polystrata.bench import run_bench

    r = run_bench(moe, target=TARGET, n_prompt=8, n_gen=3, repetitions=1,
                  memory={"expert_slots": 1, "expert_policy": "lru"})
    assert set(r["experts"]) == {"policy", "slots", "hit_rate", "link_bytes_per_token", "stall_ms_per_token",
                                 "device_resolved"}
    assert r["experts"]["slots"] == 1 and r["experts"]["link_bytes_per_token"] > 0
    assert r["experts"]["device_resolved"] == 0  # one slot holds less than a token's two experts
    assert isinstance(r["gpu_mem"], int) and r["gpu_mem"] > 0


def test_plans_share_one_set_of_activation_buffers():
    """An engine's plans never run at once: the i-th largest activation buffer of a dtype of every plan takes shared
    buffer i, as large as the largest it holds; a plan's own buffers stay apart; the memory plan counts the set
    once. Weights, the KV cache and the inputs are shared by name as before."""
    from polystrata.compiler.plan import BufferSpec, Plan

    def plan(*bufs) -> Plan:
        return Plan([], {n: BufferSpec(n, d, c, k) for n, d, c, k in bufs}, "x", ("T", 8), 4)

    prompt = plan(("x", "f32", 100, "activation"), ("y", "f32", 30, "activation"), ("q", "u8", 64, "activation"),
                  ("w", "f32", 999, "weight"), ("tokens", "i32", 4, "input"))
    step = plan(("x", "f32", 20, "activation"), ("z", "f32", 50, "activation"), ("k", "f16", 16, "kv"),
                ("w", "f32", 999, "weight"), ("tokens", "i32", 1, "input"))
    pool, use = shared_scratch({1: prompt, 2: step})
    assert sorted(pool) == [("f32", 30), ("f32", 100), ("u8", 64)]
    assert use[1, "x"] == use[2, "z"] != use[1, "y"] == use[2, "x"] and use[1, "q"] not in (use[1, "x"], use[1, "y"])
    mem = plan_memory({1: prompt, 2: step}, [], 16, None)
    assert (mem.scratch_bytes, mem.kv_bytes, mem.weight_bytes) == (4 * 130 + 64 + 4 * 4, 2 * 16, 4 * 999)


def test_compile_manifest_records_the_plan(moe, kernel_target, tmp_path):
    from polystrata.artifact import MANIFEST, write_artifact

    out, _ = write_artifact(moe, TARGET, tmp_path / "a", expert_slots=2)
    mem = yaml.safe_load((out / MANIFEST).read_text())["memory"]
    assert mem["experts_streamed"] is True and mem["expert_slots_per_layer"] == 2 and mem["n_expert"] == 8
    assert mem["kv_bytes"] > 0 and any("experts stream" in line for line in mem["plan"])


def test_run_artifact_keeps_the_compiled_expert_cache(moe, kernel_target, tmp_path, capsys):
    from polystrata.artifact import write_artifact
    from polystrata.cli import main

    out, _ = write_artifact(moe, TARGET, tmp_path / "a", expert_slots=2)
    assert main(["run", str(out), "-n", "1", "--raw", "-p", "hi", "--verbose"]) == 0
    assert "experts stream from host memory: 2 of 8 slots per layer" in capsys.readouterr().err
    assert main(["run", str(out), "-n", "1", "--raw", "-p", "hi", "--verbose", "--expert-slots", "3"]) == 0
    assert "3 of 8 slots per layer" in capsys.readouterr().err


def test_streaming_f32_activation_path(tmp_path, kernel_target):
    """F16 experts take the expert kernels' f32-activation path (not the int8 one): streamed, bit-identical too."""
    path = synth_model("qwen3moe", tmp_path / "f16.gguf", preset="tiny", qtype="F16", seed=3)
    want = _outputs(_engine(path))
    eng = _engine(path, expert_slots=1)
    names = {la.kernel.name for p in eng.executor.plans.values() for la in p.launches if "_slots" in la.kernel.name}
    assert names and not any(n.endswith("_q8") for n in names)
    assert all(np.array_equal(a, b) for a, b in zip(_outputs(eng), want))

"""Recipe conformance, codegen/recipes/attention.py: attention over every KV format, with splits and runs, rope and
the heads' norms fused in, on every target under test, against the numpy reference."""

from __future__ import annotations

import numpy as np
import pytest
from recipe_cases import gpu_shaped, plan_scratch, q8_rounded, recipe, recipe_context, run_launches, target_runtimes

from polystrata.ir.encode import quantize
from polystrata.ir.evaluate import dequantize
from polystrata.ir.formats import KV_FORMATS, row_bytes
from polystrata.ir.graph import Graph
from polystrata.ir.layout import repack, split_rows
from polystrata.runtimes import reference as R

rt = target_runtimes()


def _attention_graph(hq: int, hkv: int, d: int, window: int = 0, softcap: float = 0.0) -> Graph:
    """One attention op over inputs q, k, v, positions (heads of d values), output "o"."""
    g = Graph("t")
    q, k, v = (g.input(n, "f32", ("T", h, d)) for n, h in (("q", hq), ("k", hkv), ("v", hkv)))
    pos = g.input("positions", "i32", ("T",))
    g.op("attention", q, k, v, pos, layer=0, scale=0.125, window=window, softcap=softcap, name="o")
    return g


def _check_attention(rt, kv: str, gqa: int, window: int, softcap: float, lanes: int, n_ctx: int, knobs: dict,
                     steps: tuple[int, ...], seed: int, d: int = 64, split_kv: bool = False,
                     int8_q: bool = False) -> list:
    """The attention recipe's launches (lanes, knobs; heads of `d`) against the reference over `steps` (token
    counts, the largest first: `keep` holds buffers sized by it), the cache carried between them; returns the
    launches. `split_kv`: the KV rows split (`split_rows`), the reference then fed the very values the cache holds
    (its rows decoded from that layout), so that only the order of float sums may differ; `int8_q`: the scores
    take q as int8 (knob int8), the reference then q rounded so too (`q8_rounded`)."""
    hkv = 2
    hq = hkv * gqa
    g = _attention_graph(hq, hkv, d, window, softcap)
    ctx = recipe_context(g, kv=kv, n_ctx=n_ctx, lanes=lanes, split_kv=split_kv)
    ctx.knobs, ctx.t_max = {"attention": knobs}, max(ctx.t_max, *steps)  # scratch for the longest step
    launches = recipe("attention").lower(g.nodes, ctx)
    fmt = KV_FORMATS[kv]
    kvb = n_ctx * row_bytes(fmt, hkv * d)
    ex = R.ReferenceExecutor({}, n_ctx)
    keep = {"kv.0.k": rt.alloc((kvb,), "u8"), "kv.0.v": rt.alloc((kvb,), "u8")}
    n_past = 0
    rng = np.random.default_rng(seed)
    for t in steps:
        qv, kvv, vv = (rng.standard_normal((t, h, d)).astype(np.float32) for h in (hq, hkv, hkv))
        pv = np.arange(n_past, n_past + t, dtype=np.int32)
        # The reference sees what the cache holds: K/V rounded through the KV format.
        kq = dequantize(fmt, quantize(fmt, kvv.reshape(t, -1)), (t, hkv * d)).reshape(kvv.shape)
        vq = dequantize(fmt, quantize(fmt, vv.reshape(t, -1)), (t, hkv * d)).reshape(vv.shape)
        sb, so = plan_scratch(ctx)  # split-K partials, poisoned: a run the combine should not read spoils the output
        out = run_launches(rt, launches, {"q": qv.reshape(-1), "k": kvv.reshape(-1), "v": vv.reshape(-1),
                                           "positions": pv, "starts": np.zeros(t, np.int32), **sb}, {"T": t},
                            {"o": ((t, hq, d), "f32"), **so},
                            keep)["o"]
        if split_kv:
            rows = [dequantize(split_rows(fmt, d), rt.download(keep[f"kv.0.{n}"], (kvb,), "u8"), (n_ctx, hkv, d))
                    [n_past:n_past + t] for n in "kv"]
            np.testing.assert_allclose(rows[0], kq, atol=0.03)  # what the store wrote, K/V rounded through the format
            np.testing.assert_allclose(rows[1], vq, atol=0.03)
            kq, vq = rows
        qr = q8_rounded(qv.reshape(t, -1)).astype(np.float32).reshape(qv.shape) if int8_q else qv
        ref = R._IMPLS["attention"](ex, g.nodes[0], [qr, kq, vq, pv])
        # Our encoder may pick the neighbouring f16 scale (round-to-nearest vs. rounding up): a q8 step of a value.
        np.testing.assert_allclose(out, ref, atol=1e-4 if kv == "f16" or split_kv else 0.03, rtol=1e-3,
                                   err_msg=f"T={t}")
        n_past += t
    return launches


@pytest.mark.parametrize("kv,gqa,window,softcap", [
    ("f16", 1, 0, 0.0), ("f16", 3, 4, 0.0), ("q8_0", 3, 0, 30.0), ("q8_0", 1, 4, 0.0), ("q8_g64", 3, 0, 0.0),
    ("q8_g64", 1, 3, 20.0),
])
@pytest.mark.parametrize("lanes,splits", [(1, 1), (128, 1), (1, 4), (128, 4)],
                         ids=["lanes1", "lanes128", "lanes1-split4", "lanes128-split4"])
def test_attention(rt, kv, gqa, window, softcap, lanes, splits):
    """Attention against the reference; 128 lanes: the GPU shapes (keys in tiles, lanes sharing a key's dot
    product, V sums in registers); split-K: 4 runs of keys (some empty in the first steps) and the combine."""
    gpu_shaped(rt, lanes, sampled=False)  # one-lane targets: test_attention_runs has the GPU shapes with splits
    launches = _check_attention(rt, kv, gqa, window, softcap, lanes, 32, {"splits": splits}, (7, 1, 1, 5), 7)
    assert len(launches) == (3 if splits > 1 else 2)  # K/V store, attention, [combine]


@pytest.mark.parametrize("kv,gqa,window,softcap,lanes,heads,splits", [
    ("f16", 3, 0, 0.0, 1, 3, 5), ("q8_0", 1, 10, 30.0, 1, 1, 5), ("q8_g64", 4, 0, 0.0, 1, 2, 5),
    ("f16", 4, 10, 0.0, 128, 4, 5), ("q8_0", 3, 0, 0.0, 128, 3, 5), ("q8_g64", 3, 10, 30.0, 128, 3, 5),
    ("q8_0", 4, 0, 20.0, 128, 4, 1),
])
def test_attention_runs(rt, kv, gqa, window, softcap, lanes, heads, splits):
    """Split-K as flash-decoding has it: 5 runs of the keys visible at run time, each at least 4 long (knob
    min_run), so that the runs holding keys, and their lengths, change with the context; the combine reads only
    those (the partials of the others stay NaN). Contexts with a partial last run, prefill chunks and decode
    steps, GQA with groups taking several query heads of a KV head (knob heads), gemma3's sliding window and
    softcap."""
    gpu_shaped(rt, lanes, sampled=kv == "q8_g64")
    # Runs of the contexts 1..16 of the first step: 1 of 1 to 4 keys, then of 4 (the last partial); 17, 18: 5 runs
    # of 4, the last 1 or 2 long; 22, 23: 5 runs of 5, the last 2 or 3 long; 36, 37: 5 runs of 8, the last 4 or 5
    # long (a window of 10: 3 runs of 4, the last 2).
    knobs = {"splits": splits, "min_run": 4, "heads": heads}
    launches = _check_attention(rt, kv, gqa, window, softcap, lanes, 40, knobs, (16, 1, 1, 4, 1, 13, 1), 11)
    attn = launches[1].kernel
    assert dict(attn.knobs) == {"two_pass": 1, "splits": splits} | ({"min_run": 4} if splits > 1 else {}) | (
        {"heads": heads} if heads > 1 else {})
    assert attn.grid[1].value == 2 * gqa // heads


@pytest.mark.parametrize("kv,gqa,window,softcap,q_tile,k_tile", [
    ("f16", 1, 0, 0.0, 16, 32), ("f16", 4, 10, 0.0, 4, 8), ("q8_0", 3, 0, 30.0, 16, 32), ("q8_0", 1, 10, 0.0, 4, 8),
    ("q8_g64", 3, 0, 20.0, 8, 16), ("q8_g64", 2, 10, 0.0, 4, 8),
])
def test_attention_tiles(rt, kv, gqa, window, softcap, q_tile, k_tile):
    """Prefill attention in tiles (`attention_tiles`: rows in tiles of q_tile, keys of k_tile, the online softmax)
    against the reference: chunks whose rows do not fill their last tile, keys starting mid-tile and a window
    inside a tile, decode steps through the same kernel, GQA, softcap."""
    gpu_shaped(rt, 128, sampled=False)  # GPU targets only (the policy's split_keys): no one-lane sample
    knobs = {"tiles": 1, "tiles_above": 0, "q_tile": q_tile, "k_tile": k_tile}
    launches = _check_attention(rt, kv, gqa, window, softcap, 128, 64, knobs, (21, 1, 1, 6, 13), 13)
    tiles = launches[1].kernel
    assert len(launches) == 2 and dict(tiles.knobs) == {"tiles": 1, "q_tile": q_tile, "k_tile": k_tile}


@pytest.mark.parametrize("mma", [0, 1])
def test_attention_tiles_split_keys(rt, mma):
    """Knob tile_splits: each pass's key tiles dealt to 3 groups (parts without keys for some rows and steps),
    their partials added up by the split-K combine, against the reference; the loops (f16 K/V: within 1e-4) and
    the tile products (q8_0 K/V)."""
    gpu_shaped(rt, 128, sampled=False)
    q_tile, k_tile = (16, 32) if mma else (8, 16)
    knobs = {"tiles": 1, "tiles_above": 0, "q_tile": q_tile, "k_tile": k_tile, "mma": mma, "tile_splits": 3}
    launches = _check_attention(rt, "q8_0" if mma else "f16", 3, 0, 30.0 if mma else 0.0, 128, 128, knobs,
                                (90, 1, 6, 13), 17)
    tiles, combine = launches[1].kernel, launches[2].kernel
    assert dict(tiles.knobs)["tile_splits"] == 3 and len(tiles.grid) == 3 and combine.param("po")


# The host's policy never splits KV rows, and its Numba compile of the split rows' kernels costs ~20 s: the split
# layout's tests run on the targets with lanes (their one-lane case too).
SPLIT_ON_HOST = "split KV rows: not a host layout"


@pytest.mark.parametrize("kv,d,gqa,window,softcap,lanes,knobs", [
    ("q8_0", 64, 3, 0, 30.0, 1, {"splits": 1}),
    ("q8_g64", 128, 4, 10, 0.0, 128, {"splits": 5, "min_run": 4, "heads": 2}),
    ("q8_g64", 128, 3, 10, 20.0, 128, {"tiles": 1, "tiles_above": 0, "q_tile": 8, "k_tile": 16}),
    ("q8_0", 64, 2, 0, 0.0, 128, {"splits": 1, "heads": 2, "int8": 1}),
    ("q8_g64", 128, 2, 10, 30.0, 1, {"splits": 1, "int8": 1}),
], ids=["lanes1", "lanes128-split5-heads2", "tiles", "lanes128-int8", "lanes1-int8"])
def test_attention_split_kv_rows(rt, kv, d, gqa, window, softcap, lanes, knobs):
    """KV cache rows split into codes and scales (`ir.layout.split_rows`), as a wide-load target's policy keeps
    q8_0 and q8_g64 (forced here): the store writes them; the row kernels read K a word of 4 codes a load (a lane a
    key, or lanes sharing a key's dot product) and V a word a lane (lanes sharing a word over phases of the keys
    where the row has fewer words than the group lanes), and the tiles decode words, each against the reference;
    with knob int8 the scores take q as int8, a K word against a q word in one dot4_i8. Not on the host
    (`SPLIT_ON_HOST`)."""
    if rt.lanes == 1:
        pytest.skip(SPLIT_ON_HOST)
    steps = (16, 1, 1, 4, 1, 13, 1) if "splits" in knobs else (21, 1, 1, 6, 13)
    launches = _check_attention(rt, kv, gqa, window, softcap, lanes, 64, knobs, steps, 19, d=d, split_kv=True,
                                int8_q="int8" in knobs)
    assert all("_split_" in la.kernel.name for la in launches[:2])
    assert dict(launches[1].kernel.knobs).get("int8", 0) == knobs.get("int8", 0)


def test_wide_load_targets_split_q8_kv_rows_of_whole_words():
    """The layout is the policy's: a wide-load target (cuda) keeps q8_0 and q8_g64 head rows split where their
    bytes are whole words (heads of 64 in q8_g64, 66 bytes, stay in blocks), others and f16 as they are (a row's
    bytes are the same either way); the store and attention kernels follow the policy."""
    from polystrata.codegen.policy import HOST_POLICY, device_policy
    from polystrata.runtimes.cuda import CUDARuntime

    wide = device_policy(128, 32, wide_loads=True)
    assert CUDARuntime.policy.split_kv_formats == wide.split_kv_formats == ("Q8_0", "q8_g64")
    q8, g64, f16 = (KV_FORMATS[n] for n in ("q8_0", "q8_g64", "f16"))
    assert wide.kv_layout(q8, 64) == split_rows(q8, 64) and wide.kv_layout(g64, 128) == split_rows(g64, 128)
    assert wide.kv_layout(g64, 64) is g64 and wide.kv_layout(f16, 128) is f16
    for other in (HOST_POLICY, device_policy(64, 64, int8_dot=True)):
        assert other.kv_layout(q8, 64) is q8
    assert split_rows(g64, 128).block_bytes == row_bytes(g64, 128)
    g = _attention_graph(8, 2, 128)
    for policy, kernels in ((wide, ["kv_store_q8_g64_split", "attn_q8_g64_split"]),
                            (HOST_POLICY, ["kv_store_q8_g64_8", "attn_q8_g64_8"])):
        ctx = recipe_context(g, kv="q8_g64", lanes=policy.lanes)
        ctx.policy = policy
        assert [la.kernel.name[:len(k)] for la, k in zip(recipe("attention").lower(g.nodes, ctx), kernels)] == kernels


def test_long_one_token_plan_with_few_splits_takes_a_head_a_group():
    """`--knob attention.splits=1` on a long context: a run's scores too many for GROUP_SCORES with any number of
    heads, so a group takes one head (it raised a ValueError before); lowering only."""
    g = _attention_graph(8, 2, 64)
    ctx = recipe_context(g, n_ctx=8192, lanes=64)
    ctx.t_max, ctx.knobs = 1, {"attention": {"splits": 1}}
    attn = recipe("attention").lower(g.nodes, ctx)[1].kernel
    assert dict(attn.knobs)["splits"] == 1 and "heads" not in dict(attn.knobs)


def test_split_kv_store_writes_the_gguf_blocks_repacked(rt):
    """The K/V store into split rows writes exactly the bytes of its GGUF-layout store, repacked (`repack`)."""
    if rt.lanes == 1:
        pytest.skip(SPLIT_ON_HOST)
    hkv, d, t, n_ctx = 2, 64, 5, 8
    g = _attention_graph(3 * hkv, hkv, d)  # test_attention's and test_attention_split_kv_rows' stores
    fmt = KV_FORMATS["q8_0"]
    kvb = n_ctx * row_bytes(fmt, hkv * d)
    rng = np.random.default_rng(2)
    ins = {"k": rng.standard_normal(t * hkv * d).astype(np.float32),
           "v": rng.standard_normal(t * hkv * d).astype(np.float32),
           "positions": np.arange(t, dtype=np.int32), "starts": np.zeros(t, np.int32)}
    caches = {}
    for split in (False, True):
        store = recipe("attention").lower(g.nodes, recipe_context(g, kv="q8_0", n_ctx=n_ctx, split_kv=split))[0]
        caches[split] = run_launches(rt, [store], ins, {"T": t}, {"kv.0.k": ((kvb,), "u8"), "kv.0.v": ((kvb,), "u8")})
    layout = split_rows(fmt, d)
    for name in ("kv.0.k", "kv.0.v"):
        np.testing.assert_array_equal(caches[True][name], repack(caches[False][name], fmt, layout))


@pytest.mark.parametrize("q_tile", [16, 32])
def test_attention_tile_products(rt, q_tile):
    """Prefill attention's products as the kernel IR's tile products (knob mma; the portable rendering here,
    test_target_cuda emulates the matrix units' layouts with f16 K/V): a 512-row prompt (32 row tiles, 16 key
    tiles), then 33, 7 and 1 rows (partial tiles of rows and keys), GQA, a window, a softcap, q8_0 K/V decoded to
    f16 (within the loops' tolerance; q, K and the probabilities rounded to f16 cost f16 K/V 6e-4 at 512 rows, where
    the loops' f32 products are within 1e-6). One case: each is a PoCL compile of seconds; its heads are
    test_attention_tiles' (their K/V store kernel compiles once). Tiles of 16 query rows (the default) and of 32
    (knob q_tile: two 16-row tiles of each fragment)."""
    gpu_shaped(rt, 128, sampled=False)
    knobs = {"tiles": 1, "tiles_above": 0, "mma": 1, "q_tile": q_tile, "k_tile": 32}
    launches = _check_attention(rt, "q8_0", 3, 10, 30.0, 128, 560, knobs, (512, 33, 7, 1), 3)
    kern = launches[1].kernel
    assert dict(kern.knobs)["mma"] == 1 and len(kern.fragments) == 3  # scores and two 32-column output fragments


def test_attention_tile_products_by_default_on_matrix_units():
    """Knob mma "auto": the tile products where the target's policy has matrix units, in the largest tiles whose
    local arrays fit (fragments in registers there); the loops elsewhere, and where no tile-product tiles fit."""
    from polystrata.codegen.cuda import MMA_SYNC

    def tiles(matrix_units: bool, d: int, mma="auto") -> tuple[dict, int]:
        g = _attention_graph(8, 2, d)
        ctx = recipe_context(g, n_ctx=4096, lanes=128, matrix_units=matrix_units)
        ctx.t_max, ctx.knobs = 512, {"attention": {"mma": mma}}
        kern = recipe("attention").lower(g.nodes, ctx)[1].kernel
        assert MMA_SYNC.takes(kern) == (dict(kern.knobs).get("mma") == 1)  # cuda's unit: native, not local memory
        return dict(kern.knobs), kern.lanes

    # With tile products, a warp per 16 x 16 tile of a fragment at most (whole hardware tiles for every unit).
    assert tiles(True, 128) == ({"tiles": 1, "q_tile": 16, "k_tile": 32, "mma": 1}, 64)
    assert tiles(True, 256) == ({"tiles": 1, "q_tile": 16, "k_tile": 16, "mma": 1}, 32)  # gemma3's heads
    assert tiles(True, 128, 0) == ({"tiles": 1, "q_tile": 16, "k_tile": 32}, 128)
    assert tiles(False, 128) == ({"tiles": 1, "q_tile": 16, "k_tile": 32}, 128)
    assert tiles(False, 256, 1) == ({"tiles": 1, "q_tile": 8, "k_tile": 16}, 128)  # portable fragments: none fit


def test_attention_tiles_or_rows_by_the_step(rt):
    """A plan for steps of up to 16 rows with tiles above 5: both kernels, each running only for its steps (the
    other's output, poisoned, would spoil the result), a 13-row prefill in tiles and then 1- to 5-row steps by
    rows, the row kernels' split-K combine not providing the int8 activations (the tiles do not write them)."""
    gpu_shaped(rt, 128, sampled=False)
    knobs = {"tiles": 1, "tiles_above": 5, "q_tile": 4, "k_tile": 8}
    launches = _check_attention(rt, "q8_0", 2, 0, 0.0, 128, 128, knobs, (13, 1, 5, 6), 17)  # 2 runs of keys
    assert [la.kernel.name.rsplit("_", 1)[-1] for la in launches[1:]] == ["gt5", "le5", "le5"]
    assert not launches[-1].provides


@pytest.mark.parametrize("kv,gqa,window,lanes,knobs", [
    ("f16", 1, 0, 1, {"splits": 1}), ("q8_0", 3, 4, 128, {"splits": 4}),
    ("q8_0", 3, 4, 128, {"tiles": 1, "tiles_above": 0, "q_tile": 4, "k_tile": 8}),
    ("q8_0", 3, 4, 128, {"tiles": 1, "tiles_above": 0, "q_tile": 4, "k_tile": 8, "tile_splits": 3})],
    ids=["lanes1", "lanes128-split4", "lanes128-tiles", "lanes128-tiles-split3"])
def test_attention_batched_sequences(rt, kv, gqa, window, lanes, knobs):
    """Rows of several sequences in one step (batched decoding): each row's K and V go to its sequence's cache
    rows (`starts[t] + positions[t]`) and it attends over those only, as if its sequence ran alone (one reference
    executor per sequence); the sequences are prefilled one by one, then decoded together in varying order, then
    rows of one sequence apart in a step. In tiles, a tile holding rows of several sequences takes a pass a
    sequence."""
    if lanes > 1 and rt.lanes == 1:
        pytest.skip("GPU-shaped kernels")
    hkv, d, n_ctx = 2, 64, 32
    hq = hkv * gqa
    g = _attention_graph(hq, hkv, d, window)
    ctx = recipe_context(g, kv=kv, n_ctx=n_ctx, lanes=lanes)
    ctx.knobs = {"attention": knobs}
    launches = recipe("attention").lower(g.nodes, ctx)
    fmt = KV_FORMATS[kv]
    kvb = n_ctx * row_bytes(fmt, hkv * d)
    keep = {"kv.0.k": rt.alloc((kvb,), "u8"), "kv.0.v": rt.alloc((kvb,), "u8")}
    base = [0, 10, 20]  # the sequences' first cache rows: 10, 10 and 12 rows each
    alone = [R.ReferenceExecutor({}, n_ctx) for _ in base]
    n_past = [0, 0, 0]
    rng = np.random.default_rng(5)
    steps = [[(2, 7)], [(0, 5)], [(1, 3)], [(2, 1), (0, 1), (1, 1)], [(1, 1), (2, 1), (0, 1)], [(0, 2), (2, 1)],
             [(1, 1), (2, 1), (1, 2)]]
    for step in steps:
        seqs = [s for s, n in step for _ in range(n)]
        fed = dict.fromkeys(seqs, 0)  # a sequence's rows in this step so far: its positions go on from there
        pv = np.zeros(len(seqs), np.int32)
        for i, s in enumerate(seqs):
            pv[i], fed[s] = n_past[s] + fed[s], fed[s] + 1
        t = len(seqs)
        qv, kvv, vv = (rng.standard_normal((t, h, d)).astype(np.float32) for h in (hq, hkv, hkv))
        kq = dequantize(fmt, quantize(fmt, kvv.reshape(t, -1)), (t, hkv * d)).reshape(kvv.shape)
        vq = dequantize(fmt, quantize(fmt, vv.reshape(t, -1)), (t, hkv * d)).reshape(vv.shape)
        sb, so = plan_scratch(ctx)
        out = run_launches(rt, launches, {"q": qv.reshape(-1), "k": kvv.reshape(-1), "v": vv.reshape(-1),
                                           "positions": pv, "starts": np.asarray([base[s] for s in seqs], np.int32),
                                           **sb}, {"T": t}, {"o": ((t, hq, d), "f32"), **so}, keep)["o"]
        for s, n in fed.items():
            rows = np.flatnonzero(np.asarray(seqs) == s)
            ref = R._IMPLS["attention"](alone[s], g.nodes[0], [qv[rows], kq[rows], vq[rows], pv[rows]])
            np.testing.assert_allclose(out[rows], ref, atol=1e-4 if kv == "f16" else 0.03, rtol=1e-3)
            n_past[s] += n


def test_attention_splits_grow_with_the_context_in_one_token_steps():
    """splits "auto": on GPUs up to 8 runs, and enough that none holds more than DECODE_RUN_KEYS keys (one-token
    plans: flash-decoding) or PREFILL_RUN_KEYS keys at a full context, each group taking the 4 query heads of a KV
    head beyond LONG_CONTEXT (heads "auto"); on the CPU one group per head. All by the key span, not n_ctx. Plans
    with steps of more than TILES_ABOVE rows on GPUs add the tiles kernel for those."""
    from polystrata.codegen.recipes.attention import (
        DECODE_RUN_KEYS,
        LONG_CONTEXT,
        MAX_DECODE_RUNS,
        MIN_RUN_KEYS,
        PREFILL_RUN_KEYS,
        key_span,
    )

    g = _attention_graph(32, 8, 128)

    def attn(lanes, t_max, n_ctx):
        ctx = recipe_context(g, n_ctx=n_ctx, lanes=lanes)
        ctx.t_max = t_max
        launches = recipe("attention").lower(g.nodes, ctx)
        return dict(launches[1].kernel.knobs), len(launches)

    n_ctx = 32768 + 64
    span = key_span(n_ctx)
    assert span == 33792
    runs = {"two_pass": 1, "min_run": MIN_RUN_KEYS}
    assert attn(128, 1, n_ctx) == ({**runs, "splits": min(MAX_DECODE_RUNS, span // DECODE_RUN_KEYS), "heads": 4}, 3)
    assert attn(128, 16, n_ctx) == ({**runs, "splits": 9}, 3)  # 33792 / 4096, rounded up
    assert attn(128, 16, 131072) == ({**runs, "splits": 131072 // PREFILL_RUN_KEYS}, 3)
    # Steps of more than TILES_ABOVE rows: the tiles, at any context (then the row kernels for shorter steps).
    assert attn(128, 256, n_ctx) == ({"tiles": 1, "q_tile": 16, "k_tile": 32}, 4)
    assert attn(128, 256, 131072) == ({"tiles": 1, "q_tile": 16, "k_tile": 32}, 4)
    assert attn(128, 1, 131072) == ({**runs, "splits": MAX_DECODE_RUNS, "heads": 4}, 3)  # runs of 256 keys
    assert attn(128, 1, LONG_CONTEXT) == ({**runs, "splits": LONG_CONTEXT // DECODE_RUN_KEYS}, 3)
    assert attn(128, 1, 640) == ({**runs, "splits": 16}, 3)  # the span, 1024, in runs of 64
    assert attn(128, 1, 256) == ({**runs, "splits": 4}, 3)
    # The host groups a KV head's 4 query heads (policy attention.group_heads 2): prefill all 4; one-token steps
    # too while they leave 2 groups a token (8 here) ...
    assert attn(1, 1, n_ctx) == ({"two_pass": 1, "splits": 1, "heads": 4}, 2)
    assert attn(1, 16, n_ctx) == ({"two_pass": 1, "splits": 1, "heads": 4}, 2)
    g = _attention_graph(4, 1, 128)  # ... gemma3's 4 query heads of one KV head: 2 groups of 2 in one-token steps
    assert attn(1, 1, n_ctx) == ({"two_pass": 1, "splits": 1, "heads": 2}, 2)
    assert attn(1, 16, n_ctx) == ({"two_pass": 1, "splits": 1, "heads": 4}, 2)


def test_attention_kernels_depend_on_the_key_span_only():
    """Contexts within one key span compile to the same kernels (the kernel cache is shared); a GPU group's scores
    stay within 16 KiB of local memory at any context. (test_attention_runs checks kernels whose span, 64, exceeds
    the context, 40.)"""
    from polystrata.codegen.recipes.attention import key_span

    assert [key_span(n) for n in (1, 2, 40, 64, 65, 1024, 1025, 5000, 8192)] == \
        [1, 2, 64, 64, 128, 1024, 2048, 5120, 8192]
    g = _attention_graph(32, 8, 128)

    def kernels(lanes, t_max, n_ctx):
        ctx = recipe_context(g, n_ctx=n_ctx, lanes=lanes)
        ctx.t_max = t_max
        return [la.kernel for la in recipe("attention").lower(g.nodes, ctx)]

    for lanes, t_max in ((1, 16), (128, 16), (128, 1)):
        assert [k.fingerprint() for k in kernels(lanes, t_max, 4100)] == \
               [k.fingerprint() for k in kernels(lanes, t_max, 5120)]
        assert [k.fingerprint() for k in kernels(lanes, t_max, 5120)] != \
               [k.fingerprint() for k in kernels(lanes, t_max, 5121)]
    # The tiles (steps of many rows on GPUs) depend on nothing of the context.
    assert len({kernels(128, 256, n)[1].fingerprint() for n in (40, 5121, 131072)}) == 1
    for t_max in (1, 16):
        for n_ctx in (8192, 131072, 262144):
            attn = kernels(128, t_max, n_ctx)[1]
            assert sum(a.size for a in attn.local if a.name == "s") * 4 <= 16 << 10


@pytest.mark.parametrize("kv,mode,dims,lanes,qk_norm", [
    ("f16", "normal", 64, 1, False), ("q8_0", "neox", 32, 1, True), ("f16", "neox", 64, 128, True),
    ("q8_0", "normal", 48, 128, False)])
def test_rope_attention(rt, kv, mode, dims, lanes, qk_norm):
    """[per-head RMS norms of q and k,] rope(q), rope(k), attention fused (the K/V store norms and ropes q and K on
    the way) against the reference running the ops one by one: prefill, then decode steps. GPU-shaped: split-K,
    and the combine also writes the output as the output projection's int8 activations, the very codes of the
    quantize launch it provides."""
    gpu_shaped(rt, lanes, sampled=qk_norm)
    hkv, d, hq, n_ctx = 2, 64, 6, 32
    g = Graph("t")
    q = g.input("q", "f32", ("T", hq, d))
    k = g.input("k", "f32", ("T", hkv, d))
    v = g.input("v", "f32", ("T", hkv, d))
    pos = g.input("positions", "i32", ("T",))
    rope = dict(base=10000.0, dims=dims, mode=mode, freq_scale=0.5)
    rng = np.random.default_rng(3)
    weights = {}
    if qk_norm:
        weights = {"qn": rng.standard_normal(d).astype(np.float32), "kn": rng.standard_normal(d).astype(np.float32)}
        q = g.op("rms_norm", q, g.weight("qn", "F32", (d,)), eps=1e-6, name="qnorm")
        k = g.op("rms_norm", k, g.weight("kn", "F32", (d,)), eps=1e-6, name="knorm")
    qr = g.op("rope", q, pos, name="qr", **rope)
    kr = g.op("rope", k, pos, name="kr", **rope)
    g.op("attention", qr, kr, v, pos, layer=0, scale=0.125, window=0, softcap=0.0, name="o")
    ctx = recipe_context(g, kv=kv, n_ctx=n_ctx, lanes=lanes)
    ctx.knobs = {"attention": {"splits": 4 if lanes > 1 else 1}}
    launches = recipe("norm_rope_attention" if qk_norm else "rope_attention").lower(g.nodes, ctx)
    assert launches[0].kernel.name.startswith("rope_norm_kv_store" if qk_norm else "rope_kv_store")

    norm_nodes = {n.inputs[1].name: n for n in g.nodes if n.op == "rms_norm"}

    def normed(x, w):  # the reference's per-head RMS norm, where the graph has one
        return R._IMPLS["rms_norm"](None, norm_nodes[w], [x, weights[w]]) if qk_norm else x
    provided = launches[-1].provides
    assert len(provided) == (lanes > 1)
    fmt = KV_FORMATS[kv]
    kvb = n_ctx * row_bytes(fmt, hkv * d)
    ex = R.ReferenceExecutor({}, n_ctx)
    keep = {"kv.0.k": rt.alloc((kvb,), "u8"), "kv.0.v": rt.alloc((kvb,), "u8")}
    n_past = 0
    for t in (6, 1, 1):
        qv, kvv, vv = (rng.standard_normal((t, h, d)).astype(np.float32) for h in (hq, hkv, hkv))
        pv = np.arange(n_past, n_past + t, dtype=np.int32)
        krv = R.apply_rope(normed(kvv, "kn"), pv, dims, 10000.0, 0.5, mode)
        qrv = R.apply_rope(normed(qv, "qn"), pv, dims, 10000.0, 0.5, mode)
        kq = dequantize(fmt, quantize(fmt, krv.reshape(t, -1)), (t, hkv * d)).reshape(kvv.shape)
        vq = dequantize(fmt, quantize(fmt, vv.reshape(t, -1)), (t, hkv * d)).reshape(vv.shape)
        ref = R._IMPLS["attention"](ex, g.nodes[-1], [qrv, kq, vq, pv])
        sb, so = plan_scratch(ctx)
        out = run_launches(rt, launches, {"q": qv.reshape(-1), "k": kvv.reshape(-1), "v": vv.reshape(-1),
                                           "positions": pv, "starts": np.zeros(t, np.int32), **sb, **weights},
                            {"T": t},
                            {"o": ((t, hq, d), "f32"), "qr": ((t, hq, d), "f32"), **so,
                             **({"scratch.xq": (sb["scratch.xq"].shape, "u32")} if provided else {})}, keep)
        np.testing.assert_allclose(out["qr"], qrv, rtol=1e-4, atol=3e-5)
        np.testing.assert_allclose(out["o"], ref, atol=1e-4 if kv == "f16" else 0.02, rtol=1e-3)
        if provided:
            qouts = {"scratch.xq": ((t * hq * d // 4,), "u32"), "scratch.xd": ((t * hq * d // 32,), "f32")}
            sep = run_launches(rt, provided, {"o": out["o"].reshape(-1)}, {"T": t}, qouts)
            for name, ((n,), _) in qouts.items():
                np.testing.assert_array_equal(out[name][:n], sep[name])
        n_past += t

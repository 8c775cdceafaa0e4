"""What the recipe conformance tests (tests/test_recipes_*.py, one per module of codegen/recipes) share: the
runtimes they run on, weights of every format, one-kernel and whole-plan launches, and the oracles' rounding
models. Outputs are poisoned with NaN before each launch."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from suite_plugin import targets_under_test

from polystrata.codegen.policy import MMA_SYNC, SLICED_ON_WIDE_LOADS, SPLIT_KV_ON_WIDE_LOADS, matrix_kinds, shape_policy
from polystrata.codegen.recipes import RECIPES, Recipe, RecipeContext, load_all
from polystrata.ir.encode import quantize
from polystrata.ir.evaluate import dequantize
from polystrata.ir.formats import FORMATS, KV_FORMATS, QuantFormat
from polystrata.ir.graph import Graph
from polystrata.ir.layout import padded, repack, sliced
from polystrata.runtimes import reference as R
from polystrata.runtimes.base import eval_int
from polystrata.targets import runtime_class

FORMAT_NAMES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
           "IQ4_NL", "IQ4_XS"]
# The formats cuda keeps with rows sliced, by their `weight_format` names (NAME_S).
SLICED = [f"{name}_S" for name in SLICED_ON_WIDE_LOADS]


# What the runtimes of kernel cases take: their kernels launch a few times at small shapes, so compiling is their
# cost (PoCL on a cold cache: a GPU-shaped Q4_K matvec's 9 schedules 22.5 s, 6.8 s unoptimised). Whole models run
# optimised kernels (gemma3's parity run on opencl: 18 s, 92 s unoptimised).
CASE_RUNTIME_ARGS = {"opencl": {"build_options": ("-cl-opt-disable",)}}


def case_runtime(target: str):
    """A fresh runtime of `target` for kernel cases (`CASE_RUNTIME_ARGS`)."""
    return runtime_class(target)(**CASE_RUNTIME_ARGS.get(target, {}))


def target_runtimes():
    """A module-scoped fixture giving a runtime of each kernel target under test (`rt = target_runtimes()` in a
    test module). The run's kernel cache (suite_plugin.run_home) is shared: a kernel compiles once per run."""

    @pytest.fixture(scope="module", params=targets_under_test())
    def rt(request):
        return case_runtime(request.param)

    return rt


def gpu_shaped(rt, lanes: int, sampled: bool) -> None:
    """Skip a GPU-shaped case (`lanes` > 1) on a one-lane target unless it is `sampled`. One-lane targets run
    GPU-shaped kernels too (the IR's sequential semantics: lane loops become plain loops), but there each is a
    Numba compile of its own, so they run a sample of the cases: the targets with lanes run them all."""
    if lanes > 1 and rt.lanes == 1 and not sampled:
        pytest.skip("GPU-shaped case outside the one-lane sample")


def run(rt, kernel, buffers: dict[str, np.ndarray], scalars: dict, outs: dict[str, tuple]) -> dict[str, np.ndarray]:
    """Upload, poison outputs with NaN, launch once, download the outputs (name -> (shape, dtype))."""
    dev = {}
    for p in kernel.params:
        if hasattr(p, "dtype") and p.name in buffers:
            dev[p.name] = rt.upload(buffers[p.name])
    for name, (shape, dtype) in outs.items():
        if name in buffers:
            continue
        dev[name] = rt.alloc(shape, dtype)
        if dtype == "f32":
            rt.write(dev[name], np.full(int(np.prod(shape)), np.nan, np.float32))
    grid = [eval_int(g, scalars) for g in kernel.grid]
    rt.launch(rt.compile(kernel), rt.args_for(kernel, dev, scalars), grid)
    rt.sync()
    return {n: rt.download(dev[n], s, d) for n, (s, d) in outs.items()}


def weight_format(fmt_name: str, cols: int = 0) -> QuantFormat:
    """A GGUF format by name, or device layouts of one: NAME_A16, its blocks padded to 16 bytes (`padded`);
    NAME_S, its rows of `cols` sliced (`sliced`)."""
    name = fmt_name.removesuffix("_S")
    base, _, align = name.partition("_A")
    fmt = padded(FORMATS[base], int(align)) if align else FORMATS[name]
    return sliced(fmt, cols) if name != fmt_name else fmt


def weight(fmt_name: str, rows: int, cols: int, seed: int = 0):
    fmt = weight_format(fmt_name, cols)
    base = FORMATS[fmt_name.removesuffix("_S").partition("_A")[0]]
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    raw = repack(quantize(base, w), base, fmt)
    deq = dequantize(base, quantize(base, w), (rows, cols))
    buf = raw.reshape(-1).view(np.float32) if fmt.name == "F32" else raw.reshape(-1)
    return fmt, buf, deq


def int8_bound(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Per-output bound of the int8 activation rounding (plus float slack)."""
    xb = np.abs(x).reshape(x.shape[0], -1, 32).max(axis=-1) / 254.0  # half a step per 32-block
    xe = np.repeat(xb, 32, axis=1)
    return xe @ np.abs(w).T * 1.01 + 1e-4 * (np.abs(x) @ np.abs(w).T) + 1e-5


def recipe_context(g: Graph, kv="f16", n_ctx=64, formats=None, lanes=1, matrix_units=False, split_kv=False):
    """A recipe context over `g`'s values (lanes > 1: GPU-shaped, with warps of 32; `matrix_units`: a target
    whose policy says it has them, cuda's MMA_SYNC kinds; `split_kv`: one keeping the KV cache rows split, as
    wide-load targets do)."""
    names = {}
    for v in g.inputs:
        names[id(v)] = v.name
    for nd in g.nodes:
        names[id(nd.output)] = nd.output.name
    policy = None
    if matrix_units or split_kv:
        policy = replace(shape_policy(lanes, min(lanes, 32)),
                         matrix_kinds=matrix_kinds(MMA_SYNC) if matrix_units else (),
                         split_kv_formats=SPLIT_KV_ON_WIDE_LOADS if split_kv else ())
    return RecipeContext(lanes=lanes, subgroup=min(lanes, 32), kv_format=KV_FORMATS[kv], n_ctx=n_ctx,
                         buffer_names=names, weight_formats=formats or {}, t_max=16, policy=policy)


def recipe(name: str) -> Recipe:
    """The registered recipe called `name`."""
    load_all()
    return next(r for r in RECIPES if r.name == name)


def run_launches(rt, launches, bufs: dict[str, np.ndarray], scal: dict, outs: dict[str, tuple], keep=None):
    """Run launches over named plan buffers (numpy in, dict out); `keep` holds device buffers across calls."""
    dev = keep if keep is not None else {}
    for name, arr in bufs.items():
        dev[name] = rt.upload(arr)
    for name, (shape, dtype) in outs.items():
        if name not in dev:
            dev[name] = rt.alloc(shape, dtype)
        if dtype == "f32":
            rt.write(dev[name], np.full(int(np.prod(shape)), np.nan, np.float32))
    for la in launches:
        k = la.kernel
        bmap = dict(la.buffers)
        s = {n: (scal[v] if isinstance(v, str) else v) for n, v in la.scalars}
        args = rt.args_for(k, {p: dev[b] for p, b in bmap.items()}, s)
        rt.launch(rt.compile(k), args, [eval_int(gd, s) for gd in k.grid])
    rt.sync()
    return {n: rt.download(dev[n], sh, dt) for n, (sh, dt) in outs.items()}


def q8_rounded(x: np.ndarray) -> np.ndarray:
    """x as the GPU path's int8 activations see it: codes round(x * 127 / max|x|) per 32 values, times the scale."""
    xb = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    amax = np.abs(xb).max(axis=-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127.0) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    v = xb * inv
    codes = np.trunc(v + np.where(v < 0, -0.5, 0.5).astype(np.float32))
    return (codes.astype(np.float64) * (amax.astype(np.float64) / 127.0)).reshape(x.shape)


def plan_scratch(ctx):
    """Scratch buffers of the plan (MoE lists, split-K partials), poisoned: NaN (f32, through `outs`), garbage
    (i32, uploaded)."""
    bufs, outs = {}, {}
    for name, (dt, count) in ctx.scratch_buffers.items():
        if dt == "f32":
            outs[name] = ((count,), dt)
        else:
            bufs[name] = np.full(count, 0x3C3C3C3C, np.int32)
    return bufs, outs


def attention_prefill_case(kv: str, hq: int, hkv: int, d: int, t: int, window: int, softcap: float,
                           seed: int = 0) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """A prefill of t rows (positions 0..t-1, scale 1/8) for `attention_tiles.prefill_attention_kernel` run alone:
    its inputs (q, the K/V cache rows encoded in KV format `kv`, positions, starts) and the reference output
    (t, hq, d), which sees K and V as the cache holds them."""
    fmt = KV_FORMATS[kv]
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((t, h, d)).astype(np.float32) for h in (hq, hkv, hkv))
    kc, vc = (quantize(fmt, x.reshape(t, -1)) for x in (k, v))
    kq, vq = (dequantize(fmt, c, (t, hkv * d)).reshape(t, hkv, d) for c in (kc, vc))
    pos = np.arange(t, dtype=np.int32)
    ref = R._attend({"scale": 0.125, "softcap": softcap, "window": window}, q, kq, vq, pos, np.zeros_like(kq),
                    np.zeros_like(vq))
    inputs = {"q": q.reshape(-1), "kc": kc.reshape(-1), "vc": vc.reshape(-1), "positions": pos,
              "starts": np.zeros(t, np.int32)}
    return inputs, ref

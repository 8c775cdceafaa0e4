"""CUDA target: the conformance cases of `ir_constructs` (every IR construct, numpy references) run in numba-cuda's
simulator (no GPU needed) on the shared-memory Reduce and compared with numpy and the CPU target; the launch
paths (prepared launches, graph capture and replay, the binary cache); render-only checks of the shuffle path
and the wide loads. `scripts/cuda_selftest.py` runs the same cases on a real GPU, with shuffles.

The simulator must be chosen before numba.cuda is first imported, so the runtime tests run in a child pytest
(`NUMBA_ENABLE_CUDASIM=1`, `POLYSTRATA_CUDA_INNER=1`) of this same file: nothing leaks into other test modules.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from ir_constructs import (
    GRID,
    cases,
    check_case,
    copy_region_check,
    expert_cache_resize_check,
    grid_kernel,
    reduce_kernel,
    run,
    shared_kernel,
    tile_kernel,
)

from polystrata.codegen.cuda import render
from polystrata.errors import PolystrataError

INNER = os.environ.get("POLYSTRATA_CUDA_INNER") == "1"
inner = pytest.mark.skipif(not INNER, reason="runs in the simulator child process (test_simulator)")
pytestmark = pytest.mark.target("cuda")


# --- the simulator child process -------------------------------------------------------------------------


@pytest.mark.long
def test_simulator():
    """Every runtime test of this file, in a child pytest with the simulator on (isolated from this process)."""
    if INNER:
        pytest.skip("this is the child")
    if importlib.util.find_spec("numba_cuda") is None:
        pytest.skip("numba-cuda not installed (pip install -e '.[test]')")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", POLYSTRATA_CUDA_INNER="1")  # the run's kernel cache
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__],
                          capture_output=True, text=True, env=env, timeout=600, cwd=Path(__file__).parent)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def rt():
    from polystrata.runtimes.cuda import CUDARuntime

    r = CUDARuntime()
    assert r.simulator and not r.shuffles
    return r


@pytest.fixture(scope="module")
def cpu():
    from polystrata.runtimes.cpu import CPURuntime

    return CPURuntime()


@inner
@pytest.mark.parametrize("case", cases(), ids=lambda c: c[0])
def test_case_matches_numpy_and_cpu(rt, cpu, case):
    label, kernel, inputs, outputs, scalars, grid, ref = case
    got = run(rt, kernel, inputs, outputs, scalars, grid)
    check_case(got, ref, outputs, label)
    check_case(got, run(cpu, kernel, inputs, outputs, scalars, grid), outputs, label + " vs cpu")
    if kernel.name.startswith("red"):  # max is exact
        np.testing.assert_array_equal(got["m"], np.asarray(ref["m"], np.float32))


@inner
@pytest.mark.parametrize("unit,kind", [("mma_sync", "i8"), ("mma_sync", "f16"), ("mma_sync", "recipe"),
                                       ("mma_sync", "recipe_split"), ("mma_sync", "recipe_cols"),
                                       ("mma_sync", "recipe_blocks"), ("mma_sync", "u8f16"),
                                       ("mma_sync", "recipe_u8f16"), ("mfma", "i8"),
                                       ("mfma", "f16"), ("wmma", "f16"), ("wmma", "recipe"),
                                       ("mma_sync", "attention"), ("mfma", "attention"), ("wmma", "attention"),
                                       ("mma_sync", "attention_split")])
def test_native_tile_lowering_emulated(unit, kind, tmp_path):
    """The native lowering of tile products for cuda's MMA_SYNC unit and hip's gfx90a MFMA and gfx11 WMMA units
    (operand loads, accumulator layout, tiles dealt to subgroups), rendered by this printer with the instructions
    emulated from the vendors' fragment layouts (`matrix_emulation`), against numpy: the conformance cases and the
    prefill matmul recipe's kernel (int8 m16n8k32 on MMA_SYNC, Q4_K, whose groups have offsets; Q8_0 with K split
    in 3 parts, the last empty, added up here, and with the tile dealt to warps by columns and in blocks), and
    prefill attention's (f16 products of scores and of probabilities with V, a window and a softcap, GQA, q8_0
    K/V; 7 rows: a partial tile of rows and of keys)."""
    import importlib

    from ir_constructs import tile_case

    from polystrata.codegen.cuda import CUDAPrinter
    from polystrata.codegen.lanes import LaneAbilities
    from polystrata.codegen.policy import MATRIX_ARCHS, MMA_SYNC
    from polystrata.codegen.pyfamily import PyPrinter

    mu = MMA_SYNC if unit == "mma_sync" else MATRIX_ARCHS["gfx90a" if unit == "mfma" else "gfx1100"]

    class Emulated(CUDAPrinter):
        imports = CUDAPrinter.imports + ("from matrix_emulation import mma_s8_k32, mma_s8_k16, mma_f16_k16, "
                                         "mma_u8f16_k16, "
                                         "__builtin_amdgcn_mfma_i32_16x16x16i8, "
                                         "__builtin_amdgcn_mfma_f32_16x16x16f16, "
                                         "__builtin_amdgcn_wmma_i32_16x16x16_iu8_w32, "
                                         "__builtin_amdgcn_wmma_f32_16x16x16_f16_w32\n")

        def __init__(self, k):
            PyPrinter.__init__(self, k, LaneAbilities(several=True, matrix=mu))
            self.native = False

    if kind == "recipe_u8f16":
        from recipe_cases import weight
        from test_recipes_tile_mma import u8f16_reference

        from polystrata.codegen.recipes.tile_mma import tile_mma_kernel

        fmt, wb, wd = weight("Q4_K_S", 30, 256)
        kernel = tile_mma_kernel("t_mma_emu_u8f16", [fmt], 30, 256, rows=32, tokens=16, chunk=64, lanes=64,
                                 u8f16=True)
        x = np.random.default_rng(3).standard_normal((7, 256)).astype(np.float32)
        inputs, outputs, scalars, grid = {"x": x.reshape(-1), "w0": wb}, {"y": (7 * 30, "f32")}, {"T": 7}, (1, 1)
        want, bound = u8f16_reference(x, wd)
    elif kind.startswith("recipe"):
        from recipe_cases import q8_rounded, weight

        from polystrata.codegen.recipes.tile_mma import tile_mma_kernel

        fmt, wb, wd = weight("Q4_K_S" if kind == "recipe" else "Q8_0", 30, 256)
        parts = 3 if kind == "recipe_split" else 1
        # Blocks need 4 tiles a warp (32 x 32: blocks of 2 x 2); the others keep 2 (32 x 16).
        tile = dict(rows=32, tokens=32 if kind == "recipe_blocks" else 16, chunk=64, lanes=64, split=parts)
        deal = {"recipe_cols": "cols", "recipe_blocks": "blocks"}.get(kind, "rows")
        kernel = tile_mma_kernel(f"t_mma_emu{parts}_{kind}", [fmt], 30, 256, deal=deal, **tile)
        if deal == "blocks":  # not the rows' dealing under another name
            rows_dealt = tile_mma_kernel(f"t_mma_emu{parts}_{kind}", [fmt], 30, 256, **tile)
            assert Emulated(kernel).render() != Emulated(rows_dealt).render()
        x = np.random.default_rng(3).standard_normal((7, 256)).astype(np.float32)
        codes = np.round(q8_rounded(x) / (np.abs(x).reshape(7, 8, 32).max(-1, keepdims=True).repeat(32, -1)
                                          .reshape(7, 256) / 127)).astype(np.int8)
        inputs = {"xq": codes.view(np.uint32).reshape(-1), "w0": wb,
                  "xd": (np.abs(x).reshape(7, 8, 32).max(-1) / 127).astype(np.float32).reshape(-1)}
        outputs, scalars, grid = {"yp" if parts > 1 else "y": (parts * 7 * 30, "f32")}, {"T": 7}, (1, parts)
        want = {"y": (q8_rounded(x) @ wd.T).reshape(-1)}
    elif kind.startswith("attention"):
        from recipe_cases import attention_prefill_case

        from polystrata.codegen.format_analysis import widen
        from polystrata.codegen.recipes.attention import scaled_score
        from polystrata.codegen.recipes.attention_tiles import prefill_attention_kernel
        from polystrata.ir.formats import KV_FORMATS

        fmt = widen(KV_FORMATS["f16"], 32)  # f16 K/V in blocks of 32, as the recipe decodes them
        if kind == "attention":
            kernel = prefill_attention_kernel("attn_emu", fmt, fmt, 2, 1, 32, 32,
                                              lambda x: scaled_score(x, 0.125, 30.0), 5, 64, 16, 32, mma=True)
            inputs, ref = attention_prefill_case("f16", 2, 1, 32, 7, 5, 30.0, seed=2)
            outputs, scalars, grid, want = {"out": (ref.size, "f32")}, {"T": 7}, (1, 2), {"out": ref.reshape(-1)}
        else:  # the keys of 40 rows in 2 parts (knob tile_splits), partials added up here as the combine does
            kernel = prefill_attention_kernel("attn_emu_k2", fmt, fmt, 1, 1, 32, 32,
                                              lambda x: scaled_score(x, 0.125, 30.0), 0, 64, 16, 32, mma=True,
                                              splits=2)
            inputs, ref = attention_prefill_case("f16", 1, 1, 32, 40, 0, 30.0, seed=2)
            outputs = {"po": (ref.size * 2, "f32"), "pm": (ref.size // 16, "f32"), "pz": (ref.size // 16, "f32")}
            scalars, grid, want = {"T": 40}, (3, 1, 2), {"out": ref.reshape(-1)}
    else:
        rows = {"f16": 20, "u8f16": 40}.get(kind, 50)
        label, kernel, inputs, outputs, scalars, grid, want = tile_case(kind, rows, 10)
    src = Emulated(kernel).render()
    assert {"mma_sync": "= mma_", "mfma": "= __builtin_amdgcn_mfma", "wmma": "= __builtin_amdgcn_wmma"}[unit] in src
    (tmp_path / f"emu_{unit}_{kind}.py").write_text(src)
    sys.path.insert(0, str(tmp_path))
    try:
        mod = importlib.import_module(f"emu_{unit}_{kind}")
    finally:
        sys.path.remove(str(tmp_path))
    arrays = {name: np.ascontiguousarray(a) for name, a in inputs.items()}
    for name, (size, dt) in outputs.items():
        arrays[name] = np.full(size, np.nan, np.float32) if dt == "f32" else np.full(size, -1, np.int32)
    args = [arrays[p.name] if hasattr(p, "out") else scalars[p.name] for p in kernel.params]
    getattr(mod, kernel.name)[grid, kernel.lanes](*args)
    if kind == "recipe_split":  # the parts added up as split_sum_kernel does
        arrays["y"], outputs = arrays["yp"].reshape(3, -1).sum(0), {"y": (7 * 30, "f32")}
    if kind == "attention_split":  # as attention_combine_kernel: weights exp(m_part - max)
        m, z, o = arrays["pm"].reshape(-1, 2), arrays["pz"].reshape(-1, 2), arrays["po"].reshape(-1, 2, 32)
        w = np.exp(m - m.max(1, keepdims=True))
        arrays["out"] = ((o * w[..., None]).sum(1) / (z * w).sum(1, keepdims=True)).reshape(-1)
    if kind == "recipe_u8f16":
        assert np.all(np.abs(arrays["y"].reshape(7, 30) - want) <= bound), unit
    elif kind.startswith("attention"):  # q, K, the probabilities rounded to f16: absolute error
        np.testing.assert_allclose(arrays["out"], want["out"], atol=2e-3, rtol=1e-3, err_msg=unit)
    else:
        check_case({name: arrays[name] for name in outputs}, want, outputs, f"{unit} {kind}", tol=1e-4)


@inner
def test_prepared_launch_and_graph_recording(rt):
    kern = reduce_kernel(32)
    x = np.arange(40, dtype=np.float32)
    s, m = rt.upload(np.full(1, np.nan, np.float32)), rt.upload(np.full(1, np.nan, np.float32))
    xb = rt.upload(x)
    ck = rt.compile(kern)
    h = rt.prepare(ck, rt.args_for(kern, {"x": xb, "s": s, "m": m}, {"n": 40, "rows": 1}), (1,))
    rt.begin_capture()
    rt.launch_prepared(h)
    graph = rt.end_capture()
    assert np.isnan(rt.download(s, (1,), "f32")[0])  # captured, not run
    rt.replay(graph)
    assert rt.download(s, (1,), "f32")[0] == x.sum() and rt.download(m, (1,), "f32")[0] == 78
    rt.write(xb, np.ones(40, np.float32))  # a replay sees new buffer contents
    rt.replay(graph)
    assert rt.download(s, (1,), "f32")[0] == 40
    with pytest.raises(PolystrataError):
        rt.end_capture()


@inner
def test_edited_cached_kernel_is_rebuilt(monkeypatch, tmp_path, capsys):
    """The kernel cache's check (tests/test_kernel_cache.py) on this target: an edited source is rebuilt."""
    from test_kernel_cache import EDITED_PY, check_rebuilt

    from polystrata.runtimes.cuda import CUDARuntime

    monkeypatch.setenv("POLYSTRATA_HOME", str(tmp_path))
    check_rebuilt(CUDARuntime, EDITED_PY, capsys)


@inner
def test_binary_cache_hit_in_fresh_runtime(rt):
    from polystrata.runtimes.cuda import CUDARuntime

    kern = reduce_kernel(8)
    rt.compile(kern)
    fresh = CUDARuntime()
    ck = fresh.compile(kern)
    assert ck.cached and fresh.cache_hits == 1 and fresh.cache_misses == 0
    out = run(fresh, kern, {"x": np.arange(10, dtype=np.float32)}, {"s": (1, "f32"), "m": (1, "f32")},
              {"n": 10, "rows": 1}, (1,))
    assert out["s"][0] == 45 and out["m"][0] == 18


@inner
def test_buffers_and_empty_grid(rt):
    buf = rt.alloc((5,), "f16")
    rt.write(buf, np.array([1, 2, 3], np.float16))
    np.testing.assert_array_equal(rt.download(buf, (5,), "f16"), [1, 2, 3, 0, 0])
    assert rt.download(rt.upload(np.zeros(0, np.float32)), (0,), "f32").size == 0
    rows = rt.upload(np.arange(12, dtype=np.float32))  # 4 rows of 3: reads at an offset
    np.testing.assert_array_equal(rt.download_rows(rows, 3, [0, 2, 3], "f32"), [[0, 1, 2], [6, 7, 8], [9, 10, 11]])
    out = run(rt, grid_kernel(), {}, {"y": (10 * np.prod(GRID), "i32")}, {}, (0, *GRID[1:]))
    assert out["y"].view(np.uint32).min() == 0xFFFFFFFF  # nothing launched
    assert rt.memory_info() is None and rt.lanes == 128 and rt.subgroup == 32


@inner
def test_copy_async_into_a_region(rt):
    assert copy_region_check(rt)


@inner
def test_expert_cache_resize(rt):
    """A resized expert cache frees its old slot buffers before allocating the new (`CUDARuntime.free`)."""
    assert expert_cache_resize_check(rt)


# --- render-only checks (this process: no numba.cuda import) ---------------------------------------------


@pytest.mark.parametrize("lanes", [32, 64, 128])
def test_shuffle_path_renders(lanes):
    for kern in (reduce_kernel(lanes), shared_kernel(lanes)):
        src = render(kern, shuffles=True)
        ast.parse(src)
        assert "cuda.shfl_down_sync(0xFFFFFFFF" in src
        if kern.name.startswith("red"):
            assert "max(_acc_mx, cuda.shfl_down_sync" in src
        assert ("_red = cuda.shared.array" in src) == (lanes > 32)
        assert "shfl" not in render(kern, shuffles=False)
    # Not a whole number of warps: the shared-memory tree even when shuffles are asked for.
    assert "shfl" not in render(reduce_kernel(24), shuffles=True)


def test_wide_loads_render():
    """The runs-layout Q4_K matvec renders its 16-byte-aligned promises as the intrinsics that declare them (NVVM
    merges each run into one vector load), and cuda plans choose runs."""
    from polystrata.codegen.recipes.linear import matvec_q8_kernel
    from polystrata.ir.formats import FORMATS

    kern = matvec_q8_kernel("t_wide", [FORMATS["Q4_K"]], 64, 1024, tokens=1, lanes=32, runs=1)
    src = render(kern, shuffles=True, native=True)
    ast.parse(src)
    assert "load_u32_a16(w0, " in src and "load_a16(xq, " in src
    assert "load_a16" not in render(kern, shuffles=True)  # the simulator's portable loads
    from polystrata.runtimes.cuda import CUDARuntime

    assert CUDARuntime.wide_loads


def test_one_pass_lowering_scan_matches_numba_cuda(tmp_path):
    """The runtime's replacement for numba-cuda's quadratic scan for singly assigned variables finds exactly the
    set numba-cuda's own finds, on the lowering of a generated Q4_K matvec (both run on every function
    lowered; NVVM, which comes after lowering, is not needed)."""
    if INNER or importlib.util.find_spec("numba_cuda") is None:
        pytest.skip("needs numba-cuda outside the simulator")
    from numba import cuda
    from numba.cuda import lowering

    from polystrata.codegen.recipes.linear import matvec_q8_kernel
    from polystrata.ir.formats import FORMATS
    from polystrata.runtimes import numba_ssa
    from polystrata.runtimes.base import numba_signature
    from polystrata.runtimes.numba_ssa import singly_assigned_in_one_pass

    installed = lowering.Lower._find_singly_assigned_variable
    theirs = numba_ssa.numba_cuda_scan or installed  # replaced already where a CUDA runtime was made
    assert theirs is not singly_assigned_in_one_pass
    agree = []

    def both(lower):
        theirs(lower)
        want = set(lower._singly_assigned_vars)
        singly_assigned_in_one_pass(lower)
        agree.append((len(want), want == lower._singly_assigned_vars))

    kern = matvec_q8_kernel("t_scan", [FORMATS["Q4_K"]], 64, 512, tokens=1, lanes=32, runs=1)
    path = tmp_path / "k_scan.py"
    path.write_text(render(kern, shuffles=True, native=True))
    spec = importlib.util.spec_from_file_location("polystrata_t_scan", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    lowering.Lower._find_singly_assigned_variable = both
    try:
        cuda.compile_ptx(getattr(module, kern.name).py_func, numba_signature(kern), cc=(9, 0))
    except Exception:  # noqa: BLE001 - without NVVM the compile stops after lowering, all this test needs
        pass
    finally:
        lowering.Lower._find_singly_assigned_variable = installed
    assert agree and all(same for _, same in agree), agree
    assert max(n for n, _ in agree) > 100  # a real kernel: hundreds of register variables



@inner
def test_repeated_reads_are_rendered_once_per_run(rt):
    """The cuda printer reads a load repeated within a run of straight-line statements once (a temporary), but
    reads again after a store (the output may be the input: here it is) and after the index's variable changes."""
    from polystrata.ir.expr import Const
    from polystrata.ir.kernel import Assign, Buf, Decl, Kernel, Let, Load, Store, Var

    g0, i, a, b, c, d = (Var(v) for v in ("g0", "i", "a", "b", "c", "d"))
    kern = Kernel("cse", (Buf("x", "i32"), Buf("y", "i32", True), Buf("z", "i32", True)), (Const(1),), (
        Let("a", Load("x", g0) + Load("x", g0)),
        Store("y", g0, a),  # y is x: x[0] doubles
        Let("b", Load("x", g0) + Load("x", g0)),
        Store("y", g0 + 1, b),
        Decl("i", "i32", g0 + 2),
        Let("c", Load("z", i) * Load("z", i)),
        Assign("i", i + 1),
        Let("d", Load("z", i) * Load("z", i)),
        Store("z", Const(0), c),
        Store("z", Const(1), d),
    ))
    source = render(kern)
    assert source.count("x[np.uint64(g0)]") == 2 and source.count("z[np.uint64(i)]") == 2, source
    x, z = rt.upload(np.array([3, 0], np.int32)), rt.upload(np.array([0, 0, 5, 7], np.int32))
    rt.launch(rt.compile(kern), rt.args_for(kern, {"x": x, "y": x, "z": z}, {}), (1,))
    assert rt.download(x, (2,), "i32").tolist() == [6, 12]
    assert rt.download(z, (4,), "i32").tolist() == [25, 49, 5, 7]


@inner
def test_shared_reads_leave_a_matvec_unchanged(rt, monkeypatch):
    """A Q4_K matvec of two tokens with each weight word decoded once for both (`reuse`: the kernel that repeats
    its reads most) gives, bit for bit, the same outputs rendered with shared reads and without."""
    from polystrata.codegen.cuda import CUDAPrinter
    from polystrata.codegen.recipes.linear import matvec_q8_kernel
    from polystrata.ir.encode import quantize
    from polystrata.ir.formats import FORMATS

    n, k, tokens = 4, 256, 2
    kern = matvec_q8_kernel("t_shared", [FORMATS["Q4_K"]], n, k, tokens=tokens, lanes=32, runs=1, reuse=True)
    rng = np.random.default_rng(0)
    inputs = {"xq": rng.integers(0, 2**32, tokens * k // 4, dtype=np.uint32),
              "xd": rng.random(tokens * k // 32, dtype=np.float32),
              "w0": quantize(FORMATS["Q4_K"], rng.standard_normal((n, k)).astype(np.float32)).reshape(-1)}
    got = {}
    for share in (True, False):
        monkeypatch.setattr(CUDAPrinter, "share_reads", share)
        assert ("_cse" in rt.render(kern)) == share
        got[share] = run(rt, kern, inputs, {"y": (tokens * n, "f32")}, {"T": tokens}, grid=(n, 1))["y"]
    assert np.isfinite(got[True]).all()
    np.testing.assert_array_equal(got[True], got[False])

def test_barriers_follow_the_model():
    src = render(shared_kernel(64))
    body = src[src.index("def shared64"):]
    assert body.count("cuda.syncthreads()") >= 4
    # A uniform store into a local array is done by lane 0 and published by a barrier.
    assert "if (_lid == 0):\n        u[np.uint64(0)] = " in body
    assert "u[np.uint64(0)] = (s + np.float32(1.0))\n    cuda.syncthreads()" in body
    # The last LaneFor rewrites t, which no uniform code reads: no extra barrier before it.
    assert "tot[np.uint64(g0)] = u[np.uint64(0)]\n    for j in range(_lid, n, 64):\n        t[np.uint64(j)]" in body
    ast.parse(src)


def test_no_gpu_is_a_clear_error():
    code = ("from polystrata.runtimes.cuda import CUDARuntime\nfrom polystrata.errors import PolystrataError\n"
            "try:\n    CUDARuntime()\n    print('GPU')\nexcept PolystrataError as e:\n    print(e)\n")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120).stdout
    if out.strip() == "GPU":
        pytest.skip("a CUDA GPU is present")
    assert out.startswith("no CUDA GPU found: "), out


_PTX_CHILD = r"""
import json, re, shutil, subprocess, sys, tempfile
from pathlib import Path
sys.path.insert(0, sys.argv[1])
try:
    from numba.cuda.cudadrv.nvvm import NVVM
    NVVM()
except Exception as e:
    print(json.dumps({"skip": f"no NVVM: {e}"}))
    sys.exit(0)
import yaml
from ir_constructs import tile_kernel
from polystrata.cli import main
from polystrata.codegen.recipes.tile_mma import tile_mma_kernel
from polystrata.ir.formats import FORMATS
from polystrata.runtimes.cuda import CUDARuntime
from polystrata.synth import synth_model
out, tmp = {}, Path(tempfile.mkdtemp())
rt = CUDARuntime(arch="sm_80")  # compile-only without a GPU
kernels = [tile_mma_kernel("t_mma_ptx", [FORMATS["Q8_0"]], 64, 256, rows=32, tokens=16, chunk=64, lanes=64),
           tile_kernel("f16"),
           tile_mma_kernel("t_u8f16_ptx", [FORMATS["Q4_K"]], 64, 256, rows=32, tokens=16, chunk=64, lanes=64,
                           split=2, u8f16=True),
           tile_mma_kernel("t_q4k_ptx", [FORMATS["Q4_K"]], 64, 512, rows=64, tokens=32, chunk=128, lanes=128)]
ptxas = shutil.which("ptxas") or shutil.which("/usr/local/cuda/bin/ptxas")
for k in kernels:
    ck = rt.compile(k)
    ptx = ck.entry.path.read_text()
    res = {"mma": sorted(set(re.findall(r"mma\.sync\.aligned\.[\w.]+", ptx))), "entries": ptx.count(".entry "),
           "target": re.search(r"^\.target (\w+)", ptx, re.M).group(1), "suffix": ck.entry.path.suffix,
           "loads": {w: ptx.count(f"ld.global.{w} ") for w in ("u32", "v4.u32")}}
    if ptxas:
        p = subprocess.run([ptxas, "-arch=sm_90", str(ck.entry.path), "-o", str(tmp / "k.cubin")],
                           capture_output=True, text=True)
        res["ptxas"] = p.returncode == 0 or p.stderr
    out[k.name] = res
# Programmatic launches: sm_90 PTX gets the grid-dependency wait ahead of its first instruction, sm_80 PTX none.
from polystrata.runtimes.cuda_driver import with_grid_dependency
ptx90 = CUDARuntime(arch="sm_90").compile(tile_kernel("f16")).entry.path.read_bytes()
waiting = with_grid_dependency(ptx90)
body = waiting.split(b")\n{", 1)[1].decode().splitlines()
first = next(i for i, line in enumerate(body) if line.strip() and not line.strip().startswith((".", "//")))
pdl = {"sm_80": with_grid_dependency(rt.compile(kernels[1]).entry.path.read_bytes()),
       "first": body[first].strip(), "next": body[first + 2].strip().split()[0],
       "rest": waiting.replace(b"\tgriddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;\n", b"") == ptx90}
if ptxas:
    (tmp / "w.ptx").write_bytes(waiting)
    p = subprocess.run([ptxas, "-arch=sm_90", str(tmp / "w.ptx"), "-o", str(tmp / "w.cubin")], capture_output=True,
                       text=True)
    pdl["ptxas"] = p.returncode == 0 or p.stderr
out["pdl"] = pdl
# A model compiled for sm_90 with a knob: every kernel of the artifact is PTX for sm_90, the knob in the manifest.
model = synth_model("llama", tmp / "tiny.gguf", preset="tiny", qtype="Q8_0", seed=0)
assert main(["compile", str(model), "--target", "cuda", "--arch", "sm_90", "-c", "64", "--knob", "matmul.tokens=4",
             "-o", str(tmp / "art")]) == 0
m = yaml.safe_load((tmp / "art" / "manifest.yaml").read_text())
kept = sorted(f.name for f in (tmp / "art" / "kernels").iterdir())
out["art"] = {"target": m["target"], "knobs": m["knobs"], "files": len(kept),
              "ptx": [f for f in kept if f.endswith(".ptx")], "records": [f for f in kept if f.endswith(".json")],
              "sm_90": all(".target sm_90" in (tmp / "art" / "kernels" / f).read_text() for f in kept
                           if f.endswith(".ptx")),
              "tokens": sorted({str(k["knobs"].get("tokens")) for k in m["kernels"]
                                if k["plan"] == "prefill" and k["name"].startswith(("matmul", "glu"))})}
print(json.dumps(out))
"""


def test_kernels_compile_to_ptx_without_a_gpu():
    """Without a GPU, a cuda runtime given an architecture compiles (NVVM) but runs nothing: each kernel's cache
    entry is its PTX, one kernel entry for that architecture. Tile products become mma.sync there (the recipe's
    int8 m16n8k32, the conformance f16 m16n8k16, the recipe's u8f16 as f16 m16n8k16 behind its byte permutes),
    and ptxas assembles them for sm_90 where it is installed. The Q4_K tile kernel's global words all come in
    16-byte loads (NVVM left a copy of its activation staging in 4-byte loads while element loads were addressed
    by elements: 8 of them, 32 sectors each on the H100).
    For programmatic launches, sm_90 PTX gets `griddepcontrol.wait` before its first instruction (sm_80 none).
    `compile --target cuda --arch sm_90` writes an artifact of such PTX, with its --knob in the manifest. In a
    child process (numba.cuda stays unimported here); skipped without NVVM (CI: numba-cuda without the CUDA
    toolkit). The numbers are checked on the GPU: the conformance cases (scripts/cuda_selftest.py)."""
    import json

    if INNER:
        pytest.skip("runs in the parent (it starts a process of its own)")

    proc = subprocess.run([sys.executable, "-c", _PTX_CHILD, str(Path(__file__).parent)], capture_output=True,
                          text=True, timeout=600, env=dict(os.environ, NUMBA_ENABLE_CUDASIM="0"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in res:
        pytest.skip(res["skip"])
    assert res["t_mma_ptx"]["mma"] == ["mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32"]
    assert res["tile_f16"]["mma"] == ["mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"]
    assert res["t_u8f16_ptx"]["mma"] == ["mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"]
    assert res["t_q4k_ptx"]["loads"]["u32"] == 0 < res["t_q4k_ptx"]["loads"]["v4.u32"], res["t_q4k_ptx"]
    for r in (res["t_mma_ptx"], res["tile_f16"], res["t_u8f16_ptx"], res["t_q4k_ptx"]):
        assert r["entries"] == 1 and r["target"] == "sm_80" and r["suffix"] == ".ptx"
        assert r.get("ptxas", True) is True, r
    art = res["art"]
    assert art["target"]["arch"] == "sm_90" and art["target"]["device"] == "sm_90 (compile only)"
    assert art["knobs"] == {"matmul": {"tokens": 4}} and art["tokens"] == ["4"]
    assert art["ptx"] and len(art["ptx"]) == len(art["records"]) and art["files"] == 2 * len(art["ptx"])
    assert art["sm_90"]
    assert "= mma_" not in render(tile_kernel("i8"), shuffles=True, native=True)  # no matrix unit asked for
    pdl = res["pdl"]
    assert pdl["sm_80"] is None and pdl["rest"] and pdl.get("ptxas", True) is True, pdl
    assert (pdl["first"], pdl["next"]) == ("griddepcontrol.wait;", "ld.param.u64"), pdl

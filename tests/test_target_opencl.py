"""OpenCL target: the conformance cases of `ir_constructs` (every IR construct) run on OpenCL and compared with
numpy and the CPU target (Numba), the subgroup and local-memory reduction paths, every f16 bit pattern and
rounding case, aligned loads, and the runtime's cache and errors. Skips when no OpenCL device exists (CI installs
pocl-opencl-icd)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest
from ir_constructs import GRID, ROWS, cases, check_case, f16_kernel, grid_kernel, reduce_kernel, run
from oclgrind import oclgrind_problems

from polystrata.codegen.opencl import render
from polystrata.errors import PolystrataError
from polystrata.ir.kernel import Buf, Call, Kernel, LaneFor, Load, Scalar, Store, Var

g0, n, j = (Var(v) for v in ("g0", "n", "j"))


pytestmark = pytest.mark.target("opencl")


@pytest.fixture(scope="module")
def rt():
    from recipe_cases import case_runtime

    try:
        return case_runtime("opencl")
    except PolystrataError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def cpu():
    from polystrata.runtimes.cpu import CPURuntime

    return CPURuntime()


def both(rt, cpu, kernel, inputs, outputs, scalars=None, grid=(1,), **kw):
    return run(rt, kernel, inputs, outputs, scalars, grid, **kw), run(cpu, kernel, inputs, outputs, scalars, grid)


# --- the conformance cases ----------------------------------------------------------------------------------


@pytest.mark.parametrize("case", cases(), ids=lambda c: c[0])
def test_case_matches_numpy_and_cpu(rt, cpu, case):
    label, kernel, inputs, outputs, scalars, grid, ref = case
    got, host = both(rt, cpu, kernel, inputs, outputs, scalars, grid)
    check_case(got, ref, outputs, label)
    check_case(got, host, outputs, label + " vs cpu")


def test_empty_grid_launches_nothing(rt):
    out = run(rt, grid_kernel(), {}, {"y": (10 * np.prod(GRID), "i32")}, {}, (0, *GRID[1:]))
    assert out["y"].view(np.uint32).min() == 0xFFFFFFFF


# --- reductions -------------------------------------------------------------------------------------------


def test_subgroup_and_local_paths(rt):
    kern = reduce_kernel(32)
    assert "sub_group_reduce_add" in render(kern, subgroups=True)
    assert "sub_group_reduce_max" in render(kern, subgroups=True)
    local = render(kern, subgroups=False)
    assert "sub_group" not in local and "ps_red" in local
    x = np.random.default_rng(1).standard_normal(2 * 100).astype(np.float32)
    paths = [False] + ([True] if rt.has_subgroups and rt.subgroup == 32 else [])
    for sg in paths:
        out = run(rt, kern, {"x": x}, {"s": (2, "f32"), "m": (2, "f32")}, {"n": 100, "rows": 2}, (2,), subgroups=sg)
        np.testing.assert_allclose(out["s"], x.reshape(2, 100).sum(1), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(out["m"], 2 * x.reshape(2, 100).max(1))


# --- f16 and intrinsics -----------------------------------------------------------------------------------


def _f16_specials() -> np.ndarray:
    edge = [0.0, -0.0, 1.0, 65504.0, 65519.99, 65520.0, 1e6, -1e6, np.inf, -np.inf, 6.1e-5, 5.96e-8, 2.98e-8,
            2.9802322e-08, 2.9802326e-08, 8.9406967e-08, 1e-10, -3e-6, 0.1, 1 / 3]
    rng = np.random.default_rng(6)
    rand = rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    near = (rng.integers(0, 2**16, 20000).astype(np.uint16).view(np.float16).astype(np.float32).view(np.uint32)
            + rng.integers(-4096, 4097, 20000).astype(np.uint32)).view(np.float32)  # near f16 ties
    return np.concatenate([np.array(edge, np.float32), rand, near]).astype(np.float32)


def _same_f16_bits(got: np.ndarray, want: np.ndarray) -> None:
    got, want = got.astype(np.uint16), want.astype(np.uint16)
    gnan = ((got & 0x7C00) == 0x7C00) & ((got & 0x3FF) != 0)
    wnan = ((want & 0x7C00) == 0x7C00) & ((want & 0x3FF) != 0)
    np.testing.assert_array_equal(gnan, wnan)
    np.testing.assert_array_equal(got[~wnan], want[~wnan])


@pytest.mark.parametrize("target", ["rt", "cpu"])
def test_f16_loads_and_stores(target, request):
    """`ir_constructs.f16_kernel` on 40000 rounding cases and random f16 patterns (NaNs included)."""
    rt = request.getfixturevalue(target)
    x = _f16_specials()
    x = x[~np.isnan(x)]
    hb = np.random.default_rng(7).integers(0, 2**16, x.size).astype(np.uint16)
    outs = {"y": (x.size, "f32"), "o": (x.size, "f16"), "p": (x.size, "u32"), "z": (1, "f32")}
    a = run(rt, f16_kernel(), {"h": hb, "x": x}, outs, {"n": x.size})
    with np.errstate(over="ignore"):
        want16 = x.astype(np.float16).view(np.uint16)
    _same_f16_bits(a["o"], want16)
    _same_f16_bits(a["p"], want16)
    wanty = hb.view(np.float16).astype(np.float32)
    finite = ~np.isnan(wanty)
    np.testing.assert_array_equal(a["y"][finite], wanty[finite])
    assert np.isnan(a["y"][~finite]).all()


@pytest.mark.parametrize("target", ["rt", "cpu"])
def test_f16_bits_to_f32_all_patterns(target, request):
    rt = request.getfixturevalue(target)
    kern = Kernel("h2f", (Buf("b", "u16"), Buf("y", "f32", True), Scalar("n")), (Var("rows"),),
                  (LaneFor("j", n, (Store("y", g0 * n + j, Call("f16_bits_to_f32", Load("b", g0 * n + j))),)),),
                  lanes=64)
    kern = Kernel(kern.name, kern.params + (ROWS,), kern.grid, kern.body, kern.lanes)
    bits = np.arange(65536, dtype=np.uint16)
    y = run(rt, kern, {"b": bits}, {"y": (65536, "f32")}, {"n": 1024, "rows": 64}, (64,))["y"]
    want = bits.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(y[~nan].view(np.uint32), want[~nan].view(np.uint32))  # -0, subnormals exact
    assert np.isnan(y[nan]).all()


@pytest.mark.parametrize("target", ["rt", "cpu"])
def test_f32_to_f16_bits_rne(target, request):
    rt = request.getfixturevalue(target)
    kern = Kernel("f2h", (Buf("x", "f32"), Buf("o", "u32", True), Scalar("n")), (1,),
                  (LaneFor("j", n, (Store("o", j, Call("f32_to_f16_bits", Load("x", j))),)),), lanes=64)
    x = _f16_specials()
    o = run(rt, kern, {"x": x}, {"o": (x.size, "u32")}, {"n": x.size})["o"]
    assert (o >> 16).max() == 0
    with np.errstate(over="ignore"):
        _same_f16_bits(o, x.astype(np.float16).view(np.uint16))


@pytest.mark.parametrize("align", [1, 2, 4, 8, 16])
def test_load_u32(rt, cpu, align):
    """`load_u32` at every promised alignment, and `Load` with an alignment promise (the same values)."""
    w = min(align // 4, 4) or 1  # the promise in u32 elements
    kern = Kernel("ldu32", (Buf("b", "u8"), Buf("u", "u32"), Buf("o", "u32", True), Buf("p", "u32", True),
                            Scalar("n")), (1,),
                  (LaneFor("j", n, (Store("o", j, Call("load_u32", Var("b"), j * align, align)),
                                    Store("p", j, Load("u", j * w, w)))),), lanes=16)
    raw = np.random.default_rng(9).integers(0, 256, align * 200 + 4).astype(np.uint8)
    words = np.random.default_rng(10).integers(0, 2**32, 200 * w, dtype=np.uint32)
    r, c = both(rt, cpu, kern, {"b": raw, "u": words}, {"o": (200, "u32"), "p": (200, "u32")}, {"n": 200})
    want = np.array([raw[i * align:i * align + 4].view("<u4")[0] for i in range(200)], np.uint32)
    for out in (r, c):
        np.testing.assert_array_equal(out["o"], want)
        np.testing.assert_array_equal(out["p"], words[::w])


# --- runtime plumbing -------------------------------------------------------------------------------------


def test_binary_cache_hit_in_fresh_runtime(rt):
    from recipe_cases import CASE_RUNTIME_ARGS

    from polystrata.runtimes.opencl import OpenCLRuntime

    kern = reduce_kernel(8)
    rt.compile(kern)
    fresh = OpenCLRuntime(rt.dev, **CASE_RUNTIME_ARGS["opencl"])
    ck = fresh.compile(kern)
    assert ck.cached and fresh.cache_hits == 1 and fresh.cache_misses == 0
    # Other build options (here none: optimised) are another binary, never the cached one.
    other = OpenCLRuntime(rt.dev)
    assert not other.compile(kern).cached and other.cache_misses == 1
    x = np.arange(10, dtype=np.float32)
    out = run(fresh, kern, {"x": x}, {"s": (1, "f32"), "m": (1, "f32")}, {"n": 10, "rows": 1})
    assert out["s"][0] == 45 and out["m"][0] == 18


def test_build_error_is_clear(rt, monkeypatch):
    kern = Kernel("broken", (Buf("y", "f32", True),), (1,), (Store("y", 0, 1.0),))
    monkeypatch.setattr(rt, "render", lambda k, subgroups=None: "__kernel void broken(__global float* y) { oops; }")
    with pytest.raises(PolystrataError, match="build of kernel broken failed"):
        rt.compile(kern)


def test_memory_and_buffers(rt):
    free, total = rt.memory_info()
    assert 0 < free <= total
    buf = rt.alloc((5,), "f16")
    rt.write(buf, np.array([1, 2, 3], np.float16))
    np.testing.assert_array_equal(rt.download(buf, (5,), "f16"), [1, 2, 3, 0, 0])
    rows = rt.upload(np.arange(12, dtype=np.float32))  # 4 rows of 3: reads at an offset
    np.testing.assert_array_equal(rt.download_rows(rows, 3, [0, 2, 3], "f32"), [[0, 1, 2], [6, 7, 8], [9, 10, 11]])


_OCLGRIND_SCRIPT = """
import sys, numpy as np
sys.path.insert(0, {tests!r})
import ir_constructs as t
from polystrata.runtimes.opencl import OpenCLRuntime
rt = OpenCLRuntime()
x = np.random.default_rng(0).random(3 * 40).astype(np.float32)
out = t.run(rt, t.shared_kernel(16), {{"x": x}}, {{"y": (120, "f32"), "tot": (3, "f32")}}, {{"n": 40, "rows": 3}}, (3,))
np.testing.assert_allclose(out["y"], t.shared_ref(x, 3, 40)[0], rtol=1e-5)
out = t.run(rt, t.reduce_kernel(24), {{"x": x}}, {{"s": (3, "f32"), "m": (3, "f32")}}, {{"n": 40, "rows": 3}}, (3,))
np.testing.assert_allclose(out["s"], x.reshape(3, 40).sum(1), rtol=1e-5)
q = np.arange(40, dtype=np.uint8)
out = t.run(rt, t.table_kernel(), {{"q": q}}, {{"y": (40, "f32")}}, {{"n": 40}})
np.testing.assert_array_equal(out["y"], np.array(t.TABLES["iq4nl"], np.float32)[q & 15] * 0.5)
print("OK")
"""


@pytest.mark.slow
def test_oclgrind_clean(tmp_path):
    script = textwrap.dedent(_OCLGRIND_SCRIPT.format(tests=str(Path(__file__).parent)))
    problems = oclgrind_problems(script, tmp_path, timeout=600)
    assert not problems, "\n\n".join(problems)

"""OpenCL target: hand-built kernels covering every IR construct, run on OpenCL and compared with the CPU target
(Numba) and numpy. Skips when no OpenCL device exists (CI installs pocl-opencl-icd)."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import numpy as np
import pytest
from oclgrind import oclgrind_problems

from polystrata.codegen.cpu import NUMPY_DTYPES
from polystrata.codegen.opencl import render
from polystrata.errors import PolystrataError
from polystrata.ir.kernel import (
    Assign,
    Buf,
    Call,
    Cast,
    Const,
    Decl,
    For,
    If,
    Kernel,
    LaneFor,
    Let,
    Load,
    LocalArray,
    Reduce,
    Scalar,
    Select,
    Store,
    ToF32,
    Var,
)
from polystrata.ir.quant import TABLES, Table

g0, g1, g2, n, j, k = (Var(v) for v in ("g0", "g1", "g2", "n", "j", "k"))


@pytest.fixture(scope="module", autouse=True)
def _home(tmp_path_factory):
    old = os.environ.get("POLYSTRATA_HOME")
    os.environ["POLYSTRATA_HOME"] = str(tmp_path_factory.mktemp("home"))
    yield
    if old is None:
        os.environ.pop("POLYSTRATA_HOME")
    else:
        os.environ["POLYSTRATA_HOME"] = old


@pytest.fixture(scope="module")
def rt(_home):
    from polystrata.runtimes.opencl import OpenCLRuntime

    try:
        return OpenCLRuntime()
    except PolystrataError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def cpu(_home):
    from polystrata.runtimes.cpu import CPURuntime

    return CPURuntime()


def run(r, kernel, inputs, outputs, scalars=None, grid=(1,), subgroups=None):
    """Launch `kernel` on runtime `r`; outputs (name -> (size, dtype)) start poisoned; returns their contents
    (f16 outputs as raw u16 bits)."""
    ck = r.compile(kernel) if subgroups is None else r.compile(kernel, subgroups=subgroups)
    bufs = {name: r.upload(np.ascontiguousarray(a)) for name, a in inputs.items()}
    for name, (size, dt) in outputs.items():
        # NaN for floats, all-ones bytes otherwise, in the storage dtype (the CPU target keeps the array's dtype).
        fill = np.full(size, np.nan, np.float32) if dt == "f32" else \
            np.full(size * _BYTES[dt], 0xFF, np.uint8).view(NUMPY_DTYPES[dt])
        bufs[name] = r.upload(fill)
    r.launch(ck, r.args_for(kernel, bufs, scalars or {}), grid)
    r.sync()
    return {name: r.download(bufs[name], (size,), "u16" if dt == "f16" else dt)
            for name, (size, dt) in outputs.items()}


_BYTES = {"f32": 4, "f16": 2, "i32": 4, "u32": 4, "i16": 2, "u16": 2, "i8": 1, "u8": 1}


def both(rt, cpu, kernel, inputs, outputs, scalars=None, grid=(1,), **kw):
    return run(rt, kernel, inputs, outputs, scalars, grid, **kw), run(cpu, kernel, inputs, outputs, scalars, grid)


# --- kernels (also used by the oclgrind script) -------------------------------------------------------------


ROWS = Scalar("rows")


def reduce_kernel(lanes: int) -> Kernel:
    """Per row g0 of x[rows, n]: s = sum of x, m = max of 2x (uniform stores of Reduce results)."""
    row = g0 * n
    return Kernel(f"red{lanes}", (Buf("x", "f32"), Buf("s", "f32", True), Buf("m", "f32", True), Scalar("n"), ROWS),
                  (Var("rows"),), (
        Reduce("sum", "+", "j", n, (Let("v", Load("x", row + j)),), Var("v")),
        Reduce("mx", "max", "j", n, (), Load("x", row + j) * 2.0),
        Store("s", g0, Var("sum")),
        Store("m", g0, Var("mx")),
    ), lanes=lanes)


def shared_kernel(lanes: int) -> Kernel:
    """LaneFor fills a local array (nested For inside), a Reduce reads it, a uniform local store and reads."""
    row = g0 * n
    params = (Buf("x", "f32"), Buf("y", "f32", True), Buf("tot", "f32", True), Scalar("n"), ROWS)
    return Kernel("shared", params, (Var("rows"),), (
        LaneFor("j", n, (
            Decl("acc", "f32", Const(0.0)),
            For("k", Const(0), Const(3), (Assign("acc", Var("acc") + Load("x", row + j) * ToF32(k + 1)),)),
            Store("t", j, Var("acc")),
        )),
        Reduce("s", "+", "j", n, (), Load("t", j)),
        Store("u", Const(0), Var("s") + 1.0),
        Let("inv", 1.0 / Load("u", 0)),
        LaneFor("j", n, (Store("y", row + j, Load("t", j) * Var("inv")),)),
        Store("tot", g0, Load("u", 0)),
    ), lanes=lanes, local=(LocalArray("t", "f32", 300), LocalArray("u", "f32", 1)))


def shared_ref(x, rows, n_):
    t = x.reshape(rows, n_).astype(np.float64) * 6
    u = t.sum(1) + 1
    return (t / u[:, None]).reshape(-1), u


# --- reductions -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lanes", [1, 16, 32, 64, 128, 24])
def test_reduce_sum_max(rt, lanes):
    kern = reduce_kernel(lanes)
    rng = np.random.default_rng(lanes)
    for n_ in sorted({0, 1, 5, max(lanes - 1, 1), lanes, lanes + 3, 3 * lanes + 7}):
        rows = 3
        x = rng.standard_normal(rows * n_).astype(np.float32)
        out = run(rt, kern, {"x": x}, {"s": (rows, "f32"), "m": (rows, "f32")}, {"n": n_, "rows": rows}, (rows,))
        xr = x.reshape(rows, n_)
        np.testing.assert_allclose(out["s"], xr.sum(1), rtol=1e-5, atol=1e-5, err_msg=f"n={n_}")
        want_max = (2 * xr).max(1) if n_ else np.full(rows, -np.inf, np.float32)
        np.testing.assert_array_equal(out["m"], want_max, err_msg=f"n={n_}")


def test_reduce_matches_cpu(rt, cpu):
    kern = reduce_kernel(32)
    x = np.random.default_rng(0).standard_normal(4 * 77).astype(np.float32)
    a, b = both(rt, cpu, kern, {"x": x}, {"s": (4, "f32"), "m": (4, "f32")}, {"n": 77, "rows": 4}, (4,))
    np.testing.assert_allclose(a["s"], b["s"], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(a["m"], b["m"])


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


@pytest.mark.parametrize("lanes", [1, 16, 64])
def test_local_arrays_lanefor_reduce_uniform(rt, cpu, lanes):
    kern = shared_kernel(lanes)
    rows, n_ = 3, 150
    x = np.random.default_rng(2).random(rows * n_).astype(np.float32)
    outs = {"y": (rows * n_, "f32"), "tot": (rows, "f32")}
    y, u = shared_ref(x, rows, n_)
    a, b = both(rt, cpu, kern, {"x": x}, outs, {"n": n_, "rows": rows}, (rows,))
    for o in (a, b):
        np.testing.assert_allclose(o["y"], y, rtol=1e-5)
        np.testing.assert_allclose(o["tot"], u, rtol=1e-5)


# --- integers, control flow, loads ------------------------------------------------------------------------


def int_kernel() -> Kernel:
    a, b, c, h, s = (Load(name, j) for name in ("a", "b", "c", "h", "s"))
    w = Load("w", j)
    body = (
        Let("q", a // 7 + (a % 7) * 100),
        Let("bits", ((b >> 3) & 0xF) | (c << 2)),
        Decl("r", "i32", Const(0)),
        If(a < 50, (Assign("r", Var("q")),), (Assign("r", Var("bits") - s),)),
        Store("o", j * 4, Var("r")),
        Store("o", j * 4 + 1, Select(h.eq(7), -1, h * 3 + b)),
        Store("o", j * 4 + 2, Cast("i32", ToF32(s) * 0.5) + Call("abs", s) + Call("max", a, c) - Call("min", b, s)),
        Store("u", j, ((w >> 4) & 0xFFFFFFF) | (w << 28)),
        If(Call("min", b, 3).ne(3), (Store("o", j * 4 + 3, Const(1)),), (Store("o", j * 4 + 3, Const(2)),)),
    )
    params = (Buf("a", "i32"), Buf("b", "u8"), Buf("c", "i8"), Buf("h", "u16"), Buf("s", "i16"), Buf("w", "u32"),
              Buf("o", "i32", True), Buf("u", "u32", True), Scalar("n"))
    return Kernel("ints", params, (1,), (LaneFor("j", n, body),), lanes=16)


def test_int_ops_select_if(rt, cpu):
    rng = np.random.default_rng(3)
    n_ = 300
    ins = {"a": rng.integers(0, 100, n_, dtype=np.int32), "b": rng.integers(0, 256, n_).astype(np.uint8),
           "c": rng.integers(-128, 128, n_).astype(np.int8), "h": rng.integers(0, 12, n_).astype(np.uint16),
           "s": rng.integers(-30000, 30000, n_).astype(np.int16),
           "w": rng.integers(0, 2**32, n_, dtype=np.uint64).astype(np.uint32)}
    outs = {"o": (4 * n_, "i32"), "u": (n_, "u32")}
    a, b = both(rt, cpu, int_kernel(), ins, outs, {"n": n_})
    np.testing.assert_array_equal(a["o"], b["o"])
    np.testing.assert_array_equal(a["u"], b["u"])
    A, B, C, S = (ins[x].astype(np.int64) for x in "abcs")
    q = A // 7 + (A % 7) * 100
    bits = ((B >> 3) & 0xF) | (C << 2)
    np.testing.assert_array_equal(a["o"][0::4], np.where(A < 50, q, bits - S))
    w = ins["w"]
    np.testing.assert_array_equal(a["u"], ((w >> 4) & 0xFFFFFFF) | (w << 28))


def test_math_functions(rt, cpu):
    x = Load("x", j)
    fns = [Call("exp", x), Call("tanh", x), Call("sqrt", Call("abs", x)), Call("rsqrt", Call("abs", x) + 1.0),
           Call("cos", x), Call("sin", x), Call("log", Call("abs", x) + 0.5), Call("pow", Call("abs", x), 1.5),
           Call("max", x, 0.25), Call("min", x, 0.25), x / 3.0]
    body = tuple(Store("y", j * len(fns) + i, f) for i, f in enumerate(fns))
    kern = Kernel("mathf", (Buf("x", "f32"), Buf("y", "f32", True), Scalar("n")), (1,),
                  (LaneFor("j", n, body),), lanes=16)
    xs = np.random.default_rng(4).uniform(-3, 3, 100).astype(np.float32)
    a, b = both(rt, cpu, kern, {"x": xs}, {"y": (100 * len(fns), "f32")}, {"n": 100})
    np.testing.assert_allclose(a["y"], b["y"], rtol=2e-6, atol=1e-6)


def test_multi_dim_grid(rt, cpu):
    idx = (g2 * 4 + g1) * 3 + g0
    kern = Kernel("grid3", (Buf("y", "i32", True),), (Const(3), Const(4), Const(5)), (
        LaneFor("j", Const(10), (Store("y", idx * 10 + j, g0 * 10000 + g1 * 1000 + g2 * 100 + j),)),
    ), lanes=8)
    a, b = both(rt, cpu, kern, {}, {"y": (600, "i32")}, {}, (3, 4, 5))
    G0, G1, G2, J = np.meshgrid(range(3), range(4), range(5), range(10), indexing="ij")
    want = np.zeros(600, np.int64)
    want[((G2 * 4 + G1) * 3 + G0) * 10 + J] = G0 * 10000 + G1 * 1000 + G2 * 100 + J
    np.testing.assert_array_equal(a["y"], want)
    np.testing.assert_array_equal(b["y"], want)
    # Empty grids launch nothing.
    assert run(rt, kern, {}, {"y": (600, "i32")}, {}, (0, 4, 5))["y"].view(np.uint32).max() == 0xFFFFFFFF


def table_kernel() -> Kernel:
    return Kernel("table", (Buf("q", "u8"), Buf("y", "f32", True), Scalar("n")), (1,), (
        LaneFor("j", n, (Store("y", j, ToF32(Table("iq4nl", Load("q", j) & 15)) * 0.5),)),
    ), lanes=16)


def test_table_lookup(rt, cpu):
    kern = table_kernel()
    q = np.random.default_rng(5).integers(0, 256, 200).astype(np.uint8)
    a, b = both(rt, cpu, kern, {"q": q}, {"y": (200, "f32")}, {"n": 200})
    want = np.array(TABLES["iq4nl"], np.float32)[q & 15] * 0.5
    np.testing.assert_array_equal(a["y"], want)
    np.testing.assert_array_equal(b["y"], want)


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
    rt = request.getfixturevalue(target)
    kern = Kernel("f16io", (Buf("h", "f16"), Buf("x", "f32"), Buf("y", "f32", True), Buf("o", "f16", True),
                            Buf("p", "f16", True), Scalar("n")), (1,), (
        LaneFor("j", n, (
            Store("y", j, Load("h", j)),
            Store("o", j, Load("x", j)),
            Store("p", j, Call("f16_bits_to_f32", Call("f32_to_f16_bits", Load("x", j)))),
        )),
    ), lanes=64)
    x = _f16_specials()
    x = x[~np.isnan(x)]
    hb = np.random.default_rng(7).integers(0, 2**16, x.size).astype(np.uint16)
    outs = {"y": (x.size, "f32"), "o": (x.size, "f16"), "p": (x.size, "f16")}
    a = run(rt, kern, {"h": hb, "x": x}, outs, {"n": x.size})
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


def test_dot4_i8(rt, cpu):
    kern = Kernel("dot4", (Buf("a", "i32"), Buf("b", "u32"), Buf("o", "i32", True), Scalar("n")), (1,),
                  (LaneFor("j", n, (Store("o", j, Call("dot4_i8", Load("a", j), Load("b", j), j - 50)),)),),
                  lanes=32)
    rng = np.random.default_rng(8)
    a = rng.integers(-(2**31), 2**31, 1000, dtype=np.int64).astype(np.int32)
    b = rng.integers(0, 2**32, 1000, dtype=np.uint64).astype(np.uint32)
    r, c = both(rt, cpu, kern, {"a": a, "b": b}, {"o": (1000, "i32")}, {"n": 1000})
    want = (a.view(np.int8).reshape(-1, 4).astype(np.int64) * b.view(np.int8).reshape(-1, 4)).sum(1)
    want += np.arange(1000) - 50
    np.testing.assert_array_equal(r["o"], want)
    np.testing.assert_array_equal(c["o"], want)


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
    from polystrata.runtimes.opencl import OpenCLRuntime

    kern = reduce_kernel(8)
    rt.compile(kern)
    fresh = OpenCLRuntime(rt.dev)
    ck = fresh.compile(kern)
    assert ck.cached and fresh.cache_hits == 1 and fresh.cache_misses == 0
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


_OCLGRIND_SCRIPT = """
import sys, numpy as np
sys.path.insert(0, {tests!r})
import test_target_opencl as t
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

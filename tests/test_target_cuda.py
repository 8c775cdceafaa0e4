"""CUDA target: hand-built kernels covering every IR construct, run in numba-cuda's simulator (no GPU needed) on
the shared-memory Reduce and compared with the CPU target and numpy; render-only checks of the shuffle path.

The simulator must be chosen before numba.cuda is first imported, so the runtime tests run in a child pytest
(`NUMBA_ENABLE_CUDASIM=1`, `POLYSTRATA_CUDA_INNER=1`) of this same file: nothing leaks into other test modules.
`CASES` (kernel, inputs, outputs, scalars, grid, numpy reference) is shared with `scripts/cuda_selftest.py`,
which runs them on a real GPU with shuffles, the driver launch path and graph replay.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from polystrata.codegen.cuda import render
from polystrata.codegen.pyfamily import NUMPY_DTYPES
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

INNER = os.environ.get("POLYSTRATA_CUDA_INNER") == "1"
inner = pytest.mark.skipif(not INNER, reason="runs in the simulator child process (test_simulator)")
g0, g1, g2, n, j, k = (Var(v) for v in ("g0", "g1", "g2", "n", "j", "k"))
ROWS = Scalar("rows")
_BYTES = {"f32": 4, "f16": 2, "i32": 4, "u32": 4, "i16": 2, "u16": 2, "i8": 1, "u8": 1}


# --- kernels ----------------------------------------------------------------------------------------------


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
    """LaneFor fills a local array (For inside), a Reduce reads it, uniform local store, a LaneFor rewrites."""
    row = g0 * n
    params = (Buf("x", "f32"), Buf("y", "f32", True), Buf("tot", "f32", True), Scalar("n"), ROWS)
    return Kernel(f"shared{lanes}", params, (Var("rows"),), (
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
        LaneFor("j", n, (Store("t", j, Const(0.0)),)),  # overwrites t after uniform reads of u only
    ), lanes=lanes, local=(LocalArray("t", "f32", 64), LocalArray("u", "f32", 1)))


def int_kernel() -> Kernel:
    a, b, c, h, s, w = (Load(name, j) for name in ("a", "b", "c", "h", "s", "w"))
    body = (
        Let("q", a // 7 + (a % 7) * 100),
        Let("bits", ((b >> 3) & 0xF) | (c << 2)),
        Decl("r", "i32", Const(0)),
        If(a < 50, (Assign("r", Var("q")),), (Assign("r", Var("bits") - s),)),
        Store("o", j * 3, Var("r")),
        Store("o", j * 3 + 1, Select(h.eq(7), -1, h * 3 + b)),
        Store("o", j * 3 + 2, Cast("i32", ToF32(s) * 0.5) + Call("abs", s) + Call("max", a, c) - Call("min", b, s)),
        Store("u", j, ((w >> 4) & 0xFFFFFFF) | (w << 28)),
    )
    params = (Buf("a", "i32"), Buf("b", "u8"), Buf("c", "i8"), Buf("h", "u16"), Buf("s", "i16"), Buf("w", "u32"),
              Buf("o", "i32", True), Buf("u", "u32", True), Scalar("n"))
    return Kernel("ints", params, (1,), (LaneFor("j", n, body),), lanes=16)


def math_kernel() -> Kernel:
    x = Load("x", j)
    fns = [Call("exp", x), Call("tanh", x), Call("sqrt", Call("abs", x)), Call("rsqrt", Call("abs", x) + 1.0),
           Call("cos", x), Call("sin", x), Call("log", Call("abs", x) + 0.5), Call("pow", Call("abs", x), 1.5),
           Call("max", x, 0.25), Call("min", x, 0.25), x / 3.0]
    body = tuple(Store("y", j * len(fns) + i, f) for i, f in enumerate(fns))
    return Kernel("mathf", (Buf("x", "f32"), Buf("y", "f32", True), Scalar("n")), (1,), (LaneFor("j", n, body),),
                  lanes=32)


def grid_kernel() -> Kernel:
    idx = (g2 * 4 + g1) * 3 + g0
    return Kernel("grid3", (Buf("y", "i32", True),), (Const(3), Const(4), Const(2)), (
        LaneFor("j", Const(5), (Store("y", idx * 5 + j, g0 * 10000 + g1 * 1000 + g2 * 100 + j),)),
    ), lanes=4)


def f16_kernel() -> Kernel:
    """f16 buffer loads and stores, both intrinsics, and an f16 local array (uniform store + read)."""
    return Kernel("f16io", (Buf("h", "f16"), Buf("x", "f32"), Buf("y", "f32", True), Buf("o", "f16", True),
                            Buf("p", "u32", True), Buf("z", "f32", True), Scalar("n")), (1,), (
        LaneFor("j", n, (
            Store("y", j, Load("h", j)),
            Store("o", j, Load("x", j)),
            Store("p", j, Call("f32_to_f16_bits", Call("f16_bits_to_f32", Call("f32_to_f16_bits", Load("x", j))))),
        )),
        Store("hl", Const(0), Const(1.0) / 3.0),
        Store("z", Const(0), Load("hl", Const(0))),
    ), lanes=64, local=(LocalArray("hl", "f16", 2),))


def intrinsics_kernel() -> Kernel:
    """dot4_i8, load_u32 at offsets aligned to 1, 2 and 4 bytes, and an iq4nl Table lookup."""
    return Kernel("intr", (Buf("a", "i32"), Buf("b", "u32"), Buf("q", "u8"), Buf("o", "i32", True),
                           Buf("w", "u32", True), Buf("t", "f32", True), Scalar("n")), (1,), (
        LaneFor("j", n, (
            Store("o", j, Call("dot4_i8", Load("a", j), Load("b", j), j - 50)),
            *(Store("w", j * 3 + s, Call("load_u32", Var("q"), j * al, al)) for s, al in enumerate((1, 2, 4))),
            Store("t", j, ToF32(Table("iq4nl", Load("q", j) & 15)) * 0.5),
        )),
    ), lanes=32)


def f16_values(count: int = 300) -> np.ndarray:
    """Edge cases of f32 -> f16 rounding, random bit patterns and values near f16 ties (no NaNs)."""
    edge = [0.0, -0.0, 1.0, 65504.0, 65519.99, 65520.0, 1e6, -1e6, np.inf, -np.inf, 6.1e-5, 5.96e-8, 2.98e-8,
            2.9802322e-08, 2.9802326e-08, 8.9406967e-08, 1e-10, -3e-6, 0.1, 1 / 3, 6.103515625e-05, 6.1e-05]
    rng = np.random.default_rng(6)
    rand = rng.integers(0, 2**32, count, dtype=np.uint64).astype(np.uint32).view(np.float32)
    near = (rng.integers(0, 2**16, count).astype(np.uint16).view(np.float16).astype(np.float32).view(np.uint32)
            + rng.integers(-4096, 4097, count).astype(np.uint32)).view(np.float32)
    x = np.concatenate([np.array(edge, np.float32), rand, near]).astype(np.float32)
    return x[~np.isnan(x)]


def cases(scale: int = 1) -> list[tuple]:
    """(label, kernel, inputs, outputs {name: (size, dtype)}, scalars, grid, reference {name: array}).

    f16 outputs are compared as raw bits; `scale` grows the sizes (the GPU selftest)."""
    rng = np.random.default_rng(0)
    out = []
    for lanes in (1, 32, 64, 128, 24):
        for n_ in sorted({0, 1, lanes + 3, 2 * lanes + 7}):
            x = rng.standard_normal(3 * n_ * scale).astype(np.float32)
            xr = x.reshape(3, -1)
            mx = (2 * xr).max(1) if xr.size else np.full(3, -np.inf, np.float32)
            out.append((f"reduce lanes={lanes} n={n_ * scale}", reduce_kernel(lanes), {"x": x},
                        {"s": (3, "f32"), "m": (3, "f32")}, {"n": n_ * scale, "rows": 3}, (3,),
                        {"s": xr.sum(1), "m": mx}))
    for lanes in (1, 16, 64):
        x = rng.random(3 * 50).astype(np.float32)
        t = x.reshape(3, 50).astype(np.float64) * 6
        u = t.sum(1) + 1
        out.append((f"local+lanefor lanes={lanes}", shared_kernel(lanes), {"x": x},
                    {"y": (150, "f32"), "tot": (3, "f32")}, {"n": 50, "rows": 3}, (3,),
                    {"y": (t / u[:, None]).reshape(-1), "tot": u}))
    m = 100 * scale
    ins = {"a": rng.integers(0, 100, m, dtype=np.int32), "b": rng.integers(0, 256, m).astype(np.uint8),
           "c": rng.integers(-128, 128, m).astype(np.int8), "h": rng.integers(0, 12, m).astype(np.uint16),
           "s": rng.integers(-30000, 30000, m).astype(np.int16),
           "w": rng.integers(0, 2**32, m, dtype=np.uint64).astype(np.uint32)}
    A, B, C, S = (ins[v].astype(np.int64) for v in "abcs")
    o = np.zeros((m, 3), np.int64)
    o[:, 0] = np.where(A < 50, A // 7 + (A % 7) * 100, (((B >> 3) & 0xF) | (C << 2)) - S)
    o[:, 1] = np.where(ins["h"] == 7, -1, ins["h"].astype(np.int64) * 3 + B)
    o[:, 2] = (S * 0.5).astype(np.int64) + np.abs(S) + np.maximum(A, C) - np.minimum(B, S)
    w = ins["w"]
    out.append(("ints/select/if", int_kernel(), ins, {"o": (3 * m, "i32"), "u": (m, "u32")}, {"n": m}, (1,),
                {"o": o.reshape(-1), "u": ((w >> 4) & 0xFFFFFFF) | (w << 28)}))
    x = rng.uniform(-3, 3, m).astype(np.float32).astype(np.float64)
    ref = np.stack([np.exp(x), np.tanh(x), np.sqrt(abs(x)), 1 / np.sqrt(abs(x) + 1), np.cos(x), np.sin(x),
                    np.log(abs(x) + 0.5), abs(x) ** 1.5, np.maximum(x, 0.25), np.minimum(x, 0.25), x / 3], 1)
    out.append(("math", math_kernel(), {"x": x.astype(np.float32)}, {"y": (11 * m, "f32")}, {"n": m}, (1,),
                {"y": ref.reshape(-1)}))
    G0, G1, G2, J = np.meshgrid(range(3), range(4), range(2), range(5), indexing="ij")
    want = np.zeros(120, np.int64)
    want[((G2 * 4 + G1) * 3 + G0) * 5 + J] = G0 * 10000 + G1 * 1000 + G2 * 100 + J
    out.append(("grid 3x4x2", grid_kernel(), {}, {"y": (120, "i32")}, {}, (3, 4, 2), {"y": want}))
    xv = f16_values(300 * scale)
    hb = rng.integers(0, 2**16, xv.size).astype(np.uint16)
    with np.errstate(over="ignore"):
        want16 = xv.astype(np.float16).view(np.uint16)
    out.append(("f16 load/store/intrinsics", f16_kernel(), {"h": hb, "x": xv},
                {"y": (xv.size, "f32"), "o": (xv.size, "f16"), "p": (xv.size, "u32"), "z": (1, "f32")},
                {"n": xv.size}, (1,), {"y": hb.view(np.float16).astype(np.float32), "o": want16, "p": want16,
                                       "z": np.float32(np.float16(1 / 3))}))
    a = rng.integers(-(2**31), 2**31, m, dtype=np.int64).astype(np.int32)
    b = rng.integers(0, 2**32, m, dtype=np.uint64).astype(np.uint32)
    q = rng.integers(0, 256, 4 * m + 4).astype(np.uint8)
    dot = (a.view(np.int8).reshape(-1, 4).astype(np.int64) * b.view(np.int8).reshape(-1, 4)).sum(1)
    out.append(("dot4/load_u32/table", intrinsics_kernel(), {"a": a, "b": b, "q": q},
                {"o": (m, "i32"), "w": (3 * m, "u32"), "t": (m, "f32")}, {"n": m}, (1,),
                {"o": dot + np.arange(m) - 50,
                 "w": np.array([q[i * al:i * al + 4].view("<u4")[0] for i in range(m) for al in (1, 2, 4)]),
                 "t": np.array(TABLES["iq4nl"], np.float32)[q[:m] & 15] * 0.5}))
    return out


# --- running and comparing (also used by scripts/cuda_selftest.py) ---------------------------------------


def run(r, kernel, inputs, outputs, scalars, grid, **compile_kw):
    """Launch `kernel` on runtime `r` with poisoned outputs; returns their contents (f16 as raw u16 bits)."""
    ck = r.compile(kernel, **compile_kw)
    bufs = {name: r.upload(np.ascontiguousarray(a)) for name, a in inputs.items()}
    for name, (size, dt) in outputs.items():
        fill = np.full(size, np.nan, np.float32) if dt == "f32" else \
            np.full(size * _BYTES[dt], 0xFF, np.uint8).view(NUMPY_DTYPES[dt])
        bufs[name] = r.upload(fill)
    r.launch(ck, r.args_for(kernel, bufs, scalars), grid)
    r.sync()
    return {name: r.download(bufs[name], (size,), "u16" if dt == "f16" else dt) for name, (size, dt) in outputs.items()}


def max_error(got: np.ndarray, want, dtype: str) -> float:
    """Largest relative error (floats; NaN where exactly one is NaN) or count of differing values (ints)."""
    got, want = np.asarray(got), np.asarray(want).reshape(np.shape(got))
    if dtype != "f32":
        return float((got.astype(np.int64) != want.astype(np.int64)).sum())
    g, w = got.astype(np.float64), want.astype(np.float64)
    if (np.isnan(g) != np.isnan(w)).any():
        return float("nan")
    inf = np.isinf(w)
    if (g[inf] != w[inf]).any():  # infinities must match exactly
        return float("inf")
    ok = np.isfinite(w)
    return float((np.abs(g[ok] - w[ok]) / np.maximum(np.abs(w[ok]), 1e-6)).max(initial=0.0))


# --- the simulator child process -------------------------------------------------------------------------


def test_simulator(tmp_path):
    """Every runtime test of this file, in a child pytest with the simulator on (isolated from this process)."""
    if INNER:
        pytest.skip("this is the child")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", POLYSTRATA_CUDA_INNER="1", POLYSTRATA_HOME=str(tmp_path))
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
    cpu_got = run(cpu, kernel, inputs, outputs, scalars, grid)
    for name, (_, dt) in outputs.items():
        tol = 1e-5
        assert max_error(got[name], ref[name], dt) <= (tol if dt == "f32" else 0), (label, name)
        assert max_error(got[name], cpu_got[name], dt) <= (tol if dt == "f32" else 0), (label, name, "vs cpu")
        if kernel.name.startswith("red") and name == "m":  # max is exact
            np.testing.assert_array_equal(got[name], np.asarray(ref[name], np.float32))


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
    out = run(rt, grid_kernel(), {}, {"y": (120, "i32")}, {}, (0, 4, 2))
    assert out["y"].view(np.uint32).min() == 0xFFFFFFFF  # nothing launched
    assert rt.memory_info() is None and rt.lanes == 128 and rt.subgroup == 32


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
    from polystrata.ir.quant import FORMATS

    kern = matvec_q8_kernel("t_wide", [FORMATS["Q4_K"]], 64, 1024, tokens=1, lanes=32, runs=1)
    src = render(kern, shuffles=True, native=True)
    ast.parse(src)
    assert "load_u32_a16(w0, " in src and "load_a16(xq, " in src
    assert "load_a16" not in render(kern, shuffles=True)  # the simulator's portable loads
    from polystrata.runtimes.cuda import CUDARuntime

    assert CUDARuntime.wide_loads


def test_barriers_follow_the_model():
    src = render(shared_kernel(64))
    body = src[src.index("def shared64"):]
    assert body.count("cuda.syncthreads()") >= 4
    # A uniform store into a local array is done by lane 0 and published by a barrier.
    assert "if _lid == 0:\n        u[np.uint64(0)] = " in body
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

"""HIP target: hand-built kernels covering every IR construct, rendered to HIP C++ and compiled by hiprtc into
AMD code objects for gfx1030 (wave32) and gfx90a (wave64); the compile-only runtime's errors; the same source as
CUDA behind `cuda_prelude()` where nvcc exists. Skips where libamdhip64 is absent (CI installs libamdhip64-5 and
libhiprtc-builtins5). Running the kernels needs an AMD GPU: see `test_runs_on_gpu`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from polystrata.codegen import hip as hipgen
from polystrata.codegen.hip import cuda_prelude, render, wave_of
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
from polystrata.ir.quant import Table

hiprt = pytest.importorskip("polystrata.runtimes.hip")
if not hiprt.available():
    pytest.skip("libamdhip64 not installed (apt-get install libamdhip64-5 libhiprtc-builtins5)",
                allow_module_level=True)

g0, g1, g2, n, j, k = (Var(v) for v in ("g0", "g1", "g2", "n", "j", "k"))
ARCHS = ("gfx1030", "gfx90a")  # wave32 RDNA2, wave64 CDNA2
OLD_ROCM = hiprt.supported_archs() is not None  # ROCm <= 5.2: the refusal list applies


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("POLYSTRATA_HOME", str(tmp_path))  # a fresh, empty code-object cache per test
    monkeypatch.delenv(hiprt.FORCE_ENV, raising=False)


@pytest.fixture(scope="module")
def runtimes():
    """Compile-only runtimes, one per architecture (made lazily: a refused arch fails only its own test)."""
    made: dict[str, hiprt.HIPRuntime] = {}

    def get(arch: str) -> hiprt.HIPRuntime:
        if arch not in made:
            made[arch] = hiprt.HIPRuntime(arch, compile_only=True)
        return made[arch]

    return get


# --- kernels ----------------------------------------------------------------------------------------------


def reduce_kernel(lanes: int) -> Kernel:
    """Per row g0: s = sum of x, m = max of 2x; uniform stores of the Reduce results."""
    row = g0 * n
    return Kernel(f"red{lanes}", (Buf("x", "f32"), Buf("s", "f32", True), Buf("m", "f32", True), Scalar("n")),
                  (Var("n"),), (
        Reduce("sum", "+", "j", n, (Let("v", Load("x", row + j)),), Var("v")),
        Reduce("mx", "max", "j", n, (), Load("x", row + j) * 2.0),
        Store("s", g0, Var("sum")),
        Store("m", g0, Var("mx")),
    ), lanes=lanes)


def shared_kernel(lanes: int) -> Kernel:
    """LaneFor fills a local array (nested For), a Reduce reads it, a uniform local store is read back."""
    row = g0 * n
    return Kernel(f"shared{lanes}", (Buf("x", "f32"), Buf("y", "f32", True), Buf("tot", "f32", True), Scalar("n")),
                  (Var("n"),), (
        LaneFor("j", n, (
            Decl("acc", "f32", Const(0.0)),
            For("k", Const(0), Const(3), (Assign("acc", Var("acc") + Load("x", row + j) * ToF32(k + 1)),), unroll=3),
            Store("t", j, Var("acc")),
        )),
        Reduce("s", "+", "j", n, (), Load("t", j)),
        Store("u", Const(0), Var("s") + 1.0),
        Let("inv", 1.0 / Load("u", 0)),
        LaneFor("j", n, (Store("y", row + j, Load("t", j) * Var("inv")),)),
        Store("tot", g0, Load("u", 0)),
    ), lanes=lanes, local=(LocalArray("t", "f32", 300), LocalArray("u", "f32", 1)))


def int_kernel() -> Kernel:
    """Integer ops, narrow loads, If / Select / Cast, int abs / max / min."""
    a, b, c, h, s, w = (Load(name, j) for name in ("a", "b", "c", "h", "s", "w"))
    body = (
        Let("q", a // 7 + (a % 7) * 100),
        Let("bits", ((b >> 3) & 0xF) | (c << 2)),
        Decl("r", "i32", Const(0)),
        If(a < 50, (Assign("r", Var("q")),), (Assign("r", Var("bits") - s),)),
        Store("o", j * 4, Var("r")),
        Store("o", j * 4 + 1, Select(h.eq(7), -1, h * 3 + b)),
        Store("o", j * 4 + 2, Cast("i32", ToF32(s) * 0.5) + Call("abs", s) + Call("max", a, c) - Call("min", b, s)),
        Store("u", j, ((w >> 4) & 0xFFFFFFF) | (w << 28)),
    )
    params = (Buf("a", "i32"), Buf("b", "u8"), Buf("c", "i8"), Buf("h", "u16"), Buf("s", "i16"), Buf("w", "u32"),
              Buf("o", "i32", True), Buf("u", "u32", True), Scalar("n"))
    return Kernel("ints", params, (1,), (LaneFor("j", n, body),), lanes=64)


def math_kernel() -> Kernel:
    """Every math function, float division, and f32 scalars."""
    x = Load("x", j) * Var("scale")
    fns = [Call("exp", x), Call("tanh", x), Call("sqrt", Call("abs", x)), Call("rsqrt", Call("abs", x) + 1.0),
           Call("cos", x), Call("sin", x), Call("log", Call("abs", x) + 0.5), Call("pow", Call("abs", x), 1.5),
           Call("max", x, 0.25), Call("min", x, 0.25), x / 3.0, Const(float("inf")) * x, Const(float("nan"))]
    body = tuple(Store("y", j * len(fns) + i, f) for i, f in enumerate(fns))
    return Kernel("mathf", (Buf("x", "f32"), Buf("y", "f32", True), Scalar("n"), Scalar("scale", "f32")), (1,),
                  (LaneFor("j", n, body),), lanes=64)


def grid_kernel() -> Kernel:
    """A three-dimensional grid."""
    idx = (g2 * 4 + g1) * 3 + g0
    return Kernel("grid3", (Buf("y", "i32", True),), (Const(3), Const(4), Const(5)), (
        LaneFor("j", Const(10), (Store("y", idx * 10 + j, g0 * 10000 + g1 * 1000 + g2 * 100 + j),)),
    ), lanes=64)


def f16_kernel() -> Kernel:
    """f16 buffer loads / stores, an f16 local array, a uniform f16 store, a Table lookup."""
    return Kernel("f16io", (Buf("h", "f16"), Buf("q", "u8"), Buf("y", "f32", True), Buf("o", "f16", True),
                            Scalar("n")), (1,), (
        LaneFor("j", n, (Store("t", j, Load("h", j) * 2.0),)),
        LaneFor("j", n, (
            Store("y", j, Load("t", j) + ToF32(Table("iq4nl", Load("q", j) & 15))),
            Store("o", j, Load("h", j) * 0.5),
        )),
        Store("o", Const(0), Load("t", 1)),
    ), lanes=64, local=(LocalArray("t", "f16", 256),))


def intrinsics_kernel() -> Kernel:
    """Each intrinsic: f16 bit conversions, dot4_i8, load_u32."""
    x = Load("x", j)
    return Kernel("intr", (Buf("x", "f32"), Buf("a", "i32"), Buf("b", "u32"), Buf("raw", "u8"),
                           Buf("o", "i32", True), Buf("u", "u32", True), Buf("y", "f32", True), Scalar("n")), (1,), (
        LaneFor("j", n, (
            Store("u", j * 2, Call("f32_to_f16_bits", x)),
            Store("y", j, Call("f16_bits_to_f32", Call("f32_to_f16_bits", x))),
            Store("o", j, Call("dot4_i8", Load("a", j), Load("b", j), j - 50)),
            Store("u", j * 2 + 1, Call("load_u32", Var("raw"), j)),
        )),
    ), lanes=64)


LANES = (1, 32, 64, 128)
OTHERS = {"ints": int_kernel, "math": math_kernel, "grid": grid_kernel, "f16": f16_kernel,
          "intrinsics": intrinsics_kernel}


def _is_code_object(code: bytes, arch: str) -> None:
    assert code[:4] == b"\x7fELF" and len(code) > 256
    assert arch.encode() in code  # the target id is recorded in the code object's metadata


# --- compiles -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("lanes", LANES)
@pytest.mark.parametrize("make", [reduce_kernel, shared_kernel], ids=["reduce", "shared"])
def test_reductions_and_lanes_compile(runtimes, arch, lanes, make):
    rt = runtimes(arch)
    kern = make(lanes)
    ck = rt.compile(kern)
    _is_code_object(ck.handle.code, arch)
    wave = wave_of(arch)
    src = ck.source
    assert f"__launch_bounds__({lanes})" in src and f"wave {wave}" in src
    if lanes == 1:
        assert "__shfl" not in src and "ps_red" not in src
    elif lanes <= wave:  # one butterfly over the group, no shared scratch
        assert f"for (int o = {lanes // 2}; o > 0" in src and "ps_red" not in src
    else:  # a butterfly per wave, then the waves through shared memory
        assert f"for (int o = {wave // 2}; o > 0" in src
        assert f"ps_red[{lanes // wave}]" in src and f"ps_lid % {wave} == 0" in src


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", sorted(OTHERS))
def test_every_construct_compiles(runtimes, arch, name):
    ck = runtimes(arch).compile(OTHERS[name]())
    _is_code_object(ck.handle.code, arch)


def test_render_spellings():
    src = render(intrinsics_kernel(), "gfx90a")
    assert 'extern "C" __global__ void __launch_bounds__(64)' in src
    assert "__builtin_amdgcn_sdot4" in src and "ps_dot4_i8" not in src
    assert "#pragma clang fp contract(off)" in src
    # No v_dot4_i32_i8 on gfx803 / gfx1010: the portable definition.
    for arch in ("gfx803", "gfx1010"):
        src = render(intrinsics_kernel(), arch)
        assert "__builtin_amdgcn_sdot4" not in src and "int ps_dot4_i8(" in src
    f16 = render(f16_kernel(), "gfx1030")
    assert "const __half* h" in f16 and "__half2float(h[" in f16 and "__float2half_rn(" in f16
    assert "__syncthreads();" in f16 and "__shared__ unsigned short t[256];" in f16
    portable = render(f16_kernel(), "gfx1030", native_f16=False)
    assert "__half" not in portable and "ps_f32_to_f16_bits" in portable
    # Wave override: an RDNA part in wave64 mode.
    assert "ps_lid % 64" in render(reduce_kernel(128), "gfx1030", wave=64)
    assert [wave_of(a) for a in ("gfx1030", "gfx1100", "gfx90a", "gfx942", "gfx803", "gfx90a:xnack-")] == \
        [32, 32, 64, 64, 64, 64]
    with pytest.raises(ValueError, match="unknown GPU architecture"):
        wave_of("navi21")


def test_options_and_device(runtimes):
    rt = runtimes("gfx1030")
    assert rt.options == ["--offload-arch=gfx1030", "-O3", "-ffp-contract=off"]
    assert (rt.lanes, rt.subgroup) == (32, 32) and runtimes("gfx90a").lanes == 64
    if not rt.gpu:
        assert "compile only" in rt.device and rt.memory_info() is None


# --- errors ---------------------------------------------------------------------------------------------------


def test_syntax_error_is_clean(runtimes, monkeypatch):
    kern = Kernel("broken", (Buf("y", "f32", True),), (1,), (Store("y", 0, Call("rsqrt", Const(2.0))),))
    monkeypatch.setattr(hipgen.HIPPrinter, "rsqrt", lambda self, x: f"ps_no_such_intrinsic({x})")
    with pytest.raises(PolystrataError, match="hiprtc build of kernel broken failed for gfx1030") as err:
        runtimes("gfx1030").compile(kern)
    msg = str(err.value)
    assert "ps_no_such_intrinsic" in msg and "error" in msg
    assert len(msg.splitlines()) <= 22  # the first log lines, not the whole log


@pytest.mark.skipif(not OLD_ROCM, reason="a ROCm newer than 5.2 compiles these")
@pytest.mark.parametrize("arch", ["gfx1100", "gfx942"])
def test_unknown_arch_refused_up_front(arch):
    with pytest.raises(PolystrataError) as err:
        hiprt.HIPRuntime(arch, compile_only=True)
    msg = str(err.value)
    assert msg.startswith(f"hiprtc in ROCm 5.2 cannot compile for {arch}; supported here: gfx803,")
    assert "gfx906" in msg and "gfx90a" in msg and "gfx1030" in msg


@pytest.mark.skipif(not OLD_ROCM, reason="a ROCm newer than 5.2 compiles gfx1100")
def test_compiler_crash_does_not_kill_the_caller(monkeypatch):
    monkeypatch.setenv(hiprt.FORCE_ENV, "1")
    rt = hiprt.HIPRuntime("gfx1100", compile_only=True)  # refusal disabled: hiprtc itself gets the arch
    with pytest.raises(PolystrataError, match="hiprtc crashed .* compiling kernel red32 for gfx1100"):
        rt.compile(reduce_kernel(32))
    assert rt.cache_misses == 0 and not list((hiprt.cache_dir("hip")).glob("*.co"))


def test_code_object_cache_hit_in_fresh_runtime():
    kern = reduce_kernel(64)
    first = hiprt.HIPRuntime("gfx90a", compile_only=True)
    a = first.compile(kern)
    assert not a.cached and first.cache_misses == 1
    assert first.compile(kern) is a  # in-memory on the same runtime
    fresh = hiprt.HIPRuntime("gfx90a", compile_only=True)
    b = fresh.compile(kern)
    assert b.cached and fresh.cache_hits == 1 and fresh.cache_misses == 0
    assert b.handle.code == a.handle.code
    # Another arch is another key.
    other = hiprt.HIPRuntime("gfx1030", compile_only=True).compile(kern)
    assert not other.cached


def test_compile_only_launch_error():
    rt = hiprt.HIPRuntime("gfx1030", compile_only=True)
    ck = rt.compile(grid_kernel())
    want = r"no AMD GPU: the hip target can compile \(polystrata compile --target hip --arch gfx1030\) but not run"
    for call in (lambda: rt.alloc((4,), "f32"), lambda: rt.upload(np.zeros(4, np.float32)),
                 lambda: rt.launch(ck, [None], (3, 4, 5))):
        with pytest.raises(PolystrataError, match=want):
            call()


def test_child_entry_usage():
    p = subprocess.run([sys.executable, "-m", "polystrata.runtimes.hip"], capture_output=True, text=True)
    assert p.returncode != 0 and "usage" in p.stderr


# --- a GPU, where there is one ----------------------------------------------------------------------------------


def test_runs_on_gpu():
    """Sums and maxima of rows on a real AMD GPU (skipped without one)."""
    if hiprt._gpu_count() == 0:
        pytest.skip("no AMD GPU")
    rt = hiprt.HIPRuntime()
    for lanes in (1, rt.subgroup // 2, rt.subgroup, 2 * rt.subgroup, 96):
        kern = reduce_kernel(lanes)
        n_ = 77
        x = np.random.default_rng(lanes).standard_normal(n_ * n_).astype(np.float32)
        bufs = {"x": rt.upload(x), "s": rt.alloc((n_,), "f32"), "m": rt.alloc((n_,), "f32")}
        rt.launch(rt.compile(kern), rt.args_for(kern, bufs, {"n": n_}), (n_,))
        rt.sync()
        np.testing.assert_allclose(rt.download(bufs["s"], (n_,), "f32"), x.reshape(n_, n_).sum(1), rtol=1e-4,
                                   atol=1e-4)
        np.testing.assert_array_equal(rt.download(bufs["m"], (n_,), "f32"), 2 * x.reshape(n_, n_).max(1))


# --- the same source as CUDA -----------------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("kern", [reduce_kernel(128), shared_kernel(32), f16_kernel(), intrinsics_kernel(),
                                  math_kernel()], ids=lambda kk: kk.name)
def test_cuda_prelude_compiles_with_nvcc(tmp_path, kern):
    src = tmp_path / f"{kern.name}.cu"
    src.write_text(cuda_prelude() + render(kern, "sm_80"))
    p = subprocess.run(["nvcc", "-arch=sm_80", "--fmad=false", "--ptx", "-o", str(tmp_path / "k.ptx"), str(src)],
                       capture_output=True, text=True, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert p.returncode == 0, p.stderr[-3000:]
    ptx = (tmp_path / "k.ptx").read_text()
    assert f".entry {kern.name}(" in ptx  # extern "C": the name is not mangled
    if kern.name == "intr":
        assert "dp4a" in ptx

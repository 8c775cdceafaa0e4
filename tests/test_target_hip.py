"""HIP target: the `ir_constructs` kernels (every IR construct), rendered to HIP C++ and compiled by hiprtc into
AMD code objects for gfx1030 (wave32) and gfx90a (wave64); the compile-only runtime's errors; the same source as
CUDA behind `CUDA_PRELUDE` where nvcc exists, and through NVRTC (`HIPRuntime("sm_90")`, runtimes/hip_nvrtc.py)
where libnvrtc loads. hiprtc tests skip where libamdhip64 is absent (CI installs libamdhip64-5 and
libhiprtc-builtins5). Running the kernels needs an AMD GPU (`test_runs_on_gpu`) or an NVIDIA GPU with no AMD one
(`test_nvidia_*`: `HIPRuntime()` is then the NVRTC backend, checked against numpy and the CPU target)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from ir_constructs import (
    cases,
    check_case,
    f16_kernel,
    f16_local_kernel,
    grid_kernel,
    int_kernel,
    intrinsics_kernel,
    math_kernel,
    reduce_kernel,
    run,
    shared_kernel,
    table_kernel,
)

from polystrata.codegen import hip as hipgen
from polystrata.codegen.hip import CUDA_PRELUDE, render, wave_of
from polystrata.errors import PolystrataError
from polystrata.ir.kernel import Buf, Call, Const, Kernel, Store
from polystrata.runtimes.base import cache_dir

hiprt = pytest.importorskip("polystrata.runtimes.hip")
hipnv = pytest.importorskip("polystrata.runtimes.hip_nvrtc")
AMD = hiprt.available()
amd = pytest.mark.skipif(not AMD, reason="libamdhip64 not installed (apt-get install libamdhip64-5 "
                         "libhiprtc-builtins5)")
try:
    NVRTC = hipnv.nvrtc_version()
except PolystrataError:
    NVRTC = None
nv = pytest.mark.skipif(NVRTC is None, reason="NVRTC not loadable (pip install cuda-bindings nvidia-cuda-nvrtc)")
# HIPRuntime() takes the NVRTC path: an NVIDIA GPU, NVRTC, and no AMD GPU.
NV_GPU = NVRTC is not None and hipnv.gpu_count() > 0 and not (AMD and hiprt._gpu_count() > 0)
nv_gpu = pytest.mark.skipif(not NV_GPU, reason="no NVIDIA GPU (or no NVRTC, or an AMD GPU takes precedence)")

ARCHS = ("gfx1030", "gfx90a")  # wave32 RDNA2, wave64 CDNA2
OLD_ROCM = AMD and hiprt.supported_archs() is not None  # ROCm <= 5.2: the refusal list applies


pytestmark = pytest.mark.target("hip")


@pytest.fixture(autouse=True)
def _no_forced_arch(monkeypatch):
    monkeypatch.delenv(hiprt.FORCE_ENV, raising=False)


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A fresh, empty code-object cache (the run's shared one holds other tests' kernels)."""
    monkeypatch.setenv("POLYSTRATA_HOME", str(tmp_path))


@pytest.fixture(scope="module")
def runtimes():
    """Compile-only runtimes, one per architecture (made lazily: a refused arch fails only its own test)."""
    made: dict[str, hiprt.HIPRuntime] = {}

    def get(arch: str) -> hiprt.HIPRuntime:
        if not AMD:
            pytest.skip("libamdhip64 not installed (apt-get install libamdhip64-5 libhiprtc-builtins5)")
        if arch not in made:
            made[arch] = hiprt.HIPRuntime(arch, compile_only=True)
        return made[arch]

    return get


LANES = (1, 32, 64, 128)
# The other constructs, at the hip target's group size (64 lanes: a wave64 wave, two wave32 ones).
OTHERS = {"ints": lambda: int_kernel(64), "math": lambda: math_kernel(64), "grid": lambda: grid_kernel(64),
          "table": lambda: table_kernel(64), "f16": lambda: f16_kernel(64), "f16local": lambda: f16_local_kernel(64),
          "intrinsics": lambda: intrinsics_kernel(64)}


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
        assert f"ps_red[{lanes // wave}]" in src and f"(ps_lid % {wave}) == 0" in src


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", sorted(OTHERS))
def test_every_construct_compiles(runtimes, arch, name):
    ck = runtimes(arch).compile(OTHERS[name]())
    _is_code_object(ck.handle.code, arch)


def test_render_spellings():
    src = render(intrinsics_kernel(64), "gfx90a")
    assert 'extern "C" __global__ void __launch_bounds__(64)' in src
    assert "__builtin_amdgcn_sdot4" in src and "ps_dot4_i8" not in src
    assert "#pragma clang fp contract(off)" in src
    # No v_dot4_i32_i8 on gfx803 / gfx1010: the portable definition.
    for arch in ("gfx803", "gfx1010"):
        src = render(intrinsics_kernel(), arch)
        assert "__builtin_amdgcn_sdot4" not in src and "int ps_dot4_i8(" in src
    f16 = render(f16_local_kernel(), "gfx1030")
    assert "const __half* h" in f16 and "__half2float(h[" in f16 and "__float2half_rn(" in f16
    assert "__syncthreads();" in f16 and "__shared__ unsigned short t[256];" in f16
    portable = render(f16_local_kernel(), "gfx1030", native_f16=False)
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
def test_compiler_crash_does_not_kill_the_caller(home, monkeypatch):
    monkeypatch.setenv(hiprt.FORCE_ENV, "1")
    rt = hiprt.HIPRuntime("gfx1100", compile_only=True)  # refusal disabled: hiprtc itself gets the arch
    with pytest.raises(PolystrataError, match="hiprtc crashed .* compiling kernel red32 for gfx1100"):
        rt.compile(reduce_kernel(32))
    assert rt.cache_misses == 0 and not list(cache_dir("hip").glob("*.co"))


@pytest.mark.parametrize("arch,other", [pytest.param("gfx90a", "gfx1030", marks=amd, id="hiprtc"),
                                        pytest.param("sm_90", "sm_80", marks=nv, id="nvrtc")])
def test_code_object_cache_hit_in_fresh_runtime(home, arch, other):
    """hiprtc's code objects and NVRTC's cubins alike: built once, then from this runtime's memory, then from the
    cache in a fresh runtime; another arch is another key."""
    kern = reduce_kernel(64)
    first = hiprt.HIPRuntime(arch, compile_only=True)
    a = first.compile(kern)
    assert not a.cached and first.cache_misses == 1 and first.compile(kern) is a
    fresh = hiprt.HIPRuntime(arch, compile_only=True)
    b = fresh.compile(kern)
    assert b.cached and fresh.cache_hits == 1 and fresh.cache_misses == 0 and b.handle.code == a.handle.code
    assert not hiprt.HIPRuntime(other, compile_only=True).compile(kern).cached


def _refuses_to_run(rt, vendor: str) -> None:
    """A compile-only runtime compiles, and its buffers and launches raise the one error saying so."""
    ck = rt.compile(grid_kernel())
    want = rf"no {vendor} GPU: the hip target can compile \(polystrata compile --target hip --arch {rt.arch}\) but not"
    for call in (lambda: rt.alloc((4,), "f32"), lambda: rt.upload(np.zeros(4, np.float32)),
                 lambda: rt.launch(ck, [None], (3, 4, 5))):
        with pytest.raises(PolystrataError, match=want):
            call()


@amd
def test_compile_only_launch_error():
    _refuses_to_run(hiprt.HIPRuntime("gfx1030", compile_only=True), "AMD")


def test_child_entry_usage():
    """The compiler's child process (`runtimes.base.compile_in_child`) asked without a compiler says how to call it."""
    p = subprocess.run([sys.executable, "-m", "polystrata.runtimes.base"], capture_output=True, text=True)
    assert p.returncode != 0 and "usage" in p.stderr


# --- a GPU, where there is one ----------------------------------------------------------------------------------


def test_runs_on_gpu():
    """Sums and maxima of rows on a real AMD GPU (skipped without one)."""
    if not AMD or hiprt._gpu_count() == 0:
        pytest.skip("no AMD GPU")
    rt = hiprt.HIPRuntime()
    for lanes in (1, rt.subgroup // 2, rt.subgroup, 2 * rt.subgroup, 96):
        kern = reduce_kernel(lanes)
        n_ = 77
        x = np.random.default_rng(lanes).standard_normal(n_ * n_).astype(np.float32)
        bufs = {"x": rt.upload(x), "s": rt.alloc((n_,), "f32"), "m": rt.alloc((n_,), "f32")}
        rt.launch(rt.compile(kern), rt.args_for(kern, bufs, {"n": n_, "rows": n_}), (n_,))
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
    src.write_text(CUDA_PRELUDE + render(kern, "sm_80"))
    p = subprocess.run(["nvcc", "-arch=sm_80", "--fmad=false", "--ptx", "-o", str(tmp_path / "k.ptx"), str(src)],
                       capture_output=True, text=True, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert p.returncode == 0, p.stderr[-3000:]
    ptx = (tmp_path / "k.ptx").read_text()
    assert f".entry {kern.name}(" in ptx  # extern "C": the name is not mangled
    if kern.name == "intr":
        assert "dp4a" in ptx


# --- the same source through NVRTC (runtimes/hip_nvrtc.py) -------------------------------------------------------


def _is_cubin(code: bytes) -> None:
    assert code[:4] == b"\x7fELF" and len(code) > 256
    assert int.from_bytes(code[18:20], "little") == 190  # e_machine: EM_CUDA


def test_nvrtc_dispatch(monkeypatch):
    """Which runtime `HIPRuntime(...)` is: sm_XX always NVRTC; no arch only with an NVIDIA GPU and no AMD one."""
    wanted = hipnv.wanted
    assert wanted(hiprt.HIPRuntime, "sm_90", False) and wanted(hiprt.HIPRuntime, "sm_80", True)
    assert not wanted(hiprt.HIPRuntime, "gfx90a", False) and not wanted(hipnv.NVRTCRuntime, "sm_90", False)
    monkeypatch.setattr(hipnv, "gpu_count", lambda: 1)
    monkeypatch.setattr(hiprt, "available", lambda: False)
    assert wanted(hiprt.HIPRuntime, None, False) and not wanted(hiprt.HIPRuntime, None, True)
    monkeypatch.setattr(hiprt, "available", lambda: True)
    monkeypatch.setattr(hiprt, "_gpu_count", lambda: 1)  # an AMD GPU comes first
    assert not wanted(hiprt.HIPRuntime, None, False)
    monkeypatch.setattr(hiprt, "_gpu_count", lambda: 0)
    assert wanted(hiprt.HIPRuntime, None, False)
    monkeypatch.setattr(hipnv, "gpu_count", lambda: 0)
    assert not wanted(hiprt.HIPRuntime, None, False)


@nv
@pytest.mark.parametrize("kern", [reduce_kernel(1), reduce_kernel(16), reduce_kernel(32), reduce_kernel(128),
                                  shared_kernel(32), shared_kernel(96), *(make() for make in OTHERS.values())],
                         ids=lambda kk: kk.name)
def test_nvrtc_compiles_every_construct(kern):
    rt = hiprt.HIPRuntime("sm_90", compile_only=True)
    assert isinstance(rt, hipnv.NVRTCRuntime)
    ck = rt.compile(kern)
    _is_cubin(ck.handle.code)
    assert ck.source.startswith(CUDA_PRELUDE) and "sm_90, wave 32" in ck.source
    assert ck.source.endswith(render(kern, "sm_90"))  # the HIP renderer's source, unchanged
    if kern.name == "intr":
        assert "__builtin_amdgcn_sdot4" in ck.source  # -> PTX dp4a through the prelude


@nv
def test_nvrtc_reuses_loads_across_dp4a():
    """The prelude's dp4a is asm NVRTC may move: the Q4_K matvec's PTX reuses each weight word for the low and
    high nibbles (36 global loads a lane and block; CUDA's volatile __dp4a left 76)."""
    import re

    from polystrata.codegen.recipes.linear import matvec_q8_kernel
    from polystrata.ir.formats import FORMATS

    kern = matvec_q8_kernel("t_mv", [FORMATS["Q4_K"]], 4096, 4096, tokens=1, lanes=128, runs=0)
    rt = hiprt.HIPRuntime("sm_90", compile_only=True)
    ptx = rt._build(rt.render(kern), kern.name, ptx=True).decode(errors="replace")
    assert len(re.findall(r"\bdp4a\.s32\.s32\b", ptx)) == 32
    assert len(re.findall(r"\bld\.global\.", ptx)) <= 40


@nv
def test_nvrtc_options_device_and_compile_only_errors():
    rt = hiprt.HIPRuntime("sm_90", compile_only=True)
    assert rt.options[:2] == ["--gpu-architecture=sm_90", "--fmad=false"] and not rt.ptx
    assert all(o.startswith("-I") for o in rt.options[2:])
    assert (rt.lanes, rt.subgroup, rt.gpu) == (32, 32, False) and rt.memory_info() is None
    assert rt.device == f"sm_90 (compile only, NVRTC {NVRTC[0]}.{NVRTC[1]}, HIP source)"
    _refuses_to_run(rt, "NVIDIA")
    with pytest.raises(PolystrataError, match="unknown NVIDIA architecture 'sm_9x'"):
        hiprt.HIPRuntime("sm_9x")


@nv
def test_nvrtc_ptx_for_an_arch_newer_than_nvrtc():
    rt = hiprt.HIPRuntime("sm_990", compile_only=True)
    assert rt.ptx and rt.options[0].startswith("--gpu-architecture=compute_")
    ptx = rt.compile(reduce_kernel(64)).handle.code
    assert b".entry red64(" in ptx and f".target sm_{rt.options[0].split('_')[-1]}".encode() in ptx


@nv
def test_nvrtc_syntax_error_is_clean(home, monkeypatch):
    kern = Kernel("broken", (Buf("y", "f32", True),), (1,), (Store("y", 0, Call("rsqrt", Const(2.0))),))
    monkeypatch.setattr(hipgen.HIPPrinter, "rsqrt", lambda self, x: f"ps_no_such_intrinsic({x})")
    rt = hiprt.HIPRuntime("sm_90", compile_only=True)
    with pytest.raises(PolystrataError, match="NVRTC build of kernel broken failed for sm_90") as err:
        rt.compile(kern)
    msg = str(err.value)
    assert "ps_no_such_intrinsic" in msg and "error" in msg
    assert len(msg.splitlines()) <= 22
    assert rt.cache_misses == 0 and not list(cache_dir("hip").glob("broken_*"))


# --- on an NVIDIA GPU: HIPRuntime() through NVRTC and the CUDA driver -----------------------------------------------

@pytest.fixture(scope="module")
def nvrt():
    if not NV_GPU:
        pytest.skip("no NVIDIA GPU (or no NVRTC, or an AMD GPU takes precedence)")
    return hiprt.HIPRuntime()


@nv_gpu
def test_nvidia_runtime_is_nvrtc(nvrt):
    from cuda.bindings import driver

    assert isinstance(nvrt, hipnv.NVRTCRuntime) and nvrt.gpu and nvrt.subgroup == 32
    assert nvrt.device.startswith("NVIDIA") and "via NVRTC (HIP source" in nvrt.device
    dev = driver.cuDeviceGet(0)[1]
    major = driver.cuDeviceGetAttribute(driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)[1]
    assert nvrt.arch.startswith(f"sm_{major}")
    free, total = nvrt.memory_info()
    assert 0 < free <= total
    buf = nvrt.alloc((5,), "i32")  # zeroed
    np.testing.assert_array_equal(nvrt.download(buf, (5,), "i32"), np.zeros(5, np.int32))
    nvrt.write(buf, np.arange(3, dtype=np.int32))
    np.testing.assert_array_equal(nvrt.download(buf, (5,), "i32"), [0, 1, 2, 0, 0])
    rows = nvrt.upload(np.arange(12, dtype=np.float32))  # 4 rows of 3: reads at an offset
    np.testing.assert_array_equal(nvrt.download_rows(rows, 3, [0, 2, 3], "f32"), [[0, 1, 2], [6, 7, 8], [9, 10, 11]])
    with pytest.raises(PolystrataError, match="write of 24 bytes at 0 beyond a 20-byte hip buffer"):
        nvrt.write(buf, np.arange(6, dtype=np.int32))
    if hipnv.include_dirs():
        assert f"-I{hipnv.include_dirs()[0]}" in nvrt.options


@nv_gpu
@pytest.mark.parametrize("lanes", [1, 16, 32, 64, 96, 128])
def test_nvidia_reductions_vs_numpy(nvrt, lanes):
    n_ = 77
    x = np.random.default_rng(lanes).standard_normal(n_ * n_).astype(np.float32)
    out = run(nvrt, reduce_kernel(lanes), {"x": x}, {"s": (n_, "f32"), "m": (n_, "f32")}, {"n": n_, "rows": n_}, (n_,))
    np.testing.assert_allclose(out["s"], x.reshape(n_, n_).sum(1), rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(out["m"], 2 * x.reshape(n_, n_).max(1))


@nv_gpu
@pytest.mark.parametrize("case", cases(), ids=lambda c: c[0])
def test_nvidia_matches_numpy_and_cpu(nvrt, case):
    """Every construct on the GPU against numpy (CUDA's math functions are within a few ulp: 2e-5 relative) and,
    but for math, the CPU target."""
    cpu = pytest.importorskip("polystrata.runtimes.cpu")  # Numba
    label, kern, inputs, outputs, scalars, grid, ref = case
    got = run(nvrt, kern, inputs, outputs, scalars, grid)
    check_case(got, ref, outputs, label, tol=2e-5)
    if kern.name != "mathf":
        check_case(got, run(cpu.CPURuntime(), kern, inputs, outputs, scalars, grid), outputs, label + " vs cpu")


# First 16 bits of the VOP3P-MAI words of the MFMA instructions the tile products use on gfx90a (as llvm-objdump
# shows them: D3D58000 v_mfma_i32_16x16x16i8, D3CD8000 v_mfma_f32_16x16x16f16).
MFMA_OPCODES = {0xD3D5: "v_mfma_i32_16x16x16i8", 0xD3CD: "v_mfma_f32_16x16x16f16"}


def _mfma_in(code: bytes, arch: str) -> set[str]:
    """The MFMA mnemonics in a code object: llvm-objdump's disassembly where it is installed, else a scan of its
    32-bit words for the instructions' encodings."""
    objdump = shutil.which("llvm-objdump")
    if objdump:
        import re
        import tempfile

        with tempfile.NamedTemporaryFile(suffix=".co") as f:
            f.write(code)
            f.flush()
            text = subprocess.run([objdump, "-d", f"--mcpu={arch}", f.name], capture_output=True, text=True).stdout
        return set(re.findall(r"v_mfma_\w+", text))
    words = np.frombuffer(code[:len(code) // 4 * 4], "<u4")
    return {MFMA_OPCODES[w >> 16] for w in words if w >> 16 in MFMA_OPCODES}


@pytest.mark.parametrize("arch", ARCHS)
def test_tile_products_on_mfma_or_dot4(runtimes, arch):
    """gfx90a: the tile products (conformance kernels, the prefill matmul recipe's, int8 and f16, and prefill
    attention's, f16) compile to MFMA instructions; gfx1030 (no MFMA): to the portable loops, int8 through sdot4
    (v_dot4)."""
    from ir_constructs import tile_kernel

    from polystrata.codegen.recipes.attention_tiles import prefill_attention_kernel
    from polystrata.codegen.recipes.tile_mma import tile_mma_kernel
    from polystrata.ir.formats import FORMATS, KV_FORMATS

    rt = runtimes(arch)
    if arch != "gfx90a":
        ck = rt.compile(tile_kernel("i8"))
        assert not rt.matrix_units and not _mfma_in(ck.handle.code, arch) and "__builtin_amdgcn_sdot4" in ck.source
        return
    recipe = tile_mma_kernel("t_mma_hip", [FORMATS["Q4_K"]], 64, 256, rows=32, tokens=32, chunk=64, lanes=64)
    q8 = KV_FORMATS["q8_0"]
    attention = prefill_attention_kernel("attn_mma_hip", q8, q8, 8, 2, 128, 128, lambda x: x * 0.125, 0, 64, 16, 32,
                                         mma=True)
    found = {name: _mfma_in(rt.compile(k).handle.code, arch) for name, k in
             (("i8", tile_kernel("i8")), ("f16", tile_kernel("f16")), ("recipe", recipe), ("attention", attention))}
    assert rt.matrix_units
    assert found == {"i8": {"v_mfma_i32_16x16x16i8"}, "f16": {"v_mfma_f32_16x16x16f16"},
                     "recipe": {"v_mfma_i32_16x16x16i8"}, "attention": {"v_mfma_f32_16x16x16f16"}}, found
    # gfx942's int8 MFMA takes 8 bytes a lane (ROCm 5.2 cannot compile for it: the source only).
    src = render(tile_mma_kernel("t_mma_942", [FORMATS["Q8_0"]], 64, 256, rows=32, tokens=32, chunk=64, lanes=64),
                 "gfx942")
    assert "__builtin_amdgcn_mfma_i32_16x16x32_i8((long)" in src
    # RDNA3's WMMA (wave32; this ROCm cannot compile for gfx11 either: the source only, its layout is emulated in
    # test_target_cuda.py).
    src = render(tile_mma_kernel("t_mma_11", [FORMATS["Q8_0"]], 64, 256, rows=32, tokens=16, chunk=64, lanes=64),
                 "gfx1100")
    assert "__builtin_amdgcn_wmma_i32_16x16x16_iu8_w32(true, (ps_i32x4){(int)" in src

"""The kernel cache (runtimes/base.py): entries are checked against their recorded digests and key before anything
is loaded, and a corrupt entry is rebuilt with one warning; kernel names are the same in every process; one home
directory (polystrata/paths.py) for the zoo and the kernel cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from polystrata import zoo
from polystrata.errors import PolystrataError
from polystrata.ir.kernel import Buf, Kernel, Load, Scalar, Store, Var
from polystrata.runtimes.base import CacheEntry, cache_dir
from polystrata.runtimes.cpu import CPURuntime
from polystrata.synth import synth_model

g0 = Var("g0")
# The smallest kernel there is: y = 2x + 1, one element per group.
AFFINE = Kernel("affine", (Buf("x", "f32"), Buf("y", "f32", out=True), Scalar("n")), (Var("n"),),
                (Store("y", g0, Load("x", g0) * 2.0 + 1.0),))
X = np.arange(-3, 4, dtype=np.float32)
MAIN_FILE = {"cpu": "k_*.py", "cuda": "k_*.py", "opencl": "affine_*.bin"}  # the file an entry is named by


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("POLYSTRATA_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def affine(rt):
    """Compile AFFINE on `rt` (through the cache) and run it on X: (compiled kernel, y)."""
    ck = rt.compile(AFFINE)
    bufs = {"x": rt.upload(X), "y": rt.alloc(X.shape, "f32")}
    rt.launch(ck, rt.args_for(AFFINE, bufs, {"n": X.size}), (X.size,))
    rt.sync()
    return ck, rt.download(bufs["y"], X.shape, "f32")


def one_file(target: str, pattern: str) -> Path:
    (path,) = cache_dir(target).glob(pattern)
    return path


def rewrite(pattern: str, change: Callable[[bytes], bytes]) -> Callable[[str], None]:
    """A damage: the cache file of the target matching `pattern`, rewritten by `change`."""
    def damage(target: str) -> None:
        path = one_file(target, pattern)
        path.write_bytes(change(path.read_bytes()))
    return damage


def garble(data: bytes) -> bytes:
    mid = len(data) // 2
    return data[:mid] + bytes(b ^ 0x5A for b in data[mid:mid + 64]) + data[mid + 64:]


def reseal_after(damage: Callable[[str], None]) -> Callable[[str], None]:
    """`damage`, then a record that matches it: only the loader can tell (Numba's cache fails to load)."""
    def both(target: str) -> None:
        damage(target)
        py = one_file(target, "k_*.py")
        CacheEntry(py, json.loads(py.with_name(f"{py.stem}.sha256.json").read_text())["key"]).seal()
    return both


def check_rebuilt(make_runtime: type, damage, capsys, warns: bool = True) -> None:
    """Build AFFINE with a fresh `make_runtime()`, damage its cache entry, and expect a rebuild with the right
    output and one warning (none where `warns` is False), then a clean cache hit."""
    ck, y = affine(make_runtime())
    assert not ck.cached and np.array_equal(y, 2 * X + 1)
    capsys.readouterr()
    damage(make_runtime.name)
    ck, y = affine(make_runtime())
    assert np.array_equal(y, 2 * X + 1)
    assert not ck.cached
    err = capsys.readouterr().err.splitlines()
    main = one_file(make_runtime.name, MAIN_FILE[make_runtime.name])
    assert err == ([f"warning: kernel cache entry {main} was corrupt; rebuilt"] if warns else [])
    ck, y = affine(make_runtime())
    assert ck.cached and np.array_equal(y, 2 * X + 1)
    assert capsys.readouterr().err == ""


# Still valid Python: without the check, Numba recompiles it and the kernel computes 3x + 1.
EDITED_PY = rewrite("k_*.py", lambda b: b.replace(b"np.float32(2.0)", b"np.float32(3.0)"))
CPU_DAMAGE = {
    "edited py": EDITED_PY,
    "truncated py": rewrite("k_*.py", lambda b: b[: len(b) // 2]),
    "emptied py": rewrite("k_*.py", lambda b: b""),
    "garbled nbc": rewrite("__pycache__/k_*.nbc", garble),
    "truncated nbi": rewrite("__pycache__/k_*.nbi", lambda b: b[: len(b) // 2]),
    "record of another key": rewrite("k_*.sha256.json", lambda b: b.replace(b'"key": "', b'"key": "0')),
    "garbled record": rewrite("k_*.sha256.json", garble),
    "nbi the loader rejects": reseal_after(rewrite("__pycache__/k_*.nbi", lambda b: b[: len(b) // 2])),
}


@pytest.mark.parametrize("damage", CPU_DAMAGE)
def test_cpu_corrupt_entry_is_rebuilt_with_one_warning(home, capsys, damage):
    check_rebuilt(CPURuntime, CPU_DAMAGE[damage], capsys)


def test_cpu_entry_without_record_is_rebuilt_quietly(home, capsys):
    """An entry whose build never finished (or from before records) is rebuilt without a warning."""
    check_rebuilt(CPURuntime, lambda target: one_file(target, "k_*.sha256.json").unlink(), capsys, warns=False)


def test_cpu_record_lists_the_numba_cache(home):
    affine(CPURuntime())
    py = one_file("cpu", "k_*.py")
    record = json.loads(py.with_name(f"{py.stem}.sha256.json").read_text())
    assert record["key"] == py.stem[2:]
    names = set(record["sha256"])
    assert py.name in names and {Path(n).suffix for n in names} >= {".py", ".nbi", ".nbc"}


def test_concurrent_builds_of_one_entry_build_once(home, monkeypatch, capsys):
    """Two runtimes (two test workers, say) wanting the same kernel while the first is still building it: the
    second waits for that build and loads it, rather than discarding the unsealed files and building again."""
    from polystrata.runtimes import base

    building, resume, second_wrote = threading.Event(), threading.Event(), threading.Event()
    write = base.atomic_write

    def paused_write(path, data):
        write(path, data)
        if path.suffix != ".py":  # the entry's record, written by the same helper
            return
        if not building.is_set():
            building.set()  # the first build: source written, nothing compiled or recorded yet
            resume.wait(60)
        else:
            second_wrote.set()

    monkeypatch.setattr(base, "atomic_write", paused_write)
    results = {}

    def compile_as(who: str) -> None:
        results[who] = affine(CPURuntime())

    first = threading.Thread(target=compile_as, args=("first",))
    first.start()
    assert building.wait(60)
    second = threading.Thread(target=compile_as, args=("second",))
    second.start()
    second_wrote.wait(2)  # an unlocked cache lets the second build at once
    resume.set()
    first.join(120)
    second.join(120)
    assert not second_wrote.is_set()
    (ck1, y1), (ck2, y2) = results["first"], results["second"]
    assert not ck1.cached and ck2.cached
    assert np.array_equal(y1, 2 * X + 1) and np.array_equal(y2, 2 * X + 1)
    py = one_file("cpu", "k_*.py")
    assert CacheEntry(py, py.stem[2:]).verify() is True
    assert capsys.readouterr().err == ""


@pytest.mark.target("opencl")
def test_opencl_garbled_binary_is_rebuilt(home, capsys):
    from polystrata.runtimes.opencl import OpenCLRuntime

    try:
        OpenCLRuntime()
    except PolystrataError as e:
        pytest.skip(str(e))
    check_rebuilt(OpenCLRuntime, rewrite("affine_*.bin", garble), capsys)


@pytest.mark.target("hip")
def test_hip_garbled_code_object_is_rebuilt(home, capsys):
    from polystrata.runtimes import hip

    if not hip.available():
        pytest.skip("libamdhip64 not installed")
    rt = hip.HIPRuntime("gfx1030", compile_only=True)
    code = rt.compile(AFFINE).handle.code
    path = one_file("hip", "affine_*.co")
    path.write_bytes(garble(code))
    capsys.readouterr()
    again = hip.HIPRuntime("gfx1030", compile_only=True).compile(AFFINE)
    assert not again.cached and again.handle.code == code == path.read_bytes()
    assert capsys.readouterr().err.splitlines() == [f"warning: kernel cache entry {path} was corrupt; rebuilt"]


# --- stable names: one compile per kernel, whichever process -------------------------------------------------


@pytest.mark.slow  # a whole model's kernels (compiled once a run: test_cli's and test_artifact_kernels' tiny model)
def test_second_process_compiles_nothing(tmp_path):
    """A llama-family model's kernels (rope kernels) compiled in this process, through the run's cache, and copied
    as they are into an empty cache: `compile` in another process finds every one there and writes no file."""
    from polystrata.artifact import KERNELS, write_artifact

    model = synth_model("llama", tmp_path / "tiny.gguf", preset="tiny", qtype="Q8_0", seed=0)
    write_artifact(model, "cpu", tmp_path / "a1")  # its kernels/ holds the cache entries, files and records
    kernels = tmp_path / "home" / "kernels"
    kernels.mkdir(parents=True)
    (tmp_path / "a1" / KERNELS).rename(kernels / "cpu")

    def cache_files() -> list[Path]:  # the entries' files (the locks, dot files, come with the first look)
        return sorted(p.relative_to(kernels) for p in kernels.rglob("*") if not p.name.startswith("."))

    files = cache_files()
    env = dict(os.environ, POLYSTRATA_HOME=str(tmp_path / "home"))
    p = subprocess.run([sys.executable, "-m", "polystrata", "compile", str(model), "--target", "cpu", "-o",
                        str(tmp_path / "a2")], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr
    assert " 0 compiled (cache hit)" in p.stderr, p.stderr
    assert cache_files() == files


# --- one home directory --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "where"), [("", ".cache/polystrata"), ("~/x", "x")])
def test_home_expands_and_defaults(tmp_path, monkeypatch, value, where):
    """An empty POLYSTRATA_HOME is unset and `~` expands, for models and kernels alike (not `./kernels`)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("POLYSTRATA_HOME", value)
    home = tmp_path / where
    assert zoo.models_dir() == home / "models"
    assert cache_dir("cpu") == home / "kernels" / "cpu"
    for d in (home, home / "kernels", home / "kernels" / "cpu"):
        assert d.stat().st_mode & 0o777 == 0o700, d
    assert sorted(p.name for p in tmp_path.iterdir()) == [where.split("/")[0]]


def test_compile_all_compiles_what_the_cache_lacks_in_worker_processes(home, monkeypatch):
    """With POLYSTRATA_COMPILE_JOBS=2, the kernels the cache lacks are compiled by spawned workers into the cache,
    and this process loads every one from there, counting them as compiled (what `compile` reports); what the
    cache holds (or this process compiled) starts no worker; a bad setting is one clear error."""
    monkeypatch.setenv("POLYSTRATA_COMPILE_JOBS", "2")
    scaled = Kernel("scaled", AFFINE.params, AFFINE.grid, (Store("y", g0, Load("x", g0) * 3.0 - 1.0),))
    rt = CPURuntime()
    assert rt.compile_workers() == 2
    assert not rt._built(AFFINE) and not rt._built(scaled)
    out = rt.compile_all([AFFINE, scaled, AFFINE])
    assert (rt.cache_hits, rt.cache_misses) == (0, 2)  # both built by the workers: compiled, not cache hits
    assert rt._built(AFFINE) and rt._built(scaled)
    bufs = {"x": rt.upload(X), "y": rt.alloc(X.shape, "f32")}
    rt.launch(out[scaled.fingerprint()], rt.args_for(scaled, bufs, {"n": X.size}), (X.size,))
    np.testing.assert_array_equal(rt.download(bufs["y"], X.shape, "f32"), X * 3 - 1)
    fresh = CPURuntime()
    fresh.compile_all([AFFINE, scaled])
    assert (fresh.cache_hits, fresh.cache_misses) == (2, 0)
    # A kernel its worker fails on is compiled here, which reports the build error as a serial compile does.
    broken = Kernel("broken", AFFINE.params, AFFINE.grid, (Store("y", g0, Var("undefined")),))
    halved = Kernel("halved", AFFINE.params, AFFINE.grid, (Store("y", g0, Load("x", g0) * 0.5),))
    with pytest.raises(PolystrataError, match="build of kernel broken failed"):
        fresh.compile_all([halved, broken])
    monkeypatch.setenv("POLYSTRATA_COMPILE_JOBS", "many")
    with pytest.raises(PolystrataError, match="POLYSTRATA_COMPILE_JOBS must be a whole number"):
        CPURuntime().compile_workers()


def test_an_edit_of_an_imported_intrinsic_module_misses_the_cache(tmp_path, monkeypatch):
    """Kernels compile the intrinsic modules their source imports (cpu_intrinsics, and through it
    numba_intrinsics) into their machine code: an edit there gives another key, as an edit of the source does."""
    import importlib.util
    from types import SimpleNamespace

    from polystrata.runtimes import base

    source = "from polystrata.codegen.cpu_intrinsics import dot_f32\n"
    before = base.cache_key(source, "cpu", "dev", "numba")
    real = importlib.util.find_spec
    edited = tmp_path / "numba_intrinsics.py"
    edited.write_text(Path(real("polystrata.codegen.numba_intrinsics").origin).read_text() + "\n# edited\n")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: SimpleNamespace(origin=str(edited))
                        if name == "polystrata.codegen.numba_intrinsics" else real(name, *a))
    base._modules_digest.cache_clear()
    try:
        assert base.cache_key(source, "cpu", "dev", "numba") != before
        assert base.intrinsics_digest("__kernel void k() {}") == ""  # a C source imports none
    finally:
        base._modules_digest.cache_clear()

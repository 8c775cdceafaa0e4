"""The target registry (`polystrata/targets.py`) and what the project asks runtime classes instead of naming
targets, and the defaults `runtimes/base.py` gives every runtime (no kernel compiles here)."""

from __future__ import annotations

import numpy as np
import pytest

from polystrata import artifact, bench
from polystrata.errors import PolystrataError, UnsupportedError
from polystrata.runtimes.base import CompiledKernel, Runtime
from polystrata.runtimes.cpu import CPURuntime
from polystrata.targets import KERNEL_TARGETS, TARGETS, is_host, make_runtime, resolve_target, runtime_class


def test_every_target_is_one_registry_entry():
    assert TARGETS == ("auto", "reference", *KERNEL_TARGETS) and KERNEL_TARGETS[-1] == "cpu"
    for name in KERNEL_TARGETS:
        cls = runtime_class(name)
        assert issubclass(cls, Runtime) and cls.name == name and cls.source_ext != "txt"
    assert {t for t in TARGETS[1:] if is_host(t)} == {"reference", "cpu"}
    assert [t for t in KERNEL_TARGETS if runtime_class(t).takes_arch] == ["cuda", "hip"]
    assert artifact._source_suffixes() == {".py", ".hip", ".cl"}
    with pytest.raises(UnsupportedError, match="has no kernel runtime"):
        runtime_class("reference")
    with pytest.raises(UnsupportedError, match="--arch applies"):
        make_runtime("cpu", arch="gfx90a")


def test_auto_takes_the_first_registered_target_whose_device_is_present(monkeypatch):
    """`auto` asks each class's `present()` in registry order; one whose check fails (a missing driver) is passed
    over; the CPU is always present."""
    for name in KERNEL_TARGETS[:-1]:
        monkeypatch.setattr(runtime_class(name), "present", classmethod(lambda cls: False))
    assert resolve_target("auto") == "cpu"

    def broken(cls):
        raise OSError("libcuda.so: cannot open shared object file")

    monkeypatch.setattr(runtime_class("cuda"), "present", classmethod(broken))
    monkeypatch.setattr(runtime_class("opencl"), "present", classmethod(lambda cls: True))
    assert resolve_target("auto") == "opencl"
    monkeypatch.setattr(runtime_class("hip"), "present", classmethod(lambda cls: True))
    assert resolve_target("auto") == "hip"


def test_bench_asks_the_runtime_for_threads_and_host():
    class Engine:
        runtime = CPURuntime()
        device = runtime.device

    import numba

    assert bench.engine_threads(Engine()) == numba.get_num_threads() == Engine.runtime.threads()
    assert bench.describe_device(Engine(), "cpu") != "cpu"  # a host target: the CPU model is named


class _Recorder(Runtime):
    """A runtime whose buffers are numpy bytes and whose launches are recorded: the base class's defaults."""

    name = "recorder"

    def __init__(self):
        super().__init__()
        self.launched: list = []

    def render(self, kernel):
        return ""

    def compile(self, kernel):
        return CompiledKernel(kernel, None, "", False)

    def alloc(self, shape, dtype):
        return np.zeros(max(int(np.prod(shape)) * 4, 4), np.uint8)

    def read_bytes(self, buf, out, offset=0):
        out[:] = buf[offset : offset + out.size]

    def write_bytes(self, buf, offset, host):
        buf[offset : offset + host.size] = host

    def launch(self, ck, args, grid):
        self.launched.append((ck, list(args), list(grid)))


def test_base_defaults_capture_replay_and_timing():
    """Every runtime can prepare, capture and replay (the defaults record the prepared launches and re-launch
    them) and has marks (None: no device clock), so the executor never asks what a runtime has."""
    rt = _Recorder()
    assert not rt.graphs and rt.mark() is None and rt.elapsed(rt.mark(), rt.mark()) is None
    assert rt.kernel_resources(rt.compile(None)) == {}
    p = rt.prepare("ck", [1, 2.5], (3,))
    rt.begin_capture()
    rt.launch_prepared(p)
    with pytest.raises(PolystrataError, match="already open"):
        rt.begin_capture()
    graph = rt.end_capture()
    assert rt.launched == []  # captured, not run
    rt.replay(graph)
    rt.replay(graph)
    assert rt.launched == [("ck", [1, 2.5], [3])] * 2
    with pytest.raises(PolystrataError, match="end_capture without begin_capture"):
        rt.end_capture()


@pytest.mark.parametrize("runtime", [_Recorder, CPURuntime])
def test_base_moves_bytes_and_reinterprets_them(runtime):
    """`write` copies an array's bytes whatever the buffer's dtype; `download` views the bytes as the asked dtype
    (f16 back as f32), `download_rows` the rows asked for; all refuse to go past the buffer's end."""
    rt = runtime()
    buf = rt.alloc((4,), "f32")
    rt.write(buf, np.array([1.5, -2.0], np.float16))
    np.testing.assert_array_equal(rt.download(buf, (2,), "f16"), [1.5, -2.0])
    rt.write_region(buf, 8, np.array([7], np.int32))
    assert rt.download(buf, (3,), "i32")[2] == 7
    buf2 = rt.upload(np.arange(3, dtype=np.float32))
    np.testing.assert_array_equal(rt.download(buf2, (3,), "f32"), [0, 1, 2])
    with pytest.raises(PolystrataError, match="write of 8 bytes at 12 beyond a 16-byte"):
        rt.write_region(buf, 12, np.zeros(2, np.float32))
    with pytest.raises(PolystrataError, match="download of 20 bytes"):
        rt.download(buf, (5,), "f32")
    rows = rt.alloc((12,), "f32")  # 4 rows of 3: rows 0, 2 and 3 read (two reads)
    rt.write(rows, np.arange(12, dtype=np.float32))
    np.testing.assert_array_equal(rt.download_rows(rows, 3, [0, 2, 3], "f32"), [[0, 1, 2], [6, 7, 8], [9, 10, 11]])
    assert rt.download_rows(rows, 3, [], "f32").shape == (0, 3)
    with pytest.raises(PolystrataError, match="download of 12 bytes at 48 beyond a 48-byte"):
        rt.download_rows(rows, 3, [1, 4], "f32")


def test_every_package_is_installed_by_a_plain_pip_install():
    """`pip install .` (not editable) installs only the packages pyproject.toml lists: each directory of the
    source tree with an `__init__.py` must be there under its installed name (polystrata.tuning once was not, and
    every command failed to import on a machine that installed a wheel)."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    setup = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = {d: name for name, d in setup["package-dir"].items()}
    found = set()
    for top, name in dirs.items():
        for init in (root / top).rglob("__init__.py"):
            rel = init.parent.relative_to(root / top).parts
            found.add(".".join((name, *rel)))
    assert found <= set(setup["packages"]), sorted(found - set(setup["packages"]))


def test_every_script_imports():
    """The scripts under scripts/ (device checks, benchmarks) run by hand or on the GPU machine, where a name
    renamed in the package and not in a script costs a device call: each one's imports and module-level code run
    here (its `main` does not)."""
    import importlib.util
    from pathlib import Path

    scripts = sorted((Path(__file__).resolve().parent.parent / "scripts").glob("*.py"))
    assert scripts
    for path in scripts:
        spec = importlib.util.spec_from_file_location(f"script_{path.stem}", path)
        spec.loader.exec_module(importlib.util.module_from_spec(spec))

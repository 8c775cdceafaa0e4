"""The suite's own plugin (tests/suite_plugin.py): one home for a whole run, shared by pytest-xdist workers, the
`--target` option and `--record-costs`. Each check runs a child pytest (its own temp folders, its own run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

TESTS = Path(__file__).parent


def pytest_run(*args: str, cwd: Path = TESTS) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    env.pop("POLYSTRATA_HOME", None)  # a child of a run would keep this run's home
    env.pop("PYTEST_XDIST_WORKER", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "suite_plugin",
                           *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


def test_workers_share_one_run_home(tmp_path):
    """Two xdist workers see one POLYSTRATA_HOME, fresh for the run, with the user's models linked in;
    `--record-costs` writes the CPU seconds of each file."""
    (tmp_path / "test_homes.py").write_text(textwrap.dedent("""
        import os, pytest
        @pytest.mark.parametrize("i", range(4))
        def test_home(i, tmp_path_factory):
            out = tmp_path_factory.getbasetemp().parent / f"home.{os.environ['PYTEST_XDIST_WORKER']}.{i}"
            out.write_text(os.environ["POLYSTRATA_HOME"])
    """))
    base = tmp_path / "base"
    costs = tmp_path / "costs.json"
    p = pytest_run("-n", "2", "--basetemp", str(base), "--record-costs", str(costs), str(tmp_path / "test_homes.py"),
                   cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    recorded = json.loads(costs.read_text())
    assert list(recorded) == ["test_homes.py"] and recorded["test_homes.py"] >= 0, recorded
    assert "CPU seconds: " in p.stdout and "test_homes.py::test_home[" in p.stdout, p.stdout
    seen = {f.name.split(".")[1]: f.read_text() for f in base.glob("home.*")}
    assert set(seen) == {"gw0", "gw1"} and len(set(seen.values())) == 1, seen
    home = Path(next(iter(seen.values())))
    assert home == base / "run-home" and (home / "models").is_symlink()


def test_target_option_narrows_the_targets():
    p = pytest_run("--collect-only", "--target", "cpu", "test_recipes_elementwise.py")
    assert p.returncode == 0, p.stdout + p.stderr
    ids = [line for line in p.stdout.splitlines() if "::" in line]
    assert ids and all("[cpu" in i for i in ids), ids
    p = pytest_run("-rs", "--target", "cpu", "test_target_opencl.py", "-k", "f16")
    assert p.returncode == 0 and " passed" not in p.stdout and "--target leaves out opencl" in p.stdout, p.stdout
    p = pytest_run("--target", "cpu,vulkan", "test_recipes_elementwise.py")
    assert p.returncode == 4 and "--target: unknown target 'vulkan'" in p.stderr, p.stderr

"""This test suite's pytest plugin (loaded by conftest.py): one home and kernel cache for the whole run, shared by
the pytest-xdist workers; the `--target` option that picks the kernel targets to test; and `--record-costs`, the
CPU seconds of each test and file (what a test costs, whatever else loads the machine)."""

from __future__ import annotations

import contextlib
import json
import os
import resource
from collections.abc import Iterator
from pathlib import Path

import pytest

from polystrata import zoo
from polystrata.paths import private_dir
from polystrata.targets import KERNEL_TARGETS, available_kernel_targets

RUN_HOME = "run-home"
_chosen: tuple[str, ...] = KERNEL_TARGETS
_spent: dict[str, float] = {}  # CPU seconds by test id, this run (`--record-costs`)


def pytest_addoption(parser):
    parser.addoption("--target", default="", metavar="T[,T...]",
                     help=f"kernel targets to test: {', '.join(KERNEL_TARGETS)} (default: every one available here)")
    parser.addoption("--record-costs", default="", metavar="FILE",
                     help="write each test file's CPU seconds (the tests' own and their child processes') to FILE "
                          "as JSON and print the costliest files and tests")


def pytest_configure(config):
    global _chosen
    names = tuple(n.strip() for n in config.getoption("target").split(",") if n.strip()) or KERNEL_TARGETS
    unknown = [n for n in names if n not in KERNEL_TARGETS]
    if unknown:
        known = ", ".join(KERNEL_TARGETS)
        raise pytest.UsageError(f"--target: unknown target '{unknown[0]}' (kernel targets: {known})")
    _chosen = names


def pytest_collection_modifyitems(config, items):
    for item in items:
        marker = item.get_closest_marker("target")
        if marker and marker.args[0] not in _chosen:
            item.add_marker(pytest.mark.skip(reason=f"--target leaves out {marker.args[0]}"))
    # Tests marked `long` (minutes alone) go first: started last, one of them would be a worker's tail while the
    # others idle.
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


def _cpu_seconds() -> float:
    return sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))


_START = pytest.StashKey[float]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if item.config.getoption("record_costs"):
        item.stash[_START] = _cpu_seconds()


def pytest_runtest_makereport(item, call):
    """With `--record-costs`: the test's CPU seconds (set-up and tear-down included; a child process counts once it
    has been waited for) go to the controller in its tear-down report."""
    if call.when == "teardown" and _START in item.stash:
        item.user_properties.append(("cpu_s", _cpu_seconds() - item.stash[_START]))


def pytest_runtest_logreport(report):
    if report.when == "teardown":
        cost = dict(report.user_properties).get("cpu_s")
        if cost is not None:
            _spent[report.nodeid] = cost


def pytest_terminal_summary(terminalreporter, config):
    if not config.getoption("record_costs") or not _spent:
        return
    files: dict[str, float] = {}
    for nodeid, cost in _spent.items():
        files[nodeid.split("::")[0]] = files.get(nodeid.split("::")[0], 0.0) + cost
    path = Path(config.getoption("record_costs"))
    path.write_text(json.dumps({f: round(c, 1) for f, c in sorted(files.items())}, indent=1) + "\n")
    write = terminalreporter.write_line
    write(f"CPU seconds: {sum(files.values()):.0f} in all; by file (written to {path}):")
    for f, c in sorted(files.items(), key=lambda fc: -fc[1]):
        write(f"{c:8.1f}  {f}")
    write("costliest tests:")
    for nodeid, c in sorted(_spent.items(), key=lambda nc: -nc[1])[:30]:
        write(f"{c:8.1f}  {nodeid}")


def targets_under_test() -> list[str]:
    """The kernel targets that run here and that `--target` chose, in `KERNEL_TARGETS` order (for parametrizing:
    test modules are collected after the option is read)."""
    return [t for t in available_kernel_targets() if t in _chosen]


@pytest.fixture(scope="session", autouse=True)
def run_home(tmp_path_factory) -> Iterator[Path]:
    """One POLYSTRATA_HOME for the whole run, shared by the pytest-xdist workers (their temp folders' parent). Its
    kernel cache starts empty and is keyed by each kernel's source, so a kernel compiles once per run, whichever
    test or worker needs it first; its `models` links to the user's, so the zoo models are pulled once ever.
    A pytest that a test starts (test_target_cuda's simulator run) keeps its parent's. Tests that need an empty
    cache or home on purpose set their own."""
    old = os.environ.get("POLYSTRATA_HOME")
    if old and Path(old).name == RUN_HOME:
        yield Path(old)
        return
    base = tmp_path_factory.getbasetemp()
    home = private_dir((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / RUN_HOME)
    with contextlib.suppress(FileExistsError):  # the other worker made it first
        (home / "models").symlink_to(private_dir(zoo.models_dir()), target_is_directory=True)
    os.environ["POLYSTRATA_HOME"] = str(home)
    yield home
    if old is None:
        os.environ.pop("POLYSTRATA_HOME", None)
    else:
        os.environ["POLYSTRATA_HOME"] = old

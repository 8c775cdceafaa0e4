"""Host threads of the cpu target (polystrata.threads) and the -t/--threads option."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from polystrata import threads
from polystrata.cli import main
from polystrata.synth import synth_model

# Each case runs in a fresh interpreter: a thread pool takes its settings once, when it starts.
_PROBE = """
import json, os, sys
import numba
from polystrata import threads
threads.machine_busy = lambda n: {busy}  # what the machine looks like when the pool starts
n = threads.configure({n})
out = {{"n": n, "numba": numba.get_num_threads(), "pool": numba.config.NUMBA_NUM_THREADS,
        "wait": os.environ.get("OMP_WAIT_POLICY"), "blocktime": os.environ.get("KMP_BLOCKTIME")}}
out["later"] = threads.configure(None)  # the first call's choice stands
out["more"] = threads.configure(n + 3)  # the pool started with n: cut, with a warning
print(json.dumps(out))
"""


def _probe(n: int | None, busy: bool = True, **env: str) -> tuple[dict, str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "KMP_BLOCKTIME", "GOMP_SPINCOUNT",
                                                                "NUMBA_NUM_THREADS")}
    p = subprocess.run([sys.executable, "-c", _PROBE.format(n=n, busy=busy)], capture_output=True, text=True,
                       check=True, env={**clean, **env}, timeout=120)
    return json.loads(p.stdout), p.stderr


def test_configure_sets_passive_waiting_and_the_count_before_the_pool_starts():
    out, err = _probe(1)
    assert out == {"n": 1, "numba": 1, "pool": 1, "wait": "PASSIVE", "blocktime": "0", "later": 1, "more": 1}
    assert err.strip() == "warning: 4 threads asked, but the thread pool already started with 1; using 1"


def test_default_count_is_every_usable_cpu_and_user_settings_win():
    out, _ = _probe(None, OMP_WAIT_POLICY="ACTIVE")
    assert out["n"] == out["numba"] == len(os.sched_getaffinity(0)) and out["wait"] == "ACTIVE"
    out, _ = _probe(None, GOMP_SPINCOUNT="300000")  # a spin count of the user's own: no wait policy imposed
    assert out["wait"] is None


def test_workers_spin_as_openmp_does_on_an_idle_machine():
    out, _ = _probe(None, busy=False)
    assert out["wait"] is None and out["blocktime"] is None


def test_machine_busy_sees_other_processes_running():
    n = len(os.sched_getaffinity(0))
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n + 1)]
    try:
        time.sleep(0.3)  # started and running
        assert threads.machine_busy(n)
    finally:
        for p in spinners:
            p.kill()
            p.wait()


@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_threads_must_be_a_positive_count(value, capsys):
    with pytest.raises(SystemExit) as e:
        main(["run", "-t", value])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: argument -t/--threads: expected")


@pytest.mark.parametrize("cmd", ["run", "score", "bench", "compile", "parity"])
def test_every_model_command_takes_threads(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        main([cmd, "--help"])
    assert e.value.code == 0 and "-t N, --threads N" in capsys.readouterr().out


def test_bench_decodes_with_the_threads_asked(tmp_path):
    # test_cli's tiny model at its default context (2048): kernels it compiles too.
    model = synth_model("llama", tmp_path / "tiny.gguf", preset="tiny", qtype="Q8_0", seed=0)
    p = subprocess.run([sys.executable, "-m", "polystrata", "bench", str(model), "--target", "cpu", "-p", "0", "-n",
                        "2", "-r", "1", "-c", "2048", "-t", "1", "--json"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["n_threads"] == 1
    assert "compiling kernels" not in p.stderr  # no progress under --json

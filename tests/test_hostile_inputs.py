"""Hostile and careless input: wrong metadata, fuzzed GGUF headers, hostile chat templates, bad arguments, Ctrl-C.

Every outcome is exit 0, or one line `error: ...` with exit 1 (2 for usage), never a traceback. Most cases
call the CLI's `main(argv)` in-process (hundreds of subprocesses would be too slow); a handful run the real
command. The inputs are data: tests/data/fuzz/gguf_mutations.json and tests/data/hostile_templates/.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from polystrata import chat
from polystrata.cli import main
from polystrata.errors import GGUFError
from polystrata.gguf import GGUFFile
from polystrata.gguf_writer import write_gguf
from polystrata.synth import synth_model

DATA = Path(__file__).parent / "data"
FUZZ = json.loads((DATA / "fuzz" / "gguf_mutations.json").read_text())
HOSTILE_TEMPLATES = sorted((DATA / "hostile_templates").glob("*.jinja"))
CALL_LIMIT_S = 20  # per in-process command; the slowest legitimate one here takes well under a second


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> dict:
    """A tiny llama GGUF and what it takes to write variants of it."""
    path = synth_model("llama", tmp_path_factory.mktemp("base") / "tiny.gguf", preset="tiny", qtype="Q8_0", seed=0)
    with GGUFFile(path) as f:
        tensors = [(t.name, t.shape, t.fmt, np.array(f.raw(t.name))) for t in f.tensors.values()]
        return {"path": path, "metadata": dict(f.metadata), "types": dict(f.metadata_types),
                "tensors": tensors, "data_offset": f.data_offset}


def variant(base: dict, path: Path, changes: dict) -> Path:
    """The base model with metadata `changes` (a value of None drops the key), types inferred for new values."""
    md, types = dict(base["metadata"]), dict(base["types"])
    for key, value in changes.items():
        md.pop(key, None)
        types.pop(key, None)
        if value is not None:
            md[key] = value
    write_gguf(path, md, base["tensors"], types=types)
    return path


class _Timeout(Exception):
    pass


def _on_alarm(signum, frame):
    raise _Timeout


def run_cli(*argv: str) -> tuple[int, str, str]:
    """`polystrata argv` in this process: exit code, stdout, stderr; any exception escaping main fails the test."""
    out, err = io.StringIO(), io.StringIO()
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, CALL_LIMIT_S)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(list(argv))
            except SystemExit as e:  # argparse's usage errors
                rc = e.code
    except _Timeout:
        raise AssertionError(f"polystrata {' '.join(argv)} ran longer than {CALL_LIMIT_S} s") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    return rc, out.getvalue(), err.getvalue()


def outcome_problem(rc: int, err: str) -> str | None:
    """What is wrong with an outcome, or None: exit 0, or exit 1 (2: usage) ending in one line `error: ...`."""
    if "Traceback" in err:
        return "traceback"
    if rc == 0:
        return None
    if rc not in (1, 2):
        return f"exit code {rc}"
    lines = err.strip().splitlines()
    if not lines or not lines[-1].startswith("error: ") or sum(ln.startswith("error:") for ln in lines) != 1:
        return f"exit {rc} without one line 'error: ...': {err[-300:]!r}"
    return None


def assert_clean(rc: int, err: str, code: int | None = None, match: str | None = None) -> None:
    problem = outcome_problem(rc, err)
    assert problem is None, problem
    if code is not None:
        assert rc == code, err
    if match is not None:
        assert match in err.strip().splitlines()[-1], err


# --- item 5: metadata of the wrong type or value, refused when the model is opened -------------------------


TOKENS = "tokenizer.ggml.tokens"
BAD_METADATA = {
    "block_count_inf": ({"llama.block_count": float("inf")}, "'llama.block_count' has value inf"),
    "block_count_strings": ({"llama.block_count": ["a", "b"]}, "'llama.block_count' has value ['a', 'b']"),
    "block_count_zero": ({"llama.block_count": 0}, "'llama.block_count' is 0, expected at least 1"),
    "context_length_zero": ({"llama.context_length": 0}, "'llama.context_length' is 0"),
    "rope_dims_past_head": ({"llama.rope.dimension_count": 64}, "'llama.rope.dimension_count' is 64"),
    "rms_eps_nan": ({"llama.attention.layer_norm_rms_epsilon": float("nan")}, "layer_norm_rms_epsilon"),
    "bos_token_id_text": ({"tokenizer.ggml.bos_token_id": "xyz"}, "'tokenizer.ggml.bos_token_id' has value 'xyz'"),
    "token_types_floats": ({"tokenizer.ggml.token_type": np.full(1024, 1.5, np.float32)}, "not an array of integers"),
    "tokens_numbers": ({TOKENS: list(range(1024))}, "'tokenizer.ggml.tokens' is not an array of strings"),
    "merges_numbers": ({"tokenizer.ggml.merges": [1, 2]}, "'tokenizer.ggml.merges' is not an array of strings"),
    "tokenizer_model_array": ({"tokenizer.ggml.model": [1, 2]}, "'tokenizer.ggml.model' has value"),
    "vocabulary_short": ({TOKENS: "first 1000", "tokenizer.ggml.token_type": None}, "the vocabulary has 1000 tokens"),
}


@pytest.mark.parametrize("case", sorted(BAD_METADATA))
def test_bad_metadata_is_one_line_error(case, base, tmp_path):
    changes, message = BAD_METADATA[case]
    if changes.get(TOKENS) == "first 1000":
        changes = {**changes, TOKENS: base["metadata"][TOKENS][:1000]}
    path = variant(base, tmp_path / "m.gguf", changes)
    rc, _, err = run_cli("score", str(path), "--target", "reference", "--text", "hi", "-o", str(tmp_path / "s.npz"))
    assert_clean(rc, err, code=1, match=message)
    assert not (tmp_path / "s.npz").exists()


def test_text_that_is_not_utf8_in_vocabulary_template_and_prompt(base, tmp_path):
    """Bytes that are not UTF-8 (kept as surrogates) tokenize and decode as those bytes, mid-output too."""
    from polystrata.tokenizer import Tokenizer

    tokens = list(base["metadata"][TOKENS])
    tokens[300] = "\udcff" + tokens[300]
    template = "{{ '\udcfe' }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    path = variant(base, tmp_path / "m.gguf", {TOKENS: tokens, "tokenizer.chat_template": template})
    with GGUFFile(path) as f:
        tok = Tokenizer.from_metadata(f.metadata)
    assert tok.token_bytes(300).startswith(b"\xff")
    assert tok.decode([300]).startswith("\ufffd")
    rc, out, err = run_cli("tokenize", str(path), "--text", "a\udcffb")
    assert_clean(rc, err, code=0)
    assert tok.decode(json.loads(out)) == "a\ufffdb"
    rc, _, err = run_cli("run", str(path), "--target", "reference", "-n", "4", "--seed", "1", "-p", "hi\udcfd")
    assert_clean(rc, err, code=0)


@pytest.mark.parametrize(
    ("args", "ids", "code", "message"),
    [
        (("--seed", "-2"), None, 2, "argument -s/--seed"),
        (("--ctx", "0"), None, 2, "argument -c/--ctx-size/--ctx: expected a positive integer"),
        (("--ctx", "-3"), None, 2, "argument -c/--ctx-size/--ctx: expected a positive integer"),
        ((), [1, 10**20], 1, "token id 100000000000000000000 is out of range"),
        ((), "[" * 100_000 + "]" * 100_000, 1, "expected a non-empty JSON array"),
    ],
    ids=["seed_negative", "ctx_zero", "ctx_negative", "id_past_int64", "ids_nested_deep"],
)
def test_bad_arguments_are_one_line_errors(args, ids, code, message, base, tmp_path):
    model = str(base["path"])
    if ids is None:
        rc, _, err = run_cli("run", model, "--target", "reference", "-n", "1", *args)
    else:
        ids_file = tmp_path / "ids.json"
        ids_file.write_text(ids if isinstance(ids, str) else json.dumps(ids))
        rc, _, err = run_cli("score", model, "--target", "reference", "--ids-file", str(ids_file),
                             "-o", str(tmp_path / "s.npz"))
    assert_clean(rc, err, code=code, match=message)


def test_seed_minus_one_means_random(base):
    """llama.cpp's habit: --seed -1 asks for a fresh random seed."""
    rc, _, err = run_cli("run", str(base["path"]), "--target", "reference", "-n", "1", "--seed", "-1", "-p", "hi")
    assert_clean(rc, err, code=0)


# --- the fuzz test: mutated headers and metadata values through info, tokenize and score ----------------------


def _byte_mutant(rng: random.Random, data: bytes, data_offset: int) -> tuple[bytes, str]:
    regions = FUZZ["byte_regions"]
    region = rng.choice(sorted(regions))
    size = regions[region]
    lo, hi = {"start": (0, min(size, data_offset)), "tensor_infos": (max(data_offset - size, 0), data_offset),
              "anywhere": (0, data_offset)}[region]
    at = rng.randrange(lo, hi)
    op = rng.choice(FUZZ["byte_operations"])
    buf = bytearray(data)
    if op == "truncate":
        return bytes(buf[:at]), f"truncated at {at}"
    if op == "small_int":
        value = rng.choice([0, 1, 2, 255, 2**31, 2**32 - 1, 2**63, 2**64 - 1])
        buf[at : at + 8] = value.to_bytes(8, "little")[: len(buf) - at]
        return bytes(buf), f"u64 {value} at {at}"
    buf[at] = {"random": rng.randrange(256), "flip_bit": buf[at] ^ (1 << rng.randrange(8)), "zero": 0,
               "ff": 0xFF}[op]
    return bytes(buf), f"{op} byte at {at} ({region})"


def _fuzz_cases(base: dict, tmp: Path):
    """(description, path) of each mutated file, written one at a time."""
    rng = random.Random(FUZZ["seed"])
    data = base["path"].read_bytes()
    keys = sorted(base["metadata"])
    for i in range(FUZZ["byte_mutations"]):
        mutated, what = _byte_mutant(rng, data, base["data_offset"])
        path = tmp / f"b{i}.gguf"
        path.write_bytes(mutated)
        yield f"bytes #{i}: {what}", path
    for i in range(FUZZ["value_mutations"]):
        key, value = rng.choice(keys), rng.choice(FUZZ["values"])
        try:
            path = variant(base, tmp / f"v{i}.gguf", {key: value})
        except GGUFError:  # a value the writer cannot encode (an empty array has no element type)
            continue
        yield f"value #{i}: {key} = {value!r}", path


def test_fuzzed_models_give_clean_outcomes(base, tmp_path):
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    problems, outcomes = [], {0: 0, 1: 0}
    for what, path in _fuzz_cases(base, tmp_path):
        for command in FUZZ["commands"]:
            argv = [a.format(model=path, out=tmp_path / "out.npz") for a in command]
            try:
                rc, _, err = run_cli(*argv)
            except Exception as e:  # noqa: BLE001 - any escape from main is what this test looks for
                problems.append(f"{what}: {command[0]} raised {type(e).__name__}: {e}")
                continue
            problem = outcome_problem(rc, err)
            if problem:
                problems.append(f"{what}: {command[0]}: {problem}")
            outcomes[rc] = outcomes.get(rc, 0) + 1
        path.unlink()
    assert not problems, f"{len(problems)} bad outcomes, e.g.:\n" + "\n".join(problems[:15])
    # The mutations reach both sides: files that still work and files refused with a clear error.
    assert outcomes[0] > 50 and outcomes[1] > 100, outcomes
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0 < 1024 * 1024  # KiB: under 1 GiB more


def test_fuzzed_models_through_the_command(base, tmp_path):
    """A few mutants through the real command: the same clean outcomes at the process level."""
    cases = [case for i, case in enumerate(_fuzz_cases(base, tmp_path)) if i % 60 == 0][:5]
    for what, path in cases:
        for command in ("info", "tokenize"):
            extra = ["--text", "hi"] if command == "tokenize" else []
            r = subprocess.run([sys.executable, "-m", "polystrata", command, str(path), *extra],
                               capture_output=True, text=True, timeout=120)
            assert outcome_problem(r.returncode, r.stderr) is None, (what, command, r.stderr)


# --- item 4: hostile chat templates through `run` ----------------------------------------------------------------


@pytest.fixture(scope="module")
def template_models(base, tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("templates")
    return {p.stem: variant(base, tmp / f"{p.stem}.gguf", {"tokenizer.chat_template": p.read_text()})
            for p in HOSTILE_TEMPLATES}


@pytest.mark.parametrize("name", [p.stem for p in HOSTILE_TEMPLATES])
def test_hostile_template_through_run(name, template_models, monkeypatch):
    """Templates that would loop for hours or build gigabytes stop with one line, soon and small."""
    monkeypatch.setattr(chat, "MAX_STEPS", 50_000)  # a tenth of the default: the same bound, sooner
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    rc, out, err = run_cli("run", str(template_models[name]), "--target", "reference", "-n", "2", "-p", "hi")
    assert_clean(rc, err, code=1, match="error: chat template")
    assert out == ""
    assert time.monotonic() - t0 < chat.TIME_LIMIT_S + 2
    # ru_maxrss is in KiB on Linux: the peak grew by less than the memory bound and a margin.
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0 < (chat.MAX_MEMORY >> 10) + 256 * 1024


def test_hanging_template_through_the_command(template_models):
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "polystrata", "run", str(template_models["nested_range_loops"]), "--target",
         "reference", "-n", "2", "-p", "hi"], capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 1 and r.stderr.startswith("error: chat template stopped:"), r.stderr
    assert r.stderr.count("\n") == 1
    assert time.monotonic() - t0 < chat.TIME_LIMIT_S + 15  # the limit plus start-up on a busy machine


# --- item 8: Ctrl-C ---------------------------------------------------------------------------------------------


def _interrupt(argv: list[str], home: Path, ready, env: dict | None = None,
               group: bool = False) -> tuple[subprocess.CompletedProcess, float]:
    """Start `polystrata argv`, send SIGINT once `ready(pid)` holds (`group`: to its whole process group, as a
    terminal does), and time how long the command takes to end (and every process holding its output)."""
    env = {**os.environ, "POLYSTRATA_HOME": str(home), **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "polystrata", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=group)
    deadline = time.monotonic() + 120
    while not ready(proc.pid) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proc.poll() is None, "the command ended before it could be interrupted"
    t0 = time.monotonic()
    if group:
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), time.monotonic() - t0


def _main_started(pid: int) -> bool:
    # main() starts the Ctrl-C watchdog thread before anything heavy: before that, Python itself is starting,
    # where a Ctrl-C is Python's to report.
    return len(os.listdir(f"/proc/{pid}/task")) >= 2


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux's /proc")
def test_ctrl_c_at_start_up(base, tmp_path):
    r, took = _interrupt(["compile", str(base["path"]), "--target", "cpu", "-o", str(tmp_path / "a")], tmp_path,
                         _main_started)
    assert (r.returncode, r.stderr) == (130, "error: interrupted\n")
    assert took < 2
    assert not (tmp_path / "a").exists()


def _seeded_cache(base, tmp_path, missing: int) -> tuple[Path, Path, int]:
    """(a home, its cpu kernel cache, the entries there): the tiny model's kernels (compiled once a run), all but
    `missing` of them, in a fresh cache."""
    from polystrata.artifact import KERNELS, write_artifact

    home = tmp_path / "home"
    write_artifact(base["path"], "cpu", tmp_path / "seed")
    (home / "kernels").mkdir(parents=True)
    cached = (tmp_path / "seed" / KERNELS).rename(home / "kernels" / "cpu")
    for source in sorted(cached.glob("k_*.py"))[:missing]:
        for f in [*cached.glob(f"{source.stem}.*"), *cached.glob(f"__pycache__/{source.stem}.*")]:
            f.unlink()
    return home, cached, len(list(cached.glob("__pycache__/*.nbi")))


@pytest.mark.slow  # compiles a few of the tiny model's kernels (the rest come from the run's cache)
def test_ctrl_c_during_compile_leaves_the_cache_valid(base, tmp_path):
    home, cached, seeded = _seeded_cache(base, tmp_path, 3)  # the command compiles 3

    def most_kernels_compiled(pid: int) -> bool:
        # Interrupt while the second of the three is compiling, so the rerun is short.
        return len(list(cached.glob("__pycache__/*.nbi"))) > seeded

    r, took = _interrupt(["compile", str(base["path"]), "--target", "cpu", "-o", str(tmp_path / "a")], home,
                         most_kernels_compiled)
    *shown, last = r.stderr.splitlines()
    assert (r.returncode, last) == (130, "error: interrupted")
    assert all(line.startswith("compiling kernels ") for line in shown)  # progress, before the interruption
    assert took < 2
    assert not (tmp_path / "a").exists()
    env = {**os.environ, "POLYSTRATA_HOME": str(home)}
    again = subprocess.run([sys.executable, "-m", "polystrata", "compile", str(base["path"]), "--target", "cpu",
                            "-o", str(tmp_path / "a")], capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0, again.stderr
    assert "from the binary cache" in again.stderr and "warning" not in again.stderr


@pytest.mark.slow  # starts two compile workers, which compile a few of the tiny model's kernels
@pytest.mark.skipif(not hasattr(os, "killpg"), reason="process groups")
def test_ctrl_c_at_a_terminal_ends_the_compile_workers_too(base, tmp_path):
    """A terminal's Ctrl-C reaches the whole process group: the compile workers leave it to the command, which
    ends them and itself at once (an orphaned worker used to wait forever, holding the terminal's output)."""
    home, cached, seeded = _seeded_cache(base, tmp_path, 6)
    r, took = _interrupt(["compile", str(base["path"]), "--target", "cpu", "-o", str(tmp_path / "a")], home,
                         lambda pid: len(list(cached.glob("__pycache__/*.nbi"))) > seeded,
                         env={"POLYSTRATA_COMPILE_JOBS": "2"}, group=True)
    *shown, last = r.stderr.splitlines()
    assert (r.returncode, last) == (130, "error: interrupted")
    assert all(line.startswith("compiling kernels ") for line in shown), r.stderr  # no worker's traceback
    assert took < 5  # communicate() returned: no process holds the output any more


def test_a_ctrl_c_python_cannot_raise_is_left_to_the_watchdog(capsys, monkeypatch):
    """A KeyboardInterrupt that lands in a callback (the import system's weakref ones, Numba's from C) is dropped
    by Python with an "Exception ignored" traceback; while armed it is not printed (the watchdog reports the one
    `error: interrupted` line), and any other unraisable exception still is."""
    import gc

    from polystrata import interrupt

    class Raises:  # raises from __del__, where Python cannot raise: an unraisable exception
        def __init__(self, exc):
            self.exc = exc

        def __del__(self):
            raise self.exc

    monkeypatch.setattr(sys, "unraisablehook", interrupt._unraisable)
    Raises(KeyboardInterrupt())
    gc.collect()
    assert capsys.readouterr().err == ""
    Raises(ValueError("kept"))
    gc.collect()
    assert "ValueError: kept" in capsys.readouterr().err


def test_a_ctrl_c_inside_a_compiler_waits_for_it_to_return(monkeypatch):
    """Inside `held_back` (around every compile and cache load) a Ctrl-C does not raise, where it could land
    between two of llvmlite's calls into LLVM and free an object twice; it raises once the body returns, and
    the handler Python had is back."""
    from polystrata import interrupt

    monkeypatch.setattr(interrupt, "_armed", True)
    monkeypatch.setattr(interrupt, "_received", False)
    # Python's own handler to start from, whatever an earlier test in this worker process left (once SIG_IGN).
    original = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        steps = []
        with pytest.raises(KeyboardInterrupt):
            with interrupt.held_back():
                os.kill(os.getpid(), signal.SIGINT)
                for _ in range(1000):  # Python runs signal handlers between bytecodes: give it many
                    steps.append(1)
                steps.append("finished")
        assert steps[-1] == "finished"
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        with interrupt.held_back():  # no key, no interrupt
            steps.append("again")
        assert steps[-1] == "again"
        with pytest.raises(KeyboardInterrupt):  # what the body raises after the key (a compiler child it killed)
            with interrupt.held_back():
                os.kill(os.getpid(), signal.SIGINT)
                with interrupt.held_back():  # nested: the outer one holds the key
                    raise RuntimeError("build failed: the compiler died of SIGINT")
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, original)


def test_an_error_after_a_ctrl_c_is_the_interrupt(monkeypatch, capsys):
    """A library may turn the KeyboardInterrupt into an error of its own (numpy's import of its C extension: an
    ImportError, 1 start-up in ~50): after a Ctrl-C, `main` reports any error as the interrupt."""
    from polystrata import interrupt, progress
    from polystrata.cli import main

    monkeypatch.setattr(interrupt, "_reported", False)
    monkeypatch.setattr(progress, "enabled", progress.enabled)  # main() sets it
    assert main(["info", "/nonexistent.gguf"]) == 1  # no key: the command's own error
    assert "no such file" in capsys.readouterr().err
    monkeypatch.setattr(interrupt, "_armed", True)
    monkeypatch.setattr(interrupt, "_received", True)
    assert main(["info", "/nonexistent.gguf"]) == 130
    assert capsys.readouterr().err == "error: interrupted\n"


def test_a_ctrl_c_caught_inside_eval_still_exits_130(monkeypatch):
    """CPython 3.11 marks a KeyboardInterrupt that leaves an eval() of a string (namedtuple() runs one while
    modules import) as unhandled even when it is caught, and at exit turns status 130 into death by SIGINT (-2,
    about one Ctrl-C at start-up in twenty); `report` clears the mark."""
    import ctypes

    from polystrata import interrupt

    try:
        mark = ctypes.c_int.in_dll(ctypes.pythonapi, "_Py_UnhandledKeyboardInterrupt")
    except ValueError:
        pytest.skip("this Python keeps the mark elsewhere")
    monkeypatch.setattr(interrupt, "_reported", True)  # the line was printed: this checks only the mark
    try:
        eval("exec('raise KeyboardInterrupt')")
    except KeyboardInterrupt:
        assert mark.value == 1
        assert interrupt.report() == 130
    assert mark.value == 0

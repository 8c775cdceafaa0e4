"""`chat` (and `run -i`), run's prompt sources and stop strings, and the engine's reuse of the cached prefix.

Everything runs a tiny random-weight model on the reference target: no kernel is compiled.
"""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from suite_plugin import targets_under_test

from polystrata.chat import StopStrings, encode_chat
from polystrata.cli import main
from polystrata.engine import Engine, GenerationStats
from polystrata.sampling import Sampler, SamplerConfig
from polystrata.synth import synth_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return synth_model("llama", tmp_path_factory.mktemp("m") / "tiny.gguf", preset="tiny", qtype="Q8_0", seed=0)


def polystrata(capsys, monkeypatch, *argv: str, stdin: str = "") -> tuple[int, str, str]:
    """`polystrata argv` in this process with `stdin` as standard input: exit code, stdout, stderr."""
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    try:
        rc = main(list(argv))
    except SystemExit as e:  # argparse's usage errors
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def chat(capsys, monkeypatch, tiny, stdin: str, *args: str) -> tuple[int, str, str]:
    # A newline ends every reply (--stop): stdout has exactly one line per turn.
    return polystrata(capsys, monkeypatch, "chat", str(tiny), "--target", "reference", "-s", "7", "-n", "6",
                      "--stop", "\n", *args, stdin=stdin)


# --- the engine: a turn prefills only what follows the cached prefix ---------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # gemma3: sliding-window layers too
def test_generate_prefills_only_what_follows_the_cached_prefix(arch, tiny, tmp_path):
    model = tiny if arch == "llama" else synth_model(arch, tmp_path / "m.gguf", preset="tiny", qtype="Q8_0", seed=1)
    eng = Engine(model, target="reference", n_ctx=128)
    greedy = Sampler(SamplerConfig(temperature=0))
    first = eng.tokenizer.encode("the first turn of a conversation")
    s1 = GenerationStats()
    reply = list(eng.generate(first, 5, greedy, s1, stop=lambda t: False, reuse_cache=True))
    assert (s1.n_prompt, s1.n_cached, s1.n_generated, s1.finish) == (len(first), 0, 5, "length")
    # The cache holds the prompt and the reply but its last token (never fed: the reply ended there).
    assert eng.cache_ids == first + reply[:-1] and eng.n_past == len(eng.cache_ids)
    second = first + reply + eng.tokenizer.encode(" and the second one", add_special=False)
    s2 = GenerationStats()
    again = list(eng.generate(second, 4, greedy, s2, stop=lambda t: False, reuse_cache=True))
    assert s2.n_cached == len(first) + len(reply) - 1 and s2.n_prompt == len(second) - s2.n_cached
    assert "(+" in s2.summary()
    fresh = list(eng.generate(second, 4, greedy, GenerationStats(), stop=lambda t: False))
    assert again == fresh, "a turn on the cached prefix must continue as a fresh prefill of the whole prompt does"
    # A prompt that diverges early keeps only the shared part.
    s3 = GenerationStats()
    list(eng.generate(first[:2] + [5, 6, 7], 1, greedy, s3, reuse_cache=True))
    assert (s3.n_cached, s3.n_prompt) == (2, 3)


@pytest.mark.parametrize("target", targets_under_test())
def test_kernel_targets_continue_a_rewound_cache(target, tmp_path):
    """A turn's prefill after rewinding past tokens of another continuation (what the cache reuse does), then decode
    steps: the logits match a fresh prefill of the same tokens. The shapes of test_targets' tiny llama (its kernels
    come from the run's cache). On the H200: `pytest tests/test_chat_cli.py --target cuda -k kernel_targets`."""
    path = synth_model("llama", tmp_path / "m.gguf", preset="tiny", qtype="Q8_0", seed=7)
    rng = np.random.default_rng(0)
    shared, other, turn = (rng.integers(3, 1000, size=n).tolist() for n in (20, 5, 6))
    eng = Engine(path, target=target, n_ctx=64)
    eng.forward(shared + other)
    eng.rewind(len(shared))
    reused = [eng.forward(turn)] + [eng.forward([t]) for t in (11, 12)]
    eng.reset()
    fresh = [eng.forward(shared + turn)] + [eng.forward([t]) for t in (11, 12)]
    for have, want in zip(reused, fresh):
        assert np.linalg.norm(have - want) / np.linalg.norm(want) < 1e-2


def test_generate_stops_at_a_full_context(tiny):
    eng = Engine(tiny, target="reference", n_ctx=12)
    stats = GenerationStats()
    out = list(eng.generate([1, 2, 3, 4], -1, Sampler(SamplerConfig(temperature=0)), stats, stop=lambda t: False))
    assert stats.finish == "context" and len(out) == 12 - 4 + 1 and eng.n_past == 12


# --- stop strings ------------------------------------------------------------------------------------------------


def test_stop_strings_hold_back_what_may_start_one():
    cut = StopStrings(["</s>", "STOP"])
    assert cut.feed("Hello <") == "Hello " and not cut.hit  # "<" may start "</s>": held
    assert cut.feed("/x") == "</x" and not cut.hit
    assert cut.feed(" ST") == " " and cut.feed("OP and more") == "" and cut.hit
    tail = StopStrings(["STOP"])
    assert tail.feed("all ST") == "all " and tail.flush() == "ST", "at the end, held text is no stop string"
    assert StopStrings([]).feed("x") == "x"


# --- chat ----------------------------------------------------------------------------------------------------------


def test_chat_answers_each_message_and_reuses_the_cache(capsys, monkeypatch, tiny):
    rc, out, err = chat(capsys, monkeypatch, tiny, "hello there\nhow are you\n/stats\n/bogus\n/reset\nagain\n")
    assert rc == 0, err
    assert out.count("\n") == 3, "one reply line per message; commands print nothing on stdout"
    stats = [line for line in err.splitlines() if line.startswith("chat: ")]
    # /stats after two turns: the second turn reused at least the first turn's prompt from the cache.
    first_prompt = len(encode_chat(Engine(tiny, target="reference").tokenizer, _template(tiny),
                                   [{"role": "user", "content": "hello there"}]))
    assert stats[0].startswith("chat: 2 turns") and _reused(stats[0]) >= first_prompt
    assert "unknown command /bogus" in err and "the conversation starts over" in err
    assert stats[-1].startswith("chat: 3 turns"), "the session's line at the end"


def _template(path: Path) -> str:
    from polystrata.gguf import GGUFFile

    with GGUFFile(path) as f:
        return f.metadata["tokenizer.chat_template"]


def _reused(line: str) -> int:
    return int(line.split(" tokens prefilled, ")[1].split()[0])


def test_chat_exit_command_ends_it(capsys, monkeypatch, tiny):
    rc, out, _ = chat(capsys, monkeypatch, tiny, "one\n/exit\ntwo\n")
    assert rc == 0 and out.count("\n") == 1


def test_chat_drops_the_oldest_turns_when_the_context_is_full(capsys, monkeypatch, tiny):
    messages = "".join(f"message number {i} with a few words\n" for i in range(6))
    rc, out, err = chat(capsys, monkeypatch, tiny, messages + "/stats\n" + "word " * 80 + "\nlast\n", "-c", "96")
    assert rc == 0, err
    assert "the context is full: dropped the oldest" in err
    assert "error: the message does not fit" in err, "a message longer than the context is refused, not fatal"
    assert out.count("\n") == 7, "every other message is answered"
    context = next(line for line in err.splitlines() if line.startswith("context: "))
    assert int(context.split()[1]) <= 96


def test_chat_system_prompt_and_first_message(capsys, monkeypatch, tiny):
    rc, out, err = chat(capsys, monkeypatch, tiny, "/stats\n", "-sys", "You are terse.", "-p", "hi")
    assert rc == 0 and out.count("\n") == 1
    tok = Engine(tiny, target="reference").tokenizer
    with_system = encode_chat(tok, _template(tiny), [{"role": "system", "content": "You are terse."},
                                                     {"role": "user", "content": "hi"}])
    assert f"prompt: {len(with_system)} tokens," in err


def test_run_i_is_chat(capsys, monkeypatch, tiny):
    args = (str(tiny), "--target", "reference", "-s", "3", "-n", "5", "--stop", "\n")
    assert polystrata(capsys, monkeypatch, "run", "-cnv", *args, stdin="hi\nyes\n")[1] == \
        polystrata(capsys, monkeypatch, "chat", *args, stdin="hi\nyes\n")[1]


def test_chat_through_a_pipe(tiny):
    """As a user pipes it: a subprocess whose stdin ends (Ctrl-D)."""
    p = subprocess.run([sys.executable, "-m", "polystrata", "chat", str(tiny), "--target", "reference", "-n", "4",
                        "--stop", "\n"], input="hello\n", capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.count("\n") == 1 and "chat: 1 turn;" in p.stderr


# --- run: the prompt from -p, -f or stdin ------------------------------------------------------------------------


def test_run_reads_the_prompt_from_a_file_or_stdin(capsys, monkeypatch, tiny, tmp_path):
    args = (str(tiny), "--target", "reference", "-s", "5", "-n", "6", "--raw")
    rc, by_flag, err = polystrata(capsys, monkeypatch, "run", *args, "-p", "once upon a time")
    assert rc == 0 and "prompt: " in err
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("once upon a time\n")
    assert polystrata(capsys, monkeypatch, "run", *args, "-f", str(prompt))[1] == by_flag
    assert polystrata(capsys, monkeypatch, "run", *args, stdin="once upon a time\n")[1] == by_flag
    assert polystrata(capsys, monkeypatch, "run", *args, stdin="another beginning\n")[1] != by_flag


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_run_without_a_prompt_on_a_terminal_is_a_usage_error(capsys, monkeypatch, tiny, tmp_path):
    monkeypatch.setattr(sys, "stdin", _Terminal())
    assert main(["run", str(tiny), "--target", "reference"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: no prompt: give -p PROMPT or -f FILE, or pipe it on stdin (`polystrata chat` to talk)"]
    rc, _, err = polystrata(capsys, monkeypatch, "run", str(tiny), "-f", str(tmp_path / "missing.txt"))
    assert rc == 1 and err.startswith("error: cannot read the prompt from") and len(err.splitlines()) == 1
    rc, _, err = polystrata(capsys, monkeypatch, "run", str(tiny), stdin="\n")
    assert rc == 1 and err == "error: the prompt read from stdin is empty\n"
    rc, _, err = polystrata(capsys, monkeypatch, "run", str(tiny), "-p", "x", "-f", "y")
    assert rc == 2 and "not allowed with argument" in err
    rc, _, err = polystrata(capsys, monkeypatch, "run", str(tiny), "--raw", "-sys", "x", "-p", "y")
    assert rc == 2 and err.startswith("error: --raw feeds the prompt without the chat template")
    rc, _, err = polystrata(capsys, monkeypatch, "run", str(tiny), "--raw", "-i")
    assert rc == 2 and err.startswith("error: a conversation goes through the chat template")


def test_run_stop_string_ends_the_text(capsys, monkeypatch, tiny):
    args = ("run", str(tiny), "--target", "reference", "-s", "11", "-n", "24", "--raw", "-p", "a")
    full = polystrata(capsys, monkeypatch, *args)[1].rstrip("\n")
    stop = full[len(full) // 2: len(full) // 2 + 2]
    assert len(stop) == 2
    rc, cut, _ = polystrata(capsys, monkeypatch, *args, "--stop", stop)
    assert rc == 0 and cut.rstrip("\n") == full[: full.index(stop)]

"""The `run` and `chat` commands: one answer, or a conversation in a read-eval-print loop.

`chat` (and `run -i` / `run -cnv`, llama-cli's spelling) renders the whole conversation through the model's chat
template at every turn and lets the engine keep the K, V of the prefix it shares with what the cache holds
(`Engine.generate(reuse_cache=True)`), so a turn prefills only its own tokens. When the conversation no longer fits
the context, its oldest turns are dropped (the system prompt stays), with a line on stderr. Replies stream to
stdout; notices, errors and speeds go to stderr.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TextIO

from polystrata.chat import StopStrings, chat_template_from_metadata, encode_chat
from polystrata.engine import Engine, GenerationStats
from polystrata.errors import PolystrataError, UsageError
from polystrata.sampling import Sampler, SamplerConfig

RUN_N_PREDICT = 128  # run's default -n; chat's is -1 (until the reply ends or the context is full)
COMMANDS_HELP = "/reset starts over, /stats shows token counts and speeds, /exit or Ctrl-D ends"


def stream_reply(
    engine: Engine, prompt_ids: list[int], n_predict: int, sampler: Sampler, stops: Sequence[str] = (),
    out: TextIO | None = None, reuse_cache: bool = False,
) -> tuple[str, GenerationStats]:
    """Generate after `prompt_ids`, writing the text to `out` (stdout) as it comes; returns the text and the stats
    (`finish` is "stop" where a stop string ended it)."""
    out = out if out is not None else sys.stdout
    stats = GenerationStats()
    decoder, cut, parts = engine.tokenizer.stream(), StopStrings(stops), []

    def emit(text: str) -> None:
        if text:
            out.write(text)
            out.flush()
            parts.append(text)

    tokens = engine.generate(prompt_ids, n_predict, sampler, stats, reuse_cache=reuse_cache)
    for t in tokens:
        emit(cut.feed(decoder.feed(t)))
        if cut.hit:
            tokens.close()
            break
    else:
        emit(cut.feed(decoder.flush()))
    if cut.hit:
        stats.finish = "stop"
    else:
        emit(cut.flush())
    return "".join(parts), stats


def open_engine(a, checked: Callable[[], None] | None = None, all_logits: bool = False) -> Engine:
    """The engine `run`/`chat`/`serve` (and `score` of an artifact: `all_logits`) ask for: a model (path or zoo
    name) or an artifact, with the target, KV type, context, step size and memory options, and `serve`'s parallel
    sequences. What the options and an artifact's manifest can refuse (-np against the step size and the context,
    -ub against the context, --knob) is refused before the model is looked for or loaded; then `checked` is called
    (serve takes its port there). An artifact's step size is the one it was compiled for, unless -ub asks for
    another; its plans are made again for that one, and likewise for another -np than the artifact's (`compile
    -np`), with a line on stderr (kernels the artifact lacks are compiled); `all_logits` makes scoring's plan too,
    which artifacts do not hold."""
    from polystrata.artifact import find_model, is_artifact, kernel_store, read_artifact
    from polystrata.bench import parse_knobs
    from polystrata.cli import _resolve, memory_kwargs
    from polystrata.compiler import DEFAULT_UBATCH
    from polystrata.engine import check_parallel, check_ubatch

    target, kv_type, n_ctx, n_ubatch, store = a.target, a.kv_type, a.ctx, a.n_ubatch, None
    n_seq = getattr(a, "parallel", 1)
    manifest = read_artifact(a.model) if a.model and is_artifact(a.model) else None
    if manifest is not None:
        target = manifest["target"]["name"]
        kv_type = manifest["memory"]["kv_type"] if target != "reference" else kv_type
        n_ctx = n_ctx or manifest["memory"]["n_ctx"]
        compiled_ub = manifest["memory"].get("n_ubatch")  # absent in artifacts from before -ub: the default then
        if n_ubatch is not None and compiled_ub is not None and n_ubatch != compiled_ub:
            print(f"{a.model} was compiled for steps of {compiled_ub} tokens; -ub {n_ubatch} plans its steps again "
                  "(kernels it lacks are compiled)", file=sys.stderr)
        if n_ubatch is None and compiled_ub != DEFAULT_UBATCH:  # the default may exceed a small context; a
            n_ubatch = compiled_ub  # step size asked for at compile time was checked against the artifact's
    check_parallel(n_seq, n_ubatch or DEFAULT_UBATCH, n_ctx)
    if n_ubatch is not None:
        check_ubatch(n_ubatch, n_ctx)
    knobs = parse_knobs(a.knob) if getattr(a, "knob", None) else (manifest or {}).get("knobs")
    if checked is not None:
        checked()
    if manifest is not None:
        compiled_np = manifest["memory"].get("n_parallel", 1)  # absent in artifacts from before -np: one
        if n_seq > 1 and n_seq != compiled_np and target != "reference":
            print(f"{a.model} was compiled for {compiled_np} parallel sequence{'s' * (compiled_np > 1)} "
                  f"(compile -np); -np {n_seq} plans the steps of {n_seq} sequences (kernels it lacks are compiled)",
                  file=sys.stderr)
        # The model it was compiled from, found by its sha256 (-m PATH, the manifest's path, the zoo cache); the
        # kernels the cache lacks come from the artifact.
        path = find_model(Path(a.model), manifest["model"]["path"], manifest["model"]["sha256"],
                          getattr(a, "model_file", None))
        store = kernel_store(a.model)
        if all_logits and target != "reference":
            print(f"{a.model} holds the plans of run, chat and serve; score plans every token's logits too "
                  "(kernels the artifact lacks are compiled)", file=sys.stderr)
        slots = manifest["memory"].get("expert_slots_per_layer")
        if a.expert_slots is None and manifest["memory"].get("experts_streamed") and isinstance(slots, int):
            a.expert_slots = slots  # the compiled plan's expert cache, unless --expert-slots says otherwise
    else:
        path = _resolve(a.model)
    return Engine(path, target=target, n_ctx=n_ctx, kv_type=kv_type, verbose=getattr(a, "verbose", False),
                  kernel_store=store, tuning=not a.no_tuning, knobs=knobs, n_ubatch=n_ubatch, logit_rows=n_seq,
                  all_logits=all_logits, **memory_kwargs(a))


def make_sampler(a) -> Sampler:
    """The sampler of the command-line options."""
    return Sampler(SamplerConfig(
        temperature=a.temp, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p, repeat_penalty=a.repeat_penalty,
        repeat_last_n=a.repeat_last_n, seed=a.seed))


def _strip_newline(text: str) -> str:
    # As llama.cpp does with -f: the newline that ends a file's last line is not part of the prompt.
    return text[:-1] if text.endswith("\n") else text


def read_prompt(a, stdin: bool) -> str | None:
    """The prompt of -p, else of -f FILE, else (`stdin`) all of standard input; None if there is none. A file or
    stdin that holds nothing is refused (most likely a mistake); -p "" is taken as given."""
    if a.prompt is not None:
        return a.prompt
    if a.file is not None:
        source = a.file
        try:
            text = Path(a.file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            reason = getattr(e, "strerror", None) or e
            raise PolystrataError(f"cannot read the prompt from {a.file}: {reason}") from None
    elif not stdin:
        return None
    elif sys.stdin is None or sys.stdin.isatty():
        raise UsageError("no prompt: give -p PROMPT or -f FILE, or pipe it on stdin (`polystrata chat` to talk)")
    else:
        source = "stdin"
        try:
            text = sys.stdin.read()
        except UnicodeDecodeError as e:
            raise PolystrataError(f"cannot read the prompt from stdin: {e}") from None
    if not text.strip():
        raise PolystrataError(f"the prompt read from {source} is empty")
    return _strip_newline(text)


def cmd_run(a) -> int:
    """`polystrata run`: generate after one prompt; the text to stdout, the speeds to stderr."""
    if a.interactive:
        if a.raw:
            raise UsageError("a conversation goes through the chat template: -i/-cnv and --raw do not go together")
        return cmd_chat(a)
    if a.raw and a.system_prompt is not None:
        raise UsageError("--raw feeds the prompt without the chat template, which is where -sys would go")
    prompt = read_prompt(a, stdin=True)
    n_predict = RUN_N_PREDICT if a.n_predict is None else a.n_predict
    eng = open_engine(a)
    template = chat_template_from_metadata(eng.metadata)
    if template and not a.raw:
        system = [{"role": "system", "content": a.system_prompt}] if a.system_prompt is not None else []
        ids = encode_chat(eng.tokenizer, template, [*system, {"role": "user", "content": prompt}])
    elif a.system_prompt is not None:
        raise PolystrataError(f"{eng.path.name} has no chat template to put the -sys system prompt in")
    else:
        ids = eng.tokenizer.encode(prompt)
    _, stats = stream_reply(eng, ids, n_predict, make_sampler(a), a.stop)
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(stats.summary(), file=sys.stderr)
    return 0


class MessageTooLong(PolystrataError):
    """A message that does not fit the context even with every earlier turn dropped."""


class Conversation:
    """A chat's system prompt and turns, rendered through the model's template within the context."""

    def __init__(self, engine: Engine, template: str, system: str | None, reply_room: int):
        """`reply_room`: tokens of context a prompt leaves free for the reply."""
        self.engine, self.template, self.system, self.reply_room = engine, template, system, reply_room
        self.turns: list[tuple[str, str]] = []  # (user message, reply)

    def messages(self, user: str) -> list[dict[str, str]]:
        """The template's messages: the system prompt, the turns so far and `user`'s new message."""
        msgs = [{"role": "system", "content": self.system}] if self.system is not None else []
        for said, reply in self.turns:
            msgs += [{"role": "user", "content": said}, {"role": "assistant", "content": reply}]
        return msgs + [{"role": "user", "content": user}]

    def prompt(self, user: str) -> tuple[list[int], int]:
        """Token ids of the conversation with `user`'s message and the reply opened, and how many of the oldest
        turns were dropped (for good) to leave `reply_room` tokens of the context free."""
        n_ctx, dropped = self.engine.n_ctx, 0
        while True:
            ids = encode_chat(self.engine.tokenizer, self.template, self.messages(user))
            if len(ids) + self.reply_room <= n_ctx:
                return ids, dropped
            if not self.turns:
                raise MessageTooLong(
                    f"the message does not fit: {len(ids)} tokens of prompt and {self.reply_room} kept for the reply "
                    f"are more than the context of {n_ctx} (-c)")
            self.turns.pop(0)
            dropped += 1


def _reply_room(n_predict: int, n_ctx: int) -> int:
    """Context a prompt leaves for the reply: -n tokens, at most half the context; a quarter with -n -1."""
    return min(n_predict, n_ctx // 2) if n_predict >= 0 else n_ctx // 4


def _read_line(interactive: bool, continued: bool) -> str | None:
    if interactive:
        try:
            return input("" if continued else "> ")
        except EOFError:
            print()  # Ctrl-D: the shell's prompt goes on a line of its own
            return None
    line = sys.stdin.readline()
    return line.rstrip("\r\n") if line else None


def _read_message(interactive: bool) -> str | None:
    """One message from stdin: a line, or lines joined where one ends in a backslash; None at the end."""
    lines: list[str] = []
    while (line := _read_line(interactive, bool(lines))) is not None:
        if not line.endswith("\\"):
            return "\n".join([*lines, line])
        lines.append(line[:-1])
    return "\n".join(lines) if lines else None


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _notice(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class _Session:
    """Token counts of a whole chat, for /stats and the line at its end."""

    def __init__(self):
        self.turns = self.prefilled = self.cached = self.generated = 0
        self.last: GenerationStats | None = None

    def add(self, s: GenerationStats) -> None:
        self.turns += 1
        self.prefilled += s.n_prompt
        self.cached += s.n_cached
        self.generated += s.n_generated
        self.last = s

    def summary(self) -> str:
        return (f"chat: {_count(self.turns, 'turn')}; prompts: {self.prefilled} tokens prefilled, {self.cached} reused "
                f"from the cache; replies: {self.generated} tokens")


def cmd_chat(a) -> int:
    """`polystrata chat`: a conversation read from stdin, replies streamed to stdout."""
    n_predict = -1 if a.n_predict is None else a.n_predict
    first = read_prompt(a, stdin=False)
    eng = open_engine(a)
    template = chat_template_from_metadata(eng.metadata)
    if not template:
        raise PolystrataError(f"{eng.path.name} has no chat template, which chat needs; `run --raw` completes text")
    conv = Conversation(eng, template, a.system_prompt, _reply_room(n_predict, eng.n_ctx))
    sampler, session = make_sampler(a), _Session()
    interactive = sys.stdin is not None and sys.stdin.isatty()
    if interactive:
        import readline  # noqa: F401 - input() gets line editing and history

        _notice(f"chat with {eng.path.name} on {eng.target}: {COMMANDS_HELP}")
    while True:
        if first is not None:
            message, first = first, None
        else:
            message = _read_message(interactive)
        if message is None:
            break
        command = message.strip()
        if not command:
            continue
        if command in ("/exit", "/quit", "/bye"):
            break
        if command == "/reset":
            conv.turns.clear()
            _notice("the conversation starts over")
            continue
        if command == "/stats":
            if session.last is not None:
                _notice(f"last turn: {session.last.summary()}")
            _notice(f"context: {eng.n_past} of {eng.n_ctx} tokens; {_count(len(conv.turns), 'turn')} kept")
            _notice(session.summary())
            continue
        if command.startswith("/") and " " not in command:
            _notice(f"unknown command {command}: {COMMANDS_HELP}")
            continue
        try:
            ids, dropped = conv.prompt(message)
        except MessageTooLong as e:
            print(f"error: {e}", file=sys.stderr)
            continue
        if dropped:
            _notice(f"the context is full: dropped the oldest {_count(dropped, 'turn')}")
        reply, stats = stream_reply(eng, ids, n_predict, sampler, a.stop, reuse_cache=True)
        sys.stdout.write("\n")
        sys.stdout.flush()
        conv.turns.append((message, reply))
        session.add(stats)
        if stats.finish == "context":
            _notice("the reply filled the context and was cut; the next turn drops the oldest turns")
    _notice(session.summary())
    return 0

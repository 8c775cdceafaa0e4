"""Chat templates: render a GGUF's `tokenizer.chat_template` (Jinja2) for a list of messages.

Templates come from model files downloaded from anywhere, so they are untrusted code: they run in
Jinja2's immutable sandbox, any attempt to reach an unsafe attribute (``__class__``, ``__globals__``...)
is an error rather than a silent empty string, and one rendering is bounded in steps, wall-clock time and
the size of every text, list and number it builds.
"""

from __future__ import annotations

import contextvars
import functools
import json
import os
import re
import sys
import time
import types
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.filters
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

from polystrata.errors import PolystrataError

__all__ = ["ChatTemplateError", "render_chat", "chat_template_from_metadata", "encode_chat"]

# Bounds on one rendering. Real chat templates take a few thousand interpreter steps and print a few KB;
# hostile ones loop for hours or double strings until memory runs out. Steps are Python trace events
# (calls and lines, the template's and the Jinja runtime's); the wall-clock limit catches slow steps.
MAX_STEPS = 500_000
TIME_LIMIT_S = 3.0
# Longest text (string, list, output) a template may build, in characters, on top of twice the input.
MAX_TEXT = 4_000_000
# Growth of the process's resident memory while rendering (sampled every 64 steps where /proc exists).
MAX_MEMORY = 512 * 2**20
_MAX_INT_BITS = 4096


class ChatTemplateError(PolystrataError):
    """A chat template failed to compile or render, or tried something the sandbox forbids."""


class _TemplateRaised(jinja2.TemplateError):
    """The template called raise_exception(message)."""


class _TemplateLimit(jinja2.TemplateError):
    """The template went past a bound on steps, time or the size of what it builds."""


def _raise_exception(message: Any = "") -> None:
    raise _TemplateRaised(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Budget:
    """Steps, time and text size left to one rendering; its `trace` is installed with sys.settrace."""

    def __init__(self, max_text: int, max_steps: int, time_limit_s: float):
        self.max_text = max_text
        self.steps = max_steps
        self.deadline = time.monotonic() + time_limit_s
        try:
            self._statm: int | None = os.open("/proc/self/statm", os.O_RDONLY)
        except OSError:
            self._statm = None
        self._rss0 = self._resident()

    def _resident(self) -> int:
        if self._statm is None:
            return 0
        return int(os.pread(self._statm, 128, 0).split()[1]) * _PAGE

    def close(self) -> None:
        if self._statm is not None:
            os.close(self._statm)
            self._statm = None

    def check_len(self, n: int, what: str = "a text") -> None:
        if n > self.max_text:
            raise _TemplateLimit(f"template tried to build {what} of length {n} (limit {self.max_text})")

    def trace(self, frame, event: str, arg: Any):
        self.steps -= 1
        if self.steps <= 0:
            raise _TemplateLimit("template takes too many steps (a loop or recursion that does not end?)")
        if not self.steps & 63:
            if time.monotonic() > self.deadline:
                raise _TemplateLimit("template takes too long to render")
            if self._resident() - self._rss0 > MAX_MEMORY:
                raise _TemplateLimit(f"template uses more than {MAX_MEMORY >> 20} MiB of memory")
        if event == "line" and frame.f_code.co_filename == "<template>":
            # Concatenation (`~`) and `{% set %}` reach no sandbox hook: look at what the template holds.
            for value in frame.f_locals.values():
                if isinstance(value, str | list | tuple):
                    self.check_len(len(value))
        return self.trace


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_budget: contextvars.ContextVar[_Budget] = contextvars.ContextVar("chat_template_budget")


def _check_len(n: int, what: str = "a text") -> None:
    _budget.get().check_len(n, what)


def _check_format(fmt: str, args: Any, nested: bool) -> None:
    """Refuse a format string whose widths or precisions would allocate more than the text limit."""
    limit = _budget.get().max_text
    if any(len(d) > len(str(limit)) or int(d) > limit for d in re.findall(r"\d+", fmt)):
        raise _TemplateLimit("template tried to format with a width or precision that is too large")
    if nested:
        # Widths can come from the arguments: '%*d' % (width, x), '{:>{w}}'.format(x, w=width).
        values = []
        for arg in args if isinstance(args, tuple | list) else (args,):
            values.extend(arg.values() if isinstance(arg, Mapping) else (arg,))
        if any(isinstance(v, int) and abs(v) > limit for v in values):
            raise _TemplateLimit("template tried to format with a width or precision that is too large")


def _tojson(value: Any, indent: int | None = None, separators=None, sort_keys: bool = False,
            ensure_ascii: bool = False) -> str:
    # Jinja's own tojson HTML-escapes <, >, & and ', which would corrupt prompts; templates expect plain JSON.
    if isinstance(indent, int):
        _check_len(indent, "an indent")
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii)


def _sized(text: Any) -> int:
    return len(text) if isinstance(text, str) else len(str(text))


def _check_str_method(name: str, text: str, args: tuple, kwargs: dict) -> tuple:
    """Estimate what a str method builds from its arguments before it runs (in C, out of the tracer's reach).

    Returns the arguments to call it with: an iterator given to join is read into a list to be measured.
    """
    if name in ("center", "ljust", "rjust", "zfill") and args and isinstance(args[0], int):
        _check_len(args[0])
    elif name == "expandtabs":
        size = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(size, int):
            _check_len(text.count("\t") * size + len(text))
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        _check_len(_replaced_len(text, args[0], args[1]))
    elif name == "join" and args:
        args = (_materialized(args[0]), *args[1:])
        _check_len(_joined_len(text, args[0]))
    return args


def _replaced_len(text: str, old: str, new: str) -> int:
    count = len(text) + 1 if not old else text.count(old)
    return len(text) + count * max(len(new) - len(old), 0)


def _materialized(items: Any) -> Any:
    return items if isinstance(items, list | tuple | str) else list(items)


def _joined_len(sep: Any, items: list | tuple | str) -> int:
    _check_len(len(items), "a list")
    return _sized(sep) * max(len(items) - 1, 0) + sum(_sized(i) for i in items)


class _Namespace(Namespace):
    """namespace() whose attributes cannot grow past the text limit (`{% set ns.s = ns.s ~ ns.s %}`)."""

    def __setitem__(self, name: str, value: Any) -> None:
        if isinstance(value, str | list | tuple):
            _check_len(len(value))
        super().__setitem__(name, value)


def _filter_center(value: Any, width: int = 80) -> str:
    _check_len(int(width))
    return jinja2.filters.do_center(value, width)


def _filter_indent(s: str, width: int | str = 4, first: bool = False, blank: bool = False) -> str:
    _check_len(width if isinstance(width, int) else len(str(width)), "an indent")
    text = str(s)
    _check_len(len(text) + (text.count("\n") + 1) * (width if isinstance(width, int) else len(str(width))))
    return jinja2.filters.do_indent(s, width, first, blank)


@jinja2.pass_eval_context
def _filter_replace(eval_ctx, s: Any, old: str, new: str, count: int | None = None) -> str:
    _check_len(_replaced_len(str(s), str(old), str(new)))
    return jinja2.filters.do_replace(eval_ctx, s, old, new, count)


@jinja2.pass_eval_context
def _filter_join(eval_ctx, value: Any, d: str = "", attribute=None) -> str:
    if attribute is None:
        value = _materialized(value)
        _check_len(_joined_len(d, value))
    return jinja2.filters.do_join(eval_ctx, value, d, attribute)


@jinja2.pass_environment
def _filter_wordwrap(environment, s: str, width: int = 79, break_long_words: bool = True, wrapstring=None,
                     break_on_hyphens: bool = True) -> str:
    sep = environment.newline_sequence if wrapstring is None else wrapstring
    _check_len(len(str(s)) + (len(str(s)) // max(int(width), 1) + 1) * len(str(sep)))
    return jinja2.filters.do_wordwrap(environment, s, width, break_long_words, wrapstring, break_on_hyphens)


def _filter_format(value: str, *args: Any, **kwargs: Any) -> str:
    _check_format(str(value), kwargs or args, "*" in str(value))
    return jinja2.filters.do_format(value, *args, **kwargs)


class _Sandbox(ImmutableSandboxedEnvironment):
    """Immutable sandbox that fails loudly on unsafe access and bounds what templates can build."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    @staticmethod
    def concat(parts) -> str:
        # Macro bodies, {% set %} blocks and the whole output are joined here.
        limit = _budget.get().max_text
        held, total = [], 0
        for part in parts:
            total += len(part)
            if total > limit:
                _check_len(total)
            held.append(part)
        return "".join(held)

    def unsafe_undefined(self, obj: Any, attribute: str):
        # The stock sandbox returns an Undefined, which renders as "" when printed; refusing outright makes
        # probing templates fail visibly.
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__} object is not allowed")

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if isinstance(seq, str | list | tuple | bytes) and isinstance(count, int):
                    _check_len(len(seq) * max(count, 0), "a sequence")
            if isinstance(left, int) and isinstance(right, int):
                if left.bit_length() + right.bit_length() > _MAX_INT_BITS:
                    raise SecurityError("template tried to compute a number that is too large")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int):
            if right > 0 and abs(left) > 1 and right * max(abs(left).bit_length(), 1) > _MAX_INT_BITS:
                raise SecurityError("template tried to compute a number that is too large")
        elif operator == "+" and isinstance(left, str | list | tuple) and isinstance(right, str | list | tuple):
            _check_len(len(left) + len(right), "a sequence")
        elif operator == "%" and isinstance(left, str):
            _check_format(left, right, "*" in left)
        return super().call_binop(context, operator, left, right)

    def wrap_str_format(self, value: Any):
        wrapper = super().wrap_str_format(value)
        if wrapper is None:
            return None
        text = value.__self__

        def checked(*args: Any, **kwargs: Any) -> str:
            _check_format(text, (*args, kwargs), nested=re.search(r"{[^{}]*{", text) is not None)
            return wrapper(*args, **kwargs)

        return checked

    def call(__self, __context, __obj, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - Jinja's signature
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str) and isinstance(__obj, types.BuiltinMethodType):
            args = _check_str_method(__obj.__name__, owner, args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)


@functools.lru_cache(maxsize=1)
def _environment() -> _Sandbox:
    # trim_blocks/lstrip_blocks match how Hugging Face renders chat templates, which authors write for.
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters.update(
        tojson=_tojson, center=_filter_center, indent=_filter_indent, replace=_filter_replace, join=_filter_join,
        wordwrap=_filter_wordwrap, format=_filter_format,
    )
    env.globals["namespace"] = _Namespace
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    return _environment().from_string(template)


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    if isinstance(e, jinja2.TemplateSyntaxError) and e.lineno:
        text = f"{text} (line {e.lineno})"
    return text


def render_chat(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    **extra: Any,
) -> str:
    """Render `messages` (dicts with 'role' and 'content') through a Jinja2 chat template, sandboxed.

    `bos_token`/`eos_token` are the texts templates may print (pass the tokenizer's, e.g. "<bos>"); `extra`
    becomes further template variables (tools, documents, ...). Any failure, including the template calling
    raise_exception() or touching something unsafe, raises ChatTemplateError with a one-line message.
    """
    if not isinstance(template, str) or not template.strip():
        raise ChatTemplateError("the model has no chat template")
    try:
        compiled = _compile(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not compile: {_one_line(e)}") from None
    context = dict(extra)
    context.update(
        messages=[dict(m) for m in messages],
        add_generation_prompt=add_generation_prompt,
        bos_token=bos_token,
        eos_token=eos_token,
    )
    # Inputs may be long (a document pasted into the prompt); what the template builds may be twice as long.
    budget = _Budget(MAX_TEXT + 2 * len(repr(context)), MAX_STEPS, TIME_LIMIT_S)
    token = _budget.set(budget)
    previous = sys.gettrace()
    sys.settrace(budget.trace)
    try:
        return compiled.render(**context)
    except _TemplateRaised as e:
        raise ChatTemplateError(f"chat template refused the conversation: {_one_line(e)}") from None
    except _TemplateLimit as e:
        raise ChatTemplateError(f"chat template stopped: {_one_line(e)}") from None
    except SecurityError as e:
        raise ChatTemplateError(f"chat template blocked by the sandbox: {_one_line(e)}") from None
    except MemoryError:
        raise ChatTemplateError("chat template stopped: it ran out of memory") from None
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError,
            ArithmeticError, RecursionError) as e:
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {_one_line(e)}") from None
    finally:
        sys.settrace(previous)
        _budget.reset(token)
        budget.close()


def chat_template_from_metadata(metadata: Mapping[str, Any], name: str | None = None) -> str | None:
    """The GGUF's default chat template (`tokenizer.chat_template`), or a named one; None if absent."""
    key = "tokenizer.chat_template" if name is None else f"tokenizer.chat_template.{name}"
    value = metadata.get(key)
    return value if isinstance(value, str) else None


def encode_chat(tokenizer, template: str, messages: Sequence[Mapping[str, Any]],
                add_generation_prompt: bool = True) -> list[int]:
    """Token ids of `messages` rendered through `template` with `tokenizer`'s BOS and EOS texts.

    The template places BOS where the model wants it (added in front only if the model adds one and the template
    did not), and special-token text in it (``<|im_start|>``) is meant literally.
    """
    tok = tokenizer
    text = render_chat(
        template, messages, add_generation_prompt=add_generation_prompt,
        bos_token=tok.id_to_token(tok.bos_id) if tok.bos_id is not None else "",
        eos_token=tok.id_to_token(tok.eos_id) if tok.eos_id is not None else "",
    )
    ids = tok.encode(text, add_special=False, parse_special=True)
    if tok.add_bos and tok.bos_id is not None and (not ids or ids[0] != tok.bos_id):
        ids = [tok.bos_id] + ids
    return ids


class StopStrings:
    """Cuts streamed text at the first of some stop strings.

    Text that could be the start of a stop string is held back until the next piece shows whether it is one, so
    nothing of a stop string is ever shown or sent.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.hit = False

    def feed(self, piece: str) -> str:
        """Add generated text; return what can be shown now (`hit` turns true at a stop string)."""
        text = self.held + piece
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if found:
            self.hit, self.held = True, ""
            return text[: min(found)]
        keep = 0
        for s in self.stops:
            keep = max(keep, next((k for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])), 0))
        self.held = text[len(text) - keep :]
        return text[: len(text) - keep]

    def flush(self) -> str:
        """The end of generation: what was held back is no stop string after all."""
        text, self.held = self.held, ""
        return text

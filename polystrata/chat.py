"""Chat templates: render a GGUF's `tokenizer.chat_template` (Jinja2) for a list of messages.

Templates come from model files downloaded from anywhere, so they are untrusted code: they run in
Jinja2's immutable sandbox, any attempt to reach an unsafe attribute (``__class__``, ``__globals__``...)
is an error rather than a silent empty string, and big repetitions/powers are capped.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from polystrata.errors import PolystrataError

__all__ = ["ChatTemplateError", "render_chat", "chat_template_from_metadata"]

# Caps on what a template can make the renderer allocate with `*` and `**`.
_MAX_REPEAT_LEN = 1_000_000
_MAX_POWER_BITS = 4096


class ChatTemplateError(PolystrataError):
    """A chat template failed to compile or render, or tried something the sandbox forbids."""


class _TemplateRaised(jinja2.TemplateError):
    """The template called raise_exception(message)."""


def _raise_exception(message: Any = "") -> None:
    raise _TemplateRaised(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None, separators=None, sort_keys: bool = False,
            ensure_ascii: bool = False) -> str:
    # Jinja's own tojson HTML-escapes <, >, & and ', which would corrupt prompts; templates expect plain JSON.
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii)


class _Sandbox(ImmutableSandboxedEnvironment):
    """Immutable sandbox that fails loudly on unsafe access and bounds memory-hungry operators."""

    intercepted_binops = frozenset({"*", "**"})

    def unsafe_undefined(self, obj: Any, attribute: str):
        # The stock sandbox returns an Undefined, which renders as "" when printed; refusing outright makes
        # probing templates fail visibly.
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__} object is not allowed")

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if isinstance(seq, str | list | tuple) and isinstance(count, int):
                    if len(seq) * max(count, 0) > _MAX_REPEAT_LEN:
                        raise SecurityError("template tried to build a sequence that is too long")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int):
            if right > 0 and abs(left) > 1 and right * max(abs(left).bit_length(), 1) > _MAX_POWER_BITS:
                raise SecurityError("template tried to compute a number that is too large")
        return super().call_binop(context, operator, left, right)


@functools.lru_cache(maxsize=1)
def _environment() -> _Sandbox:
    # trim_blocks/lstrip_blocks match how Hugging Face renders chat templates, which authors write for.
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
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
    try:
        return compiled.render(**context)
    except _TemplateRaised as e:
        raise ChatTemplateError(f"chat template refused the conversation: {_one_line(e)}") from None
    except SecurityError as e:
        raise ChatTemplateError(f"chat template blocked by the sandbox: {_one_line(e)}") from None
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError,
            ArithmeticError, RecursionError) as e:
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {_one_line(e)}") from None


def chat_template_from_metadata(metadata: Mapping[str, Any], name: str | None = None) -> str | None:
    """The GGUF's default chat template (`tokenizer.chat_template`), or a named one; None if absent."""
    key = "tokenizer.chat_template" if name is None else f"tokenizer.chat_template.{name}"
    value = metadata.get(key)
    return value if isinstance(value, str) else None

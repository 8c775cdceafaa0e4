"""Chat template rendering: real templates, tokenization of the result, and sandbox escapes."""

from __future__ import annotations

from pathlib import Path

import pytest

from polystrata.chat import ChatTemplateError, chat_template_from_metadata, render_chat
from polystrata.errors import PolystrataError, ZooError
from polystrata.tokenizer import Tokenizer

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "What is 2+2?"},
]

# The Gemma 3 GGUF carries no chat template, so this is a compact template in Gemma's turn format
# (system prompt folded into the first user turn, assistant role called "model").
GEMMA_STYLE_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(system='') -%}
{%- for m in messages -%}
  {%- if m['role'] == 'system' -%}
    {%- set ns.system = m['content'] + '\n\n' -%}
  {%- else -%}
    {%- if m['role'] not in ['user', 'assistant'] -%}
      {{ raise_exception('unsupported role: ' + m['role']) }}
    {%- endif -%}
    {{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else 'user') + '\n' }}
    {%- if m['role'] == 'user' and ns.system -%}{{ ns.system }}{%- set ns.system = '' -%}{%- endif -%}
    {{ m['content'] | trim }}<end_of_turn>{{ '\n' }}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"""


def _metadata(request, name: str) -> dict:
    from polystrata.gguf import GGUFFile

    try:
        path = Path(request.getfixturevalue(f"{name}_path"))
    except ZooError as e:
        pytest.skip(f"{name} model is not available: {e}")
    return GGUFFile(path).metadata


@pytest.fixture(scope="module")
def smollm2_md(request) -> dict:
    return _metadata(request, "smollm2")


@pytest.fixture(scope="module")
def gemma3_md(request) -> dict:
    return _metadata(request, "gemma3")


def test_smollm2_template(smollm2_md):
    template = chat_template_from_metadata(smollm2_md)
    assert template is not None
    text = render_chat(template, MESSAGES[1:])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    with_system = render_chat(template, MESSAGES, add_generation_prompt=False)
    assert with_system.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert not with_system.endswith("<|im_start|>assistant\n")

    tok = Tokenizer.from_metadata(smollm2_md)
    ids = tok.encode(text, parse_special=True)
    assert ids[0] == tok.token_to_id("<|im_start|>") and ids.count(tok.eos_id) == 4
    assert tok.decode(ids, special=True) == text


def test_gemma_style_template(gemma3_md):
    assert chat_template_from_metadata(gemma3_md) is None  # this GGUF ships without one
    tok = Tokenizer.from_metadata(gemma3_md)
    text = render_chat(GEMMA_STYLE_TEMPLATE, MESSAGES, bos_token="<bos>", eos_token="<eos>")
    assert text == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi!<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n"
    )
    # The template prints BOS itself, so encode without adding another one.
    ids = tok.encode(text, add_special=False, parse_special=True)
    assert ids[:3] == [tok.bos_id, 105, 2364]  # <bos> <start_of_turn> user
    assert ids[-3:] == [105, 4368, 107]  # <start_of_turn> model \n
    assert ids.count(106) == 3 and all(tok.is_eog(i) for i in ids if i == 106)
    with pytest.raises(ChatTemplateError, match="unsupported role: tool"):
        render_chat(GEMMA_STYLE_TEMPLATE, [{"role": "tool", "content": "x"}])


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__.__subclasses__() }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__ }}",
        "{{ raise_exception.__globals__ }}",
        "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
        "{{ namespace.__init__.__globals__ }}",
        "{% set x = messages.append({'role': 'user'}) %}",
        "{{ messages[0].update({'role': 'x'}) }}",
        "{{ 'a' * 1000000000 }}",
        "{{ 9 ** 99999999 }}",
        "{{ range(10 ** 9) | list }}",
    ],
)
def test_malicious_templates_raise_clean_errors(template):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ChatTemplateError) as info:
        render_chat(template, messages)
    assert isinstance(info.value, PolystrataError)
    assert "\n" not in str(info.value)
    assert messages == [{"role": "user", "content": "hi"}]  # inputs untouched


@pytest.mark.parametrize(
    ("template", "match"),
    [
        ("{{ raise_exception('System role not supported') }}", "System role not supported"),
        ("{% for m in messages %}", "does not compile"),
        ("{{ messages[0]['content'] + 1 }}", "failed"),
        ("", "no chat template"),
    ],
)
def test_template_errors(template, match):
    with pytest.raises(ChatTemplateError, match=match):
        render_chat(template, [{"role": "user", "content": "hi"}])


def test_helpers():
    text = render_chat(
        "{{ messages[0] | tojson }}|{{ strftime_now('%Y') | length }}|{{ tools is defined }}|{{ extra }}",
        [{"role": "user", "content": "<b>&'é"}],
        extra="yes",
    )
    # tojson must not HTML-escape (that would corrupt the prompt) and keeps non-ASCII as is.
    assert text == '{"role": "user", "content": "<b>&\'é"}|4|False|yes'


def test_bounded_operations_render_like_jinja():
    """The size checks on filters, methods and operators leave ordinary uses unchanged."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    template = (
        "{{ 'ab' | center(9) }}|{{ 'a\nb' | indent(2, true) }}|{{ 'a-b-c' | replace('-', '+') }}|"
        "{{ 'aXbX' | replace('X', 'yy', 1) }}|{{ [1, 2, 3] | join(', ') }}|{{ 'one two three' | wordwrap(5) }}|"
        "{{ '%s=%03d' | format('x', 7) }}|{{ '%-4s|' % 'ab' }}|{{ '{}:{:>4}'.format('k', 12) }}|"
        "{{ 'ab'.center(6, '*') }}|{{ 'a\tb'.expandtabs(4) }}|{{ '-'.join(['x', 'y']) }}|{{ 'ab' * 3 }}|"
        "{{ [1] + [2] }}|{{ 'a' + 'b' }}|{{ 6 * 7 }}|{{ 2 ** 10 }}|{{ 7 % 3 }}|"
        "{% set ns = namespace(s='') %}{% for i in range(3) %}{% set ns.s = ns.s ~ i %}{% endfor %}{{ ns.s }}|"
        "{{ messages | map(attribute='content') | join('/') }}|{{ '+'.join(messages | map(attribute='role')) }}"
    )
    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(template)
    assert render_chat(template, MESSAGES) == plain.render(messages=MESSAGES)

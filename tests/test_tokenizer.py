"""Tokenizer tests: exact agreement with llama.cpp on the real models, plus unit tests on tiny vocabularies."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from polystrata.errors import GGUFError, PolystrataError, UnsupportedError, ZooError
from polystrata.tokenizer import Tokenizer

MODELS = ("smollm2", "gemma3")
REFERENCE = Path(__file__).parent / "data" / "fixtures" / "reference"


def _metadata(path: Path) -> dict:
    from polystrata.gguf import GGUFFile

    return GGUFFile(path).metadata


def _model_path(request, name: str) -> Path:
    # conftest's <name>_path fixtures fetch the model into the cache; offline without it, skip rather than fail.
    try:
        return Path(request.getfixturevalue(f"{name}_path"))
    except ZooError as e:
        pytest.skip(f"{name} model is not available: {e}")


@pytest.fixture(scope="module")
def smollm2(request) -> Tokenizer:
    return Tokenizer.from_metadata(_metadata(_model_path(request, "smollm2")))


@pytest.fixture(scope="module")
def gemma3(request) -> Tokenizer:
    return Tokenizer.from_metadata(_metadata(_model_path(request, "gemma3")))


@pytest.fixture(scope="module")
def tokenizers(request) -> dict:
    # Lazily resolves one model's fixture, so a missing file skips only that model's cases.
    return {name: (lambda name=name: request.getfixturevalue(name)) for name in MODELS}


def _cases(name: str) -> list[dict]:
    return json.loads((REFERENCE / name / "tokenize.json").read_text(encoding="utf-8"))


ALL_CASES = [(name, i, case) for name in MODELS for i, case in enumerate(_cases(name))]


# ---------------------------------------------------------------- llama.cpp reference fixtures


@pytest.mark.parametrize(("name", "index", "case"), ALL_CASES, ids=[f"{n}-{i}" for n, i, _ in ALL_CASES])
def test_matches_llama_cpp_fixture(tokenizers, name, index, case):
    tok = tokenizers[name]()
    ids = tok.encode(case["text"], add_special=case["add_bos"], parse_special=case["special"])
    assert ids == case["ids"]


@pytest.mark.parametrize("name", MODELS)
def test_round_trip_fixture_texts(tokenizers, name):
    tok = tokenizers[name]()
    for text in json.loads((REFERENCE / "texts.json").read_text(encoding="utf-8")):
        assert tok.decode(tok.encode(text, add_special=False)) == text
        # BOS is a control token, so it renders as nothing.
        assert tok.decode(tok.encode(text, add_special=True)) == text


@pytest.mark.parametrize("name", MODELS)
def test_prompt_fixture_ids(tokenizers, name):
    # The logits fixtures were made from prompts tokenized with the model's own BOS policy.
    tok = tokenizers[name]()
    prompts = json.loads((REFERENCE / "prompts.json").read_text(encoding="utf-8"))
    for key, text in prompts.items():
        assert tok.encode(text) == np.load(REFERENCE / name / f"{key}.npz")["ids"].tolist(), key


# Made with llama-cpp-python 0.3.36 (llama.cpp's tokenize with add_special, parse_special): special-token
# parsing, user-defined tokens (split out even without parse_special) and control tokens as plain text.
SPECIAL_CASES = [
    ("smollm2", "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n", True, True,
     [1, 4093, 198, 26843, 665, 2, 198, 1, 520, 9531, 198]),
    ("smollm2", "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n", False, False,
     [44, 108, 306, 79, 3738, 108, 46, 4093, 198, 26843, 665, 44, 108, 306, 79, 486, 108, 46, 198, 44, 108,
      306, 79, 3738, 108, 46, 520, 9531, 198]),
    ("smollm2", "<|endoftext|>a<repo_name>", True, True, [0, 81, 3]),
    ("smollm2", "<|endoftext|>a<repo_name>", False, False,
     [44, 108, 486, 1714, 2692, 108, 46, 81, 44, 22139, 79, 1245, 46]),
    ("smollm2", "x<|im_end|>y<|im_end", True, True, [104, 2, 105, 44, 108, 306, 79, 486]),
    ("smollm2", "x<|im_end|>y<|im_end", False, False,
     [104, 44, 108, 306, 79, 486, 108, 46, 105, 44, 108, 306, 79, 486]),
    ("smollm2", "ᬊ=\xa0\U000b7524naïve", False, False, [172, 122, 228, 45, 15442, 132, 238, 114, 3546, 46494]),
    ("gemma3", "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n", True, True,
     [2, 105, 2364, 107, 10979, 993, 106, 107, 105, 4368, 107]),
    ("gemma3", "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n", False, False,
     [236820, 3041, 236779, 1340, 236779, 887, 236813, 2364, 107, 10979, 993, 236820, 643, 236779, 1340,
      236779, 887, 236813, 107, 236820, 3041, 236779, 1340, 236779, 887, 236813, 4368, 107]),
    ("gemma3", "a[multimodal]b\n\n\n\nc", True, True, [2, 236746, 5, 236763, 110, 236755]),
    ("gemma3", "a[multimodal]b\n\n\n\nc", False, False, [236746, 5, 236763, 110, 236755]),
    ("gemma3", "<bos>x <eos></s><unk><unused3>", True, True, [2, 2, 236781, 236743, 1, 212, 3, 9]),
    ("gemma3", "<bos>x <eos></s><unk><unused3>", False, False,
     [236820, 46757, 236813, 236781, 655, 211827, 2588, 236751, 1798, 4984, 1798, 63634, 236800, 236813]),
]


@pytest.mark.parametrize(("name", "text", "add_special", "parse_special", "ids"), SPECIAL_CASES)
def test_special_tokens_match_llama_cpp(tokenizers, name, text, add_special, parse_special, ids):
    tok = tokenizers[name]()
    assert tok.encode(text, add_special=add_special, parse_special=parse_special) == ids


def test_decode_control_tokens(smollm2, gemma3):
    ids = smollm2.encode("<|im_start|>user\nHi<|im_end|>\n", parse_special=True)
    assert smollm2.decode(ids) == "user\nHi\n"  # control tokens are not rendered by default
    assert smollm2.decode(ids, special=True) == "<|im_start|>user\nHi<|im_end|>\n"
    assert smollm2.token_bytes(2) == b"" and smollm2.token_bytes(2, special=True) == b"<|im_end|>"
    # User-defined tokens render as their text; byte tokens as their byte.
    assert gemma3.decode([236746, 5, 236763]) == "a[multimodal]b"
    assert gemma3.token_bytes(gemma3.token_to_id("<0xF0>")) == b"\xf0"
    assert gemma3.token_bytes(gemma3.token_to_id("▁world")) == b" world"
    assert smollm2.token_bytes(smollm2.token_to_id("Ġworld")) == b" world"


# ---------------------------------------------------------------- BOS / EOS / EOG policy


def test_bos_policy(smollm2, gemma3):
    assert smollm2.add_bos is False and smollm2.bos_id == 1
    assert smollm2.encode("Hello") == smollm2.encode("Hello", add_special=False) == [19556]
    assert gemma3.add_bos is True and gemma3.bos_id == 2 and gemma3.add_eos is False
    assert gemma3.encode("Hello world") == [2, 9259, 1902]
    assert gemma3.encode("Hello world", add_special=False) == [9259, 1902]
    assert gemma3.encode("") == [2] and gemma3.encode("", add_special=False) == []


def test_eog(smollm2, gemma3):
    # Sets read from llama.cpp's llama_vocab_is_eog on these files.
    assert smollm2.eog_ids == {0, 2, 4}  # <|endoftext|>, <|im_end|> (eos), <reponame>
    assert smollm2.eos_id == 2 and smollm2.is_eog(2) and not smollm2.is_eog(1)
    assert gemma3.eog_ids == {1, 106, 212}  # <eos>, <end_of_turn>, </s>
    assert gemma3.eot_id == 106 and gemma3.is_eog(106) and not gemma3.is_eog(105)


def test_vocab(smollm2, gemma3):
    assert smollm2.vocab_size == 49152 and gemma3.vocab_size == 262144
    assert gemma3.id_to_token(106) == "<end_of_turn>" and gemma3.token_to_id("<end_of_turn>") == 106


# ---------------------------------------------------------------- streaming


STREAM_TEXTS = [
    "Emoji: 😀👍🏽 family 👨‍👩‍👧 flag 🇫🇷!",
    "中文字符和日本語のテキスト、한국어",
    "naïve café — “quotes” ½ ² 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]
# Gemma spells these with <0xNN> byte-fallback tokens; SmolLM2's vocab lacks byte 0xF2, which llama.cpp drops.
GEMMA_ONLY_TEXT = "rare: \U000b7524\U00104674 end"


@pytest.mark.parametrize("name", MODELS)
def test_stream_decoder_matches_decode(tokenizers, name):
    tok = tokenizers[name]()
    split_seen = False
    for text in STREAM_TEXTS + ([GEMMA_ONLY_TEXT] if name == "gemma3" else []):
        ids = tok.encode(text, add_special=True)
        stream = tok.stream()
        chunks = [stream.feed(i) for i in ids]
        chunks.append(stream.flush())
        assert "".join(chunks) == tok.decode(ids)
        assert not any("\ufffd" in c for c in chunks)
        for i in ids:
            try:
                tok.token_bytes(i).decode("utf-8")
            except UnicodeDecodeError:
                split_seen = True  # a character really was split across tokens
    assert split_seen
    assert tok.decode(tok.encode(STREAM_TEXTS[0], add_special=False)) == STREAM_TEXTS[0]


def test_stream_decoder_holds_partial_utf8(gemma3):
    ids = [gemma3.token_to_id(f"<0x{b:02X}>") for b in "😀".encode()]
    stream = gemma3.stream()
    assert [stream.feed(i) for i in ids] == ["", "", "", "😀"]
    stream = gemma3.stream()
    assert stream.feed(ids[0]) == "" and stream.flush() == "\ufffd"  # cut off at the end


# ---------------------------------------------------------------- long mixed text


@pytest.mark.parametrize("name", MODELS)
def test_long_mixed_text_round_trips(tokenizers, name):
    rng = random.Random(0)
    words = "the quick brown fox jumps over lazy dog naïve café 日本語 😀 1234 def return x**2 <p>".split()
    text = " ".join(rng.choice(words) for _ in range(400))[:2048]
    tok = tokenizers[name]()
    ids = tok.encode(text, parse_special=True, add_special=False)
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode("a" * 2000, add_special=False)) == "a" * 2000


# ---------------------------------------------------------------- tiny synthetic vocabularies


def _byte_chars() -> list[str]:
    from polystrata.tokenizer import _BYTE_CHARS

    return list(_BYTE_CHARS)


def _bpe_md(pre: str | None, merges: list[str] = (), extra: list[str] = (), types: list[int] | None = None):
    tokens = _byte_chars() + [a.replace(" ", "") for a in merges] + list(extra)
    md = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": list(merges),
        "tokenizer.ggml.token_type": np.array(types or [1] * len(tokens), dtype=np.int32),
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 0,
    }
    if pre is not None:
        md["tokenizer.ggml.pre"] = pre
    return md


@pytest.mark.parametrize(
    ("pre", "text", "words"),
    [
        ("gpt-2", "I'm 12345 ok!!  x\n", ["I", "'m", " 12345", " ok", "!!", " ", " x", "\n"]),
        ("smollm", "abc 123", ["abc", " ", "1", "2", "3"]),
        ("llama-bpe", "I'M 12345 ok!!\n\nx", ["I", "'M", " ", "123", "45", " ok", "!!\n\n", "x"]),
        ("qwen2", "ab 123", ["ab", " ", "1", "2", "3"]),
        ("qwen2", "e\u0301t\u0301 1", ["e", "\u0301t", "\u0301", " ", "1"]),
        ("qwen35", "e\u0301t\u0301 1", ["e\u0301t\u0301", " ", "1"]),  # combining marks stay in the word
        ("default", "x+=1000", ["x", "+=", "100", "0"]),
    ],
)
def test_pre_tokenizers(pre, text, words):
    tok = Tokenizer.from_metadata(_bpe_md(pre))
    assert tok.pre_tokenize(text) == words
    assert tok.decode(tok.encode(text)) == text


def test_bpe_merges_by_rank():
    # Lower rank wins and ties go left: "aaa" -> "aa" + "a".
    tok = Tokenizer.from_metadata(_bpe_md("gpt-2", merges=["a a", "b c", "a bc"]))
    ids = tok.encode("aaa abc", add_special=False)
    assert [tok.id_to_token(i) for i in ids] == ["aa", "a", "Ġ", "abc"]
    assert tok.decode(ids) == "aaa abc"


def test_llama3_defaults_add_bos():
    assert Tokenizer.from_metadata(_bpe_md("llama-bpe")).add_bos is True
    assert Tokenizer.from_metadata(_bpe_md("gpt-2")).add_bos is False
    md = _bpe_md("llama-bpe")
    md["tokenizer.ggml.add_bos_token"] = False
    assert Tokenizer.from_metadata(md).add_bos is False


def test_missing_pre_warns_and_uses_default():
    with pytest.warns(UserWarning, match="default"):
        tok = Tokenizer.from_metadata(_bpe_md(None))
    assert tok.pre == "default"


def test_unsupported():
    with pytest.raises(UnsupportedError, match="gpt2, llama"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(UnsupportedError, match="smollm"):
        Tokenizer.from_metadata(_bpe_md("no-such-pre"))
    with pytest.raises(GGUFError):
        Tokenizer.from_metadata({})
    assert issubclass(UnsupportedError, PolystrataError)


def _spm_md(pieces: dict[str, float], add_space_prefix: bool = True) -> dict:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + list(pieces)
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + list(pieces.values())
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": np.array(scores, dtype=np.float32),
        "tokenizer.ggml.token_type": np.array(types, dtype=np.int32),
        "tokenizer.ggml.add_space_prefix": add_space_prefix,
    }


def test_spm_space_prefix_scores_and_byte_fallback():
    tok = Tokenizer.from_metadata(_spm_md({"▁": -1, "h": -1, "i": -1, "▁h": -3, "hi": -2, "▁hi": -1}))
    assert tok.bos_id == 1 and tok.eos_id == 2 and tok.add_bos  # llama.cpp's SPM defaults
    ids = tok.encode("hi é")
    # "▁hi" via the best-scoring merges, then the space, then é as two byte-fallback tokens.
    assert [tok.id_to_token(i) for i in ids] == ["<s>", "▁hi", "▁", "<0xC3>", "<0xA9>"]
    assert tok.decode(ids) == "hi é"  # the added space prefix is removed again
    no_prefix = Tokenizer.from_metadata(_spm_md({"▁": -1, "h": -1, "i": -1}, add_space_prefix=False))
    assert [no_prefix.id_to_token(i) for i in no_prefix.encode("hi", add_special=False)] == ["h", "i"]


def test_spm_space_prefix_after_special():
    tok = Tokenizer.from_metadata(_spm_md({"▁": -1, "a": -1, "▁a": -0.5}))
    ids = tok.encode("a</s>a", add_special=False, parse_special=True)
    assert [tok.id_to_token(i) for i in ids] == ["▁a", "</s>", "▁a"]


# ---------------------------------------------------------------- optional: live llama.cpp comparison


@pytest.mark.llama_cpp
@pytest.mark.parametrize("name", MODELS)
def test_random_texts_against_llama_cpp(request, tokenizers, name):
    llama_cpp = pytest.importorskip("llama_cpp")
    tok = tokenizers[name]()
    llm = llama_cpp.Llama(model_path=str(_model_path(request, name)), n_ctx=64, vocab_only=True, verbose=False)
    rng = random.Random(1)
    pieces = ["Hello", " world", "  ", "\n\n", "\t", "2024", "I'm", "...", "naïve", "日本語", "😀", "👨‍👩‍👧",
              "<|im_start|>", "<|im_end|>", "<start_of_turn>", "<end_of_turn>", "<bos>", "[multimodal]", "▁"]
    for _ in range(300):
        text = "".join(rng.choice(pieces) if rng.random() < 0.8 else chr(rng.randint(32, 0x2FFF))
                       for _ in range(rng.randint(0, 10)))
        for add_special, parse_special in ((True, False), (False, True)):
            ref = llm.tokenize(text.encode(), add_bos=add_special, special=parse_special)
            assert tok.encode(text, add_special=add_special, parse_special=parse_special) == ref, text

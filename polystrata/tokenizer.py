"""Tokenizers for GGUF models, matching llama.cpp's `llama-vocab` token for token.

Two tokenizer families are supported, chosen by `tokenizer.ggml.model`:

* ``gpt2``: byte-level BPE with ranked merges, preceded by a regex pre-tokenizer selected by
  `tokenizer.ggml.pre` (``smollm``, ``llama-bpe``/``llama3``, ``qwen2``, ``gpt-2``, ``default``, ...).
* ``llama``: SentencePiece-style merging by token score, with ``<0xNN>`` byte fallback and ``▁`` as space.

Build one with :meth:`Tokenizer.from_metadata` from a GGUF metadata dict (as returned by
``polystrata.gguf.GGUFFile(path).metadata``).
"""

from __future__ import annotations

import codecs
import heapq
import warnings
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import regex

from polystrata.errors import GGUFError, PolystrataError, UnsupportedError
from polystrata.gguf import typed_value

__all__ = [
    "TOKEN_NORMAL",
    "TOKEN_UNKNOWN",
    "TOKEN_CONTROL",
    "TOKEN_USER_DEFINED",
    "TOKEN_UNUSED",
    "TOKEN_BYTE",
    "SUPPORTED_MODELS",
    "SUPPORTED_PRE",
    "StreamDecoder",
    "Tokenizer",
]

# `tokenizer.ggml.token_type` values (llama.cpp's llama_token_type).
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6

SUPPORTED_MODELS = ("gpt2", "llama")

# Pre-tokenizer regexes, applied one after another: each one splits every fragment produced by the
# previous one, and the text between matches stays as fragments of its own (llama.cpp's unicode_regex_split).
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_RE = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_RE = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5 / Qwen3.6: qwen2's, with combining marks (\p{M}) kept in words.
_QWEN35_RE = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEFAULT_RES = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_RE, r"\p{N}+", r"[0-9][0-9][0-9]")
_STARCODER_RES = (r"\p{N}", _GPT2_RE)

# tokenizer.ggml.pre name -> (regexes, ignore_merges, default add_bos)
_PRE = {
    "default": (_DEFAULT_RES, False, False),
    "gpt-2": ((_GPT2_RE,), False, False),
    "phi-2": ((_GPT2_RE,), False, False),
    "llama-bpe": ((_LLAMA3_RE,), True, True),
    "llama3": ((_LLAMA3_RE,), True, True),
    "llama-v3": ((_LLAMA3_RE,), True, True),
    "qwen2": ((_QWEN2_RE,), False, False),
    "qwen35": ((_QWEN35_RE,), False, False),
    "smollm": (_STARCODER_RES, False, False),
    "starcoder": (_STARCODER_RES, False, False),
    "refact": (_STARCODER_RES, False, False),
}
SUPPORTED_PRE = tuple(_PRE)

# Token texts llama.cpp treats as end of generation in addition to eos/eot/eom (it matches by text
# because converters do not record these in metadata). Checked against llama.cpp on SmolLM2 and Gemma 3.
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>",
    "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>", "</s>",
})
# Fill-in-the-middle pad/repo/file-separator tokens, which llama.cpp also makes EOG.
_FIM_EOG_TEXTS = (
    ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>"),
    ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    ("<|file_sep|>",),
)


def gpt2_byte_chars() -> list[str]:
    """GPT-2's reversible byte -> printable unicode char table (bytes that print stay themselves)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table: list[str] = [""] * 256
    extra = 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_CHARS = gpt2_byte_chars()
# bytes.decode("latin-1").translate(_BYTE_ENCODE) maps raw bytes to their GPT-2 chars in one C-level pass.
_BYTE_ENCODE = {b: c for b, c in enumerate(_BYTE_CHARS)}
_BYTE_DECODE = {c: b for b, c in enumerate(_BYTE_CHARS)}


def _utf8(text: str) -> bytes:
    """UTF-8 bytes of `text`. GGUF strings and argv keep bytes that are not UTF-8 as surrogates
    (surrogateescape), which turn back into those bytes; any other lone surrogate becomes '?'."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace")


def _strings(md: Mapping, key: str) -> list[str] | None:
    """A string-array metadata value, or None if absent; GGUFError for any other type."""
    value = md.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise GGUFError(f"metadata '{key}' is not an array of strings")
    return value


def _numbers(md: Mapping, key: str, integer: bool) -> list | None:
    """A numeric-array metadata value (integers only if `integer`), or None if absent; GGUFError otherwise."""
    value = md.get(key)
    if value is None:
        return None
    kinds = "biu" if integer else "biuf"
    if not isinstance(value, np.ndarray) or value.ndim != 1 or value.dtype.kind not in kinds:
        raise GGUFError(f"metadata '{key}' is not an array of {'integers' if integer else 'numbers'}")
    return value.tolist()


def _scalar(md: Mapping, key: str, kind: type):
    """An int or bool metadata value, or None if absent."""
    value = md.get(key)
    return None if value is None else typed_value(key, value, kind)


def _text(md: Mapping, key: str) -> str | None:
    value = md.get(key)
    if value is not None and not isinstance(value, str):
        raise GGUFError(f"metadata '{key}' has value {value!r:.60}, expected a string")
    return value


def _merge_pairs(syms: list[str], priority) -> list[int]:
    """Merge adjacent symbols in place, the pair with the lowest `priority(left, right)` first (None: never
    merged) and the leftmost on ties, until no pair merges: llama.cpp's SPM and BPE loops over a linked list with
    a heap. Merged-away symbols become ""; returns each symbol's successor (-1 after the last)."""
    n = len(syms)
    nxt = [i + 1 if i + 1 < n else -1 for i in range(n)]
    prev = list(range(-1, n - 1))
    heap: list[tuple] = []

    def push(left: int, right: int) -> None:
        if left >= 0 and right >= 0:
            p = priority(syms[left], syms[right])
            if p is not None:
                heapq.heappush(heap, (p, left, right, syms[left] + syms[right]))

    for i in range(1, n):
        push(i - 1, i)
    while heap:
        _, left, right, merged = heapq.heappop(heap)
        if not syms[left] or not syms[right] or syms[left] + syms[right] != merged:
            continue  # stale: one side was merged since this pair was queued
        syms[left], syms[right] = merged, ""
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prev[nxt[right]] = left
        push(prev[left], left)
        push(left, nxt[left])
    return nxt


class Tokenizer:
    """A llama.cpp-compatible tokenizer (byte-level BPE or SentencePiece) built from GGUF metadata."""

    def __init__(
        self,
        *,
        model: str,
        tokens: Sequence[str],
        token_types: Sequence[int] | None = None,
        scores: Sequence[float] | None = None,
        merges: Sequence[str] | None = None,
        pre: str | None = None,
        bos_id: int | None = None,
        eos_id: int | None = None,
        unk_id: int | None = None,
        eot_id: int | None = None,
        eom_id: int | None = None,
        add_bos: bool | None = None,
        add_eos: bool | None = None,
        add_space_prefix: bool | None = None,
    ):
        """Build a tokenizer from decoded metadata values; most callers want :meth:`from_metadata`."""
        if model not in SUPPORTED_MODELS:
            raise UnsupportedError(
                f"tokenizer model {model!r} is not supported (supported: {', '.join(SUPPORTED_MODELS)})"
            )
        self.model = model
        n = len(tokens)
        if n == 0:
            raise GGUFError("tokenizer.ggml.tokens is empty")
        # llama.cpp renames empty tokens so they cannot match empty text.
        self._tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        types = list(token_types) if token_types is not None else [TOKEN_NORMAL] * n
        if len(types) != n:
            raise GGUFError(f"tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")
        self._types = [int(t) for t in types]
        self._scores = list(scores) if scores is not None else [0.0] * n
        if len(self._scores) != n:
            raise GGUFError(f"tokenizer.ggml.scores has {len(self._scores)} entries for {n} tokens")
        # Later duplicates win, as in llama.cpp's token_to_id map.
        self._tok2id = {t: i for i, t in enumerate(self._tokens)}

        if model == "llama":
            # llama.cpp's SPM defaults; metadata overrides them below.
            self.pre = "default"
            self._regexes: list = []
            self._ignore_merges = False
            default_bos, default_eos_flag, default_space = True, False, True
            defaults = (1, 2, 0)
            self._ranks: dict[tuple[str, str], int] = {}
            self._byte_ids = self._spm_byte_tokens()
        else:
            if not pre:
                warnings.warn("GGUF has no tokenizer.ggml.pre; using the 'default' pre-tokenizer", stacklevel=2)
                pre = "default"
            if pre not in _PRE:
                # llama.cpp refuses unknown pre-tokenizers rather than silently mis-tokenizing.
                raise UnsupportedError(
                    f"pre-tokenizer {pre!r} is not supported (supported: {', '.join(SUPPORTED_PRE)})"
                )
            self.pre = pre
            res, self._ignore_merges, default_bos = _PRE[pre]
            self._regexes = [regex.compile(r) for r in res]
            default_eos_flag, default_space = False, False
            defaults = (None, None, None)
            if merges is None:
                raise GGUFError("gpt2 tokenizer without tokenizer.ggml.merges")
            self._ranks = {}
            for rank, m in enumerate(merges):
                # Split at the first space after position 0, like llama.cpp (a merge may start with a space).
                pos = m.find(" ", 1)
                if pos < 0:
                    continue
                self._ranks.setdefault((m[:pos], m[pos + 1 :]), rank)
            self._byte_ids = []

        def check_id(value, default, name):
            if value is None:
                return default
            value = int(value)
            if not 0 <= value < n:
                warnings.warn(f"{name} {value} is out of range for {n} tokens; ignored", stacklevel=3)
                return default
            return value

        self.bos_id: int | None = check_id(bos_id, defaults[0], "bos_token_id")
        self.eos_id: int | None = check_id(eos_id, defaults[1], "eos_token_id")
        self.unk_id: int | None = check_id(unk_id, defaults[2], "unknown_token_id")
        self.add_bos = bool(default_bos if add_bos is None else add_bos)
        self.add_eos = bool(default_eos_flag if add_eos is None else add_eos)
        self.add_space_prefix = bool(default_space if add_space_prefix is None else add_space_prefix)
        if self.add_bos and self.bos_id is None:
            raise GGUFError("tokenizer adds a BOS token but has no tokenizer.ggml.bos_token_id")
        if self.add_eos and self.eos_id is None:
            raise GGUFError("tokenizer adds an EOS token but has no tokenizer.ggml.eos_token_id")

        self.eot_id = check_id(eot_id, None, "eot_token_id")
        self._compute_eog(check_id(eom_id, None, "eom_token_id"))

        # Special-token candidates for splitting input text, longest first (llama.cpp's cache_special_tokens).
        special = [
            i for i, t in enumerate(self._types) if t in (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN)
        ]
        special.sort(key=lambda i: (-len(_utf8(self._tokens[i])), i))
        self._special_all = [(self._tokens[i], i) for i in special]
        # Without parse_special, user-defined tokens are still split out first (llama.cpp does the same).
        self._special_user = [(t, i) for t, i in self._special_all if self._types[i] == TOKEN_USER_DEFINED]

        self._word_cache: dict[str, tuple[int, ...]] = {}
        self._piece_cache: dict[tuple[int, bool], bytes] = {}

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_metadata(cls, md: Mapping) -> Tokenizer:
        """Build the tokenizer described by a GGUF metadata dict (`tokenizer.ggml.*` keys)."""
        model = _text(md, "tokenizer.ggml.model")
        if model is None:
            raise GGUFError("GGUF has no tokenizer (tokenizer.ggml.model is missing)")
        if model not in SUPPORTED_MODELS:
            raise UnsupportedError(
                f"tokenizer model {model!r} is not supported (supported: {', '.join(SUPPORTED_MODELS)})"
            )
        tokens = _strings(md, "tokenizer.ggml.tokens")
        if tokens is None:
            raise GGUFError("GGUF has no tokenizer.ggml.tokens")
        return cls(
            model=model,
            tokens=tokens,
            token_types=_numbers(md, "tokenizer.ggml.token_type", integer=True),
            scores=_numbers(md, "tokenizer.ggml.scores", integer=False),
            merges=_strings(md, "tokenizer.ggml.merges"),
            pre=_text(md, "tokenizer.ggml.pre"),
            bos_id=_scalar(md, "tokenizer.ggml.bos_token_id", int),
            eos_id=_scalar(md, "tokenizer.ggml.eos_token_id", int),
            unk_id=_scalar(md, "tokenizer.ggml.unknown_token_id", int),
            eot_id=_scalar(md, "tokenizer.ggml.eot_token_id", int),
            eom_id=_scalar(md, "tokenizer.ggml.eom_token_id", int),
            add_bos=_scalar(md, "tokenizer.ggml.add_bos_token", bool),
            add_eos=_scalar(md, "tokenizer.ggml.add_eos_token", bool),
            add_space_prefix=_scalar(md, "tokenizer.ggml.add_space_prefix", bool),
        )

    def _spm_byte_tokens(self) -> list[int]:
        ids = []
        for b in range(256):
            tid = self._tok2id.get(f"<0x{b:02X}>")
            if tid is None:
                # llama.cpp falls back to the single-character token for that byte.
                tid = self._tok2id.get(chr(b)) if b < 128 else None
            ids.append(-1 if tid is None else tid)
        return ids

    def _compute_eog(self, eom_id: int | None) -> None:
        eog: set[int] = set()
        if self.eot_id is None:
            for text in ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                         "<|end_of_text|>", "<EOT>", "_<EOT>", "<｜end▁of▁sentence｜>", "<end_of_utterance>"):
                if text in self._tok2id:
                    self.eot_id = self._tok2id[text]
                    break
        for group in _FIM_EOG_TEXTS:
            for text in group:
                if text in self._tok2id:
                    eog.add(self._tok2id[text])
                    break
        for text in _EOG_TEXTS:
            tid = self._tok2id.get(text)
            if tid is not None:
                eog.add(tid)
        for tid in (self.eos_id, self.eot_id, eom_id):
            if tid is not None:
                eog.add(tid)
        for tid in eog:
            # llama.cpp forces EOG tokens to be control tokens: never parsed from plain text, never rendered.
            if self._types[tid] != TOKEN_CONTROL:
                self._types[tid] = TOKEN_CONTROL
        self.eog_ids: frozenset[int] = frozenset(eog)

    # ------------------------------------------------------------------ vocabulary

    @property
    def vocab_size(self) -> int:
        """Number of tokens in the vocabulary."""
        return len(self._tokens)

    def is_eog(self, token_id: int) -> bool:
        """True for tokens that end generation (EOS, end-of-turn and friends)."""
        return token_id in self.eog_ids

    def id_to_token(self, token_id: int) -> str:
        """The token's text as stored in the vocabulary (GPT-2 byte chars / ``▁`` not decoded)."""
        return self._tokens[token_id]

    def token_to_id(self, text: str) -> int | None:
        """The id of the vocabulary entry whose stored text is exactly `text`, or None."""
        return self._tok2id.get(text)

    def token_type(self, token_id: int) -> int:
        """The token's type (TOKEN_NORMAL, TOKEN_CONTROL, ...), after llama.cpp's EOG adjustment."""
        return self._types[token_id]

    # ------------------------------------------------------------------ encoding

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Tokenize `text`.

        add_special: add BOS/EOS according to the model's policy (llama.cpp's add_special).
        parse_special: turn control-token text such as ``<|im_start|>`` into those tokens; otherwise such
        text is tokenized as plain text (user-defined tokens are split out either way, as in llama.cpp).
        """
        out: list[int] = []
        if add_special and self.add_bos:
            out.append(self.bos_id)
        fragments = self._split_special(text, parse_special)
        if self.model == "llama":
            prev_special = True  # a space prefix goes at the start and after every special token
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                    prev_special = True
                    continue
                if self.add_space_prefix and prev_special:
                    frag = " " + frag
                self._spm_encode(frag.replace(" ", "\u2581"), out)
                prev_special = False
        else:
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                else:
                    self._bpe_encode(frag, out)
        if add_special and self.add_eos:
            out.append(self.eos_id)
        return out

    def _split_special(self, text: str, parse_special: bool) -> list[str | int]:
        """Split out special-token texts: longest token first, over the whole text, like llama.cpp."""
        frags: list[str | int] = [text] if text else []
        for tok_text, tid in self._special_all if parse_special else self._special_user:
            if tok_text not in text:  # cheap rejection for the (many) tokens that cannot occur
                continue
            new: list[str | int] = []
            for frag in frags:
                if isinstance(frag, int) or tok_text not in frag:
                    new.append(frag)
                    continue
                for k, part in enumerate(frag.split(tok_text)):
                    if k:
                        new.append(tid)
                    if part:
                        new.append(part)
            frags = new
        return frags

    def _spm_encode(self, text: str, out: list[int]) -> None:
        """llama.cpp's llm_tokenizer_spm: repeatedly merge the adjacent pair whose token scores highest."""
        if not text:
            return
        syms = list(text)
        tok2id, scores = self._tok2id, self._scores

        def priority(left: str, right: str) -> float | None:
            tid = tok2id.get(left + right)
            return None if tid is None else -scores[tid]  # highest score first

        nxt = _merge_pairs(syms, priority)

        byte_ids = self._byte_ids
        i = 0
        while i != -1:
            s = syms[i]
            tid = tok2id.get(s)
            if tid is not None:
                out.append(tid)
            else:
                for b in _utf8(s):
                    bid = byte_ids[b]
                    if bid < 0:
                        raise PolystrataError(f"cannot tokenize {s!r}: the vocabulary has no token for byte {b:#04x}")
                    out.append(bid)
            i = nxt[i]

    def pre_tokenize(self, text: str) -> list[str]:
        """Split plain text into the words BPE merges within (gpt2 models; SPM returns [text])."""
        frags = [text] if text else []
        for rx in self._regexes:
            new: list[str] = []
            for frag in frags:
                pos = 0
                for m in rx.finditer(frag):
                    start, end = m.span()
                    if start > pos:
                        new.append(frag[pos:start])  # unmatched text stays a fragment of its own
                    if end > start:
                        new.append(frag[start:end])
                    pos = end
                if pos < len(frag):
                    new.append(frag[pos:])
            frags = new
        return frags

    def _bpe_encode(self, text: str, out: list[int]) -> None:
        cache = self._word_cache
        for word in self.pre_tokenize(text):
            ids = cache.get(word)
            if ids is None:
                ids = self._bpe_word(_utf8(word).decode("latin-1").translate(_BYTE_ENCODE))
                if len(cache) > 100_000:  # bound memory on long-running servers
                    cache.clear()
                cache[word] = ids
            out.extend(ids)

    def _bpe_word(self, word: str) -> tuple[int, ...]:
        """Merge one byte-encoded word by merge rank (lowest first, leftmost on ties), like llama.cpp."""
        tok2id = self._tok2id
        if self._ignore_merges and word in tok2id:
            return (tok2id[word],)
        syms = list(word)
        ranks = self._ranks
        _merge_pairs(syms, lambda left, right: ranks.get((left, right)))
        ids: list[int] = []
        for s in syms:
            if not s:
                continue
            tid = tok2id.get(s)
            if tid is not None:
                ids.append(tid)
            else:
                # No token for this piece (e.g. byte 0xF2 missing from the vocab): llama.cpp looks up each
                # UTF-8 byte of it as a one-byte token text, which only ASCII can match, and drops the rest.
                for b in _utf8(s):
                    bid = tok2id.get(chr(b)) if b < 0x80 else None
                    if bid is not None:
                        ids.append(bid)
        return tuple(ids)

    # ------------------------------------------------------------------ decoding

    def token_bytes(self, token_id: int, special: bool = False) -> bytes:
        """The bytes token `token_id` contributes to decoded text (llama.cpp's token_to_piece).

        Control tokens give b"" unless `special` is true; unused tokens always give b"".
        """
        key = (token_id, special)
        piece = self._piece_cache.get(key)
        if piece is None:
            piece = self._piece(token_id, special)
            self._piece_cache[key] = piece
        return piece

    def _piece(self, token_id: int, special: bool) -> bytes:
        if not 0 <= token_id < len(self._tokens):
            raise PolystrataError(f"token id {token_id} is out of range (vocabulary has {len(self._tokens)})")
        ttype = self._types[token_id]
        text = self._tokens[token_id]
        if ttype == TOKEN_CONTROL:
            return _utf8(text) if special else b""
        if ttype in (TOKEN_UNKNOWN, TOKEN_USER_DEFINED):
            return _utf8(text)
        if ttype == TOKEN_NORMAL:
            if self.model == "llama":
                return _utf8(text.replace("\u2581", " "))
            # Chars outside the GPT-2 byte table are kept as their own UTF-8 (llama.cpp writes a marker).
            return b"".join(
                bytes((_BYTE_DECODE[c],)) if c in _BYTE_DECODE else _utf8(c) for c in text
            )
        if ttype == TOKEN_BYTE and self.model == "llama":
            return bytes((int(text[3:-1], 16),))
        return b""

    def decode(self, ids: Iterable[int], special: bool = False) -> str:
        """Turn token ids back into text; control tokens are left out unless `special` is true.

        Invalid UTF-8 (e.g. a sequence cut off at the end) becomes U+FFFD. With add_space_prefix, the space
        the encoder put in front of the text is removed again (also after a leading BOS, unlike llama.cpp's
        detokenize, so that decode(encode(x)) == x).
        """
        dec = StreamDecoder(self, special=special)
        return "".join(dec.feed(i) for i in ids) + dec.flush()

    def stream(self, special: bool = False) -> StreamDecoder:
        """A decoder to feed generated ids one at a time (see :class:`StreamDecoder`)."""
        return StreamDecoder(self, special=special)

    def __repr__(self) -> str:
        return f"Tokenizer(model={self.model!r}, pre={self.pre!r}, vocab_size={self.vocab_size})"


class StreamDecoder:
    """Incremental detokenizer: feed ids one by one, get back the text completed by each.

    Bytes of a UTF-8 character split across tokens (byte-fallback or byte-level BPE) are held until the
    character is complete, so no U+FFFD appears for valid text; truly invalid bytes become U+FFFD.
    """

    def __init__(self, tokenizer: Tokenizer, special: bool = False):
        """Start decoding at the beginning of a text."""
        self._tok = tokenizer
        self._special = special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # Strip the encoder's space prefix from the first piece that has any text.
        self._strip_space = tokenizer.add_space_prefix

    def feed(self, token_id: int) -> str:
        """Add one token; return the newly completed text (possibly empty)."""
        piece = self._tok.token_bytes(token_id, self._special)
        if self._strip_space and piece:
            self._strip_space = False
            if piece.startswith(b" "):
                piece = piece[1:]
        return self._utf8.decode(piece)

    def flush(self) -> str:
        """End of stream: return whatever is still held (an incomplete sequence becomes U+FFFD)."""
        return self._utf8.decode(b"", final=True)

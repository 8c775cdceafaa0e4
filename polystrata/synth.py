"""Synthetic models: random weights at real shapes, in any tensor format, written as GGUF files that both
PolyStrata and llama.cpp load.

`synth_model(arch, out, preset, qtype, seed, n_layer)` writes one file; `PRESETS[arch][name]`
lists the shapes. Used by `polystrata synth` to make benchmark models without downloading anything, and by
tests for models of every architecture and format.

Conventions (llama.cpp's, so its loader accepts the files):

* Tensor names are llama.cpp's (`token_embd.weight`, `blk.N.attn_q.weight`, ...); shapes are given here in
  numpy order (the reverse of GGUF's `ne`). 1-D tensors (norms, biases) and MoE routers are always F32.
* Tied models (gemma3 and the presets marked `tied_embeddings`) have no `output.weight`.
* Formats whose block is 256 values (K-quants, IQ4_XS) cannot hold rows of other lengths; such tensors fall
  back as llama.cpp's quantizer does: Q2_K / Q3_K / IQ4_XS -> IQ4_NL, Q4_K -> Q5_0, Q5_K -> Q5_1,
  Q6_K -> Q8_0.
* Mixes `Q4_K_M` / `Q4_K_S` approximate llama.cpp's `llama_tensor_get_type` (see `_mix_type`).
* The tokenizer is a synthetic GPT-2 style byte-level BPE vocabulary (see `synth_vocab`).

Weights are N(0, std) with std = 1/sqrt(fan_in) for matrices (so activations keep unit scale and logits
stay finite), norm weights 1 + N(0, 0.1), biases N(0, 0.1); routers are scaled so that expert choice
varies from token to token. Every tensor draws from its own generator seeded by (seed, tensor name), so
the same seed gives a byte-identical file.

Speed: tensors are produced lazily, one at a time, while the file is streamed. Tensors of more than
`EXACT_ELEMENTS` values are not drawn value by value: a pool of random rows (about `POOL_ELEMENTS` values)
is quantized once per (format, row length, scale) and each tensor's rows are picked from that pool at
random. Such tensors have repeated rows, which is harmless for benchmarking but means big presets are not
"fully random"; every tiny preset is.
"""

from __future__ import annotations

import functools
import math
import re
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from polystrata.errors import UnsupportedError
from polystrata.gguf_writer import write_gguf
from polystrata.ir.encode import quantize
from polystrata.ir.formats import by_name
from polystrata.models.hparams import HParams
from polystrata.progress import Progress
from polystrata.tokenizer import gpt2_byte_chars

__all__ = [
    "ARCHES",
    "EXACT_ELEMENTS",
    "MIXES",
    "POOL_ELEMENTS",
    "PRESETS",
    "QTYPES",
    "preset_metadata",
    "synth_model",
    "synth_vocab",
    "tensor_plan",
    "tokenizer_metadata",
]

# Tensors up to this many values get independent random values; larger ones are built from a row pool.
EXACT_ELEMENTS = 1 << 22
# Values per row pool (rounded to whole rows, at least 64 rows).
POOL_ELEMENTS = 1 << 22

ARCHES = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "gemma3", "qwen35", "qwen35moe", "qwen3next")
# Hybrids of Gated DeltaNet and gated full attention (`polystrata/models/qwen35.py`).
HYBRID_ARCHES = ("qwen35", "qwen35moe", "qwen3next")

# Plain tensor formats (format names of polystrata.ir.formats) and llama.cpp-style mixes.
QTYPES = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS",
)  # fmt: skip
MIXES = ("Q4_K_M", "Q4_K_S")

# llama.cpp's llama_ftype for general.file_type (plain K-quants get the nearest mix's id).
_FILE_TYPE = {
    "F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10,
    "Q3_K": 12, "Q4_K": 15, "Q4_K_S": 14, "Q4_K_M": 15, "Q5_K": 17, "Q6_K": 18, "IQ4_NL": 25,
    "IQ4_XS": 30, "BF16": 32,
}  # fmt: skip

# llama.cpp's convert_incompatible_tensor: where a 256-block format cannot hold a row length.
_QK_K = 256
_K_FALLBACK = {"Q2_K": "IQ4_NL", "Q3_K": "IQ4_NL", "IQ4_XS": "IQ4_NL", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def _preset_hparams(
    arch: str, n_vocab: int, n_embd: int, n_layer: int, n_head: int, n_head_kv: int, head_dim: int, n_ff: int,
    n_ctx_train: int = 4096, rope_base: float = 10000.0, rms_eps: float = 1e-6, rope_dims: int | None = None,
    **more: Any,
) -> HParams:
    """A preset's shapes and hyper-parameters: value heads as wide as the key heads, rotary embeddings over
    `rope_dims` dimensions of each head (default: all of them)."""
    return HParams(
        arch=arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim,
        head_dim_v=head_dim, n_ff=n_ff, n_vocab=n_vocab, n_ctx_train=n_ctx_train, rms_eps=rms_eps,
        rope_base=rope_base, rope_dims=head_dim if rope_dims is None else rope_dims, **more,
    )


_P = _preset_hparams
# Qwen3.5 / Qwen3.6 / Qwen3-Next: gated attention of 16 heads of 256 (2 kv heads) with a quarter of each head
# rotated; DeltaNet layers of 16 key heads and 32 value heads of 128, conv kernel 4; one MTP layer.
_HYBRID = dict(rope_dims=64, extra=dict(
    ssm_conv_kernel=4, ssm_state_size=128, ssm_group_count=16, ssm_time_step_rank=32, ssm_inner_size=32 * 128,
    full_attention_interval=4, nextn_predict_layers=1,
))
_HYBRID_TINY = dict(rope_dims=8, extra=dict(
    ssm_conv_kernel=4, ssm_state_size=16, ssm_group_count=2, ssm_time_step_rank=4, ssm_inner_size=4 * 16,
    full_attention_interval=4, nextn_predict_layers=1,
))
# The shared expert as wide as a routed one, as in Qwen3.6 and Qwen3-Next (512 each).
_HYBRID_MOE_TINY = dict(n_expert=8, n_expert_used=2, n_ff_expert=64, n_ff_shared=64, **_HYBRID_TINY)
# One table: (arch, preset name) -> shapes. Benchmark presets use a 49152-token vocabulary (SmolLM2's size)
# whatever the original model's, so tokenizer and embedding sizes are comparable across architectures.
_TABLE: dict[tuple[str, str], HParams] = {
    ("llama", "tiny"): _P("llama", 1024, 128, 2, 4, 2, 32, 256, 2048),
    ("llama", "smollm2-135m"): _P("llama", 49152, 576, 30, 9, 3, 64, 1536, 8192, 100000.0, 1e-5, tied_embeddings=True),
    ("llama", "llama3-8b"): _P("llama", 49152, 4096, 32, 32, 8, 128, 14336, 8192, 500000.0, 1e-5),
    ("qwen2", "tiny"): _P("qwen2", 1024, 128, 2, 4, 2, 32, 256, 2048, 1000000.0),
    ("qwen2", "qwen2.5-0.5b"): _P("qwen2", 49152, 896, 24, 14, 2, 64, 4864, 32768, 1000000.0, tied_embeddings=True),
    ("qwen3", "tiny"): _P("qwen3", 1024, 128, 2, 4, 2, 32, 256, 2048, 1000000.0),
    ("qwen3", "qwen3-0.6b"): _P("qwen3", 49152, 1024, 28, 16, 8, 128, 3072, 40960, 1000000.0, tied_embeddings=True),
    ("qwen2moe", "tiny"): _P(
        "qwen2moe", 1024, 128, 2, 4, 2, 32, 256, 2048, 1000000.0,
        n_expert=8, n_expert_used=2, n_ff_expert=128, n_ff_shared=256,
    ),  # fmt: skip
    ("qwen3moe", "tiny"): _P(
        "qwen3moe", 1024, 128, 2, 4, 2, 32, 256, 2048, 1000000.0, n_expert=8, n_expert_used=2, n_ff_expert=256
    ),
    ("qwen3moe", "qwen3-30b-a3b"): _P(
        "qwen3moe", 49152, 2048, 48, 32, 4, 128, 6144, 40960, 1000000.0,
        n_expert=128, n_expert_used=8, n_ff_expert=768,
    ),  # fmt: skip
    # Six layers with a window of 8: layers 0-4 are sliding-window, layer 5 global (llama.cpp's pattern).
    ("gemma3", "tiny"): _P(
        "gemma3", 1024, 128, 6, 4, 1, 32, 256, 2048, 1000000.0, sliding_window=8, tied_embeddings=True
    ),
    ("gemma3", "gemma3-270m"): _P(
        "gemma3", 49152, 640, 18, 4, 1, 256, 2048, 32768, 1000000.0, sliding_window=512, tied_embeddings=True
    ),
    # Four layers: three DeltaNet, then one full attention.
    ("qwen35", "tiny"): _P("qwen35", 1024, 128, 4, 4, 2, 32, 256, 2048, 10000000.0, **_HYBRID_TINY),
    ("qwen35moe", "tiny"): _P("qwen35moe", 1024, 128, 4, 4, 2, 32, 0, 2048, 10000000.0, **_HYBRID_MOE_TINY),
    ("qwen35moe", "qwen3.6-35b-a3b"): _P(
        "qwen35moe", 49152, 2048, 40, 16, 2, 256, 0, 262144, 10000000.0,
        n_expert=256, n_expert_used=8, n_ff_expert=512, n_ff_shared=512, **_HYBRID,
    ),  # fmt: skip
    ("qwen3next", "tiny"): _P("qwen3next", 1024, 128, 4, 4, 2, 32, 0, 2048, 10000000.0, **_HYBRID_MOE_TINY),
    ("qwen3next", "qwen3-next-80b-a3b"): _P(
        "qwen3next", 49152, 2048, 48, 16, 2, 256, 0, 262144, 10000000.0,
        n_expert=512, n_expert_used=10, n_ff_expert=512, n_ff_shared=512, **_HYBRID,
    ),  # fmt: skip
}
del _P

PRESETS: dict[str, dict[str, HParams]] = {arch: {} for arch in ARCHES}
for (_arch, _name), _preset in _TABLE.items():
    PRESETS[_arch][_name] = _preset


# --- tokenizer -------------------------------------------------------------------------------------------

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_TOKEN_NORMAL, _TOKEN_CONTROL = 1, 3

# The text the first merges are learned from (frequent pairs first, as real BPE training does).
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A model reads the tokens of a prompt and then writes
one token at a time; each new token depends on all the tokens before it. The weights of this model
are random, so what it writes means nothing, but the shapes and the formats are the same as those
of the real thing, which is what a benchmark of the engine needs to measure.
def main(args):
    for i in range(len(args)):
        if args[i] is not None:
            print("value", i, args[i])
    return 0
In the beginning there was the word, and the word was the first of many. Then there were more
words, and the words were put into sentences, and the sentences into paragraphs, and so on, until
there was a whole book of them. 1234567890 + 0987654321 = 2222222211. Hello, world! How are you?
"""

_GPT2_SPLIT = re.compile(r"'(?:[sdmt]|ll|ve|re)| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+")


@functools.cache
def synth_vocab(n_vocab: int) -> tuple[tuple[str, ...], tuple[int, ...], tuple[str, ...]]:
    """A deterministic GPT-2 style byte-level BPE vocabulary of exactly `n_vocab` tokens.

    Returns (tokens, token types, merges). Ids 0..255 are the byte tokens (GPT-2's byte-to-unicode
    characters, in byte order), the last ids are `SPECIAL_TOKENS` (type 3, control), and every other token
    is the result of one merge `"left right"` whose parts have lower ids: first the most frequent pairs of
    a built-in text (real BPE training), then systematic extensions of existing tokens by a letter.
    """
    n_merges = n_vocab - 256 - len(SPECIAL_TOKENS)
    if n_merges < 0:
        raise UnsupportedError(f"a vocabulary needs at least {256 + len(SPECIAL_TOKENS)} tokens, got {n_vocab}")
    b2u = gpt2_byte_chars()
    tokens: list[str] = list(b2u)
    known = set(tokens) | set(SPECIAL_TOKENS)
    merges: list[str] = []

    def add(a: str, b: str) -> bool:
        if a + b in known or len(merges) >= n_merges:
            return False
        merges.append(f"{a} {b}")
        tokens.append(a + b)
        known.add(a + b)
        return True

    # Phase 1: BPE on the corpus, words as byte-level symbol lists, until no pair occurs twice.
    counts: dict[tuple[str, ...], int] = {}
    for w in _GPT2_SPLIT.findall(_CORPUS):
        key = tuple(b2u[c] for c in w.encode("utf-8"))
        counts[key] = counts.get(key, 0) + 1
    words = list(counts.items())
    while len(merges) < n_merges:
        pairs: dict[tuple[str, str], int] = {}
        for syms, c in words:
            for p in zip(syms, syms[1:]):
                pairs[p] = pairs.get(p, 0) + c
        if not pairs:
            break
        # Most frequent first, ties broken by the pair itself so the order never depends on hashing.
        (a, b), best = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        if best < 2 or not add(a, b):
            break
        merged = []
        for syms, c in words:
            out, i = [], 0
            while i < len(syms):
                if i + 1 < len(syms) and syms[i] == a and syms[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(syms[i])
                    i += 1
            merged.append((tuple(out), c))
        words = merged

    # Phase 2: breadth-first extensions by a letter: "Ġ"+letter, then every token so far + letter, ...
    letters = [*"etaoinshrdlcumwfgypbvkjxqz"]
    queue = [b2u[ord(" ")], *letters, *tokens[256:]]
    head = 0
    while len(merges) < n_merges:
        t = queue[head]
        head += 1
        for c in letters:
            if add(t, c):
                queue.append(t + c)
    tokens.extend(SPECIAL_TOKENS)
    types = [_TOKEN_NORMAL] * (len(tokens) - len(SPECIAL_TOKENS)) + [_TOKEN_CONTROL] * len(SPECIAL_TOKENS)
    assert len(tokens) == n_vocab
    return tuple(tokens), tuple(types), tuple(merges)


_CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tokenizer_metadata(n_vocab: int) -> dict[str, Any]:
    """The `tokenizer.*` metadata of the synthetic vocabulary of `n_vocab` tokens (`synth_vocab`), chat template
    included."""
    tokens, types, merges = synth_vocab(n_vocab)
    eot = tokens.index("<|endoftext|>")
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": list(tokens),
        "tokenizer.ggml.token_type": np.asarray(types, dtype=np.int32),
        "tokenizer.ggml.merges": list(merges),
        "tokenizer.ggml.bos_token_id": eot,
        "tokenizer.ggml.eos_token_id": eot,
        "tokenizer.ggml.padding_token_id": eot,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.chat_template": _CHATML,
    }


# --- tensors ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Tensor:
    name: str
    shape: tuple[int, ...]
    kind: str  # "matrix", "embd", "norm", "bias", "router", "conv" (kept in F32), "decay" (-A in [1, 16))
    std: float


def _tensors(p: HParams) -> Iterator[_Tensor]:
    """Every tensor of the model, in file order, with its shape (numpy order) and init scale."""
    n, d = p.n_embd, p.head_dim
    q_out, kv_out = p.n_head * d, p.n_head_kv * d

    def mat(name: str, n_out: int, n_in: int, *lead: int) -> _Tensor:
        return _Tensor(name, (*lead, n_out, n_in), "matrix", 1.0 / math.sqrt(n_in))

    def vec(name: str, size: int, kind: str = "norm") -> _Tensor:
        return _Tensor(name, (size,), kind, 0.1)

    # Tied models read logits off the embeddings: keep rows at ~unit norm x 2 so logits have std ~2.
    yield _Tensor("token_embd.weight", (p.n_vocab, n), "embd", 2.0 / math.sqrt(n))
    if p.arch in HYBRID_ARCHES:
        yield from _hybrid_layers(p, mat, vec)
        yield vec("output_norm.weight", n)
        if not p.tied_embeddings:
            yield _Tensor("output.weight", (p.n_vocab, n), "matrix", 2.0 / math.sqrt(n))
        return
    biased = p.arch in ("qwen2", "qwen2moe")
    qk_norm = p.arch in ("qwen3", "qwen3moe", "gemma3")
    for il in range(p.n_layer):
        b = f"blk.{il}"
        yield vec(f"{b}.attn_norm.weight", n)
        yield mat(f"{b}.attn_q.weight", q_out, n)
        if biased:
            yield vec(f"{b}.attn_q.bias", q_out, "bias")
        yield mat(f"{b}.attn_k.weight", kv_out, n)
        if biased:
            yield vec(f"{b}.attn_k.bias", kv_out, "bias")
        yield mat(f"{b}.attn_v.weight", kv_out, n)
        if biased:
            yield vec(f"{b}.attn_v.bias", kv_out, "bias")
        if qk_norm:
            yield vec(f"{b}.attn_q_norm.weight", d)
            yield vec(f"{b}.attn_k_norm.weight", d)
        yield mat(f"{b}.attn_output.weight", n, q_out)
        if p.arch == "gemma3":
            yield vec(f"{b}.post_attention_norm.weight", n)
        yield vec(f"{b}.ffn_norm.weight", n)
        if p.n_expert:
            e, f = p.n_expert, p.n_ff_expert
            # Router logits of std ~3 across experts: a clear but token-dependent top-k.
            yield _Tensor(f"{b}.ffn_gate_inp.weight", (e, n), "router", 3.0 / math.sqrt(n))
            yield mat(f"{b}.ffn_gate_exps.weight", f, n, e)
            yield mat(f"{b}.ffn_up_exps.weight", f, n, e)
            yield mat(f"{b}.ffn_down_exps.weight", n, f, e)
            if p.n_ff_shared:
                s = p.n_ff_shared
                yield _Tensor(f"{b}.ffn_gate_inp_shexp.weight", (n,), "router", 1.0 / math.sqrt(n))
                yield mat(f"{b}.ffn_gate_shexp.weight", s, n)
                yield mat(f"{b}.ffn_up_shexp.weight", s, n)
                yield mat(f"{b}.ffn_down_shexp.weight", n, s)
        else:
            yield mat(f"{b}.ffn_gate.weight", p.n_ff, n)
            yield mat(f"{b}.ffn_up.weight", p.n_ff, n)
            yield mat(f"{b}.ffn_down.weight", n, p.n_ff)
        if p.arch == "gemma3":
            yield vec(f"{b}.post_ffw_norm.weight", n)
    yield vec("output_norm.weight", n)
    if not p.tied_embeddings:
        yield _Tensor("output.weight", (p.n_vocab, n), "matrix", 2.0 / math.sqrt(n))


# The hybrids' layer matrices at 0.35 of the unit-gain scale: at full scale a random hybrid amplifies small
# differences so much that Q8_0 rounding alone moved its logits by KL 0.02-0.07 (tiny presets, against F32; at
# 0.35, 4e-4 to 8e-4, and llama.cpp's Q8_0 run agrees with the reference within its parity test's bounds).
_HYBRID_GAIN = 0.35


def _hybrid_layers(p: HParams, unit_mat, vec) -> Iterator[_Tensor]:
    """The layers of a Qwen3.5 / Qwen3-Next hybrid, then its multi-token-prediction layers, named and shaped as
    llama.cpp's converter writes them (`polystrata/models/qwen35.py`)."""
    n, d = p.n_embd, p.head_dim

    def mat(name: str, n_out: int, n_in: int, *lead: int) -> _Tensor:
        return replace(unit_mat(name, n_out, n_in, *lead), std=_HYBRID_GAIN / math.sqrt(n_in))

    x = p.extra
    hk, dk, hv, value_dim = x["ssm_group_count"], x["ssm_state_size"], x["ssm_time_step_rank"], x["ssm_inner_size"]
    k_conv, interval, n_nextn = x["ssm_conv_kernel"], x["full_attention_interval"], x["nextn_predict_layers"]
    conv_dim = 2 * hk * dk + value_dim

    def ffn(b: str) -> Iterator[_Tensor]:
        if not p.n_expert:
            yield mat(f"{b}.ffn_gate.weight", p.n_ff, n)
            yield mat(f"{b}.ffn_up.weight", p.n_ff, n)
            yield mat(f"{b}.ffn_down.weight", n, p.n_ff)
            return
        e, f, s = p.n_expert, p.n_ff_expert, p.n_ff_shared
        yield _Tensor(f"{b}.ffn_gate_inp.weight", (e, n), "router", 3.0 / math.sqrt(n))
        yield mat(f"{b}.ffn_gate_exps.weight", f, n, e)
        yield mat(f"{b}.ffn_up_exps.weight", f, n, e)
        yield mat(f"{b}.ffn_down_exps.weight", n, f, e)
        yield _Tensor(f"{b}.ffn_gate_inp_shexp.weight", (n,), "router", 1.0 / math.sqrt(n))
        yield mat(f"{b}.ffn_gate_shexp.weight", s, n)
        yield mat(f"{b}.ffn_up_shexp.weight", s, n)
        yield mat(f"{b}.ffn_down_shexp.weight", n, s)

    def attention(b: str) -> Iterator[_Tensor]:
        yield mat(f"{b}.attn_q.weight", 2 * p.n_head * d, n)  # per head: query, then its output gate
        yield mat(f"{b}.attn_k.weight", p.n_head_kv * d, n)
        yield mat(f"{b}.attn_v.weight", p.n_head_kv * d, n)
        yield vec(f"{b}.attn_q_norm.weight", d)
        yield vec(f"{b}.attn_k_norm.weight", d)
        yield mat(f"{b}.attn_output.weight", n, p.n_head * d)

    for il in range(p.n_layer + n_nextn):
        b = f"blk.{il}"
        yield vec(f"{b}.attn_norm.weight", n)
        if il >= p.n_layer or (il + 1) % interval == 0:
            yield from attention(b)
        else:
            yield mat(f"{b}.attn_qkv.weight", conv_dim, n)
            yield mat(f"{b}.attn_gate.weight", value_dim, n)
            yield _Tensor(f"{b}.ssm_conv1d.weight", (conv_dim, k_conv), "conv", 1.0 / math.sqrt(k_conv))
            yield vec(f"{b}.ssm_dt.bias", hv, "bias")
            # -exp(A_log), A in [1, 16): log decays of -0.7 per token and below.
            yield _Tensor(f"{b}.ssm_a", (hv,), "decay", 1.0)
            if p.arch == "qwen3next":
                yield mat(f"{b}.ssm_ba.weight", 2 * hv, n)
            else:
                yield mat(f"{b}.ssm_beta.weight", hv, n)
                yield mat(f"{b}.ssm_alpha.weight", hv, n)
            yield vec(f"{b}.ssm_norm.weight", value_dim // hv)
            yield mat(f"{b}.ssm_out.weight", n, value_dim)
        yield vec(f"{b}.post_attention_norm.weight", n)
        yield from ffn(b)
        if il >= p.n_layer:
            yield mat(f"{b}.nextn.eh_proj.weight", n, 2 * n)
            yield vec(f"{b}.nextn.enorm.weight", n)
            yield vec(f"{b}.nextn.hnorm.weight", n)
            yield vec(f"{b}.nextn.shared_head_norm.weight", n)


def _use_more_bits(i_layer: int, n_layer: int) -> bool:
    # llama.cpp: the first and last eighth of the layers, and every third layer in between.
    return i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or (i_layer - n_layer // 8) % 3 == 2


def _mix_type(mix: str, t: _Tensor, p: HParams) -> str:
    """The format llama.cpp's quantizer picks for tensor `t` under mix `mix` (before the row-length fallback).

    Approximation of `llama_tensor_get_type` for Q4_K_M / Q4_K_S:
    * the output matrix (`output.weight`, or `token_embd.weight` when tied) -> Q6_K;
    * `attn_v`: Q4_K_M -> Q6_K on "more bits" layers (first and last eighth, every third between);
      Q4_K_S -> Q5_K on the first 4 layers;
    * `ffn_down` (dense, expert and shared): Q4_K_M -> Q6_K on "more bits" layers; Q4_K_S -> Q5_K on the
      first eighth. The layer index is the block number (llama.cpp counts expert tensors slightly
      differently for MoE models);
    * models with exactly 8 experts: `attn_v` and `attn_k` -> Q8_0, `attn_output` -> Q5_K;
    * everything else Q4_K.
    """
    name = t.name
    if name == "output.weight" or (name == "token_embd.weight" and p.tied_embeddings):
        return "Q6_K"
    m = re.match(r"blk\.(\d+)\.", name)
    il = int(m.group(1)) if m else 0
    if p.n_expert == 8 and (".attn_v." in name or ".attn_k." in name):
        return "Q8_0"
    if p.n_expert == 8 and ".attn_output." in name:
        return "Q5_K"
    if ".attn_v." in name:
        if mix == "Q4_K_M" and _use_more_bits(il, p.n_layer):
            return "Q6_K"
        if mix == "Q4_K_S" and il < 4:
            return "Q5_K"
    if ".ffn_down" in name:
        if mix == "Q4_K_M" and _use_more_bits(il, p.n_layer):
            return "Q6_K"
        if mix == "Q4_K_S" and il < p.n_layer // 8:
            return "Q5_K"
    return "Q4_K"


def _tensor_type(qtype: str, t: _Tensor, p: HParams) -> str:
    if len(t.shape) == 1 or t.kind in ("router", "conv"):
        return "F32"  # llama.cpp requires 1-D tensors in F32 and never quantizes routers or conv kernels
    fmt = _mix_type(qtype, t, p) if qtype in MIXES else qtype
    if t.shape[-1] % _QK_K and fmt in _K_FALLBACK:
        fmt = _K_FALLBACK[fmt]
    return fmt


def preset_metadata(arch: str, preset: str = "tiny", qtype: str = "Q8_0", n_layer: int | None = None) -> dict:
    """The metadata `synth_model` would write (tokenizer included), without writing anything."""
    return _metadata(_preset(arch, preset, n_layer), preset, _check_qtype(qtype))


def tensor_plan(arch: str, preset: str = "tiny", qtype: str = "Q8_0", n_layer: int | None = None) -> list:
    """The `(name, shape, format name)` of every tensor `synth_model` would write, without writing anything."""
    p = _preset(arch, preset, n_layer)
    qtype = _check_qtype(qtype)
    return [(t.name, t.shape, _tensor_type(qtype, t, p)) for t in _tensors(p)]


# --- values ----------------------------------------------------------------------------------------------


def _encode(fmt_name: str, x: np.ndarray) -> np.ndarray:
    """float32 rows -> raw bytes (..., row_bytes) in format `fmt_name`."""
    if fmt_name == "F32":
        return np.ascontiguousarray(x, dtype="<f4").view(np.uint8)
    if fmt_name == "F16":
        return np.ascontiguousarray(x.astype("<f2")).view(np.uint8)
    return np.asarray(quantize(by_name(fmt_name), np.ascontiguousarray(x, dtype=np.float32)))


def _rng(seed: int, key: str) -> np.random.Generator:
    # crc32, not hash(): stable across processes, so the same seed gives the same file.
    return np.random.default_rng([seed, zlib.crc32(key.encode())])


def _floats(t: _Tensor, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    if t.kind == "decay":
        return -rng.uniform(1.0, 16.0, shape).astype(np.float32)
    x = rng.standard_normal(shape, dtype=np.float32) * np.float32(t.std)
    if t.kind == "norm":
        x += np.float32(1.0)
    return x


class _Pools:
    """Quantized random rows, shared by big tensors of the same format, row length and scale."""

    def __init__(self, seed: int):
        self.seed = seed
        self.pools: dict[tuple[str, int, float], np.ndarray] = {}

    def get(self, fmt: str, t: _Tensor) -> np.ndarray:
        row = t.shape[-1]
        key = (fmt, row, t.std)
        if key not in self.pools:
            rows = max(64, POOL_ELEMENTS // row)
            rng = _rng(self.seed, f"pool:{fmt}:{row}:{t.std!r}")
            self.pools[key] = _encode(fmt, _floats(t, rng, (rows, row)))
        return self.pools[key]


def _skewed(x: np.ndarray, skew: float, rng: np.random.Generator) -> np.ndarray:
    """Router rows scaled by exp(-skew * r), r in [0, 1] over a random order of the experts: experts with wider
    logits win the top-k more often, so routing concentrates on a popular few (different ones in each layer)."""
    rank = rng.permutation(x.shape[0]) / max(x.shape[0] - 1, 1)
    return x * np.exp(-skew * rank).astype(np.float32)[:, None]


def _make(t: _Tensor, fmt: str, seed: int, pools: _Pools, router_skew: float = 0.0) -> np.ndarray:
    n_el = math.prod(t.shape)
    rng = _rng(seed, t.name)
    if n_el <= EXACT_ELEMENTS:
        x = _floats(t, rng, t.shape)
        if t.kind == "router" and len(t.shape) == 2 and router_skew:
            x = _skewed(x, router_skew, rng)
        data = _encode(fmt, x)
    else:
        pool = pools.get(fmt, t)
        n_rows = n_el // t.shape[-1]
        data = pool[rng.integers(0, len(pool), n_rows)]
    return data.reshape(-1)


# --- driver ----------------------------------------------------------------------------------------------


def _preset(arch: str, preset: str, n_layer: int | None) -> HParams:
    if arch not in PRESETS:
        raise UnsupportedError(f"unknown architecture '{arch}' (supported: {', '.join(ARCHES)})")
    if preset not in PRESETS[arch]:
        raise UnsupportedError(
            f"no preset '{preset}' for {arch} (available: {', '.join(PRESETS[arch])})"
        )
    p = PRESETS[arch][preset]
    if n_layer is not None:
        if n_layer < 1:
            raise UnsupportedError(f"n_layer must be at least 1, got {n_layer}")
        p = replace(p, n_layer=n_layer)
    return p


def _check_qtype(qtype: str) -> str:
    q = qtype.upper()
    if q not in QTYPES and q not in MIXES:
        raise UnsupportedError(f"unknown type '{qtype}' (supported: {', '.join(QTYPES + MIXES)})")
    return q


def _metadata(p: HParams, preset: str, qtype: str) -> dict[str, Any]:
    a = p.arch
    md: dict[str, Any] = {
        "general.architecture": a,
        "general.type": "model",
        "general.name": f"polystrata-synth-{a}-{preset}",
        "general.file_type": _FILE_TYPE[qtype],
        "general.quantization_version": 2,
        f"{a}.vocab_size": p.n_vocab,
        f"{a}.block_count": p.n_layer,
        f"{a}.context_length": p.n_ctx_train,
        f"{a}.embedding_length": p.n_embd,
        f"{a}.feed_forward_length": p.n_ff,
        f"{a}.attention.head_count": p.n_head,
        f"{a}.attention.head_count_kv": p.n_head_kv,
        f"{a}.attention.key_length": p.head_dim,
        f"{a}.attention.value_length": p.head_dim_v,
        f"{a}.attention.layer_norm_rms_epsilon": float(p.rms_eps),
        f"{a}.rope.freq_base": float(p.rope_base),
        f"{a}.rope.dimension_count": p.rope_dims,
    }
    if p.n_expert:
        md[f"{a}.expert_count"] = p.n_expert
        md[f"{a}.expert_used_count"] = p.n_expert_used
        md[f"{a}.expert_feed_forward_length"] = p.n_ff_expert
        if p.n_ff_shared:
            md[f"{a}.expert_shared_feed_forward_length"] = p.n_ff_shared
    if p.sliding_window:
        md[f"{a}.attention.sliding_window"] = p.sliding_window
    if a in HYBRID_ARCHES:
        md.update(_hybrid_metadata(p))
    md.update(tokenizer_metadata(p.n_vocab))
    return md


def _hybrid_metadata(p: HParams) -> dict[str, Any]:
    """The keys llama.cpp's converter writes for a Qwen3.5 / Qwen3-Next hybrid."""
    a = p.arch
    x = p.extra
    n_all = p.n_layer + x["nextn_predict_layers"]
    recurrent = [il < p.n_layer and (il + 1) % x["full_attention_interval"] != 0 for il in range(n_all)]
    md: dict[str, Any] = {
        f"{a}.block_count": n_all,
        f"{a}.rope.dimension_count": p.rope_dims,
        **{f"{a}.ssm.{key}": x[f"ssm_{key}"]
           for key in ("conv_kernel", "state_size", "group_count", "time_step_rank", "inner_size")},
        f"{a}.full_attention_interval": x["full_attention_interval"],
        f"{a}.attention.recurrent_layers": np.asarray(recurrent, dtype=bool),
    }
    if x["nextn_predict_layers"]:
        md[f"{a}.nextn_predict_layers"] = x["nextn_predict_layers"]
    if a != "qwen3next":
        # Interleaved M-RoPE sections (Qwen3.5's [11, 11, 10] for 64 rotated dims), required by llama.cpp.
        pairs = p.rope_dims // 2
        third = (pairs + 2) // 3
        md[f"{a}.rope.dimension_sections"] = [third, third, pairs - 2 * third, 0]
    return md


def synth_model(
    arch: str,
    out: str | Path,
    preset: str = "tiny",
    qtype: str = "Q8_0",
    seed: int = 0,
    n_layer: int | None = None,
    router_skew: float = 0.0,
) -> Path:
    """Write a random-weight `arch` model with the shapes of `PRESETS[arch][preset]` to `out`; returns the path.

    `qtype` is a tensor format name (`QTYPES`) or a llama.cpp-style mix (`MIXES`); see the module docstring
    for which tensors get which format. `n_layer` overrides the preset's layer count (progress: "writing tensors
    k/N", `polystrata.progress`). `router_skew` > 0 makes MoE routing
    concentrate on fewer experts (see `_skewed`; 0 keeps every expert equally likely). The file is written
    atomically and one tensor at a time, so memory stays at about one tensor plus the row pools.
    """
    p = _preset(arch, preset, n_layer)
    qtype = _check_qtype(qtype)
    out = Path(out)
    specs = list(_tensors(p))
    pools = _Pools(seed)

    def lazy(t: _Tensor, fmt: str, bar: Progress) -> Callable[[], np.ndarray]:
        def produce() -> np.ndarray:
            data = _make(t, fmt, seed, pools, router_skew)
            bar.update()
            return data

        return produce

    fmts = [_tensor_type(qtype, t, p) for t in specs]
    with Progress("writing tensors", len(specs)) as bar:
        tensors = [(t.name, t.shape, fmt, lazy(t, fmt, bar)) for t, fmt in zip(specs, fmts)]
        write_gguf(out, _metadata(p, preset, qtype), tensors)
    return out

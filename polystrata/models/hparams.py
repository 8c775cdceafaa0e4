"""Hyper-parameters of a model, read from GGUF metadata under the architecture's key prefix."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from polystrata.errors import GGUFError
from polystrata.gguf import typed_value


@dataclass
class HParams:
    """What a model builder needs to know, with llama.cpp's defaults where the metadata is silent; also the shapes
    of `polystrata synth`'s presets, which it writes as metadata."""

    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    head_dim_v: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    rms_eps: float
    rope_base: float
    rope_dims: int
    rope_freq_scale: float = 1.0
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_expert: int = 0
    n_ff_shared: int = 0
    expert_weights_norm: bool = False
    sliding_window: int = 0
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    tied_embeddings: bool = False  # the output projection is token_embd (the file has no output.weight)
    extra: dict[str, Any] = field(default_factory=dict)


class MetadataView:
    """Typed access to `<arch>.<key>` metadata with clear errors for missing or ill-typed values."""

    def __init__(self, metadata: dict[str, Any], arch: str):
        self.md = metadata
        self.arch = arch

    def get(self, key: str, default: Any = None, *, kind: type = int, required: bool = False) -> Any:
        full = f"{self.arch}.{key}"
        if full not in self.md:
            if required:
                raise GGUFError(f"metadata key '{full}' is missing; the file is not a complete {self.arch} model")
            return default
        v = self.md[full]
        if isinstance(v, np.ndarray) and v.ndim == 1 and v.size and v.dtype.kind in "biuf":
            # Per-layer arrays (e.g. head counts): PolyStrata supports uniform layers only.
            vals = {typed_value(full, x.item(), kind) for x in v}
            if len(vals) != 1:
                raise GGUFError(f"metadata '{full}' varies per layer, which is not supported")
            return vals.pop()
        return typed_value(full, v, kind)


def read_hparams(metadata: dict[str, Any], arch: str, n_vocab: int) -> HParams:
    """Read the common hyper-parameters; builders add their own from `MetadataView`."""
    m = MetadataView(metadata, arch)
    n_embd = m.get("embedding_length", required=True)
    n_head = m.get("attention.head_count", required=True)
    n_head_kv = m.get("attention.head_count_kv", n_head)
    head_dim = m.get("attention.key_length", n_embd // n_head if n_head else 0)
    if n_head <= 0 or n_head_kv <= 0 or head_dim <= 0 or n_head % n_head_kv:
        raise GGUFError(f"{arch}: inconsistent head counts ({n_head} heads, {n_head_kv} kv heads)")
    scaling = metadata.get(f"{arch}.rope.scaling.type", "none")
    factor = m.get("rope.scaling.factor", 1.0, kind=float)
    hp = HParams(
        arch=arch,
        n_layer=m.get("block_count", required=True),
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        head_dim_v=m.get("attention.value_length", head_dim),
        n_ff=m.get("feed_forward_length", 0),
        n_vocab=n_vocab,
        n_ctx_train=m.get("context_length", 4096),
        rms_eps=m.get("attention.layer_norm_rms_epsilon", 1e-6, kind=float),
        rope_base=m.get("rope.freq_base", 10000.0, kind=float),
        rope_dims=m.get("rope.dimension_count", head_dim),
        rope_freq_scale=1.0 / factor if scaling == "linear" and factor > 0 else 1.0,
        n_expert=m.get("expert_count", 0),
        n_expert_used=m.get("expert_used_count", 0),
        n_ff_expert=m.get("expert_feed_forward_length", 0),
        n_ff_shared=m.get("expert_shared_feed_forward_length", 0),
        sliding_window=m.get("attention.sliding_window", 0),
        attn_softcap=m.get("attn_logit_softcapping", 0.0, kind=float),
        final_softcap=m.get("final_logit_softcapping", 0.0, kind=float),
    )
    check_hparams(hp)
    return hp


# Sizes and counts are int32 in every target's kernels.
_MAX_DIM = 2**31 - 1


def check_hparams(hp: HParams) -> None:
    """Refuse hyper-parameters that no target can run, with a GGUFError naming the metadata at fault."""
    a = hp.arch
    at_least_one = {
        "block_count": hp.n_layer, "embedding_length": hp.n_embd, "context_length": hp.n_ctx_train,
        "attention.value_length": hp.head_dim_v,
    }
    for key, value in at_least_one.items():
        if not 1 <= value <= _MAX_DIM:
            raise GGUFError(f"metadata '{a}.{key}' is {value}, expected at least 1")
    non_negative = {
        "feed_forward_length": hp.n_ff, "expert_count": hp.n_expert, "expert_used_count": hp.n_expert_used,
        "expert_feed_forward_length": hp.n_ff_expert, "expert_shared_feed_forward_length": hp.n_ff_shared,
        "attention.sliding_window": hp.sliding_window, "attention.layer_norm_rms_epsilon": hp.rms_eps,
        "attn_logit_softcapping": hp.attn_softcap, "final_logit_softcapping": hp.final_softcap,
    }
    for key, value in non_negative.items():
        if not 0 <= value <= _MAX_DIM:
            raise GGUFError(f"metadata '{a}.{key}' is {value}, expected a non-negative value")
    if hp.n_head > _MAX_DIM or hp.head_dim > _MAX_DIM or hp.n_head * hp.head_dim > _MAX_DIM:
        raise GGUFError(f"{a}: attention of {hp.n_head} heads of {hp.head_dim} is too large")
    # Rotary embeddings turn pairs of a head's dimensions: at most the whole head, an even count.
    if not 0 < hp.rope_dims <= hp.head_dim or hp.rope_dims % 2:
        raise GGUFError(
            f"metadata '{a}.rope.dimension_count' is {hp.rope_dims}, expected an even number "
            f"from 2 to the head size {hp.head_dim}"
        )
    if hp.rope_base <= 0:
        raise GGUFError(f"metadata '{a}.rope.freq_base' is {hp.rope_base}, expected a positive number")

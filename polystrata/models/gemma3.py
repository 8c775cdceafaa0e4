"""Gemma 3: interleaved sliding-window and global attention layers with their own RoPE bases, q/k norms,
norms before and after both attention and FFN, GELU-tanh gating, embeddings scaled by sqrt(n_embd)."""

from __future__ import annotations

import math

from polystrata.ir.graph import Graph
from polystrata.models.builder import Builder
from polystrata.models.hparams import MetadataView

# Fixed by the architecture (llama.cpp uses the same): local layers use RoPE base 10000 without scaling,
# and every `pattern`-th layer is global.
LOCAL_ROPE_BASE = 10000.0
DEFAULT_SWA_PATTERN = 6


def build(b: Builder, metadata: dict) -> Graph:
    """Build a gemma3 forward step."""
    hp = b.hp
    pattern = MetadataView(metadata, hp.arch).get("attention.sliding_window_pattern", DEFAULT_SWA_PATTERN)
    # The 27B model scales queries by 1/sqrt(n_embd / n_head) instead of 1/sqrt(head_dim).
    d_scale = hp.n_embd // hp.n_head if hp.n_layer == 62 else hp.head_dim
    x = b.embed(scale=math.sqrt(hp.n_embd))
    for il in range(hp.n_layer):
        p = f"blk.{il}"
        local = pattern > 0 and hp.sliding_window > 0 and il % pattern < pattern - 1
        h = b.norm(x, f"{p}.attn_norm.weight")
        a = b.attention(
            h,
            il,
            rope_mode="neox",
            qk_norm=True,
            rope_base=LOCAL_ROPE_BASE if local else hp.rope_base,
            freq_scale=1.0 if local else hp.rope_freq_scale,
            window=hp.sliding_window if local else 0,
            scale=1.0 / math.sqrt(d_scale),
        )
        a = b.norm(a, f"{p}.post_attention_norm.weight")
        x = b.op("add", x, a, name=f"{p}.attn_residual")
        h = b.norm(x, f"{p}.ffn_norm.weight")
        f = b.norm(b.ffn(h, p, hp.n_ff, act="geglu"), f"{p}.post_ffw_norm.weight")
        x = b.op("add", x, f, name=f"{p}.ffn_residual")
    return b.head(x)

"""Llama-family decoders: llama (SmolLM2, Llama 3), qwen2 (q/k/v biases), qwen3 (q/k norms).

One pre-norm residual block per layer: x += attn(norm(x)); x += ffn(norm(x)).
"""

from __future__ import annotations

from polystrata.ir.graph import Graph
from polystrata.models.builder import Builder

# llama.cpp rotates adjacent pairs for llama and halves ("neox") for the Qwen family.
ROPE_MODE = {"llama": "normal", "qwen2": "neox", "qwen3": "neox"}


def build(b: Builder) -> Graph:
    """Build a llama, qwen2 or qwen3 forward step."""
    hp = b.hp
    x = b.embed()
    for il in range(hp.n_layer):
        p = f"blk.{il}"
        h = b.norm(x, f"{p}.attn_norm.weight")
        a = b.attention(h, il, rope_mode=ROPE_MODE[hp.arch], qk_norm=hp.arch == "qwen3", bias=hp.arch == "qwen2")
        x = b.op("add", x, a, name=f"{p}.attn_residual")
        h = b.norm(x, f"{p}.ffn_norm.weight")
        x = b.op("add", x, b.ffn(h, p, hp.n_ff), name=f"{p}.ffn_residual")
    return b.head(x)

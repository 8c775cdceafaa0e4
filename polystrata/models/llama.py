"""Llama-family decoders: llama (SmolLM2, Llama 3), qwen2 (q/k/v biases), qwen3 (q/k norms), and the same
block with routed experts in place of the dense FFN (qwen2moe, qwen3moe: see `qwen_moe.py`).

One pre-norm residual block per layer: x += attn(norm(x)); x += ffn(norm(x)).
"""

from __future__ import annotations

from collections.abc import Callable

from polystrata.ir.graph import Graph, Value
from polystrata.models.builder import Builder

# llama.cpp rotates adjacent pairs for llama and halves ("neox") for the Qwen family.
NORMAL_ROPE = {"llama"}
QK_NORM = {"qwen3", "qwen3moe"}
QKV_BIAS = {"qwen2", "qwen2moe"}


def dense_ffn(b: Builder, h: Value, il: int) -> Value:
    """The gated SiLU feed-forward of layer `il`."""
    return b.ffn(h, f"blk.{il}", b.hp.n_ff)


def build(b: Builder, ffn: Callable[[Builder, Value, int], Value] = dense_ffn) -> Graph:
    """Build a llama-family forward step; `ffn` makes each layer's feed-forward from its normed input."""
    hp = b.hp
    x = b.embed()
    for il in range(hp.n_layer):
        p = f"blk.{il}"
        h = b.norm(x, f"{p}.attn_norm.weight")
        rope = "normal" if hp.arch in NORMAL_ROPE else "neox"
        a = b.attention(h, il, rope_mode=rope, qk_norm=hp.arch in QK_NORM, bias=hp.arch in QKV_BIAS)
        x = b.op("add", x, a, name=f"{p}.attn_residual")
        h = b.norm(x, f"{p}.ffn_norm.weight")
        x = b.op("add", x, ffn(b, h, il), name=f"{p}.ffn_residual")
    return b.head(x)

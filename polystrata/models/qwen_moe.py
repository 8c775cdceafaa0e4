"""Mixture-of-experts Qwen decoders: the llama-family block with routed experts as its FFN. qwen3moe
renormalises the top-k weights; qwen2moe adds a shared expert scaled by a sigmoid gate."""

from __future__ import annotations

from polystrata.ir.graph import Graph, Value
from polystrata.models import llama
from polystrata.models.builder import Builder


def moe_ffn(b: Builder, h: Value, il: int) -> Value:
    """Routed experts of layer `il`, plus the gated shared expert where the file has one."""
    hp = b.hp
    p = f"blk.{il}"
    f = b.moe(h, il)
    if b.has(f"{p}.ffn_gate_inp_shexp.weight"):
        s = b.ffn(h, p, hp.n_ff_shared, suffix="_shexp")
        gate_w = b.w(f"{p}.ffn_gate_inp_shexp.weight", (hp.n_embd,), view=(1, hp.n_embd))
        gate = b.op("matmul", h, gate_w, name=f"{p}.shexp_gate")
        f = b.op("add", f, b.op("sigmoid_mul", s, gate, name=f"{p}.shexp_gated"), name=f"{p}.ffn_out")
    return f


def build(b: Builder) -> Graph:
    """Build a qwen3moe or qwen2moe forward step."""
    return llama.build(b, ffn=moe_ffn)

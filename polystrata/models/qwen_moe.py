"""Mixture-of-experts Qwen decoders: qwen3moe (q/k norms, renormalised top-k) and qwen2moe (q/k/v biases,
a shared expert scaled by a sigmoid gate)."""

from __future__ import annotations

from polystrata.ir.graph import Graph
from polystrata.models.builder import Builder


def build(b: Builder) -> Graph:
    """Build a qwen3moe or qwen2moe forward step."""
    hp = b.hp
    x = b.embed()
    for il in range(hp.n_layer):
        p = f"blk.{il}"
        h = b.norm(x, f"{p}.attn_norm.weight")
        a = b.attention(h, il, rope_mode="neox", qk_norm=hp.arch == "qwen3moe", bias=hp.arch == "qwen2moe")
        x = b.op("add", x, a, name=f"{p}.attn_residual")
        h = b.norm(x, f"{p}.ffn_norm.weight")
        f = b.moe(h, il)
        if b.has(f"{p}.ffn_gate_inp_shexp.weight"):
            s = b.ffn(h, p, hp.n_ff_shared, suffix="_shexp")
            gate_w = b.w(f"{p}.ffn_gate_inp_shexp.weight", (hp.n_embd,))
            gate_w = b.op("reshape", gate_w, shape=(1, hp.n_embd), name=f"{p}.shexp_gate_w")
            gate = b.op("matmul", h, gate_w, name=f"{p}.shexp_gate")
            f = b.op("add", f, b.op("sigmoid_mul", s, gate, name=f"{p}.shexp_gated"), name=f"{p}.ffn_out")
        x = b.op("add", x, f, name=f"{p}.ffn_residual")
    return b.head(x)

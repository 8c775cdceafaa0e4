"""Pieces shared by the model builders: weight lookup with shape checks, attention and FFN blocks."""

from __future__ import annotations

import math
from typing import Any

from polystrata.errors import GGUFError
from polystrata.ir.graph import Graph, Value
from polystrata.models.hparams import HParams


def _squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
    # llama.cpp accepts a tensor whose extra outer dims are 1: converters write a [1, n] gate as it came.
    shape = tuple(shape)
    while len(shape) > 1 and shape[0] == 1:
        shape = shape[1:]
    return shape


class Builder:
    """Builds one forward step of a transformer into a `Graph`, from GGUF tensor names and hyper-parameters.

    `tensors` maps a GGUF tensor name to `(shape, format name)` with the shape in numpy order. `all_logits`: the
    logits of every row of the step; else those of its last `last_rows` rows.
    """

    def __init__(self, hp: HParams, tensors: dict[str, tuple[tuple[int, ...], str]], all_logits: bool,
                 last_rows: int = 1):
        self.hp = hp
        self.tensors = tensors
        self.all_logits = all_logits
        self.last_rows = last_rows
        self.g = Graph(arch=hp.arch)
        self.tokens = self.g.input("tokens", "i32", ("T",))
        self.positions = self.g.input("positions", "i32", ("T",))

    def has(self, name: str) -> bool:
        """Whether the file has tensor `name`."""
        return name in self.tensors

    def w(self, name: str, shape: tuple[int, ...], view: tuple[int, ...] | None = None) -> Value:
        """The weight `name`, checked against the shape the architecture implies; `view` declares it in the
        graph with another shape of the same size (a vector used as a one-row matrix)."""
        if name not in self.tensors:
            raise GGUFError(f"tensor '{name}' is missing; the file is not a complete {self.hp.arch} model")
        got, fmt = self.tensors[name]
        if _squeezed(got) != _squeezed(shape):
            raise GGUFError(f"tensor '{name}' has shape {tuple(got)}, expected {tuple(shape)} for {self.hp.arch}")
        return self.g.weight(name, fmt, view or shape)

    def opt_w(self, name: str, shape: tuple[int, ...]) -> Value | None:
        """The weight `name` if the file has it (biases, norms some variants lack)."""
        return self.w(name, shape) if self.has(name) else None

    def op(self, op: str, *inputs: Value, **attrs: Any) -> Value:
        return self.g.op(op, *inputs, **attrs)

    # --- blocks -------------------------------------------------------------------------------------------

    def embed(self, scale: float = 1.0) -> Value:
        """Token embeddings, optionally scaled (gemma multiplies by sqrt(n_embd))."""
        hp = self.hp
        x = self.op("embed", self.w("token_embd.weight", (hp.n_vocab, hp.n_embd)), self.tokens, name="embd")
        return self.op("scale", x, factor=scale, name="embd_scaled") if scale != 1.0 else x

    def norm(self, x: Value, name: str) -> Value:
        return self.op("rms_norm", x, self.w(name, (self.hp.n_embd,)), eps=self.hp.rms_eps, name=name)

    def linear(self, x: Value, name: str, n_out: int, n_in: int, bias: bool = False) -> Value:
        y = self.op("matmul", x, self.w(f"{name}.weight", (n_out, n_in)), name=name)
        b = self.opt_w(f"{name}.bias", (n_out,)) if bias else None
        return self.op("add", y, b, name=f"{name}.bias") if b is not None else y

    def attention(
        self,
        x: Value,
        il: int,
        *,
        rope_mode: str,
        qk_norm: bool = False,
        bias: bool = False,
        rope_base: float | None = None,
        freq_scale: float | None = None,
        window: int = 0,
        scale: float | None = None,
    ) -> Value:
        """Self-attention of layer `il` on normed input x; returns the output projection (before residual)."""
        hp = self.hp
        p = f"blk.{il}"
        hq, hkv, d, dv = hp.n_head, hp.n_head_kv, hp.head_dim, hp.head_dim_v
        q = self.linear(x, f"{p}.attn_q", hq * d, hp.n_embd, bias)
        k = self.linear(x, f"{p}.attn_k", hkv * d, hp.n_embd, bias)
        v = self.linear(x, f"{p}.attn_v", hkv * dv, hp.n_embd, bias)
        q = self.op("reshape", q, shape=("T", hq, d), name=f"{p}.q_heads")
        k = self.op("reshape", k, shape=("T", hkv, d), name=f"{p}.k_heads")
        v = self.op("reshape", v, shape=("T", hkv, dv), name=f"{p}.v_heads")
        if qk_norm:
            q = self.op("rms_norm", q, self.w(f"{p}.attn_q_norm.weight", (d,)), eps=hp.rms_eps, name=f"{p}.q_norm")
            k = self.op("rms_norm", k, self.w(f"{p}.attn_k_norm.weight", (d,)), eps=hp.rms_eps, name=f"{p}.k_norm")
        rope = dict(
            base=rope_base if rope_base is not None else hp.rope_base,
            dims=hp.rope_dims,
            mode=rope_mode,
            freq_scale=freq_scale if freq_scale is not None else hp.rope_freq_scale,
        )
        q = self.op("rope", q, self.positions, name=f"{p}.q_rope", **rope)
        k = self.op("rope", k, self.positions, name=f"{p}.k_rope", **rope)
        a = self.op(
            "attention",
            q,
            k,
            v,
            self.positions,
            layer=il,
            scale=scale if scale is not None else 1.0 / math.sqrt(d),
            window=window,
            softcap=hp.attn_softcap,
            name=f"{p}.attn",
        )
        a = self.op("reshape", a, shape=("T", hq * dv), name=f"{p}.attn_flat")
        return self.linear(a, f"{p}.attn_output", hp.n_embd, hq * dv)

    def ffn(self, x: Value, prefix: str, n_ff: int, act: str = "swiglu", suffix: str = "") -> Value:
        """Gated feed-forward: down(act(gate x) * up x)."""
        n = self.hp.n_embd
        g = self.linear(x, f"{prefix}.ffn_gate{suffix}", n_ff, n)
        u = self.linear(x, f"{prefix}.ffn_up{suffix}", n_ff, n)
        return self.linear(self.op(act, g, u, name=f"{prefix}.ffn_act{suffix}"), f"{prefix}.ffn_down{suffix}", n, n_ff)

    def moe(self, x: Value, il: int) -> Value:
        """Routed experts: router softmax -> top-k (renormalised when the model says so) -> expert FFNs."""
        hp = self.hp
        p = f"blk.{il}"
        n, e, f = hp.n_embd, hp.n_expert, hp.n_ff_expert
        logits = self.op("matmul", x, self.w(f"{p}.ffn_gate_inp.weight", (e, n)), name=f"{p}.router_logits")
        route = self.op("router", logits, k=hp.n_expert_used, norm=hp.expert_weights_norm, name=f"{p}.route")
        return self.op(
            "moe_ffn",
            x,
            route,
            self.w(f"{p}.ffn_gate_exps.weight", (e, f, n)),
            self.w(f"{p}.ffn_up_exps.weight", (e, f, n)),
            self.w(f"{p}.ffn_down_exps.weight", (e, n, f)),
            name=f"{p}.moe",
        )

    def head(self, x: Value) -> Graph:
        """Final norm and output projection (tied to the embeddings when the file has no output.weight)."""
        hp = self.hp
        if not self.all_logits:
            x = self.op("last_rows", x, n=self.last_rows, name="last")
        x = self.norm(x, "output_norm.weight")
        out = "output.weight" if self.has("output.weight") else "token_embd.weight"
        logits = self.op("matmul", x, self.w(out, (hp.n_vocab, hp.n_embd)), name="logits")
        if hp.final_softcap:
            raise GGUFError("final logit soft-capping is not supported yet")
        self.g.outputs.append(logits)
        self.g.verify()
        return self.g

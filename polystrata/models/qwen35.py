"""Qwen3.5 / Qwen3.6 (`qwen35` dense, `qwen35moe`) and Qwen3-Next (`qwen3next`): hybrid decoders whose layers are
mostly Gated DeltaNet (linear attention over a recurrent state) with every `full_attention_interval`-th layer gated
full attention, as llama.cpp's `src/models/qwen35*.cpp` and `qwen3next.cpp` build them from the GGUF files its
`convert_hf_to_gguf.py` writes.

Per layer: x += mixer(norm(x)); x += ffn(post_attention_norm(x)), the FFN dense (qwen35) or routed experts plus a
sigmoid-gated shared expert (qwen35moe, qwen3next).

* DeltaNet layer: qkv = conv(attn_qkv x) with SiLU (a causal depthwise conv of kernel `ssm.conv_kernel` over a
  rolling state), q and k L2-normalized per head, the gated delta rule with decay a * softplus(alpha + dt_bias) and
  rate sigmoid(beta), then rms_norm(out) * silu(attn_gate x) per head and ssm_out. `ssm.group_count` key heads of
  `ssm.state_size`, `ssm.time_step_rank` value heads (`ssm.inner_size` / heads each). The converter stores the value
  heads of qwen35/qwen35moe tiled over the key heads (value head h reads key head h % Hk), those of qwen3next grouped
  (h // (Hv / Hk)), where qwen3next also fuses beta and alpha into `ssm_ba`, per key head [beta | alpha].
* Full-attention layer: attn_q gives per head [query | gate]; q/k RMS norms, NeoX RoPE on the first
  `rope.dimension_count` dims (Qwen3.5's interleaved M-RoPE is this for text: every section has the same position),
  attention, out * sigmoid(gate), attn_output.
* The file's `block_count` includes `nextn_predict_layers` multi-token-prediction layers after the decoder; they are
  read (their tensors listed by `info`) and not used.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from polystrata.errors import GGUFError
from polystrata.ir.graph import Graph, Value
from polystrata.models import qwen_moe
from polystrata.models.builder import Builder
from polystrata.models.hparams import HParams, MetadataView

ARCHES = ("qwen35", "qwen35moe", "qwen3next")
MOE_ARCHES = ("qwen35moe", "qwen3next")
# The delta rule's prefill form runs chunks of this many tokens (the reference implementation's chunk size).
DELTA_CHUNK = 64
# llama.cpp's default when the file has neither `attention.recurrent_layers` nor `full_attention_interval`.
DEFAULT_FULL_ATTENTION_INTERVAL = 4


def read_hybrid(metadata: dict[str, Any], hp: HParams) -> None:
    """Add the DeltaNet hyper-parameters and the layer kinds to `hp.extra`, and count only the decoder's layers in
    `hp.n_layer` (the file's `block_count` includes the multi-token-prediction layers)."""
    a = hp.arch
    m = MetadataView(metadata, a)
    n_nextn = m.get("nextn_predict_layers", 0)
    if not 0 <= n_nextn < hp.n_layer:
        raise GGUFError(f"metadata '{a}.nextn_predict_layers' is {n_nextn}, expected fewer than the "
                        f"{hp.n_layer} blocks")
    n_layer = hp.n_layer - n_nextn
    ssm = {key: m.get(f"ssm.{key}", required=True) for key in
           ("conv_kernel", "state_size", "group_count", "time_step_rank", "inner_size")}
    for key, value in ssm.items():
        if not 1 <= value <= 2**31 - 1:
            raise GGUFError(f"metadata '{a}.ssm.{key}' is {value}, expected at least 1")
    if ssm["time_step_rank"] % ssm["group_count"] or ssm["inner_size"] % ssm["time_step_rank"]:
        raise GGUFError(f"{a}: {ssm['inner_size']} values in {ssm['time_step_rank']} value heads over "
                        f"{ssm['group_count']} key heads do not divide evenly (ssm.inner_size, ssm.time_step_rank, "
                        "ssm.group_count)")
    flags = metadata.get(f"{a}.attention.recurrent_layers")
    if flags is not None:
        flags = np.asarray(flags).reshape(-1)
        if flags.dtype.kind not in "biu" or len(flags) < n_layer:
            raise GGUFError(f"metadata '{a}.attention.recurrent_layers' is not {n_layer} or more flags")
        recurrent = tuple(bool(f) for f in flags[:n_layer])
    else:
        interval = m.get("full_attention_interval", DEFAULT_FULL_ATTENTION_INTERVAL)
        if interval < 1:
            raise GGUFError(f"metadata '{a}.full_attention_interval' is {interval}, expected at least 1")
        recurrent = tuple((i + 1) % interval != 0 for i in range(n_layer))
    hp.n_layer = n_layer
    hp.extra.update(
        ssm_conv_kernel=ssm["conv_kernel"], ssm_state_size=ssm["state_size"], ssm_group_count=ssm["group_count"],
        ssm_time_step_rank=ssm["time_step_rank"], ssm_inner_size=ssm["inner_size"],
        full_attention_layers=tuple(i for i, r in enumerate(recurrent) if not r),
        nextn_predict_layers=n_nextn,
    )


def describe(hp: HParams) -> list[str]:
    """Lines for `info`: the hybrid layout and what is not used."""
    x = hp.extra
    full = x["full_attention_layers"]
    lines = [
        f"  layers: {hp.n_layer - len(full)} Gated DeltaNet, {len(full)} gated full attention "
        f"({', '.join(map(str, full)) or 'none'})",
        f"  delta rule: {x['ssm_group_count']} key heads of {x['ssm_state_size']}, {x['ssm_time_step_rank']} "
        f"value heads of {x['ssm_inner_size'] // x['ssm_time_step_rank']}, conv kernel {x['ssm_conv_kernel']}",
    ]
    n = x["nextn_predict_layers"]
    if n:
        blocks = ", ".join(f"blk.{hp.n_layer + i}" for i in range(n))
        lines.append(f"  multi-token prediction: {n} layer ({blocks}), read and not used")
    return lines


def _delta_net(b: Builder, h: Value, il: int) -> Value:
    """The Gated DeltaNet mixer of layer `il` on normed input h; returns its output projection."""
    hp, x = b.hp, b.hp.extra
    p = f"blk.{il}"
    n = hp.n_embd
    hk, dk, hv = x["ssm_group_count"], x["ssm_state_size"], x["ssm_time_step_rank"]
    dv = x["ssm_inner_size"] // hv
    key_dim, value_dim = hk * dk, hv * dv
    conv_dim = 2 * key_dim + value_dim
    qkv = b.linear(h, f"{p}.attn_qkv", conv_dim, n)
    z = b.linear(h, f"{p}.attn_gate", value_dim, n)
    if hp.arch == "qwen3next":
        r = hv // hk
        ba = b.linear(h, f"{p}.ssm_ba", 2 * hv, n)
        ba = b.op("reshape", ba, shape=("T", hk, 2 * r), name=f"{p}.ba_heads")
        beta = b.op("slice", ba, start=0, stop=r, name=f"{p}.beta_groups")
        beta = b.op("reshape", beta, shape=("T", hv), name=f"{p}.beta")
        alpha = b.op("slice", ba, start=r, stop=2 * r, name=f"{p}.alpha_groups")
        alpha = b.op("reshape", alpha, shape=("T", hv), name=f"{p}.alpha")
    else:
        beta = b.linear(h, f"{p}.ssm_beta", hv, n)
        alpha = b.linear(h, f"{p}.ssm_alpha", hv, n)
    gates = b.op("gdn_gates", alpha, beta, b.w(f"{p}.ssm_dt.bias", (hv,)), b.w(f"{p}.ssm_a", (hv,)),
                 name=f"{p}.gates")
    conv = b.op("ssm_conv", qkv, b.w(f"{p}.ssm_conv1d.weight", (conv_dim, x["ssm_conv_kernel"])), layer=il,
                name=f"{p}.conv")
    heads = []
    for what, start, stop, nh, d in (("q", 0, key_dim, hk, dk), ("k", key_dim, 2 * key_dim, hk, dk),
                                     ("v", 2 * key_dim, conv_dim, hv, dv)):
        t = b.op("slice", conv, start=start, stop=stop, name=f"{p}.{what}_conv")
        t = b.op("reshape", t, shape=("T", nh, d), name=f"{p}.{what}_heads")
        if what != "v":
            t = b.op("l2_norm", t, eps=hp.rms_eps, name=f"{p}.{what}_l2")
        heads.append(t)
    out = b.op("delta_rule", *heads, gates, layer=il, scale=1.0 / math.sqrt(dk),
               head_map="grouped" if hp.arch == "qwen3next" else "tiled", chunk=DELTA_CHUNK, name=f"{p}.delta")
    z = b.op("reshape", z, shape=("T", hv, dv), name=f"{p}.z_heads")
    out = b.op("rms_norm_gated", out, b.w(f"{p}.ssm_norm.weight", (dv,)), z, eps=hp.rms_eps, name=f"{p}.ssm_norm")
    out = b.op("reshape", out, shape=("T", value_dim), name=f"{p}.delta_flat")
    return b.linear(out, f"{p}.ssm_out", n, value_dim)


def _gated_attention(b: Builder, h: Value, il: int) -> Value:
    """The gated full attention of layer `il` on normed input h; returns its output projection."""
    hp = b.hp
    p = f"blk.{il}"
    hq, hkv, d = hp.n_head, hp.n_head_kv, hp.head_dim
    if hp.head_dim_v != d:
        raise GGUFError(f"{hp.arch}: keys of {d} and values of {hp.head_dim_v} per head are not supported")
    # The three projections of h one after another: one stacked launch on the GPU path (`matmul_stack3`).
    qg = b.linear(h, f"{p}.attn_q", 2 * hq * d, hp.n_embd)
    k = b.linear(h, f"{p}.attn_k", hkv * d, hp.n_embd)
    v = b.linear(h, f"{p}.attn_v", hkv * d, hp.n_embd)
    qg = b.op("reshape", qg, shape=("T", hq, 2 * d), name=f"{p}.qg_heads")
    q = b.op("slice", qg, start=0, stop=d, name=f"{p}.q_heads")
    gate = b.op("slice", qg, start=d, stop=2 * d, name=f"{p}.gate_heads")
    gate = b.op("reshape", gate, shape=("T", hq * d), name=f"{p}.gate")
    k = b.op("reshape", k, shape=("T", hkv, d), name=f"{p}.k_heads")
    v = b.op("reshape", v, shape=("T", hkv, d), name=f"{p}.v_heads")
    q = b.op("rms_norm", q, b.w(f"{p}.attn_q_norm.weight", (d,)), eps=hp.rms_eps, name=f"{p}.q_norm")
    k = b.op("rms_norm", k, b.w(f"{p}.attn_k_norm.weight", (d,)), eps=hp.rms_eps, name=f"{p}.k_norm")
    rope = dict(base=hp.rope_base, dims=hp.rope_dims, mode="neox", freq_scale=hp.rope_freq_scale)
    q = b.op("rope", q, b.positions, name=f"{p}.q_rope", **rope)
    k = b.op("rope", k, b.positions, name=f"{p}.k_rope", **rope)
    a = b.op("attention", q, k, v, b.positions, layer=il, scale=1.0 / math.sqrt(d), window=0,
             softcap=hp.attn_softcap, name=f"{p}.attn")
    a = b.op("reshape", a, shape=("T", hq * d), name=f"{p}.attn_flat")
    a = b.op("sigmoid_mul", a, gate, name=f"{p}.attn_gated")
    return b.linear(a, f"{p}.attn_output", hp.n_embd, hq * d)


def build(b: Builder) -> Graph:
    """Build a qwen35, qwen35moe or qwen3next forward step."""
    hp = b.hp
    full = set(hp.extra["full_attention_layers"])
    x = b.embed()
    for il in range(hp.n_layer):
        p = f"blk.{il}"
        h = b.norm(x, f"{p}.attn_norm.weight")
        mixed = _gated_attention(b, h, il) if il in full else _delta_net(b, h, il)
        x = b.op("add", x, mixed, name=f"{p}.attn_residual")
        h = b.norm(x, f"{p}.post_attention_norm.weight")
        f = qwen_moe.moe_ffn(b, h, il) if hp.arch in MOE_ARCHES else b.ffn(h, p, hp.n_ff)
        x = b.op("add", x, f, name=f"{p}.ffn_residual")
    return b.head(x)

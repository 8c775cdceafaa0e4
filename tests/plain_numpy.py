"""A plain numpy forward pass of the MoE architectures, written independently of the engine: the oracle of
the MoE tests (float64, token by token, expert by expert)."""

from __future__ import annotations

import numpy as np

from polystrata.gguf import GGUFFile


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope_neox(x, base):
    """x [T, H, D]: rotate (x_i, x_{i+D/2}) by pos * base^(-2i/D)."""
    t, _, d = x.shape
    half = d // 2
    ang = np.arange(t)[:, None] * base ** (-np.arange(half) * 2.0 / d)[None, :]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)


def _silu(x):
    return x / (1 + np.exp(-x))


def plain_moe_forward(f: GGUFFile, ids: list[int]) -> np.ndarray:
    """A qwen3moe/qwen2moe forward pass in float64, token by token and expert by expert."""
    md = f.metadata
    arch = md["general.architecture"]

    def hp(key, default=None):
        return md.get(f"{arch}.{key}", default)

    def W(name):
        return f.dequantize(name).astype(np.float64)

    eps = hp("attention.layer_norm_rms_epsilon")
    n_head, n_kv = hp("attention.head_count"), hp("attention.head_count_kv")
    k_used = hp("expert_used_count")
    norm_topk = arch == "qwen3moe"
    x = W("token_embd.weight")[ids]
    t = len(ids)
    for il in range(hp("block_count")):
        p = f"blk.{il}."
        h = _rms(x, W(p + "attn_norm.weight"), eps)
        q, k, v = (h @ W(p + f"attn_{n}.weight").T for n in "qkv")
        if arch == "qwen2moe":
            q, k, v = q + W(p + "attn_q.bias"), k + W(p + "attn_k.bias"), v + W(p + "attn_v.bias")
        d = q.shape[1] // n_head
        q, k, v = q.reshape(t, n_head, d), k.reshape(t, n_kv, d), v.reshape(t, n_kv, d)
        if arch == "qwen3moe":
            q, k = _rms(q, W(p + "attn_q_norm.weight"), eps), _rms(k, W(p + "attn_k_norm.weight"), eps)
        q, k = _rope_neox(q, hp("rope.freq_base")), _rope_neox(k, hp("rope.freq_base"))
        att = np.zeros_like(q)
        for head in range(n_head):
            kv = head // (n_head // n_kv)
            s = q[:, head] @ k[:, kv].T / np.sqrt(d)
            s[np.triu_indices(t, 1)] = -np.inf
            pr = np.exp(s - s.max(1, keepdims=True))
            att[:, head] = (pr / pr.sum(1, keepdims=True)) @ v[:, kv]
        x = x + att.reshape(t, -1) @ W(p + "attn_output.weight").T
        h = _rms(x, W(p + "ffn_norm.weight"), eps)
        gate_e, up_e, down_e = W(p + "ffn_gate_exps.weight"), W(p + "ffn_up_exps.weight"), W(p + "ffn_down_exps.weight")
        logits = h @ W(p + "ffn_gate_inp.weight").T
        y = np.zeros_like(x)
        for i in range(t):
            pr = np.exp(logits[i] - logits[i].max())
            pr /= pr.sum()
            top = np.argsort(-pr)[:k_used]
            wts = pr[top] / pr[top].sum() if norm_topk else pr[top]
            for e, wt in zip(top, wts):
                y[i] += wt * (down_e[e] @ (_silu(gate_e[e] @ h[i]) * (up_e[e] @ h[i])))
        if arch == "qwen2moe":
            shared = (_silu(h @ W(p + "ffn_gate_shexp.weight").T) * (h @ W(p + "ffn_up_shexp.weight").T)) @ W(
                p + "ffn_down_shexp.weight"
            ).T
            y += shared / (1 + np.exp(-(h @ W(p + "ffn_gate_inp_shexp.weight"))))[:, None]
        x = x + y
    out = "output.weight" if "output.weight" in f.tensors else "token_embd.weight"
    return _rms(x, W("output_norm.weight"), eps) @ W(out).T

"""Tiny random Qwen3.5 / Qwen3.5-MoE / Qwen3-Next models of transformers, and their conversion to GGUF as
llama.cpp's `convert_hf_to_gguf.py` does it (its `conversion/qwen.py`: `Qwen3NextModel`,
`_LinearAttentionVReorderBase`, `Qwen3_5TextModel`, `Qwen3_5MoeTextModel`), for the tests that check the hybrid
builders against the reference implementation. Needs torch and transformers (the tests skip without them).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from polystrata.synth import tokenizer_metadata

N_VOCAB = 512
# Value heads twice the key heads, so the tiled / grouped order of the value heads matters.
_COMMON = dict(
    vocab_size=N_VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, rms_norm_eps=1e-6, max_position_embeddings=4096,
)
_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64)


def tiny_model(arch: str, seed: int = 0) -> torch.nn.Module:
    """A random fp32 transformers model of `arch` (`qwen35`, `qwen35moe` or `qwen3next`). Matrices at half the
    unit-gain scale, so that a layer damps rather than amplifies small differences (at full scale Q8_0 rounding of
    the embeddings alone moved the logits by KL 0.007), and a wide output matrix, so the logits are decisive."""
    import transformers as tf

    cfg, cls = {
        "qwen35": (tf.Qwen3_5TextConfig, tf.Qwen3_5ForCausalLM),
        "qwen35moe": (tf.Qwen3_5MoeTextConfig, tf.Qwen3_5MoeForCausalLM),
        "qwen3next": (tf.Qwen3NextConfig, tf.Qwen3NextForCausalLM),
    }[arch]
    config = cfg(**_COMMON, **({"intermediate_size": 96} if arch == "qwen35" else _MOE))
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(config).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=g) * 15 + 1))
            elif p.ndim == 1:  # norms (zero-centred except the gated one), dt_bias
                p.copy_((1.0 if name.endswith(("linear_attn.norm.weight", "dt_bias")) else 0.0)
                        + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                fan_in = p.shape[-1]
                std = (2.0 if "lm_head" in name else 0.5) / fan_in**0.5
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


def _reorder_v_heads(t: np.ndarray, dim: int, n_k: int, per_k: int, head_dim: int) -> np.ndarray:
    """Value heads grouped by key head -> tiled over the key heads (the converter's `_reorder_v_heads`)."""
    shape = list(t.shape)
    t = t.reshape(shape[:dim] + [n_k, per_k, head_dim] + shape[dim + 1 :])
    return np.swapaxes(t, dim, dim + 1).reshape(shape)


def _tensors(model: torch.nn.Module, arch: str) -> dict[str, np.ndarray]:
    c = model.config
    hk, hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    per_k = hv // hk
    out: dict[str, np.ndarray] = {}
    for name, p in model.state_dict().items():
        x = p.detach().numpy().astype(np.float32)
        if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            x = x + 1  # zero-centred RMS norms: llama.cpp multiplies by the stored weight
        if name.endswith(".A_log"):
            x = -np.exp(x)
        if "conv1d" in name:
            x = x.squeeze(1)
        tiled = arch != "qwen3next"  # Qwen3.5: value heads reordered for ggml's tiled broadcast
        if tiled and "linear_attn." in name:
            if ".in_proj_qkv." in name:
                x = np.concatenate([x[: 2 * hk * dk], _reorder_v_heads(x[2 * hk * dk :], 0, hk, per_k, dv)])
            elif ".in_proj_z." in name:
                x = _reorder_v_heads(x, 0, hk, per_k, dv)
            elif ".in_proj_b." in name or ".in_proj_a." in name or name.endswith((".A_log", ".dt_bias")):
                x = _reorder_v_heads(x, 0, hk, per_k, 1)
            elif "conv1d" in name:
                x = np.concatenate([x[: 2 * hk * dk], _reorder_v_heads(x[2 * hk * dk :], 0, hk, per_k, dv)])
            elif ".out_proj." in name:
                x = _reorder_v_heads(x, 1, hk, per_k, dv)
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = x
            continue
        if name == "model.norm.weight":
            out["output_norm.weight"] = x
            continue
        if name == "lm_head.weight":
            out["output.weight"] = x
            continue
        il, rest = name.removeprefix("model.layers.").split(".", 1)
        b = f"blk.{il}"
        if rest == "linear_attn.in_proj_qkvz.weight":
            # per key head [q, k, v, z] -> [all q, all k, all v] and [all z]
            parts = x.reshape(hk, -1, x.shape[1])
            q, k, v, z = np.split(parts, np.cumsum([dk, dk, per_k * dv])[:3], axis=1)
            out[f"{b}.attn_qkv.weight"] = np.concatenate([t.reshape(-1, x.shape[1]) for t in (q, k, v)])
            out[f"{b}.attn_gate.weight"] = z.reshape(-1, x.shape[1])
            continue
        if rest == "mlp.experts.gate_up_proj":
            f = x.shape[1] // 2
            out[f"{b}.ffn_gate_exps.weight"], out[f"{b}.ffn_up_exps.weight"] = x[:, :f], x[:, f:]
            continue
        out[f"{b}.{_LAYER_NAMES[rest]}"] = x
    return out


_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.in_proj_ba.weight": "ssm_ba.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _metadata(model: torch.nn.Module, arch: str) -> dict:
    """The keys the converter writes (`TextModel`, `Qwen2MoeModel`, `Qwen3NextModel`, `_Qwen35MRopeMixin`), besides
    general.architecture."""
    c = model.config
    a = arch
    rope = c.rope_parameters
    md = {
        "general.name": f"tiny-{a}",
        f"{a}.block_count": c.num_hidden_layers,
        f"{a}.context_length": c.max_position_embeddings,
        f"{a}.embedding_length": c.hidden_size,
        f"{a}.attention.head_count": c.num_attention_heads,
        f"{a}.attention.head_count_kv": c.num_key_value_heads,
        f"{a}.attention.key_length": c.head_dim,
        f"{a}.attention.value_length": c.head_dim,
        f"{a}.attention.layer_norm_rms_epsilon": float(c.rms_norm_eps),
        f"{a}.rope.freq_base": float(rope["rope_theta"]),
        f"{a}.rope.dimension_count": int(c.head_dim * rope.get("partial_rotary_factor", 0.25)),
        f"{a}.ssm.conv_kernel": c.linear_conv_kernel_dim,
        f"{a}.ssm.state_size": c.linear_key_head_dim,
        f"{a}.ssm.group_count": c.linear_num_key_heads,
        f"{a}.ssm.time_step_rank": c.linear_num_value_heads,
        f"{a}.ssm.inner_size": c.linear_value_head_dim * c.linear_num_value_heads,
        f"{a}.attention.recurrent_layers": np.asarray([t == "linear_attention" for t in c.layer_types]),
        f"{a}.full_attention_interval": 4,
    }
    if arch == "qwen35":
        md[f"{a}.feed_forward_length"] = c.intermediate_size
    else:
        md[f"{a}.expert_count"] = c.num_experts
        md[f"{a}.expert_used_count"] = c.num_experts_per_tok
        md[f"{a}.expert_feed_forward_length"] = c.moe_intermediate_size
        md[f"{a}.expert_shared_feed_forward_length"] = c.shared_expert_intermediate_size
    if arch != "qwen3next":
        md[f"{a}.rope.dimension_sections"] = [11, 11, 10, 0]
    md.update(tokenizer_metadata(N_VOCAB))
    return md


# Kept in F32 by the converter whatever the output type (`ModelBase.prepare_tensors`): 1-D tensors, norms,
# routers (and the shared expert's gate) and conv kernels.
_F32_ALWAYS = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")


def _add_kv(w, key: str, value) -> None:
    """One metadata value, typed as the converter's `GGUFWriter.add_*` calls type it."""
    import gguf

    t = gguf.GGUFValueType
    if isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, np.ndarray) and value.dtype == bool:
        w.add_key_value(key, [bool(v) for v in value], t.ARRAY, sub_type=t.BOOL)
    elif isinstance(value, np.ndarray):
        w.add_key_value(key, [int(v) for v in value], t.ARRAY, sub_type=t.INT32)
    elif value and isinstance(value[0], str):
        w.add_key_value(key, list(value), t.ARRAY, sub_type=t.STRING)
    else:
        w.add_key_value(key, [int(v) for v in value], t.ARRAY, sub_type=t.INT32)


def write_gguf_from_hf(model: torch.nn.Module, arch: str, path: Path, outtype: str = "F32") -> Path:
    """Convert `model` to a GGUF file at `path`, its matrices in `outtype` (F32 or Q8_0, as `--outtype`), written
    and quantized by gguf-py as the converter does."""
    import gguf

    w = gguf.GGUFWriter(path, arch)
    for key, value in _metadata(model, arch).items():
        _add_kv(w, key, value)
    for name, x in _tensors(model, arch).items():
        if outtype == "F32" or x.ndim < 2 or name.endswith(_F32_ALWAYS):
            w.add_tensor(name, np.ascontiguousarray(x, np.float32))
        else:
            qtype = gguf.GGMLQuantizationType[outtype]
            w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path

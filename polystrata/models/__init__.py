"""Model builders: GGUF metadata and tensor table -> graph IR of one forward step."""

from __future__ import annotations

from typing import Any

from polystrata.errors import GGUFError, UnsupportedError
from polystrata.ir.graph import Graph
from polystrata.models import gemma3, llama, qwen35, qwen_moe
from polystrata.models.builder import Builder
from polystrata.models.hparams import HParams, MetadataView, read_hparams

ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "gemma3", *qwen35.ARCHES)

# Whether routed expert weights are renormalised over the chosen top-k when the file does not say.
_EXPERT_NORM_DEFAULT = {"qwen3moe": True, "qwen2moe": False, "qwen35moe": True, "qwen3next": True}


def model_hparams(metadata: dict[str, Any], tensors: dict[str, tuple[tuple[int, ...], str]]) -> HParams:
    """Hyper-parameters of a supported architecture, or a clear error naming the supported ones."""
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise GGUFError("metadata 'general.architecture' is missing; is this a model file?")
    if arch not in ARCHITECTURES:
        raise UnsupportedError(f"architecture '{arch}' is not supported (supported: {', '.join(ARCHITECTURES)})")
    if "token_embd.weight" not in tensors:
        raise GGUFError("tensor 'token_embd.weight' is missing; the file is not a complete model")
    hp = read_hparams(metadata, arch, n_vocab=tensors["token_embd.weight"][0][0])
    hp.tied_embeddings = "output.weight" not in tensors
    if arch in qwen35.ARCHES:
        qwen35.read_hybrid(metadata, hp)
    tokens = metadata.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and len(tokens) != hp.n_vocab:
        # llama.cpp refuses this too: ids past the shorter side would embed or decode garbage.
        raise GGUFError(
            f"the vocabulary has {len(tokens)} tokens but token_embd.weight has {hp.n_vocab} rows; "
            "the file is inconsistent"
        )
    if arch in _EXPERT_NORM_DEFAULT:
        m = MetadataView(metadata, arch)
        hp.expert_weights_norm = m.get("expert_weights_norm", _EXPERT_NORM_DEFAULT[arch], kind=bool)
        if hp.n_expert <= 0 or not 0 < hp.n_expert_used <= hp.n_expert:
            raise GGUFError(f"{arch}: bad expert counts ({hp.n_expert_used} used of {hp.n_expert})")
        if hp.n_ff_expert <= 0 and "blk.0.ffn_gate_exps.weight" in tensors:
            hp.n_ff_expert = tensors["blk.0.ffn_gate_exps.weight"][0][1]
        if hp.n_ff_shared <= 0 and "blk.0.ffn_gate_shexp.weight" in tensors:
            hp.n_ff_shared = tensors["blk.0.ffn_gate_shexp.weight"][0][0]
    return hp


def build_graph(
    metadata: dict[str, Any], tensors: dict[str, tuple[tuple[int, ...], str]], all_logits: bool = True,
    last_rows: int = 1,
) -> Graph:
    """The graph of one forward step. With `all_logits` False only the logits of the step's last `last_rows`
    tokens are computed (the `last_rows` op: a step of fewer rows computes all of its own)."""
    hp = model_hparams(metadata, tensors)
    b = Builder(hp, tensors, all_logits, last_rows)
    if hp.arch == "gemma3":
        g = gemma3.build(b, metadata)
    elif hp.arch in ("qwen2moe", "qwen3moe"):
        g = qwen_moe.build(b)
    elif hp.arch in qwen35.ARCHES:
        g = qwen35.build(b)
    else:
        g = llama.build(b)
    g.meta.update(
        n_layer=hp.n_layer, n_embd=hp.n_embd, n_head=hp.n_head, n_head_kv=hp.n_head_kv, head_dim=hp.head_dim,
        n_vocab=hp.n_vocab, n_ctx_train=hp.n_ctx_train,
    )
    return g


__all__ = ["ARCHITECTURES", "Graph", "HParams", "build_graph", "model_hparams"]

"""The engine: a loaded model on a target, with prefill in chunks, decode one token at a time, and scoring."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from polystrata.compiler import PREFILL_CHUNK
from polystrata.errors import PolystrataError
from polystrata.gguf import GGUFFile
from polystrata.ir.graph import Graph
from polystrata.models import HParams, build_graph, model_hparams
from polystrata.sampling import Sampler
from polystrata.targets import make_runtime, resolve_target
from polystrata.tokenizer import Tokenizer

DEFAULT_CTX = 4096


def tensor_table(f: GGUFFile) -> dict[str, tuple[tuple[int, ...], str]]:
    """GGUF tensor name -> (numpy-order shape, format name): what the model builders read."""
    return {name: (tuple(t.shape), t.fmt.name) for name, t in f.tensors.items()}


@dataclass
class GenerationStats:
    """Token counts and wall times of one generation, for the speed line on stderr."""

    n_prompt: int = 0
    n_generated: int = 0
    prompt_s: float = 0.0
    decode_s: float = 0.0

    def summary(self) -> str:
        pp = self.n_prompt / self.prompt_s if self.prompt_s > 0 else 0.0
        # The first generated token comes out of the prefill; decode speed counts the rest.
        n_dec = max(self.n_generated - 1, 0)
        tg = n_dec / self.decode_s if self.decode_s > 0 else 0.0
        return (
            f"prompt: {self.n_prompt} tokens, {pp:.1f} tok/s | "
            f"decode: {self.n_generated} tokens, {tg:.1f} tok/s"
        )


class Engine:
    """A model loaded for one target. `forward` keeps a KV cache; `reset` starts a new sequence."""

    def __init__(
        self, model_path: str | Path, target: str = "auto", n_ctx: int | None = None, kv_type: str = "f16",
        gpu_mem: str | None = None, expert_policy: str = "lru", expert_slots: int | None = None,
        verbose: bool = False, kernel_store: Path | None = None,
    ):
        """`n_ctx` None: min(trained context, `DEFAULT_CTX`), reduced to what the device-memory budget holds (see
        `runtimes.memory.fit_plans`). `gpu_mem`: the budget (`--gpu-mem`: bytes with a K/M/G suffix or a
        percentage of free memory; default: free memory less a margin). `expert_policy`, `expert_slots`: the MoE
        expert cache where the experts do not all fit (`runtimes/memory.py`). `verbose`: the memory plan and the
        VRAM guard's actions on stderr. `kernel_store`: an artifact's compiled kernels, used where the kernel cache
        lacks them (`polystrata.artifact.kernel_store`)."""
        if n_ctx is not None and n_ctx < 1:
            raise PolystrataError(f"the context length must be at least 1, not {n_ctx}")
        from polystrata.runtimes.memory import policy_class

        target = resolve_target(target)
        policy_class(expert_policy)  # an unknown name fails before anything is loaded
        self.path = Path(model_path)
        self.file = GGUFFile(self.path)
        self.metadata = self.file.metadata
        tensors = tensor_table(self.file)
        self.hparams: HParams = model_hparams(self.metadata, tensors)
        self.tokenizer = Tokenizer.from_metadata(self.metadata)
        self.graph_all: Graph = build_graph(self.metadata, tensors, all_logits=True)
        self.graph_last: Graph = build_graph(self.metadata, tensors, all_logits=False)
        # One-token steps (decode) run their own plan, compiled for steps of one token.
        self.graph_step: Graph = build_graph(self.metadata, tensors, all_logits=False)
        self.n_ctx = n_ctx or min(self.hparams.n_ctx_train, DEFAULT_CTX)
        self.n_ctx_given = n_ctx is not None
        self.target = target
        self.kv_type = kv_type
        self.gpu_mem, self.expert_policy, self.expert_slots = gpu_mem, expert_policy, expert_slots
        self.verbose = verbose
        self.memory = None  # the memory plan (kernel targets)
        self.runtime = None if target == "reference" else make_runtime(target)
        if self.runtime is not None and kernel_store is not None:
            self.runtime.kernel_stores.append(kernel_store)
        self.device = self.runtime.device if self.runtime else "host CPU (numpy float32)"
        self.executor = self._make_executor()

    def _make_executor(self):
        if self.runtime is None:
            from polystrata.runtimes.reference import ReferenceExecutor

            return ReferenceExecutor.from_file(self.file, self.graph_all, self.n_ctx)
        from polystrata.compiler.executor import PlanExecutor

        plans, experts = self.plan_memory()
        return PlanExecutor(self.runtime, self.file, plans, self.n_ctx, experts)

    def plan_memory(self) -> tuple[dict, dict | None]:
        """Plans fitted into the device-memory budget (`self.memory`, the plan; `self.n_ctx`, the context) and the
        executor's expert-cache settings (None: every expert resident). Nothing is uploaded yet."""
        from polystrata.runtimes import memory as mm

        graphs = [self.graph_all, self.graph_last, self.graph_step]
        plans, self.memory = mm.fit_plans(
            self.file, graphs, {id(self.graph_step): 1}, self.runtime, self.n_ctx if self.n_ctx_given else None,
            self.hparams.n_ctx_train, self.kv_type, self.gpu_mem, self.expert_slots, DEFAULT_CTX)
        self.n_ctx = self.memory.n_ctx
        if self.verbose:
            for line in self.memory.describe():
                print(line, file=sys.stderr)
        if not self.memory.streaming:
            return plans, None
        rt = self.runtime
        info = rt.memory_info()
        guard = mm.VRAMGuard(mm.margin(info[1]), 2 * mm.margin(info[1])) if info else None
        log = (lambda msg: print(msg, file=sys.stderr)) if self.verbose else None
        # Only a predicting policy reads the routers on the host (dequantized once, in f32).
        routers = ({la.weights[0]: la.router for la in mm.moe_layers(self.graph_step)}
                   if mm.policy_class(self.expert_policy).predicts else {})
        return plans, {"slots": self.memory.slots, "policy": self.expert_policy, "guard": guard, "log": log,
                       "routers": routers}

    @property
    def n_past(self) -> int:
        return self.executor.n_past

    def reset(self) -> None:
        """Start a new sequence (the KV cache is reused, its contents ignored)."""
        self.executor.reset()

    def rewind(self, n_past: int) -> None:
        """Keep only the first `n_past` tokens of the cache: the next forward continues after them."""
        if not 0 <= n_past <= self.n_past:
            raise ValueError(f"cannot rewind to {n_past} tokens: the cache holds {self.n_past}")
        self.executor.n_past = n_past  # rows past n_past are never read

    def forward(self, ids: list[int] | np.ndarray, all_logits: bool = False) -> np.ndarray:
        """Feed tokens after those already in the cache; logits of every token, or of the last one only."""
        ids = np.asarray(ids, dtype=np.int32)
        if ids.size == 0:
            raise PolystrataError("nothing to evaluate: the prompt has no tokens")
        if int(ids.min()) < 0 or int(ids.max()) >= self.hparams.n_vocab:
            raise PolystrataError(f"token id out of range (vocabulary has {self.hparams.n_vocab} tokens)")
        if self.n_past + len(ids) > self.n_ctx:
            raise PolystrataError(
                f"context length exceeded: {self.n_past + len(ids)} tokens > {self.n_ctx}; use a larger -c/--ctx-size"
            )
        outs = []
        for start in range(0, len(ids), PREFILL_CHUNK):
            chunk = ids[start : start + PREFILL_CHUNK]
            last_chunk = start + PREFILL_CHUNK >= len(ids)
            if all_logits:
                outs.append(self.executor.forward(self.graph_all, chunk))
            else:
                out = self.executor.forward(self.graph_step if len(chunk) == 1 else self.graph_last, chunk)
                if last_chunk:
                    outs.append(out)
        return outs[0] if len(outs) == 1 else np.concatenate(outs, axis=0)  # the runtime's array is a copy

    def score(self, ids: list[int]) -> np.ndarray:
        """Logits [n, vocab] of one forward pass over `ids` from an empty context."""
        self.reset()
        return self.forward(ids, all_logits=True)

    def generate(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        sampler: Sampler,
        stats: GenerationStats | None = None,
        stop: Callable[[int], bool] | None = None,
    ) -> Iterator[int]:
        """Yield up to `max_tokens` sampled tokens after the prompt, stopping at end-of-generation tokens."""
        stats = stats if stats is not None else GenerationStats()
        stop = stop or self.tokenizer.is_eog
        self.reset()
        history = list(prompt_ids)
        t0 = time.perf_counter()
        logits = self.forward(prompt_ids)[-1]
        stats.n_prompt = len(prompt_ids)
        stats.prompt_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(max_tokens):
            tok = sampler.sample(logits, history)
            if stop(tok):
                break
            stats.n_generated += 1
            history.append(tok)
            yield tok
            if i + 1 == max_tokens or self.n_past >= self.n_ctx:
                break
            logits = self.forward([tok])[-1]
            stats.decode_s = time.perf_counter() - t0

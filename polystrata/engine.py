"""The engine: a loaded model on a target, with prefill in chunks, decode one token at a time, and scoring."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from polystrata.compiler import DEFAULT_UBATCH, check_kv_type
from polystrata.errors import PolystrataError, UnsupportedError
from polystrata.gguf import GGUFFile
from polystrata.ir.graph import Graph
from polystrata.models import HParams, build_graph, model_hparams
from polystrata.sampling import Sampler
from polystrata.targets import make_runtime, resolve_target
from polystrata.tokenizer import Tokenizer

# The reference target's default context (its numpy KV cache holds f32), and `score`'s least context.
DEFAULT_CTX = 4096


def tensor_table(f: GGUFFile) -> dict[str, tuple[tuple[int, ...], str]]:
    """GGUF tensor name -> (numpy-order shape, format name): what the model builders read."""
    return {name: (tuple(t.shape), t.fmt.name) for name, t in f.tensors.items()}


@dataclass
class GenerationStats:
    """Token counts and wall times of one generation, for the speed line on stderr."""

    n_prompt: int = 0  # prompt tokens prefilled
    n_cached: int = 0  # prompt tokens whose K, V were already in the cache (not prefilled again)
    n_generated: int = 0
    prompt_s: float = 0.0
    decode_s: float = 0.0
    # Why generation ended: "eog" (an end-of-generation token), "length" (max_tokens), "context" (the context is
    # full), or "" while it runs or when the caller stopped reading.
    finish: str = ""

    def summary(self) -> str:
        pp = self.n_prompt / self.prompt_s if self.prompt_s > 0 else 0.0
        # The first generated token comes out of the prefill; decode speed counts the rest.
        n_dec = max(self.n_generated - 1, 0)
        tg = n_dec / self.decode_s if self.decode_s > 0 else 0.0
        cached = f" (+{self.n_cached} cached)" if self.n_cached else ""
        return (
            f"prompt: {self.n_prompt} tokens{cached}, {pp:.1f} tok/s | "
            f"decode: {self.n_generated} tokens, {tg:.1f} tok/s"
        )


def gpu_layers_target(asked: str, resolved: str, n_gpu_layers: int | None, n_layer: int) -> str:
    """The target that llama.cpp's `-ngl N` asks for, given the target asked for and what it resolved to.

    PolyStrata runs every layer on one device: N = 0 keeps the model on the CPU (target `auto` becomes `cpu`); N < 0
    or N >= the layer count is the whole model on the device; some layers on a GPU and the rest on the CPU is
    refused. On a host target (cpu, reference) there is nothing to offload, so any N runs there, as in a llama.cpp
    build without GPU support.
    """
    if n_gpu_layers is None:
        return resolved
    host = resolved in ("cpu", "reference")
    if n_gpu_layers == 0:
        if asked == "auto":
            return "cpu"
        if host:
            return resolved
        raise UnsupportedError(f"-ngl 0 keeps the model on the CPU, but the target {asked} is a GPU")
    if n_gpu_layers < 0 or n_gpu_layers >= n_layer or host:
        return resolved
    raise UnsupportedError(
        f"-ngl {n_gpu_layers} would split the model's {n_layer} layers between the GPU and the CPU, which PolyStrata "
        f"does not do: use -ngl 0 (CPU) or -ngl {n_layer} (all on the GPU; --gpu-mem bounds its memory)")


def check_ubatch(n_ubatch: int, n_ctx: int | None) -> None:
    """Refuse a step size (`-ub/--ubatch-size`) below 1, or above the context `n_ctx` (None: not known yet)."""
    if n_ubatch < 1:
        raise PolystrataError(f"the step size (-ub/--ubatch-size) must be at least 1, not {n_ubatch}")
    if n_ctx is not None and n_ubatch > n_ctx:
        raise PolystrataError(f"the step size (-ub {n_ubatch}) is larger than the context ({n_ctx} tokens): use "
                              f"-ub {n_ctx} or less, or a larger -c/--ctx-size")


def check_parallel(n_seq: int, n_ubatch: int, n_ctx: int | None = None, graph: Graph | None = None) -> None:
    """Refuse `n_seq` sequences sharing each step (`serve -np N`, `compile -np N`) where they cannot be served: more
    than a step's `n_ubatch` rows (a decode step computes a row of each), fewer than 2 tokens each of a context of
    `n_ctx`, or several on a model whose `graph` keeps a recurrent state (one per engine). None: not known yet;
    callers check again once it is, before anything is planned or compiled. One sequence is always served."""
    if n_seq < 1:
        raise PolystrataError(f"parallel sequences (-np/--parallel) must be at least 1, not {n_seq}")
    if n_seq == 1:
        return
    if n_seq > n_ubatch:
        raise PolystrataError(f"-np {n_seq} does not fit a step of {n_ubatch} rows (-ub {n_ubatch}): a decode step "
                              f"computes one row per sequence; use -ub {n_seq} or more, or -np {n_ubatch} or less")
    if n_ctx is not None and n_ctx // n_seq < 2:
        raise PolystrataError(f"a context of {n_ctx} tokens (-c) cannot hold {n_seq} parallel sequences (-np) of at "
                              f"least 2 tokens each: use -c {2 * n_seq} or more"
                              + (f", or -np {n_ctx // 2} or less" if n_ctx >= 4 else ""))
    if graph is not None and graph.recurrent():
        # Sequences share the K/V cache by rows, but a recurrent state is one per engine (issue 23): one sequence
        # at a time holds it, zeroed as each opens.
        raise PolystrataError(f"{graph.arch} keeps a recurrent state, one per engine: -np {n_seq} parallel sequences "
                              "are not supported yet; use -np 1")


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Engine:
    """A model loaded for one target. `forward` keeps a KV cache; `reset` starts a new sequence."""

    def __init__(
        self, model_path: str | Path, target: str = "auto", n_ctx: int | None = None, kv_type: str = "f16",
        gpu_mem: str | None = None, expert_policy: str | None = None, expert_slots: int | None = None,
        n_gpu_layers: int | None = None, verbose: bool = False, kernel_store: Path | None = None,
        tuning: bool = True, knobs: dict | None = None, n_ubatch: int | None = None, logit_rows: int = 1,
        all_logits: bool = False,
    ):
        """`n_ctx` None: the model's trained context, reduced to what the device-memory budget holds (see
        `runtimes.memory.fit_plans`; the reference target: min(trained, `DEFAULT_CTX`)). `gpu_mem`: the budget
        (`--gpu-mem`: bytes with a K/M/G suffix or a percentage of free memory; default: free memory less a
        margin). `expert_policy` (default lru), `expert_slots`: the MoE expert cache where the experts do not all
        fit (`runtimes/memory.py`). The reference target refuses these three. `verbose`: the memory plan and the
        VRAM guard's actions on stderr. `n_gpu_layers`: llama.cpp's -ngl (see `gpu_layers_target`).
        `kernel_store`: an artifact's compiled kernels, used where the kernel cache lacks them
        (`polystrata.artifact.kernel_store`). `tuning`: take the tuning database's knobs for this device
        (`polystrata.tuning`; `--no-tuning` turns it off). `knobs`: knob space -> knob -> value, for every kernel of
        the space (`bench --knob`), under the tuning database's choices for single kernels. `n_ubatch`: the step
        size, llama.cpp's -ub: the most tokens one step of a prompt computes (its plans' t_max; a longer prompt runs
        in steps of this many); None: `DEFAULT_UBATCH`, which the context may be smaller than, where a given one
        must fit the context (`check_ubatch`). `logit_rows`: the most rows whose logits a step of several sequences
        wants (`serve --parallel N`: N); above 1, the plan of the step's last `logit_rows` rows' logits
        (`graph_rows`) is made too, for the steps of several sequences that want several rows' logits (decode rows,
        with prompt runs or not: `polystrata.batch`), once that many sequences are known to fit the step size, the
        context and the model (`check_parallel`).
        `all_logits`: make the plan of every token's logits too (`graph_all`), for `score` and
        `forward(all_logits=True)` (`score`, `parity`); without it they refuse. Its logits buffer (step size x
        vocabulary, f32) is most of an engine's scratch memory on models of large vocabularies: `run`, `chat`,
        `serve` and `bench` never ask for it."""
        if n_ctx is not None and n_ctx < 1:
            raise PolystrataError(f"the context length must be at least 1, not {n_ctx}")
        if n_ubatch is not None:
            check_ubatch(n_ubatch, n_ctx)
        self.n_ubatch = n_ubatch or DEFAULT_UBATCH
        self.n_ubatch_given = n_ubatch is not None
        check_parallel(logit_rows, self.n_ubatch, n_ctx)  # before the model loads; its graph and context below
        from polystrata.runtimes.memory import check_reference_flags, policy_class

        asked, target = target, resolve_target(target)
        if target == "reference":
            check_reference_flags(gpu_mem, expert_slots, expert_policy)
        else:
            check_kv_type(kv_type)  # before the model loads (the reference keeps f32 K, V whatever is asked)
        expert_policy = expert_policy or "lru"
        policy_class(expert_policy)  # an unknown name fails before anything is loaded
        self.path = Path(model_path)
        self.file = GGUFFile(self.path)
        self.metadata = self.file.metadata
        tensors = tensor_table(self.file)
        self.hparams: HParams = model_hparams(self.metadata, tensors)
        target = gpu_layers_target(asked, target, n_gpu_layers, self.hparams.n_layer)
        # The model's graph as a whole (what `recurrent()` and the weights say); planned only with `all_logits`.
        self.graph_all: Graph = build_graph(self.metadata, tensors, all_logits=True)
        self.all_logits = all_logits
        check_parallel(logit_rows, self.n_ubatch, graph=self.graph_all)  # a recurrent model: before anything else
        self.tokenizer = Tokenizer.from_metadata(self.metadata)
        self.graph_last: Graph = build_graph(self.metadata, tensors, all_logits=False)
        # Steps of several sequences wanting several rows' logits (decode rows, a prompt run beside them or not):
        # those rows go last.
        self.logit_rows = logit_rows
        self.graph_rows: Graph | None = (build_graph(self.metadata, tensors, all_logits=False, last_rows=logit_rows)
                                         if logit_rows > 1 else None)
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
        if self.runtime is not None and tuning:
            from polystrata.tuning import apply_tuning

            apply_tuning(self.runtime)
        if self.runtime is not None:
            self.runtime.set_knobs(knobs)
        if self.runtime is not None and kernel_store is not None:
            self.runtime.kernel_stores.append(kernel_store)
        self.device = self.runtime.device if self.runtime else "host CPU (numpy float32)"
        if self.n_ubatch_given and self.runtime is None:
            check_ubatch(self.n_ubatch, self.n_ctx)
        self.executor = self._make_executor()
        if verbose:
            print(f"step size: {self.n_ubatch} tokens at most per step of a prompt (-ub)", file=sys.stderr)
        # The token ids whose K, V the cache holds, in order: `generate(reuse_cache=True)` prefills only what follows
        # the longest prefix a new prompt shares with them.
        self.cache_ids: list[int] = []
        self._checkpoint: tuple[int, object] | None = None  # (n_past, recurrent states): see `checkpoint`

    def _make_executor(self):
        if self.runtime is None:
            from polystrata.runtimes.reference import ReferenceExecutor

            check_parallel(self.logit_rows, self.n_ubatch, self.n_ctx)

            return ReferenceExecutor.from_file(self.file, self.graph_all, self.n_ctx)
        from polystrata.compiler.executor import PlanExecutor

        plans, experts = self.plan_memory()
        return PlanExecutor(self.runtime, self.file, plans, self.n_ctx, experts)

    def plan_memory(self) -> tuple[dict, dict | None]:
        """Plans fitted into the device-memory budget (`self.memory`, the plan; `self.n_ctx`, the context) and the
        executor's expert-cache settings (None: every expert resident). Nothing is uploaded yet."""
        from polystrata.runtimes import memory as mm

        graphs = [*([self.graph_all] if self.all_logits else []), self.graph_last, self.graph_step,
                  *([self.graph_rows] if self.graph_rows else [])]
        steps = {id(g): self.n_ubatch for g in graphs} | {id(self.graph_step): 1}
        plans, self.memory = mm.fit_plans(
            self.file, graphs, steps, self.runtime, self.n_ctx if self.n_ctx_given else None,
            self.hparams.n_ctx_train, self.kv_type, self.gpu_mem, self.expert_slots)
        self.n_ctx = self.memory.n_ctx
        if self.n_ubatch_given:  # the context fitted to the budget may be smaller than the one asked for
            check_ubatch(self.n_ubatch, self.n_ctx)
        check_parallel(self.logit_rows, self.n_ubatch, self.n_ctx)  # so may the sequences' share of it
        if self.verbose:
            for line in self.memory.describe():
                print(line, file=sys.stderr)
        if not self.memory.streaming:
            return plans, None
        guard = mm.vram_guard(self.memory, self.runtime.memory_info(), explicit=self.gpu_mem is not None)
        log = (lambda msg: print(msg, file=sys.stderr)) if self.verbose else None
        if guard is None and log is not None:
            log("vram guard: off (the device does not report its free memory, or the budget leaves none free)")
        # Only a predicting policy reads the routers on the host (dequantized once, in f32).
        routers = ({la.weights[0]: la.router for la in mm.moe_layers(self.graph_step)}
                   if mm.policy_class(self.expert_policy).predicts else {})
        return plans, {"slots": self.memory.slots, "policy": self.expert_policy, "guard": guard, "log": log,
                       "routers": routers}

    @property
    def n_past(self) -> int:
        return self.executor.n_past

    def reset(self) -> None:
        """Start a new sequence (the KV cache is reused, its contents ignored; recurrent states are zeroed)."""
        self._checkpoint = None
        self.executor.reset()
        self.cache_ids.clear()

    def rewind(self, n_past: int) -> None:
        """Keep only the first `n_past` tokens of the cache: the next forward continues after them."""
        if not 0 <= n_past <= self.n_past:
            raise ValueError(f"cannot rewind to {n_past} tokens: the cache holds {self.n_past}")
        if not self.can_rewind(n_past):
            raise PolystrataError(f"{self.hparams.arch} keeps a recurrent state, which cannot be rewound to "
                                  f"{n_past} of its {self.n_past} tokens (no checkpoint there)")
        if n_past == 0:
            self.reset()
        elif n_past < self.n_past and self.graph_all.recurrent():
            self.executor.load_state(self._checkpoint[1])
        self.executor.n_past = n_past  # rows past n_past are never read
        del self.cache_ids[n_past:]

    def can_rewind(self, n_past: int) -> bool:
        """Whether `rewind(n_past)` can be done: always with a KV cache alone; with a recurrent state, which holds
        every token so far, only to the start, to where it is, or to its `checkpoint`."""
        return (n_past in (0, self.n_past) or not self.graph_all.recurrent()
                or (self._checkpoint is not None and self._checkpoint[0] == n_past))

    def checkpoint(self) -> None:
        """Remember the recurrent state here, so that `rewind` can come back to this point of the sequence (a KV
        cache needs no checkpoint: rows past n_past are never read). One checkpoint; a new one replaces it."""
        if self.graph_all.recurrent():
            self._checkpoint = (self.n_past, self.executor.save_state())

    def check_tokens(self, ids: list[int] | np.ndarray, n_past: int, n_ctx: int) -> np.ndarray:
        """`ids` as int32, checked: not empty, in the vocabulary, and fitting after `n_past` tokens in `n_ctx`."""
        ids = np.asarray(ids, dtype=np.int32)
        if ids.size == 0:
            raise PolystrataError("nothing to evaluate: the prompt has no tokens")
        if int(ids.min()) < 0 or int(ids.max()) >= self.hparams.n_vocab:
            raise PolystrataError(f"token id out of range (vocabulary has {self.hparams.n_vocab} tokens)")
        if n_past + len(ids) > n_ctx:
            raise PolystrataError(
                f"context length exceeded: {n_past + len(ids)} tokens > {n_ctx}; use a larger -c/--ctx-size"
            )
        return ids

    def forward(self, ids: list[int] | np.ndarray, all_logits: bool = False) -> np.ndarray:
        """Feed tokens after those already in the cache, in steps of at most `n_ubatch`; logits of every token, or
        of the last one only (every token's: an engine made with `all_logits`)."""
        if all_logits and not self.all_logits:  # a caller's bug: its engine lacks the plan it needs
            raise PolystrataError("the logits of every token were asked of an engine made without their plan: "
                                  "make it with Engine(..., all_logits=True)")
        ids = self.check_tokens(ids, self.n_past, self.n_ctx)
        outs = []
        for start in range(0, len(ids), self.n_ubatch):
            chunk = ids[start : start + self.n_ubatch]
            last_chunk = start + self.n_ubatch >= len(ids)
            if all_logits:
                outs.append(self.executor.forward(self.graph_all, chunk))
            else:
                out = self.executor.forward(self.graph_step if len(chunk) == 1 else self.graph_last, chunk)
                if last_chunk:
                    outs.append(out)
            self.cache_ids.extend(chunk.tolist())
        return outs[0] if len(outs) == 1 else np.concatenate(outs, axis=0)  # the runtime's array is a copy

    def score(self, ids: list[int]) -> np.ndarray:
        """Logits [n, vocab] of one forward pass over `ids` from an empty context (an engine made with
        `all_logits`)."""
        self.reset()
        return self.forward(ids, all_logits=True)

    def generate(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        sampler: Sampler,
        stats: GenerationStats | None = None,
        stop: Callable[[int], bool] | None = None,
        reuse_cache: bool = False,
    ) -> Iterator[int]:
        """Yield up to `max_tokens` sampled tokens after the prompt (a negative `max_tokens`: until the context is
        full), stopping at end-of-generation tokens; `stats.finish` says why it ended.

        `reuse_cache`: keep the K, V of the longest prefix the prompt shares with the tokens in the cache (the
        previous prompt and what was generated after it) and prefill only the rest, as a conversation's next turn
        needs; otherwise the prompt is prefilled from an empty cache.
        """
        stats = stats if stats is not None else GenerationStats()
        stop = stop or self.tokenizer.is_eog
        # At least the last prompt token is fed again: its logits give the first generated token.
        keep = max(min(common_prefix(self.cache_ids, prompt_ids), len(prompt_ids) - 1), 0) if reuse_cache else 0
        if keep and not self.can_rewind(keep):  # a recurrent state cannot go back to the shared prefix
            keep = 0
        if keep:
            self.rewind(keep)
        else:
            self.reset()
        history = list(prompt_ids)
        t0 = time.perf_counter()
        logits = self.forward(prompt_ids[self.n_past:])[-1]
        stats.n_cached = keep
        stats.n_prompt = len(prompt_ids) - keep
        stats.prompt_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        limit = max_tokens if max_tokens >= 0 else self.n_ctx
        for i in range(limit):
            tok = sampler.sample(logits, history)
            if stop(tok):
                stats.finish = "eog"
                return
            stats.n_generated += 1
            history.append(tok)
            yield tok
            if self.n_past >= self.n_ctx:
                stats.finish = "context"
                return
            if i + 1 == limit:
                break
            logits = self.forward([tok])[-1]
            stats.decode_s = time.perf_counter() - t0
        stats.finish = "length"

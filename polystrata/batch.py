"""Batched decoding: up to N sequences share each decode step (the server's `--parallel N`).

The engine's KV cache is split into N runs of n_ctx // N rows, one per sequence slot (as llama-server splits its
context between its slots). A step is a list of rows, one per active sequence: its token, its position in its own
sequence and its slot's first cache row (`starts`); the attention kernels store and read each row's K and V in its
own slot's rows (codegen/recipes/attention.py), and every other kernel treats the rows as the T rows of a prefill
chunk, so the step's matrix-vector products become small matrix products over the active sequences. Sequences
join (`open`, `prefill`) and leave (`close`) between steps.
"""

from __future__ import annotations

import numpy as np

from polystrata.engine import Engine
from polystrata.errors import PolystrataError


class BatchDecoder:
    """Sequence slots over one engine's KV cache; `step` decodes one token of several sequences at once."""

    def __init__(self, engine: Engine, n_seq: int):
        if n_seq < 1:
            raise PolystrataError(f"parallel sequences must be at least 1, not {n_seq}")
        if n_seq > engine.n_ubatch:  # a decode step computes one row per sequence, at most a step's rows
            raise PolystrataError(f"{n_seq} parallel sequences do not fit a step of {engine.n_ubatch} rows: use "
                                  f"-ub {n_seq} or more, or fewer parallel sequences")
        self.recurrent = engine.graph_all.recurrent()
        if self.recurrent and n_seq > 1:
            # Sequences share the K/V cache by rows, but a recurrent state is one per engine (issue 23): one
            # sequence at a time holds it, zeroed as each opens.
            raise PolystrataError(f"{engine.hparams.arch} keeps a recurrent state, one per engine: {n_seq} parallel "
                                  "sequences are not supported yet; use one (--parallel 1)")
        if engine.n_ctx // n_seq < 2:
            raise PolystrataError(f"a context of {engine.n_ctx} tokens cannot hold {n_seq} sequences; "
                                  "use a larger -c/--ctx-size or fewer parallel sequences")
        self.engine = engine
        self.n_seq = n_seq
        self.n_ctx = engine.n_ctx // n_seq  # tokens a sequence holds
        self.n_past = [0] * n_seq  # tokens in each slot's cache rows
        self.free = list(range(n_seq - 1, -1, -1))  # slot 0 first

    def open(self) -> int:
        """A free slot for a new sequence (its cache rows start empty)."""
        if not self.free:
            raise PolystrataError(f"all {self.n_seq} sequence slots are busy")
        slot = self.free.pop()
        self.n_past[slot] = 0
        if self.recurrent:  # the one sequence's state starts from zero (the engine's reset)
            self.engine.reset()
        return slot

    def close(self, slot: int) -> None:
        """Free a sequence's slot."""
        if slot in self.free or not 0 <= slot < self.n_seq:
            raise ValueError(f"slot {slot} is not open")
        self.free.append(slot)

    def prefill(self, slot: int, ids: list[int] | np.ndarray) -> np.ndarray:
        """Feed `ids` after what the slot holds, alone, in steps of at most the engine's `n_ubatch`; returns the
        logits of the last token."""
        ids = self.engine.check_tokens(ids, self.n_past[slot], self.n_ctx)
        eng, ex = self.engine, self.engine.executor
        out = None
        for i in range(0, len(ids), eng.n_ubatch):
            chunk = ids[i : i + eng.n_ubatch]
            pos = np.arange(self.n_past[slot], self.n_past[slot] + len(chunk), dtype=np.int32)
            graph = eng.graph_step if len(chunk) == 1 else eng.graph_last
            out = ex.step(graph, chunk, pos, np.full(len(chunk), slot * self.n_ctx, np.int32))
            self.n_past[slot] += len(chunk)
        return out[-1]

    def step(self, slots: list[int], tokens: list[int]) -> np.ndarray:
        """One decode step: token `tokens[i]` appended to sequence `slots[i]` (distinct slots); returns the logits
        [len(slots), vocab], row i those of sequence `slots[i]`."""
        if len(set(slots)) != len(slots) or len(slots) != len(tokens) or not slots:
            raise ValueError("a step takes one token each of distinct sequences")
        for s in slots:
            if self.n_past[s] >= self.n_ctx:
                raise PolystrataError(f"context length exceeded: a sequence holds {self.n_ctx} tokens")
        ids = self.engine.check_tokens(tokens, 0, self.n_ctx)
        pos = np.asarray([self.n_past[s] for s in slots], np.int32)
        starts = np.asarray(slots, np.int32) * self.n_ctx
        eng = self.engine
        # One row: the one-token plan (captured into a device graph where the target has them); several: the plan
        # of all logits, whose matrix products take the rows together.
        graph = eng.graph_step if len(slots) == 1 else eng.graph_all
        out = eng.executor.step(graph, ids, pos, starts)
        for s in slots:
            self.n_past[s] += 1
        return out

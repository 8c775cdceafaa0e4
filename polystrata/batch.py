"""Batched decoding: up to N sequences share each step (the server's `--parallel N`).

The engine's KV cache is split into N runs of n_ctx // N rows, one per sequence slot (as llama-server splits its
context between its slots). A step is a list of rows of several sequences, each sequence giving its next decode
token or a run of its prompt's tokens (continuous batching): each row carries its token, its position in its own
sequence and its slot's first cache row (`starts`); the attention kernels store every row's K and V in its own slot's
rows before any row reads them, and a row attends to the rows of its slot up to its position
(codegen/recipes/attention.py, attention_tiles.py), so a run of prompt rows sees its cache and its own earlier rows
of the step, causally. Every other kernel treats the rows as the T rows of a prefill chunk, so the step's
matrix-vector products become matrix products over all the step's rows. Only the logits a caller samples from (a
decode row's, a prompt's last token's) leave the device. Sequences join (`open`) and leave (`close`) between steps.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from polystrata.engine import Engine
from polystrata.errors import PolystrataError


class BatchDecoder:
    """Sequence slots over one engine's KV cache; `step` feeds tokens of several sequences at once."""

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
        n = self.engine.n_ubatch
        for i in range(0, len(ids), n):
            out = self.step([(slot, ids[i : i + n])], need=[i + n >= len(ids)])
        return out[0]

    def step(self, runs: Sequence[tuple[int, Sequence[int]]], need: Sequence[bool] | None = None) -> np.ndarray:
        """One step of runs of tokens of distinct sequences, at most the engine's `n_ubatch` tokens in all: run
        `(slot, ids)` appends `ids` (a decode token, or a chunk of a prompt) to sequence `slot` after what it holds.
        Returns the logits of the last token of each run that `need`s them (default: every run), in run order,
        [runs needing them, vocab]; only those rows leave the device."""
        slots = [s for s, _ in runs]
        need = [True] * len(runs) if need is None else list(need)
        if not runs or len(set(slots)) != len(slots) or len(need) != len(runs):
            raise ValueError("a step takes runs of tokens of distinct sequences")
        eng = self.engine
        ids = [eng.check_tokens(t, self.n_past[s], self.n_ctx) for s, t in runs]
        order = list(range(len(runs)))
        if need.count(True) == 1:
            # Rows are independent of their order in a step: the one run whose logits are wanted goes last, so the
            # plan of the last logits serves (no output projection of the other rows).
            order.append(order.pop(need.index(True)))
        slots, ids, need = [slots[i] for i in order], [ids[i] for i in order], [need[i] for i in order]
        lengths = [len(t) for t in ids]
        if sum(lengths) > eng.n_ubatch:
            raise ValueError(f"a step of {sum(lengths)} tokens exceeds the step size {eng.n_ubatch}")
        pos = np.concatenate([np.arange(self.n_past[s], self.n_past[s] + n, dtype=np.int32)
                              for s, n in zip(slots, lengths)])
        starts = np.repeat(np.asarray(slots, np.int32) * self.n_ctx, lengths)
        ends = np.cumsum(lengths) - 1  # each run's last row
        rows = [int(e) for e, w in zip(ends, need) if w]
        # One row: the one-token plan (captured into a device graph where the target has them); only the step's
        # last row wanted: the plan of the last logits (a prompt's chunk alone); else the plan of all logits, whose
        # matrix products take the rows together, of which only the wanted rows are read.
        if len(pos) == 1:
            graph, rows = eng.graph_step, [0] if rows else []
        elif rows == [len(pos) - 1] or not rows:
            graph, rows = eng.graph_last, [0] if rows else []
        else:
            graph = eng.graph_all
        out = eng.executor.step(graph, np.concatenate(ids), pos, starts, rows=rows)
        for s, n in zip(slots, lengths):
            self.n_past[s] += n
        return out

"""Batched decoding: up to N sequences share each step (the server's `--parallel N`).

The engine's KV cache is split into N runs of n_ctx // N rows, one per sequence slot (as llama-server splits its
context between its slots). A step is a list of rows of several sequences, each sequence giving its next decode
token or a run of its prompt's tokens (continuous batching): each row carries its token, its position in its own
sequence and its slot's first cache row (`starts`); the attention kernels store every row's K and V in its own slot's
rows before any row reads them, and a row attends to the rows of its slot up to its position
(codegen/recipes/attention.py, attention_tiles.py), so a run of prompt rows sees its cache and its own earlier rows
of the step, causally. Every other kernel treats the rows as the T rows of a prefill chunk, so the step's
matrix-vector products become matrix products over all the step's rows. Only the logits a caller samples from (a
decode row's, a prompt's last token's) leave the device, and a step with other rows computes only theirs: the wanted
rows go last and the plan of the step's last rows' logits runs (`Engine(logit_rows=N)`, the `last_rows` op before
the output norm and projection, which keep min(rows, N) rows: a step of fewer rows computes only its own), for steps
of decode rows only too: no step needs the plan of every row's logits.
Sequences join (`open`) and leave (`close`) between steps.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from polystrata.engine import Engine, check_parallel
from polystrata.errors import PolystrataError


class BatchDecoder:
    """Sequence slots over one engine's KV cache; `step` feeds tokens of several sequences at once."""

    def __init__(self, engine: Engine, n_seq: int):
        """`n_seq` sequence slots; an engine made for at least that many (`Engine(logit_rows=n_seq)`), whose plan of
        the last rows' logits serves steps wanting several rows."""
        check_parallel(n_seq, engine.n_ubatch, engine.n_ctx, engine.graph_all)
        if n_seq > engine.logit_rows:  # a caller's bug: `serve -np N` makes its engine with logit_rows=N
            raise PolystrataError(f"{n_seq} sequences share the steps of an engine made for the logits of "
                                  f"{engine.logit_rows} row{'s' * (engine.logit_rows > 1)} a step: make it with "
                                  f"Engine(..., logit_rows={n_seq})")
        self.recurrent = engine.graph_all.recurrent()
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

    def step(self, runs: Sequence[tuple[int, Sequence[int]]], need: Sequence[bool] | None = None,
             launched: Callable[[], None] | None = None) -> np.ndarray:
        """One step of runs of tokens of distinct sequences, at most the engine's `n_ubatch` tokens in all: run
        `(slot, ids)` appends `ids` (a decode token, or a chunk of a prompt) to sequence `slot` after what it holds.
        Returns the logits of the last token of each run that `need`s them (default: every run), in run order,
        [runs needing them, vocab]; only those rows leave the device. `launched` is called while the device works
        (`PlanExecutor.step`)."""
        slots = [s for s, _ in runs]
        need = [True] * len(runs) if need is None else list(need)
        if not runs or len(set(slots)) != len(slots) or len(need) != len(runs):
            raise ValueError("a step takes runs of tokens of distinct sequences")
        eng = self.engine
        ids = [eng.check_tokens(t, self.n_past[s], self.n_ctx) for s, t in runs]
        if sum(map(len, ids)) > eng.n_ubatch:
            raise ValueError(f"a step of {sum(map(len, ids))} tokens exceeds the step size {eng.n_ubatch}")
        # Rows are independent of their order in a step, and a run's rows may be split: every row's K and V are
        # stored (the attention's store launch) before any row of the step attends. So the wanted rows, each
        # wanted run's last token, go last, in run order, and a plan computing the logits of the step's last rows
        # only serves: (slot, tokens, first position) segments.
        early = [(s, t, self.n_past[s]) for s, t, w in zip(slots, ids, need) if not w]
        early += [(s, t[:-1], self.n_past[s]) for s, t, w in zip(slots, ids, need) if w and len(t) > 1]
        late = [(s, t[-1:], self.n_past[s] + len(t) - 1) for s, t, w in zip(slots, ids, need) if w]
        segments = early + late
        pos = np.concatenate([np.arange(p, p + len(t), dtype=np.int32) for _, t, p in segments])
        starts = np.concatenate([np.full(len(t), s * self.n_ctx, np.int32) for s, t, _ in segments])
        n, wanted = len(pos), len(late)
        # One row: the one-token plan (captured into a device graph where the target has them); at most one row
        # wanted: the plan of the last logits; several (at most one a sequence, so at most `logit_rows`): the plan
        # of the last `logit_rows` rows' logits, whose matrix products take the step's rows together. A step of
        # fewer rows than that (decode rows of fewer sequences, say) keeps all its rows (the `last_rows` op keeps
        # min(n, logit_rows)): the wanted rows are the last of those either way.
        if n == 1:
            graph, rows = eng.graph_step, [0] * wanted
        elif wanted <= 1:
            graph, rows = eng.graph_last, [0] * wanted
        else:
            kept = min(n, eng.logit_rows)
            graph, rows = eng.graph_rows, list(range(kept - wanted, kept))
        out = eng.executor.step(graph, np.concatenate([t for _, t, _ in segments]), pos, starts, rows=rows,
                                launched=launched)
        for s, t in zip(slots, ids):
            self.n_past[s] += len(t)
        return out

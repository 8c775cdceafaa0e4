"""The parity metric against llama.cpp's reference logits (see tests/data/fixtures/README.md).

At each position: renormalise the reference's top-k logits and the candidate's logits at the same ids over those
k tokens, take KL(reference || candidate); pool the mean over every position of every prompt, and count how often
the candidate's arg-max over the whole vocabulary is the reference's top token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

KL_MAX = 0.01
TOP1_MIN = 0.95


@dataclass
class Parity:
    """Pooled parity over some positions."""

    kl_sum: float = 0.0
    top1_hits: int = 0
    n: int = 0

    @property
    def kl(self) -> float:
        return self.kl_sum / self.n if self.n else float("nan")

    @property
    def top1(self) -> float:
        return self.top1_hits / self.n if self.n else float("nan")

    def add(self, ref_top_ids: np.ndarray, ref_top_logits: np.ndarray, logits: np.ndarray) -> None:
        """Add positions: reference top-k ids/logits [n, k] and the candidate's full logits [n, vocab]."""
        r = ref_top_logits.astype(np.float64)
        c = np.take_along_axis(logits, ref_top_ids, axis=1).astype(np.float64)
        lp = r - r.max(1, keepdims=True)
        lp -= np.log(np.exp(lp).sum(1, keepdims=True))
        lq = c - c.max(1, keepdims=True)
        lq -= np.log(np.exp(lq).sum(1, keepdims=True))
        self.kl_sum += float((np.exp(lp) * (lp - lq)).sum())
        self.top1_hits += int((logits.argmax(1) == ref_top_ids[:, 0]).sum())
        self.n += len(ref_top_ids)

    def ok(self) -> bool:
        return self.kl <= KL_MAX and self.top1 >= TOP1_MIN

    def __str__(self) -> str:
        return f"KL {self.kl:.5f} (<= {KL_MAX}), top-1 {self.top1:.3f} (>= {TOP1_MIN}) over {self.n} positions"

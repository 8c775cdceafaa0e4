"""Token sampling: repetition penalty, top-k, top-p, min-p and temperature, in llama.cpp's default order.

The chain is penalties -> top-k -> top-p -> min-p -> temperature -> draw, as in llama.cpp's default sampler
chain, so top-p and min-p see the distribution at temperature 1 and temperature only reshapes what is left.
A temperature <= 0 means greedy: the argmax after the repetition penalty.

Everything works on a numpy vector of logits and is linear in the vocabulary size apart from sorting the
few surviving candidates, so a 262k-token vocabulary costs well under a millisecond per token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from polystrata.errors import PolystrataError

# Logit distances below the max tried in turn when top-p runs without min-p to bound the candidates to sort.
_TOP_P_DELTAS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, math.inf)


@dataclass
class SamplerConfig:
    """Sampling settings; the defaults are llama.cpp's.

    temperature: <= 0 means greedy decoding.
    top_k: keep the k most likely tokens; 0 disables it.
    top_p: keep the smallest set of most likely tokens whose probability mass is >= top_p; 1.0 disables it.
    min_p: drop tokens whose probability is below min_p times the most likely one's; 0 disables it.
    repeat_penalty: divide positive (multiply negative) logits of recently seen tokens; 1.0 disables it.
    repeat_last_n: how many of the last tokens the penalty looks at; 0 disables it, -1 means all.
    seed: seed of the random generator; None draws a fresh one from the OS.
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature):
            raise PolystrataError(f"temperature must be a finite number, got {self.temperature}")
        if self.top_k < 0:
            raise PolystrataError(f"top-k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 <= self.top_p <= 1.0:
            raise PolystrataError(f"top-p must be between 0 and 1, got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise PolystrataError(f"min-p must be between 0 and 1, got {self.min_p}")
        if not (self.repeat_penalty > 0.0 and math.isfinite(self.repeat_penalty)):
            raise PolystrataError(f"repeat penalty must be > 0 (1.0 disables it), got {self.repeat_penalty}")
        if self.repeat_last_n < -1:
            raise PolystrataError(f"repeat-last-n must be >= -1 (-1 means all), got {self.repeat_last_n}")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to the argmax."""
        return self.temperature <= 0.0 or self.top_k == 1


class Sampler:
    """Picks the next token from a logits vector; the same seed gives the same sequence of tokens."""

    def __init__(self, config: SamplerConfig | None = None):
        self.config = config if config is not None else SamplerConfig()
        self.reset()

    def reset(self, seed: int | None = None) -> None:
        """Restart the random stream, from `seed` if given, else from the config's seed."""
        self._rng = np.random.default_rng(self.config.seed if seed is None else seed)

    def apply_penalty(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        """Logits with the repetition penalty applied to the tokens in the last `repeat_last_n` of history.

        Returns the input unchanged (not copied) when the penalty is off.
        """
        cfg = self.config
        n = cfg.repeat_last_n
        if cfg.repeat_penalty == 1.0 or n == 0 or len(history) == 0:
            return logits
        recent = history if n < 0 else history[-n:]
        # Each token is penalised once however often it occurred, as in llama.cpp.
        toks = np.unique(np.asarray(recent, dtype=np.int64))
        toks = toks[(toks >= 0) & (toks < logits.shape[0])]
        out = logits.copy()
        v = out[toks]
        out[toks] = np.where(v > 0, v / cfg.repeat_penalty, v * cfg.repeat_penalty)
        return out

    def sample(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        """Return the next token id given the logits of the last position and the tokens so far."""
        x = np.asarray(logits, dtype=np.float32)
        if x.ndim != 1 or x.shape[0] == 0:
            raise PolystrataError(f"sampler needs a 1-D logits vector, got shape {x.shape}")
        cfg = self.config
        x = self.apply_penalty(x, history)
        if cfg.greedy:
            i = int(np.argmax(x))
            if np.isnan(x[i]):  # argmax returns the first NaN if there is one
                raise PolystrataError("the model produced NaN logits")
            return i
        cand, v = self._truncate(x)
        # Temperature last: it reshapes the survivors without changing which ones survive.
        # A temperature near zero sends the distances to -inf (exp: 0): greedy in the limit, as it should be.
        with np.errstate(over="ignore"):
            z = (v.astype(np.float64) - float(v.max())) / cfg.temperature
        w = np.exp(z)
        cum = np.cumsum(w)
        r = self._rng.random() * cum[-1]
        j = min(int(np.searchsorted(cum, r, side="right")), len(cum) - 1)
        return int(cand[j])

    def _truncate(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and logits that survive top-k, top-p and min-p, most likely first where it matters."""
        cfg = self.config
        n = x.shape[0]
        xmax = float(x.max())
        if math.isnan(xmax):
            raise PolystrataError("the model produced NaN logits")
        if xmax == -math.inf:
            raise PolystrataError("every token has probability 0 (all logits are -inf)")

        # top-k: argpartition is O(n); only the k survivors are ever sorted.
        if 0 < cfg.top_k < n:
            cand = np.argpartition(x, n - cfg.top_k)[n - cfg.top_k :]
            v = x[cand]
        else:
            cand = np.arange(n)
            v = x
        use_top_p = cfg.top_p < 1.0
        use_min_p = cfg.min_p > 0.0
        if not (use_top_p or use_min_p):
            return cand, v

        if use_min_p:
            # min-p keeps a prefix of the sorted order, and so does top-p: the result is the shorter prefix.
            # Top-p's mass is still normalised over all top-k survivors below, so this prefilter is exact.
            pool = np.flatnonzero(v >= xmax + math.log(cfg.min_p))
            if not use_top_p:
                return cand[pool], v[pool]
        # Probabilities at temperature 1 over the top-k survivors (xmax is theirs too: top-k keeps it).
        w = np.exp(v.astype(np.float64) - xmax)
        total = w.sum()
        if not use_min_p:
            # No bound from min-p: take the tokens within `delta` of the max, widening until they hold the
            # mass, then sort only those. A threshold scan is linear and, unlike argpartition, is not slowed
            # down by large blocks of tied logits (masked tokens, flat tails).
            for delta in _TOP_P_DELTAS:
                pool = np.flatnonzero(v >= xmax - delta)
                if delta == math.inf or w[pool].sum() >= cfg.top_p * total:
                    break
        order = pool[np.argsort(-v[pool], kind="stable")]
        order = order[: _top_p_cut(w[order], total, cfg.top_p)]
        return cand[order], v[order]


def _top_p_cut(w_sorted: np.ndarray, total: float, top_p: float) -> int:
    """How many of the descending weights form the smallest prefix with mass >= top_p (at least one)."""
    cum = np.cumsum(w_sorted) / total
    return min(int(np.searchsorted(cum, top_p, side="left")) + 1, len(w_sorted))

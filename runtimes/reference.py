"""The numpy reference executor of the graph IR: the oracle every target, recipe and format is checked against.

Float32 throughout. Weights are dequantized once at load. The KV cache is float32 per layer, written at the
positions given, so a prompt can be fed in chunks and then one token at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from polystrata.ir.graph import Graph, Node, Value

OpImpl = Callable[["ReferenceExecutor", Node, list], np.ndarray]
_IMPLS: dict[str, OpImpl] = {}


def _impl(name: str):
    def reg(fn: OpImpl) -> OpImpl:
        _IMPLS[name] = fn
        return fn

    return reg


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x), without overflow warnings for large negative x."""
    with np.errstate(over="ignore"):
        return x / (np.float32(1) + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU with the tanh approximation (what Gemma uses)."""
    c = np.float32(np.sqrt(2.0 / np.pi))
    return np.float32(0.5) * x * (np.float32(1) + np.tanh(c * (x + np.float32(0.044715) * x * x * x)))


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Numerically stable softmax."""
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def rope_angles(positions: np.ndarray, dims: int, base: float, freq_scale: float) -> np.ndarray:
    """Rotation angle per (position, pair): pos * freq_scale * base^(-2i/dims)."""
    inv = base ** (-np.arange(0, dims, 2, dtype=np.float64) / dims)
    return positions.astype(np.float64)[:, None] * freq_scale * inv[None, :]


def apply_rope(x: np.ndarray, positions: np.ndarray, dims: int, base: float, freq_scale: float, mode: str):
    """Rotate the first `dims` features of every head of x [T, H, D].

    mode "normal" rotates adjacent pairs (x0, x1), "neox" rotates (x_i, x_{i+dims/2}).
    """
    ang = rope_angles(positions, dims, base, freq_scale)
    cos = np.cos(ang).astype(np.float32)[:, None, :]
    sin = np.sin(ang).astype(np.float32)[:, None, :]
    out = x.copy()
    if mode == "normal":
        a, b = x[..., 0:dims:2], x[..., 1:dims:2]
        out[..., 0:dims:2] = a * cos - b * sin
        out[..., 1:dims:2] = a * sin + b * cos
    elif mode == "neox":
        h = dims // 2
        a, b = x[..., :h], x[..., h:dims]
        out[..., :h] = a * cos - b * sin
        out[..., h:dims] = a * sin + b * cos
    else:
        raise ValueError(f"unknown rope mode {mode!r}")
    return out


class OneSequence:
    """What the executors (this one, `compiler.executor.PlanExecutor`) share: one sequence in the KV cache, `n_past`
    tokens of at most `n_ctx`, fed by `forward` through their `step` (which takes rows of any sequences)."""

    n_ctx: int
    n_past: int = 0

    def reset(self) -> None:
        """Forget the sequence: the next forward starts at position 0 (KV rows past n_past are never read)."""
        self.n_past = 0

    def forward(self, graph: Graph, tokens: np.ndarray) -> np.ndarray:
        """Run one step on `tokens`, at positions continuing the KV cache; returns the graph's first output."""
        t = len(tokens)
        if self.n_past + t > self.n_ctx:
            raise ValueError(f"context full: {self.n_past} + {t} tokens > n_ctx {self.n_ctx}")
        out = self.step(graph, tokens, np.arange(self.n_past, self.n_past + t, dtype=np.int32))
        self.n_past += t
        return out

    def step(self, graph: Graph, tokens: np.ndarray, positions: np.ndarray,
             starts: np.ndarray | None = None) -> np.ndarray:
        raise NotImplementedError


class ReferenceExecutor(OneSequence):
    """Runs graphs of one model on numpy, sharing dequantized weights and the KV cache between them.

    `weights` maps a GGUF tensor name to its float32 array (numpy shape order).
    """

    def __init__(self, weights: Mapping[str, np.ndarray], n_ctx: int):
        self.weights = weights
        self.n_ctx = n_ctx
        self.kv: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.n_past = 0
        self.starts: np.ndarray | None = None  # the step's sequence starts in the cache (None: all 0)

    @classmethod
    def from_file(cls, file, graph: Graph, n_ctx: int) -> ReferenceExecutor:
        """Dequantize the weights `graph` uses from a GGUFFile, in the shapes the graph declares."""
        weights = {name: file.dequantize(name).reshape(v.type.shape) for name, v in graph.weights.items()}
        return cls(weights, n_ctx)

    def step(self, graph: Graph, tokens: np.ndarray, positions: np.ndarray,
             starts: np.ndarray | None = None) -> np.ndarray:
        """One step over rows of (token, position in its sequence, cache row where its sequence begins: `starts`,
        None for all 0), as `PlanExecutor.step`; `n_past` is left as it is."""
        t = len(tokens)
        self.starts = np.zeros(t, np.int32) if starts is None else np.asarray(starts, np.int32)
        env: dict[int, object] = {}
        tok_in, pos_in = graph.inputs
        env[id(tok_in)] = np.asarray(tokens, dtype=np.int32)
        env[id(pos_in)] = np.asarray(positions, dtype=np.int32)
        for name, v in graph.weights.items():
            env[id(v)] = self.weights[name]
        for node in graph.nodes:
            args = [env[id(v)] for v in node.inputs]
            env[id(node.output)] = _IMPLS[node.op](self, node, args)
        return env[id(graph.outputs[0])]

    def cache(self, layer: int, hkv: int, dk: int, dv: int) -> tuple[np.ndarray, np.ndarray]:
        """The layer's (K, V) cache arrays, allocated on first use."""
        if layer not in self.kv:
            self.kv[layer] = (
                np.zeros((self.n_ctx, hkv, dk), np.float32),
                np.zeros((self.n_ctx, hkv, dv), np.float32),
            )
        return self.kv[layer]


def _concrete(shape: tuple, x: np.ndarray) -> tuple[int, ...]:
    t = x.shape[0]
    return tuple(t if d == "T" else d for d in shape)


@_impl("embed")
def _embed(ex, node, a):
    w, tok = a
    return w[tok]


@_impl("matmul")
def _matmul(ex, node, a):
    x, w = a
    return x @ w.T


@_impl("add")
def _add(ex, node, a):
    return a[0] + a[1]


@_impl("mul")
def _mul(ex, node, a):
    return a[0] * a[1]


@_impl("scale")
def _scale(ex, node, a):
    return a[0] * np.float32(node.attrs["factor"])


@_impl("rms_norm")
def _rms_norm(ex, node, a):
    x, w = a
    ms = np.mean(np.square(x, dtype=np.float32), axis=-1, keepdims=True, dtype=np.float32)
    return x / np.sqrt(ms + np.float32(node.attrs["eps"])) * w


@_impl("reshape")
def _reshape(ex, node, a):
    return a[0].reshape(_concrete(node.attrs["shape"], a[0]))


@_impl("rope")
def _rope(ex, node, a):
    x, pos = a
    at = node.attrs
    return apply_rope(x, pos, at["dims"], at["base"], at["freq_scale"], at["mode"])


@_impl("attention")
def _attention(ex, node, a):
    q, k, v, pos = a
    t, hq, _ = q.shape
    kc, vc = ex.cache(node.attrs["layer"], k.shape[1], q.shape[2], v.shape[2])
    starts = ex.starts if ex.starts is not None else np.zeros(t, np.int32)
    out = np.empty((t, hq, v.shape[2]), np.float32)
    # Each sequence (rows of one start) attends over its own run of cache rows.
    for s0 in np.unique(starts):
        rows = np.flatnonzero(starts == s0)
        out[rows] = _attend(node.attrs, q[rows], k[rows], v[rows], pos[rows], kc[s0:], vc[s0:])
    return out


def _attend(at, q, k, v, pos, kc, vc):
    """Causal attention of one sequence's rows, its K/V written into its cache rows `kc`, `vc` at `pos`."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    kc[pos] = k
    vc[pos] = v
    s = int(pos.max()) + 1
    keys, vals = kc[:s], vc[:s]
    g = hq // hkv
    qg = q.reshape(t, hkv, g, d)
    scores = np.einsum("thgd,shd->hgts", qg, keys) * np.float32(at["scale"])
    if at["softcap"]:
        c = np.float32(at["softcap"])
        scores = c * np.tanh(scores / c)
    kpos = np.arange(s)
    masked = kpos[None, :] > pos[:, None]
    if at["window"]:
        masked |= (pos[:, None] - kpos[None, :]) >= at["window"]
    scores = np.where(masked[None, None], np.float32(-np.inf), scores)
    p = softmax(scores, axis=-1).astype(np.float32)
    out = np.einsum("hgts,shd->thgd", p, vals)
    return out.reshape(t, hq, vals.shape[2])


@_impl("swiglu")
def _swiglu(ex, node, a):
    return silu(a[0]) * a[1]


@_impl("geglu")
def _geglu(ex, node, a):
    return gelu_tanh(a[0]) * a[1]


@_impl("sigmoid_mul")
def _sigmoid_mul(ex, node, a):
    x, gate = a
    with np.errstate(over="ignore"):
        return x / (np.float32(1) + np.exp(-gate))


@_impl("router")
def _router(ex, node, a):
    (logits,) = a
    k = node.attrs["k"]
    probs = softmax(logits, axis=-1)
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(probs, ids, axis=-1)
    if node.attrs["norm"]:
        w = w / w.sum(axis=-1, keepdims=True)
    return ids.astype(np.int32), w.astype(np.float32)


@_impl("moe_ffn")
def _moe_ffn(ex, node, a):
    x, (ids, w), gate, up, down = a
    out = np.zeros_like(x)
    for e in np.unique(ids):
        rows, slots = np.nonzero(ids == e)
        h = x[rows]
        y = (silu(h @ gate[e].T) * (h @ up[e].T)) @ down[e].T
        np.add.at(out, rows, y * w[rows, slots][:, None])
    return out


@_impl("last_row")
def _last_row(ex, node, a):
    return a[0][-1:]


def check_complete() -> None:
    """Every op of the graph IR has a reference implementation (a test calls this)."""
    from polystrata.ir.graph import OPS

    missing = set(OPS) - set(_IMPLS)
    if missing:
        raise AssertionError(f"reference executor lacks ops {sorted(missing)}")


__all__ = ["OneSequence", "ReferenceExecutor", "Value", "apply_rope", "gelu_tanh", "silu", "softmax", "check_complete"]

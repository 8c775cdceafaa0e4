"""The numpy reference executor of the graph IR: the oracle every target, recipe and format is checked against.

Float32 throughout. Weights are dequantized once at load. The KV cache is float32 per layer, written at the
positions given, so a prompt can be fed in chunks and then one token at a time. Linear-attention layers keep their
recurrent state (the conv rows and the delta rule's matrices, `RECURRENT_OPS`) per layer beside it: zero at the
start of a sequence, carried from one step to the next.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

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
             starts: np.ndarray | None = None, rows: Sequence[int] | None = None,
             launched: Callable[[], None] | None = None) -> np.ndarray:
        raise NotImplementedError


class ReferenceExecutor(OneSequence):
    """Runs graphs of one model on numpy, sharing dequantized weights and the KV cache between them.

    `weights` maps a GGUF tensor name to its float32 array (numpy shape order).
    """

    def __init__(self, weights: Mapping[str, np.ndarray], n_ctx: int):
        self.weights = weights
        self.n_ctx = n_ctx
        self.kv: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.states: dict[tuple[str, int], np.ndarray] = {}
        self.n_past = 0
        self.starts: np.ndarray | None = None  # the step's sequence starts in the cache (None: all 0)

    @classmethod
    def from_file(cls, file, graph: Graph, n_ctx: int) -> ReferenceExecutor:
        """Dequantize the weights `graph` uses from a GGUFFile, in the shapes the graph declares."""
        weights = {name: file.dequantize(name).reshape(v.type.shape) for name, v in graph.weights.items()}
        return cls(weights, n_ctx)

    def reset(self) -> None:
        """Forget the conversation: the next forward starts at position 0, with zero recurrent state."""
        self.n_past = 0
        self.states.clear()

    def save_state(self) -> dict[tuple[str, int], np.ndarray]:
        """A copy of the recurrent states (for `Engine.checkpoint`)."""
        return {key: st.copy() for key, st in self.states.items()}

    def load_state(self, saved: dict[tuple[str, int], np.ndarray]) -> None:
        """Put back states `save_state` returned."""
        self.states = {key: st.copy() for key, st in saved.items()}

    def step(self, graph: Graph, tokens: np.ndarray, positions: np.ndarray,
             starts: np.ndarray | None = None, rows: Sequence[int] | None = None,
             launched: Callable[[], None] | None = None) -> np.ndarray:
        """One step over rows of (token, position in its sequence, cache row where its sequence begins: `starts`,
        None for all 0), as `PlanExecutor.step`, returning the logits (with `rows`: those rows of them); `n_past`
        is left as it is. `launched` is called first (numpy has no queue to fill before the work)."""
        if launched is not None:
            launched()
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
        out = env[id(graph.outputs[0])]
        return out if rows is None else out[np.asarray(rows, dtype=np.intp)]

    def cache(self, layer: int, hkv: int, dk: int, dv: int) -> tuple[np.ndarray, np.ndarray]:
        """The layer's (K, V) cache arrays, allocated on first use."""
        if layer not in self.kv:
            self.kv[layer] = (
                np.zeros((self.n_ctx, hkv, dk), np.float32),
                np.zeros((self.n_ctx, hkv, dv), np.float32),
            )
        return self.kv[layer]

    def state(self, op: str, layer: int, shape: tuple[int, ...]) -> np.ndarray:
        """The recurrent state of `op` in `layer` for this sequence, zero on first use."""
        key = (op, layer)
        if key not in self.states:
            self.states[key] = np.zeros(shape, np.float32)
        return self.states[key]


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


@_impl("last_rows")
def _last_rows(ex, node, a):
    return a[0][max(len(a[0]) - node.attrs["n"], 0):]


@_impl("slice")
def _slice(ex, node, a):
    return np.ascontiguousarray(a[0][..., node.attrs["start"] : node.attrs["stop"]])


def l2_normalize(x: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(sum(x^2) + eps) over the last dim."""
    return x / np.sqrt(np.sum(np.square(x), axis=-1, keepdims=True, dtype=np.float32) + np.float32(eps))


@_impl("l2_norm")
def _l2_norm(ex, node, a):
    return l2_normalize(a[0], node.attrs["eps"])


@_impl("rms_norm_gated")
def _rms_norm_gated(ex, node, a):
    x, w, gate = a
    return _rms_norm(ex, node, [x, w]) * silu(gate)


@_impl("ssm_conv")
def _ssm_conv(ex, node, a):
    x, w = a
    c, k = w.shape
    state = ex.state("ssm_conv", node.attrs["layer"], (k - 1, c))
    xs = np.concatenate([state, x], axis=0)
    t = len(x)
    out = np.zeros_like(x)
    for j in range(k):
        out += xs[j : j + t] * w[:, j]
    state[...] = xs[len(xs) - (k - 1) :]
    return silu(out)


@_impl("gdn_gates")
def _gdn_gates(ex, node, a):
    alpha, beta, dt_bias, decay = a
    log_decay = decay * np.logaddexp(np.float32(0), alpha + dt_bias)  # a * softplus(alpha + dt_bias)
    with np.errstate(over="ignore"):
        rate = np.float32(1) / (np.float32(1) + np.exp(-beta))
    return np.stack([log_decay, rate], axis=-1).astype(np.float32)


def _heads_for_values(x: np.ndarray, hv: int, head_map: str) -> np.ndarray:
    """[T, Hk, D] -> [T, Hv, D]: the key head each value head reads."""
    r = hv // x.shape[1]
    return np.tile(x, (1, r, 1)) if head_map == "tiled" else np.repeat(x, r, axis=1)


def delta_rule_recurrent(q, k, v, gates, state, scale: float, head_map: str) -> np.ndarray:
    """The gated delta rule token by token (the decode form); updates `state` [Hv, Dk, Dv] in place and returns
    the output [T, Hv, Dv]. q, k [T, Hk, Dk], v [T, Hv, Dv], gates [T, Hv, 2] (log decay, rate)."""
    hv = v.shape[1]
    q = _heads_for_values(q, hv, head_map) * np.float32(scale)
    k = _heads_for_values(k, hv, head_map)
    out = np.empty_like(v)
    for t in range(len(v)):
        state *= np.exp(gates[t, :, 0])[:, None, None]
        kv_mem = np.einsum("hk,hkv->hv", k[t], state)
        delta = (v[t] - kv_mem) * gates[t, :, 1:2]
        state += k[t][:, :, None] * delta[:, None, :]
        out[t] = np.einsum("hk,hkv->hv", q[t], state)
    return out


def delta_rule_chunked(q, k, v, gates, state, scale: float, head_map: str, chunk: int) -> np.ndarray:
    """The gated delta rule in chunks of `chunk` tokens (the prefill form): within a chunk the sequential updates
    are one unit-lower-triangular solve (the WY / UT representation), between chunks the state carries them.
    Same arguments and result as `delta_rule_recurrent`."""
    hv = v.shape[1]
    q = (_heads_for_values(q, hv, head_map) * np.float32(scale)).transpose(1, 0, 2)  # [H, T, Dk]
    k = _heads_for_values(k, hv, head_map).transpose(1, 0, 2)
    v = v.transpose(1, 0, 2)  # [H, T, Dv]
    g, beta = gates[:, :, 0].T, gates[:, :, 1].T  # [H, T]
    out = np.empty_like(v)
    for s in range(0, v.shape[1], chunk):
        e = min(s + chunk, v.shape[1])
        n = e - s
        qc, kc, vc, bc = q[:, s:e], k[:, s:e], v[:, s:e], beta[:, s:e, None]
        gc = np.cumsum(g[:, s:e], axis=1)  # log decay from the chunk's start to each token
        lower = np.tril(np.ones((n, n), bool))
        # decay[h, i, j] = exp(gc_i - gc_j) for j <= i: the decay between tokens j and i
        decay = np.exp(np.where(lower, gc[:, :, None] - gc[:, None, :], -np.inf)).astype(np.float32)
        kb = kc * bc
        # (I + strictly-lower(beta_i k_i . k_j decay_ij)) w = rhs: the chunk's sequential updates at once
        system = np.where(np.tril(np.ones((n, n), bool), -1), (kb @ kc.transpose(0, 2, 1)) * decay, 0)
        system += np.eye(n, dtype=np.float32)
        rhs = np.concatenate([vc * bc, kb * np.exp(gc)[:, :, None]], axis=2)
        solved = np.linalg.solve(system, rhs).astype(np.float32)
        u, w = solved[:, :, : vc.shape[2]], solved[:, :, vc.shape[2] :]
        v_new = u - w @ state  # what each token writes, less what the state before the chunk predicts
        attn = (qc @ kc.transpose(0, 2, 1)) * decay
        out[:, s:e] = (qc * np.exp(gc)[:, :, None]) @ state + attn @ v_new
        last = gc[:, -1:]
        state *= np.exp(last)[:, :, None]
        state += (kc * np.exp(last - gc)[:, :, None]).transpose(0, 2, 1) @ v_new
    return out.transpose(1, 0, 2)


@_impl("delta_rule")
def _delta_rule(ex, node, a):
    q, k, v, gates = a
    at = node.attrs
    state = ex.state("delta_rule", at["layer"], (v.shape[1], q.shape[2], v.shape[2]))
    if len(v) == 1:
        return delta_rule_recurrent(q, k, v, gates, state, at["scale"], at["head_map"])
    return delta_rule_chunked(q, k, v, gates, state, at["scale"], at["head_map"], at["chunk"])


def check_complete() -> None:
    """Every op of the graph IR has a reference implementation (a test calls this)."""
    from polystrata.ir.graph import OPS

    missing = set(OPS) - set(_IMPLS)
    if missing:
        raise AssertionError(f"reference executor lacks ops {sorted(missing)}")


__all__ = [
    "OneSequence", "ReferenceExecutor", "Value", "apply_rope", "check_complete", "delta_rule_chunked",
    "delta_rule_recurrent", "gelu_tanh", "l2_normalize", "silu", "softmax",
]

"""Graph IR: a model's forward step as typed values and ops.

A `Graph` is a list of `Node`s in execution order over SSA `Value`s. Every value has a `TensorType`: an element
type and a shape whose entries are ints or symbolic names (``"T"``, the number of tokens in this step). Weights are
graph inputs that name a GGUF tensor and carry its storage format; the KV cache is state owned by the executor,
reached only through the `attention` op (which appends this step's keys and values, then attends); the recurrent
state of linear-attention layers likewise, only through `ssm_conv` and `delta_rule` (`RECURRENT_OPS`).

Each op is declared once in `OPS` with its arity, attributes and shape rule, so the verifier, the printer, the
reference executor and (later) the compiler passes all read the same table.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

Dim = int | str
Shape = tuple[Dim, ...]


class GraphError(ValueError):
    """The graph is malformed: a bug in a model builder or a pass, never the user's input."""


@dataclass(frozen=True)
class TensorType:
    """Element type (``f32``, ``i32`` or a storage format name for weights) and shape."""

    dtype: str
    shape: Shape

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(str(d) for d in self.shape)}]"


@dataclass(eq=False)
class Value:
    """One SSA value. `weight` is the GGUF tensor name for weight inputs, else None."""

    name: str
    type: TensorType
    weight: str | None = None

    def __repr__(self) -> str:
        return f"%{self.name}"


@dataclass(eq=False)
class Node:
    """One op application: inputs and attributes in, one output value."""

    op: str
    inputs: tuple[Value, ...]
    attrs: dict[str, Any]
    output: Value


@dataclass(frozen=True)
class OpDef:
    """Declaration of an op: input names, required attributes, and the output-type rule."""

    inputs: tuple[str, ...]
    attrs: tuple[str, ...]
    infer: Callable[[Sequence[TensorType], dict[str, Any]], TensorType]
    doc: str


def _same(i: int = 0) -> Callable[[Sequence[TensorType], dict], TensorType]:
    return lambda ts, a: TensorType("f32", ts[i].shape)


def _check_dim(a: Dim, b: Dim, what: str) -> None:
    if a != b:
        raise GraphError(f"{what}: dimension {a} does not match {b}")


def _infer_matmul(ts, a):
    x, w = ts
    _check_dim(x.shape[-1], w.shape[-1], "matmul")
    return TensorType("f32", x.shape[:-1] + (w.shape[0],))


def _infer_embed(ts, a):
    w, tok = ts
    if tok.dtype != "i32":
        raise GraphError("embed: token ids must be i32")
    return TensorType("f32", tok.shape + (w.shape[1],))


def _infer_reshape(ts, a):
    return TensorType(ts[0].dtype, tuple(a["shape"]))


def _infer_binary(ts, a):
    x, y = ts
    # y broadcasts over leading dims of x (bias vectors, norm weights).
    if tuple(x.shape[len(x.shape) - len(y.shape):]) != tuple(y.shape):
        raise GraphError(f"elementwise op: {y} does not broadcast to {x}")
    return TensorType("f32", x.shape)


def _infer_norm(ts, a):
    x, w = ts
    _check_dim(x.shape[-1], w.shape[-1], "rms_norm")
    return TensorType("f32", x.shape)


def _infer_glu(ts, a):
    g, u = ts
    if g.shape != u.shape:
        raise GraphError(f"gated activation: {g} and {u} differ")
    return TensorType("f32", g.shape)


def _infer_attention(ts, a):
    q, k, v, pos = ts
    t, hq, d = q.shape
    _check_dim(k.shape[0], t, "attention k")
    _check_dim(v.shape[0], t, "attention v")
    if hq % k.shape[1]:
        raise GraphError(f"attention: {hq} query heads not a multiple of {k.shape[1]} kv heads")
    return TensorType("f32", (t, hq, v.shape[2]))


def _infer_router(ts, a):
    (logits,) = ts
    # A route is a pair per token and slot: the expert id and its weight.
    return TensorType("route", (logits.shape[0], a["k"]))


def _infer_moe(ts, a):
    x, route, gate, up, down = ts
    _check_dim(gate.shape[2], x.shape[1], "moe_ffn gate")
    _check_dim(down.shape[1], x.shape[1], "moe_ffn down")
    return TensorType("f32", x.shape)


def _infer_last(ts, a):
    n = a["n"]
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise GraphError(f"last_rows takes n >= 1 rows, not {n!r}")
    return TensorType(ts[0].dtype, (n,) + ts[0].shape[1:])


def _infer_slice(ts, a):
    (x,) = ts
    start, stop = a["start"], a["stop"]
    if not 0 <= start < stop <= x.shape[-1]:
        raise GraphError(f"slice [{start}:{stop}] outside the last dimension of {x}")
    return TensorType("f32", x.shape[:-1] + (stop - start,))


def _infer_ssm_conv(ts, a):
    x, w = ts
    _check_dim(x.shape[-1], w.shape[0], "ssm_conv channels")
    if len(x.shape) != 2 or len(w.shape) != 2:
        raise GraphError(f"ssm_conv: x {x} must be [T, C] and the weight {w} [C, K]")
    return TensorType("f32", x.shape)


def _infer_gdn_gates(ts, a):
    alpha, beta, dt_bias, decay = ts
    if alpha.shape != beta.shape or len(alpha.shape) != 2:
        raise GraphError(f"gdn_gates: alpha {alpha} and beta {beta} must both be [T, H]")
    _check_dim(dt_bias.shape[-1], alpha.shape[1], "gdn_gates dt_bias")
    _check_dim(decay.shape[-1], alpha.shape[1], "gdn_gates a")
    return TensorType("f32", alpha.shape + (2,))


def _infer_delta_rule(ts, a):
    q, k, v, gates = ts
    if q.shape != k.shape or len(q.shape) != 3 or len(v.shape) != 3:
        raise GraphError(f"delta_rule: q {q} and k {k} must be [T, Hk, Dk] and v {v} [T, Hv, Dv]")
    t, hk, _ = q.shape
    _check_dim(v.shape[0], t, "delta_rule v")
    if v.shape[1] % hk:
        raise GraphError(f"delta_rule: {v.shape[1]} value heads not a multiple of {hk} key heads")
    if gates.shape != (t, v.shape[1], 2):
        raise GraphError(f"delta_rule: gates {gates} must be [T, Hv, 2]")
    if a["head_map"] not in ("tiled", "grouped"):
        raise GraphError(f"delta_rule: unknown head_map {a['head_map']!r}")
    return TensorType("f32", v.shape)


def _infer_norm_gated(ts, a):
    x, w, gate = ts
    _check_dim(x.shape[-1], w.shape[-1], "rms_norm_gated")
    if gate.shape != x.shape:
        raise GraphError(f"rms_norm_gated: gate {gate} differs from x {x}")
    return TensorType("f32", x.shape)


OPS: dict[str, OpDef] = {
    "embed": OpDef(("weight", "tokens"), (), _infer_embed, "rows of an embedding table"),
    "matmul": OpDef(("x", "weight"), (), _infer_matmul, "x @ weight.T (weight is [out, in])"),
    "add": OpDef(("x", "y"), (), _infer_binary, "x + y, y broadcast over leading dims"),
    "mul": OpDef(("x", "y"), (), _infer_binary, "x * y, y broadcast over leading dims"),
    "scale": OpDef(("x",), ("factor",), _same(), "x * factor"),
    "rms_norm": OpDef(("x", "weight"), ("eps",), _infer_norm, "x / rms(x) * weight over the last dim"),
    "reshape": OpDef(("x",), ("shape",), _infer_reshape, "same elements, new shape"),
    "rope": OpDef(
        ("x", "positions"),
        ("base", "dims", "mode", "freq_scale"),
        _same(),
        "rotary embedding on the first `dims` of each head; mode normal (adjacent pairs) or neox (halves)",
    ),
    "attention": OpDef(
        ("q", "k", "v", "positions"),
        ("layer", "scale", "window", "softcap"),
        _infer_attention,
        "append k, v to the layer's KV cache at positions, then causal attention (window 0 = global)",
    ),
    "swiglu": OpDef(("gate", "up"), (), _infer_glu, "silu(gate) * up"),
    "geglu": OpDef(("gate", "up"), (), _infer_glu, "gelu_tanh(gate) * up"),
    "sigmoid_mul": OpDef(
        ("x", "gate"), (), _same(), "x * sigmoid(gate), gate [T, 1] broadcast or of x's shape (an output gate)"
    ),
    "router": OpDef(
        ("logits",),
        ("k", "norm"),
        _infer_router,
        "softmax over experts, then top-k (expert id, weight) per token; weights renormalised when norm",
    ),
    "moe_ffn": OpDef(
        ("x", "route", "gate_exps", "up_exps", "down_exps"),
        (),
        _infer_moe,
        "sum over the routed experts of weight * down(swiglu(gate x, up x))",
    ),
    "last_rows": OpDef(
        ("x",),
        ("n",),
        _infer_last,
        "the step's last min(T, n) token rows: row i is x[T - min(T, n) + i]; its type says [n, ...], the most rows "
        "it has (one such op a graph: its row count is the step symbol T_last of every kernel after it)",
    ),
    "slice": OpDef(("x",), ("start", "stop"), _infer_slice, "x[..., start:stop] (a copy)"),
    "l2_norm": OpDef(("x",), ("eps",), _same(), "x / sqrt(sum(x^2) + eps) over the last dim"),
    "rms_norm_gated": OpDef(
        ("x", "weight", "gate"), ("eps",), _infer_norm_gated, "rms_norm(x) * weight * silu(gate) over the last dim"
    ),
    # The recurrent ops: each layer's state lives in the executor beside the KV cache, one per sequence, zero at
    # its start and carried from step to step (see `RECURRENT_OPS`).
    "ssm_conv": OpDef(
        ("x", "weight"),
        ("layer",),
        _infer_ssm_conv,
        "silu of the causal depthwise convolution (kernel K) of x [T, C] preceded by the layer's conv state, "
        "the previous K-1 rows of x; the state then keeps the last K-1 rows",
    ),
    "gdn_gates": OpDef(
        ("alpha", "beta", "dt_bias", "a"),
        (),
        _infer_gdn_gates,
        "[T, H, 2]: the gated delta rule's log decay a * softplus(alpha + dt_bias) and its rate sigmoid(beta)",
    ),
    "delta_rule": OpDef(
        ("q", "k", "v", "gates"),
        ("layer", "scale", "head_map", "chunk"),
        _infer_delta_rule,
        "gated delta rule over the layer's state S [Hv, Dk, Dv], per token: S *= exp(g); "
        "S += k (beta (v - k S))^T; out = scale q S. Value head h reads key head h % Hk (head_map tiled) or "
        "h // (Hv / Hk) (grouped); steps of several tokens may run chunks of `chunk` tokens in the WY form",
    ),
}

# Ops that read and write per-sequence state of their `layer` (besides `attention`'s KV cache).
RECURRENT_OPS = ("ssm_conv", "delta_rule")


@dataclass
class Graph:
    """A forward step. `inputs` are the runtime inputs (tokens, positions), `weights` the GGUF tensors used."""

    arch: str
    inputs: list[Value] = field(default_factory=list)
    weights: dict[str, Value] = field(default_factory=dict)
    nodes: list[Node] = field(default_factory=list)
    outputs: list[Value] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    _names: set[str] = field(default_factory=set, repr=False)

    def _fresh(self, hint: str) -> str:
        name, n = hint, 1
        while name in self._names:
            n += 1
            name = f"{hint}.{n}"
        self._names.add(name)
        return name

    def input(self, name: str, dtype: str, shape: Shape) -> Value:
        """Declare a runtime input."""
        v = Value(self._fresh(name), TensorType(dtype, tuple(shape)))
        self.inputs.append(v)
        return v

    def weight(self, tensor: str, fmt: str, shape: Shape) -> Value:
        """Declare (once) a weight input backed by the GGUF tensor `tensor`."""
        if tensor not in self.weights:
            self.weights[tensor] = Value(self._fresh(tensor), TensorType(fmt, tuple(shape)), weight=tensor)
        return self.weights[tensor]

    def op(self, op: str, *inputs: Value, name: str | None = None, **attrs: Any) -> Value:
        """Append a node, inferring its output type from the op's declaration."""
        d = OPS.get(op)
        if d is None:
            raise GraphError(f"unknown op {op!r}")
        if len(inputs) != len(d.inputs):
            raise GraphError(f"{op}: expected {len(d.inputs)} inputs, got {len(inputs)}")
        missing = [a for a in d.attrs if a not in attrs]
        if missing:
            raise GraphError(f"{op}: missing attributes {missing}")
        out = Value(self._fresh(name or op), d.infer([v.type for v in inputs], attrs))
        self.nodes.append(Node(op, tuple(inputs), dict(attrs), out))
        return out

    def verify(self) -> None:
        """Check that every value is defined before use, once, and that every node's types follow its op."""
        defined = {id(v) for v in self.inputs} | {id(v) for v in self.weights.values()}
        for n in self.nodes:
            d = OPS.get(n.op)
            if d is None:
                raise GraphError(f"unknown op {n.op!r}")
            for v in n.inputs:
                if id(v) not in defined:
                    raise GraphError(f"{n.op} -> %{n.output.name}: input %{v.name} used before definition")
            expect = d.infer([v.type for v in n.inputs], n.attrs)
            if expect != n.output.type:
                raise GraphError(f"%{n.output.name}: type {n.output.type} but {n.op} gives {expect}")
            if id(n.output) in defined:
                raise GraphError(f"%{n.output.name} defined twice")
            defined.add(id(n.output))
        for v in self.outputs:
            if id(v) not in defined:
                raise GraphError(f"output %{v.name} is never computed")
        if sum(n.op == "last_rows" for n in self.nodes) > 1:
            raise GraphError("a graph has one last_rows op at most (the rows after it are one step symbol, T_last)")

    def last_rows(self) -> int | None:
        """The n of the graph's `last_rows` op (whose step keeps min(T, n) rows), None where it has none."""
        return next((n.attrs["n"] for n in self.nodes if n.op == "last_rows"), None)

    def recurrent(self) -> bool:
        """Whether the graph keeps recurrent state (`RECURRENT_OPS`), which cannot be rewound like a KV cache."""
        return any(n.op in RECURRENT_OPS for n in self.nodes)

    def summary(self) -> dict[str, Any]:
        """Counts used in compile manifests and `info`."""
        ops: dict[str, int] = {}
        for n in self.nodes:
            ops[n.op] = ops.get(n.op, 0) + 1
        return {"arch": self.arch, "nodes": len(self.nodes), "weights": len(self.weights), "ops": ops}

    def dump(self) -> str:
        """Readable text form, one line per value."""
        lines = [f"graph {self.arch} {{"]
        for k, v in self.meta.items():
            lines.append(f"  # {k} = {v}")
        for v in self.inputs:
            lines.append(f"  input %{v.name}: {v.type}")
        for v in self.weights.values():
            lines.append(f"  weight %{v.name}: {v.type}")
        for n in self.nodes:
            args = ", ".join(f"%{v.name}" for v in n.inputs)
            attrs = "".join(f", {k}={_fmt_attr(a)}" for k, a in n.attrs.items())
            lines.append(f"  %{n.output.name}: {n.output.type} = {n.op}({args}{attrs})")
        lines.append(f"  return {', '.join(f'%{v.name}' for v in self.outputs)}")
        lines.append("}")
        return "\n".join(lines)


def _fmt_attr(a: Any) -> str:
    if isinstance(a, float):
        return f"{a:g}"
    if isinstance(a, (list, tuple)):
        return "(" + ", ".join(_fmt_attr(x) for x in a) + ")"
    return str(a)

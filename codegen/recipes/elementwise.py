"""Elementwise and row-wise recipes: add, mul, scale, swiglu/geglu (unfused), sigmoid_mul, last_rows, rms_norm,
fused add + rms_norm, rope.

Elementwise kernels: grid (tokens, ceil(C / chunk)), a LaneFor over the chunk. Row kernels (norms): grid over
rows, a Reduce over the row then a LaneFor writing it; where the next matmuls read int8 activations, the norm
writes them too and `provides` their quantize launch. Knob: chunk (elements per group). `rope_value` is the one
rope formula (the rope kernel's and the fused K/V store's, see `attention`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

from polystrata.codegen.recipes import (
    Knob,
    KnobSpace,
    Recipe,
    RecipeContext,
    kernel_builder,
    recipe_named,
    register,
    token_binding,
)
from polystrata.codegen.recipes._matvec import QB
from polystrata.codegen.recipes.linear import (
    ACTIVATIONS,
    quantize_staged,
    quantized_output,
    staged,
    staged_locals,
    value_format,
)
from polystrata.ir.expr import Const, Expr, Var
from polystrata.ir.graph import Node, Value
from polystrata.ir.kernel import (
    Buf,
    Call,
    Cast,
    If,
    Kernel,
    LaneFor,
    Launch,
    Let,
    Load,
    Reduce,
    Scalar,
    Select,
    Store,
    name_tag,
    stable_digest,
)

CHUNK = 256
QUANT_LOCAL_BYTES = 40 * 1024  # the most local memory a norm may keep its row (and int8 output) in (of 48 KB)


def _per_token(v: Value) -> int:
    return math.prod(int(d) for d in v.type.shape[1:]) if v.type.shape[0] == "T" else math.prod(
        int(d) for d in v.type.shape)


@kernel_builder
def elementwise_kernel(name: str, ins: Sequence[tuple[str, int]], per: int, fn: Callable[[list[Expr]], Expr],
                       chunk: int, lanes: int, then: Callable[[Expr, list[Expr]], Expr] | None = None) -> Kernel:
    """out[t, c] = fn(in_j[t, c % size_j ...]); `ins` are (name, elements per token or -size for broadcast).
    `then`: a second op in the same launch, y = then(fn's value, the inputs' values), fn's value stored as y0."""
    chunk = max(1, min(chunk, per))
    c = Var("g1") * chunk + Var("l")
    vals = []
    for nm, size in ins:
        if size < 0:  # broadcast over tokens: a [size] vector repeating along the row
            vals.append(Load(nm, c % (-size)))
        else:  # per token: size elements per token, repeating along the row when smaller than it
            vals.append(Load(nm, Var("g0") * size + (c % size if size != per else c)))
    out = Var("g0") * per + c
    if then is None:
        stores: tuple = (Store("y", out, fn(vals)),)
        outs: tuple = (Buf("y", "f32", out=True),)
    else:
        stores = (Let("v0", fn(vals)), Store("y0", out, Var("v0")), Store("y", out, then(Var("v0"), vals)))
        outs = (Buf("y0", "f32", out=True), Buf("y", "f32", out=True))
    body = (LaneFor("l", Const(chunk), (If(c < per, stores),)),)
    params = (*(Buf(nm, "f32") for nm, _ in ins), *outs, Scalar("T"))
    return Kernel(name, params, (Var("T"), Const((per + chunk - 1) // chunk)), body, lanes=lanes,
                  knobs=(("chunk", chunk),))


def _sizes(values: Sequence[Value], first: int = 0) -> list[tuple[str, int]]:
    """(parameter name in{j}, numbered from `first`; elements per token, or -size for a broadcast vector) of
    elementwise inputs `values`."""
    out = []
    for j, v in enumerate(values, first):
        if v.type.shape and v.type.shape[0] == "T":
            out.append((f"in{j}", _per_token(v)))
        else:
            out.append((f"in{j}", -math.prod(int(d) for d in v.type.shape)))
    return out


def sigmoid(g: Expr) -> Expr:
    """1 / (1 + exp(-g))."""
    return Const(1.0) / (Const(1.0) + Call("exp", Const(0.0) - g))


_FNS: dict[str, Callable[[Node], Callable[[list[Expr]], Expr]]] = {
    "add": lambda n: lambda v: v[0] + v[1],
    "mul": lambda n: lambda v: v[0] * v[1],
    "scale": lambda n: lambda v: v[0] * float(n.attrs["factor"]),
    "swiglu": lambda n: lambda v: ACTIVATIONS["swiglu"](v[0]) * v[1],
    "geglu": lambda n: lambda v: ACTIVATIONS["geglu"](v[0]) * v[1],
    "sigmoid_mul": lambda n: lambda v: v[0] / (Const(1.0) + Call("exp", Const(0.0) - v[1])),
}


def _lower_elementwise(nodes: Sequence[Node], ctx: RecipeContext) -> list[Launch]:
    (node,) = nodes
    ins = _sizes(node.inputs)
    per = _per_token(node.output)
    tbind = token_binding(node.output)
    sig = "_".join(str(s) for _, s in ins)
    key = name_tag(f"{node.op}_{node.attrs.get('factor', '')}")
    name = f"ew_{key}_{sig}_{per}".replace("-", "b")
    kern = elementwise_kernel(name, ins, per, _FNS[node.op](node), ctx.knobs_for(_SPACES[node.op], name)["chunk"],
                              ctx.lanes)
    bufs = tuple((nm, ctx.buf(v)) for (nm, _), v in zip(ins, node.inputs)) + (("y", ctx.buf(node.output)),)
    return [Launch(kern, bufs, (("T", tbind),))]


def _lower_elementwise_pair(nodes: Sequence[Node], ctx: RecipeContext) -> list[Launch]:
    """Two elementwise ops, the second reading the first's output (a shared expert's sigmoid gate, then its sum
    with the routed experts'): one launch, which writes both outputs (the first's may have other readers)."""
    first, second = nodes
    extra = [(j, v) for j, v in enumerate(second.inputs) if v is not first.output]
    ins = _sizes(first.inputs) + _sizes([v for _, v in extra], len(first.inputs))
    per = _per_token(second.output)
    slot = {j: len(first.inputs) + i for i, (j, _) in enumerate(extra)}
    fn2 = _FNS[second.op](second)

    def then(v0: Expr, vals: list[Expr]) -> Expr:
        return fn2([vals[slot[j]] if j in slot else v0 for j in range(len(second.inputs))])

    sig = "_".join(str(s) for _, s in ins)
    name = f"ew_{name_tag(first.op)}_{name_tag(second.op)}_{sig}_{per}".replace("-", "b")
    kern = elementwise_kernel(name, ins, per, _FNS[first.op](first), ctx.knobs_for(_SPACES[second.op], name)["chunk"],
                              ctx.lanes, then)
    bufs = tuple((nm, ctx.buf(v)) for (nm, _), v in zip(ins, [*first.inputs, *(v for _, v in extra)]))
    return [Launch(kern, (*bufs, ("y0", ctx.buf(first.output)), ("y", ctx.buf(second.output))),
                   (("T", token_binding(second.output)),))]


def _match_pair(nodes: Sequence[Node]) -> bool:
    first, second = nodes
    return any(v is first.output for v in second.inputs) and first.output.type.shape == second.output.type.shape


def gate_logit(name: str, n: int, row: Expr) -> Reduce:
    """`name` = dot(h[row], wg) over rows of n: a shared expert's gate logit (buffers h, wg), one group's Reduce,
    cheaper than a launch of its own."""
    e = Var(f"{name}_e")
    return Reduce(name, "+", e.name, Const(n), (), Load("h", row * n + e) * Load("wg", e))


def _lower_gate_sigmoid_mul_add(nodes: Sequence[Node], ctx: RecipeContext) -> list[Launch]:
    """A one-row F32 matmul (a shared expert's gate logit), the sigmoid of it times the shared expert's output, then
    the sum with the routed experts' (qwen2moe, qwen3.5 MoE): one launch. Each group takes its token's dot product
    itself (a row of the model's width, cheaper than a launch of its own); the logit, the gated value and the sum
    are all stored, for any other reader. A gate weight in another format lowers as the matmul and the pair."""
    mm, sm, ad = nodes
    h, wg = mm.inputs
    if value_format(ctx, wg).name != "F32":
        return [*recipe_named("matmul").lower([mm], ctx), *_lower_elementwise_pair([sm, ad], ctx)]
    n, per = int(h.type.shape[-1]), _per_token(ad.output)
    (f,) = [v for v in ad.inputs if v is not sm.output] or [sm.output]
    name = f"ew_gate{n}_sigmoid_mul_add_{per}"
    chunk = max(1, min(ctx.knobs_for(_SPACES["add"], name)["chunk"], per))
    t, c = Var("g0"), Var("g1") * chunk + Var("l")
    gated = Load("s", t * per + c) * sigmoid(Var("logit"))
    body = (
        gate_logit("logit", n, t),
        LaneFor("l", Const(1), (If(Var("g1").eq(0), (Store("gl", t, Var("logit")),)),)),
        LaneFor("l", Const(chunk), (If(c < per, (Let("v0", gated), Store("y0", t * per + c, Var("v0")),
                                                 Store("y", t * per + c, Load("f", t * per + c) + Var("v0")))),)),
    )
    params = (Buf("h", "f32"), Buf("wg", "f32"), Buf("s", "f32"), Buf("f", "f32"), Buf("gl", "f32", out=True),
              Buf("y0", "f32", out=True), Buf("y", "f32", out=True), Scalar("T"))
    kern = Kernel(name, params, (Var("T"), Const((per + chunk - 1) // chunk)), body, lanes=ctx.lanes,
                  knobs=(("chunk", chunk),))
    bufs = (("h", ctx.buf(h)), ("wg", ctx.buf(wg)), ("s", ctx.buf(sm.inputs[0])),
            ("f", ctx.buf(f)), ("gl", ctx.buf(mm.output)),
            ("y0", ctx.buf(sm.output)), ("y", ctx.buf(ad.output)))
    return [Launch(kern, bufs, (("T", token_binding(ad.output)),))]


def match_gate_sigmoid_mul_add(nodes: Sequence[Node]) -> bool:
    mm, sm, ad = nodes
    h, wg = mm.inputs
    return (wg.weight is not None and tuple(wg.type.shape) == (1, int(h.type.shape[-1])) and len(h.type.shape) == 2
            and sm.inputs[1] is mm.output and sm.inputs[0] is not mm.output
            and tuple(sm.inputs[0].type.shape) == tuple(ad.output.type.shape) == tuple(h.type.shape)
            and _match_pair([sm, ad]))


def _lower_last_rows(nodes: Sequence[Node], ctx: RecipeContext) -> list[Launch]:
    """y[i] = x[T - rows + i], i < rows = min(T, n) (the step symbol "T_last", which every later launch's row count
    binds to: a step of fewer rows than n computes only its own): a group per chunk of a row (grid dim 0) and
    output row (grid dim 1). The kernel takes the count at run time, so plans of every n share it."""
    (node,) = nodes
    per = _per_token(node.inputs[0])
    name = f"last_rows_{per}"
    chunk = max(1, min(ctx.knobs_for(_SPACES["last_rows"], name)["chunk"], per))
    c = Var("g0") * chunk + Var("l")
    src = Var("T") - Var("rows") + Var("g1")
    body = (LaneFor("l", Const(chunk), (If(c < per, (Store("y", Var("g1") * per + c, Load("x", src * per + c)),)),)),)
    kern = Kernel(name, (Buf("x", "f32"), Buf("y", "f32", out=True), Scalar("T"), Scalar("rows")),
                  (Const((per + chunk - 1) // chunk), Var("rows")), body, lanes=ctx.lanes, knobs=(("chunk", chunk),))
    return [Launch(kern, (("x", ctx.buf(node.inputs[0])), ("y", ctx.buf(node.output))),
                   (("T", "T"), ("rows", "T_last")))]


def rms_inverse(name: str, var: str, d: int, x: Callable[[Expr], Expr], eps: float) -> list:
    """Group statements leaving in `name` the RMS norm's scale 1 / sqrt(mean(x(j)^2) + eps) of a row of `d` values
    (a Reduce over `var`), x(j) giving value j."""
    ss, v = f"{name}_ss", Var(f"{name}_x")
    return [Reduce(ss, "+", var, Const(d), (Let(v.name, x(Var(var))),), v * v), rms_scale(name, Var(ss), d, eps)]


def rms_scale(name: str, sum_squares: Expr, d: int, eps: float) -> Let:
    """`name` = 1 / sqrt(sum_squares / d + eps): the RMS norm's scale from the sum of a row's squares."""
    return Let(name, Const(1.0) / Call("sqrt", sum_squares / float(d) + float(eps)))


class Addend(NamedTuple):
    """A norm's second addend computed in the kernel (the MoE recipes sum the experts' outputs this way:
    `moe.combine_addend`, `moe.shared_gate_addend`)."""

    bufs: tuple[Buf, ...]  # the buffers it reads
    # Its value at (row, element index, the alignment in elements that index has); the expression may use the
    # kernel's scalar R (its row count: tokens) and what `prologue` leaves.
    value: Callable[[Expr, Expr, int], Expr]
    prologue: tuple = ()  # group statements before the row's pass (a dot product the value reads)


@kernel_builder
def rms_norm_kernel(name: str, d: int, eps: float, fused_add: bool, lanes: int, quant: bool = False,
                    addend: Addend | None = None) -> Kernel:
    """Rows of length d (grid over rows): [s = x + r, stored to `sum`] then y = s / sqrt(mean(s^2) + eps) * w.

    Each lane takes 4 neighbouring values at a time (16-byte loads where the target merges them), and the loads,
    the add and the sum of squares are one pass: at decode a single group does the row, and each pass over
    global memory is a round trip the step waits for. s stays in a local copy (where `norm_local_bytes` fits)
    for the second pass. `quant`: also write y as the matmuls' int8 activations (`xq`, `xd`: what
    `linear.quantize_x_kernel` writes, through the same local copy: `linear.quantize_staged`), sparing them a
    launch. `addend` (with `fused_add`): r is not read from a buffer but computed (`Addend`)."""
    row = Var("g0") * d
    vw = 4 if d % 4 == 0 else 1  # values a lane takes at a time
    keep = norm_local_bytes(d, quant) <= QUANT_LOCAL_BYTES  # s in the local copy, else re-read from global
    q = Var("q")

    def at(e: int) -> Expr:
        return q * vw + e

    def load(buf: str, base: Expr, e: int) -> Load:
        return Load(buf, base + at(e), vw if e == 0 and vw > 1 else 1)

    # Every load before any store: a store may alias a later load, and would keep it from being merged or hoisted.
    first = [Let(f"x{e}", load("x", row, e)) for e in range(vw)]
    if addend is not None:
        first += [Let(f"r{e}", addend.value(Var("g0"), at(e), vw if e == 0 else 1)) for e in range(vw)]
    elif fused_add:
        first += [Let(f"r{e}", load("r", row, e)) for e in range(vw)]
    first += [Let(f"s{e}", Var(f"x{e}") + Var(f"r{e}") if fused_add else Var(f"x{e}")) for e in range(vw)]
    for e in range(vw):
        if fused_add:
            first.append(Store("sum", row + at(e), Var(f"s{e}")))
        if keep:
            first.append(Store("sl", staged(at(e)), Var(f"s{e}")))
    squares = Var("s0") * Var("s0")
    for e in range(1, vw):
        squares = squares + Var(f"s{e}") * Var(f"s{e}")
    body = [*(addend.prologue if addend is not None else ()), Reduce("ss", "+", q.name, Const(d // vw), tuple(first),
                                                                     squares),
            rms_scale("inv", Var("ss"), d, eps)]
    second = [Let(f"w{e}", load("w", Const(0), e)) for e in range(vw)]
    for e in range(vw):
        s_e = Load("sl", staged(at(e))) if keep else load("sum" if fused_add else "x", row, e)
        second.append(Let(f"y{e}", s_e * Var("inv") * Var(f"w{e}")))
    for e in range(vw):
        second.append(Store("y", row + at(e), Var(f"y{e}")))
        if quant:
            second.append(Store("sl", staged(at(e)), Var(f"y{e}")))  # each lane overwrites only its own values
    body.append(LaneFor(q.name, Const(d // vw), tuple(second)))
    local: tuple = ()
    if quant:
        body += quantize_staged("sl", d, Var("g0") * (d // 4), Var("g0") * (d // QB))
        local = staged_locals("sl", d)
    elif keep:
        local = (staged_locals("sl", d)[0],)
    params = [Buf("x", "f32")]
    if fused_add:
        params += [*(addend.bufs if addend else (Buf("r", "f32"),)), Buf("sum", "f32", out=True)]
    params += [Buf("w", "f32"), Buf("y", "f32", out=True)]
    if quant:
        params += [Buf("xq", "u32", out=True), Buf("xd", "f32", out=True)]
    return Kernel(name, (*params, Scalar("R")), (Var("R"),), tuple(body), lanes=lanes, local=local)


def norm_local_bytes(d: int, quant: bool) -> int:
    """Local memory of `rms_norm_kernel` over rows of d keeping its row copy (`linear.staged_locals`)."""
    return sum(a.size * 4 for a in staged_locals("sl", d)[: 2 if quant else 1])


def _norm_rows(v: Value) -> tuple[str, int]:
    """Launch binding for the row count of a norm over the last dim: 'T' scaled by middle dims needs a kernel
    scalar, so rows = T * mid is expressed through grid R bound to T with the middle folded into d-steps."""
    mid = math.prod(int(d) for d in v.type.shape[1:-1])
    return token_binding(v), mid


def norm_launch(node: Node, out: Value, ctx: RecipeContext, eps: float, fused: bool,
                bufs: list[tuple[str, str]], addend: tuple[str, Addend] | None = None) -> list[Launch]:
    """The norm's launch over rows of its input's last dim; where the next matmuls read quantized activations and
    the row fits the local copy, it writes them too (`linear.quantized_output`). `addend`: (a name tag for the
    kernel, the `Addend` computing r), rows of one token each only."""
    x = node.inputs[0]
    d = int(x.type.shape[-1])
    tb, mid = _norm_rows(x)
    if addend is not None and mid != 1:
        raise ValueError("a computed addend needs a norm over rows of one token")
    qbufs, provides = ((), ())
    if mid == 1 and d % QB == 0 and norm_local_bytes(d, True) <= QUANT_LOCAL_BYTES:
        qbufs, provides = quantized_output(ctx, ctx.buf(out), d, token_binding(out))
    kern = _rms_kernel_mid(d, mid, eps, fused, norm_lanes(ctx, d), bool(provides), addend)
    return [Launch(kern, (*bufs, *qbufs), (("R", tb),), provides=provides)]


def _rms_kernel_mid(d: int, mid: int, eps: float, fused: bool, lanes: int, quant: bool,
                    addend: tuple[str, Addend] | None = None) -> Kernel:
    tag = f"{'_add' if fused else ''}{addend[0] if addend else ''}{'_q8' if quant else ''}"
    k = rms_norm_kernel(f"rms_norm{tag}_{d}x{mid}_{name_tag(eps)}",
                        d, eps, fused, lanes, quant, addend[1] if addend else None)
    if mid == 1:
        return k
    # Rows = tokens * mid: scale the grid (R is bound to the token count).
    return Kernel(k.name, k.params, (Var("R") * mid,), k.body, lanes=k.lanes, local=k.local)


def norm_lanes(ctx: RecipeContext, d: int) -> int:
    """Lanes of a norm over rows of `d`: with lanes at all, enough that each has ~4 values (up to 1024; whole
    warps): at decode one group does the whole row, and its latency is what the step waits for."""
    if ctx.lanes == 1:
        return 1
    return max(ctx.lanes, min(1024, d // 4 // 32 * 32))


def _lower_rms(nodes: Sequence[Node], ctx: RecipeContext) -> list[Launch]:
    (node,) = nodes
    x, w = node.inputs
    return norm_launch(node, node.output, ctx, float(node.attrs["eps"]), False,
                       [("x", ctx.buf(x)), ("w", ctx.buf(w)), ("y", ctx.buf(node.output))])


def _lower_add_rms(nodes: Sequence[Node], ctx: RecipeContext) -> list[Launch]:
    add, norm = nodes
    x, r = add.inputs
    w = norm.inputs[1]
    return norm_launch(add, norm.output, ctx, float(norm.attrs["eps"]), True,
                       [("x", ctx.buf(x)), ("r", ctx.buf(r)), ("sum", ctx.buf(add.output)), ("w", ctx.buf(w)),
                        ("y", ctx.buf(norm.output))])


def match_add_rms(nodes: Sequence[Node]) -> bool:
    add, norm = nodes
    x, r = add.inputs
    return norm.inputs[0] is add.output and x.type.shape == r.type.shape and _f32_weight(norm)


def _f32_weight(norm: Node) -> bool:
    return len(norm.inputs[1].type.shape) == 1


def rope_value(x: Callable[[Expr], Expr], i: Expr, pos: Expr, d: int, dims: int, base: float, freq_scale: float,
               mode: str) -> Expr:
    """Element i of a roped head row of `d` values, x(j) giving element j before the rope: with its pair partner
    x_j and the pair's angle a, x_i cos a - x_j sin a for the pair's first element, x_i cos a + x_j sin a for its
    second; elements from `dims` on pass through. Pairs are (2p, 2p + 1) in mode "normal", (p, p + dims / 2) in "neox";
    a = pos * freq_scale * base^(-2p / dims)."""
    half = dims // 2
    if mode == "normal":
        p, first = i // 2, (i % 2).eq(0)
        partner = Select(first, i + 1, i - 1)
    else:
        p, first = i % half, i < half
        partner = Select(first, i + half, i - half)
    ang = pos * float(freq_scale) * Call("pow", Const(float(base)), Cast("f32", p * -2) / float(dims))
    xj = x(partner)
    rot = x(i) * Call("cos", ang) + Select(first, Const(0.0) - xj, xj) * Call("sin", ang)
    return rot if dims >= d else Select(i < dims, rot, x(i))


@kernel_builder
def rope_kernel(name: str, h: int, d: int, dims: int, base: float, freq_scale: float, mode: str,
                lanes: int) -> Kernel:
    """y = rope(x) for x [T, h, d] (`rope_value`); grid (T, h)."""
    row = (Var("g0") * h + Var("g1")) * d
    body = (
        Let("pos", Cast("f32", Load("positions", Var("g0")))),
        LaneFor("i", Const(d), (Store("y", row + Var("i"), rope_value(
            lambda j: Load("x", row + j), Var("i"), Var("pos"), d, dims, base, freq_scale, mode)),)),
    )
    params = (Buf("x", "f32"), Buf("positions", "i32"), Buf("y", "f32", out=True), Scalar("T"))
    return Kernel(name, params, (Var("T"), Const(h)), body, lanes=lanes)


def _lower_rope(nodes: Sequence[Node], ctx: RecipeContext) -> list[Launch]:
    (node,) = nodes
    x, pos = node.inputs
    _, h, d = (x.type.shape[0], int(x.type.shape[1]), int(x.type.shape[2]))
    a = node.attrs
    tag = f"{h}x{d}_{a['dims']}_{a['mode']}_{stable_digest((a['base'], a['freq_scale']), 8)}"
    kern = rope_kernel(f"rope_{tag}", h, d, int(a["dims"]), float(a["base"]), float(a["freq_scale"]), a["mode"],
                       ctx.lanes)
    return [Launch(kern, (("x", ctx.buf(x)), ("positions", ctx.buf(pos)), ("y", ctx.buf(node.output))),
                   (("T", "T"),))]


register(Recipe("add_rms_norm", ("add", "rms_norm"), _lower_add_rms, match_add_rms))
# Knob chunk: values a group takes (its lanes' loop).
_SPACES = {op: KnobSpace(op, (Knob("chunk", CHUNK, (32, 64, 128, 512, 1024)),)) for op in (*_FNS, "last_rows")}
for _op in _FNS:
    register(Recipe(_op, (_op,), _lower_elementwise, None, _SPACES[_op]))
# Chains of two in one launch (qwen2moe / qwen3.5 MoE: the shared expert's gate, then the sum with the experts').
register(Recipe("sigmoid_mul_add", ("sigmoid_mul", "add"), _lower_elementwise_pair, _match_pair, _SPACES["add"]))
# ... and with the gate's logit (a one-row F32 matmul) computed in it too.
register(Recipe("gate_sigmoid_mul_add", ("matmul", "sigmoid_mul", "add"), _lower_gate_sigmoid_mul_add,
                match_gate_sigmoid_mul_add, _SPACES["add"]))
register(Recipe("last_rows", ("last_rows",), _lower_last_rows, None, _SPACES["last_rows"]))
register(Recipe("rms_norm", ("rms_norm",), _lower_rms, None))
register(Recipe("rope", ("rope",), _lower_rope, None))

"""Recipes of the Gated DeltaNet layers (`polystrata/models/qwen35.py`): slice, l2_norm, rms_norm_gated, gdn_gates,
and the recurrent ops ssm_conv and delta_rule, whose per-sequence state lives in plan buffers of kind "state"
(`state_buffer`: one per op and layer, shared by every plan, zeroed when a sequence starts).

Row kernels (l2_norm, rms_norm_gated): a group per row, a Reduce over it then a LaneFor writing it. ssm_conv: a
group per `chunk` channels, each lane one channel through every token of the step (a channel's outputs depend only
on its own inputs and state). delta_rule: the recurrent form for steps of any length (the chunked WY form of the
reference executor has no kernel yet): a group per (value head, column j of its state), whose lanes share the
column's Dk values, kept adjacent (the state is stored transposed); per token: S *= exp(g); delta = beta (v_j -
k . S[:, j]); S[:, j] += k delta; out_j = scale q . S[:, j], from one read of the column (see `_lower_delta_rule`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from polystrata.codegen.recipes import Recipe, RecipeContext, register, token_binding
from polystrata.codegen.recipes.elementwise import rms_scale
from polystrata.ir.graph import Node, Value
from polystrata.ir.kernel import (  # the expression nodes Const, Expr, Var too, which ir.kernel builds on
    Assign,
    Buf,
    Call,
    Const,
    Decl,
    Expr,
    For,
    If,
    Kernel,
    LaneFor,
    Launch,
    Let,
    Load,
    Reduce,
    Scalar,
    Store,
    Var,
    name_tag,
)

CHUNK = 64


def state_buffer(node: Node) -> tuple[str, int]:
    """(plan buffer name, f32 count) of the recurrent state a `RECURRENT_OPS` node keeps for its layer: ssm_conv's
    last K-1 input rows [K-1, C], delta_rule's matrices transposed, [Hv, Dv, Dk] (the reference's [Hv, Dk, Dv])."""
    layer = node.attrs["layer"]
    if node.op == "ssm_conv":
        c, k = (int(d) for d in node.inputs[1].type.shape)
        return f"state.{layer}.conv", (k - 1) * c
    _, hv, dv = node.inputs[2].type.shape
    return f"state.{layer}.delta", int(hv) * int(node.inputs[0].type.shape[2]) * int(dv)


def _rows(v: Value) -> tuple[Expr, str | int]:
    """(grid extent, binding of T) of a kernel with a group per row of v's last dim."""
    mid = math.prod(int(d) for d in v.type.shape[1:-1])
    return Var("T") * mid, token_binding(v)


def _sigmoid(x: Expr) -> Expr:
    return Const(1.0) / (Const(1.0) + Call("exp", Const(0.0) - x))


def _lower_slice(nodes: Sequence[Node], ctx: RecipeContext) -> list[Launch]:
    (node,) = nodes
    (x,) = node.inputs
    width, start, n = int(x.type.shape[-1]), node.attrs["start"], node.attrs["stop"] - node.attrs["start"]
    grid, tb = _rows(x)
    body = (LaneFor("l", Const(n), (Store("y", Var("g0") * n + Var("l"), Load("x", Var("g0") * width + start
                                                                              + Var("l"))),)),)
    kern = Kernel(f"slice_{width}_{start}_{n}", (Buf("x", "f32"), Buf("y", "f32", out=True), Scalar("T")), (grid,),
                  body, lanes=ctx.lanes)
    return [Launch(kern, (("x", ctx.buf(x)), ("y", ctx.buf(node.output))), (("T", tb),))]


def _row_norm(name: str, x: Value, d: int, scale: list, value, extra: tuple[Buf, ...], ctx: RecipeContext) -> Kernel:
    """A group per row of d: `scale` (statements after the row's sum of squares `ss`), then y = value(j)."""
    row = Var("g0") * d
    body = (Reduce("ss", "+", "j", Const(d), (Let("xj", Load("x", row + Var("j"))),), Var("xj") * Var("xj")),
            *scale,
            LaneFor("j", Const(d), (Store("y", row + Var("j"), value(row, Var("j"))),)))
    grid, _ = _rows(x)
    return Kernel(name, (Buf("x", "f32"), *extra, Buf("y", "f32", out=True), Scalar("T")), (grid,), body,
                  lanes=ctx.lanes)


def _lower_l2_norm(nodes: Sequence[Node], ctx: RecipeContext) -> list[Launch]:
    (node,) = nodes
    (x,) = node.inputs
    d, eps = int(x.type.shape[-1]), float(node.attrs["eps"])
    inv = Let("inv", Const(1.0) / Call("sqrt", Var("ss") + eps))
    kern = _row_norm(f"l2_norm_{d}_{name_tag(eps)}", x, d, [inv],
                     lambda row, j: Load("x", row + j) * Var("inv"), (), ctx)
    return [Launch(kern, (("x", ctx.buf(x)), ("y", ctx.buf(node.output))), (("T", token_binding(x)),))]


def _lower_rms_norm_gated(nodes: Sequence[Node], ctx: RecipeContext) -> list[Launch]:
    (node,) = nodes
    x, w, gate = node.inputs
    d, eps = int(x.type.shape[-1]), float(node.attrs["eps"])

    def value(row: Expr, j: Expr) -> Expr:
        z = Load("z", row + j)
        return Load("x", row + j) * Var("inv") * Load("w", j) * (z * _sigmoid(z))

    kern = _row_norm(f"rms_norm_gated_{d}_{name_tag(eps)}", x, d, [rms_scale("inv", Var("ss"), d, eps)], value,
                     (Buf("w", "f32"), Buf("z", "f32")), ctx)
    bufs = (("x", ctx.buf(x)), ("w", ctx.buf(w)), ("z", ctx.buf(gate)), ("y", ctx.buf(node.output)))
    return [Launch(kern, bufs, (("T", token_binding(x)),))]


def _lower_gdn_gates(nodes: Sequence[Node], ctx: RecipeContext) -> list[Launch]:
    (node,) = nodes
    alpha, beta, dt_bias, decay = node.inputs
    h = int(alpha.type.shape[1])
    i = Var("g0") * h + Var("l")
    a = Var("a")
    body = (LaneFor("l", Const(h), (
        Let("a", Load("alpha", i) + Load("dt", Var("l"))),
        # softplus(a) = max(a, 0) + log(1 + exp(-|a|)), without overflow
        Let("sp", Call("max", a, Const(0.0)) + Call("log", Const(1.0) + Call("exp", Const(0.0) - Call("abs", a)))),
        Store("y", i * 2, Load("decay", Var("l")) * Var("sp")),
        Store("y", i * 2 + 1, _sigmoid(Load("beta", i))),
    )),)
    params = (Buf("alpha", "f32"), Buf("beta", "f32"), Buf("dt", "f32"), Buf("decay", "f32"),
              Buf("y", "f32", out=True), Scalar("T"))
    kern = Kernel(f"gdn_gates_{h}", params, (Var("T"),), body, lanes=ctx.lanes)
    bufs = (("alpha", ctx.buf(alpha)), ("beta", ctx.buf(beta)), ("dt", ctx.buf(dt_bias)), ("decay", ctx.buf(decay)),
            ("y", ctx.buf(node.output)))
    return [Launch(kern, bufs, (("T", token_binding(alpha)),))]


def _lower_ssm_conv(nodes: Sequence[Node], ctx: RecipeContext) -> list[Launch]:
    (node,) = nodes
    x, w = node.inputs
    c, k = (int(d) for d in w.type.shape)
    chunk = max(1, min(ctx.knob("ssm_conv", "chunk", CHUNK), c))
    ch, t, j, i = Var("ch"), Var("t"), Var("j"), Var("i")
    # Row i of (state ++ x): the state's rows first, then this step's.
    row_term = (Let("i", t + j),
                If(i < k - 1, (Assign("acc", Var("acc") + Load("w", ch * k + j) * Load("s", i * c + ch)),),
                   (Assign("acc", Var("acc") + Load("w", ch * k + j) * Load("x", (i - (k - 1)) * c + ch)),)))
    per_token = (Decl("acc", "f32", Const(0.0)), For("j", Const(0), Const(k), row_term),
                 Store("y", t * c + ch, Var("acc") * _sigmoid(Var("acc"))))
    # The new state: rows T .. T+K-2 of (state ++ x), in ascending order, so each read precedes its overwrite.
    keep = (Let("i", Var("T") + j),
            If(i < k - 1, (Store("s", j * c + ch, Load("s", i * c + ch)),),
               (Store("s", j * c + ch, Load("x", (i - (k - 1)) * c + ch)),)))
    body = (LaneFor("l", Const(chunk), (
        Let("ch", Var("g0") * chunk + Var("l")),
        If(ch < c, (For("t", Const(0), Var("T"), per_token), For("j", Const(0), Const(k - 1), keep))),
    )),)
    params = (Buf("x", "f32"), Buf("w", "f32"), Buf("s", "f32", out=True), Buf("y", "f32", out=True), Scalar("T"))
    kern = Kernel(f"ssm_conv_{c}x{k}", params, (Const((c + chunk - 1) // chunk),), body, lanes=ctx.lanes,
                  knobs=(("chunk", chunk),))
    bufs = (("x", ctx.buf(x)), ("w", ctx.buf(w)), ("s", state_buffer(node)[0]), ("y", ctx.buf(node.output)))
    return [Launch(kern, bufs, (("T", token_binding(x)),))]


def _lower_delta_rule(nodes: Sequence[Node], ctx: RecipeContext) -> list[Launch]:
    (node,) = nodes
    q, k, v, gates = node.inputs
    hk, dk = int(q.type.shape[1]), int(q.type.shape[2])
    hv, dv = int(v.type.shape[1]), int(v.type.shape[2])
    tiled = node.attrs["head_map"] == "tiled"
    h, col, t, e = Var("g0"), Var("g1"), Var("t"), Var("e")
    kh = h % hk if tiled else h // (hv // hk)
    qk = (t * hk + kh) * dk + e  # element e of the token's key (and query) head
    s = (h * dv + col) * dk + e  # S[h, e, col], kept transposed: a column's Dk values are adjacent
    g = (t * hv + h) * 2
    out = (t * hv + h) * dv + col
    # Per token one read of the column gives k . S, q . S and q . k; with the decay d, delta = beta (v - d k.S) and
    # out = scale (d q.S + q.k delta); then S = d S + k delta. Two reads and one write of S per token.
    token = (
        Reduce("ks", "+", "e", Const(dk), (Let("se", Load("s", s)), Let("ke", Load("k", qk)), Let("qe", Load("q", qk))),
               Var("ke") * Var("se"), more=(("qs", Var("qe") * Var("se")), ("qk", Var("qe") * Var("ke")))),
        Let("decay", Call("exp", Load("g", g))),
        Let("delta", (Load("v", out) - Var("decay") * Var("ks")) * Load("g", g + 1)),
        Store("y", out, (Var("decay") * Var("qs") + Var("qk") * Var("delta")) * float(node.attrs["scale"])),
        LaneFor("e", Const(dk), (Store("s", s, Load("s", s) * Var("decay") + Load("k", qk) * Var("delta")),)),
    )
    params = (Buf("q", "f32"), Buf("k", "f32"), Buf("v", "f32"), Buf("g", "f32"), Buf("s", "f32", out=True),
              Buf("y", "f32", out=True), Scalar("T"))
    name = f"delta_rule_{hk}x{dk}_{hv}x{dv}_{'tiled' if tiled else 'grouped'}_{name_tag(node.attrs['scale'])}"
    kern = Kernel(name, params, (Const(hv), Const(dv)), (For("t", Const(0), Var("T"), token),), lanes=ctx.lanes)
    bufs = (("q", ctx.buf(q)), ("k", ctx.buf(k)), ("v", ctx.buf(v)), ("g", ctx.buf(gates)),
            ("s", state_buffer(node)[0]), ("y", ctx.buf(node.output)))
    return [Launch(kern, bufs, (("T", token_binding(v)),))]


register(Recipe("slice", ("slice",), _lower_slice))
register(Recipe("l2_norm", ("l2_norm",), _lower_l2_norm))
register(Recipe("rms_norm_gated", ("rms_norm_gated",), _lower_rms_norm_gated))
register(Recipe("gdn_gates", ("gdn_gates",), _lower_gdn_gates))
register(Recipe("ssm_conv", ("ssm_conv",), _lower_ssm_conv, None, (("chunk", CHUNK),)))
register(Recipe("delta_rule", ("delta_rule",), _lower_delta_rule))

"""MoE recipes: `router` and `moe_ffn`.

Route buffer convention (i32, 2 * T * k words, as the compiler sizes it): words [0, T*k) hold the expert ids of
(token t, slot s) at t*k + s; words [T*k, 2*T*k) hold the slot weights as Q30 fixed point, round(w * 2^30)
(the IR has no bit-cast, and weights lie in [0, 1], so Q30 keeps ~1e-9 absolute precision).

`moe_ffn`: grid (T,): for each slot, h = silu(gate_e x) * (up_e x) into local memory (LaneFor over the expert's
rows), then a LaneFor over output rows accumulates w * (down_e h) into a local row; expert e's matrix starts at
e * rows * row_bytes of the 3-D weight buffer. No atomics: each group owns its token's output row.
"""

from __future__ import annotations

from collections.abc import Sequence

from polystrata.codegen.dequant import elements_per_row_bytes, weight_dtype
from polystrata.codegen.recipes import Recipe, RecipeContext, register
from polystrata.codegen.recipes._matvec import Act, block_dot, fmt_for
from polystrata.codegen.recipes.linear import silu
from polystrata.ir.graph import Node
from polystrata.ir.kernel import (
    Assign,
    Buf,
    Call,
    Cast,
    Decl,
    For,
    If,
    Kernel,
    LaneFor,
    Launch,
    Let,
    Load,
    LocalArray,
    Reduce,
    Scalar,
    Store,
)
from polystrata.ir.quant import Const, QuantFormat, Var

Q30 = float(1 << 30)


def router_kernel(name: str, e: int, k: int, norm: bool, lanes: int) -> Kernel:
    """Softmax over e logits, top-k by repeated argmax (lowest index wins ties), optional renormalisation."""
    t = Var("g0")
    body = [
        Reduce("m", "max", "j", Const(e), (), Load("x", t * e + Var("j"))),
        LaneFor("j", Const(e), (Store("p", Var("j"), Call("exp", Load("x", t * e + Var("j")) - Var("m"))),)),
        Reduce("z", "+", "j", Const(e), (), Load("p", Var("j"))),
        Decl("tot", "f32", Const(0.0)),
    ]
    for s in range(k):
        body += [
            Decl(f"bi{s}", "i32", Const(0)), Decl(f"bv{s}", "f32", Const(-1.0)),
            For("j", Const(0), Const(e), (If(Load("p", Var("j")) > Var(f"bv{s}"), (
                Assign(f"bi{s}", Var("j")), Assign(f"bv{s}", Load("p", Var("j"))))),)),
            Store("p", Var(f"bi{s}"), Const(-2.0)),  # taken
            Assign("tot", Var("tot") + Var(f"bv{s}") / Var("z")),
        ]
    for s in range(k):
        w = Var(f"bv{s}") / Var("z")
        if norm:
            w = w / Var("tot")
        body += [Store("route", t * k + s, Var(f"bi{s}")),
                 Store("route", Var("T") * k + t * k + s, Cast("i32", w * Q30 + 0.5))]
    params = (Buf("x", "f32"), Buf("route", "i32", out=True), Scalar("T"))
    return Kernel(name, params, (Var("T"),), tuple(body), lanes=lanes, local=(LocalArray("p", "f32", e),))


def moe_kernel(name: str, fg: QuantFormat, fu: QuantFormat, fd: QuantFormat, n_exp: int, dm: int, ff: int, k: int,
               lanes: int) -> Kernel:
    """out[t] = sum_s w_s * down_e(silu(gate_e x_t) * up_e x_t), e = ids[t, s]; f32-activation dot products."""
    t = Var("g0")
    ex = Var("ex")
    xa = Act("x", dm)
    ha = Act("h", ff)

    def dot(fmt, buf, n_rows, n_cols, row, act, trow, acc, prefix):
        rb = elements_per_row_bytes(fmt, n_cols)
        base = (ex * n_rows + row) * rb
        return [Decl(acc, "f32", Const(0.0)),
                For(f"{prefix}b", Const(0), Const(n_cols // fmt_for(fmt).block_size),
                    tuple(block_dot(fmt, buf, base, Var(f"{prefix}b"), act, trow, acc, prefix)))]

    body = (
        LaneFor("r", Const(dm), (Store("o", Var("r"), Const(0.0)),)),
        For("s", Const(0), Const(k), (
            Let("ex", Load("route", t * k + Var("s"))),
            Let("wt", Cast("f32", Load("route", Var("T") * k + t * k + Var("s"))) / Q30),
            LaneFor("f", Const(ff), (
                *dot(fg, "gate", ff, dm, Var("f"), xa, t, "ag", "g_"),
                *dot(fu, "up", ff, dm, Var("f"), xa, t, "au", "u_"),
                Store("h", Var("f"), silu(Var("ag")) * Var("au")),
            )),
            LaneFor("r", Const(dm), (
                *dot(fd, "down", dm, ff, Var("r"), ha, Const(0), "ad", "d_"),
                Store("o", Var("r"), Load("o", Var("r")) + Var("wt") * Var("ad")),
            )),
        )),
        LaneFor("r", Const(dm), (Store("y", t * dm + Var("r"), Load("o", Var("r"))),)),
    )
    params = (Buf("x", "f32"), Buf("route", "i32"), Buf("gate", weight_dtype(fg)), Buf("up", weight_dtype(fu)),
              Buf("down", weight_dtype(fd)), Buf("y", "f32", out=True), Scalar("T"))
    local = (LocalArray("h", "f32", ff), LocalArray("o", "f32", dm))
    return Kernel(name, params, (Var("T"),), body, lanes=lanes, local=local)


def _lower_router(nodes: Sequence[Node], ctx: RecipeContext) -> list[Launch]:
    (node,) = nodes
    (x,) = node.inputs
    e, k, norm = int(x.type.shape[1]), int(node.attrs["k"]), bool(node.attrs["norm"])
    kern = router_kernel(f"router_{e}_{k}_{int(norm)}", e, k, norm, ctx.lanes)
    return [Launch(kern, (("x", ctx.buf(x)), ("route", ctx.buf(node.output))), (("T", "T"),))]


def _lower_moe(nodes: Sequence[Node], ctx: RecipeContext) -> list[Launch]:
    (node,) = nodes
    x, route, g, u, d = node.inputs
    n_exp, ff, dm = (int(s) for s in g.type.shape)
    k = int(route.type.shape[1])
    fg, fu, fd = (ctx.weight_formats[w.weight] for w in (g, u, d))
    kern = moe_kernel(f"moe_{fg.name}_{fu.name}_{fd.name}_{n_exp}_{dm}_{ff}_{k}".lower(), fg, fu, fd, n_exp, dm, ff,
                      k, ctx.lanes)
    return [Launch(kern, (("x", ctx.buf(x)), ("route", ctx.buf(route)), ("gate", ctx.buf(g)), ("up", ctx.buf(u)),
                          ("down", ctx.buf(d)), ("y", ctx.buf(node.output))), (("T", "T"),))]


register(Recipe("router", ("router",), _lower_router, None))
register(Recipe("moe_ffn", ("moe_ffn",), _lower_moe, None))

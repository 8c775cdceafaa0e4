"""Recipes of the Gated DeltaNet layers (`polystrata/models/qwen35.py`): slice, l2_norm, rms_norm_gated, gdn_gates,
and the recurrent ops ssm_conv and delta_rule, whose per-sequence state lives in plan buffers of kind "state"
(`state_buffer`: one per op and layer, shared by every plan, zeroed when a sequence starts).

Row kernels (l2_norm, rms_norm_gated): a group per row, a Reduce over it then a LaneFor writing it. ssm_conv: a
group per `chunk` channels, each lane one channel through every token of the step (a channel's outputs depend only
on its own inputs and state). delta_rule, in two forms over the same state (its matrices stored transposed, a
column's Dk values adjacent), chosen by the step's length at run time (the knob `chunked_above`, a kernel scalar):
- recurrent, for decode and short steps: a group per (value head, column j of its state), its lanes sharing the
  column's Dk values; per token: S *= exp(g); delta = beta (v_j - k . S[:, j]); S[:, j] += k delta;
  out_j = scale q . S[:, j], from one read of the column (`_recurrent_kernel`);
- chunked, for prompts: the reference executor's WY / UT form in chunks of the node's `chunk` (64) tokens, in two
  kernels: what needs no state, for every chunk at once (`_chunk_prep_kernel`: decays, masked scores, the
  triangular solve), then a group per state column through the chunks in order (`_chunk_scan_kernel`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from polystrata.codegen.recipes import Knob, KnobSpace, Recipe, RecipeContext, register, token_binding
from polystrata.codegen.recipes._matvec import QB
from polystrata.codegen.recipes.elementwise import rms_scale, sigmoid
from polystrata.codegen.recipes.linear import quantize_staged, quantized_output, staged, staged_locals
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
    LocalArray,
    Reduce,
    Scalar,
    Select,
    Store,
    Var,
    name_tag,
)

CHUNK = 64
# Tokens of keys the chunked form's state update stages in local memory at a time.
KEY_TILE = 16
# Knob chunk: channels a group of the short convolution takes. Knob chunked_above: steps of more tokens than this
# run the delta rule's chunked form, shorter ones (decode) the recurrent form ("auto": the target's policy, GPUs
# 16, the host never).
CONV_SPACE = KnobSpace("ssm_conv", (Knob("chunk", CHUNK),))
DELTA_SPACE = KnobSpace("delta_rule", (Knob("chunked_above", "auto"),))


def state_buffer(node: Node) -> tuple[str, int]:
    """(plan buffer name, f32 count) of the recurrent state a `RECURRENT_OPS` node keeps for its layer: ssm_conv's
    last K-1 input rows [K-1, C], delta_rule's matrices transposed, [Hv, Dv, Dk] (the reference's [Hv, Dk, Dv])."""
    layer = node.attrs["layer"]
    if node.op == "ssm_conv":
        c, k = (int(d) for d in node.inputs[1].type.shape)
        return f"state.{layer}.conv", (k - 1) * c
    _, hv, dv = node.inputs[2].type.shape
    return f"state.{layer}.delta", int(hv) * int(node.inputs[0].type.shape[2]) * int(dv)


def _rows(v: Value) -> tuple[Expr, str]:
    """(grid extent, binding of T) of a kernel with a group per row of v's last dim."""
    mid = math.prod(int(d) for d in v.type.shape[1:-1])
    return Var("T") * mid, token_binding(v)


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


def _row_norm(name: str, x: Value, d: int, scale: list, value, extra: tuple[Buf, ...], ctx: RecipeContext,
              quant: bool = False) -> Kernel:
    """A group per row of d: `scale` (statements after the row's sum of squares `ss`), then y = value(row, j).
    `quant`: y also written as the next matmuls' int8 activations (`linear.quantize_staged`: xq, xd, rows of d
    following one another)."""
    row = Var("g0") * d
    out = [Store("y", row + Var("j"), Var("yj"))]
    if quant:
        out.append(Store("sl", staged(Var("j")), Var("yj")))
    body = [Reduce("ss", "+", "j", Const(d), (Let("xj", Load("x", row + Var("j"))),), Var("xj") * Var("xj")),
            *scale,
            LaneFor("j", Const(d), (Let("yj", value(row, Var("j"))), *out))]
    grid, _ = _rows(x)
    params = [Buf("x", "f32"), *extra, Buf("y", "f32", out=True)]
    local: tuple = ()
    if quant:
        body += quantize_staged("sl", d, Var("g0") * (d // 4), Var("g0") * (d // QB))
        params += [Buf("xq", "u32", out=True), Buf("xd", "f32", out=True)]
        local = staged_locals("sl", d)
    return Kernel(name, (*params, Scalar("T")), (grid,), tuple(body), lanes=ctx.lanes, local=local)


def _l2_scale(name: str, sum_squares: Expr, eps: float) -> Let:
    """`name` = 1 / sqrt(sum_squares + eps): the L2 norm's scale of a row from the sum of its squares (the l2_norm
    op's, wherever a kernel takes it: alone, cutting heads, in the delta rule)."""
    return Let(name, Const(1.0) / Call("sqrt", sum_squares + eps))


def _lower_l2_norm(nodes: Sequence[Node], ctx: RecipeContext) -> list[Launch]:
    (node,) = nodes
    (x,) = node.inputs
    d, eps = int(x.type.shape[-1]), float(node.attrs["eps"])
    kern = _row_norm(f"l2_norm_{d}_{name_tag(eps)}", x, d, [_l2_scale("inv", Var("ss"), eps)],
                     lambda row, j: Load("x", row + j) * Var("inv"), (), ctx)
    return [Launch(kern, (("x", ctx.buf(x)), ("y", ctx.buf(node.output))), (("T", token_binding(x)),))]


def _head_segments(nodes: Sequence[Node]) -> list[tuple[Node, Node, Node | None]]:
    """(slice, reshape into heads, l2_norm or None) of each part of a `slice_heads` match, in order."""
    segs, i = [], 0
    while i < len(nodes):
        norm = nodes[i + 2] if i + 2 < len(nodes) and nodes[i + 2].op == "l2_norm" else None
        segs.append((nodes[i], nodes[i + 1], norm))
        i += 3 if norm is not None else 2
    return segs


def _lower_slice_heads(nodes: Sequence[Node], ctx: RecipeContext) -> list[Launch]:
    """Slices of one input, each reshaped into heads, some then L2-normalized (Gated DeltaNet's q, k and v, cut from
    the convolution's output): one launch, a group per (token, head) row of any part, reading the row where it lies
    in the input. Each slice is stored as well (the normalized parts' for any other reader of them)."""
    segs = _head_segments(nodes)
    x = segs[0][0].inputs[0]
    width = int(x.type.shape[-1])
    parts = [(int(sl.attrs["start"]), int(heads.output.type.shape[1]), int(heads.output.type.shape[2]), norm)
             for sl, heads, norm in segs]
    total = sum(nh for _, nh, _, _ in parts)
    t, h = Var("g0") // total, Var("g0") % total
    body, params, bufs, first, tags = [], [Buf("x", "f32")], [("x", ctx.buf(x))], 0, []
    for j, ((start, nh, d, norm), (sl, _, _)) in enumerate(zip(parts, segs)):
        src = t * width + start + (h - first) * d
        dst = (t * nh + h - first) * d
        c = Var(f"c{j}")
        copy = Store(f"s{j}", dst + c, Load("x", src + c))
        if norm is None:
            stmts: list = [LaneFor(c.name, Const(d), (copy,))]
        else:
            eps = float(norm.attrs["eps"])
            stmts = [Reduce(f"ss{j}", "+", c.name, Const(d), (Let(f"x{j}", Load("x", src + c)),),
                            Var(f"x{j}") * Var(f"x{j}")),
                     _l2_scale(f"inv{j}", Var(f"ss{j}"), eps),
                     LaneFor(c.name, Const(d), (Store(f"y{j}", dst + c, Load("x", src + c) * Var(f"inv{j}")), copy))]
            params.append(Buf(f"y{j}", "f32", out=True))
            bufs.append((f"y{j}", ctx.buf(norm.output)))
        params.append(Buf(f"s{j}", "f32", out=True))
        bufs.append((f"s{j}", ctx.buf(sl.output)))
        # Flat Ifs on the group's head, one a part (as the stacked matvecs': uniform in the group).
        body.append(If((h >= first) & (h < first + nh), tuple(stmts)))
        tags.append(f"{start}_{nh}x{d}{'_l2' + name_tag(float(norm.attrs['eps'])) if norm else ''}")
        first += nh
    kern = Kernel(f"slice_heads_{width}_{'_'.join(tags)}", (*params, Scalar("T")), (Var("T") * total,), tuple(body),
                  lanes=ctx.lanes)
    return [Launch(kern, tuple(bufs), (("T", token_binding(x)),))]


def _match_slice_heads(nodes: Sequence[Node]) -> bool:
    segs = _head_segments(nodes)
    x = segs[0][0].inputs[0]
    for sl, heads, norm in segs:
        shape = heads.output.type.shape
        if not (sl.op == "slice" and heads.op == "reshape" and sl.inputs[0] is x and heads.inputs[0] is sl.output
                and len(x.type.shape) == 2 and len(shape) == 3 and shape[0] == x.type.shape[0]
                and (norm is None or norm.inputs[0] is heads.output)):
            return False
    return True


def _lower_rms_norm_gated(nodes: Sequence[Node], ctx: RecipeContext) -> list[Launch]:
    """Where the next matmuls read int8 activations of the norm's rows (the output projection's, after a reshape
    to a row a token), the norm writes them too and `provides` their quantize launch."""
    (node,) = nodes
    x, w, gate = node.inputs
    d, eps = int(x.type.shape[-1]), float(node.attrs["eps"])

    def value(row: Expr, j: Expr) -> Expr:
        z = Load("z", row + j)
        return Load("x", row + j) * Var("inv") * Load("w", j) * (z * sigmoid(z))

    per = math.prod(int(s) for s in node.output.type.shape[1:])
    qbufs, provides = ((), ())
    if d % QB == 0:
        qbufs, provides = quantized_output(ctx, ctx.buf(node.output), per, token_binding(x))
    kern = _row_norm(f"rms_norm_gated_{d}_{name_tag(eps)}{'_q8' if provides else ''}", x, d,
                     [rms_scale("inv", Var("ss"), d, eps)], value, (Buf("w", "f32"), Buf("z", "f32")), ctx,
                     quant=bool(provides))
    bufs = (("x", ctx.buf(x)), ("w", ctx.buf(w)), ("z", ctx.buf(gate)), ("y", ctx.buf(node.output)), *qbufs)
    return [Launch(kern, bufs, (("T", token_binding(x)),), provides=provides)]


def _gates_body(h: int, t: Expr) -> tuple:
    """Token t's gates: y[t, h, 0] = decay * softplus(alpha + dt) (the log decay), y[t, h, 1] = sigmoid(beta)."""
    i = t * h + Var("l")
    a = Var("a")
    return (LaneFor("l", Const(h), (
        Let("a", Load("alpha", i) + Load("dt", Var("l"))),
        # softplus(a) = max(a, 0) + log(1 + exp(-|a|)), without overflow
        Let("sp", Call("max", a, Const(0.0)) + Call("log", Const(1.0) + Call("exp", Const(0.0) - Call("abs", a)))),
        Store("gates", i * 2, Load("decay", Var("l")) * Var("sp")),
        Store("gates", i * 2 + 1, sigmoid(Load("beta", i))),
    )),)


GATES_PARAMS = (Buf("alpha", "f32"), Buf("beta", "f32"), Buf("dt", "f32"), Buf("decay", "f32"),
                Buf("gates", "f32", out=True))


def _gates_bufs(node: Node, ctx: RecipeContext) -> tuple:
    alpha, beta, dt_bias, decay = node.inputs
    return (("alpha", ctx.buf(alpha)), ("beta", ctx.buf(beta)), ("dt", ctx.buf(dt_bias)), ("decay", ctx.buf(decay)),
            ("gates", ctx.buf(node.output)))


def _lower_gdn_gates(nodes: Sequence[Node], ctx: RecipeContext) -> list[Launch]:
    (node,) = nodes
    h = int(node.inputs[0].type.shape[1])
    kern = Kernel(f"gdn_gates_{h}", (*GATES_PARAMS, Scalar("T")), (Var("T"),), _gates_body(h, Var("g0")),
                  lanes=ctx.lanes)
    return [Launch(kern, _gates_bufs(node, ctx), (("T", token_binding(node.inputs[0])),))]


def _conv_body(c: int, k: int, chunk: int) -> tuple:
    """The short convolution of group g0's `chunk` channels (a lane each) through the step's tokens, then the new
    state: y = silu(conv(state ++ x)), the state keeping the last k - 1 rows."""
    ch, t, j, i = Var("ch"), Var("t"), Var("j"), Var("i")
    # Row i of (state ++ x): the state's rows first, then this step's.
    row_term = (Let("i", t + j),
                If(i < k - 1, (Assign("acc", Var("acc") + Load("w", ch * k + j) * Load("s", i * c + ch)),),
                   (Assign("acc", Var("acc") + Load("w", ch * k + j) * Load("x", (i - (k - 1)) * c + ch)),)))
    per_token = (Decl("acc", "f32", Const(0.0)), For("j", Const(0), Const(k), row_term),
                 Store("y", t * c + ch, Var("acc") * sigmoid(Var("acc"))))
    # The new state: rows T .. T+K-2 of (state ++ x), in ascending order, so each read precedes its overwrite.
    keep = (Let("i", Var("T") + j),
            If(i < k - 1, (Store("s", j * c + ch, Load("s", i * c + ch)),),
               (Store("s", j * c + ch, Load("x", (i - (k - 1)) * c + ch)),)))
    return (LaneFor("l", Const(chunk), (
        Let("ch", Var("g0") * chunk + Var("l")),
        If(ch < c, (For("t", Const(0), Var("T"), per_token), For("j", Const(0), Const(k - 1), keep))),
    )),)


CONV_PARAMS = (Buf("x", "f32"), Buf("w", "f32"), Buf("s", "f32", out=True), Buf("y", "f32", out=True))


def _conv_shape(node: Node, ctx: RecipeContext) -> tuple[int, int, int]:
    """(channels, kernel width, channels a group: knob chunk) of an ssm_conv node."""
    c, k = (int(d) for d in node.inputs[1].type.shape)
    return c, k, max(1, min(int(ctx.knobs_for(CONV_SPACE, f"ssm_conv_{c}x{k}")["chunk"]), c))


def _conv_bufs(node: Node, ctx: RecipeContext) -> tuple:
    x, w = node.inputs
    return ("x", ctx.buf(x)), ("w", ctx.buf(w)), ("s", state_buffer(node)[0]), ("y", ctx.buf(node.output))


def _lower_ssm_conv(nodes: Sequence[Node], ctx: RecipeContext) -> list[Launch]:
    (node,) = nodes
    c, k, chunk = _conv_shape(node, ctx)
    kern = Kernel(f"ssm_conv_{c}x{k}", (*CONV_PARAMS, Scalar("T")), (Const((c + chunk - 1) // chunk),),
                  _conv_body(c, k, chunk), lanes=ctx.lanes, knobs=(("chunk", chunk),))
    return [Launch(kern, _conv_bufs(node, ctx), (("T", token_binding(node.inputs[0])),))]


def _lower_gates_conv(nodes: Sequence[Node], ctx: RecipeContext) -> list[Launch]:
    """gdn_gates then ssm_conv (independent: the gates of alpha and beta, the convolution of the qkv projection) in
    one launch: the convolution's groups, then one more group for every token's gates."""
    gates, conv = nodes
    h = int(gates.inputs[0].type.shape[1])
    c, k, chunk = _conv_shape(conv, ctx)
    groups = (c + chunk - 1) // chunk
    body = (If(Var("g0") < groups, _conv_body(c, k, chunk)),
            If(Var("g0").eq(groups), (For("tg", Const(0), Var("T"), _gates_body(h, Var("tg"))),)))
    kern = Kernel(f"gdn_gates_{h}_ssm_conv_{c}x{k}", (*GATES_PARAMS, *CONV_PARAMS, Scalar("T")), (Const(groups + 1),),
                  body, lanes=ctx.lanes, knobs=(("chunk", chunk),))
    return [Launch(kern, (*_gates_bufs(gates, ctx), *_conv_bufs(conv, ctx)), (("T", token_binding(conv.inputs[0])),))]


def _delta_heads(node: Node) -> tuple[int, int, int, int, Expr, str]:
    """(Hk, Dk, Hv, Dv, the key head of value head g0, the kernel name's shape tag) of a delta_rule node."""
    q, _, v, _ = node.inputs
    hk, dk = int(q.type.shape[1]), int(q.type.shape[2])
    hv, dv = int(v.type.shape[1]), int(v.type.shape[2])
    tiled = node.attrs["head_map"] == "tiled"
    h = Var("g0")
    kh = h % hk if tiled else h // (hv // hk)
    tag = f"{hk}x{dk}_{hv}x{dv}_{'tiled' if tiled else 'grouped'}_{name_tag(node.attrs['scale'])}"
    return hk, dk, hv, dv, kh, tag


def _recurrent_kernel(node: Node, ctx: RecipeContext, raw: tuple[int, int, int, int, float, float] | None = None
                      ) -> Kernel:
    """The token-by-token form: a group per (value head, column j of its state), whose lanes share the column's Dk
    values, kept adjacent (the state is stored transposed); per token: S *= exp(g); delta = beta (v_j - k . S[:, j]);
    S[:, j] += k delta; out_j = scale q . S[:, j], from one read of the column. It works on steps of at most `above`
    tokens (a scalar: one kernel whatever the threshold), the chunked form's kernels on the others.

    `raw` (width, q start, k start, v start, q's and k's L2-norm eps): q, k and v are read where they lie in the
    rows of one buffer x (the convolution's output) and q and k L2-normalized on the way: their sums of squares
    come out of the same Reduce as the dot products, which then take the norms' scales (`_lower_heads_delta_rule`:
    the slicing launch goes)."""
    hk, dk, hv, dv, kh, tag = _delta_heads(node)
    h, col, t, e = Var("g0"), Var("g1"), Var("t"), Var("e")
    qk = (t * hk + kh) * dk + e  # element e of the token's key (and query) head
    s = (h * dv + col) * dk + e  # S[h, e, col], kept transposed: a column's Dk values are adjacent
    g = (t * hv + h) * 2
    out = (t * hv + h) * dv + col
    if raw:
        width, qs0, ks0, vs0, q_eps, k_eps = raw
        head = t * width + kh * dk + e
        q_at, k_at, v_at = Load("x", head + qs0), Load("x", head + ks0), Load("x", t * width + vs0 + h * dv + col)
    else:
        q_at, k_at, v_at = Load("q", qk), Load("k", qk), Load("v", out)
    # Per token one read of the column gives k . S, q . S and q . k; with the decay d, delta = beta (v - d k.S) and
    # out = scale (d q.S + q.k delta); then S = d S + k delta. Two reads and one write of S per token.
    more = (("qs", Var("qe") * Var("se")), ("qk", Var("qe") * Var("ke")))
    ks, qs, qkd, k_scaled = Var("ks"), Var("qs"), Var("qk"), k_at
    norms: tuple = ()
    if raw:  # with q's and k's sums of squares: their L2 norms' scales iq, ik
        more += (("qq", Var("qe") * Var("qe")), ("kk", Var("ke") * Var("ke")))
        norms = (_l2_scale("iq", Var("qq"), q_eps), _l2_scale("ik", Var("kk"), k_eps))
        ks, qs, qkd, k_scaled = ks * Var("ik"), qs * Var("iq"), qkd * Var("iq") * Var("ik"), k_at * Var("ik")
    token = (
        Reduce("ks", "+", "e", Const(dk), (Let("se", Load("s", s)), Let("ke", k_at), Let("qe", q_at)),
               Var("ke") * Var("se"), more=more),
        *norms,
        Let("decay", Call("exp", Load("g", g))),
        Let("delta", (v_at - Var("decay") * ks) * Load("g", g + 1)),
        Store("y", out, (Var("decay") * qs + qkd * Var("delta")) * float(node.attrs["scale"])),
        LaneFor("e", Const(dk), (Store("s", s, Load("s", s) * Var("decay") + k_scaled * Var("delta")),)),
    )
    body = (If(Var("T") <= Var("above"), (For("t", Const(0), Var("T"), token),)),)
    inputs = (Buf("x", "f32"),) if raw else (Buf("q", "f32"), Buf("k", "f32"), Buf("v", "f32"))
    params = (*inputs, Buf("g", "f32"), Buf("s", "f32", out=True), Buf("y", "f32", out=True), Scalar("T"),
              Scalar("above"))
    rtag = f"_x{raw[0]}_{raw[1]}_{raw[2]}_{raw[3]}_l2{name_tag(raw[4])}_{name_tag(raw[5])}" if raw else ""
    return Kernel(f"delta_rule_{tag}{rtag}", params, (Const(hv), Const(dv)), body, lanes=ctx.lanes)


def _chunk_extent(s0: Expr, c: int) -> Let:
    """`n`: the tokens of the chunk that starts at token s0 (c, or fewer in the step's last chunk)."""
    rest = Var("T") - s0
    return Let("n", Select(rest < c, rest, Const(c)))


def _chunk_prep_kernel(node: Node, ctx: RecipeContext) -> Kernel:
    """The chunked form's first half, which needs no state: a group per (value head, chunk of C tokens) writes the
    chunk's cumulative log decays gc, its masked decayed scores attn[i, j] = scale q_i . k_j exp(gc_i - gc_j) (j <= i)
    and the WY / UT solution [u | w] of (I + A) [u | w] = [beta v | beta k exp(gc)], A[i, j] = beta_i k_i . k_j
    exp(gc_i - gc_j) (j < i), by forward substitution, one lane per column (`_chunk_scan_kernel` goes on)."""
    hk, dk, hv, dv, kh, tag = _delta_heads(node)
    c = int(node.attrs["chunk"])
    h, i, j, m, e = Var("g0"), Var("i"), Var("j"), Var("m"), Var("e")
    s0, n = Var("s0"), Var("n")
    row = h * Var("T") + s0  # row of the chunk's first token in the [Hv, T, ...] scratch buffers

    def key(buf: str, tok: Expr) -> Expr:
        return Load(buf, ((s0 + tok) * hk + kh) * dk + e)

    def gate(tok: Expr, which: int) -> Expr:
        return Load("g", ((s0 + tok) * hv + h) * 2 + which)

    cumsum = LaneFor("i", n, (
        Decl("acc", "f32", Const(0.0)),
        For("m", Const(0), i + 1, (Assign("acc", Var("acc") + gate(m, 0)),)),
        Store("lg", i, Var("acc")), Store("gc", row + i, Var("acc")),
    ))
    scores = LaneFor("p", n * n, (
        Let("i", Var("p") // n), Let("j", Var("p") % n),
        If(j <= i, (
            Decl("kk", "f32", Const(0.0)), Decl("qk", "f32", Const(0.0)),
            For("e", Const(0), Const(dk), (
                Let("kj", key("k", j)),
                Assign("kk", Var("kk") + key("k", i) * Var("kj")),
                Assign("qk", Var("qk") + key("q", i) * Var("kj")),
            )),
            Let("d", Call("exp", Load("lg", i) - Load("lg", j))),
            Store("la", i * c + j, gate(i, 1) * Var("d") * Var("kk")),
            Store("a", (row + i) * c + j, Var("qk") * Var("d") * float(node.attrs["scale"])),
        )),
    ))

    def solve(out: str, width: int, rhs: Expr) -> LaneFor:
        """Column `col` of (I + A) x = rhs, row by row; only the diagonal's left of A is read."""
        at = (row + i) * width + Var("col")
        return LaneFor("col", Const(width), (For("i", Const(0), n, (
            Decl("x", "f32", rhs),
            For("m", Const(0), i, (Assign("x", Var("x") - Load("la", i * c + m) * Load(out, (row + m) * width
                                                                                       + Var("col"))),)),
            Store(out, at, Var("x")),
        )),))

    cl = Var("col")
    body = (If(Var("above") < Var("T"), (
        Let("s0", Var("g1") * c), _chunk_extent(s0, c), cumsum, scores,
        solve("u", dv, Load("v", ((s0 + i) * hv + h) * dv + cl) * gate(i, 1)),
        solve("w", dk, Load("k", ((s0 + i) * hk + kh) * dk + cl) * gate(i, 1) * Call("exp", Load("lg", i))),
    )),)
    params = (Buf("q", "f32"), Buf("k", "f32"), Buf("v", "f32"), Buf("g", "f32"), Buf("gc", "f32", out=True),
              Buf("a", "f32", out=True), Buf("u", "f32", out=True), Buf("w", "f32", out=True), Scalar("T"),
              Scalar("above"))
    return Kernel(f"delta_chunk_{tag}_{c}", params, (Const(hv), (Var("T") + (c - 1)) // c), body, lanes=ctx.lanes,
                  local=(LocalArray("lg", "f32", c), LocalArray("la", "f32", c * c)))


def _chunk_scan_kernel(node: Node, ctx: RecipeContext) -> Kernel:
    """The chunked form's second half: a group per (value head, column j of its state) carries the column (in local
    memory) through the step's chunks: per chunk, what each token writes, v_new_i = u_i - w_i . S (S as the chunk
    found it), then out_i = scale exp(gc_i) q_i . S + sum_{m <= i} attn[i, m] v_new_m, and S = exp(gc_last) S +
    sum_i k_i exp(gc_last - gc_i) v_new_i: a few lane loops a chunk instead of a reduction a token."""
    hk, dk, hv, dv, kh, tag = _delta_heads(node)
    c = int(node.attrs["chunk"])
    h, col, i, m, e = Var("g0"), Var("g1"), Var("i"), Var("m"), Var("e")
    s0, n = Var("s0"), Var("n")
    row = h * Var("T") + s0
    s = (h * dv + col) * dk + e  # the state kept transposed, as the recurrent form keeps it

    def key(buf: str, tok: Expr) -> Expr:
        return Load(buf, ((s0 + tok) * hk + kh) * dk + e)

    writes = LaneFor("i", n, (
        Decl("ws", "f32", Const(0.0)), Decl("qs", "f32", Const(0.0)),
        For("e", Const(0), Const(dk), (
            Let("se", Load("sc", e)),
            Assign("ws", Var("ws") + Load("w", (row + i) * dk + e) * Var("se")),
            Assign("qs", Var("qs") + key("q", i) * Var("se")),
        )),
        Let("gi", Load("gc", row + i)),
        Let("vi", Load("u", (row + i) * dv + col) - Var("ws")),
        Store("vn", i, Var("vi")),
        Store("vd", i, Var("vi") * Call("exp", Var("last") - Var("gi"))),
        Store("qo", i, Var("qs") * Call("exp", Var("gi")) * float(node.attrs["scale"])),
    ))
    outputs = LaneFor("i", n, (
        Decl("o", "f32", Load("qo", i)),
        For("m", Const(0), i + 1, (Assign("o", Var("o") + Load("a", (row + i) * c + m) * Load("vn", m)),)),
        Store("y", ((s0 + i) * hv + h) * dv + col, Var("o")),
    ))
    # S = exp(gc_last) S + sum_i k_i vd_i, the keys staged KEY_TILE tokens at a time in local memory, transposed
    # (padded rows: no bank conflicts): each lane then reads its e's keys contiguously, where global memory has
    # them Hk * Dk floats apart (8 KB at Qwen3.6's shape: cache-set conflicts on CPUs).
    t0, ti, te, pad = Var("t0"), Var("ti"), Var("te"), KEY_TILE + 1
    update = (
        LaneFor("e", Const(dk), (Store("sc", e, Load("sc", e) * Call("exp", Var("last"))),)),
        For("t0", Const(0), n, (
            Let("tn", Select(n - t0 < KEY_TILE, n - t0, Const(KEY_TILE))),
            LaneFor("p", Var("tn") * dk, (
                Let("ti", Var("p") // dk), Let("te", Var("p") % dk),
                Store("kc", te * pad + ti, Load("k", ((s0 + t0 + ti) * hk + kh) * dk + te)),
            )),
            LaneFor("e", Const(dk), (
                Decl("acc", "f32", Load("sc", e)),
                For("i", Const(0), Var("tn"), (Assign("acc", Var("acc") + Load("kc", e * pad + i)
                                                      * Load("vd", t0 + i)),)),
                Store("sc", e, Var("acc")),
            )),
        ), step=KEY_TILE),
    )
    chunk = (Let("s0", Var("ci") * c), _chunk_extent(s0, c), Let("last", Load("gc", row + n - 1)),
             writes, outputs, *update)
    body = (If(Var("above") < Var("T"), (
        LaneFor("e", Const(dk), (Store("sc", e, Load("s", s)),)),
        For("ci", Const(0), (Var("T") + (c - 1)) // c, chunk),
        LaneFor("e", Const(dk), (Store("s", s, Load("sc", e)),)),
    )),)
    params = (Buf("q", "f32"), Buf("k", "f32"), Buf("gc", "f32"), Buf("a", "f32"), Buf("u", "f32"), Buf("w", "f32"),
              Buf("s", "f32", out=True), Buf("y", "f32", out=True), Scalar("T"), Scalar("above"))
    local = (LocalArray("sc", "f32", dk), LocalArray("vn", "f32", c), LocalArray("vd", "f32", c),
             LocalArray("qo", "f32", c), LocalArray("kc", "f32", dk * pad))
    return Kernel(f"delta_scan_{tag}_{c}", params, (Const(hv), Const(dv)), body, lanes=ctx.lanes, local=local)


def _chunked_above(node: Node, ctx: RecipeContext) -> int:
    """Knob chunked_above of a delta_rule node: steps of more tokens take the chunked form."""
    tag = _delta_heads(node)[5]
    above = ctx.knobs_for(DELTA_SPACE, f"delta_rule_{tag}")["chunked_above"]
    return int(ctx.target().knob("delta_rule", "chunked_above", above))


def _lower_delta_rule(nodes: Sequence[Node], ctx: RecipeContext) -> list[Launch]:
    """The recurrent form's kernel, and in plans with steps of more than `chunked_above` tokens the chunked form's
    two as well (the step's length chooses at run time which do the work)."""
    (node,) = nodes
    q, k, v, gates = node.inputs
    _, dk, hv, dv, _, tag = _delta_heads(node)
    above = _chunked_above(node, ctx)
    tb = token_binding(v)
    t_max = ctx.max_rows(v)
    inputs = (("q", ctx.buf(q)), ("k", ctx.buf(k)))
    state, out = ("s", state_buffer(node)[0]), ("y", ctx.buf(node.output))
    step = (("T", tb), ("above", max(above, 0)))
    launches = []
    if above >= 1:
        launches.append(Launch(_recurrent_kernel(node, ctx),
                               (*inputs, ("v", ctx.buf(v)), ("g", ctx.buf(gates)), state, out), step))
    if t_max > above:
        c = int(node.attrs["chunk"])
        scratch = (("gc", ctx.scratch("delta_gc", "f32", hv * t_max)),
                   ("a", ctx.scratch("delta_attn", "f32", hv * t_max * c)),
                   ("u", ctx.scratch("delta_u", "f32", hv * t_max * dv)),
                   ("w", ctx.scratch("delta_w", "f32", hv * t_max * dk)))
        launches += [Launch(_chunk_prep_kernel(node, ctx), (*inputs, ("v", ctx.buf(v)), ("g", ctx.buf(gates)),
                                                              *scratch), step),
                     Launch(_chunk_scan_kernel(node, ctx), (*inputs, *scratch, state, out), step)]
    return launches


def _lower_heads_delta_rule(nodes: Sequence[Node], ctx: RecipeContext) -> list[Launch]:
    """q, k and v cut from the convolution's output (q and k L2-normalized) and the delta rule: in plans whose steps
    all take the recurrent form (decode, batched decoding), its kernel reads them where they lie and normalizes
    q and k itself (`_recurrent_kernel`'s raw), one launch a layer fewer; other plans as `slice_heads3` and
    `delta_rule` lower them."""
    *heads, delta = nodes
    above = _chunked_above(delta, ctx)
    (sq, _, nq), (sk, _, nk), (sv, _, _) = _head_segments(heads)
    x = sq.inputs[0]
    if ctx.max_rows(x) > above or above < 1:
        return [*_lower_slice_heads(heads, ctx), *_lower_delta_rule([delta], ctx)]
    raw = (int(x.type.shape[-1]), int(sq.attrs["start"]), int(sk.attrs["start"]), int(sv.attrs["start"]),
           float(nq.attrs["eps"]), float(nk.attrs["eps"]))
    state, out = ("s", state_buffer(delta)[0]), ("y", ctx.buf(delta.output))
    return [Launch(_recurrent_kernel(delta, ctx, raw), (("x", ctx.buf(x)), ("g", ctx.buf(delta.inputs[3])), state,
                                                        out), (("T", token_binding(x)), ("above", above)))]


def _match_heads_delta_rule(nodes: Sequence[Node]) -> bool:
    # The slices and normalized heads are taken to have no other reader, as in the other fused chains.
    *heads, delta = nodes
    if not _match_slice_heads(heads):
        return False
    (_, _, nq), (_, _, nk), (_, v_heads, v_norm) = _head_segments(heads)
    return (nq is not None and nk is not None and v_norm is None and delta.inputs[0] is nq.output
            and delta.inputs[1] is nk.output and delta.inputs[2] is v_heads.output)


# q, k and v of Gated DeltaNet with the delta rule, in one launch, or the three in one launch, and any one sliced,
# L2-normalized part alone.
register(Recipe("heads_delta_rule", ("slice", "reshape", "l2_norm") * 2 + ("slice", "reshape", "delta_rule"),
                _lower_heads_delta_rule, _match_heads_delta_rule, DELTA_SPACE))
register(Recipe("slice_heads3", ("slice", "reshape", "l2_norm") * 2 + ("slice", "reshape"), _lower_slice_heads,
                _match_slice_heads))
register(Recipe("slice_heads", ("slice", "reshape", "l2_norm"), _lower_slice_heads, _match_slice_heads))
register(Recipe("slice", ("slice",), _lower_slice))
register(Recipe("l2_norm", ("l2_norm",), _lower_l2_norm))
register(Recipe("rms_norm_gated", ("rms_norm_gated",), _lower_rms_norm_gated))
register(Recipe("gdn_gates", ("gdn_gates",), _lower_gdn_gates))
register(Recipe("gdn_gates_ssm_conv", ("gdn_gates", "ssm_conv"), _lower_gates_conv, None, CONV_SPACE))
register(Recipe("ssm_conv", ("ssm_conv",), _lower_ssm_conv, None, CONV_SPACE))
register(Recipe("delta_rule", ("delta_rule",), _lower_delta_rule, None, DELTA_SPACE))

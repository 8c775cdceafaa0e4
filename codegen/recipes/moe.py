"""MoE recipes: `router`, `moe_ffn`, `router_moe` (the two together) and `router_moe_add_rms_norm` (with the
residual add and the next RMS norm, whose kernel does the combine).

Route buffer convention (i32, 2 * T * k words, as the compiler sizes it): words [0, T*k) hold the expert ids of
(token t, slot s) at t*k + s; words [T*k, 2*T*k) hold the slot weights as Q30 fixed point, round(w * 2^30)
(the IR has no bit-cast, and weights lie in [0, 1], so Q30 keeps ~1e-9 absolute precision).

`moe_ffn` dispatches by expert (group tokens by expert, run each selected expert's matrix products over all its
tokens, weighted combine back), in launches over plan scratch buffers sized for the plan's t_max:

1. `group` (one group): lane e scans the T*k route ids in order and lists the entries `t*k + s` routed to expert
   e, then one lane lists the experts that have entries: list buffer (i32) = [count of each expert (n_expert
   words)] + [n_expert x cap entries] + [number of active experts, their ids], cap = t_max * k.
2. `gate/up` (grid active experts x row tiles, at most min(n_expert, T*k) groups in x, those past the number of
   active experts exit): h[entry, f] = silu(gate_e x_t) * (up_e x_t) for every listed entry (t = entry // k),
   each weight row read once for all the expert's tokens.
3. `down` (the same grid): d[entry, r] = down_e h[entry].
4. `combine` (grid T x row pieces): y[t] = sum_s w(t, s) * d[t*k + s]; each group owns a piece of its
   token's row: no atomics.

Expert e's matrix starts at byte e * rows * row_bytes of the 3-D weight tensor; in a plan for expert streaming
(`RecipeContext.stream_experts`) the weight buffers hold a layer's expert slots and the expert kernels read expert
e's matrix at slot[e] * rows * row_bytes (`slot`: the layer's slot table, `ExpertStream`), h gets quantization
buffers of its own (the executor may run the expert launches once per group of experts that fits the cache), and
the recipe records the layer in `RecipeContext.expert_streams`; in a plan of one-token steps two launches before
the experts' let the device keep the cache itself (`resolve_kernel`: the bookkeeping, in the slot table's buffer
laid out as `ExpertState`; `fill_kernel`: the misses copied from host memory, read in place), which the executor
runs where the runtime can map host memory and drops elsewhere. With one lane (the CPU) dot
products come from `_matvec.block_dot` on f32 activations, lanes taking rows and walking the expert's tokens,
with per-element partial sums, non-negative index masks and arithmetic f16 decoding as `linear` does. With more
lanes (GPUs) and int8-path formats (knob xq), x and then h are quantized to int8 once (`linear.quantize_x_kernel`,
two more launches) and each group sweeps one expert row with `_matvec.split_row_dot` (knobs sub: lanes per
block, runs: consecutive words per lane, see `_matvec.use_runs`; spread: rows a group whose lanes spread over
them, "auto" `_matvec.spread_rows`: 16 Q4_K rows of 768 columns); other formats take a Reduce over each row's
blocks on f32 activations. Knobs: rows, split, xq, sub, runs, spread. Prompt chunks on matrix units (the
policy's `matrix_units`, matrices of at least mma_min) take `tile_mma.tile_mma_kernel` for gate/up and down in
steps of more than TILES_ABOVE tokens (shorter ones keep the int8 matvecs, the row count picking at run time; F16
experts: every step of several tokens), its tokens gathered through the lists (`expert_gather`, a grid dimension
over the experts with entries), after the same quantize launches (F16 weights: on the f32 activations); knobs mma_rows,
mma_tokens, mma_chunk, mma_lanes, mma_min, mma_words as `linear`'s. In a plan of one-token steps (decode)
the router writes the lists itself (recipe `router_moe`) and the `group` launch goes. Where the residual add and
an RMS norm follow (every layer but the last), the norm's kernel sums the experts' outputs (`combine_addend`)
and the `combine` launch goes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from polystrata.codegen.format_analysis import elements_per_row_bytes, weight_dtype
from polystrata.codegen.recipes import (
    ExpertState,
    ExpertStream,
    Knob,
    KnobSpace,
    Recipe,
    RecipeContext,
    kernel_builder,
    recipe_named,
    register,
    token_binding,
)
from polystrata.codegen.recipes._matvec import (
    QB,
    Act,
    block_dot,
    fmt_for,
    group_rows,
    guarded,
    nonneg_mask,
    runs_for_target,
    slot_row,
    split_dots,
    split_lanes,
    spread_rows,
    sub_lanes,
    sum_partials,
    use_int8,
    use_runs,
)
from polystrata.codegen.recipes.attention_tiles import TILES_ABOVE
from polystrata.codegen.recipes.elementwise import (
    Addend,
    gate_logit,
    match_add_rms,
    match_gate_sigmoid_mul_add,
    norm_launch,
    sigmoid,
)
from polystrata.codegen.recipes.linear import batch_rows, match_glu, quantize_x_kernel, silu, value_format
from polystrata.codegen.recipes.tile_matmul import gate_suffix, step_gate
from polystrata.codegen.recipes.tile_mma import (
    TILE_MMA_KNOBS,
    Gather,
    f16_path,
    mma_chunk,
    staging_flags,
    tile_mma_kernel,
    tile_products_apply,
    tile_tokens,
    u8f16_products,
)
from polystrata.ir.expr import Const, Expr, Var
from polystrata.ir.formats import QuantFormat
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
    Select,
    Store,
)

Q30 = float(1 << 30)


@kernel_builder
def router_kernel(name: str, e: int, k: int, norm: bool, lanes: int, lists: int | None = None) -> Kernel:
    """Softmax over e logits, top-k by repeated argmax (lowest index wins ties), optional renormalisation; grid
    (T,). Each argmax is two group reductions (the largest probability, then the lowest index holding it), so
    with a warp of lanes the whole top-k takes no barrier but the one after marking each pick taken.

    `lists` (a plan of one-token steps; the list capacity, k): also write the expert lists `group_kernel` would
    (`lst`), for the one token: each picked expert has one entry, and the experts with entries are the picks.
    Only what the expert kernels read is written (other experts' counts are not)."""
    t, j = Var("g0"), Var("j")
    p = Load("p", j)
    body = [
        Reduce("m", "max", "j", Const(e), (), Load("x", t * e + j)),
        LaneFor("j", Const(e), (Store("p", j, Call("exp", Load("x", t * e + j) - Var("m"))),)),
        Reduce("z", "+", "j", Const(e), (), p),
        Decl("tot", "f32", Const(0.0)),
    ]
    for s in range(k):
        body += [
            Reduce(f"bv{s}", "max", "j", Const(e), (), p),
            # e - 1 - (the lowest index with that probability): a max, as reductions go
            Reduce(f"br{s}", "max", "j", Const(e), (), Select(p.eq(Var(f"bv{s}")), Cast("f32", (e - 1) - j),
                                                              Const(-1.0))),
            Let(f"bi{s}", (e - 1) - Cast("i32", Var(f"br{s}"))),
            Store("p", Var(f"bi{s}"), Const(-2.0)),  # taken
            Assign("tot", Var("tot") + Var(f"bv{s}") / Var("z")),
        ]
    for s in range(k):
        w = Var(f"bv{s}") / Var("z")
        if norm:
            w = w / Var("tot")
        body += [Store("route", t * k + s, Var(f"bi{s}")),
                 Store("route", Var("T") * k + t * k + s, Cast("i32", w * Q30 + 0.5))]
    params = (Buf("x", "f32"), Buf("route", "i32", out=True))
    if lists is not None:
        a = e * (1 + lists)
        for s in range(k):  # the token's entry s is route word s
            body += [Store("lst", Var(f"bi{s}"), Const(1)), Store("lst", Const(e) + Var(f"bi{s}") * lists, Const(s)),
                     Store("lst", Const(a + 1 + s), Var(f"bi{s}"))]
        body.append(Store("lst", Const(a), Const(k)))
        params += (Buf("lst", "i32", out=True),)
    return Kernel(name, (*params, Scalar("T")), (Var("T"),), tuple(body), lanes=lanes,
                  local=(LocalArray("p", "f32", e),))


# version 2: mma_chunk "auto" (the policy's 128 on GPUs, was 64); version 3: the tile kernel's staging and dealing
# changed; version 4: the tile products of long steps read the knobs of a kernel family of their own
# (`_lower_moe`). Knob shared: a shared expert of the experts' shape and formats inside their int8 launches
# (`_lower_moe`); 0: its own launches. Not a candidate for `tune`: it changes which launches a plan has, not a
# kernel's schedule.
MOE_SPACE = KnobSpace("moe_ffn", (
    Knob("rows", 4, (1, 2, 8)), Knob("split", "auto", ("rows", "blocks")), Knob("xq", "auto", ("inline", "kernel")),
    Knob("sub", "auto", (1, 2, 4, 8)), Knob("runs", "auto", (0, 1)), Knob("spread", "auto", (0, 1)),
    Knob("contract", "auto", (0, 1)), Knob("shared", 1), *TILE_MMA_KNOBS), version=4,
    constraint=lambda kn: not (kn["xq"] == "inline" and any(kn[k] != "auto" for k in ("sub", "runs", "spread"))))


def list_words(n_exp: int, cap: int) -> int:
    """Size of the list buffer `group_kernel` writes (see there)."""
    return n_exp * (1 + cap) + 1 + n_exp


@kernel_builder
def group_kernel(name: str, n_exp: int, k: int, cap: int, lanes: int) -> Kernel:
    """lst[e] = number of route entries with expert e; lst[n_exp + e*cap + j] = the j-th such entry (t*k + s);
    then the experts with entries, in order: lst[A] = their number, lst[A + 1 + i] = the i-th (A = n_exp*(1+cap)).
    One group: lane e lists expert e and keeps its count in local memory; then lane e places an expert with
    entries at its rank among them (a count over the local counts, not a serial walk of the global ones)."""
    ex, e2 = Var("e"), Var("e2")
    a = n_exp * (1 + cap)
    used = Select(Load("c", e2) > 0, Const(1), Const(0))
    body = (
        LaneFor("e", Const(n_exp), (
            Decl("cnt", "i32", Const(0)),
            For("i", Const(0), Var("T") * k, (If(Load("route", Var("i")).eq(ex), (
                Store("lst", Const(n_exp) + ex * cap + Var("cnt"), Var("i")),
                Assign("cnt", Var("cnt") + 1),
            )),)),
            Store("lst", ex, Var("cnt")),
            Store("c", ex, Var("cnt")),
        )),
        LaneFor("e", Const(n_exp), (If(Load("c", ex) > 0, (
            Decl("rank", "i32", Const(0)),
            For("e2", Const(0), ex, (Assign("rank", Var("rank") + used),)),
            Store("lst", Const(a + 1) + Var("rank"), ex),
        )),)),
        Reduce("na", "+", "e2", Const(n_exp), (), Cast("f32", used)),
        Store("lst", Const(a), Cast("i32", Var("na"))),
    )
    params = (Buf("route", "i32"), Buf("lst", "i32", out=True), Scalar("T"))
    return Kernel(name, params, (Const(1),), body, lanes=lanes, local=(LocalArray("c", "i32", n_exp),),
                  doc=f"moe group {n_exp}x{k}")


def _active_grid(n_exp: int, k: int, rest: Expr, gate: tuple[int, bool] | None = None) -> tuple:
    """Grid over the experts with entries (at most T*k of them) x `rest`; groups past their number exit. `gate`:
    the steps it runs for (`tile_matmul.step_gate`)."""
    return (step_gate(Call("min", Const(n_exp), Var("T") * k), gate), rest)


def _active_expert(n_exp: int, cap: int, inner: list, slots: bool = False) -> list:
    """`inner` for expert `ex` = the g0-th expert with entries, when there is one; its weights are those of
    expert `xw` (`weight_index`): with `slots`, the slot the slot table gives `ex` (a streaming plan's expert
    cache); else `ex` itself."""
    a = n_exp * (1 + cap)
    lets = [Let("ex", Load("lst", Const(a + 1) + Var("g0")))] + ([Let("xw", Load("slot", Var("ex")))] if slots else [])
    return [If(Var("g0") < Load("lst", Const(a)), (*lets, *inner))]


def expert_gather(n_exp: int, n: int, k: int, cap: int, per_token: bool, slots: bool) -> Gather:
    """The tokens of `tile_mma.tile_mma_kernel` in MoE prefill: those listed for the g2-th expert with entries
    (`group_kernel`'s lists; none past their number), activation row entry // k (`per_token`) or the entry, output
    row the entry, weights those of the expert (`weight_index`) in matrices of n rows."""
    a = n_exp * (1 + cap)
    on = Var("g2") < Load("lst", Const(a))
    lets = (Let("ex", Select(on, Load("lst", Const(a + 1) + Var("g2")), Const(0))),
            *((Let("xw", Load("slot", Var("ex"))),) if slots else ()),
            Let("cnt", Select(on, Load("lst", Var("ex")), Const(0))))

    def entry(j: Expr) -> Expr:
        return Load("lst", Const(n_exp) + Var("ex") * cap + j)

    return Gather(lets, Var("cnt"), (lambda j: entry(j) // k) if per_token else entry, entry,
                  weight_index(slots) * n, (Buf("lst", "i32"), *_slot_params(slots)),
                  _active_grid(n_exp, k, Const(1))[0])


def _slot_params(slots: bool) -> tuple:
    return (Buf("slot", "i32"),) if slots else ()


def weight_index(slots: bool) -> Var:
    """The index of the expert's matrix in the weight buffers (see `_active_expert`)."""
    return Var("xw") if slots else Var("ex")


@kernel_builder
def expert_kernel(name: str, fmts: Sequence[QuantFormat], n_exp: int, n: int, kd: int, k: int, cap: int, *,
                  act: str, per_token: bool, rows: int, split: str, lanes: int,
                  epilogue: Callable[[list[Expr]], Expr] | None = None, slots: bool = False,
                  host_arith: bool | None = None, contract: bool = False) -> Kernel:
    """out[entry, r] = epilogue(dot(w_j[e, r], a) for each weight j) for each entry listed for expert e = g0.
    `slots`: the weights hold expert slots, and a slot table (`slot`) maps each expert to its slot. `host_arith`:
    `Policy.host_arith` (None, for kernels built without a target: with one lane); `contract`: `Kernel.contract`.

    Weights [n_exp, n, kd]; the activation row is `act[entry // k]` (`per_token`) or `act[entry]`.
    Grid (experts with entries, ceil(n / rows)) (`_active_grid`): each group reads its weight rows once for all
    the expert's entries.
    """
    rows = max(1, min(rows, n))
    cpu = lanes == 1 if host_arith is None else host_arith
    vert = cpu and split == "rows"
    wnames = [f"w{j}" for j in range(len(fmts))]
    rbs = [elements_per_row_bytes(f, kd) for f in fmts]
    masks = [nonneg_mask(n_exp * n * rb) if cpu else 0 for rb in rbs]
    a = Act(act, kd)
    ex, xw = Var("ex"), weight_index(slots)
    pb = max(fmt_for(f).block_size for f in fmts)
    local: list = []
    body: list = [Let("cnt", Load("lst", ex))]

    def entry(j: Expr, sfx: str) -> list:
        ent = Var(f"ent{sfx}")
        return [Let(ent.name, Load("lst", Const(n_exp) + ex * cap + j)),
                Let(f"ta{sfx}", ent // k if per_token else ent)]

    def result(vals: list[Expr]) -> Expr:
        return epilogue(vals) if epilogue else vals[0]

    if split == "rows":
        if vert:
            local = [LocalArray("p", "f32", (1 if lanes == 1 else rows) * len(fmts) * pb)]
        accs = [f"acc{j}" for j in range(len(fmts))]
        inner: list = [*entry(Var("j"), ""), *(Decl(acc, "f32", Const(0.0)) for acc in accs)]
        parts = []
        for j, f in enumerate(fmts):
            po = Const(j * pb) if lanes == 1 else (Var("rr") * len(fmts) + j) * pb
            if vert:
                parts.append(("p", po))
                inner.append(For("e", Const(0), Const(fmt_for(f).block_size), (Store("p", po + Var("e"), Const(0.0)),)))
            inner.append(For("b", Const(0), Const(kd // fmt_for(f).block_size), tuple(block_dot(
                f, wnames[j], Var(f"w{j}_rb"), Var("b"), a, Var("ta"), accs[j], f"w{j}_", parts[j] if vert else None,
                nonneg=masks[j]))))
            if vert:
                inner += sum_partials("p", po, fmt_for(f).block_size, accs[j])
        inner.append(Store("out", Var("ent") * n + Var("row"), result([Var(acc) for acc in accs])))
        body.append(LaneFor("rr", Const(rows), (
            Let("row", Var("g1") * rows + Var("rr")),
            If(Var("row") < n, (
                *(Let(f"w{j}_rb", (xw * n + Var("row")) * rb) for j, rb in enumerate(rbs)),
                For("j", Const(0), Var("cnt"), tuple(inner)),
            )),
        )))
    else:
        for r in range(rows):
            row = Var("g1") * rows + r
            rowc = Call("min", row, Const(n - 1))  # loads stay in bounds; the store is guarded
            red = []
            for j, f in enumerate(fmts):
                acc = f"acc{j}"
                red.append(Reduce(f"s{r}_{j}", "+", f"bb{j}", Const(kd // fmt_for(f).block_size), (
                    Decl(acc, "f32", Const(0.0)),
                    *block_dot(f, wnames[j], (xw * n + rowc) * rbs[j], Var(f"bb{j}"), a, Var(f"ta{r}"), acc,
                               f"w{j}_"),
                ), Var(acc)))
            vals = [Var(f"s{r}_{j}") for j in range(len(fmts))]
            body.append(For(f"j{r}", Const(0), Var("cnt"), (
                *entry(Var(f"j{r}"), str(r)), *red,
                If(row < n, (Store("out", Var(f"ent{r}") * n + row, result(vals)),)),
            )))
    params = (Buf(act, "f32"), Buf("lst", "i32"), *_slot_params(slots),
              *(Buf(w, weight_dtype(f)) for w, f in zip(wnames, fmts)), Buf("out", "f32", out=True), Scalar("T"))
    grid = _active_grid(n_exp, k, Const((n + rows - 1) // rows))
    knobs = (("rows", rows), ("split", split), ("vert", int(vert)), ("contract", int(contract)))
    return Kernel(name, params, grid, tuple(_active_expert(n_exp, cap, body, slots)), lanes=lanes,
                  local=tuple(local), knobs=knobs, contract=contract,
                  doc=f"moe expert matmul {'+'.join(f.name for f in fmts)} [{n_exp}x{n}x{kd}]")


@kernel_builder
def expert_q8_kernel(name: str, fmts: Sequence[QuantFormat], n_exp: int, n: int, kd: int, k: int, cap: int, *,
                     per_token: bool, sub: int | str, lanes: int, runs: bool | int | str = "auto", spread: int = 1,
                     epilogue: Callable[[list[Expr]], Expr] | None = None, slots: bool = False,
                     gate: tuple[int, bool] | None = None, shared: bool = False) -> Kernel:
    """`expert_kernel` from int8 activations (`linear.quantize_x_kernel`'s buffers; GPU path): grid (experts
    with entries, ceil(n / spread)), `spread` weight rows per group with the lanes spread over them (one row where
    it has as many units as a subgroup has lanes), their dot products swept together (`_matvec.split_dots`).
    `gate`: the steps it runs for (`tile_matmul.step_gate`). `shared`: one more column of groups takes a shared
    expert of the same shape and formats (weights ws0, ...: one matrix each) for every token of the step, its
    activation rows t (`per_token`) or T * k + t, its output rows T * k + t (after the routed entries' rows): the
    shared expert's matmuls in the routed experts' launches (`_lower_moe`)."""
    subs = [sub_lanes(f, sub, runs) for f in fmts]
    act = Act("xq", kd, "xq", "xd", packed=True)
    ex, xw, ent = Var("ex"), weight_index(slots), Var("ent")
    first = Var("g1") * spread if spread > 1 else Var("g1")
    row = slot_row(first, spread, n) if spread > 1 else first
    guards = group_rows(first, spread, n)[1]

    def dots(w: str, acc: str, matrix: Expr, ta: Expr, out_row: Expr) -> list:
        """Weights `{w}{j}`'s rows of matrix `matrix` against activation row `ta` (dot products `{acc}{j}`), stored
        to row `out_row`."""
        red = split_dots([(f"{acc}{j}", f, f"{w}{j}", (matrix * n + row) * elements_per_row_bytes(f, kd),
                           f"{w}{j}_", subs[j]) for j, f in enumerate(fmts)], act, ta, runs, spread=spread)
        stores = []
        for r in range(spread):
            vals = [Var(f"{acc}{j}_{r}" if spread > 1 else f"{acc}{j}") for j in range(len(fmts))]
            stores.append(guarded(guards[r], Store("out", out_row * n + first + r if r else out_row * n + first,
                                                   epilogue(vals) if epilogue else vals[0])))
        return [*red, *stores]

    body = [For("j", Const(0), Load("lst", ex), (
        Let("ent", Load("lst", Const(n_exp) + ex * cap + Var("j"))),
        Let("ta", ent // k if per_token else ent),
        *dots("w", "s", xw, Var("ta"), ent),
    ))]
    active_grid = _active_grid(n_exp, k, Const(-(-n // spread)), gate)
    body = _active_expert(n_exp, cap, body, slots)
    if shared:  # the column after the routed experts' (whose groups past their number do nothing)
        tk, t = Var("T") * k, Var("t")
        body.append(If(Var("g0").eq(Call("min", Const(n_exp), tk)), (For("t", Const(0), Var("T"), (
            Let("tas", t if per_token else tk + t),
            *dots("ws", "sh", Const(0), Var("tas"), tk + t),
        )),)))
        active_grid = (step_gate(Call("min", Const(n_exp), tk) + 1, gate), active_grid[1])
    wparams = [Buf(f"w{j}", weight_dtype(f)) for j, f in enumerate(fmts)]
    if shared:
        wparams += [Buf(f"ws{j}", weight_dtype(f)) for j, f in enumerate(fmts)]
    params = (Buf("xq", "u32"), Buf("xd", "f32"), Buf("lst", "i32"), *_slot_params(slots), *wparams,
              Buf("out", "f32", out=True), Scalar("T"))
    return Kernel(name, params, active_grid, tuple(body), lanes=lanes,
                  knobs=(("sub", ",".join(map(str, subs))),
                         ("runs", ",".join(str(int(use_runs(f, runs))) for f in fmts)), ("xq", "kernel"),
                         ("spread", spread)),
                  doc=f"moe expert matvec int8 {'+'.join(f.name for f in fmts)} [{n_exp}x{n}x{kd}]")


def _expert_sum(k: int, dm: int, tokens: Expr) -> Callable[[Expr, Expr, int], Expr]:
    """sum_s w(t, s) * d[(t*k + s) * dm + i] as an expression of (token t, element i, the alignment in elements i
    has): the experts' outputs weighted by the route's slot weights (`tokens`: the kernel's token count, which
    places the weights in the route buffer)."""
    def value(t: Expr, i: Expr, align: int) -> Expr:
        terms = [Cast("f32", Load("route", tokens * k + t * k + s)) / Q30 * Load("d", (t * k + s) * dm + i, align)
                 for s in range(k)]
        return functools.reduce(lambda a, b: a + b, terms)
    return value


# Groups per upload of `fill_kernel`: each copies a contiguous share of the expert, so enough reads are in flight
# over the host link at once (a link's latency times its bandwidth is tens of KB).
FILL_GROUPS = 32
FILL_READS = 4  # pieces a lane has in flight


@kernel_builder
def resolve_kernel(name: str, n_exp: int, k: int, lanes: int) -> Kernel:
    """The expert cache's bookkeeping for a one-token step, on the device (`ExpertState`'s layout in `state`):
    the token's k routed experts (route words [0, k)) are requested as `runtimes/memory.ExpertCache.request`
    does, in the same order (resident ones first, then by id), so host and device keep the same cache: a hit is
    touched; a miss takes the first empty slot, else the slot of the policy's victim among the residents not
    routed now (the header's H_LFU 0, LRU: the least recently used; 1, LFU: the fewest uses, then LRU), and is
    listed for `fill_kernel`.
    The state is staged in local memory by all lanes; one lane does the walk (a few hundred steps at most)."""
    lay = ExpertState(n_exp, k)
    e, s, r = Var("e"), Var("s"), Var("r")
    arrays = (("c_slot", lay.table), ("c_holds", lay.holds), ("c_last", lay.last), ("c_count", lay.count))
    head = lambda f: Const(lay.header + f)  # noqa: E731
    pick = Var("pick")
    old = Load("c_holds", s)
    lru = Load("c_last", old) < Var("v_last")
    lfu = (Load("c_count", old) < Var("v_count")) | (Load("c_count", old).eq(Var("v_count")) & lru)
    better = (Var("lfu").eq(0) & lru) | (Var("lfu").eq(1) & lfu)
    place = (
        Decl("slot", "i32", Const(-1)),
        For("s", Const(0), Var("n_slots"), (If((Var("slot") < 0) & (Load("c_holds", s) < 0), (Assign("slot", s),)),)),
        If(Var("slot") < 0, (
            Decl("v_count", "i32", Const(0)), Decl("v_last", "i32", Const(0)),
            For("s", Const(0), Var("n_slots"), (If(Load("c_mark", old).eq(0) & ((Var("slot") < 0) | better), (
                Assign("slot", s), Assign("v_count", Load("c_count", old)), Assign("v_last", Load("c_last", old)),
            )),)),
            Store("c_slot", Load("c_holds", Var("slot")), Const(-1)),
        )),
        Store("c_holds", Var("slot"), pick), Store("c_slot", pick, Var("slot")),
        Store("state", Const(lay.loads) + 2 * Var("n_loads"), pick),
        Store("state", Const(lay.loads + 1) + 2 * Var("n_loads"), Var("slot")),
        Assign("n_loads", Var("n_loads") + 1),
    )
    # Stage 0 takes the resident experts, stage 1 the others, each in increasing id (a selection: k is small).
    walk = For("stage", Const(0), Const(2), (
        Decl("prev", "i32", Const(-1)),
        For("j", Const(0), Const(k), (
            Decl("pick", "i32", Const(n_exp)),
            For("r", Const(0), Const(k), (
                Let("cand", Load("route", r)),
                If(Select(Load("c_slot", Var("cand")) < 0, Const(1), Const(0)).eq(Var("stage"))
                   & (Var("cand") > Var("prev")) & (Var("cand") < pick), (Assign("pick", Var("cand")),)),
            )),
            If(pick < n_exp, (
                Assign("prev", pick),
                Assign("n_req", Var("n_req") + 1),
                If(Var("stage").eq(0), (Assign("n_hit", Var("n_hit") + 1),), place),
                Assign("clock", Var("clock") + 1),
                Store("c_last", pick, Var("clock")),
                Store("c_count", pick, Load("c_count", pick) + 1),
            )),
        )),
    ))
    body = (
        LaneFor("e", Const(n_exp), (*(Store(a, e, Load("state", Const(off) + e)) for a, off in arrays),
                                    Store("c_mark", e, Const(0)))),
        LaneFor("one", Const(1), (
            For("r", Const(0), Const(k), (Store("c_mark", Load("route", r), Const(1)),)),
            Let("n_slots", Load("state", head(ExpertState.H_SLOTS))),
            Let("lfu", Load("state", head(ExpertState.H_LFU))),
            Decl("clock", "i32", Load("state", head(ExpertState.H_CLOCK))),
            Decl("n_req", "i32", Const(0)), Decl("n_hit", "i32", Const(0)), Decl("n_loads", "i32", Const(0)),
            walk,
            Store("state", head(ExpertState.H_CLOCK), Var("clock")),
            *(Store("state", head(f), Load("state", head(f)) + Var(v)) for f, v in (
                (ExpertState.H_REQUESTS, "n_req"), (ExpertState.H_HITS, "n_hit"), (ExpertState.H_UPLOADS, "n_loads"))),
            Store("state", head(ExpertState.H_LOADS), Var("n_loads")),
        )),
        LaneFor("e", Const(n_exp), tuple(Store("state", Const(off) + e, Load(a, e)) for a, off in arrays)),
    )
    local = (*(LocalArray(a, "i32", n_exp) for a, _ in arrays), LocalArray("c_mark", "i32", n_exp))
    return Kernel(name, (Buf("route", "i32"), Buf("state", "i32", out=True)), (Const(1),), body, lanes=lanes,
                  local=local, doc=f"moe resolve {n_exp}x{k}")


@kernel_builder
def fill_kernel(name: str, n_exp: int, k: int, weights: tuple[tuple[str, int], ...], lanes: int) -> Kernel:
    """Copy the experts `resolve_kernel` listed (at most k) from host memory, read in place over the host link
    (`h{j}`: weight j's experts), into their slots (`w{j}`); `weights`: per weight its buffer dtype and the
    elements of one expert. Grid (k, FILL_GROUPS): group (i, c) copies the c-th share of upload i, in FILL_READS runs of
    consecutive pieces, a lane loading one piece of each run before it stores any (the link's latency is hidden
    by reads in flight); a piece is 16 bytes where the size allows (4 words at 16-byte aligned offsets: one wide
    load on targets that merge them)."""
    lay = ExpertState(n_exp, k)
    m = Var("m")
    copies = []
    for j, (dtype, n) in enumerate(weights):
        h, w = f"h{j}", f"w{j}"
        unit = 1 if dtype == "f32" else 16 if n % 16 == 0 else 4 if n % 4 == 0 else 1  # elements (bytes) a piece
        pieces = n // unit
        run = -(-pieces // (FILL_GROUPS * FILL_READS))
        qs = [Var("g1") * (run * FILL_READS) + r * run + m for r in range(FILL_READS)]
        # Loads of a piece past the end read the last one (in bounds); only the stores are guarded.
        src = [Var("ex") * n + Call("min", q, Const(pieces - 1)) * unit for q in qs]
        dst = [Var("sl") * n + q * unit for q in qs]
        if unit == 1:
            loads = [Let(f"v{r}", Load(h, src[r])) for r in range(FILL_READS)]
            stores = [If(q < pieces, (Store(w, dst[r], Var(f"v{r}")),)) for r, q in enumerate(qs)]
        else:
            words = unit // 4
            loads = [Let(f"v{r}_{i}", Call("load_u32", Var(h), src[r] + 4 * i, Const(unit if i == 0 else 4)))
                     for r in range(FILL_READS) for i in range(words)]
            stores = [If(q < pieces, tuple(Store(w, dst[r] + 4 * i + b, (Var(f"v{r}_{i}") >> (8 * b)) & 255)
                                           for i in range(words) for b in range(4))) for r, q in enumerate(qs)]
        copies.append(LaneFor("m", Const(run), (*loads, *stores)))
    body = (If(Var("g0") < Load("state", Const(lay.header + ExpertState.H_LOADS)), (
        Let("ex", Load("state", Const(lay.loads) + 2 * Var("g0"))),
        Let("sl", Load("state", Const(lay.loads + 1) + 2 * Var("g0"))),
        *copies,
    )),)
    params = (Buf("state", "i32"), *(Buf(f"h{j}", d) for j, (d, _) in enumerate(weights)),
              *(Buf(f"w{j}", d, out=True) for j, (d, _) in enumerate(weights)))
    return Kernel(name, params, (Const(k), Const(FILL_GROUPS)), body, lanes=lanes, doc=f"moe fill {n_exp}x{k}")


@kernel_builder
def combine_kernel(name: str, dm: int, k: int, lanes: int) -> Kernel:
    """y[t] = sum_s w(t, s) * d[t*k + s] (slot weights from the route buffer). Grid (T, ceil(dm / lanes)): a
    group per `lanes` values of a token's row, so that at decode the row is many groups' work, not one's (one
    group a row with one lane: the CPU)."""
    chunk = lanes if lanes > 1 else dm
    t = Var("g0")
    r = Var("g1") * chunk + Var("r")
    value = _expert_sum(k, dm, Var("T"))
    body = (LaneFor("r", Const(chunk), (If(r < dm, (Store("y", t * dm + r, value(t, r, 1)),)),)),)
    params = (Buf("route", "i32"), Buf("d", "f32"), Buf("y", "f32", out=True), Scalar("T"))
    return Kernel(name, params, (Var("T"), Const(-(-dm // chunk))), body, lanes=lanes, doc=f"moe combine {dm}x{k}")


def combine_addend(k: int, dm: int) -> Addend:
    """What `combine_kernel` computes, as the second addend of an add + RMS norm (`elementwise.Addend`): the
    residual add after the experts sums their outputs itself, and the combine launch goes."""
    return Addend((Buf("route", "i32"), Buf("d", "f32")), _expert_sum(k, dm, Var("R")))


def _lower_router(nodes: Sequence[Node], ctx: RecipeContext, lst: tuple[str, int] | None = None) -> list[Launch]:
    """The router's launch; `lst` = (list buffer, capacity): it also writes the MoE lists (one-token plans)."""
    (node,) = nodes
    (x,) = node.inputs
    e, k, norm = int(x.type.shape[1]), int(node.attrs["k"]), bool(node.attrs["norm"])
    # One warp (subgroup reductions, no barriers between them) on GPUs.
    kern = router_kernel(f"router_{e}_{k}_{int(norm)}{'_lists' if lst else ''}", e, k, norm,
                         min(ctx.lanes, max(ctx.subgroup, 32)), lists=lst[1] if lst else None)
    bufs = (("x", ctx.buf(x)), ("route", ctx.buf(node.output))) + ((("lst", lst[0]),) if lst else ())
    return [Launch(kern, bufs, (("T", "T"),))]


def _lower_router_moe(nodes: Sequence[Node], ctx: RecipeContext,
                      shared: tuple[str, str, str] | None = None) -> list[Launch]:
    """Router then moe_ffn. In a plan of one-token steps the router writes the expert lists and the list launch
    goes (at decode it was a launch of its own a layer, for a list the router already knows). `shared`: see
    `_lower_moe`."""
    router, moe = nodes
    if ctx.t_max != 1:
        return _lower_router([router], ctx) + _lower_moe([moe], ctx, shared=shared)
    launches = _lower_moe([moe], ctx, lists_given=True, shared=shared)
    cap = _moe_cap(moe, ctx)
    return _lower_router([router], ctx, (_moe_lists(moe, ctx, cap), cap)) + launches


def _match_router_moe(nodes: Sequence[Node]) -> bool:
    router, moe = nodes
    return moe.inputs[1] is router.output


def _lower_router_moe_add_rms(nodes: Sequence[Node], ctx: RecipeContext) -> list[Launch]:
    """Router, moe_ffn, then the residual add and the next RMS norm: the norm kernel sums the experts' outputs
    (`combine_addend`) in place of the combine launch, one launch a layer fewer."""
    router, moe, add, norm = nodes
    *launches, combine = _lower_router_moe([router, moe], ctx)
    bound = dict(combine.buffers)
    residual = add.inputs[1] if add.inputs[0] is moe.output else add.inputs[0]
    k, dm = int(moe.inputs[1].type.shape[1]), int(moe.output.type.shape[-1])
    return launches + norm_launch(
        add, norm.output, ctx, float(norm.attrs["eps"]), True,
        [("x", ctx.buf(residual)), ("route", bound["route"]), ("d", bound["d"]), ("sum", ctx.buf(add.output)),
         ("w", ctx.buf(norm.inputs[1])), ("y", ctx.buf(norm.output))], (f"_moe{k}", combine_addend(k, dm)))


def _match_router_moe_add_rms(nodes: Sequence[Node]) -> bool:
    # As with the other fused chains, the intermediate (the experts' sum) is taken to have no reader but the add:
    # the model builders emit it so, and no launch writes it here.
    router, moe, add, norm = nodes
    return (_match_router_moe([router, moe]) and any(v is moe.output for v in add.inputs)
            and match_add_rms([add, norm]) and len(moe.output.type.shape) == 2)


def shared_gate_addend(k: int, dm: int, n: int, in_d: bool = False) -> Addend:
    """`combine_addend` plus a shared expert's output s gated by the sigmoid of its logit dot(h[t], wg) (qwen3.5
    MoE): the group takes its token's logit first (a row of the model's width, cheaper than a launch). `in_d`: s is
    row R * k + t of the experts' outputs d (`expert_q8_kernel`'s shared), not a buffer of its own."""
    expert_sum = _expert_sum(k, dm, Var("R"))

    def value(t: Expr, i: Expr, align: int) -> Expr:
        s = Load("d", (Var("R") * k + t) * dm + i, align) if in_d else Load("s", t * dm + i, align)
        return expert_sum(t, i, align) + s * sigmoid(Var("shg_logit"))

    bufs = (Buf("route", "i32"), Buf("d", "f32"), Buf("h", "f32"), Buf("wg", "f32"))
    bufs += () if in_d else (Buf("s", "f32"),)
    return Addend(bufs, value, (gate_logit("shg_logit", n, Var("g0")),))


def _lower_moe_shared_add_rms(nodes: Sequence[Node], ctx: RecipeContext) -> list[Launch]:
    """Router, moe_ffn, a shared expert (gate + up, down), its sigmoid gate (a one-row F32 matmul of the same input),
    the sum with the routed experts', then the residual add and the next RMS norm (qwen3.5 MoE): the norm kernel
    sums the routed experts' outputs and the gated shared expert's (`shared_gate_addend`), in place of the
    combine launch and the gate's, two launches a layer fewer. A shared expert of the routed experts' shape and
    formats runs inside their launches where `_lower_moe` can take it (three launches fewer), else as its own
    recipes lower it; a gate weight in another format lowers the chain piece by piece."""
    router, moe, g, u, act, down, gate, sm, add1, add2, norm = nodes
    if value_format(ctx, gate.inputs[1]).name != "F32":
        return [*_lower_router_moe([router, moe], ctx), *recipe_named(f"matmul_{act.op}").lower([g, u, act], ctx),
                *recipe_named("matmul").lower([down], ctx),
                *recipe_named("gate_sigmoid_mul_add").lower([gate, sm, add1], ctx),
                *recipe_named("add_rms_norm").lower([add2, norm], ctx)]
    ws = (g.inputs[1], u.inputs[1], down.inputs[1])
    routed = moe.inputs[2:]
    # The shared expert inside the experts' launches where it has their shape and formats (`_lower_moe`).
    alike = act.op == "swiglu" and all(w.type.shape == r.type.shape[1:] and value_format(ctx, w) == value_format(ctx, r)
                                       for w, r in zip(ws, routed))
    *launches, combine = _lower_router_moe([router, moe], ctx, tuple(ctx.buf(w) for w in ws) if alike else None)
    in_d = any("ws0" in dict(la.buffers) for la in launches)
    if not in_d:
        launches += [*recipe_named(f"matmul_{act.op}").lower([g, u, act], ctx),
                     *recipe_named("matmul").lower([down], ctx)]
    bound = dict(combine.buffers)
    residual = add2.inputs[1] if add2.inputs[0] is add1.output else add2.inputs[0]
    k, dm = int(moe.inputs[1].type.shape[1]), int(moe.output.type.shape[-1])
    h, wg = gate.inputs
    n = int(h.type.shape[-1])
    return launches + norm_launch(
        add2, norm.output, ctx, float(norm.attrs["eps"]), True,
        [("x", ctx.buf(residual)), ("route", bound["route"]), ("d", bound["d"]), ("h", ctx.buf(h)),
         ("wg", ctx.buf(wg)), *(() if in_d else (("s", ctx.buf(down.output)),)), ("sum", ctx.buf(add2.output)),
         ("w", ctx.buf(norm.inputs[1])), ("y", ctx.buf(norm.output))],
        (f"_moe{k}_sh{'d' if in_d else ''}gate{n}", shared_gate_addend(k, dm, n, in_d)))


def _match_moe_shared_add_rms(nodes: Sequence[Node]) -> bool:
    # The intermediates (the experts' sums, the gate's logit, the gated shared expert) are taken to have no other
    # reader, as in `_match_router_moe_add_rms`.
    router, moe, g, u, act, down, gate, sm, add1, add2, norm = nodes
    x = moe.inputs[0]
    return (_match_router_moe([router, moe]) and len(moe.output.type.shape) == 2 and g.inputs[0] is x
            and match_glu([g, u, act]) and down.inputs[0] is act.output and down.inputs[1].weight is not None
            and gate.inputs[0] is x and match_gate_sigmoid_mul_add([gate, sm, add1]) and sm.inputs[0] is down.output
            and {id(v) for v in add1.inputs} == {id(moe.output), id(sm.output)}
            and any(v is add1.output for v in add2.inputs) and match_add_rms([add2, norm]))


def _moe_cap(node: Node, ctx: RecipeContext) -> int:
    """Entries an expert's list holds: every (token, slot) of the largest step."""
    return ctx.max_rows(node.inputs[0]) * int(node.inputs[1].type.shape[1])


def _moe_lists(node: Node, ctx: RecipeContext, cap: int) -> str:
    """The plan buffer of a moe_ffn's expert lists (`group_kernel`'s layout)."""
    n_exp = int(node.inputs[2].type.shape[0])
    return ctx.scratch("moe_list", "i32", list_words(n_exp, cap))


def _lower_moe(nodes: Sequence[Node], ctx: RecipeContext, lists_given: bool = False,
               shared: tuple[str, str, str] | None = None) -> list[Launch]:
    """moe_ffn's launches (the list launch first, unless `lists_given`: the router writes them). `shared`: the
    weight buffers (gate, up, down) of a shared expert of the experts' shape and formats, on the same input: where
    the int8 expert matvecs take every step and the experts are resident, the expert launches compute it too
    (`expert_q8_kernel`'s shared), its output after the routed entries' in the down launch's output (rows T * k
    + t); elsewhere `shared` is left alone (the caller sees no binding of ws0)."""
    (node,) = nodes
    x, route, g, u, d = node.inputs
    n_exp, ff, dm = (int(s) for s in g.type.shape)
    k = int(route.type.shape[1])
    fg, fu, fd = (ctx.weight_formats[w.weight] for w in (g, u, d))
    tb = token_binding(x)
    t_max = ctx.max_rows(x)
    cap = _moe_cap(node, ctx)
    inst = f"moe_{fg.name}_{fu.name}_{fd.name}_{n_exp}_{dm}_{ff}_{k}_{cap}".lower()
    kn = ctx.knobs_for(MOE_SPACE, inst)
    policy = ctx.target()
    rows = int(kn["rows"])
    split = policy.knob("moe_ffn", "split", kn["split"])
    contract = bool(int(policy.knob("moe_ffn", "contract", kn["contract"])))
    lst = _moe_lists(node, ctx, cap)
    rows_out = cap + t_max if shared else cap  # the shared expert's rows after the routed entries'
    hb = ctx.scratch("moe_h", "f32", rows_out * ff)
    db = ctx.scratch("moe_d", "f32", rows_out * dm)
    tag = f"{n_exp}_{dm}_{ff}_{k}_{cap}"
    stream = ctx.stream_experts
    slot: tuple = ()
    resolve: list[Launch] = []
    if stream:
        # The expert launches read the weights through the layer's slot table; the executor may run them in several
        # passes over subsets of the routed experts (a cache smaller than a step's experts), so nothing they read
        # may be overwritten by them: h gets its own quantization buffers below.
        slot = (("slot", f"{g.weight}.slots"),)
        weights = (g.weight, u.weight, d.weight)
        host: tuple[str, ...] = ()
        if t_max == 1:
            # One-token steps: the device makes the routed experts resident itself, reading misses from host
            # memory in place, so the step needs no stop on the host (where the runtime can map host memory).
            per_expert = tuple((weight_dtype(f), int(w.type.shape[1]) * elements_per_row_bytes(f, int(w.type.shape[2])))
                               for f, w in zip((fg, fu, fd), (g, u, d)))
            kres = resolve_kernel(f"moe_resolve_{n_exp}_{k}", n_exp, k, ctx.lanes)
            kfill = fill_kernel(f"moe_fill_{tag}", n_exp, k, per_expert, ctx.lanes)
            host = tuple(f"{w}.host" for w in weights)
            resolve = [Launch(kres, (("route", ctx.buf(route)), ("state", slot[0][1]))),
                       Launch(kfill, (("state", slot[0][1]), *((f"h{j}", h) for j, h in enumerate(host)),
                                      *((f"w{j}", w) for j, w in enumerate(weights))))]
        ctx.expert_streams.append(ExpertStream(
            weights=weights, slots=slot[0][1], route=ctx.buf(route), lists=lst, x=ctx.buf(x), n_expert=n_exp, k=k,
            cap=cap, tokens=tb, resolve=tuple(la.kernel.name for la in resolve), host=host))
    kg = group_kernel(f"moe_group_{tag}", n_exp, k, cap, ctx.lanes)
    tag += "_slots" if stream else ""  # the expert kernels' names (the group and combine kernels are the same)
    kc = combine_kernel(f"moe_combine_{dm}_{k}", dm, k, ctx.lanes)
    group = [] if lists_given else [Launch(kg, (("route", ctx.buf(route)), ("lst", lst)), (("T", tb),))]
    group += resolve
    combine = Launch(kc, (("route", ctx.buf(route)), ("d", db), ("y", ctx.buf(node.output))), (("T", tb),))
    gateup = lambda v: silu(v[0]) * v[1]  # noqa: E731
    xq = policy.knob("moe_ffn", "xq", kn["xq"])
    q8_path = (xq == "kernel" and ctx.lanes > 1 and all(use_int8(f, True) for f in (fg, fu, fd))
               and dm % QB == 0 and ff % QB == 0)
    # The tile products of steps of more than TILES_ABOVE tokens, where the int8 expert matvecs take the shorter
    # ones, read the knobs of a kernel family of their own (as `linear`'s do), tuned at the steps they serve.
    tk = (ctx.knobs_for(MOE_SPACE, inst, "long") if q8_path and policy.matrix_units and t_max > TILES_ABOVE
          else kn)

    def tiles(fmts: list[QuantFormat], n: int, kd: int) -> bool:
        """Whether the expert matmuls over `fmts` (n x kd) take tile products: as `linear` decides for its matmuls,
        the int8 ones with activations quantized by a kernel."""
        return (tile_products_apply(policy, "moe_ffn", t_max, tk, fmts, n, kd)
                and (f16_path(fmts) or policy.knob("moe_ffn", "xq", tk["xq"]) == "kernel"))

    tiled: list[Launch] = []
    short = None  # the steps the expert matvecs below run for (all, unless tile products take the long ones)
    if tiles([fg, fu], ff, dm) and tiles([fd], dm, ff) and (t_max > TILES_ABOVE or not q8_path):
        # Prompt chunks on matrix units: each listed expert's tokens through the prefill matmul's tile products,
        # in steps of more than TILES_ABOVE tokens where the int8 expert matvecs take the shorter ones (as
        # `linear` does; F16 experts: in every step of several tokens).
        gate = (TILES_ABOVE, True) if q8_path else None

        def tile_launch(name: str, fmts: list[QuantFormat], n: int, kd: int, per_token: bool, act: str,
                        quant: tuple, ws: tuple, out: str, epilogue=None) -> list[Launch]:
            u8f16 = u8f16_products(policy, tk, fmts)  # activations read as f32 and rounded to f16 in the kernel
            kern = tile_mma_kernel(name + gate_suffix(gate) + "_mma", fmts, n, kd, rows=int(tk["mma_rows"]),
                                   tokens=tile_tokens(policy, "moe_ffn", tk),
                                   chunk=mma_chunk(policy, "moe_ffn", tk, fmts, kd),
                                   lanes=int(tk["mma_lanes"]), epilogue=epilogue,
                                   gather=expert_gather(n_exp, n, k, cap, per_token, stream),
                                   gate=gate, u8f16=u8f16, **staging_flags(tk))
            wbind = tuple((f"w{j}", w) for j, w in enumerate(ws))
            if f16_path(fmts) or u8f16:
                return [Launch(kern, (("x", act), ("lst", lst), *slot, *wbind, ("y", out)), (("T", tb),))]
            ql = Launch(quantize_x_kernel(f"quantize_x_{kd}" + (f"_{k}" if not per_token else "") + gate_suffix(gate),
                                          kd, rows_per_t=1 if per_token else k, gate=gate),
                        (("x", act), *quant), (("T", tb),))
            return [ql, Launch(kern, (*quant, ("lst", lst), *slot, *wbind, ("y", out)), (("T", tb),))]

        qx = (("xq", ctx.scratch("xq", "u32", t_max * dm // 4)), ("xd", ctx.scratch("xd", "f32", t_max * dm // QB)))
        qh = (("xq", ctx.scratch("xq_h", "u32", cap * ff // 4)), ("xd", ctx.scratch("xd_h", "f32", cap * ff // QB)))
        tiled = [
            *tile_launch(f"moe_gateup_{fg.name}_{fu.name}_{tag}".lower(), [fg, fu], ff, dm, True, ctx.buf(x), qx,
                         (ctx.buf(g), ctx.buf(u)), hb, gateup),
            *tile_launch(f"moe_down_{fd.name}_{tag}".lower(), [fd], dm, ff, False, hb, qh, (ctx.buf(d),), db),
        ]
        if gate is None:
            return [*group, *tiled, combine]
        short = (TILES_ABOVE, False)
        ctx.timed_at(MOE_SPACE, inst, batch_rows(1, TILES_ABOVE))  # the expert matvecs: the shorter steps only
    if q8_path:
        # GPU path: x and then h quantized to int8 once (as `linear` does), each expert row swept by all lanes.
        fuse = shared is not None and short is None and not stream and bool(int(kn["shared"]))
        sh = "_sh" if fuse else ""
        sub = kn["sub"]
        runs = runs_for_target(kn["runs"], ctx.wide_loads)
        # h in buffers of its own: x's int8 codes (which the norm before may have written) stay valid for a
        # shared expert's matmuls after the experts, whose quantize launch is then dropped as a repeat.
        qbufs = (("xq", ctx.scratch("xq", "u32", t_max * dm // 4)), ("xd", ctx.scratch("xd", "f32", t_max * dm // QB)))
        hq = (("xq", ctx.scratch("xq_h", "u32", rows_out * ff // 4)),
              ("xd", ctx.scratch("xd_h", "f32", rows_out * ff // QB)))
        spread = kn["spread"]

        def spread_of(fmts, kd):
            return spread_rows(fmts, kd, ctx.subgroup, sub, runs) if spread == "auto" else int(spread)

        kgu = expert_q8_kernel(f"moe_gateup_{fg.name}_{fu.name}_{tag}{gate_suffix(short)}{sh}_q8".lower(),
                               [fg, fu], n_exp, ff, dm, k, cap, gate=short, per_token=True, sub=sub, runs=runs,
                               spread=spread_of([fg, fu], dm),
                               lanes=split_lanes([fg, fu], dm, ctx.subgroup, sub, runs),
                               epilogue=gateup, slots=stream, shared=fuse)
        kd = expert_q8_kernel(f"moe_down_{fd.name}_{tag}{gate_suffix(short)}{sh}_q8".lower(), [fd], n_exp, dm, ff, k,
                              cap, gate=short, per_token=False,
                              sub=sub, runs=runs, spread=spread_of([fd], ff),
                              lanes=split_lanes([fd], ff, ctx.subgroup, sub, runs), slots=stream, shared=fuse)
        wsgu = (("ws0", shared[0]), ("ws1", shared[1])) if fuse else ()
        wsd = (("ws0", shared[2]),) if fuse else ()
        return [
            *group,
            *tiled,
            Launch(quantize_x_kernel(f"quantize_x_{dm}{gate_suffix(short)}", dm, gate=short),
                   (("x", ctx.buf(x)), *qbufs), (("T", tb),)),
            Launch(kgu, (*qbufs, ("lst", lst), *slot, ("w0", ctx.buf(g)), ("w1", ctx.buf(u)), *wsgu, ("out", hb)),
                   (("T", tb),)),
            Launch(quantize_x_kernel(f"quantize_x_{ff}_{k + fuse}{gate_suffix(short)}", ff, rows_per_t=k + fuse,
                                     gate=short), (("x", hb), *hq), (("T", tb),)),
            Launch(kd, (*hq, ("lst", lst), *slot, ("w0", ctx.buf(d)), *wsd, ("out", db)), (("T", tb),)),
            combine,
        ]
    kgu = expert_kernel(f"moe_gateup_{fg.name}_{fu.name}_{tag}".lower(), [fg, fu], n_exp, ff, dm, k, cap, act="x",
                        per_token=True, rows=rows, split=split, lanes=ctx.lanes, epilogue=gateup, slots=stream,
                        host_arith=policy.host_arith, contract=contract)
    kd = expert_kernel(f"moe_down_{fd.name}_{tag}".lower(), [fd], n_exp, dm, ff, k, cap, act="h", per_token=False,
                       rows=rows, split=split, lanes=ctx.lanes, slots=stream, host_arith=policy.host_arith,
                       contract=contract)
    return [
        *group,
        Launch(kgu, (("x", ctx.buf(x)), ("lst", lst), *slot, ("w0", ctx.buf(g)), ("w1", ctx.buf(u)), ("out", hb)),
               (("T", tb),)),
        Launch(kd, (("h", hb), ("lst", lst), *slot, ("w0", ctx.buf(d)), ("out", db)), (("T", tb),)),
        combine,
    ]


register(Recipe("router", ("router",), _lower_router, None))
register(Recipe("router_moe", ("router", "moe_ffn"), _lower_router_moe, _match_router_moe))
register(Recipe("moe_ffn", ("moe_ffn",), _lower_moe, None, MOE_SPACE))
register(Recipe("router_moe_add_rms_norm", ("router", "moe_ffn", "add", "rms_norm"), _lower_router_moe_add_rms,
                _match_router_moe_add_rms))
register(Recipe("router_moe_shared_add_rms_norm", ("router", "moe_ffn", "matmul", "matmul", "swiglu", "matmul",
                                                   "matmul", "sigmoid_mul", "add", "add", "rms_norm"),
                _lower_moe_shared_add_rms, _match_moe_shared_add_rms))

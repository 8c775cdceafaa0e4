"""Graph passes: choose a recipe for each op (fusing chains a recipe covers), plan buffers, emit the plan.

1. Matching: walk the nodes in order; at each node try the recipes whose pattern is longest first; a recipe
   covering several consecutive nodes (norm + add, gate + up + activation) is a fusion. Reshapes cost nothing:
   their output aliases their input's buffer.
2. Buffer planning: every value gets a buffer sized for `t_max` tokens; a buffer whose last reader has run is
   reused by a later value of the same dtype that fits (never by an output of the match that reads it).
3. Lowering: each match's recipe turns its nodes into `Launch`es bound to plan buffer names.
4. Repeated launches: a launch identical to an earlier one (kernel, bindings, scalars), or to one an earlier launch
   `provides`, whose inputs and outputs nothing has written since is dropped, e.g. the activation quantization
   a norm already wrote (`Launch.provides`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from polystrata.codegen.policy import Policy, device_policy, shape_policy
from polystrata.codegen.recipes import RECIPES, Recipe, RecipeContext, Site, load_all
from polystrata.codegen.recipes.deltanet import state_buffer
from polystrata.compiler.plan import BufferSpec, Plan
from polystrata.errors import UnsupportedError
from polystrata.ir.formats import QuantFormat, row_bytes
from polystrata.ir.graph import RECURRENT_OPS, Graph, Node, Value
from polystrata.ir.kernel import Buf, Launch, buffers_read
from polystrata.ir.layout import padded, sliced

# The layouts of a wide-load target (`storage_format`'s default).
WIDE_LOADS = device_policy(128, 32, wide_loads=True)


@dataclass
class Match:
    """Consecutive nodes one recipe lowers together."""

    recipe: Recipe
    nodes: list[Node]


def match_recipes(graph: Graph) -> list[Match | Node]:
    """Recipe matches in order; reshape nodes stay as bare nodes (aliases, no kernel)."""
    load_all()
    by_len = sorted(RECIPES, key=lambda r: -len(r.pattern))
    out: list[Match | Node] = []
    nodes, i = graph.nodes, 0
    while i < len(nodes):
        if nodes[i].op == "reshape":
            out.append(nodes[i])
            i += 1
            continue
        for r in by_len:
            chunk = nodes[i : i + len(r.pattern)]
            if tuple(n.op for n in chunk) == r.pattern and (r.match is None or r.match(chunk)):
                out.append(Match(r, list(chunk)))
                i += len(chunk)
                break
        else:
            raise UnsupportedError(f"no kernel recipe for op '{nodes[i].op}' (node %{nodes[i].output.name})")
    return out


def value_storage(v: Value, t_max: int) -> tuple[str, int]:
    """(IR dtype, element count) of a value's buffer at `t_max` tokens."""
    dims = [t_max if d == "T" else int(d) for d in v.type.shape]
    if v.type.dtype == "route":
        # Expert ids and weights per (token, slot): see the router recipe for the layout.
        return "i32", 2 * math.prod(dims)
    return "f32", math.prod(dims)


def storage_format(fmt: QuantFormat, cols: int, policy: Policy = WIDE_LOADS) -> QuantFormat:
    """The layout a target keeps a weight of format `fmt` with rows of `cols` elements in, as its policy says
    (`Policy.padded_formats`, `Policy.sliced_formats`): `fmt` itself, or a padded or sliced form."""
    if fmt.name in policy.padded_formats:
        return padded(fmt, 16)
    if fmt.name in policy.sliced_formats and cols // fmt.block_size > 1:
        return sliced(fmt, cols)
    return fmt


def build_plan(
    graph: Graph,
    weight_formats: dict[str, QuantFormat],
    kv_format: QuantFormat,
    n_ctx: int,
    t_max: int,
    lanes: int | None = None,
    subgroup: int | None = None,
    knobs: dict | None = None,
    wide_loads: bool = False,
    stream_experts: bool = False,
    policy: Policy | None = None,
) -> Plan:
    """Compile `graph` into a plan for a target of policy `policy` (`codegen/policy.py`; None: the policy of a
    bare shape, `lanes` work-items per group, `subgroup`, `wide_loads`: see `shape_policy`). Weights are kept in
    the layouts the policy asks for (`storage_format`). `knobs`: overrides by knob space or kernel instance
    (`RecipeContext.knobs`). `stream_experts`: MoE experts read through slot tables
    (`codegen.recipes.ExpertStream`), for a device cache of expert slots."""
    if policy is None:
        policy = shape_policy(lanes, subgroup, wide_loads)
    if policy.padded_formats or policy.sliced_formats:
        cols = {name: int(v.type.shape[-1]) for name, v in graph.weights.items()}
        weight_formats = {name: storage_format(f, cols[name], policy) if name in cols else f
                          for name, f in weight_formats.items()}
    items = match_recipes(graph)
    # Aliases: a reshape's output lives in its input's buffer.
    root: dict[int, Value] = {}

    def rootof(v: Value) -> Value:
        return root.get(id(v), v)

    for it in items:
        for n in [it] if isinstance(it, Node) else it.nodes:
            if n.op == "reshape":  # bare, or inside a match whose recipe reads through it
                root[id(n.output)] = rootof(n.inputs[0])
    # Last match index reading each root value; graph outputs live to the end.
    last: dict[int, int] = {}
    for idx, it in enumerate(items):
        for n in [it] if isinstance(it, Node) else it.nodes:
            for v in n.inputs:
                if v.weight is None:
                    last[id(rootof(v))] = idx
    for v in graph.outputs:
        last[id(rootof(v))] = len(items)

    buffers: dict[str, BufferSpec] = {}
    names: dict[int, str] = {}
    free: list[str] = []
    t_in = graph.inputs
    for v, name in zip(t_in, ("tokens", "positions")):
        names[id(v)] = name
        buffers[name] = BufferSpec(name, "i32", t_max, "input")
    for tensor, v in graph.weights.items():
        fmt = weight_formats[tensor]
        n = math.prod(int(d) for d in v.type.shape)
        buffers[tensor] = (
            BufferSpec(tensor, "f32", n, "weight")
            if fmt.name == "F32"
            else BufferSpec(tensor, "u8", n // fmt.block_size * fmt.block_bytes, "weight", fmt)
        )
    for n in graph.nodes:
        if n.op == "attention":
            _, hkv, d = n.inputs[1].type.shape
            dv = n.inputs[2].type.shape[2]
            layer = n.attrs["layer"]
            for kind, width in (("k", d), ("v", dv)):
                if width % kv_format.block_size:
                    raise UnsupportedError(
                        f"KV cache type {kv_format.name} stores blocks of {kv_format.block_size} values, but this "
                        f"model's heads have {width}; use --kv-type f16 or q8_0"
                    )
                name = f"kv.{layer}.{kind}"
                buffers[name] = BufferSpec(name, "u8", n_ctx * hkv * row_bytes(kv_format, width), "kv")
            # Per token, the cache row where its sequence begins (0 but in batched decoding: polystrata/batch.py).
            buffers["starts"] = BufferSpec("starts", "i32", t_max, "input")
        elif n.op in RECURRENT_OPS:
            name, count = state_buffer(n)
            buffers[name] = BufferSpec(name, "f32", count, "state")

    def assign(v: Value) -> None:
        dtype, count = value_storage(v, t_max)
        fits = [b for b in free if buffers[b].dtype == dtype and buffers[b].count >= count]
        if fits:
            best = min(fits, key=lambda b: buffers[b].count)
            free.remove(best)
            names[id(v)] = best
        else:
            name = f"act.{len([b for b in buffers.values() if b.kind == 'activation'])}"
            buffers[name] = BufferSpec(name, dtype, count, "activation")
            names[id(v)] = name

    ctx = RecipeContext(
        lanes=policy.lanes, subgroup=policy.subgroup, kv_format=kv_format, n_ctx=n_ctx, buffer_names=names,
        weight_formats=weight_formats, knobs={**policy.tuned, **(knobs or {})}, t_max=t_max,
        wide_loads=policy.wide_loads,
        stream_experts=stream_experts, policy=policy,
    )
    launches = []
    recipes_used = []
    groups: list[int] = []  # per launch: the index of the match (in `recipes_used`) that made it
    group_sites: list[tuple[Site, ...]] = []  # per match: the kernel instances whose knobs it read
    for idx, it in enumerate(items):
        if isinstance(it, Node):
            names[id(it.output)] = names[id(rootof(it.inputs[0]))]
            continue
        for n in it.nodes:
            if n.op == "reshape":
                names[id(n.output)] = names[id(rootof(n.inputs[0]))]
            else:
                assign(n.output)
        ctx.sites = []
        made = it.recipe.lower(it.nodes, ctx)
        launches.extend(made)
        groups.extend([len(recipes_used)] * len(made))
        group_sites.append(tuple(ctx.sites))
        recipes_used.append((it.recipe.name, tuple(n.output.name for n in it.nodes)))
        # Release buffers whose last reader was this match (and outputs nobody reads).
        for n in it.nodes:
            for v in [*n.inputs, n.output]:
                r = rootof(v)
                if v.weight is None and id(r) in names and last.get(id(r), idx) <= idx:
                    b = names[id(r)]
                    if buffers[b].kind == "activation" and b not in free and not _live_elsewhere(b, names, last, idx):
                        free.append(b)
    for name, (dtype, count) in ctx.scratch_buffers.items():
        buffers[name] = BufferSpec(name, dtype, count, "activation")
    for st in ctx.expert_streams:
        buffers[st.slots] = BufferSpec(st.slots, "i32", st.state.size, "slots")
        for w, h in zip(st.weights, st.host):  # the experts in host memory (the streamer's, never allocated)
            buffers[h] = BufferSpec(h, buffers[w].dtype, buffers[w].count, "host")
    out = graph.outputs[0]
    kept = kept_launches(launches)
    return Plan(
        launches=[launches[i] for i in kept],
        groups=[groups[i] for i in kept],
        group_sites=group_sites,
        matches=[it for it in items if isinstance(it, Match)],
        context=ctx,
        buffers=buffers,
        output=names[id(rootof(out))],
        output_shape=tuple(out.type.shape),
        t_max=t_max,
        last_rows=graph.last_rows(),
        recipes=recipes_used,
        expert_streams=list(ctx.expert_streams),
    )


def _live_elsewhere(buf: str, names: dict[int, str], last: dict[int, int], idx: int) -> bool:
    """Whether another value sharing `buf` is still read after match `idx`."""
    return any(b == buf and last.get(vid, -1) > idx for vid, b in names.items())


def drop_repeated_launches(launches: list[Launch]) -> list[Launch]:
    """`launches` without those that would recompute what is already in their output buffers (`kept_launches`)."""
    return [launches[i] for i in kept_launches(launches)]


def kept_launches(launches: list[Launch]) -> list[int]:
    """Indices of the launches to keep: all but those equal to an earlier one, or to one an earlier launch
    `provides`, with no launch in between writing a buffer it reads or writes. Launches that read a buffer they
    write are never dropped (running them again is not a no-op)."""
    out: list[int] = []
    done: dict[Launch, tuple[set[str], set[str]]] = {}  # launch -> (buffers read, written), still valid
    for i, la in enumerate(launches):
        if la in done:
            continue
        reads, writes = launch_effects(la)
        for old, (r, w) in list(done.items()):
            if writes & (r | w):
                del done[old]
        for p in (la, *la.provides):
            pr, pw = launch_effects(p)
            if not pw & pr:
                done[p] = (pr, pw)
        out.append(i)
    return out


def launch_effects(la: Launch) -> tuple[set[str], set[str]]:
    """(plan buffers a launch reads, plan buffers it writes)."""
    params = {p.name: p for p in la.kernel.params}
    read_params = buffers_read(la.kernel)
    writes = {b for name, b in la.buffers if isinstance(params[name], Buf) and params[name].out}
    reads = {b for name, b in la.buffers if name in read_params}
    return reads, writes

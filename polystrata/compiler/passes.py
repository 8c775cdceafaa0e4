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

from polystrata.codegen.recipes import RECIPES, Recipe, RecipeContext, load_all
from polystrata.codegen.recipes.deltanet import state_buffer
from polystrata.compiler.plan import BufferSpec, Plan
from polystrata.errors import UnsupportedError
from polystrata.ir.formats import QuantFormat, row_bytes
from polystrata.ir.graph import RECURRENT_OPS, Graph, Node, Value
from polystrata.ir.kernel import Buf, Launch, buffers_read
from polystrata.ir.layout import padded, sliced


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


# Formats whose blocks a target with wide loads reads padded to 16 bytes (`ir.layout.padded`): Q6_K's 210-byte
# blocks are only 2-byte aligned, so each of their loads was a 2-byte one. Costs 14 bytes a block (6.7 %).
PADDED_ON_WIDE_LOADS = ("Q6_K",)
# Formats whose rows a target with wide loads keeps `sliced` (`ir.layout.sliced`): the matvecs' lanes, two a
# block, each load 16 bytes of their block, so in the GGUF layout a warp's load touched 16 cache lines; sliced,
# 2 lines of 256 bytes. Same bytes, moved at upload. H200, 4096 x 14336 matvec kernel: Q4_K 15.5 -> 12.2 us,
# Q5_K 17.6 -> 14.7 us. (Q6_K's matvec reads interleaved words, whose slices' addresses would be computed at run
# time; not tried.)
SLICED_ON_WIDE_LOADS = ("Q4_K", "Q5_K")


def storage_format(fmt: QuantFormat, cols: int) -> QuantFormat:
    """The layout a wide-load target keeps a weight of format `fmt` with rows of `cols` elements in: `fmt` itself,
    or a padded or sliced form."""
    if fmt.name in PADDED_ON_WIDE_LOADS:
        return padded(fmt, 16)
    if fmt.name in SLICED_ON_WIDE_LOADS and cols // fmt.block_size > 1:
        return sliced(fmt, cols)
    return fmt


def build_plan(
    graph: Graph,
    weight_formats: dict[str, QuantFormat],
    kv_format: QuantFormat,
    n_ctx: int,
    t_max: int,
    lanes: int,
    subgroup: int,
    knobs: dict | None = None,
    wide_loads: bool = False,
    stream_experts: bool = False,
    matrix_units: bool = False,
) -> Plan:
    """Compile `graph` into a plan for a target with `lanes` work-items per group (`wide_loads`: see
    `Runtime.wide_loads`; such a target also reads `PADDED_ON_WIDE_LOADS` formats padded and
    `SLICED_ON_WIDE_LOADS` formats sliced). `stream_experts`: MoE experts read through slot tables
    (`codegen.recipes.ExpertStream`), for a device cache of expert slots."""
    if wide_loads:
        cols = {name: int(v.type.shape[-1]) for name, v in graph.weights.items()}
        weight_formats = {name: storage_format(f, cols[name]) if name in cols else f
                          for name, f in weight_formats.items()}
    items = match_recipes(graph)
    # Aliases: a reshape's output lives in its input's buffer.
    root: dict[int, Value] = {}

    def rootof(v: Value) -> Value:
        return root.get(id(v), v)

    for it in items:
        if isinstance(it, Node):
            root[id(it.output)] = rootof(it.inputs[0])
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
        lanes=lanes, subgroup=subgroup, kv_format=kv_format, n_ctx=n_ctx, buffer_names=names,
        weight_formats=weight_formats, knobs=knobs or {}, t_max=t_max, wide_loads=wide_loads,
        stream_experts=stream_experts, matrix_units=matrix_units,
    )
    launches = []
    recipes_used = []
    for idx, it in enumerate(items):
        if isinstance(it, Node):
            names[id(it.output)] = names[id(rootof(it.inputs[0]))]
            continue
        for n in it.nodes:
            assign(n.output)
        launches.extend(it.recipe.lower(it.nodes, ctx))
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
        buffers[st.slots] = BufferSpec(st.slots, "i32", st.n_expert, "slots")
    out = graph.outputs[0]
    return Plan(
        launches=drop_repeated_launches(launches),
        buffers=buffers,
        output=names[id(rootof(out))],
        output_shape=tuple(out.type.shape),
        t_max=t_max,
        recipes=recipes_used,
        expert_streams=list(ctx.expert_streams),
    )


def _live_elsewhere(buf: str, names: dict[int, str], last: dict[int, int], idx: int) -> bool:
    """Whether another value sharing `buf` is still read after match `idx`."""
    return any(b == buf and last.get(vid, -1) > idx for vid, b in names.items())


def drop_repeated_launches(launches: list[Launch]) -> list[Launch]:
    """`launches` without those that would recompute what is already in their output buffers: a launch equal to
    an earlier one, or to one an earlier launch `provides`, with no launch in between writing a buffer it reads
    or writes. Launches that read a buffer they write are never dropped (running them again is not a no-op)."""
    out: list[Launch] = []
    done: dict[Launch, tuple[set[str], set[str]]] = {}  # launch -> (buffers read, written), still valid
    for la in launches:
        if la in done:
            continue
        reads, writes = _effects(la)
        for old, (r, w) in list(done.items()):
            if writes & (r | w):
                del done[old]
        for p in (la, *la.provides):
            pr, pw = _effects(p)
            if not pw & pr:
                done[p] = (pr, pw)
        out.append(la)
    return out


def _effects(la: Launch) -> tuple[set[str], set[str]]:
    """(plan buffers a launch reads, plan buffers it writes)."""
    params = {p.name: p for p in la.kernel.params}
    read_params = buffers_read(la.kernel)
    writes = {b for name, b in la.buffers if isinstance(params[name], Buf) and params[name].out}
    reads = {b for name, b in la.buffers if name in read_params}
    return reads, writes

"""Weight-reading recipes: `matmul` (any weight format), fused gate+up+activation, `embed`.

Schedule (one kernel serves every T, since T is a run-time symbol): grid (ceil(N / rows), ceil(T / tokens)).
Each group first quantizes its token tile of x to int8 in local memory (int8 path, see `_matvec`), then for
each of its `rows` weight rows and each token of the tile computes the dot product block by block. For T == 1
that is a plain matvec (grid over row tiles); for large T each group reads its weight rows once from memory
and reuses them (from cache) for the whole token tile.

GPU path (knob xq="kernel", the GPU policies' default, for formats of the int8 path): two launches. A small
kernel quantizes x once per matmul into scratch buffers (`quantize_x_kernel`: int8 codes packed 4 per u32 word,
a scale per 32 values; a norm or the attention combine before the matmul may write them instead, see
`quantize_launch`), then `matvec_q8_kernel`: `q8_rows` weight rows per group (rows shorter than a subgroup
has lanes: the lanes spread over them, knob spread), swept by all its lanes
(`_matvec.split_dots`: `sub` lanes per block, neighbouring lanes on neighbouring words, or on targets with
wide loads each lane a run of 4 consecutive words, loaded 16 bytes at a time; weights and rows walked alike in
one Reduce, loading each activation word once), each lane accumulating `dot4_i8(level word, code word)` per 4
elements (level words from aligned 4-byte loads by `_matvec`'s wide path) and scaling once per sub-block; the
lanes' sums meet in a group Reduce. Matmuls of one input (q, k, v) are one `stacked_matvec_q8_kernel`. Knobs
sub, runs (`_matvec.use_runs`) and lanes (group size; "auto" covers the row's units, 32 to 128). xq="inline"
keeps the one-kernel schedule below (the CPU's, and what `matmul_kernel` builds).

Prompt chunks on the CPU (one lane, plans of more than one token): `tile_matmul.py`'s tile matmuls, each weight row
decoded once for a tile of tokens; where the host has VNNI (knob tile_q8, the host policy's) the int8 one, after a
quantize launch that also writes the activations' sums, else the f32 one (knob tile).

Prompt chunks on matrix units (the policy's `matrix_units`, plans of more than one token): `tile_mma.py`'s tile
products instead, for int8-path formats after the same quantize launch in steps of more than TILES_ABOVE tokens
(shorter steps keep the int8 matvecs, the row count picking at run time), for F16 weights on the f32 activations
(knobs mma_rows, mma_tokens, mma_chunk, mma_lanes, mma_min, mma_words); matmuls of one input then launch one by one.

Knobs (`MATMUL_SPACE`; "auto" of split, rows, xq, int8, vert and contract is what the target's policy says,
`codegen/policy.py`): rows (rows per group; the policy's: 4 on the CPU, 1 on GPUs; `q8_rows` for the int8
matvecs), tokens (token tile), int8 (int8-activation path where the format allows it; off on the CPU, where the
f32 path below vectorizes better), split ("rows": lanes take rows, each a whole dot product -- the CPU's;
"blocks": for each row a Reduce over the row's blocks spread over the lanes -- the GPUs'), vert (split "rows", f32
path: per-element partial sums in a local array, see `_matvec`; on for the CPU), contract (multiply-adds of the
f32 path's kernels fused, `Kernel.contract`; on for the CPU, where they are bound by arithmetic), reuse (the int8
matvecs of plans of several tokens sweep a token tile's weights once for all its tokens, `matvec_q8_kernel`). With
one lane the kernels also mask block base addresses non-negative (see `_matvec.NONNEG`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from polystrata.codegen.cpu_intrinsics import chunked_byte
from polystrata.codegen.dequant import Decoder
from polystrata.codegen.format_analysis import block_stride, elements_per_row_bytes, weight_dtype, widen
from polystrata.codegen.policy import Policy
from polystrata.codegen.recipes import Knob, KnobSpace, Recipe, RecipeContext, kernel_builder, register, token_binding
from polystrata.codegen.recipes._matvec import (
    QB,
    Act,
    block_dot,
    code_word,
    fmt_for,
    group_rows,
    guarded,
    nonneg_mask,
    quantize_x,
    round_half_away,
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
from polystrata.codegen.recipes.tile_matmul import (
    gate_suffix,
    q8_tile_fits,
    step_gate,
    tile_matmul_kernel,
    tile_matmul_q8_kernel,
)
from polystrata.codegen.recipes.tile_mma import (
    TILE_MMA_KNOBS,
    f16_path,
    mma_chunk,
    split_sum_kernel,
    staging_flags,
    tile_mma_kernel,
    tile_products_apply,
    tile_tokens,
    u8f16_products,
)
from polystrata.errors import UnsupportedError
from polystrata.ir.expr import Const, Expr, Var
from polystrata.ir.formats import QuantFormat
from polystrata.ir.graph import Node
from polystrata.ir.kernel import (
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

# The step the tuner times the kernels of batched decoding at (`batch_rows`): 16 sequences.
BATCH_ROWS = 16
# Knob mma_split: steps of more than mma_split_above and at most TILES_ABOVE tokens (batched decoding, short
# prompts) on matrix units take tile products with K split into this many parts (`tile_mma_kernel`'s split, added
# up by `split_sum_kernel`), in token tiles of mma_split_tokens, instead of the int8 matvecs, which sweep the
# weights again for each token (faster at a few rows); 0: off (the matvecs). The GPUs' policy sets both.
SPLIT_KNOBS = (Knob("mma_split", "auto", (0, 4, 8)), Knob("mma_split_tokens", 16),
               Knob("mma_split_above", "auto", (1, 3, 5, 8)), Knob("mma_split_each", 1))
MATMUL_KNOBS = (Knob("rows", "auto", (1, 2, 4, 8)), Knob("tokens", 8, (1, 2, 4, 8, 16)),
                Knob("int8", "auto", (0, 1)), Knob("split", "auto", ("rows", "blocks")), Knob("vert", "auto", (0, 1)),
                Knob("xq", "auto", ("inline", "kernel")), Knob("sub", "auto", (1, 2, 4, 8)),
                Knob("runs", "auto", (0, 1)), Knob("lanes", "auto", (32, 64, 128, 256)),
                Knob("spread", "auto", (0, 1)), Knob("tile", "auto", (0, 8, 16, 32)), Knob("contract", "auto", (0, 1)),
                Knob("reuse", "auto", (0, 1)), Knob("tile_q8", "auto", (0, 32, 64, 128, 256)),
                Knob("tile_q8_rows", "auto", (2, 4, 8, 16)), *TILE_MMA_KNOBS, *SPLIT_KNOBS)


def _matmul_constraint(kn: dict) -> bool:
    """Knob sets worth trying: the f32 path's options (vert, tile) only with split "rows", int8 kernels' (sub,
    runs, lanes, spread) only with xq "kernel"."""
    if kn["split"] == "blocks" and (kn["vert"] not in ("auto", 0) or kn["tile"] not in ("auto", 0)):
        return False
    return not (kn["xq"] == "inline" and any(kn[k] != "auto" for k in ("sub", "runs", "lanes", "spread")))


# One space for every matmul recipe (plain, stacked, GLU): a space-wide knob (`bench --knob matmul.mma_min=512`)
# reaches all of a model's matmuls. The GLU had a space of its own once, and that knob then left the gate+up
# matmuls, half of a llama's weights, on the other path (docs/benchmarks.md, "the prefill regression").
# Instances stay apart: their names (and so their tuning rows) differ.
# version 2: mma_chunk "auto" (the policy's 128 on GPUs, was 64), mma_split added; version 3: mma_split_above
# added, the GPUs' mma_split 4 (was 0); version 4: mma_split_each added; version 5: the tile kernel's staging and
# dealing changed, mma_tokens "auto"; version 6: the tile products of long steps and of split K read knobs of their
# own kernel families (`_launches`), the instance's own knobs only the matvecs'. (Knobs added with a default that
# renders the kernels as before, as mma_f16, keep the version: the rows tuned before still mean the same.)
MATMUL_SPACE = KnobSpace("matmul", MATMUL_KNOBS, version=6, constraint=_matmul_constraint)
# Knob tile ("auto": TILE_TOKENS; 0: off): tokens a tile of `tile_matmul_kernel`, which one-lane plans of more than
# one token take on the f32 path (`_launches`): up to 16 sequences' tokens of a batched decode step in one tile
# (docs/benchmarks.md, "Serving").
TILE_TOKENS = 16
# Knob tile_q8 ("auto": the policy's; 0: off): tokens a tile of `tile_matmul_q8_kernel`, which one-lane plans of
# more than one token take for the formats it covers, ahead of `tile_matmul_kernel`; its rows' levels are decoded
# once for a tile. Knob tile_q8_rows ("auto": the policy's): its rows a group.
# Knobs of the two-launch GPU path only (`_launches`); the rest are `matmul_kernel`'s.
GPU_PATH_KNOBS = ("xq", "sub", "runs", "lanes", "q8_rows", "spread", "reuse",
                  *(knob.name for knob in (*TILE_MMA_KNOBS, *SPLIT_KNOBS)))


def matmul_kernel_knobs(kn: dict) -> dict:
    """The knobs of `kn` that `matmul_kernel` takes (those of the GPU path and of `tile_matmul_kernel` removed)."""
    tiles = ("tile", "tile_q8", "tile_q8_rows")
    return {name: v for name, v in kn.items() if name not in GPU_PATH_KNOBS and name not in tiles}


def _exp(x: Expr) -> Expr:
    return Call("exp", x)


def silu(g: Expr) -> Expr:
    """g * sigmoid(g)."""
    return g / (Const(1.0) + _exp(Const(0.0) - g))


def gelu_tanh(g: Expr) -> Expr:
    """GELU, tanh approximation."""
    c = 0.7978845608028654
    return Const(0.5) * g * (Const(1.0) + Call("tanh", Const(c) * (g + Const(0.044715) * g * g * g)))


ACTIVATIONS = {"swiglu": silu, "geglu": gelu_tanh}


@kernel_builder
def matmul_kernel(name: str, fmts: Sequence[QuantFormat], n: int, k: int, *, rows: int, tokens: int, int8: bool,
                  split: str, lanes: int, epilogue: Callable[[list[Expr]], Expr] | None = None,
                  vert: bool | str = "auto", host_arith: bool | None = None, contract: bool | str = False) -> Kernel:
    """y[t, r] = epilogue(dot(w_j[r], x[t]) for each weight j); weights [n, k] of formats `fmts`: the one-kernel
    schedule (activations quantized inside each group, knob xq="inline"). `host_arith`: `Policy.host_arith`
    (None, for kernels built without a target: with one lane); `contract`: `Kernel.contract` ("auto": off)."""
    if int8 == "auto":
        int8 = lanes > 1
    int8 = all(use_int8(f, int8) for f in fmts)
    if vert == "auto":
        vert = lanes == 1
    vert = bool(vert) and not int8 and split == "rows"
    if split == "blocks" and lanes > 1:
        fmts = [widen(f, float_chunk(k, lanes)) for f in fmts]
    cpu = lanes == 1 if host_arith is None else host_arith  # NONNEG masks
    rows = max(1, min(rows, n))
    wnames = [f"w{j}" for j in range(len(fmts))]
    params = [Buf("x", "f32"), *(Buf(w, weight_dtype(f)) for w, f in zip(wnames, fmts)), Buf("y", "f32", out=True),
              Scalar("T")]
    t0, nt = Var("t0"), Var("nt")
    body: list = [Let("t0", Var("g1") * tokens), Let("nt", Call("min", Const(tokens), Var("T") - t0))]
    local = []
    pb = max(fmt_for(f).block_size for f in fmts)  # partial sums per (row, weight) with vert
    if vert:
        local = [LocalArray("p", "f32", (rows if lanes > 1 else 1) * len(fmts) * pb)]
    if int8:
        local = [LocalArray("xq", "i8", tokens * k), LocalArray("xd", "f32", tokens * k // QB)]
        body += quantize_x("x", "xq", "xd", t0, nt, tokens, k)
        act = Act("x", k, "xq", "xd")
    else:
        act = Act("x", k)

    def dots(row: Expr, t_act: Expr, accs: list[str], parts: list | None = None) -> list:
        rowc = Call("min", row, Const(n - 1))  # clamp so loads stay in bounds; the store is guarded
        out = []
        for j, (w, f) in enumerate(zip(wnames, fmts)):
            nb = k // fmt_for(f).block_size
            out.append(Let(f"w{j}_rb", rowc * elements_per_row_bytes(f, k)))
            out.append(For("b", Const(0), Const(nb), tuple(block_dot(
                f, w, Var(f"w{j}_rb"), Var("b"), act, t_act, accs[j], f"w{j}_", parts[j] if parts else None,
                nonneg=nonneg_mask(n * elements_per_row_bytes(f, k)) if cpu else 0))))
        return out

    def result(accs: list[str]) -> Expr:
        vals = [Var(a) for a in accs]
        return epilogue(vals) if epilogue else vals[0]

    if split == "rows":
        accs = [f"acc{j}" for j in range(len(fmts))]
        rr, row, t = Var("rr"), Var("row"), Var("t")
        t_act = t if int8 else t0 + t
        inner = [Decl(a, "f32", Const(0.0)) for a in accs]
        parts = None
        if vert:
            parts = []
            for j, f in enumerate(fmts):
                # One lane walks the rows in turn and reuses one slot per weight: constant offsets let a compiler
                # keep the partial sums in registers. Lanes working on rows concurrently need a slot each.
                po = Const(j * pb) if lanes == 1 else Var(f"w{j}_po")
                if lanes > 1:
                    inner.append(Let(po.name, (rr * len(fmts) + j) * pb))
                inner.append(For("e", Const(0), Const(fmt_for(f).block_size), (Store("p", po + Var("e"), Const(0.0)),)))
                parts.append(("p", po))
        inner += dots(row, t_act, accs, parts)
        if vert:
            for j, f in enumerate(fmts):
                inner += sum_partials("p", parts[j][1], fmt_for(f).block_size, accs[j])
        inner.append(Store("y", (t0 + t) * n + row, result(accs)))
        body.append(LaneFor("rr", Const(rows), (
            Let("row", Var("g0") * rows + rr),
            If(row < n, (For("t", Const(0), nt, tuple(inner)),)),
        )))
    else:
        for r in range(rows):
            row = Var("g0") * rows + r
            t = Var(f"tt{r}")
            t_act = t if int8 else t0 + t
            red = []
            for j in range(len(fmts)):
                acc = f"acc{j}"
                sub_accs = [acc if i == j else f"_u{i}" for i in range(len(fmts))]
                red.append(Reduce(f"s{r}_{j}", "+", f"bb{j}", Const(k // fmt_for(fmts[j]).block_size), (
                    Decl(acc, "f32", Const(0.0)),
                    *_only(dots(row, t_act, sub_accs), j, Var(f"bb{j}")),
                ), Var(acc)))
            vals = [f"s{r}_{j}" for j in range(len(fmts))]
            body.append(For(t.name, Const(0), nt, (*red, If(row < n, (Store("y", (t0 + t) * n + row, result(vals)),)))))
    grid = (Const((n + rows - 1) // rows), (Var("T") + (tokens - 1)) // tokens)
    contract = contract not in ("auto", False, 0)
    knobs = (("rows", rows), ("tokens", tokens), ("int8", int(int8)), ("split", split), ("vert", int(vert)),
             ("contract", int(contract)))
    return Kernel(name, tuple(params), grid, tuple(body), lanes=lanes, local=tuple(local), knobs=knobs,
                  contract=contract, doc=f"matmul {'+'.join(f.name for f in fmts)} [{n}x{k}]")


def float_chunk(k: int, lanes: int) -> int:
    """Elements of a one-element format (F32/F16/BF16) that a lane takes at a time where a group's lanes share a
    row: the largest power of two up to 32 dividing k that still gives every lane a chunk. A lane walking 32
    floats while its neighbours walk the next 32 touches a cache line per lane per load; with k = 2048 and 128
    lanes each lane takes 16, in one pass over the row (qwen3-30b-a3b's F32 router)."""
    c = 32
    while c > 1 and (k % c or k // c < lanes):
        c //= 2
    return c


def _only(loops: list, j: int, b: Expr) -> list:
    """Weight j's block loop body for block `b` (the Reduce iterates the blocks itself)."""
    return [loops[2 * j], Let("b", b), *loops[2 * j + 1].body]


def _knobs(ctx: RecipeContext, space: KnobSpace, instance: str | None, family: str | None = None) -> dict:
    """The matmul knobs of kernel instance `instance` (None: of the space, recording nothing; `family`: see
    `RecipeContext.knobs_for`), "auto" resolved where the target's policy decides (split, rows, xq, int8, vert,
    contract: `codegen/policy.py`; on GPUs a group per row, as small f32 matmuls such as MoE routers need every SM
    busy)."""
    kn = ctx.knobs_for(space, instance, family)
    kn["q8_rows"] = kn["rows"]  # "auto": see `q8_rows`
    kn = with_policy_defaults(kn, ctx.target())
    kn["runs"] = runs_for_target(kn["runs"], ctx.wide_loads)
    return kn


# The matmul knobs whose "auto" is the target policy's value.
POLICY_KNOBS = ("split", "rows", "xq", "int8", "vert", "contract", "reuse", "tile_q8", "tile_q8_rows", "mma_split",
                "mma_split_above")


def with_policy_defaults(kn: dict, policy: Policy) -> dict:
    """Matmul knobs `kn` with "auto" of the `POLICY_KNOBS` replaced by the target policy's values."""
    return {name: policy.knob("matmul", name, v) if name in POLICY_KNOBS else v for name, v in kn.items()}


def _int8_kernels(ctx: RecipeContext, kn: dict, fmts: Sequence[QuantFormat], k: int) -> bool:
    """Whether matmuls over `fmts` take the two-launch GPU path (quantize kernel + `matvec_q8_kernel`): knob
    xq="kernel" (GPU default) and int8-capable formats."""
    return (kn["xq"] == "kernel" and ctx.lanes > 1 and kn["int8"] in ("auto", True, 1)
            and all(use_int8(f, True) for f in fmts) and k % QB == 0)


def _tile_products(ctx: RecipeContext, kn: dict, fmts: Sequence[QuantFormat], n: int, k: int) -> bool:
    """Whether matmuls over `fmts` take `tile_mma_kernel`: plans of steps of several tokens on a target with matrix
    units, formats and K it takes (`tile_mma_fits`): F16 weights, or the GPU path's int8 activations
    (`_int8_kernels`) in plans of steps of more than TILES_ABOVE tokens."""
    if not tile_products_apply(ctx.target(), "matmul", ctx.t_max, kn, fmts, n, k):
        return False
    # The int8 ones only in plans with steps of more than TILES_ABOVE tokens (the shorter steps keep the matvecs).
    return f16_path(fmts) or (_int8_kernels(ctx, kn, fmts, k) and ctx.t_max > TILES_ABOVE)


def _split_tiles(ctx: RecipeContext, kn: dict, fmts: Sequence[QuantFormat], n: int, k: int,
                 x_rows: int) -> tuple[int, int] | None:
    """(K parts, K chunk) of the tile products that steps of more than mma_split_above and at most TILES_ABOVE
    tokens take (knob mma_split; at most one part a K step), or None where those steps keep the int8 matvecs: off,
    no matrix units, an input of no more rows a step than mma_split_above (`x_rows`), F16 weights (which take the
    tile products in every step), a matrix `tile_products_apply` refuses, or fewer than two K steps."""
    if (int(kn["mma_split"]) < 2 or f16_path(fmts) or not _int8_kernels(ctx, kn, fmts, k)
            or x_rows <= split_above(kn)):
        return None
    kn = {**kn, "mma_tokens": kn["mma_split_tokens"]}
    if not tile_products_apply(ctx.target(), "matmul", x_rows, kn, fmts, n, k):
        return None
    chunk = mma_chunk(ctx.target(), "matmul", kn, fmts, k)
    steps = k // max(chunk, *(fmt_for(f).block_size for f in fmts))
    per = -(-steps // int(kn["mma_split"]))  # K steps a part as the kernel deals them: no part left without any
    parts = -(-steps // per)
    return (parts, chunk) if parts > 1 else None


def split_above(kn: dict) -> int:
    """Knob mma_split_above: the most rows a step keeps on the int8 matvecs where split K takes longer ones (at
    least 1: one-token steps always do), at most TILES_ABOVE."""
    return max(1, min(int(kn["mma_split_above"]), TILES_ABOVE - 1))


def quantize_launch(ctx: RecipeContext, x: str, k: int, t_bind, sums: bool = False,
                    gate: tuple[int, bool] | None = None) -> tuple[Launch, str, str]:
    """(the launch quantizing activation buffer `x` of rows of `k` into the shared int8 scratch buffers, codes
    buffer, scales buffer): what the GPU path's matmuls read. Identical launches on an unchanged `x` are dropped by
    the compiler, so a producer may compute them ahead (see `Launch.provides`). `sums`: the launch also writes each
    16 values' sum into scratch buffer xs (`quantize_x_kernel`), for `tile_matmul_q8_kernel`; `gate`: the steps it
    runs for (`tile_matmul.step_gate`)."""
    qb = ctx.scratch("xq", "u32", ctx.t_max * k // 4)
    db = ctx.scratch("xd", "f32", ctx.t_max * (k // QB))
    bound = [("xq", qb), ("xd", db)]
    if sums:
        bound.append(("xs", ctx.scratch("xs", "f32", ctx.t_max * (k // (QB // 2)))))
    kern = quantize_x_kernel(f"quantize_x{'s' if sums else ''}_{k}{gate_suffix(gate)}", k, sums=sums, gate=gate)
    return Launch(kern, (("x", x), *bound), (("T", t_bind),)), qb, db


def quantized_output(ctx: RecipeContext, y: str, k: int, t_bind) -> tuple[tuple, tuple[Launch, ...]]:
    """For a kernel that can also write its output `y` (rows of `k`) as the next matmuls' int8 activations (a norm,
    the attention combine): the xq / xd bindings to add and the quantize launch it then `provides`; ((), ()) where
    this target's matmuls do not read quantized activations."""
    if not _int8_kernels(ctx, _knobs(ctx, MATMUL_SPACE, None), (), k):
        return (), ()
    ql = quantize_launch(ctx, y, k, t_bind)[0]
    return tuple(b for b in ql.buffers if b[0] in ("xq", "xd")), (ql,)


def _gpu_lanes(kn: dict, ctx: RecipeContext, fmts: Sequence[QuantFormat], k: int) -> int:
    if kn["lanes"] == "auto":
        return split_lanes(fmts, k, ctx.subgroup, kn["sub"], kn["runs"])
    return int(kn["lanes"])


def q8_rows(kn: dict, ctx: RecipeContext, fmts: Sequence[QuantFormat], n: int, k: int) -> tuple[int, bool]:
    """(rows a group of the int8 matvec, whether its lanes spread over them) (knobs rows and spread, "auto": rows
    with fewer units than a subgroup has lanes are spread, `_matvec.spread_rows` of them a group -- two Q4_K rows
    of qwen3-30b-a3b's 2048 columns, each 16 units; else two rows for matrices of at least 4096 rows of at least
    4096 columns, each lane sweeping both, sharing its activation loads, else one -- one also where a token tile
    is swept once (`_reuse`), whose tokens share the weight loads instead: rows x tokens dot products a lane are
    its registers; docs/benchmarks.md, "Matvec schedule knobs", has the H200 figures)."""
    spread_n = spread_rows(fmts, k, ctx.subgroup, kn["sub"], kn["runs"])
    spread = spread_n > 1 if kn["spread"] == "auto" else bool(int(kn["spread"]))
    if kn["q8_rows"] != "auto":
        return int(kn["q8_rows"]), spread
    if spread:
        return max(2, spread_n), True
    if _reuse(ctx, kn):
        return 1, False
    return (2 if n >= 4096 and k >= 4096 else 1), False


def _reuse(ctx: RecipeContext, kn: dict) -> bool:
    """Whether the int8 matvecs sweep a token tile's weights once for all its tokens (knob reuse): only in plans
    of steps of several tokens (a one-token plan's tile is one token)."""
    return ctx.t_max > 1 and bool(int(kn["reuse"]))


def batch_rows(lo: int, hi: int) -> int:
    """The step the tuner times kernels serving steps of more than `lo` and at most `hi` rows at (`Site.rows`):
    BATCH_ROWS where it falls among them, else the nearest of them."""
    return max(lo + 1, min(hi, BATCH_ROWS))


def _launches(name: str, fmts: Sequence[QuantFormat], n: int, k: int, ctx: RecipeContext, kn: dict, x: str,
              ws: Sequence[str], y: str, t_bind, x_rows: int, epilogue=None) -> list[Launch]:
    """The matmul launches of instance `name` (`kn`: its knobs): on the GPU path (`_int8_kernels`) a quantize
    kernel writing x as int8 codes + scales into scratch buffers, then `matvec_q8_kernel`; else one
    `matmul_kernel`. On matrix units (`_tile_products`), plans of steps of more than TILES_ABOVE tokens take the
    tile products for those steps and keep the int8 matvecs for shorter ones (batched decoding, short prompts):
    both kernels read the same quantized activations, and the row count picks at run time
    (`tile_matmul.step_gate`). With knob mma_split, steps of more than mma_split_above to TILES_ABOVE tokens take
    tile products of split K (`_split_tiles`) and their sum, and only the shorter steps the matvecs. The tile
    products of the long steps and those of split K read the knobs of kernel families of their own ("long",
    "split": `RecipeContext.knobs_for`), so that each is tuned at steps it serves. `x_rows`: the most rows x has
    in a step (`RecipeContext.max_rows`)."""
    for f in fmts:  # the kernels walk whole blocks (F16 / F32 in blocks of 32): a remainder would be left out
        if k % fmt_for(f).block_size:
            raise UnsupportedError(f"matmul {name}: rows of {k} {f.name} values are not whole blocks of "
                                   f"{fmt_for(f).block_size}")
    wbind = tuple((f"w{j}", w) for j, w in enumerate(ws))
    policy = ctx.target()
    if f16_path(fmts) and _tile_products(ctx, kn, fmts, n, k):  # F16 weights: the f16 products for every step
        mk = tile_mma_kernel(name + "_mma", fmts, n, k, rows=kn["mma_rows"], tokens=tile_tokens(policy, "matmul", kn),
                             chunk=mma_chunk(policy, "matmul", kn, fmts, k), lanes=kn["mma_lanes"], epilogue=epilogue,
                             **staging_flags(kn))
        return [Launch(mk, (("x", x), *wbind, ("y", y)), (("T", t_bind),))]
    if _int8_kernels(ctx, kn, fmts, k):
        ql, qb, db = quantize_launch(ctx, x, k, t_bind)
        acts = (("xq", qb), ("xd", db))
        # short: the steps the matvecs run for (all, unless tile products take the long or the split the middle)
        tiled, short = [], None
        long_kn = _knobs(ctx, MATMUL_SPACE, name, "long") if policy.matrix_units and ctx.t_max > TILES_ABOVE else None
        tiles = long_kn is not None and _tile_products(ctx, long_kn, fmts, n, k)
        if tiles:
            # Steps of many tokens on matrix units: tile products (codegen/recipes/tile_mma.py), on the int8
            # activations or (u8f16 products) x itself, rounded to f16 in them.
            u8f16 = u8f16_products(policy, long_kn, fmts)
            long = (TILES_ABOVE, True)
            mk = tile_mma_kernel(f"{name}{gate_suffix(long)}_mma", fmts, n, k, rows=long_kn["mma_rows"],
                                 tokens=tile_tokens(policy, "matmul", long_kn),
                                 chunk=mma_chunk(policy, "matmul", long_kn, fmts, k), lanes=long_kn["mma_lanes"],
                                 epilogue=epilogue, gate=long, u8f16=u8f16, **staging_flags(long_kn))
            tiled, short = [Launch(mk, (*((("x", x),) if u8f16 else acts), *wbind, ("y", y)), (("T", t_bind),))], \
                (TILES_ABOVE, False)
        # Where longer steps take no tile products, the matvecs must keep them: no split then.
        split_kn, split = None, None
        if policy.matrix_units and 1 < x_rows and (tiles or x_rows <= TILES_ABOVE):
            split_kn = _knobs(ctx, MATMUL_SPACE, name, "split")
            split = _split_tiles(ctx, split_kn, fmts, n, k, x_rows)
            ctx.timed_at(MATMUL_SPACE, name, batch_rows(split_above(split_kn), min(x_rows, TILES_ABOVE)), "split")
        if split:
            tiled += _split_launches(name, fmts, n, k, ctx, split_kn, split, acts, x, wbind, y, t_bind, x_rows,
                                     epilogue)
            short = (split_above(split_kn), False)
        if short:  # the matvecs serve the steps up to short[0] rows only: the tuner times them there
            ctx.timed_at(MATMUL_SPACE, name, short[0] if split else batch_rows(1, short[0]))
        rows, spread = q8_rows(kn, ctx, fmts, n, k)
        mk = matvec_q8_kernel(f"{name}{gate_suffix(short)}_q8", fmts, n, k, tokens=kn["tokens"], sub=kn["sub"],
                              runs=kn["runs"], rows=rows, spread=spread, reuse=_reuse(ctx, kn), epilogue=epilogue,
                              lanes=_gpu_lanes(kn, ctx, fmts, k), gate=short)
        return [ql, *tiled, Launch(mk, (*acts, *wbind, ("y", y)), (("T", t_bind),))]
    tile = TILE_TOKENS if kn["tile"] == "auto" else int(kn["tile"])
    if tile and ctx.lanes == 1 and ctx.t_max > 1 and kn["int8"] in ("auto", False, 0) and kn["split"] == "rows" \
            and kn["vert"] in ("auto", True, 1):
        out = []
        f32_gate = None
        long_kn = _knobs(ctx, MATMUL_SPACE, name, "long") if ctx.t_max > TILES_ABOVE else None
        if long_kn is not None and int(long_kn["tile_q8"]) and q8_tile_fits(fmts, k):
            # ... or (hosts with VNNI) each weight row's levels decoded once for a tile of tokens, int8 activations,
            # in steps of more than TILES_ABOVE tokens; shorter ones (batched decoding, short prompts) keep the f32
            # tiles, whose rows give what one-token steps give (a sequence decodes to the same bits whichever
            # sequences share its step). The row count picks at run time.
            gate = (TILES_ABOVE, True)
            ql, _, _ = quantize_launch(ctx, x, k, t_bind, sums=True, gate=gate)
            kern = tile_matmul_q8_kernel(f"{name}_tq8{gate_suffix(gate)}", fmts, n, k,
                                         rows=int(long_kn["tile_q8_rows"]), tokens=int(long_kn["tile_q8"]),
                                         epilogue=epilogue, gate=gate)
            out = [ql, Launch(kern, (*ql.buffers[1:], *wbind, ("y", y)), (("T", t_bind),))]
            f32_gate = (TILES_ABOVE, False)
            ctx.timed_at(MATMUL_SPACE, name, batch_rows(1, TILES_ABOVE))
        # Steps of several tokens on the CPU: each weight block's scales decoded once for a tile of tokens.
        kern = tile_matmul_kernel(f"{name}_tile{gate_suffix(f32_gate)}", fmts, n, k, rows=kn["rows"], tokens=tile,
                                  epilogue=epilogue, contract=bool(int(kn["contract"])), gate=f32_gate)
        return [*out, Launch(kern, (("x", x), *wbind, ("y", y)), (("T", t_bind),))]
    kern = matmul_kernel(name, fmts, n, k, lanes=ctx.lanes, epilogue=epilogue, host_arith=policy.host_arith,
                         **matmul_kernel_knobs(kn))
    return [Launch(kern, (("x", x), *wbind, ("y", y)), (("T", t_bind),))]


def _split_launches(name: str, fmts: Sequence[QuantFormat], n: int, k: int, ctx: RecipeContext, kn: dict,
                    split: tuple[int, int], acts: tuple, x: str, wbind: tuple, y: str, t_bind, x_rows: int,
                    epilogue=None) -> list[Launch]:
    """Steps of more than mma_split_above to TILES_ABOVE tokens as tile products with K in parts, each a group,
    then their sum (`kn`: the split family's knobs; `split`: `_split_tiles`' parts and chunk; `acts`, `x`,
    `wbind`: the int8 activations' bindings, the activations (which u8f16 products, `tile_mma.u8f16_products`,
    read themselves) and the weights')."""
    (parts, chunk), mid = split, ((split_above(kn), True), (TILES_ABOVE, False))
    u8f16 = u8f16_products(ctx.target(), kn, fmts)
    yp = ctx.scratch("yp", "f32", parts * len(fmts) * min(x_rows, TILES_ABOVE) * n)

    def part_launch(j0: int, fs: Sequence[QuantFormat], ws: tuple, tag: str) -> Launch:
        sk = tile_mma_kernel(f"{name}{gate_suffix(mid)}_mma_k{parts}{tag}", fs, n, k, rows=kn["mma_rows"],
                             tokens=kn["mma_split_tokens"], chunk=chunk, lanes=kn["mma_lanes"],
                             gate=mid, split=parts, slot=j0, u8f16=u8f16, **staging_flags(kn))
        return Launch(sk, (*((("x", x),) if u8f16 else acts), *ws, ("yp", yp)), (("T", t_bind),))

    # Knob mma_split_each: several weights (the gate and up of a GLU) a launch each, as a lone matmul's, whose
    # groups hold one weight's tiles, rather than one launch whose groups hold all of them (half the groups in
    # flight for the same work: docs/benchmarks.md, "Serving: the GLU's split-K products a launch a weight").
    if len(fmts) > 1 and int(kn["mma_split_each"]):
        parts_l = [part_launch(j, [f], (("w0", w),), f"_w{j}") for j, (f, (_, w)) in enumerate(zip(fmts, wbind))]
    else:
        parts_l = [part_launch(0, fmts, wbind, "")]
    ss = split_sum_kernel(f"{name}{gate_suffix(mid)}_sum{parts}", n, parts, ctx.lanes, len(fmts), epilogue, gate=mid)
    return [*parts_l, Launch(ss, (("yp", yp), ("y", y)), (("T", t_bind),))]


@kernel_builder
def quantize_x_kernel(name: str, k: int, rows_per_t: int = 1, sums: bool = False,
                      gate: tuple[int, bool] | None = None) -> Kernel:
    """xq[(t*k + e) / 4] packs the int8 codes of x[t, e..e+3] (byte e % 4, little-endian), xd[t*k/32 + b] =
    max|x| / 127 of each 32 values. Grid (T * rows_per_t, k / 32): a group of 32 lanes per 32 values (the max a
    one-warp Reduce, then 8 lanes pack a word each); `rows_per_t` > 1: x has that many rows per token (MoE slots).
    `sums`: also xs[t*k/16 + h] = the sum of each 16 values as their codes give them (xd times the codes' sum), for
    `tile_matmul_q8_kernel` (weight offsets, levels stored with a bias), and each row's words in the layout of its
    `dot_i8_pair` (`cpu_intrinsics.chunked_byte`); `gate`: the steps it runs for
    (`tile_matmul.step_gate`)."""
    na = k // QB
    xo, inv = Var("xo"), Var("inv")
    body = (
        Let("xo", Var("g0") * k + Var("g1") * QB),
        Reduce("amax", "max", "e", Const(QB), (), Call("abs", Load("x", xo + Var("e")))),
        Let("inv", Select(Var("amax") > 0.0, Const(127.0) / Var("amax"), Const(0.0))),
        Store("xd", Var("g0") * na + Var("g1"), Var("amax") / 127.0),
        LaneFor("q", Const(QB // 4), (
            *code_word(lambda e: Load("x", xo + Var("q") * 4 + e), inv, "word"),
            # With sums (`tile_matmul_q8_kernel`), a row's words in `dot_i8_pair`'s layout.
            Store("xq", Var("g0") * (k // 4) + chunked_byte(Var("g1") * QB + Var("q") * 4, k) // 4
                  if sums else xo // 4 + Var("q"), Var("word")),
        )),
    )
    params = (Buf("x", "f32"), Buf("xq", "u32", out=True), Buf("xd", "f32", out=True), Scalar("T"))
    if sums:
        for h in range(2):  # the same codes as the words': the same expression, rounded the same way
            body += (Reduce(f"xsum{h}", "+", "e", Const(QB // 2), (),
                            round_half_away(Load("x", xo + h * (QB // 2) + Var("e")) * inv)),
                     Store("xs", (Var("g0") * na + Var("g1")) * 2 + h,
                           Cast("f32", Var(f"xsum{h}")) * (Var("amax") / 127.0)))
        params = (*params[:3], Buf("xs", "f32", out=True), params[3])
    return Kernel(name, params, (step_gate(Var("T") * rows_per_t, gate), Const(na)), body, lanes=QB,
                  doc=f"quantize x to int8 [{k}]")


def staged(j: Expr) -> Expr:
    """Where value j of a row goes in the local copy `quantize_staged` reads: one word of padding per 32 values,
    so that lane b reading its block's values (at b * 33 + e) hits a different memory bank from its neighbours."""
    return j + j // QB


def staged_locals(local: str, n: int) -> tuple[LocalArray, LocalArray]:
    """The local arrays `quantize_staged` needs for n values staged in `local`: the padded copy itself and
    `{local}_max` (the largest |value| of each 4, then of each 32)."""
    return LocalArray(local, "f32", n + n // QB), LocalArray(f"{local}_max", "f32", n // 4 + n // QB)


def quantize_staged(local: str, n: int, xq_word: Expr, xd_index: Expr) -> list:
    """LaneFors quantizing the n values staged in local array `local` (at `staged(j)`) as `quantize_x_kernel`
    would: the scales of each 32 values to xd[xd_index + b], their codes to xq[xq_word + 8 b ...]. Lets a kernel
    that produces a row (a norm, the attention combine) also write it as the next matmuls' activations. In three
    short lane loops (the largest |value| of each 4 values, of each 32, then a lane per code word), not a lane per
    32 values walking them one after another. Local arrays: `staged_locals`."""
    mx, nw = f"{local}_max", n // 4
    w, b = Var("qs_w"), Var("qs_b")

    def val(e: Expr) -> Expr:
        return Load(local, staged(w * 4 + e))
    quad_max = Call("abs", val(Const(0)))
    for e in range(1, 4):
        quad_max = Call("max", quad_max, Call("abs", val(Const(e))))
    block_max = Load(mx, b * 8)
    for i in range(1, 8):
        block_max = Call("max", block_max, Load(mx, b * 8 + i))
    amax = Load(mx, nw + w // 8)
    return [
        LaneFor(w.name, Const(nw), (Store(mx, w, quad_max),)),
        LaneFor(b.name, Const(n // QB), (Let("qs_amax", block_max), Store(mx, nw + b, Var("qs_amax")),
                                         Store("xd", xd_index + b, Var("qs_amax") / 127.0))),
        LaneFor(w.name, Const(nw), (
            Let("qs_inv", Select(amax > 0.0, Const(127.0) / amax, Const(0.0))),
            *code_word(val, Var("qs_inv"), "qs_word"),
            Store("xq", xq_word + w, Var("qs_word")),
        )),
    ]


def _row_sweeps(fmts: Sequence[QuantFormat], wnames: Sequence[str], first: Expr, rows: int, n: int, k: int,
                subs: Sequence[int], runs, spread: bool, prefix: str = "",
                ts: Sequence[Expr] | None = None) -> tuple[list, list]:
    """(statements leaving the dot products `{prefix}s{j}_{r}` = dot(w_j[first + r], x[t]) for the group's `rows`
    rows from the packed int8 activations, the store guards of `_matvec.group_rows`). Weights and rows walked alike
    share one Reduce and its activation loads (`_matvec.split_dots`); with `spread` the lanes spread over the
    rows (`split_dots`' spread) rather than each lane sweeping all of them. `ts` (not with `spread`): the
    activation rows of a token tile, all dotted in the same sweep, `{prefix}s{j}_{r}_{i}` that of token i."""
    act = Act("xq", k, "xq", "xd", packed=True)
    rws, guards = group_rows(first, rows, n)
    t = Var("t0") + Var("t")
    if spread and rows > 1:
        row = slot_row(first, rows, n)
        parts = [(f"{prefix}s{j}", f, w, row * elements_per_row_bytes(f, k), f"{prefix}w{j}_", subs[j])
                 for j, (w, f) in enumerate(zip(wnames, fmts))]
        return split_dots(parts, act, t, runs, spread=rows), guards
    # Each row index a name: the weight decoders need addresses affine in their element index.
    lets = [Let(f"{prefix}row{r}", row) for r, row in enumerate(rws)]
    parts = [(f"{prefix}s{j}_{r}", f, w, Var(f"{prefix}row{r}") * elements_per_row_bytes(f, k), f"{prefix}w{j}r{r}_",
              subs[j]) for j, (w, f) in enumerate(zip(wnames, fmts)) for r in range(rows)]
    if ts is not None:
        parts = [(f"{name}_{i}", f, w, base, f"{pre}t{i}_", sub, ti)
                 for name, f, w, base, pre, sub in parts for i, ti in enumerate(ts)]
    return [*lets, *split_dots(parts, act, t, runs)], guards


def _token_tile(tokens: int) -> tuple:
    return Let("t0", Var("g1") * tokens), Let("nt", Call("min", Const(tokens), Var("T") - Var("t0")))


def _tile_statements(fmts: Sequence[QuantFormat], wnames: Sequence[str], first: Expr, rows: int, n: int, k: int,
                     subs: Sequence[int], runs, spread: bool, tokens: int, reuse: bool,
                     store: Callable[[int, str, Expr], Store], prefix: str = "") -> list:
    """A group's statements for its token tile (`_row_sweeps` of its rows, then the stores): a loop over the tile's
    tokens, each sweeping the rows again, or with `reuse` one sweep for all of them, each token's activation row
    clamped to the last token (a partial tile's loads stay in bounds) and its stores guarded. `store(r, suffix, t)`:
    the store of row r's result for token row t, its dot products named `{prefix}s{j}_{r}{suffix}`."""
    if reuse:
        lets = [Let(f"tk{i}", Call("min", Var("t0") + i, Var("T") - 1)) for i in range(tokens)]
        sweeps, guards = _row_sweeps(fmts, wnames, first, rows, n, k, subs, runs, spread, prefix,
                                     ts=[Var(f"tk{i}") for i in range(tokens)])
        stores = []
        for i in range(tokens):
            for r in range(rows):
                cond = guards[r] if not i else Var("nt") > i if guards[r] is None else guards[r] & (Var("nt") > i)
                stores.append(guarded(cond, store(r, f"_{i}", Var("t0") + i)))
        return [*lets, *sweeps, *stores]
    sweeps, guards = _row_sweeps(fmts, wnames, first, rows, n, k, subs, runs, spread, prefix)
    t = Var("t0") + Var("t")
    return [For("t", Const(0), Var("nt"), (*sweeps, *(guarded(guards[r], store(r, "", t)) for r in range(rows))))]


def _q8_knobs(fmts: Sequence[QuantFormat], tokens: int, subs: Sequence[int], runs, rows: int, spread: bool,
              reuse: bool) -> tuple:
    return (("tokens", tokens), ("int8", 1), ("xq", "kernel"), ("sub", ",".join(map(str, subs))),
            ("runs", ",".join(str(int(use_runs(f, runs))) for f in fmts)), ("rows", rows),
            ("spread", int(spread and rows > 1)), ("reuse", int(reuse)))


@kernel_builder
def matvec_q8_kernel(name: str, fmts: Sequence[QuantFormat], n: int, k: int, *, tokens: int, lanes: int,
                     sub: int | str = "auto", runs: bool | int | str = "auto", rows: int = 1, spread: bool = False,
                     reuse: bool = False, epilogue: Callable[[list[Expr]], Expr] | None = None,
                     gate: tuple[int, bool] | None = None) -> Kernel:
    """y[t, r] = epilogue(dot(w_j[r], x[t])) from pre-quantized activations (`quantize_x_kernel`); `gate`: the
    steps it runs for (`tile_matmul.step_gate`).

    Grid (ceil(n / rows), ceil(T / tokens)): `rows` weight rows per group, their dot products swept together by
    all its lanes (`_matvec.split_dots`: `sub` lanes per block, each taking interleaved words or with `runs` a run
    of consecutive words of each chunk; each activation word loaded once for all the rows and weights), or with
    `spread` the lanes spread over the rows (short rows). For each token of the tile the rows are swept again
    (from cache), or with `reuse` (not with `spread`) once for the whole tile: each weight word is loaded and
    decoded once and dotted with every token's activations (arithmetic bound steps of many tokens: each token's
    sweep decoded the weights again).
    """
    subs = [sub_lanes(f, sub, runs) for f in fmts]
    wnames = [f"w{j}" for j in range(len(fmts))]
    params = (Buf("xq", "u32"), Buf("xd", "f32"),
              *(Buf(w, weight_dtype(f)) for w, f in zip(wnames, fmts)), Buf("y", "f32", out=True), Scalar("T"))
    reuse = reuse and not (spread and rows > 1)
    first = Var("g0") * rows if rows > 1 else Var("g0")

    def store(r: int, suffix: str, t: Expr) -> Store:
        vals = [Var(f"s{j}_{r}{suffix}") for j in range(len(fmts))]
        return Store("y", t * n + first + r if r else t * n + first, epilogue(vals) if epilogue else vals[0])

    body = (*_token_tile(tokens),
            *_tile_statements(fmts, wnames, first, rows, n, k, subs, runs, spread, tokens, reuse, store))
    grid = (Const(-(-n // rows)), step_gate((Var("T") + (tokens - 1)) // tokens, gate))
    return Kernel(name, params, grid, body, lanes=lanes,
                  knobs=_q8_knobs(fmts, tokens, subs, runs, rows, spread, reuse),
                  doc=f"matvec int8 {'+'.join(f.name for f in fmts)} [{n}x{k}]")


@kernel_builder
def stacked_matvec_q8_kernel(name: str, fmts: Sequence[QuantFormat], ns: Sequence[int], k: int, *, tokens: int,
                             lanes: int, sub: int | str = "auto", runs: bool | int | str = "auto",
                             rows: int = 1, spread: bool = False, reuse: bool = False,
                             gate: tuple[int, bool] | None = None) -> Kernel:
    """y_j[t, r] = dot(w_j[r], x[t]) for several weights (rows `ns[j]`) reading the same activations, as if stacked
    into one weight: grid (sum(ceil(ns / rows)), ceil(T / tokens)), the first groups on w0, the next on w1, ...
    (a group-uniform branch), `rows` rows a group (`spread`: see `matvec_q8_kernel`). One launch where there were
    several, and small matvecs (attention k and v: 1024 rows) fill the device together. `reuse`: see
    `matvec_q8_kernel`; `gate`: the steps it runs for (`tile_matmul.step_gate`)."""
    subs = [sub_lanes(f, sub, runs) for f in fmts]
    m = len(fmts)
    params = (Buf("xq", "u32"), Buf("xd", "f32"), *(Buf(f"w{j}", weight_dtype(f)) for j, f in enumerate(fmts)),
              *(Buf(f"y{j}", "f32", out=True) for j in range(m)), Scalar("T"))
    g0 = Var("g0")
    groups = [-(-n // rows) for n in ns]
    starts = [sum(groups[:j]) for j in range(m)]
    reuse = reuse and not (spread and rows > 1)

    def part(j: int) -> tuple:
        g = g0 - starts[j] if starts[j] else g0
        first = g * rows if rows > 1 else g

        def store(r: int, suffix: str, t: Expr) -> Store:
            return Store(f"y{j}", t * ns[j] + first + r if r else t * ns[j] + first, Var(f"p{j}s0_{r}{suffix}"))

        return tuple(_tile_statements([fmts[j]], [f"w{j}"], first, rows, ns[j], k, [subs[j]], runs, spread, tokens,
                                      reuse, store, f"p{j}"))

    # Flat Ifs, one a weight (PoCL mishandles the barriers of reductions inside a nested else-if).
    branches = [If((g0 >= starts[j]) & (g0 < starts[j] + groups[j]) if j else g0 < groups[0], part(j))
                for j in range(m)]
    grid = (Const(sum(groups)), step_gate((Var("T") + (tokens - 1)) // tokens, gate))
    return Kernel(name, params, grid, (*_token_tile(tokens), *branches), lanes=lanes,
                  knobs=_q8_knobs(fmts, tokens, subs, runs, rows, spread, reuse),
                  doc=f"stacked matvecs int8 {'+'.join(f.name for f in fmts)} [{'+'.join(map(str, ns))}x{k}]")


def value_format(ctx: RecipeContext, v) -> QuantFormat:
    """The format a recipe reads value `v` in: its weight's (F32 for a weight the plan has no format of), F32 for
    activations."""
    from polystrata.ir.formats import F32

    return ctx.weight_formats.get(v.weight, F32) if v.weight is not None else F32


def _lower_matmul(nodes: Sequence[Node], ctx: RecipeContext) -> list[Launch]:
    (node,) = nodes
    x, w = node.inputs
    n, k = int(w.type.shape[0]), int(w.type.shape[-1])
    name = f"matmul_{value_format(ctx, w).name.lower()}_{n}x{k}"
    kn = _knobs(ctx, MATMUL_SPACE, name)
    return _launches(name, [value_format(ctx, w)], n, k, ctx, kn, ctx.buf(x),
                     [ctx.buf(w)], ctx.buf(node.output), token_binding(x), ctx.max_rows(x))


def _lower_glu(nodes: Sequence[Node], ctx: RecipeContext) -> list[Launch]:
    g, u, act = nodes
    x, wg = g.inputs
    _, wu = u.inputs
    n, k = int(wg.type.shape[0]), int(wg.type.shape[-1])
    fn = ACTIVATIONS[act.op]
    fg, fu = value_format(ctx, wg), value_format(ctx, wu)
    name = f"glu_{act.op}_{fg.name.lower()}_{fu.name.lower()}_{n}x{k}"
    kn = _knobs(ctx, MATMUL_SPACE, name)
    return _launches(name, [fg, fu], n, k, ctx, kn,
                     ctx.buf(x), [ctx.buf(wg), ctx.buf(wu)], ctx.buf(act.output), token_binding(x),
                     ctx.max_rows(x), epilogue=lambda v: fn(v[0]) * v[1])


def _lower_matmul_stack(nodes: Sequence[Node], ctx: RecipeContext) -> list[Launch]:
    """Matmuls of one input (attention q, k, v): on the GPU path one quantize launch and one
    `stacked_matvec_q8_kernel`; elsewhere each matmul as `matmul` lowers it."""
    x = nodes[0].inputs[0]
    ws = [n.inputs[1] for n in nodes]
    ns, k = [int(w.type.shape[0]) for w in ws], int(ws[0].type.shape[-1])
    fmts = [value_format(ctx, w) for w in ws]
    kn = _knobs(ctx, MATMUL_SPACE, None)
    x_rows = ctx.max_rows(x)
    # Where tile products take the long steps, each matmul lowers alone (its own gated kernels).
    if not _int8_kernels(ctx, kn, fmts, k) or any(_tile_products(ctx, kn, [f], n, k) for f, n in zip(fmts, ns)):
        return [la for n in nodes for la in _lower_matmul([n], ctx)]
    tag = "_".join(f"{f.name.lower()}{n}" for f, n in zip(fmts, ns))
    inst, recorded = f"matmul_stack_{tag}x{k}", len(ctx.sites)
    kn = _knobs(ctx, MATMUL_SPACE, inst)
    # Split K's products (knob mma_split) read the knobs of a family of their own, as `_launches`' do; where longer
    # steps take no tile products, the matvecs keep them: no split then.
    split_kn = (_knobs(ctx, MATMUL_SPACE, inst, "split") if ctx.target().matrix_units and 1 < x_rows <= TILES_ABOVE
                else None)
    splits = [_split_tiles(ctx, split_kn, [f], n, k, x_rows) if split_kn else None for f, n in zip(fmts, ns)]
    # This instance's override left the GPU path, or split K takes the short steps of some matmuls only (the
    # stacked matvec then has no one gate).
    if not _int8_kernels(ctx, kn, fmts, k) or (any(splits) and not all(splits)):
        del ctx.sites[recorded:]
        return [la for n in nodes for la in _lower_matmul([n], ctx)]
    ql, qb, db = quantize_launch(ctx, ctx.buf(x), k, token_binding(x))
    acts, t_bind = (("xq", qb), ("xd", db)), token_binding(x)
    # With split K: each matmul's steps of more than mma_split_above tokens (up to TILES_ABOVE) on its own tile
    # products, the stacked matvec taking the shorter steps.
    mid = [la for f, n, w, node, split in zip(fmts, ns, ws, nodes, splits) if split
           for la in _split_launches(f"{inst}_{f.name.lower()}{n}", [f], n, k, ctx, split_kn, split, acts,
                                     ctx.buf(x), (("w0", ctx.buf(w)),), ctx.buf(node.output), t_bind, x_rows)]
    if split_kn is not None:
        ctx.timed_at(MATMUL_SPACE, inst, batch_rows(split_above(split_kn), x_rows), "split")
    if mid:
        ctx.timed_at(MATMUL_SPACE, inst, split_above(split_kn))
    rows, spread = q8_rows(kn, ctx, fmts, sum(ns), k)
    gate = (split_above(split_kn), False) if mid else None
    mk = stacked_matvec_q8_kernel(f"matmul_stack_{tag}x{k}{gate_suffix(gate)}_q8", fmts, ns, k, tokens=kn["tokens"],
                                  sub=kn["sub"], runs=kn["runs"], rows=rows, spread=spread, reuse=_reuse(ctx, kn),
                                  lanes=_gpu_lanes(kn, ctx, fmts, k), gate=gate)
    outs = tuple((f"y{j}", ctx.buf(n.output)) for j, n in enumerate(nodes))
    return [ql, *mid, Launch(mk, (*acts, *((f"w{j}", ctx.buf(w)) for j, w in enumerate(ws)), *outs),
                             (("T", t_bind),))]


def _match_matmul_stack(nodes: Sequence[Node]) -> bool:
    x = nodes[0].inputs[0]
    return all(n.inputs[0] is x and n.inputs[1].weight is not None and len(n.inputs[1].type.shape) == 2
               and n.inputs[1].type.shape[-1] == nodes[0].inputs[1].type.shape[-1] for n in nodes)


def match_glu(nodes: Sequence[Node]) -> bool:
    g, u, act = nodes
    return (g.inputs[0] is u.inputs[0] and act.inputs[0] is g.output and act.inputs[1] is u.output
            and g.inputs[1].weight is not None and u.inputs[1].weight is not None)


def _match_matmul(nodes: Sequence[Node]) -> bool:
    return nodes[0].inputs[1].weight is not None


@kernel_builder
def embed_kernel(name: str, fmt: QuantFormat, cols: int, chunk: int, lanes: int) -> Kernel:
    """out[t, :] = dequantized row tokens[t] of the [vocab, cols] table; grid (T, ceil(blocks / chunk))."""
    wf = fmt_for(fmt)
    nb = cols // wf.block_size
    chunk = max(1, min(chunk, nb))
    body = (LaneFor("c", Const(chunk), (
        Let("b", Var("g1") * chunk + Var("c")),
        If(Var("b") < nb, (
            Let("tok", Load("tokens", Var("g0"))),
            *_decode_store(wf, Var("tok") * elements_per_row_bytes(fmt, cols) + Var("b") * block_stride(wf),
                           Var("g0") * cols + Var("b") * wf.block_size),
        )),
    )),)
    grid = (Var("T"), Const((nb + chunk - 1) // chunk))
    params = (Buf("w", weight_dtype(fmt)), Buf("tokens", "i32"), Buf("y", "f32", out=True), Scalar("T"))
    return Kernel(name, params, grid, body, lanes=lanes, knobs=(("chunk", chunk),), doc=f"embed {fmt.name}")


def _decode_store(wf: QuantFormat, base: Expr, out: Expr) -> list:
    dec = Decoder(wf, "w", base, "d_")
    return dec.walk(lambda s, n, env, inner: inner,
                    lambda c, L, i0, env, lw: [Store("y", out + c + Var(i0), dec.value(lw))])


def _lower_embed(nodes: Sequence[Node], ctx: RecipeContext) -> list[Launch]:
    (node,) = nodes
    w, tok = node.inputs
    fmt = value_format(ctx, w)
    cols = int(w.type.shape[1])
    name = f"embed_{fmt.name.lower()}_{cols}"
    kern = embed_kernel(name, fmt, cols, ctx.knobs_for(EMBED_SPACE, name)["chunk"], ctx.lanes)
    return [Launch(kern, (("w", ctx.buf(w)), ("tokens", ctx.buf(tok)), ("y", ctx.buf(node.output))),
                   (("T", "T"),))]


EMBED_SPACE = KnobSpace("embed", (Knob("chunk", 8, (1, 4, 16, 64)),))
register(Recipe("matmul_swiglu", ("matmul", "matmul", "swiglu"), _lower_glu, match_glu, MATMUL_SPACE))
register(Recipe("matmul_geglu", ("matmul", "matmul", "geglu"), _lower_glu, match_glu, MATMUL_SPACE))
register(Recipe("matmul", ("matmul",), _lower_matmul, _match_matmul, MATMUL_SPACE))
# Three or four matmuls sharing their input (q, k, v; Gated DeltaNet's qkv, z, beta and alpha): the "matmul"
# knobs apply.
register(Recipe("matmul_stack4", ("matmul",) * 4, _lower_matmul_stack, _match_matmul_stack, MATMUL_SPACE))
register(Recipe("matmul_stack3", ("matmul",) * 3, _lower_matmul_stack, _match_matmul_stack, MATMUL_SPACE))
register(Recipe("embed", ("embed",), _lower_embed, None, EMBED_SPACE))

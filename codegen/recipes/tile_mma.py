"""`tile_mma_kernel`: prefill matmuls (steps of many tokens) as tile products (`ir.kernel.TileMMA`), for targets
with matrix units (tensor cores, MFMA); llama.cpp's MMQ scheme, generated from the format descriptions.

A group computes a tile of `rows` weight rows x `tokens` tokens, walking K in chunks of `chunk` elements:

1. each weight row's elements of the chunk are decoded (`codegen.dequant.Decoder`, the int8 path's factoring
   `value = S_g * level + M_g` of `format_analysis.affine`) to int8 levels packed four to a word in the tile
   operand layout (K-contiguous words, rows padded by 4 words so that a warp's operand loads fall in distinct
   banks), with each group's scale S_g and offset M_g side by side (`scale_stride`);
2. the tokens' int8 activation codes (written once per matmul by `linear.quantize_x_kernel`: codes packed in
   words, a scale per 32) are copied into the other operand tile, with their scales xd and, for formats with an
   offset, xd times each group's code sum beside them, group by group (zero for tokens past T: partial tiles);
3. per weight group g: `TileMMA` of the group's words into an i32 fragment, then a `TileEach` adding
   `xd * (S_g * isum) (+ M_g * xd * xsum)` into the weight's f32 fragment and clearing the i32 one (the pairs
   side by side: one local load for a row's pair, one for a token's);
4. a last `TileEach` stores the rows and tokens inside the matrix (through the epilogue: the GLU's activation).

Staging (1 and 2) a word at a time (knob mma_words, the default, for formats whose levels pack into words as the
int8 matvec's do, `word_staging`): one lane loop over every lane does both, each weight unit a run of words of
a row's block from 4-byte loads (Q4_K: two 16-byte loads give a lane 8 operand words), each activation unit a
group's codes (16-byte loads) and their sum, then one barrier. A byte at a time (mma_words=0, and formats whose
levels do not pack, Q5_0, IQ4_NL): a lane a row stores each level as a byte, a second lane loop packs them, a
third and fourth stage the activations, each followed by a barrier (the first H200 measurement's kernel;
docs/benchmarks.md, "Prefill on matrix units", has the analysis).

The activation codes are those of the GPU matvec path, so prefill and decode see the same rounding. Knobs (recipe
"matmul", read by `linear._launches`): mma_rows, mma_tokens (the tile), mma_chunk (K per staging round), mma_lanes,
mma_min (the smallest matrix taken; "auto": the target policy's, see `TILE_MMA_KNOBS`), mma_words (above),
mma_unroll, mma_f16, mma_deal and mma_ablate (see `TILE_MMA_KNOBS`).

With knob mma_f16 (`u8f16_products`), steps 1-3 change: the levels are staged as unsigned bytes with one word of
f16 scale and offset a group, the f32 activations as f16 pairs, and one "u8f16" tile product a chunk
(`ir.kernel.TileMMA`) makes each byte an f16 value inside the product: no rescaling of the sums, no int8
activations, more accurate, but slower where measured.
Targets without a matrix unit render the same kernel as loops (`codegen/lanes.py`); `linear._launches` takes it
only where the target's policy says it has them (`Policy.matrix_units`) and the plan serves steps of several tokens.

With a `Gather`, the tile's tokens are those a list names (MoE prefill, `moe.py`: the entries routed to one expert,
whose matrix is one of a 3-D weight tensor's): the same kernel, its activation rows, output rows and first weight
row read through the list.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from polystrata.codegen.dequant import Decoder, chunk_len
from polystrata.codegen.format_analysis import affine, block_stride, elements_per_row_bytes, finest_group, weight_dtype
from polystrata.codegen.policy import MMA_OFF, Policy
from polystrata.codegen.recipes import Knob, kernel_builder
from polystrata.codegen.recipes._alignment import ALIGN_MAX, realign
from polystrata.codegen.recipes._matvec import (
    QB,
    _vec_level,
    _wide_levels,
    fmt_for,
    signed_byte_levels,
    use_int8,
)
from polystrata.codegen.recipes.tile_matmul import Gate, step_gate
from polystrata.ir.expr import Const, Expr, Var
from polystrata.ir.formats import QuantFormat
from polystrata.ir.kernel import (
    DTYPE_BYTES,
    Buf,
    Call,
    Cast,
    For,
    FragElem,
    Fragment,
    FragSet,
    If,
    Kernel,
    LaneFor,
    Let,
    Load,
    LocalArray,
    Scalar,
    Select,
    Store,
    TileEach,
    TileMMA,
    ToF32,
    substitute,
)

TILE_MMA_KNOBS = (Knob("mma_rows", 64, (32, 128)), Knob("mma_tokens", "auto", (32, 64)),
                  Knob("mma_chunk", "auto", (64, 128, 256)), Knob("mma_lanes", 128, (256,)),
                  Knob("mma_min", "auto", (512, 2048, MMA_OFF)), Knob("mma_words", 1), Knob("mma_unroll", 0, (1,)),
                  Knob("mma_f16", 0, (1,)), Knob("mma_deal", "rows", ("cols", "blocks")),
                  Knob("mma_ablate", "none", ()))
# Knob mma_min: the tile path takes matrices of at least this many rows and columns only ("auto": the target
# policy's, `codegen/policy.py`, which says why). Smaller matrices cost little in a prompt chunk anyway, and each
# tile kernel is a long compile; `tune` tries 512, 2048 and off (MMA_OFF).
# Knobs mma_rows, mma_lanes: a tile's weight rows, a group's lanes; `tune` tries 32 and 128 rows and 256 lanes
# (on the H100, 128 rows won at 512 rows with 32-token tiles and lost at 16 rows: docs/benchmarks.md, "Where the
# int8 tile kernel's time goes", "Serving: where a 16-row step goes").
# Knob mma_tokens: a tile's tokens ("auto": the policy's, `tile_tokens`).
# Knob mma_chunk: K a staging round ("auto": the policy's where the matrix takes it, else SMALL_CHUNK; `mma_chunk`).
# Knob mma_words: 1 stages int8 operands a word at a time (module docstring); 0, the byte-at-a-time staging of the
# first measurement, is kept for comparison (`--knob matmul.mma_words=0`), not searched by `tune`.
# Knob mma_unroll: 1 writes out the loop over a chunk's weight groups (each group's product and scaling), so that
# the operands' local addresses are constants; 0 keeps the loop (shorter code, a longer compile of the unrolled).
# Knob mma_f16: 1 takes the "u8f16" tile products (`u8f16_products`) where the matrix unit has them: several times
# more accurate than the int8 products, slower on the H100 (docs/benchmarks.md, "u8f16 tile products"), so off.
# Knob mma_deal: how a group's warps share its tile (`ir.kernel.Fragment.deal`): "rows" gives each warp rows of it
# (each A operand and row scale loaded once for all its tiles), "cols" columns, "blocks" blocks as square as the
# tile allows (fewer local loads of both, not yet measured); the u8f16 products take rows always.
# Knob mma_ablate: "staging" or "products" leaves that part of the kernel out (wrong results, for timing the other
# part alone: `scripts/matvec_bench.py --knob matmul.mma_ablate=products`); no candidates, so `tune` never tries it.
PAD = 4  # words of padding after each operand row (see the module docstring)
TOKEN_WORDS = 4  # words a token's (scale, scale x code sum) pair takes in `xds` (`token_stride`)
HALF_UNIT = 16  # u8f16: activation values a staging unit converts to f16: one block of 8 B words (its order)
SMALL_CHUNK = 64  # the K chunk of matrices that the policy's does not fit (two activation blocks)


@dataclass(frozen=True)
class Gather:
    """The tokens of a tile kernel taken from a list (MoE prefill: the entries routed to one expert, grid dimension
    g2): `lets` (uniform statements heading the body), `count` (how many tokens the list holds), `row(j)` the
    activation row of listed token j < count, `out(j)` its output row, `first` the first weight row (an expert's
    matrix in a 3-D tensor), `params` the buffers these read, `groups` the size of grid dimension g2."""

    lets: tuple
    count: Expr
    row: Callable[[Expr], Expr]
    out: Callable[[Expr], Expr]
    first: Expr
    params: tuple
    groups: Expr


def f16_path(fmts: Sequence[QuantFormat]) -> bool:
    """Whether weights of `fmts` take the f16 tile products (F16 weights: exact in f16) rather than int8 ones."""
    return all(f.name == "F16" for f in fmts)


def staging_flags(kn: dict) -> dict:
    """`tile_mma_kernel`'s staging, loop and dealing arguments from knobs `kn` (mma_words, mma_unroll, mma_deal,
    mma_ablate)."""
    return {"words": bool(int(kn["mma_words"])), "unroll": bool(int(kn["mma_unroll"])),
            "deal": kn["mma_deal"], "ablate": kn["mma_ablate"]}


def u8f16_products(policy: Policy, kn: dict, fmts: Sequence[QuantFormat]) -> bool:
    """Whether tile products over weights of `fmts` take the "u8f16" kind (`ir.kernel.TileMMA`): knob mma_f16, on a
    target whose matrix unit spells it (`Policy.matrix_kinds`; elsewhere it would be loops). Each weight level is
    a byte made an f16 value by its group's scale and offset inside the product, times the f32 activations
    rounded to f16, with no rescaling of the sums a weight group (the int8 products' `TileEach`) and no int8
    activations. Formats: those staged a word at a time (`word_staging`)."""
    return (bool(int(kn["mma_f16"])) and "u8f16" in policy.matrix_kinds and bool(int(kn["mma_words"]))
            and word_staging(fmts))


def tile_products_apply(policy: Policy, space: str, t_max: int, kn: dict, fmts: Sequence[QuantFormat], n: int,
                        k: int) -> bool:
    """The part of the choice of tile products that `linear` and `moe` share: a target with matrix units
    (`Policy.matrix_units`), a plan of steps of several tokens, a matrix of at least knob mma_min rows and columns
    (knob space `space`'s; "auto": the policy's), formats and K that `tile_mma_fits` takes (with `mma_chunk`'s
    chunk), local arrays within the policy's `local_bytes` (a large tile and chunk may not fit). Each caller adds
    where its int8 activations come from."""
    if not (policy.matrix_units and t_max > 1):
        return False
    chunk = mma_chunk(policy, space, kn, fmts, k)
    least = int(policy.knob(space, "mma_min", kn["mma_min"]))
    return min(n, k) >= least and tile_mma_fits(fmts, k, chunk) and _fits_local(policy, space, kn, fmts, chunk)


def mma_chunk(policy: Policy, space: str, kn: dict, fmts: Sequence[QuantFormat], k: int) -> int:
    """Knob mma_chunk of knob space `space` for weights of `fmts` with rows of k: as set, or ("auto") the policy's
    where `tile_mma_fits` and the local memory take it, else SMALL_CHUNK."""
    if kn["mma_chunk"] != "auto":
        return int(kn["mma_chunk"])
    chunk = int(policy.default(space, "mma_chunk"))
    return chunk if tile_mma_fits(fmts, k, chunk) and _fits_local(policy, space, kn, fmts, chunk) else SMALL_CHUNK


def tile_tokens(policy: Policy, space: str, kn: dict) -> int:
    """Knob mma_tokens of knob space `space`: as set, or ("auto") the policy's."""
    return int(policy.knob(space, "mma_tokens", kn["mma_tokens"]))


def _fits_local(policy: Policy, space: str, kn: dict, fmts: Sequence[QuantFormat], chunk: int) -> bool:
    words = bool(int(kn["mma_words"])) and word_staging(fmts)
    arrays = operand_arrays(fmts, int(kn["mma_rows"]), tile_tokens(policy, space, kn), chunk, words,
                            u8f16_products(policy, kn, fmts))
    return sum(a.size * DTYPE_BYTES[a.dtype] for a in arrays) <= policy.local_bytes


def tile_mma_fits(fmts: Sequence[QuantFormat], k: int, chunk: int) -> bool:
    """Whether `tile_mma_kernel` takes weights of `fmts` with rows of k: F16 weights (`f16_path`) or int8-path
    formats, and a K chunk that is a multiple of the activation block and of each weight group, and divides or is
    divided by each block."""
    if chunk % QB or k % chunk:
        return False
    if f16_path(fmts):
        return True
    if not all(use_int8(f, True) for f in fmts):
        return False
    for f in fmts:
        bs, g = fmt_for(f).block_size, affine(fmt_for(f)).group
        if chunk % g or (bs % chunk and chunk % bs) or k % max(bs, chunk):
            return False
    return True


def word_staging(fmts: Sequence[QuantFormat]) -> bool:
    """Whether `tile_mma_kernel` can stage weights of `fmts` a word at a time (knob mma_words): int8-path formats
    whose every element chunk's levels pack four to a word from one 4-byte load (`_matvec._wide_levels`, the int8
    matvec's test), as Q4_0, Q4_K, Q5_K, Q8_0 do."""
    return not f16_path(fmts) and all(use_int8(f, True) and _wide_levels(fmt_for(f), affine(fmt_for(f)), "") is not None
                                      for f in fmts)


def unsigned_levels(word: Expr, bias: int, wf: QuantFormat, lw, level: Expr) -> tuple[Expr, int]:
    """(`_vec_level`'s word of four levels as unsigned bytes, bias): level = byte - bias. Its word is that already
    (bytes below 128) but where the format's levels are the bytes read as signed int8 (Q8_0): those get each top
    bit flipped, bias 128."""
    if bias or not signed_byte_levels(wf, lw, level):
        return word, bias
    top = Cast("u32", Const(0x80808080))
    return (word & Cast("u32", Const(0x7F7F7F7F))) | (top - (word & top)), 128


def signed_bytes(word: Expr, bias: int) -> Expr:
    """The four bytes b of u32 `word` (each below 128) as the signed bytes b - bias (bias <= 128), without carries
    between bytes: b + 128 - bias in each byte, then its top bit flipped (no xor in the IR: kept bits or'd with
    0x80 minus the top bit)."""
    top = Cast("u32", Const(0x80808080))
    x = (word | top) - Cast("u32", Const(bias * 0x01010101))
    return (x & Cast("u32", Const(0x7F7F7F7F))) | (top - (x & top))


def operand_arrays(fmts: Sequence[QuantFormat], rows: int, tokens: int, chunk: int, words: bool,
                   u8f16: bool = False) -> list[LocalArray]:
    """The local arrays of `tile_mma_kernel` over `fmts` with this tile and chunk (`words`: staged a word at a time,
    as `word_staging` allows; `u8f16`: `u8f16_products`): the operand tiles, the weights' group scales and offsets
    (u8f16: one word of both in f16 a group), the activations' scales and code sums (and staged a byte at a time,
    the weights' levels before packing)."""
    half = f16_path(fmts)
    afs = [None if half else affine(fmt_for(f)) for f in fmts]
    st = chunk // (2 if half else 4) + PAD
    gx = min(a.group for a in afs) if not half else chunk
    if u8f16:
        local = [LocalArray("xb", "u32", tokens * (chunk // 2 + PAD))]
        for j, a in enumerate(afs):
            local += [LocalArray(f"wa{j}", "u32", rows * st), LocalArray(f"wsm{j}", "u32", rows * (chunk // a.group))]
        return local
    local = [LocalArray("xb", "u32", tokens * st)]
    offsets = any(a is not None and a.offset is not None for a in afs)
    if not half:
        local.append(LocalArray("xds", "f32", (chunk // gx) * token_stride(tokens, offsets)))
    for j, a in enumerate(afs):
        if not words:
            local.append(LocalArray(f"wl{j}", "f16" if half else "i8", rows * chunk))
        local.append(LocalArray(f"wa{j}", "u32", rows * st))
        if a is not None:
            local.append(LocalArray(f"ws{j}", "f32", rows * scale_stride(chunk // a.group, a.offset is not None)))
    return local


def token_stride(tokens: int, offsets: bool) -> int:
    """Words an activation group takes in `tile_mma_kernel`'s array `xds`: each token's scale, or with offsets its
    (scale, scale x code sum) pair in 4 words (a lane's two tokens then two 8-byte loads, which a warp's lanes
    share, not one 16-byte load, which the hardware serves a quarter of the warp at a time), and padding, so that
    the staging lanes of four groups of a token store into different banks."""
    return tokens * (TOKEN_WORDS if offsets else 1) + (2 if offsets else 8)


def scale_stride(groups: int, offset: bool) -> int:
    """Words a weight row takes in `tile_mma_kernel`'s group scale array `ws{j}` for `groups` groups a chunk: a
    scale each, or with offsets a (scale, offset) pair each and one pair of padding, so that the pairs that the
    eight rows of a hardware tile load at once (8-byte loads) fall in distinct banks."""
    return 2 * groups + 2 if offset else groups


@kernel_builder
def tile_mma_kernel(name: str, fmts: Sequence[QuantFormat], n: int, k: int, *, rows: int, tokens: int, chunk: int,
                    lanes: int, epilogue: Callable[[list[Expr]], Expr] | None = None,
                    gather: Gather | None = None, words: bool = True, gate: Gate | tuple[Gate, ...] | None = None,
                    split: int = 1, slot: int = 0, unroll: bool = False, u8f16: bool = False,
                    deal: str = "rows", ablate: str = "none") -> Kernel:
    """y[t, r] = epilogue(dot(w_j[r], x[t]) for each weight j), weights [n, k] of `fmts` (`tile_mma_fits`), from
    int8 activations `xq` / `xd` (`linear.quantize_x_kernel`'s), or for F16 weights (`f16_path`) from the f32
    activations `x` rounded to f16; grid (ceil(n / rows), ceil(T / tokens)). With `gather`: for each token j the
    list holds, y[out(j), r] from x[row(j)] and weight rows first + r; grid (.., .., gather.groups), a list of at
    most T tokens. `words` (knob mma_words): int8 operands staged a word at a time where every format's levels pack
    into words (`word_staging`), else a byte at a time. `gate`: the steps it runs for (`tile_matmul.step_gate`).
    `split` > 1 (steps of few tokens, not with `gather` or `epilogue`): K split into that many parts, each a group
    of its own (grid (.., ceil(T / tokens) * split)), whose unscaled sums go to yp[((j * split + part) * T + t) * n
    + r] for `split_sum_kernel` to add up; a step of one token tile then still has enough groups to fill the
    device. `slot`: the weights' sums go where weight slot + j's would (several launches, a weight each, filling
    one `split_sum_kernel`'s parts). `unroll` (knob mma_unroll): the loop over a chunk's weight groups written
    out. `deal` (knob mma_deal): how the tile is dealt to warps (`ir.kernel.Fragment.deal`).
    `u8f16` (`u8f16_products`, words staging only): the weights' levels staged as unsigned bytes with a word
    of f16 scale and offset a group, the f32 activations `x` staged as f16 pairs, one "u8f16" tile product a
    chunk into f32 fragments; no int8 activations. `ablate` (knob mma_ablate, for measuring where a kernel's time
    goes, never for results): "staging" leaves the staging out (products of whatever the local arrays hold),
    "products" the products (the results are zero)."""
    assert ablate in ("none", "staging", "products"), ablate
    assert split == 1 or (gather is None and epilogue is None), "split K adds its parts up in split_sum_kernel"
    half = f16_path(fmts)
    pack_n = 2 if half else 4  # elements a word
    wfs = [fmt_for(f) for f in fmts]
    afs = [None if half else affine(wf) for wf in wfs]
    big = max(chunk, *(wf.block_size for wf in wfs))  # the outer K step: a whole block of every weight
    st = chunk // pack_n + PAD  # operand row stride in words
    gx = min(a.group for a in afs) if not half else chunk  # activation sums are kept per gx elements
    offsets = any(a is not None and a.offset is not None for a in afs)
    xst = token_stride(tokens, offsets)
    words = words and word_staging(fmts)
    assert not u8f16 or words, "u8f16 products stage their weights a word at a time"
    stb = chunk // 2 + PAD if u8f16 else st  # activation operand row stride in words (u8f16: f16 pairs)
    row0, u = Var("g0") * rows, Var("u")
    t0 = (Var("g1") // split if split > 1 else Var("g1")) * tokens
    part = Var("g1") % split
    kb, T = Var("kb"), Var("T")
    count = gather.count if gather else T  # the tile's tokens are t0 .. count - 1 of those listed

    def source(j: Expr) -> Expr:
        """The activation row of the tile's token j (past the list: its last token's, whose results are not
        stored)."""
        return gather.row(Call("min", j, count - 1)) if gather else j

    def group_scales(j: int, r: Expr, gi: Expr, dec: Decoder, start: int, env: dict) -> list:
        """Weight j's row r, group gi: its scale, and its offset beside it (`scale_stride`)."""
        a = afs[j]
        if a.offset is None:
            return [Store(f"ws{j}", r * (chunk // a.group) + gi, dec.group_expr(a.scale, start, env))]
        at = r * scale_stride(chunk // a.group, True) + gi * 2
        return [Store(f"ws{j}", at, dec.group_expr(a.scale, start, env)),
                Store(f"ws{j}", at + 1, dec.group_expr(a.offset, start, env))]

    def token_scales(tg: Expr, g: Expr, dx: Expr, total: Expr) -> list:
        """Token tg's activation group g (gx codes): its scale dx and, with offsets, dx times its code sum `total`
        beside it, at [group][token] (`token_stride`)."""
        if not offsets:
            return [Store("xds", g * xst + tg, dx)]
        return [Let("xdv", dx), Store("xds", g * xst + tg * TOKEN_WORDS, Var("xdv")),
                Store("xds", g * xst + tg * TOKEN_WORDS + 1, Var("xdv") * ToF32(total))]

    def decode(j: int, s: int) -> list:
        """Weight j's levels (f16: values) and group scales of sub-chunk s of K step kb into its local arrays."""
        wf, a, w = wfs[j], afs[j], f"w{j}"
        bs, rb = wf.block_size, elements_per_row_bytes(fmts[j], k)
        per = max(1, chunk // bs)  # blocks in a chunk (1 where a chunk is part of a block)
        r, q = u // per, u % per
        if bs <= chunk:
            block, lo, hi = (kb * big + s * chunk) // bs + q, 0, bs
            at = q * bs  # where the block starts in the chunk
        else:
            block, lo, hi = kb, s * chunk, s * chunk + chunk
            at = Const(-lo)
        dec = Decoder(wf, w, Var(f"w{j}_wb"), f"w{j}_")

        def group(start, size, env, inner):
            if a is None:
                return inner
            return [*inner, *group_scales(j, r, (at + start) // a.group, dec, start, env)]

        def element(c, L, i0, env, lw):
            return [Store(f"wl{j}", r * chunk + at + c + Var(i0), dec.value(lw) if a is None else lw.expr(a.level))]

        row = Call("min", row0 + r, Const(n - 1))  # rows past n decode row n - 1: their results are not stored
        if gather:
            row = gather.first + row
        return [LaneFor(u.name, Const(rows * per), (
            Let(f"w{j}_wb", row * rb + block * block_stride(wf)),
            *dec.walk(group, element, lo, hi),
        ))]

    def decode_words(j: int, s: int, v: Expr) -> list:
        """Unit v of weight j's staging of sub-chunk s (words mode): `share` units a row's block, each a run of
        its words, each word four levels straight from one 4-byte load (`_matvec._vec_level`, the int8 matvec's
        packing) into the operand tile; the units with sub 0 store the groups' scales and offsets."""
        wf, a, w = wfs[j], afs[j], f"w{j}"
        bs, rb = wf.block_size, elements_per_row_bytes(fmts[j], k)
        per, share = max(1, chunk // bs), word_share(j)
        parts = per * share  # units a row
        if 1 < parts <= 4 and rows % 8 == 0:
            # Eight neighbouring lanes take eight rows' same part (their 16-byte stores in distinct banks, where
            # a row's parts side by side would share them); a warp still reads the same rows' bytes.
            r, p = v // (8 * parts) * 8 + v % 8, v // 8 % parts
        else:
            r, p = v // parts, v % parts
        q, sub = (p // share if per > 1 else Const(0)), (p % share if share > 1 else Const(0))
        if bs <= chunk:
            block, lo, hi = (kb * big + s * chunk) // bs + q, 0, bs
            at, at_w = q * bs, q * (bs // 4)  # where the block starts in the chunk: elements, words
        else:
            block, lo, hi = kb, s * chunk, s * chunk + chunk
            at, at_w = Const(-lo), Const(-lo // 4)
        base = Var(f"{w}_wb")
        dec = Decoder(wf, w, base, f"{w}_", word_loads=True)

        biases: dict[int, int] = {}  # u8f16: each element chunk's level bias (level = byte - bias)

        def group(start, size, env, inner):
            ng, gi = chunk // a.group, (at + start) // a.group
            if u8f16:
                # value = S * (byte - bias) + M: the word holds f16 S and f16 (M - S * bias).
                bias = {b for c, b in biases.items() if start <= c < start + size}
                assert len(bias) == 1, f"{wf.name}: one level bias a group"
                scale, off = dec.group_expr(a.scale, start, env), Const(0.0)
                if a.offset is not None:
                    off = dec.group_expr(a.offset, start, env)
                b = bias.pop()
                off = off - Var(f"{w}_gs") * float(b) if b else off
                out = [Let(f"{w}_gs", scale), Store(f"wsm{j}", r * ng + gi, Call("f32_to_f16_bits", Var(f"{w}_gs"))
                                                    | (Call("f32_to_f16_bits", off) << 16))]
            else:
                out = group_scales(j, r, gi, dec, start, env)
            return [*inner, If(sub.eq(0), tuple(out))] if share > 1 else [*inner, *out]

        def element(c, L, i0, env, lw):
            word, bias = _vec_level(wf, w, lw, a.level, i0, base)
            if u8f16:
                word, bias = unsigned_levels(word, bias, wf, lw, a.level)
                biases[c] = bias
                return [Store(f"wa{j}", r * st + at_w + c // 4 + Var(i0), word)]
            return [Store(f"wa{j}", r * st + at_w + c // 4 + Var(i0), signed_bytes(word, bias) if bias else word)]

        row = Call("min", row0 + r, Const(n - 1))  # rows past n decode row n - 1: their results are not stored
        if gather:
            row = gather.first + row
        body = [Let(base.name, row * rb + block * block_stride(wf)),
                *dec.walk(group, element, lo, hi, wide=4, split=(sub, share, True))]
        return realign(body, w, {base: min(ALIGN_MAX, block_stride(wf) & -block_stride(wf))}, None, {})

    def word_share(j: int) -> int:
        """Units a row's block in words mode: a power of two dividing the words of the decoder's element chunks,
        as many as keep the units of weight j within the group's lanes."""
        wf = wfs[j]
        words_c, units = chunk_len(wf, finest_group(wf)) // 4, rows * max(1, chunk // wf.block_size)
        share = 1
        while words_c % (share * 2) == 0 and units * share * 2 <= lanes:
            share *= 2
        return share

    def activation_words(s: int, v: Expr) -> list:
        """Unit v of the activations' staging of sub-chunk s (words mode): one token's group of gx codes, its
        words copied into the operand tile, its scale, and (with offsets) its code sum taken from the words in
        registers; zero past the tile's tokens."""
        e0 = kb * big + s * chunk
        ng, gw = chunk // gx, gx // 4
        tg, g = v // ng, v % ng
        live = t0 + tg < count
        # Past the tokens the loads read the last one's codes (unconditional loads: merged into vector loads).
        src = source(t0 + tg) if gather else Call("min", t0 + tg, count - 1)
        at = src * (k // 4) + e0 // 4 + g * gw  # a multiple of gw words: k, chunk multiples of 32
        wide = min(4, gw & -gw)  # the first word of each 16 bytes promised 16-byte aligned: one vector load
        out, total = [], Const(0)
        for x in range(gw):
            word = Var(f"xw{x}")
            out += [Let(f"xr{x}", Load("xq", at + x, wide if x % wide == 0 else 1)),
                    Let(word.name, Select(live, Var(f"xr{x}"), Cast("u32", 0))),
                    Store("xb", tg * st + g * gw + x, word)]
            total = Call("dot4_i8", Cast("u32", Const(0x01010101)), word, total)
        return out + token_scales(tg, g, Select(live, Load("xd", source(t0 + tg) * (k // QB) + (e0 + g * gx) // QB),
                                                Const(0.0)), total)

    def activation_halves(s: int, v: Expr) -> list:
        """Unit v of the activations' staging of sub-chunk s (u8f16): one token's HALF_UNIT values of x as f16
        pairs in the operand tile (16-byte loads); zero past the tile's tokens."""
        e0 = kb * big + s * chunk
        per = chunk // HALF_UNIT
        tg, g = v // per, v % per
        live = t0 + tg < count
        src = source(t0 + tg) if gather else Call("min", t0 + tg, count - 1)
        at = src * k + e0 + g * HALF_UNIT  # a multiple of 16 values: k and chunk are multiples of 32
        out = []
        for x in range(HALF_UNIT // 2):
            # Unconditional loads (merged into vector loads), the word zeroed past the tokens.
            pair = [Load("x", at + 2 * x + h, 4 if (2 * x + h) % 4 == 0 else 1) for h in range(2)]
            word = Cast("u32", bits(pair[0]) | (bits(pair[1]) << 16))
            at_w = g * (HALF_UNIT // 2) + x // 2 + x % 2 * 4  # u8f16's B order (`ir.kernel.TileMMA`)
            out += [Let(f"xh{x}", word), Store("xb", tg * stb + at_w, Select(live, Var(f"xh{x}"), Cast("u32", 0)))]
        return out

    def staged(s: int) -> LaneFor:
        """Words mode: one lane loop stages every operand of sub-chunk s (one barrier after it), the weights'
        units first, then the activations'."""
        parts = [(rows * max(1, chunk // wfs[j].block_size) * word_share(j), lambda v, j=j: decode_words(j, s, v))
                 for j in range(len(fmts))]
        if u8f16:
            parts.append((tokens * (chunk // HALF_UNIT), lambda v: activation_halves(s, v)))
        else:
            parts.append((tokens * (chunk // gx), lambda v: activation_words(s, v)))
        ends = [sum(n for n, _ in parts[:p + 1]) for p in range(len(parts))]
        starts = [0, *ends[:-1]]
        body: tuple = ()
        for p in range(len(parts) - 1, -1, -1):
            v = Var(f"v{p}")
            part = (Let(v.name, u - starts[p]) if starts[p] else Let(v.name, u), *parts[p][1](v))
            body = (If(u < ends[p], part, body),) if body else part
        return LaneFor(u.name, Const(ends[-1]), body)

    def bits(v: Expr) -> Expr:
        return Call("f32_to_f16_bits", v)

    def pack(src: str, dst: str) -> LaneFor:
        """The levels (f16 values) of `src` (rows of `chunk`) packed into words of `dst` (rows of `st` words)."""
        per_row = chunk // pack_n
        r, w = u // per_row, u % per_row
        at = r * chunk + w * pack_n
        if half:
            word = bits(Load(src, at)) | (bits(Load(src, at + 1)) << 16)
        else:
            word = Cast("u32", Load(src, at) & 255)
            for e in range(1, 4):
                word = word | (Cast("u32", Load(src, at + e) & 255) << (8 * e))
        return LaneFor(u.name, Const(rows * per_row), (Store(dst, r * st + w, word),))

    def activations(s: int) -> list:
        """The tile's tokens' operand words (int8: with their scales and, with offsets, code sums) for sub-chunk s;
        zero past T."""
        e0 = kb * big + s * chunk  # first element of the chunk
        per_row = chunk // pack_n
        tk, w = u // per_row, u % per_row
        live = t0 + tk < count
        if half:
            at = source(t0 + tk) * k + e0 + w * 2
            word = bits(Load("x", at)) | (bits(Load("x", at + 1)) << 16)
        else:
            word = Load("xq", source(t0 + tk) * (k // 4) + e0 // 4 + w)
        word = Select(live, word, Cast("u32", 0))
        words = LaneFor(u.name, Const(tokens * per_row), (Store("xb", tk * st + w, word),))
        if half:
            return [words]
        ng = chunk // gx
        tg, g = u // ng, u % ng
        live = t0 + tg < count
        total = Const(0)
        for x in range(gx // 4 if offsets else 0):
            total = Call("dot4_i8", Cast("u32", Const(0x01010101)), Load("xb", tg * st + g * (gx // 4) + x), total)
        dx = Select(live, Load("xd", source(t0 + tg) * (k // QB) + (e0 + g * gx) // QB), Const(0.0))
        return [words, LaneFor(u.name, Const(tokens * ng), tuple(token_scales(tg, g, dx, total)))]

    def products(j: int) -> list:
        """Weight j's tile products over the chunk into fragment f{j}: f16 at once; int8 a group at a time, scaled."""
        a = afs[j]
        if a is None:
            return [TileMMA(f"f{j}", "f16", f"wa{j}", Const(0), st, "xb", Const(0), st, chunk // 2)]
        if u8f16:
            return [TileMMA(f"f{j}", "u8f16", f"wa{j}", Const(0), st, "xb", Const(0), stb, chunk // 4,
                            scales=f"wsm{j}", scale_stride=chunk // a.group, group_words=a.group // 4)]
        ng, gw = chunk // a.group, a.group // 4
        i, jj, gi = Var("i"), Var("jj"), Var("gi")
        first = gi * (a.group // gx)  # the group's first activation group (its scale: one a weight group)
        dx = Load("xds", first * xst + jj * (TOKEN_WORDS if offsets else 1))
        if a.offset is None:
            value = FragElem(f"f{j}") + dx * (Load(f"ws{j}", i * ng + gi) * ToF32(FragElem("iacc")))
        else:
            # + dx * (S * isum) + M * (dx * xsum): the activations' dx * xsum staged beside dx, the weights' M beside
            # S (a multiply and two multiply-adds an element).
            at = i * scale_stride(ng, True) + gi * 2
            dxs = Load("xds", first * xst + jj * TOKEN_WORDS + 1)
            for x in range(1, a.group // gx):
                dxs = dxs + Load("xds", (first + x) * xst + jj * TOKEN_WORDS + 1)
            value = (FragElem(f"f{j}") + dx * (Load(f"ws{j}", at) * ToF32(FragElem("iacc")))
                     + Load(f"ws{j}", at + 1) * dxs)
        group = (TileMMA("iacc", "i8", f"wa{j}", gi * gw, st, "xb", gi * gw, st, gw),
                 TileEach("i", "jj", (FragSet(f"f{j}", value), FragSet("iacc", Const(0)))))
        if unroll:
            return [substitute(s, gi.name, Const(g)) for g in range(ng) for s in group]
        return [For(gi.name, Const(0), Const(ng), group)]

    step: list = []
    for s in range(big // chunk):
        if ablate != "staging":
            if words:
                step.append(staged(s))
            else:
                for j in range(len(fmts)):
                    step += decode(j, s)
                    step.append(pack(f"wl{j}", f"wa{j}"))
                step += activations(s)
        if ablate != "products":
            for j in range(len(fmts)):
                step += products(j)
    vals = [FragElem(f"f{j}") for j in range(len(fmts))]
    out = epilogue(vals) if epilogue else vals[0]
    row, t = row0 + Var("i"), t0 + Var("jj")
    clear = tuple(FragSet(f"f{j}", Const(0.0)) for j in range(len(fmts)))
    first, steps = Const(0), Const(k // big)
    if gather:  # a tile past the list's tokens takes no step (its group still runs: the grid covers T tokens)
        steps = Select(t0 < count, steps, Const(0))
    if split > 1:  # part p takes K steps [p * per, (p + 1) * per) of the k // big
        per = -(-(k // big) // split)
        first, steps = part * per, Call("min", Const(k // big), part * per + per)
        stores = tuple(Store("yp", (((slot + j) * split + part) * T + t) * n + row, vals[j])
                       for j in range(len(fmts)))
    else:
        stores = (Store("y", (gather.out(t) if gather else t) * n + row, out),)
    body = (
        *(gather.lets if gather else ()),
        TileEach("i", "jj", clear if half or u8f16 else (FragSet("iacc", Const(0)), *clear)),
        For(kb.name, first, steps, tuple(step)),
        TileEach("i", "jj", (If((row < n) & (t < count), stores),)),
    )
    local = operand_arrays(fmts, rows, tokens, chunk, words, u8f16)
    assert deal in ("rows", "cols", "blocks"), deal
    deal = "rows" if u8f16 else deal
    frags = tuple(Fragment(f"f{j}", "f32", rows, tokens, deal) for j in range(len(fmts)))
    if not (half or u8f16):
        frags = (Fragment("iacc", "i32", rows, tokens, deal), *frags)
    acts = (Buf("x", "f32"),) if half or u8f16 else (Buf("xq", "u32"), Buf("xd", "f32"))
    params = (*acts, *(gather.params if gather else ()), *(Buf(f"w{j}", weight_dtype(f)) for j, f in enumerate(fmts)),
              Buf("yp" if split > 1 else "y", "f32", out=True), Scalar("T"))
    grid = (Const(-(-n // rows)), step_gate((T + (tokens - 1)) // tokens * split, gate),
            *((gather.groups,) if gather else ()))
    knobs = (("mma_rows", rows), ("mma_tokens", tokens), ("mma_chunk", chunk), ("mma_lanes", lanes),
             ("mma_words", int(words)), *((("mma_split", split),) if split > 1 else ()),
             *((("mma_unroll", 1),) if unroll else ()), *((("mma_f16", 1),) if u8f16 else ()),
             *((("mma_deal", deal),) if deal != "rows" else ()),
             *((("mma_ablate", ablate),) if ablate != "none" else ()))
    return Kernel(name, params, grid, body, lanes=lanes, local=tuple(local), knobs=knobs, fragments=frags,
                  doc=f"tile matmul {'f16' if half else 'u8f16' if u8f16 else 'int8'} {'+'.join(f.name for f in fmts)} "
                      f"[{n}x{k}]")


@kernel_builder
def split_sum_kernel(name: str, n: int, parts: int, lanes: int, weights: int = 1,
                     epilogue: Callable[[list[Expr]], Expr] | None = None,
                     gate: Gate | tuple[Gate, ...] | None = None) -> Kernel:
    """y[t, r] = epilogue(sum over p of yp[((j * parts + p) * T + t) * n + r] for each weight j): the parts of a
    `tile_mma_kernel` of split K added up (in order of p, so a token's result does not depend on the others in its
    step). Grid (T, ceil(n / lanes)), a row a lane; `gate`: the steps it runs for (`tile_matmul.step_gate`)."""
    t, r = Var("g0"), Var("g1") * lanes + Var("u")
    vals = []
    for j in range(weights):
        total = Load("yp", (j * parts * Var("T") + t) * n + r)
        for p in range(1, parts):
            total = total + Load("yp", ((j * parts + p) * Var("T") + t) * n + r)
        vals.append(total)
    out = epilogue(vals) if epilogue else vals[0]
    body = (LaneFor("u", Const(lanes), (If(r < n, (Store("y", t * n + r, out),)),)),)
    params = (Buf("yp", "f32"), Buf("y", "f32", out=True), Scalar("T"))
    return Kernel(name, params, (step_gate(Var("T"), gate), Const(-(-n // lanes))), body, lanes=lanes,
                  doc=f"sum of {parts} K parts x {weights} [{n}]")

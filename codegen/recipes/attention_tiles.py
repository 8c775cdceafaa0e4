"""Prefill attention in tiles (FlashAttention's schedule): a group per (tile of query rows, query head) walks the keys
its rows see in tiles, each K and V value decoded once into local memory for all the tile's rows, with the online
softmax (a running max, denominator and output per row, rescaled as each key tile arrives).

The one-row kernel (`attention.attention_kernel`) has a group per (token, head) and decodes every visible key for
each token: at a prompt of T tokens each K/V value is read about T/2 times. Here it is read T / `q_tile` / 2 times,
and nothing depends on the context's length (no scores of the whole context in local memory, no split-K).

Rows of several sequences in one step (batched decoding) are allowed: each row sees the cache rows of its own
sequence (`starts[t] + lo .. starts[t] + positions[t]`). A tile whose rows share one start takes its keys in one
pass over the union of their ranges (masked per row); otherwise it takes one pass a sequence (a start), over the
union of its rows' ranges, the other rows masked (their running state passes through unchanged): a step of many
short prompts joining at once has a few sequences a tile, not a pass for each of its rows.

The tile products (q . k over the head, p . v over the key tile) are loops over local memory in f32, or with `mma`
the kernel IR's tile products (`ir.kernel.TileMMA`, f16 x f16 -> f32: tensor cores, MFMA, WMMA where the target
has them, the same loops elsewhere): q rows (rounded to f16 once a tile), K rows (decoded to f16) and the
probabilities (rounded to f16) packed two to a word, V packed transposed (a word holds two keys of one value
column); the scores S = Q K^T go through a fragment of q_tile x k_tile, the output through dv / k_tile fragments of
the same shape (the IR's fragments share one shape), rescaled in place as each key tile arrives. The softmax stays
a loop over rows in local memory (reductions along a fragment's rows are not a construct of the IR).
"""

from __future__ import annotations

from collections.abc import Callable

from polystrata.codegen.dequant import Decoder, word_codes
from polystrata.codegen.format_analysis import block_stride
from polystrata.codegen.recipes import kernel_builder
from polystrata.ir.expr import Const, Expr, Var
from polystrata.ir.formats import QuantFormat
from polystrata.ir.kernel import (
    Assign,
    Buf,
    Call,
    Cast,
    Decl,
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
    Reduce,
    Scalar,
    Select,
    Store,
    TileEach,
    TileMMA,
)

# A masked score, and the running max before any key: finite, so that exp(m_old - m_new) is 1, not NaN, while a
# row has seen no key (its denominator and output stay 0).
NO_SCORE = -1.0e30
# Steps of more rows than this take the tiles; shorter ones (short prompts, batched decoding: a row a sequence)
# keep the one-row kernels, whose groups are a row each (more of them at work) and whose rows do not depend on
# each other (a sequence decodes to the same bits whichever sequences share its step).
TILES_ABOVE = 64
# Local memory left for a lane-lowered reduction's scratch (a float a lane): the tiles take the rest of what the
# target's policy offers a group (`Policy.local_bytes`).
REDUCE_LOCAL_BYTES = 4 << 10
# Tile sizes tried in order (rows, keys): the first whose local arrays fit.
TILE_CHOICES = ((16, 32), (16, 16), (8, 32), (8, 16), (4, 16), (4, 8), (2, 8), (1, 8))


# Tile sizes of the tile products (`mma`) tried in order: 16 rows and keys are what every matrix unit's tile divides
# (cuda's m16n8, MFMA's and WMMA's 16x16), and a K step of 16 (the f16 instructions') divides the key tile.
MMA_TILE_CHOICES = ((16, 32), (16, 16))
PAD = 4  # words of padding after each packed operand row (as tile_mma's: a warp's fragment loads in distinct banks)


def tile_local_bytes(d: int, dv: int, q_tile: int, k_tile: int, mma: bool = False, registers: bool = False) -> int:
    """Bytes of local memory `prefill_attention_kernel` takes for these tiles; with `mma` the tile products' layout,
    whose fragments are in local memory too unless the target keeps them in `registers` (a matrix unit)."""
    if not mma:
        return 4 * (k_tile * (d + 1 + dv) + q_tile * (k_tile + 1) + q_tile * dv + 5 * q_tile)
    words = q_tile * (d // 2 + PAD) + k_tile * (d // 2 + PAD) + dv * (k_tile // 2 + PAD) + q_tile * (k_tile // 2 + PAD)
    frags = 0 if registers else q_tile * (k_tile + dv)
    return 4 * (words + q_tile * (k_tile + 1) + 5 * q_tile + frags) + 2 * k_tile * max(d, dv)


def mma_fits(d: int, dv: int, k_tile: int) -> bool:
    """Whether the tile products take heads of d (K) and dv (V) values with key tiles of k_tile: f16 pairs of the
    head and of the key tile, and the output's columns a whole number of fragments."""
    return d % 2 == 0 and k_tile % 2 == 0 and dv % k_tile == 0


def default_tiles(d: int, dv: int, local_bytes: int, mma: bool = False,
                  registers: bool = False) -> tuple[int, int] | None:
    """(q_tile, k_tile): the first of TILE_CHOICES (with `mma`, MMA_TILE_CHOICES that `mma_fits`) whose local
    arrays fit a group's `local_bytes` (less what a reduction takes); None where no tile-product tiles fit."""
    choices = [c for c in MMA_TILE_CHOICES if mma_fits(d, dv, c[1])] if mma else TILE_CHOICES
    room = local_bytes - REDUCE_LOCAL_BYTES
    return next((c for c in choices if tile_local_bytes(d, dv, *c, mma, registers) <= room), None)


@kernel_builder
def prefill_attention_kernel(name: str, kf: QuantFormat, vf: QuantFormat, hq: int, hkv: int, d: int, dv: int,
                             scaled: Callable[[Expr], Expr], window: int, lanes: int, q_tile: int,
                             k_tile: int, active: Expr | None = None, mma: bool = False, splits: int = 1) -> Kernel:
    """out[t, h] = softmax over t's visible keys of scaled(q . k) times v, for every row t of the step; grid
    (ceil(T / q_tile), hq). `kf`, `vf`: the KV cache's block formats for K and V rows; `scaled(x)`: the score of a
    raw dot product (scale, softcap); `window`: keys within that many positions (0: all). Reductions are over f32,
    so the key ranges and starts they take are exact below 2**24. `active` (uniform, of scalars): the steps the
    kernel works for; in others it takes no pass over the keys and stores nothing (no branch around the body: PoCL
    mishandles barriers inside one). `mma`: the tile products (module docstring; `mma_fits`). `splits` > 1: the key
    tiles of each pass dealt to that many groups (grid dimension g2, part g2 taking an equal share of the tiles),
    each writing its rows' unnormalised output, running max and denominator to po / pm / pz at row
    (t * hq + h) * splits + g2, as `attention.attention_combine_kernel` reads them (a part without keys for a row:
    max NO_SCORE, the rest 0)."""
    if mma and not mma_fits(d, dv, k_tile):
        raise ValueError(f"tile products take no heads of {d}/{dv} values in key tiles of {k_tile}")
    bq, bk = q_tile, k_tile
    g = hq // hkv
    t0, h = Var("g0") * bq, Var("g1")
    kvh = h // g
    krb = hkv * d // kf.block_size * block_stride(kf)
    vrb = hkv * dv // vf.block_size * block_stride(vf)
    r, j, u, e = Var("r"), Var("j"), Var("u"), Var("e")
    # Rows of the K tile and of the scores one value longer than they hold: lanes reading down a column (the
    # keys of the scores' lanes, the rows of the softmax's) then hit different local-memory banks.
    ks_row, s_row = d + 1, bk + 1
    tr = Call("min", t0 + r, Var("T") - 1)  # row r's token (clamped: rows past T are masked)

    def stage(buf: str, fmt: QuantFormat, width: int, stride: int, rb: int, dst: str, prefix: str) -> LaneFor:
        """Decode the tile's key rows of cache `buf` (blocks of `fmt`, `width` values a head) into local `dst`
        (rows `stride` apart); rows past the last key hold 0."""
        if word_codes(fmt):
            return stage_words(buf, fmt, width, stride, rb, dst, prefix)
        nb = width // fmt.block_size
        dec = Decoder(fmt, buf, Var(f"{prefix}row") * rb + (kvh * nb + Var(f"{prefix}b")) * block_stride(fmt), prefix)

        block = Var(f"{prefix}j") * stride + Var(f"{prefix}b") * fmt.block_size  # the block's first value in dst

        def chunk(c, L, i0, env, lw) -> list:
            return [Store(dst, block + (c + Var(i0)), dec.value(lw))]

        # Past the last key nothing is read (those cache rows may lie beyond the buffer): the block's values are 0.
        zero = For(f"{prefix}z", Const(0), Const(fmt.block_size), (Store(dst, block + Var(f"{prefix}z"), Const(0.0)),))
        return LaneFor(f"{prefix}u", Const(bk * nb), (
            Let(f"{prefix}j", Var(f"{prefix}u") // nb), Let(f"{prefix}b", Var(f"{prefix}u") % nb),
            Let(f"{prefix}row", Var("kb0") + Var(f"{prefix}j")),
            If(Var(f"{prefix}row") <= Var("kmax"), tuple(dec.walk(lambda s0, sz, env, inner: inner, chunk)), (zero,)),
        ))

    def stage_words(buf: str, fmt: QuantFormat, width: int, stride: int, rb: int, dst: str, prefix: str) -> LaneFor:
        """`stage` for codes in aligned words (`dequant.word_codes`: split rows): a lane a word of a key row, 4
        values from one load, the scales as words (the word's group's picked at run time)."""
        nw, nb = width // 4, width // fmt.block_size
        w, row = Var(f"{prefix}w"), Var(f"{prefix}row")
        block = kvh * nb + w * 4 // fmt.block_size if nb > 1 else kvh
        dec = Decoder(fmt, buf, row * rb + block * block_stride(fmt), prefix, word_loads=True)
        lets, envs = dec.group_lets()
        load, values = dec.code_words(w * 4 % fmt.block_size if nb > 1 else w * 4, envs, f"{prefix}wd")
        at = Var(f"{prefix}j") * stride + w * 4  # the word's first value in dst
        return LaneFor(f"{prefix}u", Const(bk * nw), (
            Let(f"{prefix}j", Var(f"{prefix}u") // nw), Let(w.name, Var(f"{prefix}u") % nw),
            Let(row.name, Var("kb0") + Var(f"{prefix}j")),
            # Past the last key nothing is read (those cache rows may lie beyond the buffer): the values are 0.
            If(row <= Var("kmax"), (*lets, *load, *(Store(dst, at + k if k else at, v) for k, v in enumerate(values))),
               tuple(Store(dst, at + k if k else at, Const(0.0)) for k in range(4))),
        ))

    # Per pass: which rows take part (all in one pass where the rows share a start, else the rows of row `ps`'s
    # sequence, unless an earlier row of the tile is of it: that pass took them), their key ranges into rlo / rhi
    # (an empty range for the others), and the union of the ranges.
    same = Load("starts", tr).eq(Load("starts", t0 + Var("ps")))
    in_pass = (Var("uni") > 0) | (same & (Var("seen_seq") < 0.5))
    lo = Load("starts", tr) + (Call("max", Const(0), Load("positions", tr) - (window - 1)) if window else Const(0))
    ranges = LaneFor("r", Const(bq), (
        Let("row_on", (t0 + r < Var("T")) & in_pass),
        Store("rlo", r, Select(Var("row_on"), lo, Const(1 << 30))),
        Store("rhi", r, Select(Var("row_on"), Load("starts", tr) + Load("positions", tr), Const(-1))),
    ))

    def softmax(keep: Callable[[Expr, list[Expr]], tuple[list, Expr]], step: int) -> LaneFor:
        """The online softmax of a key tile, a row a lane: the tile's max, the row's new running max, the
        probabilities of keys j .. j + step - 1 handed to `keep(j, ps)` (which returns the statements keeping them
        for the product with V and what they add to the denominator), the old state's correction into c."""
        ps = [Var(f"pv{x}") for x in range(step)]
        probs = []
        for x in range(step):
            sv = Load("s", r * s_row + j + x)
            probs.append(Let(ps[x].name, Select(sv > NO_SCORE / 2, Call("exp", sv - Var("mn")), Const(0.0))))
        stmts, added = keep(j, ps)
        return LaneFor("r", Const(bq), (
            Decl("mt", "f32", Const(NO_SCORE)),
            For("j", Const(0), Const(bk), (Assign("mt", Call("max", Var("mt"), Load("s", r * s_row + j))),)),
            Let("mo", Load("m", r)),
            Let("mn", Call("max", Var("mo"), Var("mt"))),
            Decl("ls", "f32", Const(0.0)),
            For("j", Const(0), Const(bk), (*probs, *stmts, Assign("ls", Var("ls") + added)), step=step),
            Let("corr", Call("exp", Var("mo") - Var("mn"))),
            Store("l", r, Load("l", r) * Var("corr") + Var("ls")),
            Store("m", r, Var("mn")),
            Store("c", r, Var("corr")),
        ))

    rows = Call("min", Const(bq), Var("T") - t0)
    working = Const(1) > 0 if active is None else active
    stored = (t0 + r < Var("T")) & working
    frags: tuple = ()
    if not mma:
        scores = LaneFor("u", Const(bq * bk), (
            Let("r", u // bk), Let("j", u % bk), Let("kj", Var("kb0") + j),
            Decl("sc", "f32", Const(NO_SCORE)),
            If((Var("kj") >= Load("rlo", r)) & (Var("kj") <= Load("rhi", r)), (
                Decl("dot", "f32", Const(0.0)),
                For("e", Const(0), Const(d), (
                    Assign("dot", Var("dot") + Load("q", (tr * hq + h) * d + e) * Load("ks", j * ks_row + e)),),
                    unroll=4),
                Assign("sc", scaled(Var("dot"))),
            )),
            Store("s", r * s_row + j, Var("sc")),
        ))
        pv = LaneFor("u", Const(bq * dv), (
            Let("r", u // dv), Let("e", u % dv),
            Decl("acc", "f32", Load("o", u) * Load("c", r)),
            For("j", Const(0), Const(bk), (
                Assign("acc", Var("acc") + Load("s", r * s_row + j) * Load("vs", j * dv + e)),), unroll=4),
            Store("o", u, Var("acc")),
        ))
        per_tile = (stage("kc", kf, d, ks_row, krb, "ks", "k_"), stage("vc", vf, dv, dv, vrb, "vs", "v_"), scores,
                    softmax(lambda j, ps: ([Store("s", r * s_row + j, ps[0])], ps[0]), 1), pv)
        init = (LaneFor("u", Const(bq * dv), (Store("o", u, Const(0.0)),)),)
        finish = (LaneFor("u", Const(bq * dv), (
            Let("r", u // dv), Let("e", u % dv),
            If(stored, (Store("out", ((t0 + r) * hq + h) * dv + e, Load("o", u) / Load("l", r)),)),
        )),)
        local = (LocalArray("ks", "f32", bk * ks_row), LocalArray("vs", "f32", bk * dv),
                 LocalArray("o", "f32", bq * dv))
    else:
        # Packed operands (rows of f16 pairs, PAD words longer): q rows (qa), K rows (ka), probabilities (pa), V
        # transposed (vt: a row per value column, a word two keys); K and V decoded through `kh` in f16.
        qst, kst, pst, vst = d // 2 + PAD, d // 2 + PAD, bk // 2 + PAD, bk // 2 + PAD
        outs = [f"o{c}" for c in range(dv // bk)]
        w = Var("w")

        def bits(v: Expr) -> Expr:
            return Call("f32_to_f16_bits", v)

        def pair(lo: Expr, hi: Expr) -> Expr:
            """The word of two f16 values (`lo` in the low half)."""
            return Cast("u32", bits(lo)) | (Cast("u32", bits(hi)) << 16)

        def kv_pack(dst: str, count: int, row: Expr, word: Expr, stride: int, a: Expr, b: Expr) -> LaneFor:
            """Word u of `dst` (at `row` * `stride` + `word`): elements a and b of `kh`."""
            return LaneFor("u", Const(count), (Store(dst, row * stride + word, pair(Load("kh", a), Load("kh", b))),))

        jj, ee = u // (d // 2), u % (d // 2)
        seen = (Var("kb0") + j >= Load("rlo", r)) & (Var("kb0") + j <= Load("rhi", r))  # key kb0 + j in row r's range
        ve, vw = u // (bk // 2), u % (bk // 2)
        per_tile = (
            stage("kc", kf, d, d, krb, "kh", "k_"),
            kv_pack("ka", bk * (d // 2), jj, ee, kst, jj * d + 2 * ee, jj * d + 2 * ee + 1),
            stage("vc", vf, dv, dv, vrb, "kh", "v_"),
            kv_pack("vt", dv * (bk // 2), ve, vw, vst, 2 * vw * dv + ve, (2 * vw + 1) * dv + ve),
            TileMMA("sf", "f16", "qa", Const(0), qst, "ka", Const(0), kst, d // 2),
            TileEach("r", "j", (
                Store("s", r * s_row + j, Select(seen, scaled(FragElem("sf")), Const(NO_SCORE))),
                FragSet("sf", Const(0.0)),
            )),
            softmax(lambda j, ps: ([Let("h0", bits(ps[0])), Let("h1", bits(ps[1])),
                                    Store("pa", r * pst + j // 2, Var("h0") | (Var("h1") << 16))],
                                   Call("f16_bits_to_f32", Var("h0")) + Call("f16_bits_to_f32", Var("h1"))), 2),
            TileEach("r", "j", tuple(FragSet(o, FragElem(o) * Load("c", r)) for o in outs)),
            *(TileMMA(o, "f16", "pa", Const(0), pst, "vt", Const(c * bk * vst), vst, bk // 2)
              for c, o in enumerate(outs)),
        )
        init = (
            LaneFor("u", Const(bq * (d // 2)), (
                Let("r", u // (d // 2)), Let("w", u % (d // 2)),
                Store("qa", r * qst + w, pair(Load("q", (tr * hq + h) * d + 2 * w),
                                              Load("q", (tr * hq + h) * d + 2 * w + 1))),
            )),
            TileEach("r", "j", tuple(FragSet(f, Const(0.0)) for f in ("sf", *outs))),
        )
        finish = (TileEach("r", "j", (If(stored, tuple(
            Store("out", ((t0 + r) * hq + h) * dv + c * bk + j, FragElem(o) / Load("l", r)) for c, o in enumerate(outs)
        )),)),)
        local = (LocalArray("qa", "u32", bq * qst), LocalArray("ka", "u32", bk * kst),
                 LocalArray("kh", "f16", bk * max(d, dv)), LocalArray("vt", "u32", dv * vst),
                 LocalArray("pa", "u32", bq * pst))
        frags = tuple(Fragment(f, "f32", bq, bk) for f in ("sf", *outs))
    key_tiles: tuple = (For("kt", Const(0), (Var("kmax") + 1 - Var("kmin") + (bk - 1)) // bk, (
        Let("kb0", Var("kmin") + Var("kt") * bk),
        *per_tile,
    )),)
    if splits > 1:  # this group's share of the pass's key tiles
        part = Var("g2")
        key_tiles = (
            Let("ntk", (Var("kmax") + 1 - Var("kmin") + (bk - 1)) // bk),
            Let("kper", (Var("ntk") + (splits - 1)) // splits),
            For("kt", part * Var("kper"), Call("min", Var("ntk"), part * Var("kper") + Var("kper")), (
                Let("kb0", Var("kmin") + Var("kt") * bk),
                *per_tile,
            )),
        )
        prow = (((t0 + r) * hq + h) * splits + part)  # the partials' row of row r
        if mma:
            finish = (TileEach("r", "j", (If(stored, tuple(
                Store("po", prow * dv + c * bk + j, FragElem(o)) for c, o in enumerate(outs)
            )),)),)
        else:
            finish = (LaneFor("u", Const(bq * dv), (
                Let("r", u // dv), Let("e", u % dv),
                If(stored, (Store("po", prow * dv + e, Load("o", u)),)),
            )),)
        finish += (LaneFor("r", Const(bq), (If(stored, (Store("pm", prow, Load("m", r)),
                                                          Store("pz", prow, Load("l", r)))),)),)
    body = (
        # One pass where the tile's rows share their sequence's start, else one a sequence.
        Reduce("smax", "max", "r", rows, (), Cast("f32", Load("starts", t0 + r))),
        Reduce("sneg", "max", "r", rows, (), Cast("f32", Const(0) - Load("starts", t0 + r))),
        Let("uni", Select((Var("smax") + Var("sneg")).eq(0.0), Const(1), Const(0))),
        *init,
        LaneFor("r", Const(bq), (Store("m", r, Const(NO_SCORE)), Store("l", r, Const(0.0)))),
        For("ps", Const(0), Select(working, Select(Var("uni") > 0, Const(1), rows), Const(0)), (
            # Whether a row before `ps` is of its sequence (rows past T are not: `rows` counts those within).
            Reduce("seen_seq", "max", "r", rows, (), Select((r < Var("ps")) & Load("starts", t0 + r).eq(
                Load("starts", t0 + Var("ps"))), Const(1.0), Const(0.0))),
            ranges,
            Reduce("kneg", "max", "r", Const(bq), (), Cast("f32", Const(0) - Load("rlo", r))),
            Reduce("khi", "max", "r", Const(bq), (), Cast("f32", Load("rhi", r))),
            Let("kmin", Const(0) - Cast("i32", Var("kneg"))),
            Let("kmax", Cast("i32", Var("khi"))),
            *key_tiles,
        )),
        *finish,
    )
    outs_params = (Buf("out", "f32", out=True),) if splits == 1 else \
        (Buf("po", "f32", out=True), Buf("pm", "f32", out=True), Buf("pz", "f32", out=True))
    params = (Buf("q", "f32"), Buf("kc", "u8"), Buf("vc", "u8"), Buf("positions", "i32"), Buf("starts", "i32"),
              *outs_params, Scalar("T"))
    local += (LocalArray("s", "f32", bq * s_row), LocalArray("m", "f32", bq), LocalArray("l", "f32", bq),
              LocalArray("c", "f32", bq), LocalArray("rlo", "i32", bq), LocalArray("rhi", "i32", bq))
    grid = ((Var("T") + (bq - 1)) // bq, Const(hq), *((Const(splits),) if splits > 1 else ()))
    return Kernel(name, params, grid, body, lanes=lanes, local=local, fragments=frags,
                  knobs=(("tiles", 1), ("q_tile", bq), ("k_tile", bk)) + ((("mma", 1),) if mma else ())
                  + ((("tile_splits", splits),) if splits > 1 else ()))

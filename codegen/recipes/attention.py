"""`attention`: write this step's K and V into the layer's KV cache, then causal (windowed, GQA) attention.

The cache rows are kept as the target's policy says (`kv_layouts`): in the KV format's own blocks, or on
wide-load targets q8_0 and q8_g64 head rows split into codes and scales (`ir.layout.split_rows`), whose codes the
kernels read a word of 4 a load (`dequant.word_codes`). Same bytes a row either way.

Launch 1 (`kv_store_kernel`): grid (T, 2 * n_head_kv), a group per K or V head, its lanes encoding the head's
scale groups of the KV format from its description (`kv_encode`): one-element formats (f16) store converted bits;
symmetric formats whose code is a bare signed-byte field and whose step is an f16 field (q8_0, q8_g64) store
d = max|x| / |anchor| as f16 and codes round(x / d) clipped to the anchor. Recipes `rope_attention` and
`norm_rope_attention` fuse the ropes of q and k (and qwen3's per-head q/k RMS norms before them) into this
launch: n_head more groups rope q into the rope's output, and the K groups rope K on its way into the cache.

Launch 2 (`attn`): grid (T, n_head / heads); two-pass softmax with the scores of the visible keys in local memory
(room for a run's: the key span / splits): scores (K decoded block by block; with lanes, keys in tiles, `kparts`
lanes per key adding their shares of the dot product through a local array), Reduce max, LaneFor exp, Reduce
sum, then a LaneFor over (V block, part) accumulates p_j * v_j, `parts` lanes sharing a block (`Decoder.walk`'s
split; with one element a lane, in registers, else into a local output row; split rows: a word of the V row a
lane, in registers, lanes sharing a word by phases of the keys; and where the target has an int8 dot product,
knob `int8`, the scores take q quantized to int8 per 32 values, a K word against a q word in one `dot4_i8`).
Knob `heads` (GQA): a group takes
that many query heads of one KV head, each K and V value decoded once for all of them ("auto": what the policy's
`attention.group_heads` says: on the host all of them, one-token plans keeping at least that many groups a token
for the cores to share; on GPUs (0) all of them in one-token plans of contexts longer than LONG_CONTEXT, where
their scores fit GROUP_SCORES).

The kernels depend on the context only through its key span (`key_span`: n_ctx rounded up), so contexts that
differ a little share kernel sources; and however long the context, a GPU group's scores fit local memory (runs of
DECODE_RUN_KEYS keys in one-token plans, longer beyond MAX_DECODE_RUNS runs; at most PREFILL_RUN_KEYS otherwise).

Steps of more than `tiles_above` tokens (knob, "auto": TILES_ABOVE) on GPUs (knob `tiles`, "auto": there, unless
`splits` is set) take launch 2 from `attention_tiles.prefill_attention_kernel` instead: a group per tile of query
rows and head, keys in tiles decoded once for all the rows, the online softmax (knobs `q_tile`, `k_tile`; knob
`mma`, "auto": on targets with matrix units, its products as the kernel IR's tile products). Plans
that serve both kinds of step hold both kernels, each run only for its kind (the row count picks at run time).

Split-K (knob `splits`, "auto": 1 with one lane, else up to 8 by the span, and at least span / PREFILL_RUN_KEYS, in
one-token plans span / DECODE_RUN_KEYS up to MAX_DECODE_RUNS: flash-decoding): one group per head leaves most of a
GPU idle at decode, so launch 2 runs `splits` groups per (token, head), each over its run of the keys (equal shares
of the keys visible at run time, at least knob `min_run` long), writing unnormalised partials (output row, max
score, sum of exponentials) to plan scratch, and launch 3 (`attention_combine_kernel`) rescales and adds those of
the runs holding keys; where the output projection takes int8 activations, the combine writes them too
(`Launch.provides`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from polystrata.codegen.dequant import Decoder, chunk_len, word_codes
from polystrata.codegen.format_analysis import affine, block_stride, finest_group, inline_elem_lets, widen
from polystrata.codegen.policy import Policy
from polystrata.codegen.recipes import Knob, KnobSpace, Recipe, RecipeContext, kernel_builder, register
from polystrata.codegen.recipes._matvec import QB, code_word, round_half_away
from polystrata.codegen.recipes.attention_tiles import TILES_ABOVE, default_tiles, mma_fits, prefill_attention_kernel
from polystrata.codegen.recipes.elementwise import rms_inverse, rope_value, sigmoid
from polystrata.codegen.recipes.linear import quantize_staged, quantized_output, staged, staged_locals
from polystrata.ir.expr import Const, Expr, FieldLoad, Var
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
    stable_digest,
)
from polystrata.ir.layout import code_field

# Split-K in one-token steps on GPUs (flash-decoding): runs enough that none holds more than DECODE_RUN_KEYS keys
# at a full context (llama3-8b at depth 8192: 129 runs of each of its 8 KV heads, 1032 groups), and never fewer
# than 8. A group's time grows with its run's length (its loops over the keys wait on loads), the combine's barely
# with the number of runs: shorter runs won on the H200 (docs/benchmarks.md). Knob `min_run`: no run shorter than
# MIN_RUN_KEYS keys, so a short context keeps few groups at work and the combine few partials.
DECODE_RUN_KEYS = 64
MIN_RUN_KEYS = 8
# ... but at most MAX_DECODE_RUNS runs (longer runs beyond a span of 32768): the groups of runs past the visible
# keys still pass their reductions' barriers, so a 128K context at a short depth would spend more on empty groups
# than the short runs save.
MAX_DECODE_RUNS = 512
# Knob `heads` ("auto"): in one-token GPU plans of a context longer than LONG_CONTEXT a group takes all the query
# heads of a KV head (GQA: 4 on llama3-8b), so each K and V value is read once, not once a head, as long as their
# scores (heads x the longest run) fit GROUP_SCORES floats (16 KiB) of local memory. Shorter contexts keep a group
# a head: reading the cache costs little there, and a group's softmax reductions, one a head, would add up.
LONG_CONTEXT = 4096
GROUP_SCORES = 4096
# Steps of several tokens on GPUs: runs of at most PREFILL_RUN_KEYS keys, so a group's scores (16 KiB of f32) fit
# the local memory of any GPU at any context (a 128K context would need 64 KiB a group with 8 runs).
PREFILL_RUN_KEYS = 4096
# Contexts longer than SPAN_GRANULE keys are rounded up to a multiple of it for the kernels, shorter ones to a power
# of two (`key_span`).
SPAN_GRANULE = 1024


def key_span(n_ctx: int) -> int:
    """The context the attention kernels are made for: `n_ctx` rounded up to a power of two, or beyond
    SPAN_GRANULE to a multiple of it. The kernels serve any context up to their span (runs of keys are worked out
    at run time), so contexts that differ a little compile to the same kernel sources."""
    if n_ctx <= SPAN_GRANULE:
        return 1 << max(n_ctx - 1, 0).bit_length()
    return -(-n_ctx // SPAN_GRANULE) * SPAN_GRANULE


def kv_layouts(fmt: QuantFormat, d: int, dv: int, policy: Policy) -> tuple[QuantFormat, QuantFormat]:
    """How the target keeps the K and V cache rows (heads of `d` and `dv` values) of KV type `fmt`: its own
    blocks, or split into codes and scales (`Policy.kv_layout`). The store and every reader take these."""
    return policy.kv_layout(fmt, d), policy.kv_layout(fmt, dv)


def int8_scores(kf: QuantFormat, d: int) -> bool:
    """Whether scores over K rows of layout `kf` (heads of `d`) can take q as int8 (`attention_kernel`'s
    `int8_q`): codes a byte an element in aligned words (`word_codes`), each value a group scale times its code."""
    a = affine(kf) if word_codes(kf) else None
    qf = code_field(kf)
    return (a is not None and a.offset is None and d % QB == 0 and qf.dtype == "i8"
            and inline_elem_lets(kf, a.level) == FieldLoad(qf.name, Var("i")))


def _kv_fmt(fmt: QuantFormat, d: int) -> QuantFormat:
    """The blocks the readers walk a head row of layout `fmt` in: one-element formats (f16) seen as blocks."""
    return widen(fmt, math.gcd(d, 32)) if fmt.block_size == 1 else fmt


def kv_encode(fmt: QuantFormat, value, dst: Expr, cache: str, group: Expr | None = None) -> list:
    """Statements encoding one group of KV format `fmt` (values `value(e)`, e an Expr, 0 <= e < the scheme's
    group), the `group`-th (None: the only one) of the block at byte `dst` of the cache buffer `cache`: one-element
    formats (f16) store converted bits; symmetric formats whose code is a byte an element and whose step an f16
    field element a group (q8_0, q8_g64, and their `split_rows` layouts) store d = max|x| / |anchor| as f16 and
    codes round(x / d) clipped to the anchor."""
    if fmt.block_size == 1:
        (f,) = fmt.fields
        if f.dtype != "f16":
            raise NotImplementedError(f"KV cache of {fmt.name}")
        return [Let("enc_h", Call("f32_to_f16_bits", value(Const(0)))),
                Store(cache, dst, Var("enc_h") & 255), Store(cache, dst + 1, (Var("enc_h") >> 8) & 255)]
    s, qf = fmt.scheme, code_field(fmt)
    ok = (s is not None and qf is not None and qf.dtype == "i8" and s.min is None and s.step.code is None
          and s.table is None and fmt.field(s.step.field).count * s.group == fmt.block_size)
    if not ok:
        raise NotImplementedError(f"in-kernel encoding of {fmt.name}")
    df = fmt.field(s.step.field)
    a = float(abs(s.anchor))
    e = Var("enc_e")
    step = dst + df.offset if group is None else dst + df.offset + group * (df.nbytes // df.count)
    codes = dst + qf.offset if group is None else dst + qf.offset + group * s.group
    return [
        Decl("enc_amax", "f32", Const(0.0)),
        For("enc_e", Const(0), Const(s.group), (
            Assign("enc_amax", Call("max", Var("enc_amax"), Call("abs", value(e)))),)),
        Let("enc_h", Call("f32_to_f16_bits", Var("enc_amax") / a)),
        Let("enc_dd", Call("f16_bits_to_f32", Var("enc_h"))),
        Let("enc_inv", Select(Var("enc_dd") > 0.0, Const(1.0) / Var("enc_dd"), Const(0.0))),
        Store(cache, step, Var("enc_h") & 255),
        Store(cache, step + 1, (Var("enc_h") >> 8) & 255),
        For("enc_e", Const(0), Const(s.group), (
            Let("enc_v", value(e) * Var("enc_inv")),
            Let("enc_q", Call("max", Const(-int(a)), Call("min", Const(int(a)), round_half_away(Var("enc_v"))))),
            Store(cache, codes + e, (Var("enc_q") + 256) & 255),
        )),
    ]


@kernel_builder
def kv_store_kernel(name: str, kf: QuantFormat, vf: QuantFormat, hq: int, hkv: int, d: int, dv: int, lanes: int,
                    rope: dict | None = None, qk_norm_eps: float | None = None,
                    q_layout: tuple[int, int] | None = None) -> Kernel:
    """This step's K and V rows into the caches (layouts `kf`, `vf`: `kv_layouts`) at row `starts[t] +
    positions[t]` (`starts`: where the token's sequence begins in the cache, 0 but in batched decoding), one group
    per (token, head), a lane per scale group; grid (T, 2 * hkv), K heads first. With `rope` (the rope op's
    attributes) the group also ropes its K head on the way in, and hq more groups first rope the q heads into `qo`
    (the launches of both rope ops, fused). With `qk_norm_eps` each q and K head is RMS-normed (weights `qn`,
    `kn`) before its rope, as qwen3 and gemma3 do. `q_layout` (stride, offset): q head h of token t starts at
    element (t * hq + h) * stride + offset of buffer q (a slice of a wider projection read in place; default
    (d, 0))."""
    t, hd = Var("g0"), Var("g1")
    b = Var("b")

    def store(cache: str, fmt: QuantFormat, width: int, head: Expr, value) -> tuple:
        """Head `head`'s values (`value(j0, e)`: its element j0 + e) encoded a scale group a lane (f16: a value)."""
        bs = fmt.block_size
        gs = fmt.scheme.group if fmt.scheme else 1
        per = bs // gs  # groups a block
        rb = hkv * width // bs * fmt.block_bytes
        block = head * (width // bs) + (b // per if per > 1 else b)
        dst = (Load("starts", t) + Load("positions", t)) * rb + block * fmt.block_bytes
        enc = kv_encode(fmt, lambda e: value(b * gs, e), dst, cache, b % per if per > 1 else None)
        return (LaneFor("b", Const(width // gs), tuple(enc)),)

    def head(src: str, rows: int, h: Expr, wname: str, layout: tuple[int, int] = (d, 0)) -> tuple[tuple, object]:
        """(statements, element j of head h of src as the rope takes it: RMS-normed with `qk_norm_eps`)."""
        row = (t * rows + h) * layout[0]
        row = row + layout[1] if layout[1] else row
        if qk_norm_eps is None:
            return (), lambda j: Load(src, row + j)
        inv = f"{src}_inv"
        pre = tuple(rms_inverse(inv, "i", d, lambda j: Load(src, row + j), qk_norm_eps))
        return pre, lambda j: Load(src, row + j) * Var(inv) * Load(wname, j)

    def roped(x, i: Expr) -> Expr:
        return rope_value(x, i, Var("pos"), d, int(rope["dims"]), float(rope["base"]), float(rope["freq_scale"]),
                          rope["mode"])

    nq = hq if rope else 0
    k_head, v_head = hd - nq, hd - nq - hkv
    local: tuple = ()
    if rope:
        kpre, kval = head("k", hkv, k_head, "kn")
        if kf.scheme is not None and kf.scheme.group > 1:
            # A quantized K head: roped by all lanes into local memory first, then encoded a scale group a lane
            # from there (else each of a head's few encoding lanes ropes its whole group, twice: max, then codes).
            i = Var("i")
            k_store = (*kpre, LaneFor("i", Const(d), (Store("kr", i, roped(kval, i)),)),
                       *store("kc", kf, d, k_head, lambda j0, e: Load("kr", j0 + e)))
            local = (LocalArray("kr", "f32", d),)
        else:
            k_store = (*kpre, *store("kc", kf, d, k_head, lambda j0, e: roped(kval, j0 + e)))
    else:
        k_store = store("kc", kf, d, k_head, lambda j0, e: Load("k", (t * hkv + k_head) * d + j0 + e))
    v_store = store("vc", vf, dv, v_head, lambda j0, e: Load("v", (t * hkv + v_head) * dv + j0 + e))
    # One flat If per kind of head (PoCL mishandles the barriers of reductions inside a nested else-if).
    body = [If((hd >= nq) & (hd < nq + hkv), k_store), If(hd >= nq + hkv, v_store)]
    params = [Buf("k", "f32"), Buf("v", "f32"), Buf("positions", "i32"), Buf("starts", "i32")]
    if rope:
        qpre, qval = head("q", hq, hd, "qn", q_layout or (d, 0))
        i = Var("i")
        body = [Let("pos", Cast("f32", Load("positions", t))),
                If(hd < hq, (*qpre, LaneFor("i", Const(d), (Store("qo", (t * hq + hd) * d + i, roped(qval, i)),)))),
                *body]
        params = [Buf("q", "f32"), *params, Buf("qo", "f32", out=True)]
        if qk_norm_eps is not None:
            params += [Buf("qn", "f32"), Buf("kn", "f32")]
    params += [Buf("kc", "u8", out=True), Buf("vc", "u8", out=True), Scalar("T")]
    return Kernel(name, tuple(params), (Var("T"), Const(nq + 2 * hkv)), tuple(body), lanes=lanes, local=local)


def scaled_score(x: Expr, scale: float, softcap: float) -> Expr:
    """A q . k product as the softmax takes it: times `scale`, then softcapped (gemma3) where `softcap` is set."""
    x = x * float(scale)
    return Const(float(softcap)) * Call("tanh", x / float(softcap)) if softcap else x


def _runs(pos: Expr, window: int, splits: int, min_run: int) -> tuple[Let, ...]:
    """Lets of how split-K divides the keys a query at `pos` sees: `lo0` the first visible position, `nall` how many
    are visible (the window, else all), `per` keys a run (an equal share of `splits`, at least `min_run`), `runs`
    the runs holding any (the first ceil(nall / per) of the `splits`)."""
    lo = Call("max", Const(0), pos - (window - 1)) if window else Const(0)
    per = (Var("nall") + (splits - 1)) // splits
    return (Let("lo0", lo), Let("nall", pos + 1 - Var("lo0")),
            Let("per", Call("max", Const(min_run), per) if min_run > 1 else per),
            Let("runs", (Var("nall") + Var("per") - 1) // Var("per")))


@kernel_builder
def attention_kernel(name: str, kf: QuantFormat, vf: QuantFormat, hq: int, hkv: int, d: int, dv: int, n_ctx: int,
                     scale: float, window: int, softcap: float, lanes: int, splits: int = 1, min_run: int = 1,
                     heads: int = 1, active: Expr | None = None, int8_q: bool = False) -> Kernel:
    """out[t, h] = softmax over visible keys of (q . k) * scale (softcapped) times v; grid (T, hq / heads). The keys
    of a token at position p are those of positions up to p in its sequence's cache rows, from `starts[t]` on;
    `kf`, `vf`: the layouts of the K and V cache rows (`kv_layouts`). Where their codes are aligned words
    (`dequant.word_codes`: split rows) K and V are read a word of 4 codes a load, and the scales as words.

    `int8_q` (K rows whose codes are words and whose values are a scale times the code: `int8_scores`): the
    group's q rows are quantized to int8 per 32 values into local memory first (as the matmuls' activations are),
    and each K word meets its q word in one `dot4_i8`, scaled by the K group's and the q block's scales.

    `heads` (dividing hq / hkv): a group takes that many query heads of one KV head, reading each K and V value
    once for all of them (with GQA, groups of one head each read the KV head's cache again).

    `splits` > 1 (split-K, for parallelism at decode): grid (T, hq, splits), group s takes the s-th of `splits`
    equal runs of the visible keys, each at least `min_run` long (`_runs`: worked out from the position read at
    run time, so the grid stays fixed, as a captured graph needs), and writes its unnormalised partial output,
    max score and sum of exponentials to `po` / `pm` / `pz` (row (t * hq + h) * splits + s) for
    `attention_combine_kernel`; a group past the visible keys stores nothing (the combine does not read it).

    `active` (uniform, of scalars): the steps the kernel works for; in others it sees no keys and stores nothing
    (zero-trip loops rather than a branch around the body: PoCL mishandles barriers inside one).
    """
    kf, vf = _kv_fmt(kf, d), _kv_fmt(vf, dv)
    g = hq // hkv
    if g % heads:
        raise ValueError(f"{heads} query heads a group do not divide the {g} of a KV head")
    krb = hkv * d // kf.block_size * block_stride(kf)
    vrb = hkv * dv // vf.block_size * block_stride(vf)
    t = Var("g0")
    h0 = Var("g1") * heads  # the group's first query head
    kvh = h0 // g
    pos = Var("pos")
    n = Var("n")
    hs = range(heads)
    run = max(-(-n_ctx // splits), min_run if splits > 1 else 1)  # the most keys a group takes

    def qrow(hh: int) -> Expr:
        return t * hq + h0 + hh

    def prow(hh: int) -> Expr:  # split-K: the group's partial row of its head hh
        return qrow(hh) * splits + Var("g2")

    def sidx(hh: int, j: Expr) -> Expr:  # head hh's score of key j, in local memory
        return j + hh * run if hh else j
    # Lanes per key for the scores: `kparts` lanes share each key's dot product (a split of each K block's chunks),
    # keys taken in tiles of lanes / kparts; 1 (one lane per key) with one lane.
    kchunk = chunk_len(kf, finest_group(kf))
    kparts = 1
    while lanes > 1 and kparts < 4 and kchunk % (kparts * 2) == 0 and kparts * 2 <= lanes:
        kparts *= 2
    tile = max(1, lanes // kparts)

    kwords = word_codes(kf)  # split rows: K codes a word (4 keys' values) a load, scales a word
    if int8_q and not int8_scores(kf, d):
        raise ValueError(f"{kf.name}: keys whose scores cannot take int8 q")
    # int8 q: the group's q rows quantized per QB values into local memory (codes `qwd` a word of 4, scales `qsc`),
    # a lane a word (each finding its block's largest |q| itself: no barrier between).
    nqb = heads * d // QB
    qu, qb, qo = Var("qu"), Var("qb"), Var("qo")
    quantize_q = LaneFor("qu", Const(nqb * QB // 4), (
        Let("qb", qu // (QB // 4)),
        Let("qo", (t * hq + h0 + qb // (d // QB)) * d + qb % (d // QB) * QB),
        Decl("qamax", "f32", Const(0.0)),
        For("qe", Const(0), Const(QB), (
            Assign("qamax", Call("max", Var("qamax"), Call("abs", Load("q", qo + Var("qe"))))),)),
        Let("qinv", Select(Var("qamax") > 0.0, Const(127.0) / Var("qamax"), Const(0.0))),
        If((qu % (QB // 4)).eq(0), (Store("qsc", qb, Var("qamax") / 127.0),)),
        *code_word(lambda e: Load("q", qo + qu % (QB // 4) * 4 + e), Var("qinv"), "qcw"),
        Store("qwd", qu, Var("qcw")),
    ))
    kdec = Decoder(kf, "kc", Var("kj") * krb + (kvh * (d // kf.block_size) + Var("kb")) * block_stride(kf), "k_",
                   word_loads=kwords)

    def key_dot(split) -> list:
        """Statements leaving in `sc<hh>` the (partial, with `split`: `Decoder.walk`'s) dot of head hh's q row with
        K row `kj`, each K value decoded once for all the group's heads."""
        def chunk(c, L, i0, env, lw) -> list:
            e = Var("kb") * kf.block_size + (c + Var(i0))
            return [Let(f"kv{c}", kdec.value(lw)),
                    *(Assign(f"sc{hh}", Var(f"sc{hh}") + Var(f"kv{c}") * Load("q", qrow(hh) * d + e)) for hh in hs)]

        def word_chunk(c, L, i0, env, lw) -> list:  # i0 counts words of the chunk
            first = Const(c) + Var(i0) * 4 if c else Var(i0) * 4
            load, values = kdec.code_words(first, [env], f"kw{c}")
            e = Var("kb") * kf.block_size + first
            return [*load, *(st for k, v in enumerate(values) for st in (
                Let(f"kv{c}_{k}", v),
                *(Assign(f"sc{hh}", Var(f"sc{hh}") + Var(f"kv{c}_{k}") * Load("q", qrow(hh) * d + e + k))
                  for hh in hs)))]

        def int8_chunk(c, L, i0, env, lw) -> list:  # i0 counts words of the chunk: 4 codes against 4 of q
            first = Const(c) + Var(i0) * 4 if c else Var(i0) * 4
            load, _ = kdec.code_words(first, [env], f"kw{c}")
            e = Var("kb") * kf.block_size + first
            ks = lw.expr(affine(kf).scale)
            return [load[-1], *(Assign(f"sc{hh}", Var(f"sc{hh}") + ks * (
                Load("qsc", e // QB + hh * (d // QB) if hh else e // QB)
                * Cast("f32", Call("dot4_i8", Var(f"kw{c}"), Load("qwd", e // 4 + hh * (d // 4) if hh else e // 4),
                                   Const(0))))) for hh in hs)]

        walk = kdec.walk(lambda s0, sz, env, inner: inner, int8_chunk if int8_q else word_chunk if kwords else chunk,
                         wide=4 if kwords else 1, split=split)
        return [*(Decl(f"sc{hh}", "f32", Const(0.0)) for hh in hs),
                For("kb", Const(0), Const(d // kf.block_size), tuple(walk))]

    def scaled(x: Expr) -> Expr:
        return scaled_score(x, scale, softcap)

    if kparts == 1:
        scores = [LaneFor("jj", n, (Let("kj", Var("lo") + Var("jj")), *key_dot(None),
                                    *(Store("s", sidx(hh, Var("jj")), scaled(Var(f"sc{hh}"))) for hh in hs)))]
    else:
        kt, ku = Var("kt"), Var("ku")
        width = tile * kparts  # the shares of one head's keys of a tile

        def total(hh: int) -> Expr:  # the kparts lanes' shares of a key's dot product with head hh
            shares = [Load("sp", Var("kk") * kparts + (hh * width + p)) for p in range(kparts)]
            return sum(shares[1:], shares[0])

        scores = [For("kt", Const(0), (n + (tile - 1)) // tile, (
            LaneFor("ku", Const(width), (
                Let("jj", kt * tile + ku // kparts),
                If(Var("jj") < n, (Let("kj", Var("lo") + Var("jj")), *key_dot((ku % kparts, kparts)),
                                   *(Store("sp", ku + hh * width if hh else ku, Var(f"sc{hh}")) for hh in hs))),
            )),
            LaneFor("kk", Const(tile), (
                Let("jj", kt * tile + Var("kk")),
                If(Var("jj") < n, tuple(Store("s", sidx(hh, Var("jj")), scaled(total(hh))) for hh in hs)),
            )),
        ))]
    vdec_bs = vf.block_size
    nvb = dv // vdec_bs
    vb = Var("vb")
    # Lanes per V block: each of `parts` lanes takes every parts-th element of the block's chunks, so the
    # lanes of a group cover the V row (a lane per block would leave most lanes idle at small head sizes).
    chunk = chunk_len(vf, finest_group(vf))
    parts = 1
    while parts * 2 <= chunk and chunk % (parts * 2) == 0 and nvb * parts * 2 <= lanes:
        parts *= 2
    dec = Decoder(vf, "vc", Var("vj") * vrb + (kvh * nvb + vb) * block_stride(vf), "v_")

    def guarded(st: Store) -> If:
        """A partial's store, skipped by a group past the visible keys. Only the stores are in the branch: a
        group's barriers stay outside any (PoCL mishandles those inside one)."""
        return If(n > 0, (st,))

    def out_store(hh: int, e: Expr, val: Expr) -> Store | If:
        """Head hh's output element e: normalised, or (split-K) the unnormalised partial."""
        if splits > 1:
            return guarded(Store("po", prow(hh) * dv + e, val))
        return guarded(Store("out", qrow(hh) * dv + e, val / Var(f"z{hh}")))

    keys = (Let("vj", Var("lo") + Var("jj")), *(Let(f"p{hh}", Load("s", sidx(hh, Var("jj")))) for hh in hs))
    o_floats = heads * dv  # the local output row's ("o"; 0: the sums stay in registers)
    if word_codes(vf):
        # Codes in aligned words (split rows): a lane a word of the V row (4 values, one load; the scales as
        # words, its group's picked at run time). Where the row has fewer words than the group lanes, `phases`
        # lanes share a word, each taking every phases-th key, their sums added through local memory.
        nw = dv // 4
        phases = max(1, min(4, lanes // nw))
        first = Var("vw") * 4 % vdec_bs if nvb > 1 else Var("vw") * 4
        block = kvh * nvb + Var("vw") * 4 // vdec_bs if nvb > 1 else kvh
        wdec = Decoder(vf, "vc", Var("vj") * vrb + block * block_stride(vf), "v_", word_loads=True)
        lets, envs = wdec.group_lets()
        load, values = wdec.code_words(first, envs, "vwd")
        step = (*keys, *lets, *load, *(st for k, v in enumerate(values) for st in (
            Let(f"vv{k}", v), *(Assign(f"va{k}_{hh}", Var(f"va{k}_{hh}") + Var(f"p{hh}") * Var(f"vv{k}"))
                                for hh in hs))))
        at = [Var("vw") * 4 + k if k else Var("vw") * 4 for k in range(4)]
        if phases == 1:
            loop = For("jj", Const(0), n, step, unroll=UNROLL)
            ends = tuple(out_store(hh, at[k], Var(f"va{k}_{hh}")) for k in range(4) for hh in hs)
            o_floats = 0
        else:
            loop = For("jm", Const(0), (n - Var("vph") + (phases - 1)) // phases,
                       (Let("jj", Var("vph") + Var("jm") * phases), *step), unroll=UNROLL)
            ends = tuple(Store("o", (Var("vph") * heads + hh) * dv + at[k], Var(f"va{k}_{hh}"))
                         for k in range(4) for hh in hs)
            o_floats = phases * heads * dv
        e = Var("e")
        v_pass = [LaneFor("vu", Const(nw * phases), (
            *((Let("vw", Var("vu")),) if phases == 1 else (Let("vw", Var("vu") % nw), Let("vph", Var("vu") // nw))),
            *(Decl(f"va{k}_{hh}", "f32", Const(0.0)) for k in range(4) for hh in hs), loop, *ends))]
        if phases > 1:
            v_pass.append(LaneFor("e", Const(dv), tuple(out_store(hh, e, sum(
                (Load("o", e + (ph * heads + hh) * dv) for ph in range(1, phases)), Load("o", e + hh * dv)))
                for hh in hs)))
    elif 1 < parts == chunk:
        o_floats = 0
        # One element of each chunk per lane: its sum over the keys stays in a register (no local-memory
        # read-modify-write per key), stored once, divided by the softmax denominator.
        starts = range(0, vdec_bs, chunk)
        vwalk = dec.walk(lambda s0, sz, env, inner: inner, lambda c, L, i0, env, lw: [
            Let(f"vv{c}", dec.value(lw)),
            *(Assign(f"va{c}_{hh}", Var(f"va{c}_{hh}") + Var(f"p{hh}") * Var(f"vv{c}")) for hh in hs)],
            split=(Var("part"), parts))
        v_pass = [LaneFor("vu", Const(nvb * parts), (
            Let("vb", Var("vu") // parts), Let("part", Var("vu") % parts),
            *(Decl(f"va{c}_{hh}", "f32", Const(0.0)) for c in starts for hh in hs),
            For("jj", Const(0), n, (*keys, *vwalk), unroll=UNROLL),
            *(out_store(hh, vb * vdec_bs + c + Var("part"), Var(f"va{c}_{hh}")) for c in starts for hh in hs),
        ))]
    else:
        def acc(c, L, i0, env, lw) -> list:
            at = vb * vdec_bs + c + Var(i0)
            return [Let(f"vv{c}", dec.value(lw)),
                    *(Store("o", at + hh * dv if hh else at, Load("o", at + hh * dv if hh else at)
                            + Var(f"p{hh}") * Var(f"vv{c}")) for hh in hs)]

        vwalk = dec.walk(lambda s0, sz, env, inner: inner, acc, split=(Var("part"), parts) if parts > 1 else None)
        v_pass = [
            LaneFor("e", Const(heads * dv), (Store("o", Var("e"), Const(0.0)),)),
            LaneFor("vu", Const(nvb * parts), (
                Let("vb", Var("vu") // parts), Let("part", Var("vu") % parts),
                For("jj", Const(0), n, (*keys, *vwalk)),
            )),
            LaneFor("e", Const(dv), tuple(out_store(hh, Var("e"), Load("o", Var("e") + hh * dv if hh else Var("e")))
                                          for hh in hs)),
        ]
    if splits > 1:  # this group's run of the visible keys: `lo` and `n` as if they were all there is
        span = (*_runs(pos, window, splits, min_run),
                Let("k0", Var("g2") * Var("per")), Let("lo", Load("starts", t) + Var("lo0") + Var("k0")),
                Let("n", Call("max", Const(0), Call("min", Var("nall") - Var("k0"), Var("per")))))
    else:
        lo0, nall = _runs(pos, window, 1, 1)[:2]
        span = (lo0, nall, Let("lo", Load("starts", t) + Var("lo0")), Let("n", Var("nall")))
    if active is not None:
        span = (*span[:-1], Let("n", Select(active, span[-1].expr, Const(0))))
    # A group past the visible keys (n = 0) runs no loop iterations: it costs a few barriers.
    jj = Var("jj")
    body = (
        Let("pos", Load("positions", t)),
        *span,
        *((quantize_q,) if int8_q else ()),
        *scores,
        Reduce("m0", "max", "jj", n, (), Load("s", jj), tuple((f"m{hh}", Load("s", sidx(hh, jj))) for hh in hs[1:])),
        LaneFor("jj", n, tuple(Store("s", sidx(hh, jj), Call("exp", Load("s", sidx(hh, jj)) - Var(f"m{hh}")))
                               for hh in hs)),
        Reduce("z0", "+", "jj", n, (), Load("s", jj), tuple((f"z{hh}", Load("s", sidx(hh, jj))) for hh in hs[1:])),
        *v_pass,
    )
    if splits > 1:
        body += tuple(guarded(Store(f, prow(hh), Var(f"{v}{hh}"))) for hh in hs for f, v in (("pm", "m"), ("pz", "z")))
        outs = (Buf("po", "f32", out=True), Buf("pm", "f32", out=True), Buf("pz", "f32", out=True))
    else:
        outs = (Buf("out", "f32", out=True),)
    params = (Buf("q", "f32"), Buf("kc", "u8"), Buf("vc", "u8"), Buf("positions", "i32"), Buf("starts", "i32"), *outs,
              Scalar("T"))
    local = (LocalArray("s", "f32", heads * run),) + ((LocalArray("o", "f32", o_floats),) if o_floats else ())
    if int8_q:
        local += (LocalArray("qwd", "u32", nqb * QB // 4), LocalArray("qsc", "f32", nqb))
    if kparts > 1:
        local += (LocalArray("sp", "f32", heads * tile * kparts),)
    grid = (Var("T"), Const(hq // heads)) + ((Const(splits),) if splits > 1 else ())
    knobs = (("two_pass", 1), ("splits", splits)) + ((("min_run", min_run),) if splits > 1 else ()) + (
        (("heads", heads),) if heads > 1 else ()) + ((("int8", 1),) if int8_q else ())
    # Fused multiply-adds, and q.k summed in any order: with one lane that sum is a loop of a head's d products,
    # which vectorizes only reordered (an 18 ms launch for gemma3's 128-token prefill on the CPU, most of its step).
    return Kernel(name, params, grid, body, lanes=lanes, local=local, knobs=knobs, contract=True, reassociate=True)


# Serial loops over keys or runs issue UNROLL iterations' loads together (`For.unroll`): a group's lanes each
# walk a run of keys waiting on loads, and the combine's few groups leave a GPU few other warps to switch to.
UNROLL = 4


@kernel_builder
def attention_combine_kernel(name: str, hq: int, dv: int, splits: int, lanes: int, quant: bool = False,
                             min_run: int = 1, window: int = 0, active: Expr | None = None,
                             every_run: bool = False, gate: tuple[int, int] | None = None) -> Kernel:
    """out[t, h] from the split-K partials of `attention_kernel` (its `splits`, `min_run` and `window`): with M the
    largest partial max, out = sum_s po_s * exp(pm_s - M) / sum_s pz_s * exp(pm_s - M) over the runs that hold
    visible keys (`_runs`, from the position read at run time). M and the denominator are reductions over the
    group's lanes; the weights exp(pm_s - M) go to local memory for the lanes' sums over s, one per element.
    `quant`: also write out as the output projection's int8 activations (`linear.quantize_staged`). `active`: as
    `attention_kernel`'s (in other steps no run holds keys and nothing is stored). `every_run`: all `splits`
    partials of a row are read (prefill tiles' key parts, `attention_tiles.prefill_attention_kernel`: an empty
    part's max is NO_SCORE, which weighs it 0). `gate` (stride, offset): out is multiplied by the sigmoid of buffer
    g's element r * stride + offset + e for row r = t * hq + h (qwen3.5's gated attention, its gate read in place
    from the q projection: `gate_heads_kernel`'s layout)."""
    r = Var("g0") * hq + Var("g1")
    s, e, runs = Var("s"), Var("e"), Var("runs")
    store = (Store("out", r * dv + e, Var("ov")),) + ((Store("ol", staged(e), Var("ov")),) if quant else ())
    runs_lets = (Let("runs", Const(splits)),) if every_run else _runs(Var("pos"), window, splits, min_run)
    if active is not None:
        runs_lets = (*runs_lets[:-1], Let("runs", Select(active, runs_lets[-1].expr, Const(0))))
        store = (If(runs > 0, store),)
    body = (
        Let("pos", Load("positions", Var("g0"))),
        *runs_lets,
        Reduce("mx", "max", "s", runs, (), Load("pm", r * splits + s)),
        LaneFor("s", runs, (Store("cw", s, Call("exp", Load("pm", r * splits + s) - Var("mx"))),)),
        Reduce("zs", "+", "s", runs, (), Load("pz", r * splits + s) * Load("cw", s)),
        LaneFor("e", Const(dv), (
            Decl("acc", "f32", Const(0.0)),
            For("s", Const(0), runs, (Assign("acc", Var("acc") + Load("po", (r * splits + s) * dv + e)
                                             * Load("cw", s)),), unroll=2 * UNROLL),
            Let("ov", Var("acc") / Var("zs") * sigmoid(Load("g", r * gate[0] + gate[1] + e)) if gate
                else Var("acc") / Var("zs")),
            *store,
        )),
    )
    params = (Buf("po", "f32"), Buf("pm", "f32"), Buf("pz", "f32"), Buf("positions", "i32"),
              *((Buf("g", "f32"),) if gate else ()), Buf("out", "f32", out=True))
    local = (LocalArray("cw", "f32", splits),)
    if quant:
        body += tuple(quantize_staged("ol", dv, r * (dv // 4), r * (dv // QB)))
        params += (Buf("xq", "u32", out=True), Buf("xd", "f32", out=True))
        local += staged_locals("ol", dv)
    return Kernel(name, (*params, Scalar("T")), (Var("T"), Const(hq)), body, lanes=lanes, local=local,
                  doc=f"attention split-K combine x{splits}")


@kernel_builder
def gate_heads_kernel(name: str, hq: int, dv: int, stride: int, offset: int, lanes: int) -> Kernel:
    """y[t, h * dv + e] = x[t, h * dv + e] * sigmoid(g[(t * hq + h) * stride + offset + e]): an attention output
    gated by the sigmoid of a gate read in place from a wider projection; grid (T, hq)."""
    r, e = Var("g0") * hq + Var("g1"), Var("e")
    body = (LaneFor("e", Const(dv), (Store("y", r * dv + e, Load("x", r * dv + e)
                                            * sigmoid(Load("g", r * stride + offset + e))),)),)
    return Kernel(name, (Buf("x", "f32"), Buf("g", "f32"), Buf("y", "f32", out=True), Scalar("T")),
                  (Var("T"), Const(hq)), body, lanes=lanes)


def _attention_launches(node: Node, ctx: RecipeContext, q: str, rope: dict | None = None,
                        qk_norm: tuple[Node, Node] | None = None, q_src: tuple[str, int, int] | None = None,
                        gate: tuple[str, int, int, str] | None = None) -> list[Launch]:
    """The attention op's launches, its q read from buffer `q`: the K/V store (with `rope`, roping q into `q` and
    K on the way, after the per-head RMS norms `qk_norm` when given: see `kv_store_kernel`), the attention kernel
    and, with split-K, the combine. `q_src` (buffer, stride, offset): with `rope`, the store reads q there in place
    (`kv_store_kernel`'s q_layout). `gate` (buffer, stride, offset, output buffer): the output times the sigmoid
    of the gate read in place, written to the output buffer: by the split-K combine where there is one, else by a
    launch of its own (`gate_heads_kernel`)."""
    launches = _store_and_attention(node, ctx, q, rope, qk_norm, q_src, gate)
    if gate is None or any(dict(la.buffers).get("g") == gate[0] for la in launches):
        return launches
    hq, dv = (int(x) for x in node.output.type.shape[1:])
    gk = gate_heads_kernel(f"gate_heads_{hq}_{dv}_{gate[1]}_{gate[2]}", hq, dv, gate[1], gate[2], ctx.lanes)
    return [*launches, Launch(gk, (("x", ctx.buf(node.output)), ("g", gate[0]), ("y", gate[3])), (("T", "T"),))]


def _store_and_attention(node: Node, ctx: RecipeContext, q: str, rope: dict | None,
                         qk_norm: tuple[Node, Node] | None, q_src: tuple[str, int, int] | None,
                         gate: tuple[str, int, int, str] | None) -> list[Launch]:
    """`_attention_launches` without the gate's own launch: the one-row path's combine, where it has one, applies
    `gate`."""
    qv, k, v, pos = node.inputs
    a = node.attrs
    _, hq, d = qv.type.shape
    hkv, dv = int(k.type.shape[1]), int(v.type.shape[2])
    hq, d = int(hq), int(d)
    fmt = ctx.kv_format
    kf, vf = kv_layouts(fmt, d, dv, ctx.target())
    layer = a["layer"]
    kn, vn = f"kv.{layer}.k", f"kv.{layer}.v"
    p = ctx.buf(pos)
    heads = f"{fmt.name.lower()}{'_split' if kf is not fmt else ''}_{hq}_{hkv}_{d}_{dv}"
    kv_io = (("k", ctx.buf(k)), ("v", ctx.buf(v)), ("positions", p), ("starts", "starts"), ("kc", kn), ("vc", vn))
    if rope:
        eps = float(qk_norm[0].attrs["eps"]) if qk_norm else None
        rtag = f"_{rope['dims']}_{rope['mode']}_{stable_digest((rope['base'], rope['freq_scale'], eps), 8)}"
        qtag = f"_q{q_src[1]}o{q_src[2]}" if q_src else ""
        ks = kv_store_kernel(f"rope{'_norm' if qk_norm else ''}_kv_store_{heads}{rtag}{qtag}", kf, vf, hq, hkv, d,
                             dv, ctx.lanes, rope, eps, q_src[1:] if q_src else None)
        norms = (("qn", ctx.buf(qk_norm[0].inputs[1])), ("kn", ctx.buf(qk_norm[1].inputs[1]))) if qk_norm else ()
        store = Launch(ks, (("q", q_src[0] if q_src else ctx.buf(qv)), ("qo", q), *kv_io, *norms), (("T", "T"),))
    else:
        store = Launch(kv_store_kernel(f"kv_store_{heads}", kf, vf, hq, hkv, d, dv, ctx.lanes), kv_io, (("T", "T"),))
    tag = f"{heads}_{a['window']}_{stable_digest((a['scale'], a['softcap']), 8)}"
    window, softcap = int(a["window"]), float(a["softcap"] or 0.0)
    io = (("q", q), ("kc", kn), ("vc", vn), ("positions", p), ("starts", "starts"))
    out = ctx.buf(node.output)
    span = key_span(ctx.n_ctx)
    chosen = ctx.knobs_for(ATTENTION_SPACE, f"attn_{tag}_{span}")
    # Targets that split the keys over groups (the policy's split_keys: GPUs, to fill the device).
    split_keys = bool(ctx.target().default("attention", "split_keys"))
    tiles = chosen["tiles"]
    if tiles == "auto":  # there, steps of several tokens: key tiles decoded once for a tile of query rows
        tiles = int(split_keys and ctx.t_max > 1 and chosen["splits"] == "auto")
    above = TILES_ABOVE if chosen["tiles_above"] == "auto" else int(chosen["tiles_above"])
    if not int(tiles) or ctx.t_max <= above:
        return [store, *_row_launches(ctx, node, (kf, vf), tag, io, chosen, split_keys, window, softcap, provide=True,
                                      gate=gate)]
    # Knob mma ("auto": where the target has matrix units): the tile products (`attention_tiles`), in tiles of
    # MMA_TILE_CHOICES that fit; else (or where none does) the loops.
    policy = ctx.target()
    mma = bool(int(policy.matrix_units if chosen["mma"] == "auto" else chosen["mma"]))
    tiles_mma = default_tiles(d, dv, policy.local_bytes, True, policy.matrix_units) if mma else None
    qt, kt = tiles_mma or default_tiles(d, dv, policy.local_bytes)
    qt, kt = (dflt if chosen[name] == "auto" else int(chosen[name]) for name, dflt in (("q_tile", qt), ("k_tile", kt)))
    mma = mma and mma_fits(d, dv, kt) and (tiles_mma is not None or "auto" not in (chosen["q_tile"], chosen["k_tile"]))
    lanes = ctx.lanes
    if mma and qt % 16 == 0 and kt % 16 == 0:
        # A subgroup per 16 x 16 tile of a fragment at most: every matrix unit then deals whole hardware tiles to
        # the subgroups (else the fragments fall back to local memory, which the tiles above were not sized for).
        lanes = min(lanes, ctx.subgroup * (qt // 16) * (kt // 16))
    # With `above` > 0, steps of at most `above` rows (short prompts, batched decoding) keep the row kernels: a
    # group a row, and a row's result independent of which rows share its step. The row count picks at run time.
    sel = (Var("T") > above, f"_gt{above}") if above else (None, "")
    # Knob tile_splits: each pass's key tiles dealt to that many groups, whose partials a combine adds up (more
    # groups at work in a step of few row tiles: a long prompt's steps).
    parts = int(chosen["tile_splits"])
    tk = prefill_attention_kernel(f"attn_tiles_{tag}_{qt}x{kt}{'_mma' if mma else ''}"
                                  f"{f'_k{parts}' if parts > 1 else ''}{sel[1]}", _kv_fmt(kf, d),
                                  _kv_fmt(vf, dv), hq, hkv, d, dv,
                                  lambda x: scaled_score(x, float(a["scale"]), softcap), window, lanes, qt, kt,
                                  active=sel[0], mma=mma, splits=parts)
    rows = _row_launches(ctx, node, (kf, vf), tag, io, chosen, split_keys, window, softcap, provide=False,
                         active=(Var("T") <= above, f"le{above}")) if above else []
    if parts == 1:
        return [store, Launch(tk, (*io, ("out", out)), (("T", "T"),)), *rows]
    n = ctx.t_max * hq * parts
    partials = (("po", ctx.scratch("attn_o", "f32", n * dv)), ("pm", ctx.scratch("attn_m", "f32", n)),
                ("pz", ctx.scratch("attn_z", "f32", n)))
    comb = attention_combine_kernel(f"attn_tiles_combine_{hq}_{dv}_{parts}{sel[1]}", hq, dv, parts, ctx.lanes,
                                    active=sel[0], every_run=True)
    return [store, Launch(tk, (*io, *partials), (("T", "T"),)),
            Launch(comb, (*partials, ("positions", dict(io)["positions"]), ("out", out)), (("T", "T"),)), *rows]


def _row_launches(ctx: RecipeContext, node: Node, layouts: tuple[QuantFormat, QuantFormat], tag: str, io: tuple,
                  chosen: dict, split_keys: bool, window: int, softcap: float, provide: bool,
                  active: tuple[Expr, str] | None = None,
                  gate: tuple[str, int, int, str] | None = None) -> list[Launch]:
    """The one-row attention kernel (`attention_kernel`, over the K and V row `layouts`) and, with split-K, the
    combine, which writes the output projection's int8 activations too where `provide` and the target's matmuls
    take them. `chosen`: the knobs; `active`: (the steps they work for, a name suffix saying which); `gate`: see
    `_attention_launches` (the combine applies it, and then writes the gated output and its activations)."""
    cond, suffix = active if active else (None, "")
    qv, k, v, _ = node.inputs
    hq, d = (int(x) for x in qv.type.shape[1:])
    hkv, dv = int(k.type.shape[1]), int(v.type.shape[2])
    a = node.attrs
    span = key_span(ctx.n_ctx)
    splits = chosen["splits"]
    if splits == "auto":  # enough groups to fill the device (one per head is 32 for 132 SMs)
        splits = max(1, min(8, span // 64)) if split_keys else 1
        if split_keys and ctx.t_max == 1:  # one token: runs of DECODE_RUN_KEYS keys (flash-decoding)
            splits = max(splits, min(MAX_DECODE_RUNS, -(-span // DECODE_RUN_KEYS)))
        elif split_keys:  # several: runs of at most PREFILL_RUN_KEYS keys
            splits = max(splits, -(-span // PREFILL_RUN_KEYS))
    splits = int(splits)
    min_run = chosen["min_run"]
    min_run = int((MIN_RUN_KEYS if split_keys else 1) if min_run == "auto" else min_run)
    heads = chosen["heads"]
    if heads == "auto":
        run = max(-(-span // splits), min_run)
        group = [h for h in range(1, hq // hkv + 1) if (hq // hkv) % h == 0]  # what divides a KV head's q heads
        heads = 1
        keep = int(ctx.target().default("attention", "group_heads"))  # the host: groups a token in one-token plans
        if keep:  # a K or V value decoded once for all the group's heads
            heads = max((h for h in group if ctx.t_max > 1 or hq // h >= keep), default=1)
        elif split_keys and ctx.t_max == 1 and span > LONG_CONTEXT:  # long one-token GPU plans: scores in local
            heads = max((h for h in group if h * run <= GROUP_SCORES), default=1)  # memory (few splits: a head)
    heads = int(heads)
    int8_q = chosen["int8"]
    if int8_q == "auto":  # where the target has an int8 dot product and the K rows' codes are words
        int8_q = ctx.target().int8_dot
    int8_q = bool(int(int8_q)) and int8_scores(_kv_fmt(layouts[0], d), d)
    at = attention_kernel(f"attn_{tag}_{splits}" + (f"_r{min_run}" if splits > 1 else "") +
                          (f"_h{heads}" if heads > 1 else "") + ("_q8" if int8_q else "") +
                          (f"_{suffix}" if suffix else ""), *layouts, hq, hkv, d, dv, span, float(a["scale"]), window,
                          softcap, ctx.lanes, splits, min_run, heads, cond, int8_q)
    out = ctx.buf(node.output)
    if splits == 1:
        return [Launch(at, (*io, ("out", out)), (("T", "T"),))]
    rows = ctx.t_max * hq * splits
    parts = (("po", ctx.scratch("attn_o", "f32", rows * dv)), ("pm", ctx.scratch("attn_m", "f32", rows)),
             ("pz", ctx.scratch("attn_z", "f32", rows)))
    if gate:
        out = gate[3]
    # The output projection's int8 activations, which the combine can write too (a block of 32 within a head).
    qbufs, provides = quantized_output(ctx, out, hq * dv, "T") if provide and dv % QB == 0 else ((), ())
    gtag = f"_g{gate[1]}o{gate[2]}" if gate else ""
    comb = attention_combine_kernel(f"attn_combine{'_q8' if provides else ''}_{hq}_{dv}_{splits}_r{min_run}_{window}"
                                    + gtag + (f"_{suffix}" if suffix else ""), hq, dv, splits, ctx.lanes,
                                    bool(provides), min_run, window, cond, gate=gate[1:3] if gate else None)
    return [Launch(at, (*io, *parts), (("T", "T"),)),
            Launch(comb, (*parts, ("positions", dict(io)["positions"]), *((("g", gate[0]),) if gate else ()),
                          ("out", out), *qbufs), (("T", "T"),), provides=provides)]


def _lower_attention(nodes: Sequence[Node], ctx: RecipeContext) -> list[Launch]:
    (node,) = nodes
    return _attention_launches(node, ctx, ctx.buf(node.inputs[0]))


def _lower_rope_attention(nodes: Sequence[Node], ctx: RecipeContext) -> list[Launch]:
    *norms, rq, rk, attn = nodes
    # The store kernel reads q and k before their norms and ropes, and writes q roped into the q rope's output.
    q, k = (norms[0].inputs[0], norms[1].inputs[0]) if norms else (rq.inputs[0], rk.inputs[0])
    node = Node(attn.op, (q, k, *attn.inputs[2:]), attn.attrs, attn.output)
    return _attention_launches(node, ctx, ctx.buf(rq.output), rope=rq.attrs, qk_norm=tuple(norms) or None)


def _lower_gated_attention(nodes: Sequence[Node], ctx: RecipeContext) -> list[Launch]:
    """qwen3.5's gated attention: q and a gate cut from one projection (each head [q | gate]), the q and K norms
    and ropes, the attention, then its output times the sigmoid of the gate. The K/V store reads q in place from
    the projection and the combine reads the gate there (`_attention_launches`' q_src and gate): the two slices'
    launches and the gate's go, and the combine writes the output projection's int8 activations of the gated
    output (its quantize launch goes too)."""
    sq, sg, _, rk, rv, nq, nk, rq, rkr, attn, _, sm = nodes
    qg = sq.inputs[0]
    width = int(qg.type.shape[-1])
    node = Node(attn.op, (sq.output, nk.inputs[0], *attn.inputs[2:]), attn.attrs, attn.output)
    return _attention_launches(node, ctx, ctx.buf(rq.output), rope=rq.attrs, qk_norm=(nq, nk),
                               q_src=(ctx.buf(qg), width, int(sq.attrs["start"])),
                               gate=(ctx.buf(qg), width, int(sg.attrs["start"]), ctx.buf(sm.output)))


def _match_gated_attention(nodes: Sequence[Node]) -> bool:
    # The intermediates (the slices, the attention's ungated output) are taken to have no other reader, as in the
    # other fused chains.
    sq, sg, rg, rk, rv, nq, nk, rq, rkr, attn, flat, sm = nodes
    qg, d = sq.inputs[0], int(attn.inputs[0].type.shape[-1])
    return (sg.inputs[0] is qg and len(qg.type.shape) == 3 and sq.attrs["stop"] - sq.attrs["start"] == d
            and sg.attrs["stop"] - sg.attrs["start"] == int(attn.output.type.shape[-1])
            and rg.inputs[0] is sg.output and nq.inputs[0] is sq.output and nk.inputs[0] is rk.output
            and attn.inputs[2] is rv.output and _match_norm_rope_attention((nq, nk, rq, rkr, attn))
            and flat.inputs[0] is attn.output and sm.inputs[0] is flat.output and sm.inputs[1] is rg.output)


def _match_rope_attention(nodes: Sequence[Node]) -> bool:
    rq, rk, attn = nodes
    return (attn.inputs[0] is rq.output and attn.inputs[1] is rk.output and rq.inputs[1] is rk.inputs[1]
            and rq.inputs[1] is attn.inputs[3] and rq.attrs == rk.attrs)


def _match_norm_rope_attention(nodes: Sequence[Node]) -> bool:
    nq, nk, rq, rk, attn = nodes
    d = attn.inputs[0].type.shape[-1]
    return (_match_rope_attention((rq, rk, attn)) and rq.inputs[0] is nq.output and rk.inputs[0] is nk.output
            and nq.attrs == nk.attrs and all(n.inputs[1].type.shape == (d,) for n in (nq, nk)))


# Knob heads: query heads of a KV head together (must divide hq / hkv: the recipe rejects others). Knob int8: the
# one-row kernels' scores take q as int8 against K codes in words ("auto": where the policy has int8_dot; only K
# rows split into codes and scales take it). Knobs tiles, tiles_above, q_tile, k_tile, mma: prefill attention in
# tiles (`attention_tiles.py`), mma its tile products; tile_splits: the tiles' keys in that many parts, each a group,
# added up by the split-K combine (1, off, until measured on a GPU: docs/benchmarks.md).
ATTENTION_SPACE = KnobSpace("attention", (Knob("splits", "auto", (1, 2, 4, 8, 16, 32)),
                                          Knob("min_run", "auto", (1, 4, 16, 64)), Knob("heads", "auto", (1, 2, 4)),
                                          Knob("int8", "auto", (0, 1)),
                                          Knob("tiles", "auto", (0, 1)), Knob("tiles_above", "auto", (0, 16, 256)),
                                          Knob("q_tile", "auto", (4, 8, 16, 32)), Knob("k_tile", "auto", (8, 16, 32)),
                                          Knob("mma", "auto", (0, 1)), Knob("tile_splits", 1, (2, 4))),
                            constraint=lambda kn: (kn["min_run"] == "auto" or kn["splits"] not in ("auto", 1))
                            and (kn["tiles"] != 0 or (kn["tile_splits"] == 1 and all(
                                kn[t] == "auto" for t in ("tiles_above", "q_tile", "k_tile", "mma")))))
register(Recipe("attention", ("attention",), _lower_attention, None, ATTENTION_SPACE))
register(Recipe("rope_attention", ("rope", "rope", "attention"), _lower_rope_attention, _match_rope_attention,
                ATTENTION_SPACE))
register(Recipe("norm_rope_attention", ("rms_norm", "rms_norm", "rope", "rope", "attention"), _lower_rope_attention,
                _match_norm_rope_attention, ATTENTION_SPACE))
register(Recipe("gated_attention", ("slice", "slice", "reshape", "reshape", "reshape", "rms_norm", "rms_norm", "rope",
                                    "rope", "attention", "reshape", "sigmoid_mul"), _lower_gated_attention,
                _match_gated_attention, ATTENTION_SPACE))

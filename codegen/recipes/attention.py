"""`attention`: write this step's K and V into the layer's KV cache, then causal (windowed, GQA) attention.

Launch 1 (`kv_store`): grid (T, blocks per cache row) for K and for V; each group encodes one block of the KV
format from its description: one-element formats (f16) store converted bits; symmetric formats whose code is
a bare signed-byte field and whose step is an f16 field (q8_0, q8_g64) store d = max|x| / |anchor| as f16
and codes round(x / d) clipped to the anchor.

Launch 2 (`attn`): grid (T, n_head); two-pass softmax with the scores of the visible keys in local memory
(size n_ctx): scores (K decoded block by block; with lanes, keys in tiles, `kparts` lanes per key adding their
shares of the dot product through a local array), Reduce max, LaneFor exp, Reduce
sum, then a LaneFor over (V block, part) accumulates p_j * v_j, `parts` lanes sharing a block (`Decoder.walk`'s
split; with one element a lane, in registers, else into a local output row).

Split-K (knob `splits`, "auto": 1 with one lane, else up to 8 by n_ctx): one group per head leaves most of a
GPU idle at decode, so launch 2 runs `splits` groups per (token, head), each over its run of the keys, writing
unnormalised partials (output row, max score, sum of exponentials) to plan scratch, and launch 3
(`attention_combine_kernel`) rescales and adds them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from polystrata.codegen.dequant import Decoder, block_stride, chunk_len, finest_group, widen
from polystrata.codegen.recipes import Recipe, RecipeContext, register
from polystrata.codegen.recipes._matvec import Act, block_dot
from polystrata.ir import quant as Q
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
from polystrata.ir.quant import Const, Expr, QuantFormat, Var


def _kv_fmt(fmt: QuantFormat, d: int) -> QuantFormat:
    return widen(fmt, math.gcd(d, 32)) if fmt.block_size == 1 else fmt


def kv_store_kernel(name: str, fmt: QuantFormat, width: int, lanes: int) -> Kernel:
    """cache[pos[t]] row (width values) = encode(src[t]) ; grid (T, width / block)."""
    rb = width // fmt.block_size * fmt.block_bytes
    b = Var("g1")
    src0 = Var("g0") * width + b * fmt.block_size
    dst = Load("positions", Var("g0")) * rb + b * fmt.block_bytes
    body: list = [Let("dst", dst)]
    if fmt.block_size == 1:
        (f,) = fmt.fields
        if f.dtype != "f16":
            raise NotImplementedError(f"KV cache of {fmt.name}")
        body += [Let("h", Call("f32_to_f16_bits", Load("src", src0))),
                 Store("kv", Var("dst"), Var("h") & 255), Store("kv", Var("dst") + 1, (Var("h") >> 8) & 255)]
        grid = (Var("T"), Const(width))
    else:
        s = fmt.scheme
        code = fmt.let(s.code).expr
        ok = (s is not None and s.min is None and s.step.code is None and isinstance(code, Q.Load)
              and fmt.field(code.field).dtype == "i8" and s.table is None and s.group == fmt.block_size)
        if not ok:
            raise NotImplementedError(f"in-kernel encoding of {fmt.name}")
        df, qf = fmt.field(s.step.field), fmt.field(code.field)
        a = float(abs(s.anchor))
        e = Var("e")
        body += [
            Decl("amax", "f32", Const(0.0)),
            For("e", Const(0), Const(fmt.block_size), (
                Assign("amax", Call("max", Var("amax"), Call("abs", Load("src", src0 + e)))),)),
            Let("h", Call("f32_to_f16_bits", Var("amax") / a)),
            Let("dd", Call("f16_bits_to_f32", Var("h"))),
            Let("inv", Select(Var("dd") > 0.0, Const(1.0) / Var("dd"), Const(0.0))),
            Store("kv", Var("dst") + df.offset, Var("h") & 255),
            Store("kv", Var("dst") + df.offset + 1, (Var("h") >> 8) & 255),
            For("e", Const(0), Const(fmt.block_size), (
                Let("v", Load("src", src0 + e) * Var("inv")),
                Let("q", Call("max", Const(-int(a)), Call("min", Const(int(a)), Cast(
                    "i32", Var("v") + Select(Var("v") < 0.0, Const(-0.5), Const(0.5)))))),
                Store("kv", Var("dst") + qf.offset + e, (Var("q") + 256) & 255),
            )),
        ]
        grid = (Var("T"), Const(width // fmt.block_size))
    params = (Buf("src", "f32"), Buf("positions", "i32"), Buf("kv", "u8", out=True), Scalar("T"))
    return Kernel(name, params, grid, tuple(body), lanes=lanes)


def attention_kernel(name: str, fmt: QuantFormat, hq: int, hkv: int, d: int, dv: int, n_ctx: int, scale: float,
                     window: int, softcap: float, lanes: int, splits: int = 1) -> Kernel:
    """out[t, h] = softmax over visible keys of (q . k) * scale (softcapped) times v; grid (T, hq).

    `splits` > 1 (split-K, for parallelism at decode): grid (T, hq, splits), group s takes the s-th of `splits`
    equal runs of the visible keys and writes its unnormalised partial output, max score and sum of
    exponentials to `po` / `pm` / `pz` (row (t * hq + h) * splits + s) for `attention_combine_kernel`.
    """
    kf, vf = _kv_fmt(fmt, d), _kv_fmt(fmt, dv)
    g = hq // hkv
    krb = hkv * d // kf.block_size * block_stride(kf)
    vrb = hkv * dv // vf.block_size * block_stride(vf)
    t, h = Var("g0"), Var("g1")
    kvh = h // g
    pos = Var("pos")
    lo = Call("max", Const(0), pos - (window - 1)) if window else Const(0)
    n = Var("n")
    qrow = t * hq + h
    prow = qrow * splits + Var("g2")  # split-K: this group's partial row
    # Lanes per key for the scores: `kparts` lanes share each key's dot product (a split of each K block's chunks),
    # keys taken in tiles of lanes / kparts; 1 (one lane per key) with one lane.
    kchunk = chunk_len(kf, finest_group(kf))
    kparts = 1
    while lanes > 1 and kparts < 4 and kchunk % (kparts * 2) == 0 and kparts * 2 <= lanes:
        kparts *= 2
    tile = max(1, lanes // kparts)

    def key_dot(split) -> list:
        """Statements leaving in `sc` the (partial, with `split`) dot of the q row with K row `kj`."""
        return [Decl("sc", "f32", Const(0.0)),
                For("kb", Const(0), Const(d // kf.block_size), tuple(block_dot(
                    fmt if fmt.block_size != 1 else kf, "kc", Var("kj") * krb + kvh * (d // kf.block_size) *
                    block_stride(kf), Var("kb"), Act("q", d), qrow, "sc", "k_", split=split)))]

    def scaled(x: Expr) -> Expr:
        x = x * float(scale)
        return Const(float(softcap)) * Call("tanh", x / float(softcap)) if softcap else x

    if kparts == 1:
        scores = [LaneFor("jj", n, (Let("kj", Var("lo") + Var("jj")), *key_dot(None),
                                    Store("s", Var("jj"), scaled(Var("sc")))))]
    else:
        kt, ku = Var("kt"), Var("ku")
        shares = [Load("sp", Var("kk") * kparts + p) for p in range(kparts)]  # the kparts lanes' shares of a key
        scores = [For("kt", Const(0), (n + (tile - 1)) // tile, (
            LaneFor("ku", Const(tile * kparts), (
                Let("jj", kt * tile + ku // kparts),
                If(Var("jj") < n, (Let("kj", Var("lo") + Var("jj")),
                                   *key_dot((ku % kparts, kparts)), Store("sp", ku, Var("sc")))),
            )),
            LaneFor("kk", Const(tile), (
                Let("jj", kt * tile + Var("kk")),
                If(Var("jj") < n, (Store("s", Var("jj"), scaled(sum(shares[1:], shares[0]))),)),
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

    def out_store(e: Expr, val: Expr) -> Store:
        """Output element e: normalised, or (split-K) the unnormalised partial."""
        return Store("po", prow * dv + e, val) if splits > 1 else Store("out", qrow * dv + e, val / Var("z"))

    keys = (Let("vj", Var("lo") + Var("jj")), Let("p", Load("s", Var("jj"))))
    if 1 < parts == chunk:
        # One element of each chunk per lane: its sum over the keys stays in a register (no local-memory
        # read-modify-write per key), stored once, divided by the softmax denominator.
        starts = range(0, vdec_bs, chunk)
        vwalk = dec.walk(lambda s0, sz, env, inner: inner, lambda c, L, i0, env, lw: [
            Assign(f"va{c}", Var(f"va{c}") + Var("p") * dec.value(lw))], split=(Var("part"), parts))
        v_pass = [LaneFor("vu", Const(nvb * parts), (
            Let("vb", Var("vu") // parts), Let("part", Var("vu") % parts),
            *(Decl(f"va{c}", "f32", Const(0.0)) for c in starts),
            For("jj", Const(0), n, (*keys, *vwalk)),
            *(out_store(vb * vdec_bs + c + Var("part"), Var(f"va{c}")) for c in starts),
        ))]
    else:
        vwalk = dec.walk(lambda s0, sz, env, inner: inner, lambda c, L, i0, env, lw: [
            Store("o", vb * vdec_bs + c + Var(i0), Load("o", vb * vdec_bs + c + Var(i0)) + Var("p") * dec.value(lw))],
            split=(Var("part"), parts) if parts > 1 else None)
        v_pass = [
            LaneFor("e", Const(dv), (Store("o", Var("e"), Const(0.0)),)),
            LaneFor("vu", Const(nvb * parts), (
                Let("vb", Var("vu") // parts), Let("part", Var("vu") % parts),
                For("jj", Const(0), n, (*keys, *vwalk)),
            )),
            LaneFor("e", Const(dv), (out_store(Var("e"), Load("o", Var("e"))),)),
        ]
    if splits > 1:  # this group's run of the visible keys: `lo` and `n` as if they were all there is
        span = (Let("lo0", lo), Let("nall", pos + 1 - Var("lo0")), Let("per", (Var("nall") + (splits - 1)) // splits),
                Let("k0", Var("g2") * Var("per")), Let("lo", Var("lo0") + Var("k0")),
                Let("n", Call("max", Const(0), Call("min", Var("nall") - Var("k0"), Var("per")))))
    else:
        span = (Let("lo", lo), Let("n", pos + 1 - Var("lo")))
    body = (
        Let("pos", Load("positions", t)),
        *span,
        *scores,
        Reduce("m", "max", "jj", n, (), Load("s", Var("jj"))),
        LaneFor("jj", n, (Store("s", Var("jj"), Call("exp", Load("s", Var("jj")) - Var("m"))),)),
        Reduce("z", "+", "jj", n, (), Load("s", Var("jj"))),
        *v_pass,
    )
    if splits > 1:
        body += (Store("pm", prow, Var("m")), Store("pz", prow, Var("z")))
        outs = (Buf("po", "f32", out=True), Buf("pm", "f32", out=True), Buf("pz", "f32", out=True))
    else:
        outs = (Buf("out", "f32", out=True),)
    params = (Buf("q", "f32"), Buf("kc", "u8"), Buf("vc", "u8"), Buf("positions", "i32"), *outs, Scalar("T"))
    local = (LocalArray("s", "f32", -(-n_ctx // splits)),) + (() if 1 < parts == chunk else
                                                               (LocalArray("o", "f32", dv),))
    if kparts > 1:
        local += (LocalArray("sp", "f32", tile * kparts),)
    grid = (Var("T"), Const(hq)) + ((Const(splits),) if splits > 1 else ())
    return Kernel(name, params, grid, body, lanes=lanes, local=local, knobs=(("two_pass", 1), ("splits", splits)))


def attention_combine_kernel(name: str, hq: int, dv: int, splits: int, lanes: int) -> Kernel:
    """out[t, h] from the split-K partials of `attention_kernel`: with M the largest partial max,
    out = sum_s po_s * exp(pm_s - M) / sum_s pz_s * exp(pm_s - M) (runs without keys have pm = -inf: weight 0)."""
    r = Var("g0") * hq + Var("g1")
    w = Call("exp", Load("pm", r * splits + Var("s")) - Var("mx"))
    body = (
        Decl("mx", "f32", Const(float("-inf"))),
        For("s", Const(0), Const(splits), (Assign("mx", Call("max", Var("mx"), Load("pm", r * splits + Var("s")))),)),
        LaneFor("e", Const(dv), (
            Decl("zs", "f32", Const(0.0)), Decl("acc", "f32", Const(0.0)),
            For("s", Const(0), Const(splits), (
                Let("w", w),
                Assign("zs", Var("zs") + Load("pz", r * splits + Var("s")) * Var("w")),
                Assign("acc", Var("acc") + Load("po", (r * splits + Var("s")) * dv + Var("e")) * Var("w")),
            )),
            Store("out", r * dv + Var("e"), Var("acc") / Var("zs")),
        )),
    )
    params = (Buf("po", "f32"), Buf("pm", "f32"), Buf("pz", "f32"), Buf("out", "f32", out=True), Scalar("T"))
    return Kernel(name, params, (Var("T"), Const(hq)), body, lanes=lanes, doc=f"attention split-K combine x{splits}")


def _lower_attention(nodes: Sequence[Node], ctx: RecipeContext) -> list[Launch]:
    (node,) = nodes
    q, k, v, pos = node.inputs
    a = node.attrs
    _, hq, d = q.type.shape
    hkv, dv = int(k.type.shape[1]), int(v.type.shape[2])
    hq, d = int(hq), int(d)
    fmt = ctx.kv_format
    layer = a["layer"]
    kn, vn = f"kv.{layer}.k", f"kv.{layer}.v"
    ks = kv_store_kernel(f"kv_store_{fmt.name.lower()}_{hkv * d}", fmt, hkv * d, ctx.lanes)
    vs = kv_store_kernel(f"kv_store_{fmt.name.lower()}_{hkv * dv}", fmt, hkv * dv, ctx.lanes)
    tag = f"{fmt.name.lower()}_{hq}_{hkv}_{d}_{dv}_{a['window']}_{abs(hash((a['scale'], a['softcap']))) % 10**8}"
    splits = ctx.knob("attention", "splits", "auto")
    if splits == "auto":  # GPUs: enough groups to fill the device at decode (one per head is 32 for 132 SMs)
        splits = 1 if ctx.lanes == 1 else max(1, min(8, ctx.n_ctx // 64))
    splits = int(splits)
    at = attention_kernel(f"attn_{tag}_{splits}", fmt, hq, hkv, d, dv, ctx.n_ctx, float(a["scale"]),
                          int(a["window"]), float(a["softcap"] or 0.0), ctx.lanes, splits)
    p = ctx.buf(pos)
    stores = [Launch(ks, (("src", ctx.buf(k)), ("positions", p), ("kv", kn)), (("T", "T"),)),
              Launch(vs, (("src", ctx.buf(v)), ("positions", p), ("kv", vn)), (("T", "T"),))]
    io = (("q", ctx.buf(q)), ("kc", kn), ("vc", vn), ("positions", p))
    if splits == 1:
        return [*stores, Launch(at, (*io, ("out", ctx.buf(node.output))), (("T", "T"),))]
    rows = ctx.t_max * hq * splits
    parts = (("po", ctx.scratch("attn_o", "f32", rows * dv)), ("pm", ctx.scratch("attn_m", "f32", rows)),
             ("pz", ctx.scratch("attn_z", "f32", rows)))
    comb = attention_combine_kernel(f"attn_combine_{hq}_{dv}_{splits}", hq, dv, splits, ctx.lanes)
    return [*stores, Launch(at, (*io, *parts), (("T", "T"),)),
            Launch(comb, (*parts, ("out", ctx.buf(node.output))), (("T", "T"),))]


register(Recipe("attention", ("attention",), _lower_attention, None, (("two_pass", 1), ("splits", "auto"))))

"""`tile_matmul_kernel`: the one-lane (CPU) matmul of steps of several tokens, each weight block's scales decoded
once for a whole tile of tokens.

`linear.matmul_kernel` computes each token's dot products block by block, decoding every weight block again for
each token of its tile; on the CPU decoding is much of a matmul's time, so a step of T tokens cost about T
one-token steps and a batched decode step (several sequences'
tokens, polystrata/batch.py) gained nothing. Here a group walks each block of its row once: the block's lets
(scales, minima) once, then for each token of the tile one loop over the block's elements adding the products to
per-(token, element) partial sums (the f32 path's `vert` sums: elementwise, so the loop vectorizes without
reordering a float sum), added up once per row and token. The products and the order of every sum are those of
`matmul_kernel`'s f32 path, so a token's results do not depend on the tile it shares.

`linear._launches` takes this kernel for one-lane plans of more than one token on the f32 path (the CPU's
default; knob tile); one-token plans keep `matmul_kernel`.

`tile_matmul_q8_kernel` is the int8 form (knob tile_q8, its token tile: on by default where the host has VNNI,
`policy.HOST_VNNI`), for formats whose value factors as `S_g * level + M_g` with byte-sized levels
(`q8_tile_fits`): the activations quantized to int8 once per step by a launch before it (`linear.quantize_launch`
with sums, its codes in the chunked layout of `cpu_intrinsics.dot_i8_pair`); a group decodes its rows' levels
(plus a bias making them unsigned) to bytes in that layout, with the group scales and the 16-value terms (offsets
less bias times scale), into local arrays once for its tile of tokens; then two tokens' dot products with a row
are one `dot_i8_pair` (32 byte products a step, `vpdpbusd` with VNNI, summed as integers a weight group, scaled by
its scale and the activation block's; the row's bytes loaded once for both) and for each token one `dot_f32` of
the 16-value terms with the activations' sums. Its results are those of the int8 activations: each product of
the weights' values with the codes' values, exactly, but for float rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from polystrata.codegen.cpu_intrinsics import CHUNK, chunked_byte
from polystrata.codegen.dequant import Decoder
from polystrata.codegen.format_analysis import (
    affine,
    block_stride,
    elements_per_row_bytes,
    finest_group,
    level_range,
    weight_dtype,
)
from polystrata.codegen.recipes import kernel_builder
from polystrata.codegen.recipes._matvec import NONNEG, QB, fmt_for, nonneg_mask, sum_partials, use_int8
from polystrata.ir.expr import Const, Expr, Var
from polystrata.ir.formats import QuantFormat
from polystrata.ir.kernel import Buf, Call, Decl, For, If, Kernel, Let, Load, LocalArray, Scalar, Select, Store

HALF = 16  # elements of an activation sum (`quantize_x_kernel`'s sums): the finest weight group taken


Gate = tuple[int, bool]  # `step_gate`'s condition on a step's row count T: (n, True) T > n, (n, False) T <= n


def step_gate(size: Expr, gate: Gate | tuple[Gate, ...] | None) -> Expr:
    """Grid extent `size`, kept in steps of more than `gate[0]` tokens (`gate[1]` true) or of at most that many
    (false), else 0: a launch of no groups is none, so the row count picks at run time which of two kernels runs.
    A tuple of such gates keeps it where all hold (a range of row counts)."""
    if gate is None:
        return size
    if isinstance(gate[0], tuple):
        for g in gate:
            size = step_gate(size, g)
        return size
    above, over = gate
    on = Var("T") - above if over else Const(above + 1) - Var("T")
    return size * Call("min", Const(1), Call("max", Const(0), on))


def gate_suffix(gate: Gate | tuple[Gate, ...] | None) -> str:
    """A kernel name's suffix for `step_gate`'s `gate`: "_gtN", "_leN", "_gtN_leM" ("" for none)."""
    if gate is None:
        return ""
    if isinstance(gate[0], tuple):
        return "".join(gate_suffix(g) for g in gate)
    return f"_{'gt' if gate[1] else 'le'}{gate[0]}"


@kernel_builder
def tile_matmul_kernel(name: str, fmts: Sequence[QuantFormat], n: int, k: int, *, rows: int, tokens: int,
                       epilogue: Callable[[list[Expr]], Expr] | None = None, contract: bool = False,
                       gate: tuple[int, bool] | None = None) -> Kernel:
    """y[t, r] = epilogue(dot(w_j[r], x[t]) for each weight j), weights [n, k] of formats `fmts`; grid
    (ceil(n / rows), ceil(T / tokens)), one lane: a group takes `rows` rows for a tile of `tokens` tokens, each
    weight block's lets decoded once for the tile. `contract`: `Kernel.contract`; `gate`: the steps it runs for
    (`step_gate`)."""
    rows = max(1, min(rows, n))
    wfs = [fmt_for(f) for f in fmts]
    wnames = [f"w{j}" for j in range(len(fmts))]
    params = (Buf("x", "f32"), *(Buf(w, weight_dtype(f)) for w, f in zip(wnames, fmts)), Buf("y", "f32", out=True),
              Scalar("T"))
    local = tuple(LocalArray(f"p{j}", "f32", tokens * wf.block_size) for j, wf in enumerate(wfs))
    row, t, b = Var("row"), Var("t"), Var("b")
    t0, nt = Var("t0"), Var("nt")
    per_row: list = []
    for j, (w, f, wf) in enumerate(zip(wnames, fmts, wfs)):
        bs, rb = wf.block_size, elements_per_row_bytes(f, k)
        p = f"p{j}"
        dec = Decoder(wf, w, Var(f"w{j}_wb"), f"w{j}_")

        def product(c, L, i0, env, lw, p=p, dec=dec, bs=bs):
            at = t * bs + (c + Var(i0))
            return [Store(p, at, Load(p, at) + dec.value(lw) * Load("x", Var("xo") + (c + Var(i0))))]

        # The block's lets (scales, offsets) once, then one loop over its elements for each token of the tile.
        walk = dec.walk(lambda s, size, env, inner: inner, product, fuse=True)
        lets = [st for st in walk if isinstance(st, Let)]
        loops = tuple(st for st in walk if not isinstance(st, Let))
        per_row += [
            For("i", Const(0), Const(tokens * bs), (Store(p, Var("i"), Const(0.0)),)),
            For("b", Const(0), Const(k // bs), (
                # Block base addresses masked non-negative, as matmul_kernel's CPU path has them (`_matvec.NONNEG`).
                Let(f"w{j}_wb", (row * rb + b * block_stride(wf)) & nonneg_mask(n * rb)),
                *lets,
                For("t", Const(0), nt, (Let("xo", ((t0 + t) * k + b * bs) & NONNEG), *loops)),
            )),
        ]
    sums = []
    for j, wf in enumerate(wfs):
        sums += [Decl(f"acc{j}", "f32", Const(0.0)),
                 *sum_partials(f"p{j}", t * wf.block_size, wf.block_size, f"acc{j}")]
    vals = [Var(f"acc{j}") for j in range(len(fmts))]
    per_row.append(For("t", Const(0), nt, (*sums, Store("y", (t0 + t) * n + row, epilogue(vals) if epilogue
                                                         else vals[0]))))
    body = (
        Let("t0", Var("g1") * tokens), Let("nt", Call("min", Const(tokens), Var("T") - t0)),
        For("rr", Const(0), Const(rows), (Let("row", Var("g0") * rows + Var("rr")), If(row < n, tuple(per_row)))),
    )
    grid = (Const(-(-n // rows)), step_gate((Var("T") + (tokens - 1)) // tokens, gate))
    return Kernel(name, params, grid, body, lanes=1, local=local, knobs=(("rows", rows), ("tokens", tokens),
                                                                         ("tile", 1), ("contract", int(contract))),
                  contract=contract,
                  doc=f"tile matmul {'+'.join(f.name for f in fmts)} [{n}x{k}]")


def q8_level_bias(fmt: QuantFormat) -> int | None:
    """What `tile_matmul_q8_kernel` adds to each level of `fmt` to store it as an unsigned byte (the negated least
    level, `format_analysis.level_range`, or 0), or None where the levels do not fit a byte that way."""
    r = level_range(fmt_for(fmt))
    if r is None:
        return None
    bias = max(0, -r[0])
    return bias if r[1] + bias <= 255 else None


def q8_tile_fits(fmts: Sequence[QuantFormat], k: int) -> bool:
    """Whether `tile_matmul_q8_kernel` takes weights of `fmts` with rows of `k`: every format on the int8 path
    (`_matvec.use_int8`), its finest group 16 or 32 elements (`dot_i8_pair`'s groups; the activation sums are per
    16), its levels bytes (`q8_level_bias`)."""
    if k % QB:
        return False
    for f in fmts:
        wf = fmt_for(f)
        if not use_int8(f, True) or weight_dtype(wf) != "u8" or finest_group(wf) not in (16, 32):
            return False
        if q8_level_bias(f) is None:
            return False
    return True


@kernel_builder
def tile_matmul_q8_kernel(name: str, fmts: Sequence[QuantFormat], n: int, k: int, *, rows: int, tokens: int,
                          epilogue: Callable[[list[Expr]], Expr] | None = None,
                          gate: tuple[int, bool] | None = None) -> Kernel:
    """y[t, r] = epilogue(dot(w_j[r], x[t]) for each weight j) from x quantized by `quantize_x_kernel` with sums
    (xq: int8 codes 4 a word, xd: a scale a 32 values, xs: the codes' sum a 16 values, scaled); grid (ceil(n /
    rows), ceil(T / tokens)), one lane. A group first decodes its `rows` rows: each level plus the format's bias
    (`q8_level_bias`) as a byte, each group's scale S, and for each 16 values M - bias * S (M the group's offset,
    or 0). Then for each pair of tokens of its tile and each row: one `dot_i8_pair` of the bytes and the codes,
    plus for each token the 16-value terms times the activations' sums. Formats: those `q8_tile_fits` takes.
    `gate`: the steps it runs for (`step_gate`)."""
    rows = max(1, min(rows, n))
    wfs = [fmt_for(f) for f in fmts]
    na, nh = k // QB, k // HALF
    full = na // CHUNK * CHUNK  # steps of a row in chunks (`chunked_byte`)
    params = (Buf("xq", "u32"), Buf("xd", "f32"), Buf("xs", "f32"),
              *(Buf(f"w{j}", weight_dtype(f)) for j, f in enumerate(fmts)), Buf("y", "f32", out=True), Scalar("T"))
    rr, b = Var("rr"), Var("b")
    t0, t, tk, tk1 = Var("t0"), Var("t"), Var("tk"), Var("tk1")
    local, decode, dots = [], [], []
    for j, (f, wf) in enumerate(zip(fmts, wfs)):
        bs, g, a, bias = wf.block_size, finest_group(wf), affine(wf), q8_level_bias(f)
        lv, sw, mw = f"lv{j}", f"sw{j}", f"mw{j}"
        sums = a.offset is not None or bias != 0  # 16-value terms
        local += [LocalArray(lv, "u8", rows * k), LocalArray(sw, "f32", rows * (k // g))]
        if sums:
            local.append(LocalArray(mw, "f32", rows * nh))
        rb = elements_per_row_bytes(f, k)
        dec = Decoder(wf, f"w{j}", Var(f"w{j}_wb"), f"w{j}_")

        def group(start, size, env, inner, dec=dec, a=a, g=g, bs=bs, sw=sw, mw=mw, sums=sums, bias=bias):
            scale = dec.group_expr(a.scale, start, env)
            gi = b * (bs // g) + start // g  # the group's index in its row
            if g == HALF:  # a chunk's first halves' scales, then its second halves' (`dot_i8_pair`)
                step = gi // 2
                inside = step // CHUNK * (2 * CHUNK) + gi % 2 * CHUNK + step % CHUNK
                gi = inside if full == na else Select(step < full, inside, gi)
            st = [Let(f"{sw}_s{start}", scale), Store(sw, rr * (k // g) + gi, Var(f"{sw}_s{start}"))]
            if sums:
                m = Const(0.0) if a.offset is None else dec.group_expr(a.offset, start, env)
                if bias:
                    m = m - Var(f"{sw}_s{start}") * float(bias)
                st += [Store(mw, rr * nh + b * (bs // HALF) + (start + h) // HALF, m) for h in range(0, g, HALF)]
            return [*st, *inner]

        def chunk(c, L, i0, env, lw, a=a, bs=bs, lv=lv, bias=bias):
            level = lw.expr(a.level)
            return [Store(lv, rr * k + chunked_byte(b * bs + (c + Var(i0)), k), level + bias if bias else level)]

        decode.append(For("b", Const(0), Const(k // bs), (
            # Block base addresses masked non-negative, as matmul_kernel's CPU path has them (`_matvec.NONNEG`).
            Let(f"w{j}_wb", (Var("rowc") * rb + b * block_stride(wf)) & nonneg_mask(n * rb)),
            *dec.walk(group, chunk),
        )))
        # Tokens t and t + 1 (the tile's last token again where t is): one call for both, the row's bytes and
        # scales loaded once for the two.
        here, next_ = t * rows + rr, (t + 1) * rows + rr
        dots.append(Store(f"r{j}", here, Call("dot_i8_pair", Var(f"r{j}"), next_, Var(lv), rr * k, Var("xq"),
                                              tk * k, tk1 * k, Var(sw), rr * (k // g), Var("xd"), tk * na, tk1 * na,
                                              Const(na), Const(g))))
        if sums:
            # dot_f32: a loop of this length is unrolled whole and left scalar, reassociation allowed or not.
            dots += [Store(f"r{j}", at, Load(f"r{j}", at) + Call("dot_f32", Var(mw), rr * nh, Var("xs"), tok * nh,
                                                                 Const(nh)))
                     for at, tok in ((here, tk), (next_, tk1))]
    row = Var("g0") * rows + rr
    body = [
        Let("t0", Var("g1") * tokens), Let("nt", Call("min", Const(tokens), Var("T") - t0)),
        # Rows past the last decode the last row (loads stay in bounds); their results are not stored.
        For("rr", Const(0), Const(rows), (Let("rowc", Call("min", row, Const(n - 1))), *decode)),
        For("tp", Const(0), (Var("nt") + 1) // 2, (
            Let("t", Var("tp") * 2), Let("tk", t0 + t), Let("tk1", t0 + Call("min", t + 1, Var("nt") - 1)),
            For("rr", Const(0), Const(rows), tuple(dots)),
        )),
    ]
    # The results of a tile (one token more: the last of an odd count is computed twice) in local arrays.
    local += [LocalArray(f"r{j}", "f32", (tokens + 1) * rows) for j in range(len(fmts))]
    if epilogue:
        i = Var("i")
        # One loop over the tile's results, in place, then the stores: a loop without branches over consecutive
        # values, which vectorizes where the activation is plain arithmetic (the CPU's tanh). A call into the C
        # library (exp, tanh) among the dot products spilled and reloaded their vector registers around each
        # call, ~20 ns a result (docs/benchmarks.md, "Prefill on the CPU: int8 tiles").
        body.append(For("i", Const(0), Var("nt") * rows, (Store("r0", i, epilogue([Load(f"r{j}", i)
                                                                                  for j in range(len(fmts))])),)))
    body.append(For("t", Const(0), Var("nt"), (For("rr", Const(0), Const(rows), (If(row < n, (Store(
        "y", (t0 + t) * n + row, Load("r0", t * rows + rr)),)),)),)))
    grid = (Const(-(-n // rows)), step_gate((Var("T") + (tokens - 1)) // tokens, gate))
    return Kernel(name, params, grid, tuple(body), lanes=1, local=tuple(local),
                  # int8: its activations are, so the tuner compares its outputs within its int8 tolerance
                  knobs=(("tile_q8_rows", rows), ("tile_q8", tokens), ("int8", 1)),
                  doc=f"tile matmul int8 {'+'.join(f.name for f in fmts)} [{n}x{k}]")

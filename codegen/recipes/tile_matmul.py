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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from polystrata.codegen.dequant import Decoder
from polystrata.codegen.format_analysis import block_stride, elements_per_row_bytes, weight_dtype
from polystrata.codegen.recipes import kernel_builder
from polystrata.codegen.recipes._matvec import NONNEG, fmt_for, nonneg_mask, sum_partials
from polystrata.ir.expr import Const, Expr, Var
from polystrata.ir.formats import QuantFormat
from polystrata.ir.kernel import Buf, Call, Decl, For, If, Kernel, Let, Load, LocalArray, Scalar, Store


@kernel_builder
def tile_matmul_kernel(name: str, fmts: Sequence[QuantFormat], n: int, k: int, *, rows: int, tokens: int,
                       epilogue: Callable[[list[Expr]], Expr] | None = None, contract: bool = False) -> Kernel:
    """y[t, r] = epilogue(dot(w_j[r], x[t]) for each weight j), weights [n, k] of formats `fmts`; grid
    (ceil(n / rows), ceil(T / tokens)), one lane: a group takes `rows` rows for a tile of `tokens` tokens, each
    weight block's lets decoded once for the tile. `contract`: `Kernel.contract`."""
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
    grid = (Const(-(-n // rows)), (Var("T") + (tokens - 1)) // tokens)
    return Kernel(name, params, grid, body, lanes=1, local=local, knobs=(("rows", rows), ("tokens", tokens),
                                                                         ("tile", 1), ("contract", int(contract))),
                  contract=contract,
                  doc=f"tile matmul {'+'.join(f.name for f in fmts)} [{n}x{k}]")

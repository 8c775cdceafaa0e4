"""Device storage layouts of the formats: blocks padded to an alignment, rows cut into slices, rows split into
codes and scales.

A layout is a `QuantFormat` derived from a GGUF one (`padded`, `sliced`, `split_rows`) that decodes the same;
`repack` lays a file's bytes out in it at upload, and `place_slices` moves a decoder's loads to where a sliced
layout keeps them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from polystrata.ir.expr import Bin, Const, Expr, FieldLoad, Var, i
from polystrata.ir.formats import SLICE, Field, GroupLet, QuantFormat
from polystrata.ir.kernel import Call, Load, rewrite


def padded(fmt: QuantFormat, align: int) -> QuantFormat:
    """`fmt` with each block padded with zero bytes to a multiple of `align` bytes (itself where it already is): a
    device storage layout, not a GGUF type, whose blocks, and so every field the format aligns, start aligned.
    `repack` lays GGUF data out in it."""
    nbytes = -(-fmt.block_bytes // align) * align
    if nbytes == fmt.block_bytes:
        return fmt
    pad = Field("pad", fmt.block_bytes, "u8", nbytes - fmt.block_bytes)
    return dataclasses.replace(fmt, name=f"{fmt.name}_A{align}", ggml_type=None, block_bytes=nbytes,
                               fields=(*fmt.fields, pad))


def sliced(fmt: QuantFormat, cols: int) -> QuantFormat:
    """`fmt` in rows of `cols` elements, each row's blocks cut into 16-byte slices and the slices transposed: slice
    s of block b at row offset (s * blocks + b) * 16. A device storage layout for formats whose blocks are whole
    slices (Q4_K: the header, then 8 slices of quants): where neighbouring lanes work on neighbouring blocks, the
    same slice of each lies side by side, so a warp's 16-byte loads cover whole cache lines (in the GGUF layout
    they touch a line per block). Rows keep their size and place; `repack` lays GGUF data out in it."""
    nb = cols // fmt.block_size
    if fmt.row_blocks or cols % fmt.block_size or fmt.block_bytes % SLICE:
        raise ValueError(f"{fmt.name} rows of {cols} cannot be sliced")
    return dataclasses.replace(fmt, name=f"{fmt.name}_S{nb}", ggml_type=None, row_blocks=nb)


def code_field(fmt: QuantFormat) -> Field | None:
    """The field holding `fmt`'s codes a byte an element where its scheme's code is that field at the element's
    index (q8_0, q8_g64), else None."""
    s = fmt.scheme
    code = fmt.let(s.code).expr if s is not None else None
    if not (isinstance(code, FieldLoad) and code.index == i):
        return None
    f = fmt.field(code.field)
    return f if f.dtype in ("i8", "u8") and f.count == fmt.block_size else None


def split_rows(fmt: QuantFormat, width: int) -> QuantFormat:
    """`fmt` in rows of `width` elements, each row one block: first the codes of all its blocks, then the other
    fields of its blocks (q8_0's and q8_g64's f16 scales), field by field. A device storage layout of the KV
    cache: in the GGUF layout the codes of 34- and 66-byte blocks sit behind each block's scale, 2-byte aligned,
    so kernels read them a byte at a time; here a row whose bytes are whole words keeps them in aligned words and
    its scales side by side. Same bytes a row, same values; `repack` lays GGUF blocks out in it. For formats whose
    codes are a byte an element (`code_field`)."""
    qf = code_field(fmt)
    if qf is None or fmt.row_blocks or width % fmt.block_size:
        raise ValueError(f"{fmt.name} rows of {width} cannot be split into codes and scales")
    bs, nb = fmt.block_size, width // fmt.block_size
    fields, off = [Field(qf.name, 0, qf.dtype, width)], width
    for f in fmt.fields:
        if f is not qf:
            fields.append(Field(f.name, off, f.dtype, f.count * nb))
            off += f.nbytes * nb

    def moved(e: Expr) -> Expr:  # a block's field element, as the row's: block i // bs, its element at i % bs
        if not isinstance(e, FieldLoad) or e.field == qf.name:
            return e
        at = rewrite(e.index, lambda x: x % bs if x == i else x)
        count = fmt.field(e.field).count
        first = i // bs * count if count > 1 else i // bs
        return FieldLoad(e.field, first if at == Const(0) else first + at)

    return dataclasses.replace(
        fmt, name=f"{fmt.name}_R{width}", ggml_type=None, block_size=width, block_bytes=off, fields=tuple(fields),
        lets=tuple(GroupLet(lt.name, rewrite(lt.expr, moved), lt.group) for lt in fmt.lets),
        value=rewrite(fmt.value, moved))


def _split_of(dst: QuantFormat, src: QuantFormat) -> bool:
    """Whether `dst` is `split_rows` of `src`."""
    return (dst.block_size % src.block_size == 0 and code_field(src) is not None
            and dst == split_rows(src, dst.block_size))


def _unsliced(fmt: QuantFormat) -> QuantFormat:
    """The layout a `sliced` format slices (itself when not sliced)."""
    if not fmt.row_blocks:
        return fmt
    return dataclasses.replace(fmt, name=fmt.name.rsplit("_S", 1)[0], row_blocks=0)


def slice_rows(raw: np.ndarray, fmt: QuantFormat, inverse: bool = False) -> np.ndarray:
    """Bytes of whole rows of sliced `fmt` from its unsliced layout (`inverse`: back)."""
    shape = (-1, fmt.row_blocks, fmt.block_bytes // SLICE, SLICE)
    if inverse:
        shape = (shape[0], shape[2], shape[1], shape[3])
    rows = np.asarray(raw).reshape(-1).view(np.uint8).reshape(shape)
    return np.ascontiguousarray(rows.transpose(0, 2, 1, 3)).reshape(-1)


def repack(raw: np.ndarray, src: QuantFormat, dst: QuantFormat) -> np.ndarray:
    """The blocks of `src` data (its raw bytes) laid out as `dst`, a `padded` and/or `sliced` form of `src` (each
    block's bytes, then zeros; then, where sliced, each row's slices transposed) or its `split_rows`."""
    if dst.row_blocks:
        return slice_rows(repack(raw, src, _unsliced(dst)), dst)
    if dst.name == src.name:
        return raw
    if _split_of(dst, src):  # each row's blocks field by field, in the layout's order
        blocks = np.asarray(raw).reshape(-1).view(np.uint8).reshape(-1, dst.block_size // src.block_size,
                                                                    src.block_bytes)
        parts = [blocks[:, :, f.offset:f.offset + f.nbytes] for f in (src.field(g.name) for g in dst.fields)]
        return np.concatenate([p.reshape(p.shape[0], -1) for p in parts], axis=1).reshape(-1)
    if dst.fields[: len(src.fields)] != src.fields or dst.block_size != src.block_size:
        raise ValueError(f"{dst.name} is not a padded layout of {src.name}")
    blocks = np.asarray(raw).reshape(-1).view(np.uint8).reshape(-1, src.block_bytes)
    out = np.zeros((blocks.shape[0], dst.block_bytes), np.uint8)
    out[:, : src.block_bytes] = blocks
    return out.reshape(-1)


def place_slices(stmts, buf: str, base: Expr, fmt: QuantFormat):
    """`stmts` with each load of `buf` at `base + off` (`off` a byte offset inside a block of `fmt`, as the
    decoders address fields) moved to where a `sliced` layout keeps that byte: `base + (off // 16) * S + off % 16`
    for a row of S / 16 blocks (`base` is then the block's first slice). Where `off` is a constant plus multiples
    of 16 (a lane's run starting on a slice) the result is folded to the same form, so addresses stay a base plus
    constants and lane terms (what wide loads and alignment proofs need); otherwise it is computed at run time.
    Unsliced formats: `stmts` as they are."""
    if not fmt.row_blocks:
        return stmts
    stride = fmt.row_blocks * SLICE

    def place(off: Expr) -> Expr:
        lin = _linear(off)
        if lin is not None and all(c % SLICE == 0 for c in lin[1].values()):
            k, terms = lin
            out: Expr = Const(k // SLICE * stride + k % SLICE)
            for t, c in terms.items():
                out = out + t * (c // SLICE * stride)
            return out
        return (off // SLICE) * stride + off % SLICE

    def addr(a: Expr) -> Expr:
        if a == base:
            return a
        if isinstance(a, Bin) and a.op == "+" and a.a == base:
            return base + place(a.b)
        raise ValueError(f"{fmt.name}: a load of {buf} at {a!r}, not at the block base plus an offset")

    def fn(e):
        if isinstance(e, Load) and e.buf == buf:
            return Load(buf, addr(e.index), e.align)
        if isinstance(e, Call) and e.fn == "load_u32" and e.args[0] == Var(buf):
            return Call("load_u32", e.args[0], addr(e.args[1]), e.args[2])
        return e

    return rewrite(stmts, fn)


def _linear(e: Expr) -> tuple[int, dict] | None:
    """`e` as (constant, {term: coefficient}): a sum of integer multiples of subexpressions taken whole (any but
    sums, differences and products with a constant); None where a constant in it is not an integer."""
    if isinstance(e, Const):
        return (e.value, {}) if isinstance(e.value, int) and not isinstance(e.value, bool) else None
    if isinstance(e, Bin) and e.op in ("+", "-"):
        a, b = _linear(e.a), _linear(e.b)
        if a is None or b is None:
            return None
        sign = 1 if e.op == "+" else -1
        terms = dict(a[1])
        for t, c in b[1].items():
            terms[t] = terms.get(t, 0) + sign * c
        return a[0] + sign * b[0], {t: c for t, c in terms.items() if c}
    if isinstance(e, Bin) and e.op == "*":
        for x, y in ((e.a, e.b), (e.b, e.a)):
            if isinstance(y, Const) and isinstance(y.value, int) and not isinstance(y.value, bool):
                lin = _linear(x)
                return None if lin is None else (lin[0] * y.value, {t: c * y.value for t, c in lin[1].items()})
    return 0, {e: 1}

"""The generic encoder: float32 -> blocks of any format with a `Scheme`, by inverting its bit-slice code form.

The code let of a scheme is read as slices `(FieldLoad(f, idx) >> shift) & mask` placed at bit positions of the
code (`_slices`); packing writes each code's bits back into those slices. Scales come from each group's range.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from polystrata.errors import UnsupportedError
from polystrata.ir.evaluate import CHUNK_ELEMENTS
from polystrata.ir.expr import PY_OPS, TABLES, Bin, Const, Expr, FieldLoad, Select, Var
from polystrata.ir.formats import FIELD_DTYPES, INT_DTYPES, GroupParam, QuantFormat, row_bytes


def _index_value(fmt: QuantFormat, e: Expr, i_val: int) -> int | bool:
    """Concrete value of an expression that depends only on `i` (indices, shifts, conditions)."""
    if isinstance(e, Const):
        return e.value
    if isinstance(e, Var):
        return i_val if e.name == "i" else _index_value(fmt, fmt.let(e.name).expr, i_val)
    if isinstance(e, Bin):
        a, b = _index_value(fmt, e.a, i_val), _index_value(fmt, e.b, i_val)
        return PY_OPS[e.op](a, b)
    if isinstance(e, Select):
        return _index_value(fmt, e.a if _index_value(fmt, e.cond, i_val) else e.b, i_val)
    raise UnsupportedError(f"{fmt.name}: {type(e).__name__} where an index-only expression is needed")


@dataclass(frozen=True)
class _Slice:
    field: str
    elem: int  # element of the field
    shift: int  # bit position within that element
    width: int
    code_pos: int  # bit position within the code
    signed: bool


def _slices(fmt: QuantFormat, e: Expr, i_val: int, pos: int = 0) -> list[_Slice]:
    if isinstance(e, Var) and e.name != "i":
        return _slices(fmt, fmt.let(e.name).expr, i_val, pos)
    if isinstance(e, Select):
        return _slices(fmt, e.a if _index_value(fmt, e.cond, i_val) else e.b, i_val, pos)
    if isinstance(e, Bin) and e.op == "|":
        return _slices(fmt, e.a, i_val, pos) + _slices(fmt, e.b, i_val, pos)
    if isinstance(e, Bin) and e.op == "<<":
        return _slices(fmt, e.a, i_val, pos + _index_value(fmt, e.b, i_val))
    if isinstance(e, FieldLoad):
        f = fmt.field(e.field)
        width = 8 * np.dtype(FIELD_DTYPES[f.dtype]).itemsize
        return [_Slice(f.name, _index_value(fmt, e.index, i_val), 0, width, pos, f.dtype == "i8")]
    if isinstance(e, Bin) and e.op == "&" and isinstance(e.b, Const):
        width = int(e.b.value + 1).bit_length() - 1
        if (1 << width) - 1 == e.b.value:
            src, shift = e.a, 0
            if isinstance(src, Bin) and src.op == ">>":
                src, shift = src.a, _index_value(fmt, src.b, i_val)
            if isinstance(src, FieldLoad):
                return [_Slice(src.field, _index_value(fmt, src.index, i_val), shift, width, pos, False)]
    raise UnsupportedError(f"{fmt.name}: code expression is not in bit-slice form: {e!r}")


@functools.cache
def _code_layout(fmt: QuantFormat, let_name: str):
    """(offset, (lo, hi) code range, slice groups) of an integer code let, for packing."""
    lt = fmt.let(let_name)
    e, offset = lt.expr, 0
    if isinstance(e, Bin) and e.op in "+-" and isinstance(e.b, Const):
        e, offset = e.a, (e.b.value if e.op == "-" else -e.b.value)
    rows, ranges = [], set()
    for p in range(fmt.block_size // lt.group):
        sl = _slices(fmt, e, p * lt.group)
        nbits = max(s.code_pos + s.width for s in sl)
        signed = any(s.signed for s in sl)
        ranges.add((-(1 << (nbits - 1)), (1 << (nbits - 1)) - 1) if signed else (0, (1 << nbits) - 1))
        rows += [(s, p) for s in sl]
    if len(ranges) != 1:
        raise UnsupportedError(f"{fmt.name}: code {let_name} has a different width per position")
    lo, hi = ranges.pop()
    # Within one (field, shift, width, code_pos) class each field element is written once: vectorizable.
    classes: dict[tuple, list[tuple[int, int]]] = {}
    for s, p in rows:
        classes.setdefault((s.field, s.shift, s.width, s.code_pos), []).append((p, s.elem))
    groups = tuple((key, np.array([p for p, _ in v]), np.array([el for _, el in v])) for key, v in classes.items())
    return offset, (lo - offset, hi - offset), groups


def code_range(fmt: QuantFormat, let_name: str) -> tuple[int, int]:
    """Smallest and largest value the integer code let `let_name` can take."""
    return _code_layout(fmt, let_name)[1]


def levels(fmt: QuantFormat) -> np.ndarray:
    """The values a code can decode to before `step`/`min` (sorted, float64)."""
    s = fmt.scheme
    if s is None:
        raise UnsupportedError(f"{fmt.name} has no quantization levels")
    if s.table is not None:
        return np.array(TABLES[s.table], dtype=np.float64)
    lo, hi = code_range(fmt, s.code)
    return np.arange(lo, hi + 1, dtype=np.float64)


def error_bound_steps(fmt: QuantFormat) -> float:
    """Worst-case |dequantize(quantize(x)) - x| of round-to-nearest, in units of the element's |step|.

    Affine groups cover [min, max] exactly, so half a step. Symmetric groups map x/step into
    [-|anchor|, |anchor|]: the bound is half the widest gap between levels or how far that interval reaches
    beyond the outermost levels (Q4_0's -8..7 levels with anchor -8 give 1 step for x = -max).
    """
    s = fmt.scheme
    if s is None:
        return 0.0
    lv = levels(fmt)
    half_gap = float(np.max(np.diff(lv))) / 2
    if s.min is not None:
        return half_gap
    a = abs(s.anchor)
    return max(half_gap, a - lv[-1], lv[0] + a)


def _f16_away(v: np.ndarray) -> np.ndarray:
    """Nearest f16 with magnitude >= |v| (so a stored scale never shrinks the covered range)."""
    h = v.astype(np.float16)
    short = np.abs(h.astype(np.float64)) < np.abs(v)
    h[short] = np.nextafter(h[short], np.copysign(np.inf, v[short]).astype(np.float16))
    return h


def _f16_down(v: np.ndarray) -> np.ndarray:
    """Largest f16 <= v (a stored min must not rise above the group's minimum)."""
    h = v.astype(np.float16)
    high = h.astype(np.float64) > v
    h[high] = np.nextafter(h[high], np.float16(-np.inf))
    return h


def _store_param(fmt: QuantFormat, p: GroupParam, target: np.ndarray, ints: dict, floats: dict) -> np.ndarray:
    """Store per-group `target` (n, groups) as `p`, rounding magnitudes up; return the decoded float32."""
    if p.code is None:
        if target.shape[1] != 1:
            raise UnsupportedError(f"{fmt.name}: a direct f16 parameter needs one group per block")
        h = _f16_away(target[:, 0])
        floats[p.field] = h
        return h.astype(np.float32)[:, None]
    lo, hi = code_range(fmt, p.code)
    sup = _f16_away(np.abs(target).max(axis=1) / hi)
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.sign(target) * np.ceil(np.abs(target) / sup.astype(np.float64)[:, None])
    codes = np.clip(np.nan_to_num(codes), lo, hi).astype(np.int64)
    floats[p.field] = sup
    ints[p.code] = codes
    # Same float32 operations as the decoder: f32(super) * f32(code).
    return sup.astype(np.float32)[:, None] * codes.astype(np.float32)


def _encode_blocks(fmt: QuantFormat, xb: np.ndarray) -> np.ndarray:
    s = fmt.scheme
    n = xb.shape[0]
    xg = xb.astype(np.float64).reshape(n, fmt.block_size // s.group, s.group)
    ints: dict[str, np.ndarray] = {}
    floats: dict[str, np.ndarray] = {}
    lv = levels(fmt)
    if s.min is None:
        amax_at = np.abs(xg).argmax(axis=-1)[..., None]
        peak = np.take_along_axis(xg, amax_at, axis=-1)[..., 0]
        ideal = (np.abs(peak) if s.anchor > 0 else peak) / s.anchor
        mins = np.zeros((n, 1), dtype=np.float32)
    else:
        lo_x = xg.min(axis=-1)
        if s.min.code is None:  # min stored as is (Q4_1): round down so it stays <= the group minimum
            h = _f16_down(lo_x[:, 0])
            floats[s.min.field] = h
            mins = h.astype(np.float32)[:, None]
        else:  # K-quants: min = -(dmin * code) with code >= 0, so only non-positive mins are representable
            mins = s.min.sign * _store_param(fmt, s.min, np.maximum(s.min.sign * lo_x, 0.0), ints, floats)
        ideal = (xg.max(axis=-1) - mins) / lv[-1]
    steps = _store_param(fmt, s.step, ideal, ints, floats).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = (xg - mins[..., None]) / steps[..., None]
    r = np.where(steps[..., None] == 0, 0.0, r)
    if s.table is None:
        q = np.clip(np.rint(r), lv[0], lv[-1])
    else:
        q = np.searchsorted((lv[1:] + lv[:-1]) / 2, r)
    ints[s.code] = q.reshape(n, fmt.block_size).astype(np.int64)
    return _pack(fmt, ints, floats, n)


def _pack(fmt: QuantFormat, ints: dict, floats: dict, n: int) -> np.ndarray:
    acc = {f.name: np.zeros((n, f.count), dtype=np.int64) for f in fmt.fields if f.dtype in INT_DTYPES}
    for name, codes in ints.items():
        offset, _, groups = _code_layout(fmt, name)
        stored = codes + offset
        for (field, shift, width, code_pos), pos, elems in groups:
            acc[field][:, elems] |= ((stored[:, pos] >> code_pos) & ((1 << width) - 1)) << shift
    out = np.zeros((n, fmt.block_bytes), dtype=np.uint8)
    for f in fmt.fields:
        dt = np.dtype(FIELD_DTYPES[f.dtype])
        if f.name in floats:
            vals = floats[f.name].astype(dt).reshape(n, f.count)
        else:
            unsigned = np.dtype(f"<u{dt.itemsize}")
            vals = (acc[f.name] & ((1 << 8 * dt.itemsize) - 1)).astype(unsigned)
        out[:, f.offset:f.offset + f.nbytes] = vals.view(np.uint8).reshape(n, f.nbytes)
    return out


def _to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits, round to nearest even; NaNs stay (quiet) NaNs."""
    u = x.view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, (u >> 16) | 0x40, rounded).astype(np.uint16)


def quantize(fmt: QuantFormat, x: np.ndarray) -> np.ndarray:
    """Encode float32 `x` (last dim a multiple of the block size) to bytes shaped (..., row_bytes).

    Round-to-nearest with scales chosen from each group's range (see `Scheme` and `error_bound_steps`).
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    rb = row_bytes(fmt, x.shape[-1] if x.ndim else 1)
    xb = x.reshape(-1, fmt.block_size)
    if fmt.scheme is None:
        dt = fmt.fields[0].dtype
        if dt == "bf16":
            out = _to_bf16_bits(xb)
        elif dt == "i32":
            out = np.rint(xb).astype("<i4")
        else:
            out = xb.astype(FIELD_DTYPES[dt])
        return out.view(np.uint8).reshape(x.shape[:-1] + (rb,))
    out = np.empty((xb.shape[0], fmt.block_bytes), dtype=np.uint8)
    step = max(1, CHUNK_ELEMENTS // 4 // fmt.block_size)  # float64 temporaries: smaller chunks
    for s in range(0, xb.shape[0], step):
        out[s:s + step] = _encode_blocks(fmt, xb[s:s + step])
    return out.reshape(x.shape[:-1] + (rb,))

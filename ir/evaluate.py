"""The numpy evaluator of format expressions: decodes blocks of any `QuantFormat` (the oracle for every target).

Lets are evaluated once per group, as kernels hoist them, over arrays shaped (blocks, groups..., elements).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from polystrata.errors import GGUFError, UnsupportedError
from polystrata.ir.expr import TABLES, Bin, Const, Expr, FieldLoad, Select, Table, ToF32, Var
from polystrata.ir.formats import FIELD_DTYPES, GroupParam, QuantFormat, f16, tensor_bytes
from polystrata.ir.layout import slice_rows

CHUNK_ELEMENTS = 1 << 18  # keeps temporaries cache-friendly and memory bounded
_TABLE_ARRAYS = {k: np.array(v, dtype=np.int32) for k, v in TABLES.items()}
_NP_OPS = {
    "+": np.add, "-": np.subtract, "*": np.multiply, "//": np.floor_divide, "%": np.remainder,
    ">>": np.right_shift, "<<": np.left_shift, "&": np.bitwise_and, "|": np.bitwise_or,
    "<": np.less, "<=": np.less_equal, "==": np.equal, "!=": np.not_equal,
}


@functools.cache
def _axes(fmt: QuantFormat) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Nested group sizes (block, ..., 1) and the element axes they induce, e.g. (256, 32, 1) -> (8, 32)."""
    groups = tuple(sorted({fmt.block_size, 1, *(lt.group for lt in fmt.lets)}, reverse=True))
    return groups, tuple(a // b for a, b in zip(groups, groups[1:]))


def _index_arrays(fmt: QuantFormat) -> dict[int, np.ndarray]:
    """For each group size, `i` of each group's first element, shaped to broadcast over the element axes."""
    groups, axes = _axes(fmt)
    k = len(axes)
    out = {groups[0]: np.zeros((1,) + (1,) * k, dtype=np.int32)}
    acc = out[groups[0]]
    for m in range(1, len(groups)):
        shape = [1] * (k + 1)
        shape[m] = axes[m - 1]
        acc = acc + (np.arange(axes[m - 1], dtype=np.int32) * groups[m]).reshape(shape)
        out[groups[m]] = acc
    return out


def _block_fields(fmt: QuantFormat, blocks: np.ndarray) -> dict[str, np.ndarray]:
    out = {}
    for f in fmt.fields:
        raw = np.ascontiguousarray(blocks[:, f.offset:f.offset + f.nbytes]).view(FIELD_DTYPES[f.dtype])
        if f.dtype == "u32":
            raw = raw.view("<i4")  # int32 math; shifts and masks see the same bits
        elif f.dtype in ("u8", "i8", "u16"):
            raw = raw.astype(np.int32)
        out[f.name] = raw
    return out


def _ev(e: Expr, env: dict, fields: dict, n: int, ndim: int):
    if isinstance(e, Const):
        return np.int32(e.value) if isinstance(e.value, int) else np.float32(e.value)
    if isinstance(e, Var):
        return env[e.name]
    if isinstance(e, FieldLoad):
        arr = fields[e.field]
        idx = np.asarray(_ev(e.index, env, fields, n, ndim))
        if idx.ndim == 0:
            return arr[:, int(idx)].reshape((n,) + (1,) * (ndim - 1))
        if idx.shape[0] == 1:  # same index in every block: a plain gather (or none for field[i])
            if idx.size == arr.shape[1] and np.array_equal(idx.ravel(), np.arange(idx.size)):
                return arr.reshape((n,) + idx.shape[1:])
            return arr[:, idx[0]]
        idx = np.broadcast_to(idx, (n,) + idx.shape[1:])
        return np.take_along_axis(arr, idx.reshape(n, -1), axis=1).reshape(idx.shape)
    if isinstance(e, Bin):
        return _NP_OPS[e.op](_ev(e.a, env, fields, n, ndim), _ev(e.b, env, fields, n, ndim))
    if isinstance(e, Select):
        c = _ev(e.cond, env, fields, n, ndim)
        return np.where(c, _ev(e.a, env, fields, n, ndim), _ev(e.b, env, fields, n, ndim))
    if isinstance(e, ToF32):
        a = np.asarray(_ev(e.a, env, fields, n, ndim))
        if a.dtype == np.uint16:  # bf16 loads are carried as raw bits
            return (a.astype(np.uint32) << np.uint32(16)).view(np.float32)
        return a.astype(np.float32)
    if isinstance(e, Table):
        return _TABLE_ARRAYS[e.name][_ev(e.index, env, fields, n, ndim)]
    raise TypeError(f"not an expression: {e!r}")


def _evaluate(fmt: QuantFormat, blocks: np.ndarray, exprs: Sequence[Expr], hoist: bool = True) -> list:
    """Evaluate per-element `exprs` over (n_blocks, block_bytes) bytes -> list of (n_blocks, block_size)."""
    n = blocks.shape[0]
    groups, axes = _axes(fmt)
    index = _index_arrays(fmt)
    fields = _block_fields(fmt, blocks)
    ndim = len(axes) + 1
    env: dict = {}
    for lt in fmt.lets:
        env["i"] = index[lt.group if hoist else 1]
        env[lt.name] = _ev(lt.expr, env, fields, n, ndim)
    env["i"] = index[1]
    full = (n,) + axes
    return [np.broadcast_to(_ev(e, env, fields, n, ndim), full).reshape(n, fmt.block_size) for e in exprs]


def _blocks_of(fmt: QuantFormat, raw: np.ndarray, shape) -> tuple[np.ndarray, tuple[int, ...]]:
    raw = np.asarray(raw)
    if raw.dtype != np.uint8:
        raw = raw.view(np.uint8)
    if shape is None:
        if raw.ndim == 0 or raw.shape[-1] % fmt.block_bytes:
            raise GGUFError(f"{fmt.name}: rows of {raw.shape[-1:]} bytes are not whole blocks")
        shape = raw.shape[:-1] + (raw.shape[-1] // fmt.block_bytes * fmt.block_size,)
    shape = (int(shape),) if np.isscalar(shape) else tuple(int(s) for s in shape)
    want = tensor_bytes(fmt, shape)
    if raw.size != want:
        raise GGUFError(f"{fmt.name} tensor of shape {shape} needs {want} bytes, got {raw.size}")
    if fmt.row_blocks:
        raw = slice_rows(raw, fmt, inverse=True)
    return raw.reshape(-1, fmt.block_bytes), shape


def dequantize(fmt: QuantFormat, raw: np.ndarray, shape: int | Sequence[int] | None = None,
               *, hoist: bool = True) -> np.ndarray:
    """Decode `raw` bytes of format `fmt` to float32 of `shape` (default: rows = last dim of `raw`).

    Bit-identical to gguf-py. `hoist=False` evaluates every let per element (a check on the declared
    groups; results must not change).
    """
    if fmt.value is None:
        raise UnsupportedError(f"{fmt.name} tensors hold raw integers and cannot be dequantized")
    blocks, shape = _blocks_of(fmt, raw, shape)
    out = np.empty((blocks.shape[0], fmt.block_size), dtype=np.float32)
    step = max(1, CHUNK_ELEMENTS // fmt.block_size)
    with np.errstate(invalid="ignore", over="ignore"):  # inf/nan scales decode to inf/nan, as in ggml
        for s in range(0, blocks.shape[0], step):
            out[s:s + step] = _evaluate(fmt, blocks[s:s + step], [fmt.value], hoist)[0]
    return out.reshape(shape)


def _param_expr(p: GroupParam) -> Expr:
    e = f16(p.field) if p.code is None else f16(p.field) * ToF32(Var(p.code))
    return e if p.sign == 1 else Const(0.0) - e


def element_steps(fmt: QuantFormat, raw: np.ndarray, shape=None) -> tuple[np.ndarray, np.ndarray]:
    """Per element, the decoded group `step` and `min` of the scheme (for error bounds and diagnostics)."""
    if fmt.scheme is None:
        raise UnsupportedError(f"{fmt.name} has no quantization step")
    blocks, shape = _blocks_of(fmt, raw, shape)
    s = fmt.scheme
    mn = _param_expr(s.min) if s.min is not None else Const(0.0)
    step, mins = _evaluate(fmt, blocks, [_param_expr(s.step), mn])
    return step.reshape(shape), mins.reshape(shape)

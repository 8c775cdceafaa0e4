"""The GGUF writer: `write_gguf`, atomic (temp file, fsync, rename), refusing what llama.cpp would reject.

The file layout is described in `polystrata/gguf.py`, whose definitions (value types, limits) it shares.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from polystrata.errors import GGUFError
from polystrata.gguf import (
    _ARRAY_DTYPES,
    _INT_TYPES,
    _SCALAR_STRUCTS,
    _U32,
    _U64,
    _VT,
    DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGUF_VERSION,
    MAX_ARRAY_DEPTH,
    MAX_DIMS_WRITE,
    MAX_TENSOR_NAME_BYTES,
    GGUFValueType,
    _align_up,
    _q,
)
from polystrata.ir.formats import by_ggml_type
from polystrata.paths import atomic_file

__all__ = ["write_gguf"]

_DTYPE_TO_VT: dict[np.dtype, GGUFValueType] = {
    np.dtype(np.uint8): _VT.UINT8,
    np.dtype(np.int8): _VT.INT8,
    np.dtype(np.uint16): _VT.UINT16,
    np.dtype(np.int16): _VT.INT16,
    np.dtype(np.uint32): _VT.UINT32,
    np.dtype(np.int32): _VT.INT32,
    np.dtype(np.float32): _VT.FLOAT32,
    np.dtype(np.bool_): _VT.BOOL,
    np.dtype(np.uint64): _VT.UINT64,
    np.dtype(np.int64): _VT.INT64,
    np.dtype(np.float64): _VT.FLOAT64,
}

# ggml type ids whose elements are plain numbers, so the writer can accept (and convert) arrays of
# any compatible numeric dtype instead of raw bytes.
_NATIVE_TENSOR_DTYPES: dict[int, np.dtype] = {
    0: np.dtype("<f4"),  # F32
    1: np.dtype("<f2"),  # F16
    24: np.dtype("<i1"),  # I8
    25: np.dtype("<i2"),  # I16
    26: np.dtype("<i4"),  # I32
    27: np.dtype("<i8"),  # I64
    28: np.dtype("<f8"),  # F64
}


def _format_and_id(fmt: Any) -> tuple[Any, int]:
    """Resolve `fmt` (ggml type id, format name, or format object) to (format object, type id)."""
    if isinstance(fmt, int | np.integer) and not isinstance(fmt, bool):
        return by_ggml_type(int(fmt)), int(fmt)
    for attr in ("ggml_type", "type_id"):
        tid = getattr(fmt, attr, None)
        if isinstance(tid, int | np.integer) and not isinstance(tid, bool):
            return by_ggml_type(int(tid)), int(tid)
    # The format contract only promises `.name`, so find the id by name among the known ids.
    wanted = fmt if isinstance(fmt, str) else getattr(fmt, "name", None)
    if isinstance(wanted, str):
        tid = _ids_by_name().get(wanted.upper())
        if tid is not None:
            return by_ggml_type(tid), tid
    raise GGUFError(f"unknown tensor format {fmt!r}")


_NAME_TO_ID: dict[str, int] = {}


def _ids_by_name() -> dict[str, int]:
    if not _NAME_TO_ID:
        # ggml type ids are small (below 64 in every release so far).
        for tid in range(64):
            try:
                f = by_ggml_type(tid)
            except (GGUFError, KeyError, ValueError, IndexError):
                continue  # not a known id
            _NAME_TO_ID.setdefault(str(f.name).upper(), tid)
    return _NAME_TO_ID


def _infer_scalar_type(value: Any, key: str) -> GGUFValueType:
    if isinstance(value, bool | np.bool_):
        return _VT.BOOL
    if isinstance(value, np.generic):
        vt = _DTYPE_TO_VT.get(value.dtype)
        if vt is None:
            raise GGUFError(f"metadata {_q(key)}: numpy {value.dtype} has no GGUF value type")
        return vt
    if isinstance(value, int):
        if 0 <= value < 2**32:
            return _VT.UINT32
        if -(2**63) <= value < 2**63:
            return _VT.INT64
        if 0 <= value < 2**64:
            return _VT.UINT64
        raise GGUFError(f"metadata {_q(key)}: integer {value} does not fit in 64 bits")
    if isinstance(value, float):
        return _VT.FLOAT32
    if isinstance(value, str):
        return _VT.STRING
    if isinstance(value, list | tuple | np.ndarray):
        return _VT.ARRAY
    raise GGUFError(f"metadata {_q(key)}: cannot store a {type(value).__name__} in GGUF")


def _infer_element_type(items: Any, key: str) -> GGUFValueType:
    if isinstance(items, np.ndarray):
        vt = _DTYPE_TO_VT.get(items.dtype.newbyteorder("="))
        if vt is None:
            if items.dtype.kind in "US":
                return _VT.STRING
            raise GGUFError(f"metadata {_q(key)}: numpy {items.dtype} arrays have no GGUF element type")
        return vt
    if len(items) == 0:
        return _VT.INT32  # any element type is valid for an empty array; INT32 matches "list of ints"
    if all(isinstance(x, str) for x in items):
        return _VT.STRING
    if all(isinstance(x, list | tuple | np.ndarray) for x in items):
        return _VT.ARRAY
    if all(isinstance(x, bool | np.bool_) for x in items):
        return _VT.BOOL
    if all(isinstance(x, int | np.integer) and not isinstance(x, bool | np.bool_) for x in items):
        return _VT.INT32 if all(-(2**31) <= x < 2**31 for x in items) else _VT.INT64
    if all(isinstance(x, int | float | np.integer | np.floating) and not isinstance(x, bool) for x in items):
        return _VT.FLOAT32
    raise GGUFError(f"metadata {_q(key)}: array mixes element kinds that GGUF cannot store together")


def _encode_string(out: bytearray, s: Any, key: str) -> None:
    if not isinstance(s, str):
        raise GGUFError(f"metadata {_q(key)}: expected a str, got {type(s).__name__}")
    b = s.encode("utf-8", "surrogateescape")  # mirror of the reader, so odd tokens round-trip
    out += _U64.pack(len(b))
    out += b


def _encode_array(out: bytearray, items: Any, etype: GGUFValueType | None, key: str, depth: int) -> None:
    if depth >= MAX_ARRAY_DEPTH:
        raise GGUFError(f"metadata {_q(key)}: arrays nested more than {MAX_ARRAY_DEPTH} deep")
    if not isinstance(items, list | tuple | np.ndarray):
        raise GGUFError(f"metadata {_q(key)}: expected an array, got {type(items).__name__}")
    if isinstance(items, np.ndarray) and items.ndim != 1:
        raise GGUFError(f"metadata {_q(key)}: arrays must be 1-D, got shape {items.shape}")
    if etype is None:
        etype = _infer_element_type(items, key)
    out += _U32.pack(etype)
    out += _U64.pack(len(items))
    if etype == _VT.STRING:
        for s in items:
            _encode_string(out, str(s) if isinstance(s, np.str_) else s, key)
    elif etype == _VT.ARRAY:
        for sub in items:
            _encode_array(out, sub, None, key, depth + 1)
    else:
        dt = _ARRAY_DTYPES[etype]
        try:
            arr = np.asarray(items)
            if etype == _VT.BOOL:
                arr = arr.astype(bool)
            elif dt.kind in "iu" and arr.dtype.kind not in "iub":
                raise TypeError  # no silent truncation of floats (or parsing of strings) into ints
            elif arr.dtype.kind in "iu" and dt.kind in "iu" and arr.size:
                info = np.iinfo(dt)
                if arr.min() < info.min or arr.max() > info.max:
                    raise OverflowError
            out += arr.astype(dt).tobytes()
        except (OverflowError, ValueError, TypeError):
            raise GGUFError(f"metadata {_q(key)}: values do not fit GGUF element type {etype.name}") from None


def _encode_kv(out: bytearray, key: str, value: Any, vtype: GGUFValueType | None) -> None:
    _encode_string(out, key, key)
    is_array = isinstance(value, list | tuple | np.ndarray)
    if vtype is None:
        vtype = _infer_scalar_type(value, key)
    elif is_array and vtype != _VT.ARRAY:
        # A scalar type given for an array value names its element type.
        out += _U32.pack(_VT.ARRAY)
        _encode_array(out, value, vtype, key, 0)
        return
    out += _U32.pack(vtype)
    if vtype == _VT.ARRAY:
        _encode_array(out, value, None, key, 0)
    elif vtype == _VT.STRING:
        _encode_string(out, value, key)
    else:
        if is_array:
            raise GGUFError(f"metadata {_q(key)}: an array cannot be stored as {vtype.name}")
        if vtype == _VT.BOOL:
            value = 1 if value else 0
        elif vtype in _INT_TYPES and not isinstance(value, int | np.integer):
            raise GGUFError(f"metadata {_q(key)}: {value!r} is not an integer ({vtype.name})")
        try:
            out += _SCALAR_STRUCTS[vtype].pack(value)
        except (struct.error, OverflowError, TypeError):
            raise GGUFError(f"metadata {_q(key)}: {value!r} does not fit {vtype.name}") from None


_TensorSpec = tuple[str, tuple[int, ...], Any, int, int, Any]  # name, shape, fmt, type id, nbytes, data


def _tensor_payload(spec: _TensorSpec) -> np.ndarray:
    name, shape, _fmt, type_id, nbytes, data = spec
    if callable(data):
        data = data()
    if isinstance(data, bytes | bytearray | memoryview):
        arr = np.frombuffer(data, dtype=np.uint8)
    else:
        arr = np.asarray(data)
    if arr.dtype != np.uint8:
        native = _NATIVE_TENSOR_DTYPES.get(type_id)
        if native is None:
            raise GGUFError(f"tensor {_q(name)}: quantized data must be raw uint8 bytes, got {arr.dtype}")
        if arr.shape != shape:
            raise GGUFError(f"tensor {_q(name)}: data has shape {arr.shape}, expected {shape}")
        try:
            arr = arr.astype(native, casting="same_kind", copy=False)
        except TypeError:
            raise GGUFError(f"tensor {_q(name)}: cannot store {arr.dtype} data as {native}") from None
    arr = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    if arr.size != nbytes:
        raise GGUFError(f"tensor {_q(name)}: data has {arr.size} bytes, expected {nbytes} for shape {shape}")
    return arr


def write_gguf(
    path: str | os.PathLike[str],
    metadata: Mapping[str, Any],
    tensors: Iterable[tuple[str, tuple[int, ...], Any, Any]],
    alignment: int = DEFAULT_ALIGNMENT,
    types: Mapping[str, GGUFValueType] | None = None,
) -> None:
    """Write a GGUF v3 file atomically (temp file in the same directory, fsync, `os.replace`).

    `metadata` maps keys to values whose GGUF types are inferred: bool -> BOOL, int -> UINT32 when
    0 <= v < 2**32 else INT64, float -> FLOAT32, str -> STRING, numpy scalars and arrays by dtype, a list
    of str -> STRING array, of ints -> INT32 (INT64 if needed), of numbers -> FLOAT32, of lists ->
    nested arrays. `types` overrides a key's type; for an array value a scalar type names the element
    type (`GGUFValueType.ARRAY` means "infer the elements"), so `types=f.metadata_types` round-trips a
    `GGUFFile`. `general.alignment` is written when `alignment` != 32.

    `tensors` yields `(name, shape, fmt, data)`: shape in numpy order, fmt a format object from
    `ir.formats`, a ggml type id or a format name, and data either exactly `tensor_bytes(fmt, shape)`
    raw bytes (uint8 array / bytes) or, for F32/F16/F64/I8..I64, a numeric array of that shape,
    converted. `data` may also be a zero-argument callable returning it, called only when that
    tensor is streamed to disk, so multi-GB models need not be held in memory at once.

    Raises `GGUFError` for invalid input; on any failure the temp file is removed and an existing
    file at `path` is left untouched.
    """
    path = os.fspath(path)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFError(f"{path}: alignment must be a positive power of two, got {alignment!r}")
    types = dict(types or {})
    kvs = dict(metadata)
    if alignment != DEFAULT_ALIGNMENT or "general.alignment" in kvs:
        given = kvs.get("general.alignment", alignment)
        if given != alignment:
            raise GGUFError(f"{path}: metadata general.alignment={given!r} contradicts alignment={alignment}")
        kvs["general.alignment"] = alignment
        types["general.alignment"] = _VT.UINT32  # the type llama.cpp requires

    specs: list[_TensorSpec] = []
    seen: set[str] = set()
    for item in tensors:
        try:
            name, shape, fmt, data = item
        except (TypeError, ValueError):
            raise GGUFError(f"{path}: each tensor must be (name, shape, fmt, data), got {item!r:.80}") from None
        if not isinstance(name, str) or name in seen:
            raise GGUFError(f"{path}: tensor name {name!r} is not a str or is duplicated")
        seen.add(name)
        if len(name.encode("utf-8")) > MAX_TENSOR_NAME_BYTES:
            raise GGUFError(f"{path}: tensor name {_q(name)} is longer than {MAX_TENSOR_NAME_BYTES} bytes")
        shape = tuple(int(d) for d in shape)
        if not 1 <= len(shape) <= MAX_DIMS_WRITE or min(shape) < 1:
            raise GGUFError(f"{path}: tensor {_q(name)} has shape {shape} (need 1..{MAX_DIMS_WRITE} dims >= 1)")
        try:
            fmt, type_id = _format_and_id(fmt)
        except GGUFError as e:
            raise GGUFError(f"{path}: tensor {_q(name)}: {e}") from None
        if shape[-1] % fmt.block_size:
            raise GGUFError(
                f"{path}: tensor {_q(name)} row length {shape[-1]} is not a multiple of the "
                f"{fmt.name} block size {fmt.block_size}"
            )
        nbytes = math.prod(shape[:-1]) * (shape[-1] // fmt.block_size) * fmt.block_bytes
        specs.append((name, shape, fmt, type_id, nbytes, data))

    header = bytearray(GGUF_MAGIC)
    header += _U32.pack(GGUF_VERSION)
    header += _U64.pack(len(specs))
    header += _U64.pack(len(kvs))
    for key, value in kvs.items():
        if not isinstance(key, str):
            raise GGUFError(f"{path}: metadata key {key!r} is not a str")
        vt = types.get(key)
        try:
            if vt is not None and vt not in GGUFValueType.__members__.values():
                raise GGUFError(f"metadata {_q(key)}: {vt!r} is not a GGUFValueType")
            _encode_kv(header, key, value, GGUFValueType(vt) if vt is not None else None)
        except GGUFError as e:
            raise GGUFError(f"{path}: {e}") from None
    # Tensors are packed in order, each padded to the alignment: llama.cpp insists on exactly this.
    offsets = []
    offset = 0
    for name, shape, _fmt, type_id, nbytes, _data in specs:
        _encode_string(header, name, name)
        header += _U32.pack(len(shape))
        header += struct.pack(f"<{len(shape)}Q", *reversed(shape))
        header += _U32.pack(type_id)
        header += _U64.pack(offset)
        offsets.append(offset)
        offset = _align_up(offset + nbytes, alignment)
    data_offset = _align_up(len(header), alignment)
    header += bytes(data_offset - len(header))

    # A model file should be as readable as one written by open() (mkstemp makes 0600 files), or keep the mode of
    # the file it replaces.
    try:
        mode = os.stat(path).st_mode & 0o777 if os.path.exists(path) else 0o644
    except OSError:
        mode = None
    with atomic_file(Path(path), mode, durable=True) as f:
        f.write(header)
        for spec, rel in zip(specs, offsets, strict=True):
            try:
                payload = _tensor_payload(spec)
            except GGUFError as e:
                raise GGUFError(f"{path}: {e}") from None
            pos = data_offset + rel
            f.write(bytes(pos - f.tell()))  # padding from the previous tensor
            f.write(payload)
            del payload  # let a lazily produced tensor be freed before the next one is made
        end = f.tell()
        f.write(bytes(_align_up(end, alignment) - end))

"""GGUF files: the format's definitions and a validating, memory-mapped reader (`GGUFFile`).

Layout of a GGUF v2/v3 file (all little-endian):

    magic b"GGUF" | version u32 | tensor_count u64 | kv_count u64
    kv_count x   (key: string, value_type u32, value)
    tensor_count x (name: string, n_dims u32, ne u64 x n_dims, ggml_type u32, offset u64)
    padding to `general.alignment` (default 32)
    data section: tensor bytes at data_offset + offset, each offset a multiple of the alignment

A string is a u64 byte length followed by UTF-8 bytes (no terminator). An array value is an element
type u32, a u64 count and the elements. `ne` lists dimensions innermost first; this module exposes
shapes in numpy order (outermost first), i.e. reversed.

Every length, count and offset read from a file is checked against the bytes that remain before
anything is allocated or read, so a corrupt or hostile file gives a `GGUFError`, never a crash or a
huge allocation. The writer (`write_gguf`) is `polystrata/gguf_writer.py`.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np

from polystrata.errors import GGUFError
from polystrata.ir import evaluate
from polystrata.ir.formats import by_ggml_type

__all__ = [
    "DEFAULT_ALIGNMENT",
    "GGUFFile",
    "GGUFValueType",
    "TensorInfo",
    "typed_value",
]

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# GGML itself stops at 4 dims; reading up to 8 costs nothing and keeps odd files inspectable.
MAX_DIMS_READ = 8
# What llama.cpp loads; the writer refuses anything it would reject.
MAX_DIMS_WRITE = 4
# GGML_MAX_NAME is 64 including the terminating NUL.
MAX_TENSOR_NAME_BYTES = 63
# Real files nest arrays at most once or twice; the cap keeps a crafted file from exhausting the
# Python stack (each level costs only 12 bytes of file).
MAX_ARRAY_DEPTH = 16


class GGUFValueType(enum.IntEnum):
    """Type tag of a GGUF metadata value, as stored in the file."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


_VT = GGUFValueType
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

_SCALAR_STRUCTS: dict[GGUFValueType, struct.Struct] = {
    _VT.UINT8: struct.Struct("<B"),
    _VT.INT8: struct.Struct("<b"),
    _VT.UINT16: struct.Struct("<H"),
    _VT.INT16: struct.Struct("<h"),
    _VT.UINT32: _U32,
    _VT.INT32: struct.Struct("<i"),
    _VT.FLOAT32: struct.Struct("<f"),
    _VT.BOOL: struct.Struct("<B"),
    _VT.UINT64: _U64,
    _VT.INT64: struct.Struct("<q"),
    _VT.FLOAT64: struct.Struct("<d"),
}

# On-disk dtypes of numeric array elements (bools are stored as one byte each).
_ARRAY_DTYPES: dict[GGUFValueType, np.dtype] = {
    _VT.UINT8: np.dtype("<u1"),
    _VT.INT8: np.dtype("<i1"),
    _VT.UINT16: np.dtype("<u2"),
    _VT.INT16: np.dtype("<i2"),
    _VT.UINT32: np.dtype("<u4"),
    _VT.INT32: np.dtype("<i4"),
    _VT.FLOAT32: np.dtype("<f4"),
    _VT.BOOL: np.dtype("<u1"),
    _VT.UINT64: np.dtype("<u8"),
    _VT.INT64: np.dtype("<i8"),
    _VT.FLOAT64: np.dtype("<f8"),
}

_INT_TYPES = frozenset({_VT.UINT8, _VT.INT8, _VT.UINT16, _VT.INT16, _VT.UINT32, _VT.INT32, _VT.UINT64, _VT.INT64})

# Smallest encoding of one kv (8-byte key length, 4-byte type, 1-byte value) and one tensor info
# (8-byte name length, 4-byte n_dims, 4-byte type, 8-byte offset): used to reject absurd counts
# before looping over them.
_MIN_KV_BYTES = 13
_MIN_TENSOR_INFO_BYTES = 24

def _q(name: str) -> str:
    """`name` quoted for a one-line message: corrupt files can put newlines or junk in names."""
    if len(name) > 200:
        name = name[:200] + "..."
    return f"'{name}'" if name.isprintable() else repr(name)


def _align_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file.

    `shape` is in numpy order (outermost first: the reverse of GGUF's `ne`), `fmt` the format object
    from `polystrata.ir.formats.by_ggml_type`, `offset` the absolute file offset of its first byte and
    `nbytes` its exact size in bytes.
    """

    name: str
    shape: tuple[int, ...]
    fmt: Any
    offset: int
    nbytes: int
    ggml_type: int

    @property
    def n_elements(self) -> int:
        """Number of elements (product of the shape)."""
        return math.prod(self.shape)

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (the innermost dimension)."""
        return self.shape[-1] // self.fmt.block_size * self.fmt.block_bytes


# name, shape, ggml type id, format, offset relative to the data section
_PendingTensor = tuple[str, tuple[int, ...], int, Any, int]


class _Cursor:
    """Bounds-checked little-endian reads from the mapped file."""

    __slots__ = ("buf", "pos", "size", "path")

    def __init__(self, buf: memoryview, path: str) -> None:
        self.buf = buf
        self.pos = 0
        self.size = len(buf)
        self.path = path

    def error(self, message: str) -> GGUFError:
        return GGUFError(f"{self.path}: {message}")

    @property
    def remaining(self) -> int:
        return self.size - self.pos

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.error(f"truncated: {what} at byte {self.pos} needs {n} bytes but the file has {self.size} bytes")

    def unpack(self, st: struct.Struct, what: str) -> Any:
        self.need(st.size, what)
        value = st.unpack_from(self.buf, self.pos)[0]
        self.pos += st.size
        return value

    def string(self, what: str) -> str:
        n = self.unpack(_U64, f"length of {what}")
        if n > self.size - self.pos:
            raise self.error(
                f"{what} at byte {self.pos - 8} has length {n} but only {self.size - self.pos} bytes "
                "are left in the file"
            )
        # surrogateescape: a few tokenizers carry byte sequences that are not valid UTF-8; keeping
        # them lossless (and writable back unchanged) beats rejecting an otherwise usable model.
        s = str(self.buf[self.pos : self.pos + n], "utf-8", "surrogateescape")
        self.pos += n
        return s

    def value_type(self, what: str) -> GGUFValueType:
        at = self.pos
        raw = self.unpack(_U32, what)
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise self.error(f"{what} at byte {at} is {raw}, not a known GGUF value type (0..12)") from None

    def value(self, vtype: GGUFValueType, what: str, depth: int = 0) -> Any:
        if vtype == _VT.STRING:
            return self.string(what)
        if vtype == _VT.ARRAY:
            return self.array(what, depth)
        value = self.unpack(_SCALAR_STRUCTS[vtype], what)
        return value != 0 if vtype == _VT.BOOL else value

    def array(self, what: str, depth: int) -> Any:
        if depth >= MAX_ARRAY_DEPTH:
            raise self.error(f"{what} at byte {self.pos}: arrays nested more than {MAX_ARRAY_DEPTH} deep")
        etype = self.value_type(f"element type of {what}")
        count_at = self.pos
        n = self.unpack(_U64, f"length of {what}")
        if etype == _VT.STRING:
            min_item = 8
        elif etype == _VT.ARRAY:
            min_item = 12
        else:
            min_item = _ARRAY_DTYPES[etype].itemsize
        if n * min_item > self.remaining:
            raise self.error(
                f"{what} at byte {count_at} claims {n} elements of type {etype.name} (at least "
                f"{n * min_item} bytes) but only {self.remaining} bytes are left in the file"
            )
        if etype == _VT.STRING:
            return self._string_array(n, what)
        if etype == _VT.ARRAY:
            return [self.array(f"{what}[{i}]", depth + 1) for i in range(n)]
        dt = _ARRAY_DTYPES[etype]
        # Copied so metadata does not pin the mapping, and made native-endian for callers.
        arr = np.frombuffer(self.buf, dtype=dt, count=n, offset=self.pos).astype(dt.newbyteorder("="))
        self.pos += n * dt.itemsize
        return arr != 0 if etype == _VT.BOOL else arr

    def _string_array(self, n: int, what: str) -> list[str]:
        # Hot loop (tokenizer vocabularies have ~262k entries): locals only, no per-item helpers.
        buf, pos, size = self.buf, self.pos, self.size
        unpack = _U64.unpack_from
        out: list[str] = []
        append = out.append
        for i in range(n):
            if size - pos < 8:
                self.pos = pos
                self.need(8, f"length of {what}[{i}]")
            (length,) = unpack(buf, pos)
            pos += 8
            if length > size - pos:
                raise self.error(
                    f"{what}[{i}] at byte {pos - 8} has length {length} but only {size - pos} bytes "
                    "are left in the file"
                )
            append(str(buf[pos : pos + length], "utf-8", "surrogateescape"))
            pos += length
        self.pos = pos
        return out


def typed_value(key: str, v: Any, kind: type) -> Any:
    """Metadata value `v` of `key` as an int, float or bool; GGUFError if it has another type or is not finite."""
    if isinstance(v, np.generic):
        v = v.item()
    ok = isinstance(v, bool | int | float)
    if ok and kind is int:
        ok = not isinstance(v, float) or (math.isfinite(v) and v == int(v))
    elif ok and kind is float:
        ok = math.isfinite(v)
    elif ok and kind is bool:
        ok = v in (0, 1)
    if not ok:
        shown = repr(v) if len(repr(v)) <= 60 else repr(v)[:57] + "..."
        expected = "a number" if kind is float else kind.__name__
        raise GGUFError(f"metadata '{key}' has value {shown}, expected {expected}")
    return kind(v)


class GGUFFile:
    """A GGUF v2/v3 file, memory-mapped read-only, parsed and validated on open.

    Attributes: `path`, `version`, `alignment`, `data_offset` (absolute offset of the data section),
    `metadata` (key -> str / int / float / bool, `list[str]` for string arrays, a 1-D numpy array for
    numeric arrays, a list for nested arrays), `metadata_types` (key -> `GGUFValueType`; arrays are
    `ARRAY`) and `tensors` (name -> `TensorInfo`, in file order).

    Raises `GGUFError` for anything malformed. Usable as a context manager; arrays returned by `raw`
    stay valid after `close` (they keep the mapping alive).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.version = 0
        self.alignment = DEFAULT_ALIGNMENT
        self.data_offset = 0
        self.metadata: dict[str, Any] = {}
        self.metadata_types: dict[str, GGUFValueType] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self._data: np.ndarray | None = None

        where = str(self.path)
        try:
            size = os.stat(self.path).st_size
            if not self.path.is_file():
                raise GGUFError(f"{where}: not a regular file")
        except OSError as e:
            raise GGUFError(f"{where}: cannot open: {e.strerror or e}") from None
        if size == 0:
            raise GGUFError(f"{where}: not a GGUF file (the file is empty)")
        try:
            data = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as e:
            raise GGUFError(f"{where}: cannot map the file: {e}") from None
        # Plain ndarray view: slices of a np.memmap subclass behave oddly (e.g. reductions return
        # memmap objects); the view still shares, and keeps alive, the same mapping.
        self._data = data.view(np.ndarray)
        buf = memoryview(self._data)
        try:
            self._parse(_Cursor(buf, where))
        except BaseException:
            self._data = None
            raise
        finally:
            buf.release()

    # -- parsing -------------------------------------------------------------------------------

    def _parse(self, cur: _Cursor) -> None:
        if cur.size < 4 or bytes(cur.buf[:4]) != GGUF_MAGIC:
            raise cur.error(f"not a GGUF file (magic {bytes(cur.buf[:4])!r}, expected {GGUF_MAGIC!r})")
        cur.pos = 4
        version = cur.unpack(_U32, "version")
        if version not in SUPPORTED_VERSIONS:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            if swapped in (1, 2, 3):
                raise cur.error("big-endian GGUF files are not supported")
            if version == 1:
                raise cur.error("GGUF version 1 is not supported (only 2 and 3); re-convert the model")
            raise cur.error(f"unsupported GGUF version {version} (supported: 2, 3)")
        self.version = version
        n_tensors = cur.unpack(_U64, "tensor count")
        n_kv = cur.unpack(_U64, "kv count")
        if n_kv * _MIN_KV_BYTES > cur.remaining:
            raise cur.error(
                f"implausible kv count {n_kv}: needs at least {n_kv * _MIN_KV_BYTES} bytes but only "
                f"{cur.remaining} follow the header (truncated or corrupt file)"
            )
        need = n_tensors * _MIN_TENSOR_INFO_BYTES + n_kv * _MIN_KV_BYTES
        if need > cur.remaining:
            raise cur.error(
                f"implausible tensor count {n_tensors}: with {n_kv} kvs needs at least {need} bytes but "
                f"only {cur.remaining} follow the header (truncated or corrupt file)"
            )

        self._parse_kvs(cur, n_kv)
        self.alignment = self._check_alignment(cur)
        pending = self._parse_tensor_infos(cur, n_tensors)
        self.data_offset = _align_up(cur.pos, self.alignment)
        self._place_tensors(cur, pending)

    def _parse_kvs(self, cur: _Cursor, n_kv: int) -> None:
        for i in range(n_kv):
            key_at = cur.pos
            key = cur.string(f"key of kv #{i}")
            if key in self.metadata:
                raise cur.error(f"duplicate metadata key {_q(key)} (kv #{i} at byte {key_at})")
            vtype = cur.value_type(f"value type of kv {_q(key)}")
            self.metadata[key] = cur.value(vtype, f"value of kv {_q(key)}")
            self.metadata_types[key] = vtype

    def _check_alignment(self, cur: _Cursor) -> int:
        if "general.alignment" not in self.metadata:
            return DEFAULT_ALIGNMENT
        value = self.metadata["general.alignment"]
        vtype = self.metadata_types["general.alignment"]
        if vtype not in _INT_TYPES or value <= 0 or value & (value - 1):
            shown = f"{value!r}" if vtype != _VT.ARRAY else "an array"
            raise cur.error(f"general.alignment must be a positive power of two, got {shown} ({vtype.name})")
        return int(value)

    def _parse_tensor_infos(self, cur: _Cursor, n_tensors: int) -> list[_PendingTensor]:
        seen: set[str] = set()
        pending = []
        for i in range(n_tensors):
            info_at = cur.pos
            name = cur.string(f"name of tensor #{i}")
            if name in seen:
                raise cur.error(f"duplicate tensor name {_q(name)} (tensor #{i} at byte {info_at})")
            seen.add(name)
            n_dims = cur.unpack(_U32, f"dimension count of tensor {_q(name)}")
            if not 1 <= n_dims <= MAX_DIMS_READ:
                raise cur.error(f"tensor {_q(name)} has {n_dims} dimensions (supported: 1..{MAX_DIMS_READ})")
            cur.need(8 * n_dims, f"dimensions of tensor {_q(name)}")
            ne = struct.unpack_from(f"<{n_dims}Q", cur.buf, cur.pos)
            cur.pos += 8 * n_dims
            shape = tuple(reversed(ne))
            if 0 in ne:
                raise cur.error(f"tensor {_q(name)} has a zero-sized dimension (shape {shape})")
            type_id = cur.unpack(_U32, f"type of tensor {_q(name)}")
            try:
                fmt = by_ggml_type(type_id)
            except GGUFError as e:
                raise cur.error(f"tensor {_q(name)} has unsupported ggml type {type_id}: {e}") from None
            except (KeyError, ValueError, IndexError):
                raise cur.error(f"tensor {_q(name)} has unknown ggml type {type_id}") from None
            offset = cur.unpack(_U64, f"data offset of tensor {_q(name)}")
            pending.append((name, shape, type_id, fmt, offset))
        return pending

    def _place_tensors(self, cur: _Cursor, pending: list[_PendingTensor]) -> None:
        for name, shape, type_id, fmt, rel in pending:
            if shape[-1] % fmt.block_size:
                raise cur.error(
                    f"tensor {_q(name)} has rows of {shape[-1]} elements, not a multiple of the "
                    f"{fmt.name} block size {fmt.block_size}"
                )
            nbytes = math.prod(shape[:-1]) * (shape[-1] // fmt.block_size) * fmt.block_bytes
            if rel % self.alignment:
                raise cur.error(
                    f"tensor {_q(name)} data offset {rel} is not a multiple of the alignment {self.alignment}"
                )
            start = self.data_offset + rel
            end = start + nbytes
            if end > cur.size:
                raise cur.error(
                    f"truncated: tensor {_q(name)} data ends at byte {end} but the file has {cur.size} bytes"
                )
            self.tensors[name] = TensorInfo(name, shape, fmt, start, nbytes, type_id)
        prev: TensorInfo | None = None
        for info in sorted(self.tensors.values(), key=lambda t: t.offset):
            if prev is not None and info.offset < prev.offset + prev.nbytes:
                raise cur.error(
                    f"tensors {_q(prev.name)} (bytes {prev.offset}..{prev.offset + prev.nbytes}) and "
                    f"{_q(info.name)} (from byte {info.offset}) overlap"
                )
            prev = info

    # -- access --------------------------------------------------------------------------------

    def info(self, name: str) -> TensorInfo:
        """The `TensorInfo` of tensor `name`; `GGUFError` naming it if the file has no such tensor."""
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(f"{self.path}: no tensor named {_q(name)}") from None

    def raw(self, name: str) -> np.ndarray:
        """Zero-copy, read-only uint8 view of tensor `name`'s bytes, shaped (*shape[:-1], row_bytes)."""
        info = self.info(name)
        return self._raw_flat(info).reshape(*info.shape[:-1], info.row_bytes)

    def _raw_flat(self, info: TensorInfo) -> np.ndarray:
        if self._data is None:
            raise GGUFError(f"{self.path}: file is closed (reading tensor {_q(info.name)})")
        return self._data[info.offset : info.offset + info.nbytes]

    def dequantize(self, name: str) -> np.ndarray:
        """Tensor `name` as a new float32 array of shape `TensorInfo.shape`."""
        info = self.info(name)
        flat = self._raw_flat(info)
        out = evaluate.dequantize(info.fmt, flat, info.shape)
        return np.asarray(out, dtype=np.float32).reshape(info.shape)

    def get(self, key: str, default: Any = None) -> Any:
        """Metadata value of `key`, or `default` when the file does not have it."""
        return self.metadata.get(key, default)

    def close(self) -> None:
        """Drop this object's reference to the mapping (views from `raw` keep it alive until freed)."""
        self._data = None

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"GGUFFile({str(self.path)!r}, version={self.version}, kvs={len(self.metadata)}, "
            f"tensors={len(self.tensors)})"
        )

"""Tests of polystrata.gguf: round trips checked against gguf-py's reader (the oracle), real models,
corrupt and hostile inputs, and the atomic writer."""

from __future__ import annotations

import mmap
import os
import random
import struct
import time
import tracemalloc
from pathlib import Path

import gguf
import numpy as np
import pytest

from polystrata.errors import GGUFError, PolystrataError
from polystrata.gguf import GGUFFile, GGUFValueType, TensorInfo
from polystrata.gguf_writer import write_gguf

formats = pytest.importorskip("polystrata.ir.formats", reason="polystrata.ir.formats is not available")

VT = GGUFValueType
MODELS = Path.home() / ".cache" / "polystrata" / "models"
F32, F16, Q4_0, Q8_0, Q4_K = 0, 1, 2, 8, 12


# -- helpers -----------------------------------------------------------------------------------


def _fmt(type_id: int):
    return formats.by_ggml_type(type_id)


def _oracle_value(field: gguf.ReaderField):
    """A gguf-py reader field as the Python value GGUFFile is expected to produce."""
    main = field.types[0]
    if main == gguf.GGUFValueType.STRING:
        return bytes(field.parts[-1]).decode("utf-8", "surrogateescape")
    if main != gguf.GGUFValueType.ARRAY:
        return field.parts[-1].tolist()[0]
    sub = field.types[-1]
    if len(field.types) > 2:
        return None  # gguf-py flattens nested arrays; compared separately
    if sub == gguf.GGUFValueType.STRING:
        return [bytes(field.parts[i]).decode("utf-8", "surrogateescape") for i in field.data]
    if not field.data:
        return np.zeros(0)
    return np.concatenate([field.parts[i] for i in field.data])


def _assert_same_value(ours, theirs, key: str) -> None:
    if theirs is None:
        return
    if isinstance(theirs, np.ndarray):
        assert isinstance(ours, np.ndarray), key
        assert len(ours) == len(theirs), key
        if ours.dtype == np.bool_:
            theirs = theirs.astype(bool)
        else:
            assert ours.dtype == theirs.dtype.newbyteorder("="), key
        np.testing.assert_array_equal(ours, theirs, err_msg=key)
    elif isinstance(theirs, float):
        assert isinstance(ours, float) and (ours == theirs or (ours != ours and theirs != theirs)), key
    else:
        assert ours == theirs and type(ours) is type(theirs), key


def _compare_with_oracle(path: Path, f: GGUFFile, reader: gguf.GGUFReader | None = None) -> None:
    reader = reader or gguf.GGUFReader(path)
    fields = {k: v for k, v in reader.fields.items() if not k.startswith("GGUF.")}
    assert list(fields) == list(f.metadata)
    for key, field in fields.items():
        assert int(field.types[0]) == int(f.metadata_types[key]), key
        _assert_same_value(f.metadata[key], _oracle_value(field), key)
    assert f.alignment == reader.alignment
    assert f.data_offset == reader.data_offset
    assert [t.name for t in reader.tensors] == list(f.tensors)
    for t in reader.tensors:
        info = f.tensors[t.name]
        assert info.shape == tuple(int(d) for d in reversed(t.shape.tolist())), t.name
        assert info.ggml_type == int(t.tensor_type), t.name
        assert info.offset == t.data_offset, t.name
        assert info.nbytes == t.n_bytes, t.name


def _str(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


def _kv(key: str, vtype: int, payload: bytes) -> bytes:
    return _str(key.encode()) + struct.pack("<I", vtype) + payload


def _u32_kv(key: str, value: int) -> bytes:
    return _kv(key, VT.UINT32, struct.pack("<I", value))


def _tensor_info(name: str, ne: tuple[int, ...], type_id: int, offset: int) -> bytes:
    return (
        _str(name.encode())
        + struct.pack("<I", len(ne))
        + struct.pack(f"<{len(ne)}Q", *ne)
        + struct.pack("<IQ", type_id, offset)
    )


def _build(
    kvs: list[bytes] = (),
    infos: list[bytes] = (),
    data: bytes = b"",
    *,
    magic: bytes = b"GGUF",
    version: int = 3,
    n_tensors: int | None = None,
    n_kv: int | None = None,
    alignment: int = 32,
) -> bytes:
    """Hand-assembled GGUF bytes, independent of write_gguf, so corruptions can be placed exactly."""
    head = magic + struct.pack(
        "<IQQ", version, len(infos) if n_tensors is None else n_tensors, len(kvs) if n_kv is None else n_kv
    )
    head += b"".join(kvs) + b"".join(infos)
    head += bytes(-len(head) % alignment)
    return head + data


def _one_f32_tensor(name: str = "w", ne: tuple[int, ...] = (8, 2), offset: int = 0, type_id: int = F32):
    return _tensor_info(name, ne, type_id, offset)


def _expect_error(tmp_path: Path, blob: bytes, match: str | None = None) -> GGUFError:
    """Open `blob`; it must fail with GGUFError, fast and without a large allocation."""
    p = tmp_path / "bad.gguf"
    p.write_bytes(blob)
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(GGUFError, match=match) as exc:
            GGUFFile(p)
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert time.perf_counter() - t0 < 2.0
    assert peak < 16 * 2**20, f"parsing a corrupt file allocated {peak} bytes"
    message = str(exc.value)
    assert "\n" not in message and str(p) in message
    return exc.value


# -- round trip --------------------------------------------------------------------------------


def _sample_metadata():
    rng = np.random.default_rng(0)
    tokens = [f"tok_{i}_{'é' * (i % 3)}" for i in range(20000)]
    metadata = {
        "general.architecture": "llama",
        "general.name": "tiny 🦙 модель",
        "t.u8": 200,
        "t.i8": -5,
        "t.u16": 60000,
        "t.i16": -30000,
        "t.u32": 4000000000,
        "t.i32": -7,
        "t.f32": 0.5,
        "t.bool_true": True,
        "t.bool_false": False,
        "t.u64": 2**40,
        "t.i64": -(2**40),
        "t.f64": np.float64(1.0 / 3.0),
        "t.empty_string": "",
        "t.tokens": tokens,
        "t.scores": rng.standard_normal(20000).astype(np.float32),
        "t.token_type": rng.integers(0, 6, 20000).astype(np.int32),
        "t.bytes": np.arange(256, dtype=np.uint8),
        "t.i64s": np.array([-(2**62), 0, 2**62], dtype=np.int64),
        "t.f64s": np.array([1.5, -2.25], dtype=np.float64),
        "t.int_list": [1, 2, 3],
        "t.float_list": [1.0, 2.5],
        "t.bool_list": [True, False, True],
        "t.nested": [[1, 2], [3, 4, 5]],
        "t.nested_str": [["a", "β"], ["c"]],
        "t.u16_list": [1, 65535],
    }
    types = {
        "t.u8": VT.UINT8,
        "t.i8": VT.INT8,
        "t.u16": VT.UINT16,
        "t.i16": VT.INT16,
        "t.i32": VT.INT32,
        "t.u64": VT.UINT64,
        "t.u16_list": VT.UINT16,
    }
    return metadata, types


def _sample_tensors():
    rng = np.random.default_rng(1)
    f32 = rng.standard_normal((3, 64)).astype(np.float32)
    f16 = rng.standard_normal((4, 32)).astype(np.float16)
    q8_src = rng.standard_normal((2, 64)).astype(np.float32)
    q8 = gguf.quants.quantize(q8_src, gguf.GGMLQuantizationType.Q8_0)
    q4k = rng.integers(0, 256, 2 * 144, dtype=np.uint8)  # 2 rows of one 256-element block
    vec = rng.standard_normal(32).astype(np.float32)
    cube = rng.standard_normal((2, 3, 32)).astype(np.float32)
    return [
        ("token_embd.weight", (3, 64), _fmt(F32), f32),
        ("blk.0.attn_q.weight", (4, 32), _fmt(F16), f16),
        ("blk.0.ffn_up.weight", (2, 64), _fmt(Q8_0), q8),
        ("blk.0.ffn_down.weight", (2, 256), _fmt(Q4_K), q4k),
        ("output_norm.weight", (32,), F32, vec),  # fmt as a plain ggml type id
        ("blk.0.cube", (2, 3, 32), "F32", cube),  # fmt as a name
    ]


@pytest.fixture(scope="module")
def sample_file(tmp_path_factory) -> tuple[Path, dict, dict, list]:
    path = tmp_path_factory.mktemp("rt") / "sample.gguf"
    metadata, types = _sample_metadata()
    tensors = _sample_tensors()
    write_gguf(path, metadata, tensors, types=types)
    return path, metadata, types, tensors


def test_round_trip_metadata(sample_file):
    path, metadata, types, _ = sample_file
    with GGUFFile(path) as f:
        assert f.version == 3 and f.alignment == 32 and f.data_offset % 32 == 0
        assert list(f.metadata) == list(metadata)
        for key, value in metadata.items():
            got = f.metadata[key]
            if isinstance(value, np.ndarray):
                assert got.dtype == value.dtype, key
                np.testing.assert_array_equal(got, value, err_msg=key)
            elif key == "t.f32":
                assert got == pytest.approx(value)
            elif key == "t.nested":
                assert [x.tolist() for x in got] == value
            elif isinstance(value, list) and value and not isinstance(value[0], str | list):
                assert list(np.asarray(got).tolist()) == value, key
            else:
                assert got == value, key
        assert f.metadata_types["t.u32"] == VT.UINT32
        assert f.metadata_types["t.i64"] == VT.INT64
        assert f.metadata_types["t.f32"] == VT.FLOAT32
        assert f.metadata_types["t.f64"] == VT.FLOAT64
        assert f.metadata_types["t.bool_true"] == VT.BOOL
        for key, vt in types.items():
            if not isinstance(metadata[key], list):
                assert f.metadata_types[key] == vt, key
        assert f.metadata["t.u16_list"].dtype == np.uint16
        assert f.metadata["t.int_list"].dtype == np.int32
        assert f.metadata["t.float_list"].dtype == np.float32
        assert f.metadata["t.bool_list"].dtype == np.bool_
        assert f.get("general.name") == "tiny 🦙 модель" and f.get("missing", 7) == 7


def test_round_trip_against_gguf_py(sample_file):
    path, _, _, tensors = sample_file
    reader = gguf.GGUFReader(path)
    with GGUFFile(path) as f:
        _compare_with_oracle(path, f, reader)
        # Nested arrays: gguf-py flattens them, so compare flattened.
        nested = reader.fields["t.nested"]
        assert [int(x) for i in nested.data for x in nested.parts[i]] == [1, 2, 3, 4, 5]
        for t in reader.tensors:
            ours = f.raw(t.name)
            assert ours.dtype == np.uint8
            assert ours.tobytes() == np.ascontiguousarray(t.data).tobytes(), t.name
        for name, shape, _, data in tensors:
            info = f.tensors[name]
            assert isinstance(info, TensorInfo) and info.shape == shape
            assert f.raw(name).shape == (*shape[:-1], info.row_bytes)
            if data.dtype != np.uint8:
                np.testing.assert_array_equal(f.dequantize(name), data.astype(np.float32), err_msg=name)
        q8 = f.dequantize("blk.0.ffn_up.weight")
        expected = gguf.quants.dequantize(f.raw("blk.0.ffn_up.weight"), gguf.GGMLQuantizationType.Q8_0)
        assert q8.dtype == np.float32 and q8.shape == (2, 64)
        np.testing.assert_allclose(q8, expected, rtol=1e-6)
        q4k = f.dequantize("blk.0.ffn_down.weight")
        expected = gguf.quants.dequantize(f.raw("blk.0.ffn_down.weight"), gguf.GGMLQuantizationType.Q4_K)
        assert q4k.shape == (2, 256)
        np.testing.assert_array_equal(q4k, expected)  # random scales may be inf/nan: equal_nan is default


def test_raw_is_zero_copy_and_read_only(sample_file):
    path = sample_file[0]
    f = GGUFFile(path)
    a = f.raw("token_embd.weight")
    assert np.shares_memory(a, f.raw("token_embd.weight"))
    base = a
    while base is not None and not isinstance(base, mmap.mmap):
        base = base.base
    assert isinstance(base, mmap.mmap), "raw() must be a view of the file mapping"
    assert not a.flags.writeable
    before = a.tobytes()
    f.close()
    assert a.tobytes() == before  # views outlive close(): they keep the mapping alive
    with pytest.raises(GGUFError, match="closed"):
        f.raw("token_embd.weight")


def test_missing_tensor_and_file(sample_file, tmp_path):
    with GGUFFile(sample_file[0]) as f:
        with pytest.raises(GGUFError, match="'nope.weight'"):
            f.raw("nope.weight")
        with pytest.raises(GGUFError, match="'nope.weight'"):
            f.dequantize("nope.weight")
    with pytest.raises(GGUFError, match="cannot open"):
        GGUFFile(tmp_path / "absent.gguf")
    with pytest.raises(GGUFError):
        GGUFFile(tmp_path)
    assert issubclass(GGUFError, PolystrataError)


def test_rewrite_with_read_types_is_byte_identical(sample_file, tmp_path):
    path = sample_file[0]
    with GGUFFile(path) as f:
        out = tmp_path / "copy.gguf"
        tensors = [(i.name, i.shape, i.fmt, f.raw(i.name)) for i in f.tensors.values()]
        write_gguf(out, f.metadata, tensors, alignment=f.alignment, types=f.metadata_types)
    assert out.read_bytes() == path.read_bytes()


def test_writer_alignment_and_lazy_data(tmp_path):
    p = tmp_path / "a64.gguf"
    calls = []

    def make(i):
        def produce():
            calls.append(i)
            return np.full((2, 32), i, dtype=np.float32)

        return produce

    write_gguf(p, {"general.architecture": "x"}, [(f"t{i}", (2, 32), F32, make(i)) for i in range(3)], alignment=64)
    assert calls == [0, 1, 2]
    with GGUFFile(p) as f:
        assert f.alignment == 64 and f.metadata_types["general.alignment"] == VT.UINT32
        assert all((t.offset - f.data_offset) % 64 == 0 for t in f.tensors.values())
        np.testing.assert_array_equal(f.dequantize("t2"), np.full((2, 32), 2, np.float32))
        _compare_with_oracle(p, f)


@pytest.mark.parametrize(
    ("metadata", "types", "match"),
    [
        ({"k": 300}, {"k": VT.UINT8}, "fit"),
        ({"k": 1.5}, {"k": VT.INT32}, "not an integer"),
        ({"k": [1, 300]}, {"k": VT.UINT8}, "fit"),
        ({"k": object()}, None, "cannot store"),
        ({"k": [1, "a"]}, None, "mixes"),
        ({"k": 2**70}, None, "64 bits"),
        ({"k": np.zeros((2, 2), np.int32)}, None, "1-D"),
    ],
)
def test_writer_rejects_bad_metadata(tmp_path, metadata, types, match):
    with pytest.raises(GGUFError, match=match):
        write_gguf(tmp_path / "m.gguf", metadata, [], types=types)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("tensors", "match"),
    [
        ([("a", (2, 40), Q8_0, bytes(2 * 34))], "block size"),
        ([("a", (2, 0), F32, b"")], "shape"),
        ([("a", (1, 1, 1, 1, 32), F32, bytes(128))], "shape"),
        ([("a", (32,), F32, bytes(128)), ("a", (32,), F32, bytes(128))], "duplicated"),
        ([("x" * 64, (32,), F32, bytes(128))], "longer"),
        ([("a", (32,), 9999, bytes(128))], "a"),
    ],
)
def test_writer_rejects_bad_tensors(tmp_path, tensors, match):
    with pytest.raises(GGUFError, match=match):
        write_gguf(tmp_path / "t.gguf", {}, tensors)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "bad_second",
    [
        ("b", (2, 32), Q8_0, bytes(10)),  # wrong byte count
        ("b", (2, 32), F32, np.zeros((32, 2), np.float32)),  # transposed
        ("b", (2, 32), Q8_0, np.zeros((2, 32), np.float32)),  # floats for a quantized format
        ("b", (2, 32), F32, lambda: (_ for _ in ()).throw(RuntimeError("producer failed"))),
    ],
)
def test_atomic_write_leaves_existing_file_untouched(tmp_path, bad_second):
    dest = tmp_path / "model.gguf"
    write_gguf(dest, {"general.name": "original"}, [("a", (32,), F32, np.ones(32, np.float32))])
    before = dest.read_bytes()
    tensors = [("a", (64,), F32, np.zeros(64, np.float32)), bad_second]
    with pytest.raises((GGUFError, RuntimeError)):
        write_gguf(dest, {"general.name": "new"}, tensors)
    assert dest.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["model.gguf"]


def test_written_file_is_readable_like_open_and_a_replaced_one_keeps_its_mode(tmp_path):
    """mkstemp makes user-only files: a new model file gets open()'s 0o644, a replaced one keeps its mode."""
    dest = tmp_path / "model.gguf"
    tensors = [("a", (32,), F32, np.ones(32, np.float32))]
    write_gguf(dest, {"general.name": "first"}, tensors)
    assert dest.stat().st_mode & 0o777 == 0o644
    dest.chmod(0o640)
    write_gguf(dest, {"general.name": "second"}, tensors)
    assert dest.stat().st_mode & 0o777 == 0o640
    with GGUFFile(dest) as f:
        assert f.metadata["general.name"] == "second"
    assert sorted(os.listdir(tmp_path)) == ["model.gguf"]


# -- corrupt inputs ----------------------------------------------------------------------------


def _valid_small() -> bytes:
    kvs = [_kv("general.architecture", VT.STRING, _str(b"llama")), _u32_kv("n", 1)]
    infos = [_one_f32_tensor("w", (8, 2), 0), _one_f32_tensor("v", (8,), 64)]
    return _build(kvs, infos, bytes(64) + bytes(32))


def test_hand_built_file_is_valid(tmp_path):
    p = tmp_path / "ok.gguf"
    p.write_bytes(_valid_small())
    with GGUFFile(p) as f:
        assert f.tensors["w"].shape == (2, 8) and f.tensors["v"].nbytes == 32
        _compare_with_oracle(p, f)
    # Version 2 has the same layout as 3 (3 only added big-endian files, which are refused).
    p.write_bytes(struct.pack("<4sI", b"GGUF", 2) + _valid_small()[8:])
    with GGUFFile(p) as f:
        assert f.version == 2 and list(f.tensors) == ["w", "v"]


def test_truncated_everywhere(tmp_path):
    blob = _valid_small()
    end_of_data = len(blob)  # the last tensor ends exactly at the end of this file
    for cut in range(end_of_data):
        err = _expect_error(tmp_path, blob[:cut])
        assert "truncated" in str(err) or "not a GGUF file" in str(err) or "implausible" in str(err), cut


def test_truncated_data_message(tmp_path):
    blob = _valid_small()
    _expect_error(tmp_path, blob[:-1], r"truncated: tensor 'v' data ends at byte \d+ but the file has \d+ bytes")


BIG = 2**60


CORRUPT = {
    "empty": (b"", "empty"),
    "short": (b"GGU", "not a GGUF file"),
    "magic": (b"GGML" + bytes(60), "not a GGUF file"),
    "version99": (_build(version=99), "version 99"),
    "version1": (_build(version=1), "version 1"),
    "big_endian": (_build(version=3 << 24), "big-endian"),
    "tensor_count": (_build(n_tensors=BIG), "implausible tensor count"),
    "kv_count": (_build(n_kv=BIG), "implausible kv count"),
    "key_length": (_build([struct.pack("<Q", BIG) + b"key"]), "length"),
    "string_length": (_build([_kv("s", VT.STRING, struct.pack("<Q", BIG))]), "length"),
    "array_length": (_build([_kv("a", VT.ARRAY, struct.pack("<IQ", VT.UINT32, BIG))]), "claims"),
    "string_array_length": (_build([_kv("a", VT.ARRAY, struct.pack("<IQ", VT.STRING, BIG))]), "claims"),
    "string_in_array_length": (
        _build([_kv("a", VT.ARRAY, struct.pack("<IQQ", VT.STRING, 1, BIG))]),
        "length",
    ),
    "nested_array_length": (_build([_kv("a", VT.ARRAY, struct.pack("<IQ", VT.ARRAY, BIG))]), "claims"),
    "deep_nesting": (
        _build([_kv("a", VT.ARRAY, struct.pack("<IQ", VT.ARRAY, 1) * 40 + struct.pack("<IQ", 0, 0))]),
        "nested",
    ),
    "value_type": (_build([_kv("a", 13, b"\0" * 8)]), "value type"),
    "element_type": (_build([_kv("a", VT.ARRAY, struct.pack("<IQ", 77, 0))]), "value type"),
    "duplicate_key": (_build([_u32_kv("k", 1), _u32_kv("k", 2)]), "duplicate metadata key 'k'"),
    "alignment_3": (_build([_u32_kv("general.alignment", 3)], alignment=1), "alignment"),
    "alignment_0": (_build([_u32_kv("general.alignment", 0)], alignment=1), "alignment"),
    "alignment_str": (_build([_kv("general.alignment", VT.STRING, _str(b"32"))]), "alignment"),
    "offset_past_end": (_build([], [_one_f32_tensor(offset=2**40)], bytes(64)), "truncated: tensor 'w'"),
    "offset_huge": (_build([], [_one_f32_tensor(offset=BIG)], bytes(64)), "truncated: tensor 'w'"),
    "misaligned": (_build([], [_one_f32_tensor(offset=16)], bytes(96)), "not a multiple of the alignment"),
    "unknown_type": (_build([], [_one_f32_tensor(type_id=9999)], bytes(64)), "'w'.*9999"),
    "zero_dim": (_build([], [_one_f32_tensor(ne=(8, 0))], bytes(64)), "zero-sized"),
    "huge_dims": (_build([], [_one_f32_tensor(ne=(BIG, BIG))], bytes(64)), "truncated: tensor 'w'"),
    "nine_dims": (_build([], [_tensor_info("w", (1,) * 9, F32, 0)], bytes(64)), "9 dimensions"),
    "zero_dims": (_build([], [_tensor_info("w", (), F32, 0)], bytes(64)), "0 dimensions"),
    "duplicate_tensor": (
        _build([], [_one_f32_tensor("w"), _one_f32_tensor("w", offset=64)], bytes(128)),
        "duplicate tensor name 'w'",
    ),
    "row_not_blocks": (
        _build([], [_one_f32_tensor("w", type_id=Q8_0, ne=(40, 2))], bytes(128)),
        "'w'.*block size 32",
    ),
    "overlap": (_build([], [_one_f32_tensor("a"), _one_f32_tensor("b", offset=32)], bytes(128)), "overlap"),
    "no_data": (_build([], [_tensor_info("x" * 8, (8,), F32, 0)], b""), "truncated"),
}


@pytest.mark.parametrize(("blob", "match"), list(CORRUPT.values()), ids=list(CORRUPT))
def test_corrupt_inputs(tmp_path, blob, match):
    _expect_error(tmp_path, blob, match)


def test_fuzz_header_bytes(tmp_path):
    src = tmp_path / "src.gguf"
    metadata = {
        "general.architecture": "llama",
        "a": [1, 2, 3],
        "s": ["x", "yy", "zzz"],
        "n": [[1], [2, 3]],
        "f": 1.5,
        "b": True,
    }
    tensors = [
        ("w", (2, 64), Q8_0, bytes(2 * 68)),
        ("v", (32,), F32, np.ones(32, np.float32)),
        ("k", (1, 256), Q4_K, bytes(144)),
    ]
    write_gguf(src, metadata, tensors)
    blob = src.read_bytes()
    with GGUFFile(src) as f:
        header_end = f.data_offset
    rng = random.Random(20240607)
    p = tmp_path / "fuzz.gguf"
    outcomes = {"ok": 0, "error": 0}
    for _ in range(300):
        mutated = bytearray(blob)
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(header_end)
            mutated[i] = rng.choice([0, 0xFF, 0x80, rng.randrange(256), mutated[i] ^ (1 << rng.randrange(8))])
        p.write_bytes(mutated)
        try:
            with GGUFFile(p) as f:
                for name in f.tensors:
                    assert f.raw(name).size == f.tensors[name].nbytes
            outcomes["ok"] += 1
        except GGUFError as e:
            assert "\n" not in str(e)
            outcomes["error"] += 1
    assert outcomes["error"] > 0


# -- real models -------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("model", ["SmolLM2-135M-Instruct.Q4_1.gguf", "gemma-3-270m-q4_k_m.gguf"])
def test_real_model_matches_gguf_py(model, tmp_path):
    path = MODELS / model
    if not path.exists():
        pytest.skip(f"{path} not downloaded")
    with GGUFFile(path) as f:
        _compare_with_oracle(path, f)
        arch = f.metadata["general.architecture"]
        n_vocab = len(f.metadata["tokenizer.ggml.tokens"])
        assert f.tensors["token_embd.weight"].shape == (n_vocab, f.metadata[f"{arch}.embedding_length"])
        # Writing back what was read reproduces the file byte for byte.
        out = tmp_path / "copy.gguf"
        tensors = [(i.name, i.shape, i.fmt, f.raw(i.name)) for i in f.tensors.values()]
        write_gguf(out, f.metadata, tensors, alignment=f.alignment, types=f.metadata_types)
    assert out.read_bytes() == path.read_bytes()

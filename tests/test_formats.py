"""Quantization formats: decode bit-exact with gguf-py, encode round trip, sizes, registry errors."""


import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT

from polystrata.errors import GGUFError, UnsupportedError
from polystrata.ir.encode import _index_value, code_range, error_bound_steps, quantize
from polystrata.ir.evaluate import dequantize, element_steps
from polystrata.ir.expr import TABLES, FieldLoad, ToF32, Var, walk_expr
from polystrata.ir.formats import (
    BF16,
    F16,
    F32,
    FORMATS,
    I32,
    IQ4_XS,
    KV_FORMATS,
    Q3_K,
    Q4_0,
    Q4_K,
    Q6_K,
    Q8_0,
    Q8_G64,
    Field,
    GroupLet,
    QuantFormat,
    by_ggml_type,
    by_name,
    row_bytes,
    tensor_bytes,
)
from polystrata.ir.layout import padded, repack, sliced, split_rows

DECODABLE = [f for f in FORMATS.values() if f.value is not None]
ALL = [*FORMATS.values(), Q8_G64]
QUANTIZED = [f for f in [*FORMATS.values(), Q8_G64] if f.scheme is not None]
GGUF_QUANTIZERS = ["F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]

# Relative RMS error of dequantize(quantize(x)) on Gaussian data with 1% outliers (x20); measured values
# are roughly 2/3 of these (round-to-nearest, no importance search).
MAX_REL_RMS = {
    "F32": 0.0, "F16": 5e-4, "BF16": 4e-3, "Q8_0": 0.015, "q8_g64": 0.02, "Q6_K": 0.04,
    "Q5_1": 0.07, "Q5_K": 0.07, "Q5_0": 0.11, "Q4_1": 0.14, "Q4_K": 0.14, "IQ4_NL": 0.16,
    "IQ4_XS": 0.16, "Q4_0": 0.19, "Q3_K": 0.2, "Q2_K": 0.5,
}


def _ids(fmts):
    return [f.name for f in fmts]


def _bits(a):
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def _gguf_dequant(fmt, raw):
    return np.asarray(gguf.quants.dequantize(raw, GT(fmt.ggml_type)), dtype=np.float32)


def _test_data(rows=8, cols=2048, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    x[rng.random(x.shape) < 0.01] *= 20
    return x


def _rel_rms(y, x):
    return float(np.sqrt(np.mean((y.astype(np.float64) - x) ** 2) / np.mean(x.astype(np.float64) ** 2)))


@pytest.mark.parametrize("fmt", DECODABLE, ids=_ids(DECODABLE))
def test_dequantize_random_blocks_bit_exact_with_gguf(fmt):
    rng = np.random.default_rng(fmt.block_bytes)
    n_blocks = 384 if fmt.block_size > 1 else 4096  # random f16 scales include inf/nan: both must agree
    raw = rng.integers(0, 256, size=(4, n_blocks // 4 * fmt.block_bytes), dtype=np.uint8)
    ours = dequantize(fmt, raw)
    assert ours.dtype == np.float32 and ours.shape == (4, n_blocks // 4 * fmt.block_size)
    with np.errstate(all="ignore"):
        ref = _gguf_dequant(fmt, raw)
    np.testing.assert_array_equal(_bits(ours), _bits(ref))


@pytest.mark.parametrize("fmt", DECODABLE, ids=_ids(DECODABLE))
def test_hoisted_lets_really_are_constant_per_group(fmt):
    # Evaluating every let per element must not change anything, so the declared groups are truthful.
    rng = np.random.default_rng(7)
    raw = rng.integers(0, 256, size=64 * fmt.block_bytes, dtype=np.uint8)
    n = 64 * fmt.block_size
    np.testing.assert_array_equal(_bits(dequantize(fmt, raw, n)), _bits(dequantize(fmt, raw, n, hoist=False)))


def _loads(e):
    found = []
    walk_expr(e, lambda node: found.append(node) if isinstance(node, FieldLoad) else None)
    return found


@pytest.mark.parametrize("fmt", DECODABLE, ids=_ids(DECODABLE))
def test_every_load_index_is_in_range_for_every_element(fmt):
    # Kernels evaluate both Select branches, so every load anywhere must stay inside its field.
    exprs = [lt.expr for lt in fmt.lets] + [fmt.value]
    for e in exprs:
        for load in _loads(e):
            count = fmt.field(load.field).count
            for i in range(fmt.block_size):
                idx = _index_value(fmt, load.index, i)
                assert 0 <= idx < count, (fmt.name, load, i, idx)


@pytest.mark.parametrize("fmt", ALL, ids=_ids(ALL))
def test_row_and_tensor_bytes_match_gguf_sizes(fmt):
    if fmt.ggml_type is not None:
        assert (fmt.block_size, fmt.block_bytes) == gguf.GGML_QUANT_SIZES[GT(fmt.ggml_type)]
        assert GT(fmt.ggml_type).name == fmt.name
    assert row_bytes(fmt, 3 * fmt.block_size) == 3 * fmt.block_bytes
    assert tensor_bytes(fmt, (5, 2, 4 * fmt.block_size)) == 40 * fmt.block_bytes
    assert tensor_bytes(fmt, 4 * fmt.block_size) == 4 * fmt.block_bytes


def test_q8_g64_layout_is_scale_then_64_int8_codes():
    fmt = by_name("q8_g64")
    assert (fmt.ggml_type, fmt.block_size, fmt.block_bytes) == (None, 64, 66)
    codes = np.arange(-32, 32, dtype=np.int8)
    block = np.concatenate([np.array([0.25], dtype="<f2").view(np.uint8), codes.view(np.uint8)])
    np.testing.assert_array_equal(dequantize(fmt, block, 64), codes.astype(np.float32) * np.float32(0.25))


@pytest.mark.parametrize("fmt", QUANTIZED + [F32, F16, BF16], ids=_ids(QUANTIZED + [F32, F16, BF16]))
def test_quantize_round_trip_within_format_error(fmt):
    x = _test_data(cols=max(2048, fmt.block_size))
    raw = quantize(fmt, x)
    assert raw.dtype == np.uint8 and raw.shape == (x.shape[0], row_bytes(fmt, x.shape[1]))
    y = dequantize(fmt, raw)
    assert y.shape == x.shape
    assert _rel_rms(y, x) <= MAX_REL_RMS[fmt.name]
    if fmt.scheme is not None:
        # Per element: at most error_bound_steps(fmt) of its own group's decoded step (plus float slack).
        step, _ = element_steps(fmt, raw)
        bound = error_bound_steps(fmt) * np.abs(step) * (1 + 1e-5) + 1e-6 * np.abs(x).max()
        assert np.all(np.abs(y - x) <= bound)


@pytest.mark.parametrize("fmt", QUANTIZED, ids=_ids(QUANTIZED))
def test_quantize_handles_zero_and_constant_blocks(fmt):
    x = np.zeros((3, 2 * fmt.block_size), dtype=np.float32)
    x[1] = 1.5
    x[2, : fmt.block_size] = -2.0
    y = dequantize(fmt, quantize(fmt, x))
    assert np.all(np.isfinite(y))
    np.testing.assert_array_equal(y[0], 0.0)
    step, _ = element_steps(fmt, quantize(fmt, x))
    assert np.all(np.abs(y - x) <= error_bound_steps(fmt) * np.abs(step) * (1 + 1e-5) + 1e-6)


@pytest.mark.parametrize("fmt", [f for f in QUANTIZED if f.ggml_type is not None] + [F16, BF16],
                         ids=_ids([f for f in QUANTIZED if f.ggml_type is not None] + [F16, BF16]))
def test_our_quantized_bytes_decode_identically_in_gguf(fmt):
    raw = quantize(fmt, _test_data(rows=4, seed=3))
    np.testing.assert_array_equal(_bits(dequantize(fmt, raw)), _bits(_gguf_dequant(fmt, raw)))


@pytest.mark.parametrize("name", GGUF_QUANTIZERS)
def test_quantize_error_close_to_gguf_quantizer(name):
    fmt = by_name(name)
    x = _test_data(seed=5)
    ours = _rel_rms(dequantize(fmt, quantize(fmt, x)), x)
    ref_raw = np.asarray(gguf.quants.quantize(x, GT(fmt.ggml_type))).view(np.uint8)
    ref = _rel_rms(_gguf_dequant(fmt, ref_raw), x)
    assert ours <= ref * 1.05 + 1e-9
    if name in ("F16", "BF16"):  # plain conversions: must be the same bytes
        np.testing.assert_array_equal(quantize(fmt, x), ref_raw.reshape(x.shape[0], -1))


def test_bf16_quantize_keeps_nan_and_inf():
    x = np.array([np.nan, np.inf, -np.inf, -0.0, 1.0 + 2**-8], dtype=np.float32)
    y = dequantize(BF16, quantize(BF16, x))
    assert np.isnan(y[0]) and y[1] == np.inf and y[2] == -np.inf
    assert _bits(y[3:4])[0] == 0x80000000 and y[4] == 1.0  # ties round to even


def test_unknown_ggml_type_id_raises_gguf_error():
    with pytest.raises(GGUFError, match="unknown tensor type id 9 "):
        by_ggml_type(9)  # Q8_1: a real GGML type we do not support
    with pytest.raises(GGUFError, match="unknown tensor type id 1234"):
        by_ggml_type(1234)


def test_ggml_type_ids_resolve_to_their_formats():
    for fmt in FORMATS.values():
        assert by_ggml_type(fmt.ggml_type) is fmt
        assert by_ggml_type(GT(fmt.ggml_type)) is fmt


def test_by_name_is_case_insensitive_and_lists_known_names():
    assert by_name("q4_k") is Q4_K
    assert by_name("iq4_xs") is IQ4_XS
    assert by_name("f16") is F16 and KV_FORMATS["f16"] is F16
    assert by_name("Q8_G64") is Q8_G64
    assert by_name("q8_0").block_bytes == 34
    with pytest.raises(UnsupportedError, match="Q4_K.*q8_g64"):
        by_name("q7_z")


def test_bad_row_length_is_a_clear_error():
    with pytest.raises(GGUFError, match="100 elements is not a multiple of Q4_K's block size 256"):
        row_bytes(Q4_K, 100)
    with pytest.raises(GGUFError, match="not a multiple"):
        tensor_bytes(Q8_0, (4, 33))
    with pytest.raises(GGUFError, match="not a multiple"):
        quantize(Q4_0, np.zeros((2, 48), dtype=np.float32))
    with pytest.raises(GGUFError, match="needs 68 bytes, got 34"):
        dequantize(Q8_0, np.zeros(34, dtype=np.uint8), 64)


def test_raw_int_tensors_have_sizes_but_no_dequantize():
    assert by_ggml_type(26) is I32 and row_bytes(I32, 10) == 40
    with pytest.raises(UnsupportedError):
        dequantize(I32, np.zeros(8, dtype=np.uint8), 2)


def test_expressions_are_type_checked():
    with pytest.raises(ValueError, match="operator"):  # int * float needs an explicit ToF32
        QuantFormat("BAD", None, 1, 4, (Field("v", 0, "u32"),), value=FieldLoad("v", 0) * 2.0)
    with pytest.raises(ValueError, match="group"):  # a per-block let cannot use a per-element one
        QuantFormat("BAD", None, 2, 2, (Field("v", 0, "u8", 2),),
                      lets=(GroupLet("q", FieldLoad("v", Var("i"))), GroupLet("s", Var("q") + 1, 2)),
                      value=ToF32(Var("s")))


def test_format_metadata_for_codegen():
    assert Q4_K.let("dl").group == 32 and Q4_K.let("q").group == 1
    assert IQ4_XS.tables == {"iq4nl": TABLES["iq4nl"]}
    assert Q4_0.tables == {}
    assert code_range(Q3_K, "q") == (-4, 3) and code_range(Q6_K, "sc") == (-128, 127)



def test_padded_layout_decodes_like_the_gguf_one():
    """Q6_K padded to 16-byte blocks (a device layout): the repacked bytes decode to the same values, every block
    starts 16-byte aligned, formats already aligned stay themselves, and repacking into an unrelated layout fails."""
    q6 = FORMATS["Q6_K"]
    p16 = padded(q6, 16)
    assert (p16.block_bytes, p16.ggml_type, p16.block_size) == (224, None, 256)
    assert padded(FORMATS["Q4_K"], 16) is FORMATS["Q4_K"]
    raw = quantize(q6, _test_data(rows=3, cols=512))
    packed = repack(raw, q6, p16)
    assert packed.size == 3 * 2 * 224 and not packed.reshape(-1, 224)[:, 210:].any()
    np.testing.assert_array_equal(_bits(dequantize(p16, packed, (3, 512))), _bits(dequantize(q6, raw, (3, 512))))
    with pytest.raises(ValueError, match="not a padded layout"):
        repack(raw, q6, padded(FORMATS["Q8_0"], 16))


def test_sliced_layout_moves_slices_and_decodes_like_the_gguf_one():
    """Q4_K rows sliced (a device layout): slice s of block b of a row lands at (s * blocks + b) * 16 in that row,
    rows keep their place, the bytes decode to the same values, and formats or rows that do not cut into whole
    16-byte slices are refused."""
    q4 = FORMATS["Q4_K"]
    rows, cols = 3, 1024
    s4 = sliced(q4, cols)
    assert (s4.name, s4.row_blocks, s4.block_bytes, s4.ggml_type) == ("Q4_K_S4", 4, 144, None)
    raw = quantize(q4, _test_data(rows=rows, cols=cols))
    packed = repack(raw, q4, s4)
    src = np.asarray(raw).reshape(rows, 4, 9, 16)
    dst = packed.reshape(rows, 9, 4, 16)
    for r, b, s in ((0, 0, 0), (1, 3, 8), (2, 1, 5)):
        np.testing.assert_array_equal(dst[r, s, b], src[r, b, s])
    np.testing.assert_array_equal(_bits(dequantize(s4, packed, (rows, cols))),
                                  _bits(dequantize(q4, raw, (rows, cols))))
    # Padded, then sliced: Q6_K in 224-byte blocks.
    q6 = FORMATS["Q6_K"]
    s6 = sliced(padded(q6, 16), 512)
    raw6 = quantize(q6, _test_data(rows=2, cols=512))
    np.testing.assert_array_equal(_bits(dequantize(s6, repack(raw6, q6, s6), (2, 512))),
                                  _bits(dequantize(q6, raw6, (2, 512))))
    for fmt, n in ((q6, 512), (FORMATS["Q8_0"], 64), (q4, 1000), (s4, 1024)):
        with pytest.raises(ValueError, match="cannot be sliced"):
            sliced(fmt, n)


@pytest.mark.parametrize("name,width", [("Q8_0", 128), ("q8_g64", 128), ("q8_g64", 64)])
def test_split_rows_layout_keeps_codes_then_scales(name, width):
    """A KV head row split into codes and scales (a device layout): the row's codes first, in order, then its
    blocks' f16 scales side by side; same bytes a row, and the bytes decode to the same values. Formats whose codes
    are not a byte an element are refused."""
    fmt = by_name(name)
    sr = split_rows(fmt, width)
    nb = width // fmt.block_size
    assert (sr.block_size, sr.block_bytes, sr.ggml_type) == (width, nb * fmt.block_bytes, None)
    rows = 3
    raw = quantize(fmt, _test_data(rows=rows, cols=2 * width))
    packed = repack(raw, fmt, sr).reshape(2 * rows, -1)
    blocks = np.asarray(raw).reshape(2 * rows, nb, fmt.block_bytes)
    np.testing.assert_array_equal(packed[:, :width], blocks[:, :, 2:].reshape(2 * rows, width))
    np.testing.assert_array_equal(packed[:, width:], blocks[:, :, :2].reshape(2 * rows, 2 * nb))
    np.testing.assert_array_equal(_bits(dequantize(sr, packed, (rows, 2 * width))),
                                  _bits(dequantize(fmt, raw, (rows, 2 * width))))
    for bad, n in ((FORMATS["Q4_0"], 64), (FORMATS["Q4_K"], 256), (fmt, width + 16)):
        with pytest.raises(ValueError, match="cannot be split"):
            split_rows(bad, n)

"""Target policies: what a target states about itself, as data (DESIGN.md, principle 9).

A `Policy` holds a target's capabilities (lanes per group, subgroup width, wide loads, a native int8 dot
product, local memory, the storage layouts it prefers) and what its schedule knobs default to where a recipe's
knob space says "auto" and the choice depends on the target (`knobs`: knob space -> knob -> value). Each runtime
declares its own (`Runtime.policy`, `runtimes/<target>.py`); the compiler hands it to the recipes through
`RecipeContext.policy`, and the recipes ask it instead of guessing the target from a lane count. The tuner's
choices (`polystrata/tuning/`) override these defaults per kernel.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from llvmlite import binding as llvm

from polystrata.codegen.lanes import MatrixInstr, MatrixUnit
from polystrata.ir.formats import QuantFormat
from polystrata.ir.layout import split_rows

# Formats whose blocks a target with wide loads reads padded to 16 bytes (`ir.layout.padded`): Q6_K's 210-byte
# blocks are only 2-byte aligned, so each of their loads was a 2-byte one. Costs 14 bytes a block (6.7 %).
PADDED_ON_WIDE_LOADS = ("Q6_K",)
# Formats whose rows a target with wide loads keeps `sliced` (`ir.layout.sliced`): the matvecs' lanes, two a
# block, each load 16 bytes of their block, so in the GGUF layout a warp's load touched 16 cache lines; sliced,
# 2 lines of 256 bytes. Same bytes, moved at upload (docs/benchmarks.md, H200, seventh and eighth sessions).
# Q6_K's matvec reads interleaved words, whose slices' addresses would be computed at run time; not tried.
SLICED_ON_WIDE_LOADS = ("Q4_K", "Q5_K")
# KV cache types whose cache rows a target with wide loads keeps split, a head's codes before its scales
# (`ir.layout.split_rows`): in the GGUF layout q8_0's 34- and q8_g64's 66-byte blocks hold their codes 2-byte
# aligned behind each scale, read a byte a lane, and each f16 scale took two byte loads (docs/benchmarks.md,
# "Decode at depth"). Split, the codes are aligned words and the scales one word load. Same bytes a row.
SPLIT_KV_ON_WIDE_LOADS = ("Q8_0", "q8_g64")


def host_vnni() -> bool:
    """Whether the CPU Numba compiles for has a 256-bit int8 dot product instruction, `vpdpbusd` (AVX-512 VNNI with
    AVX-512 VL, or AVX-VNNI): the host's features as LLVM reports them, unless `NUMBA_CPU_NAME` names another CPU
    (a portable cache: `generic`), whose `NUMBA_CPU_FEATURES` are then the ones to read (none given: none)."""
    from numba.core import config

    if config.CPU_NAME and config.CPU_NAME != "host":
        named = {f[1:] for f in (config.CPU_FEATURES or "").split(",") if f.startswith("+")}
        features = dict.fromkeys(named, True)
    else:
        features = llvm.get_host_cpu_features()
    return bool((features.get("avx512vnni") and features.get("avx512vl")) or features.get("avxvnni"))


HOST_VNNI = host_vnni()
MMA_OFF = 1 << 20  # knob mma_min past every matrix: the tile products unused (codegen/recipes/tile_mma.py)

# The schedules picked by hand for the host CPU (one lane: a lane takes whole rows, per-element partial sums
# that vectorize, activations quantized inside the kernel if at all, multiply-adds fused in the dot products,
# which are bound by arithmetic there; no split-K attention) ...
HOST_KNOBS: Mapping[str, Mapping[str, Any]] = {
    # tile_q8: steps of several tokens take the int8 tile matmul (`tile_matmul_q8_kernel`), tiles of 256 tokens
    # (a row's levels decoded once for a 256-token step), where the host has VNNI (docs/benchmarks.md, "Prefill on
    # the CPU: int8 tiles" and "... two tokens a call"); elsewhere (0) the f32 tiles. tile_q8_rows: its rows a
    # group (8: x1.1 on gemma3's gate+up over 4, which the one-token matmuls keep).
    "matmul": {"split": "rows", "rows": 4, "xq": "inline", "int8": 0, "vert": 1, "contract": 1, "reuse": 0,
               "tile_q8": 256 if HOST_VNNI else 0, "tile_q8_rows": 8, "mma_min": MMA_OFF, "mma_chunk": 64,
               "mma_tokens": 32, "mma_split": 0, "mma_split_above": 1},
    "moe_ffn": {"split": "rows", "xq": "inline", "contract": 1, "mma_min": MMA_OFF, "mma_chunk": 64, "mma_tokens": 32},
    # group_heads: a KV head's query heads in one group (knob heads "auto"), each K and V value decoded once for all,
    # one-token plans keeping at least this many groups a token for the cores (docs/benchmarks.md, "Attention's
    # query heads grouped on the CPU"); 0: the GPUs' rule (attention.py).
    "attention": {"split_keys": 0, "group_heads": 2},
    # Steps of more tokens than this take the delta rule's chunked form: never on the host, where its lanes are
    # one and it does the recurrent form's arithmetic over more memory, slower there (docs/benchmarks.md, hybrids).
    "delta_rule": {"chunked_above": 1 << 30},
}
# ... and for GPUs (a group per row, its lanes sharing the row's blocks; activations quantized to int8 once per
# matmul by their own kernel; attention keys split over groups, flash-decoding).
DEVICE_KNOBS: Mapping[str, Mapping[str, Any]] = {
    # reuse (a token tile's weights decoded once for all its tokens) stays off until measured on a GPU
    # (docs/benchmarks.md, "H200, 2026-12-05, second session"): `bench`/`serve --knob matmul.reuse=1`.
    # mma_min: the smallest matrix whose prompt steps of more than 64 tokens take tile products, where the device
    # has matrix units (pp512 3.5x the int8 matvecs on the H200, the MoE preset's 2.6x with the experts'; docs/
    # benchmarks.md, "H200, 2026-12-05, eighth session"); shorter steps keep the int8 matvecs. mma_chunk: their K
    # a staging round, 128 (the Q4_K 14336 x 4096 x 512 matmul 76.5 TFLOP/s against 69.9 at 64, same place).
    # mma_tokens: a tile's tokens, 64 for the matmuls (H100: pp512 4071 against 3732 tok/s at 32; docs/
    # benchmarks.md, "Where the int8 tile kernel's time goes"), 32 for the experts, whose tiles hold the few
    # tokens routed to each.
    # mma_split / mma_split_above: steps of 6-64 rows (batched decoding) on tile products of K in 4 parts, shorter
    # ones on the int8 matvecs (H100: ffn_up at 16 rows 49.5 against 159.9 us, at 8 rows 47.7 against 67.0, at 4
    # rows 46.6 against 37.2; 16 streams 830 against 573 tok/s: docs/benchmarks.md, "Serving: split-K").
    "matmul": {"split": "blocks", "rows": 1, "xq": "kernel", "int8": 1, "vert": 0, "contract": 0, "reuse": 0,
               "tile_q8": 0, "tile_q8_rows": 4, "mma_min": 512, "mma_chunk": 128, "mma_tokens": 64, "mma_split": 4,
               "mma_split_above": 5},
    "moe_ffn": {"split": "blocks", "xq": "kernel", "contract": 0, "mma_min": 512, "mma_chunk": 128,
                "mma_tokens": 32},
    "attention": {"split_keys": 1, "group_heads": 0},
    "delta_rule": {"chunked_above": 16},
}


@dataclass(frozen=True)
class Policy:
    """A target's capabilities and its default schedule knobs."""

    lanes: int = 1  # work-items per group the recipes use (1: the host's loops)
    subgroup: int = 1  # subgroup / warp width (1: none)
    wide_loads: bool = False  # the compiler merges runs of aligned neighbouring loads into 16-byte loads
    int8_dot: bool = False  # a 4-way int8 dot product instruction (`dot4_i8` lowers to it; else the portable form)
    local_bytes: int = 48 * 1024  # local (shared) memory a group may use
    # The tile product kinds (`ir.kernel.TileMMA.kind`) the renderer spells on the device's matrix unit (tensor
    # cores, MFMA, WMMA; `matrix_kinds(unit)`), none without one (`matrix_units`). A recipe takes the "u8f16"
    # products (knob mma_f16) only where they are among them (elsewhere they render as loops).
    matrix_kinds: tuple[str, ...] = ()
    # The kernels run as loops on the host: block base addresses masked non-negative (`_matvec.NONNEG`: LLVM then
    # proves loads in bounds and vectorizes).
    host_arith: bool = False
    padded_formats: tuple[str, ...] = ()  # weight formats kept with blocks padded to 16 bytes (`ir.layout.padded`)
    sliced_formats: tuple[str, ...] = ()  # weight formats kept in sliced rows (`ir.layout.sliced`)
    split_kv_formats: tuple[str, ...] = ()  # KV cache types kept in split rows (`kv_layout`)
    knobs: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # knob space -> knob -> default
    # Knobs whose every value renders the same code here (the tuner does not try them): `contract` only grants a
    # permission (`Kernel.contract`) that the GPU renderers do not use.
    inert_knobs: tuple[str, ...] = ()
    # The tuning database's choices for this device (`polystrata.tuning.apply_tuning`): kernel instance signature
    # (`KnobSpace.signature`) -> knob overrides; and by knob space name, overrides for all its kernels (`bench --knob`).
    tuned: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    @property
    def matrix_units(self) -> bool:
        """Whether the renderer spells tile products on matrix units: prefill matmuls then take
        `codegen/recipes/tile_mma.py`'s kernels."""
        return bool(self.matrix_kinds)

    def default(self, space: str, knob: str) -> Any:
        """What knob `knob` of knob space `space` means on this target when it is "auto"."""
        try:
            return self.knobs[space][knob]
        except KeyError:
            raise KeyError(f"the target policy has no default for knob {space}.{knob}") from None

    def knob(self, space: str, knob: str, value: Any) -> Any:
        """A knob's value as a recipe read it: `value`, or where that is "auto", this target's (`default`)."""
        return self.default(space, knob) if value == "auto" else value

    def kv_layout(self, fmt: QuantFormat, width: int) -> QuantFormat:
        """How this target keeps a KV cache head row of `width` values of type `fmt`: split into codes and scales
        (`ir.layout.split_rows`) where the policy says so and the row's bytes are whole 4-byte words (so that
        every row's codes start on a word), else in `fmt`'s own blocks."""
        if fmt.name in self.split_kv_formats and width % fmt.block_size == 0 \
                and width // fmt.block_size * fmt.block_bytes % 4 == 0:
            return split_rows(fmt, width)
        return fmt

    def with_shape(self, lanes: int, subgroup: int) -> Policy:
        """This policy for a device whose lane counts are known only once it is opened (OpenCL, HIP)."""
        return replace(self, lanes=lanes, subgroup=subgroup)


HOST_POLICY = Policy(host_arith=True, knobs=HOST_KNOBS)


def device_policy(lanes: int, subgroup: int, wide_loads: bool = False, int8_dot: bool = False) -> Policy:
    """A GPU's policy with the GPU schedules (a wide-load target also keeps the padded, sliced and split
    layouts)."""
    layouts = (PADDED_ON_WIDE_LOADS, SLICED_ON_WIDE_LOADS, SPLIT_KV_ON_WIDE_LOADS) if wide_loads else ((), (), ())
    return Policy(lanes=lanes, subgroup=subgroup, wide_loads=wide_loads, int8_dot=int8_dot,
                  padded_formats=layouts[0], sliced_formats=layouts[1], split_kv_formats=layouts[2],
                  knobs=DEVICE_KNOBS, inert_knobs=("contract",))


def shape_policy(lanes: int, subgroup: int, wide_loads: bool = False) -> Policy:
    """The policy of a context made from a bare target shape, without a runtime (kernel tests, scripts that
    build plans for a shape): the host's with one lane, a GPU's otherwise."""
    return HOST_POLICY if lanes == 1 else device_policy(lanes, subgroup, wide_loads)


# --- what GPU architectures have, as data: their matrix units and 4-way int8 dot products -----------------------
# A `MatrixUnit` (`codegen/lanes.py`) is a tile shape, the lanes' accumulator layout and, per instruction, which
# operand words each lane passes; the renderers only spell the instruction names (`lanes.MatrixOp`).


def _mma_a(lane):
    """A operand words of m16n8k32 (s8) and m16n8k16 (f16): rows g, g + 8 at words t, t + 4 of the K step."""
    g, t = lane // 4, lane % 4
    return ((g, t), (g + 8, t), (g, t + 4), (g + 8, t + 4))


def _mma_b(lane):
    return ((lane // 4, lane % 4), (lane // 4, lane % 4 + 4))


# NVIDIA sm_80+ `mma.sync` on one warp's 16 x 8 tile (PTX ISA, "Matrix fragments for mma.m16n8k16 / m16n8k32":
# groupID = lane / 4, threadID_in_group = lane % 4; accumulator r of a lane at row groupID + 8 (r / 2), column
# 2 threadID_in_group + r % 2). The op names are cuda's intrinsics (`codegen/cuda_intrinsics.py`).
MMA_SYNC = MatrixUnit(32, 16, 8, 4, lambda lane, r: (lane // 4 + 8 * (r // 2), lane % 4 * 2 + r % 2), (
    MatrixInstr("i8", 8, "mma_s8_k32", _mma_a, _mma_b),
    MatrixInstr("i8", 4, "mma_s8_k16", lambda lane: _mma_a(lane)[:2], lambda lane: _mma_b(lane)[:1]),
    MatrixInstr("f16", 8, "mma_f16_k16", _mma_a, _mma_b),
    # u8f16 (`ir.kernel.TileMMA`): an f16 m16n8k16 whose K order is chosen so that a lane's A values are the four
    # bytes of one word of each of its rows (t) and its B values the two f16 pairs that u8f16's B layout puts at
    # words t and t + 4 of the step; the instruction turns the bytes into f16 values with the rows' scales (passed
    # after the words) on the way.
    MatrixInstr("u8f16", 4, "mma_u8f16_k16", lambda lane: _mma_a(lane)[:2], _mma_b),
))


def _row_words(per: int, spread: bool):
    """Operand words of a 16x16xK AMD step: lane l passes row (column) l % 16, words per * (l / 16) + 0..per-1 with
    `spread` (MFMA: the K step spread over the wave's four rows of 16 lanes), else words 0..per-1 (WMMA: lanes 16-31
    repeat lanes 0-15)."""
    return lambda lane: tuple((lane % 16, (lane // 16 * per if spread else 0) + w) for w in range(per))


def _mfma(i8_words: int, i8_op: str) -> MatrixUnit:
    # AMD matrix instruction calculator, 16x16 tiles on wave64: accumulator r of lane l at row 4 (l / 16) + r,
    # column l % 16.
    a = _row_words(i8_words // 4, True)
    return MatrixUnit(64, 16, 16, 4, lambda lane, r: (lane // 16 * 4 + r, lane % 16), (
        MatrixInstr("i8", i8_words, i8_op, a, a),
        MatrixInstr("f16", 8, "__builtin_amdgcn_mfma_f32_16x16x16f16", _row_words(2, True), _row_words(2, True)),
    ))


# RDNA3 WMMA in wave32 (AMD's "How to accelerate AI applications on RDNA 3 using WMMA"): accumulator r of lane l at
# row 2 r + l / 16, column l % 16.
WMMA = MatrixUnit(32, 16, 16, 8, lambda lane, r: (2 * r + lane // 16, lane % 16), (
    MatrixInstr("i8", 4, "__builtin_amdgcn_wmma_i32_16x16x16_iu8_w32", _row_words(4, False), _row_words(4, False)),
    MatrixInstr("f16", 8, "__builtin_amdgcn_wmma_f32_16x16x16_f16_w32", _row_words(8, False), _row_words(8, False)),
))
# The matrix unit of each AMD architecture that has one, in its default wave size: MFMA on CDNA (int8 16x16x16 on
# gfx908/gfx90a, 16x16x32 on gfx94x), WMMA on RDNA3.
MATRIX_ARCHS = {"gfx908": _mfma(4, "__builtin_amdgcn_mfma_i32_16x16x16i8"),
                "gfx90a": _mfma(4, "__builtin_amdgcn_mfma_i32_16x16x16i8"),
                **{a: _mfma(8, "__builtin_amdgcn_mfma_i32_16x16x32_i8") for a in ("gfx940", "gfx941", "gfx942")},
                **{a: WMMA for a in ("gfx1100", "gfx1101", "gfx1102", "gfx1103", "gfx1150", "gfx1151")}}
# AMD architectures whose ISA has v_dot4_i32_i8 (LLVM's dot1-insts; checked with hiprtc for the ROCm 5.2 ones).
SDOT4_ARCHS = frozenset({"gfx906", "gfx908", "gfx90a", "gfx1011", "gfx1012", "gfx1030", "gfx1031", "gfx1032",
                         "gfx1033", "gfx1034", "gfx1035", "gfx1036"})


def base_arch(arch: str) -> str:
    """`gfx90a:xnack-` -> `gfx90a` (target features do not change the ISA family)."""
    return arch.split(":", 1)[0].strip().lower()


def matrix_kinds(unit: MatrixUnit | None) -> tuple[str, ...]:
    """The tile product kinds `unit` has instructions for (none without a unit)."""
    return tuple(dict.fromkeys(i.kind for i in unit.instrs)) if unit else ()


def matrix_unit(arch: str) -> MatrixUnit | None:
    """The matrix unit of GPU architecture `arch` (`sm_NN`: mma.sync from sm_80; `gfxNNN[:features]`), if any."""
    a = base_arch(arch)
    if a.startswith("sm_"):
        return MMA_SYNC if a[3:].isdigit() and int(a[3:]) >= 80 else None
    return MATRIX_ARCHS.get(a)

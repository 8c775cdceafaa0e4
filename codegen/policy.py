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

# Formats whose blocks a target with wide loads reads padded to 16 bytes (`ir.layout.padded`): Q6_K's 210-byte
# blocks are only 2-byte aligned, so each of their loads was a 2-byte one. Costs 14 bytes a block (6.7 %).
PADDED_ON_WIDE_LOADS = ("Q6_K",)
# Formats whose rows a target with wide loads keeps `sliced` (`ir.layout.sliced`): the matvecs' lanes, two a
# block, each load 16 bytes of their block, so in the GGUF layout a warp's load touched 16 cache lines; sliced,
# 2 lines of 256 bytes. Same bytes, moved at upload (docs/benchmarks.md, H200, seventh and eighth sessions).
# Q6_K's matvec reads interleaved words, whose slices' addresses would be computed at run time; not tried.
SLICED_ON_WIDE_LOADS = ("Q4_K", "Q5_K")

# The schedules picked by hand for the host CPU (one lane: a lane takes whole rows, per-element partial sums
# that vectorize, activations quantized inside the kernel if at all; no split-K attention) ...
HOST_KNOBS: Mapping[str, Mapping[str, Any]] = {
    "matmul": {"split": "rows", "rows": 4, "xq": "inline", "int8": 0, "vert": 1},
    "moe_ffn": {"split": "rows", "xq": "inline"},
    "attention": {"split_keys": 0},
    # Steps of more tokens than this take the delta rule's chunked form: never on the host, where its lanes are
    # one and it does the recurrent form's arithmetic over more memory, slower there (docs/benchmarks.md, hybrids).
    "delta_rule": {"chunked_above": 1 << 30},
}
# ... and for GPUs (a group per row, its lanes sharing the row's blocks; activations quantized to int8 once per
# matmul by their own kernel; attention keys split over groups, flash-decoding).
DEVICE_KNOBS: Mapping[str, Mapping[str, Any]] = {
    "matmul": {"split": "blocks", "rows": 1, "xq": "kernel", "int8": 1, "vert": 0},
    "moe_ffn": {"split": "blocks", "xq": "kernel"},
    "attention": {"split_keys": 1},
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
    # The renderer spells tile products (`ir.kernel.TileMMA`) on matrix units (tensor cores, MFMA, WMMA): prefill
    # matmuls take `codegen/recipes/tile_mma.py`'s kernels.
    matrix_units: bool = False
    # The kernels run as loops on the host: block base addresses masked non-negative (`_matvec.NONNEG`: LLVM then
    # proves loads in bounds and vectorizes) and f16 scales decoded by arithmetic (`dequant.f16_bits_to_f32_arith`).
    host_arith: bool = False
    padded_formats: tuple[str, ...] = ()  # weight formats kept with blocks padded to 16 bytes (`ir.layout.padded`)
    sliced_formats: tuple[str, ...] = ()  # weight formats kept in sliced rows (`ir.layout.sliced`)
    knobs: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # knob space -> knob -> default
    # The tuning database's choices for this device (`polystrata.tuning.apply_tuning`): kernel instance signature
    # (`KnobSpace.signature`) -> knob overrides; and by knob space name, overrides for all its kernels (`bench --knob`).
    tuned: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def default(self, space: str, knob: str) -> Any:
        """What knob `knob` of knob space `space` means on this target when it is "auto"."""
        try:
            return self.knobs[space][knob]
        except KeyError:
            raise KeyError(f"the target policy has no default for knob {space}.{knob}") from None

    def with_shape(self, lanes: int, subgroup: int) -> Policy:
        """This policy for a device whose lane counts are known only once it is opened (OpenCL, HIP)."""
        return replace(self, lanes=lanes, subgroup=subgroup)


HOST_POLICY = Policy(host_arith=True, knobs=HOST_KNOBS)


def device_policy(lanes: int, subgroup: int, wide_loads: bool = False, int8_dot: bool = False) -> Policy:
    """A GPU's policy with the GPU schedules (a wide-load target also keeps the padded and sliced layouts)."""
    layouts = (PADDED_ON_WIDE_LOADS, SLICED_ON_WIDE_LOADS) if wide_loads else ((), ())
    return Policy(lanes=lanes, subgroup=subgroup, wide_loads=wide_loads, int8_dot=int8_dot,
                  padded_formats=layouts[0], sliced_formats=layouts[1], knobs=DEVICE_KNOBS)


def shape_policy(lanes: int, subgroup: int, wide_loads: bool = False) -> Policy:
    """The policy of a context made from a bare target shape, without a runtime (kernel tests, scripts that
    build plans for a shape): the host's with one lane, a GPU's otherwise."""
    return HOST_POLICY if lanes == 1 else device_policy(lanes, subgroup, wide_loads)

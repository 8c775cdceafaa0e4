"""HIP C++ renderer: the C-family printer with HIP's spellings, for AMD GPUs (and CUDA behind `cuda_prelude`).

Only what differs from `codegen/cfamily.py` lives here: `extern "C" __global__` kernels with
`__launch_bounds__(lanes)`, `blockIdx` / `threadIdx`, `__syncthreads()`, `__shared__` arrays, f16 through
`__half2float` / `__float2half_rn`, `__shfl_xor` butterfly steps over the wavefront (`wave`: 64 on gfx9 and
older, 32 on RDNA gfx10+), and `__builtin_amdgcn_sdot4` for `dot4_i8` where the architecture has `v_dot4_i32_i8`.

The target declares a subgroup (the wave) that also reduces a power-of-two part of itself and groups of several
waves; `codegen/lanes.py` picks the combine from that. On CDNA (`MATRIX_ARCHS`) it declares an MFMA matrix unit:
tile products become `__builtin_amdgcn_mfma_*` on 16 x 16 tiles of a wave64 (int8: 16x16x16i8 on gfx908/gfx90a,
16x16x32_i8 on gfx94x; f16: 16x16x16f16), on RDNA3 (gfx11) WMMA in wave32 (`WMMA`: spelled and checked against an
emulation of its layout, but never compiled here: ROCm 5.2's hiprtc does not know gfx11). RDNA2 takes the portable
loops, whose int8 sums are `dot4_i8` (sdot4 where the ISA has it: gfx1030's "dp4a path").
"""

from __future__ import annotations

import re

from polystrata.codegen.cfamily import CPrinter
from polystrata.codegen.lanes import LaneAbilities, MatrixInstr, MatrixUnit
from polystrata.ir.kernel import Kernel

# Architectures whose ISA has v_dot4_i32_i8 (LLVM's dot1-insts; checked with hiprtc for the ROCm 5.2 ones).
SDOT4_ARCHS = frozenset({"gfx906", "gfx908", "gfx90a", "gfx1011", "gfx1012", "gfx1030", "gfx1031", "gfx1032",
                         "gfx1033", "gfx1034", "gfx1035", "gfx1036"})



def _mfma_words(per: int):
    """Operand words of a 16x16xK MFMA step: lane l passes row (column) l % 16, words per * (l / 16) + 0..per-1."""
    return lambda lane: tuple((lane % 16, lane // 16 * per + w) for w in range(per))


def _mfma(i8_words: int, i8_op: str) -> MatrixUnit:
    # AMD matrix instruction calculator, 16x16 tiles on wave64: accumulator r of lane l at row 4 (l / 16) + r,
    # column l % 16.
    return MatrixUnit(64, 16, 16, 4, lambda lane, r: (lane // 16 * 4 + r, lane % 16), (
        MatrixInstr("i8", i8_words, i8_op, _mfma_words(i8_words // 4), _mfma_words(i8_words // 4)),
        MatrixInstr("f16", 8, "__builtin_amdgcn_mfma_f32_16x16x16f16", _mfma_words(2), _mfma_words(2)),
    ))


def _wmma_words(n: int):
    """Operand words of a wave32 WMMA step: lane l passes row (column) l % 16, all n words of it (lanes 16-31 repeat
    lanes 0-15)."""
    return lambda lane: tuple((lane % 16, w) for w in range(n))


# RDNA3 WMMA (AMD's "How to accelerate AI applications on RDNA 3 using WMMA"): accumulator r of lane l at row
# 2 r + l / 16, column l % 16.
WMMA = MatrixUnit(32, 16, 16, 8, lambda lane, r: (2 * r + lane // 16, lane % 16), (
    MatrixInstr("i8", 4, "__builtin_amdgcn_wmma_i32_16x16x16_iu8_w32", _wmma_words(4), _wmma_words(4)),
    MatrixInstr("f16", 8, "__builtin_amdgcn_wmma_f32_16x16x16_f16_w32", _wmma_words(8), _wmma_words(8)),
))
# The matrix unit of each architecture that has one (in its default wave size: MFMA wave64, WMMA wave32).
MATRIX_ARCHS = {"gfx908": _mfma(4, "__builtin_amdgcn_mfma_i32_16x16x16i8"),
                "gfx90a": _mfma(4, "__builtin_amdgcn_mfma_i32_16x16x16i8"),
                **{a: _mfma(8, "__builtin_amdgcn_mfma_i32_16x16x32_i8") for a in ("gfx940", "gfx941", "gfx942")},
                **{a: WMMA for a in ("gfx1100", "gfx1101", "gfx1102", "gfx1103", "gfx1150", "gfx1151")}}
# The operand and accumulator vector types of the matrix builtins.
_MATRIX_TYPES = "".join(f"typedef {t} ps_{n} __attribute__((ext_vector_type({w})));\n" for t, n, w in (
    ("int", "i32x4", 4), ("float", "f32x4", 4), ("_Float16", "f16x4", 4), ("unsigned int", "u32x2", 2),
    ("int", "i32x8", 8), ("float", "f32x8", 8), ("_Float16", "f16x16", 16), ("unsigned int", "u32x8", 8)))

# `a*b+c` must not become an FMA (quantized dot products match the CPU target bit for bit); the runtime also
# passes -ffp-contract=off. The fp16 header is only needed for the native f16 conversions.
_PRELUDE = """\
/* polystrata HIP kernel: {arch}, wave {wave} */
#ifdef __clang__
#pragma clang fp contract(off)
#endif
"""
# hiprtc 5.2 pre-includes the fp16 header and has no file of that name; hipcc and newer hiprtc have one.
_FP16 = "#if !defined(PS_CUDA) && defined(__has_include)\n#if __has_include(<hip/hip_fp16.h>)\n" \
    "#include <hip/hip_fp16.h>\n#endif\n#endif\n"

_CUDA_PRELUDE = """\
/* HIP -> CUDA mapping for polystrata's HIP source (NVRTC or nvcc; pass --fmad=false for exact results). */
#define PS_CUDA 1
#include <cuda_fp16.h>
/* __activemask(): a group smaller than a warp leaves lanes out, and a full mask would name absent threads. */
#define __shfl_xor(v, m) __shfl_xor_sync(__activemask(), (v), (m))
#define __shfl_down(v, o) __shfl_down_sync(__activemask(), (v), (o))
/* dp4a as asm that is not volatile: CUDA's __dp4a is `asm volatile`, which the compiler keeps in place, so it
   reused and merged no loads across it (76 global loads a lane per Q4_K block in the matvec's PTX, 36 with this). */
static __device__ __forceinline__ int ps_dp4a(int a, int b, int c) {
    int r;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}
#define __builtin_amdgcn_sdot4(a, b, c, clamp) ps_dp4a((int)(a), (int)(b), (c))
#define warpSize 32
"""


def base_arch(arch: str) -> str:
    """`gfx90a:xnack-` -> `gfx90a` (target features do not change the ISA family)."""
    return arch.split(":", 1)[0].strip().lower()


def wave_of(arch: str) -> int:
    """Wavefront width of an architecture: 32 on RDNA (gfx10, gfx11, gfx12) and CUDA (`sm_*`), else 64."""
    a = base_arch(arch)
    if a.startswith("sm_"):
        return 32
    if not re.fullmatch(r"gfx\d+[0-9a-f]?", a):
        raise ValueError(f"unknown GPU architecture {arch!r} (expected gfxNNN, e.g. gfx1030 or gfx90a)")
    return 32 if len(a) >= 7 and int(a[3:5]) >= 10 else 64  # gfx10xx, gfx11xx, gfx12xx


class HIPPrinter(CPrinter):
    """`CPrinter` for HIP C++ (hiprtc / hipcc), also valid CUDA after `cuda_prelude()`."""

    func_qualifier = "static __device__ inline"
    const_array_qualifier = "static __constant__ const"
    f2u = "__float_as_uint"
    u2f = "__uint_as_float"
    shuffle_xor = "__shfl_xor({0}, {1})"

    def __init__(self, kernel: Kernel, arch: str, wave: int | None = None, native_f16: bool = True):
        self.arch = arch
        self.wave = wave or wave_of(arch)
        unit = MATRIX_ARCHS.get(base_arch(arch))
        unit = unit if unit and unit.width == self.wave else None
        super().__init__(kernel, LaneAbilities(subgroup=self.wave, partial=True, several=True, matrix=unit))
        self.matrix = False  # whether the kernel uses the matrix builtins (and their vector types)
        self.native_f16 = native_f16
        if native_f16:
            self.f16_buffer_type, self.f16_load = "__half", "__half2float({0}[{1}])"
            self.f16_store = "{0}[{1}] = __float2half_rn({2});"
        a = base_arch(arch)
        # sm_*: the CUDA prelude maps the builtin to PTX dp4a (sm_61+).
        if a in SDOT4_ARCHS or a.startswith("sm_"):
            self.native_intrinsics = {"dot4_i8": "__builtin_amdgcn_sdot4((int)({0}), (int)({1}), {2}, false)"}

    def group_id(self, d: int) -> str:
        return f"(int)blockIdx.{'xyz'[d]}"

    def local_id(self) -> str:
        return "(int)threadIdx.x"

    def barrier(self, local: bool, global_: bool) -> str:
        return "__syncthreads();"  # a block-wide fence for shared and global memory alike

    def local_decl(self, ctype: str, name: str, size: int) -> str:
        return f"__shared__ {ctype} {name}[{size}];"

    def matrix_op(self, op: str, accs: list[str], a: list[str], b: list[str]) -> str:
        self.matrix = True
        vec = f"ps_{'i32' if '_i32_' in op else 'f32'}x{len(accs)}"

        def operand(words: list[str]) -> str:
            listed = ", ".join(words)
            if "f16" in op:  # two halves a word
                return f"__builtin_bit_cast(ps_f16x{2 * len(words)}, (ps_u32x{len(words)}){{{listed}}})"
            if "wmma" in op:  # four words of signed int8
                return "true, (ps_i32x4){" + ", ".join(f"(int){w}" for w in words) + "}"
            if len(words) == 2:  # 16x16x32_i8: eight int8 in a long
                return f"(long)(((unsigned long){words[1]} << 32) | {words[0]})"
            return f"(int){words[0]}"
        tail = ("false" if "iu8" in op else "") if "wmma" in op else "0, 0, 0"  # WMMA: clamp; MFMA: cbsz, abid, blgp
        call = ", ".join(x for x in (operand(a), operand(b), "ps_c", tail) if x)
        sets = " ".join(f"{x} = ps_c[{r}];" for r, x in enumerate(accs))
        return f"{{ {vec} ps_c = {{{', '.join(accs)}}}; ps_c = {op}({call}); {sets} }}"

    def prelude(self) -> str:
        return _PRELUDE.format(arch=self.arch, wave=self.wave) + (_FP16 if self.native_f16 else "") \
            + (_MATRIX_TYPES if self.matrix else "")

    def signature(self, params: list[str]) -> str:
        return f'extern "C" __global__ void __launch_bounds__({self.lanes})\n{self.k.name}({", ".join(params)})'


def render(kernel: Kernel, arch: str, wave: int | None = None, native_f16: bool = True) -> str:
    """HIP C++ source of `kernel` for AMD architecture `arch` (e.g. gfx1030, gfx90a; `sm_XX` for the CUDA path).

    `wave` overrides the wavefront width implied by `arch` (e.g. 64 for an RDNA part run in wave64 mode);
    `native_f16=False` uses the portable bit conversions for f16 instead of `__half` (bit-exact even for NaNs).
    """
    return HIPPrinter(kernel, arch, wave, native_f16).render()


def cuda_prelude() -> str:
    """Text to put before `render(kernel, arch)` so the same source compiles as CUDA (NVRTC / nvcc)."""
    return _CUDA_PRELUDE

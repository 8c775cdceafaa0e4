"""HIP C++ renderer: the C-family printer with HIP's spellings, for AMD GPUs (and CUDA behind `CUDA_PRELUDE`).

Only what differs from `codegen/cfamily.py` lives here: `extern "C" __global__` kernels with
`__launch_bounds__(lanes)`, `blockIdx` / `threadIdx`, `__syncthreads()`, `__shared__` arrays, f16 through
`__half2float` / `__float2half_rn`, `__shfl_xor` butterfly steps over the wavefront (`wave`: 64 on gfx9 and
older, 32 on RDNA gfx10+), and `__builtin_amdgcn_sdot4` for `dot4_i8` where the architecture has `v_dot4_i32_i8`.

The target declares a subgroup (the wave) that also reduces a power-of-two part of itself and groups of several
waves; `codegen/lanes.py` picks the combine from that. Where the architecture has a matrix unit (`MATRIX_ARCHS`
in `codegen/policy.py`: MFMA on CDNA, WMMA on RDNA3, the latter spelled and emulated but never compiled here, as
ROCm 5.2's hiprtc does not know gfx11) tile products become its builtins; elsewhere the portable loops, whose
int8 sums are `dot4_i8` (sdot4 where the ISA has it: gfx1030's "dp4a path").
"""

from __future__ import annotations

import re

from polystrata.codegen.cfamily import CPrinter
from polystrata.codegen.lanes import LaneAbilities
from polystrata.codegen.policy import MATRIX_ARCHS, SDOT4_ARCHS, base_arch
from polystrata.ir.kernel import Kernel

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

# Text to put before `render(kernel, arch)` so the same source compiles as CUDA (NVRTC / nvcc).
CUDA_PRELUDE = """\
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


def wave_of(arch: str) -> int:
    """Wavefront width of an architecture: 32 on RDNA (gfx10, gfx11, gfx12) and CUDA (`sm_*`), else 64."""
    a = base_arch(arch)
    if a.startswith("sm_"):
        return 32
    if not re.fullmatch(r"gfx\d+[0-9a-f]?", a):
        raise ValueError(f"unknown GPU architecture {arch!r} (expected gfxNNN, e.g. gfx1030 or gfx90a)")
    return 32 if len(a) >= 7 and int(a[3:5]) >= 10 else 64  # gfx10xx, gfx11xx, gfx12xx


class HIPPrinter(CPrinter):
    """`CPrinter` for HIP C++ (hiprtc / hipcc), also valid CUDA after `CUDA_PRELUDE`."""

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

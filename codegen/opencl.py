"""OpenCL C renderer: the C-family printer with OpenCL's spellings.

Only what differs from `codegen/cfamily.py` lives here: address-space qualifiers, ids, the barrier, f16 through
the core `vload_half` / `vstore_half_rte` (no cl_khr_fp16 needed), `sub_group_reduce_*` for the subgroup
combine, a byte-granular `vload4` for `load_u32`, and the kernel signature with `reqd_work_group_size`.
"""

from __future__ import annotations

from polystrata.codegen.cfamily import CPrinter
from polystrata.codegen.lanes import LaneAbilities
from polystrata.ir.kernel import Buf, Kernel, Scalar

# `a*b+c` must not become an FMA: quantized dot products are written to match gguf-py bit for bit.
PRELUDE = "#pragma OPENCL FP_CONTRACT OFF\n"
SUBGROUP_PRELUDE = "#pragma OPENCL EXTENSION cl_khr_subgroups : enable\n"


class OpenCLPrinter(CPrinter):
    """`CPrinter` for OpenCL C 1.2 and later."""

    ctypes = {"f32": "float", "f16": "ushort", "i32": "int", "u32": "uint", "i16": "short", "u16": "ushort",
              "i8": "char", "u8": "uchar"}
    f16_buffer_type = "half"  # a half pointer is legal without cl_khr_fp16, for vload/vstore_half
    func_qualifier = "static inline"
    const_array_qualifier = "__constant"
    f2u = "as_uint"
    u2f = "as_float"
    float_math = {"exp": "exp", "tanh": "tanh", "sqrt": "sqrt", "cos": "cos", "sin": "sin", "log": "log",
                  "pow": "pow", "abs": "fabs", "max": "fmax", "min": "fmin"}
    # Unaligned little-endian word from a byte buffer in any address space (OpenCL C has no alignment builtin).
    native_intrinsics = {"load_u32": "as_uint(vload4(0, {0} + ({1})))"}
    aligned_loads: dict[int, str] = {}
    aligned_element = None
    f16_load = "vload_half({1}, {0})"
    f16_store = "vstore_half_rte({2}, {1}, {0});"

    def __init__(self, kernel: Kernel, subgroups: bool = False):
        self.subgroups = subgroups and kernel.lanes > 1
        # sub_group_reduce_* spans the whole subgroup: only a group that is one subgroup may use it.
        super().__init__(kernel, LaneAbilities(subgroup=kernel.lanes if self.subgroups else 0))

    def group_id(self, d: int) -> str:
        return f"(int)get_group_id({d})"

    def local_id(self) -> str:
        return "(int)get_local_id(0)"

    def barrier(self, local: bool, global_: bool) -> str:
        flags = [f for f, on in (("CLK_LOCAL_MEM_FENCE", local), ("CLK_GLOBAL_MEM_FENCE", global_)) if on]
        return f"barrier({' | '.join(flags)});"

    def local_decl(self, ctype: str, name: str, size: int) -> str:
        return f"__local {ctype} {name}[{size}];"

    def subgroup_reduce(self, op: str, x: str, width: int) -> str:
        return f"sub_group_reduce_{'add' if op == '+' else 'max'}({x})"

    def rsqrt(self, x: str) -> str:
        return f"rsqrt({x})"

    def int_math(self, fn: str, a: list[str], t: str) -> str:
        if fn == "abs":  # OpenCL's abs(int) returns uint
            return f"(({self.ctype(t)})abs({a[0]}))"
        return f"{fn}({', '.join(a)})"

    def prelude(self) -> str:
        return PRELUDE + (SUBGROUP_PRELUDE if self.subgroups else "")

    def param_decl(self, p: Buf | Scalar) -> str:
        return ("__global " if isinstance(p, Buf) else "") + super().param_decl(p)

    def signature(self, params: list[str]) -> str:
        attr = f"__attribute__((reqd_work_group_size({self.lanes}, 1, 1)))"
        return f"__kernel {attr}\nvoid {self.k.name}({', '.join(params)})"



def render(kernel: Kernel, subgroups: bool = False) -> str:
    """OpenCL C source of `kernel`; `subgroups` selects the subgroup combine for `Reduce` (needs a device with
    subgroups whose width equals `kernel.lanes`), otherwise the local-memory tree."""
    return OpenCLPrinter(kernel, subgroups).render()

"""Where a kernel's compile goes, without a GPU: the distinct kernels of a synthetic preset's plans, each compiled
alone, with Numba's pass timings grouped into stages.

The plans are those an engine makes for `score` (prompt chunks, scoring, one-token steps; `run` makes all but
scoring's; two layers: the kernels repeat) for
`--target` cuda (rendered for a GPU of compute capability `--cc`, compiled to PTX by numba-cuda's `compile_ptx`,
with the cuda runtime's patches of Numba's passes) or cpu (`@njit(parallel=True)`, as the cpu runtime compiles).
Stages: "other" (bytecode to IR, closure inlining, rewrites, ...), "SSA", "typing", "lowering" (Numba's
passes; on the cpu this includes the compile of the parallel loop's body), "backend" (the rest: NVVM, or LLVM's
optimisation and machine code). On cuda the PTX's instructions
and, where `ptxas` is found, its registers for the same architecture. docs/benchmarks.md, "Compile time of the
generated kernels", has measurements.

    python scripts/compile_times.py [--preset llama3-8b] [--target cuda] [--knob matmul.reuse=1] [--only glu_]
        [--numba-passes] [--no-shared-reads]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from polystrata import synth
from polystrata.bench import parse_knobs
from polystrata.cli import knob_arg
from polystrata.compiler import DEFAULT_UBATCH, build_plan
from polystrata.ir.formats import FORMATS, KV_FORMATS
from polystrata.models import build_graph
from polystrata.runtimes.base import numba_signature

STAGES = {"reconstruct_ssa": "SSA", "nopython_type_inference": "typing", "native_lowering": "lowering",
          "cuda_native_lowering": "lowering", "native_parfor_lowering": "lowering"}
COLUMNS = ("other", "SSA", "typing", "lowering", "backend")


def distinct_kernels(arch: str, preset: str, qtype: str, policy, knobs: dict) -> list:
    """The kernels of the preset's plans (scoring, prompt chunks, one-token steps), each source once."""
    table = synth.tensor_plan(arch, preset, qtype, n_layer=2)
    meta = synth.preset_metadata(arch, preset, qtype, n_layer=2)
    tensors, formats = {n: (s, t) for n, s, t in table}, {n: FORMATS[t] for n, _, t in table}
    kernels = {}
    for all_logits, steps in ((True, DEFAULT_UBATCH), (False, DEFAULT_UBATCH), (False, 1)):
        plan = build_plan(build_graph(meta, tensors, all_logits), formats, KV_FORMATS["f16"], 4096, steps,
                          knobs=knobs, policy=policy)
        for la in plan.launches:
            kernels.setdefault(la.kernel.fingerprint(), la.kernel)
    return list(kernels.values())


def load(source: str, name: str, folder: Path):
    """The module of `source` (its file in `folder`), imported under a name of its own."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    path = folder / f"k_{digest}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"compile_times_{digest}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return getattr(module, name)


def stages(pipeline_times: dict, total: float) -> dict[str, float]:
    out = dict.fromkeys(COLUMNS, 0.0)
    for passes in pipeline_times.values():
        for name, t in passes.items():
            out[STAGES.get(name.split("_", 1)[1], "other")] += t.init + t.run + t.finalize
    out["backend"] = total - sum(out.values())
    return out


def ptx_stats(ptx: str, cc: tuple[int, int], ptxas: str | None, folder: Path) -> str:
    """PTX instructions, and the registers ptxas gives the kernel."""
    insts = sum(1 for line in ptx.splitlines() if line.startswith("\t") and line.strip().endswith(";")
                and not line.strip().startswith(("//", ".")))
    if not ptxas:
        return f"{insts} instructions"
    path = folder / "k.ptx"
    path.write_text(ptx)
    log = subprocess.run([ptxas, f"-arch=sm_{cc[0]}{cc[1]}", "-v", str(path), "-o", "/dev/null"],
                         capture_output=True, text=True).stderr
    regs, stack = (re.search(pattern, log) for pattern in (r"Used (\d+) registers", r"(\d+) bytes stack frame"))
    return f"{insts} instructions, {regs and regs.group(1)} registers, {stack and stack.group(1)} B stack"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="llama")
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--qtype", default="Q4_K_M")
    ap.add_argument("--target", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--cc", default="9.0", help="cuda: compute capability to compile for")
    ap.add_argument("--only", default="", help="only kernels whose name contains this")
    ap.add_argument("--numba-passes", action="store_true", help="Numba's own SSA pass (not the runtimes' replacement)")
    ap.add_argument("--no-shared-reads", action="store_true", help="cuda: render without shared reads")
    knob_arg(ap)
    a = ap.parse_args()
    cc = tuple(int(v) for v in a.cc.split("."))
    if a.target == "cuda":
        from numba import cuda
        from numba.cuda import compiler as numba_cuda_compiler

        from polystrata.codegen.cuda import CUDAPrinter, render
        from polystrata.codegen.policy import matrix_kinds, matrix_unit
        from polystrata.runtimes import cuda as cuda_runtime
        from polystrata.runtimes import numba_ssa as ssa_fixes

        policy = replace(cuda_runtime.CUDARuntime.policy, matrix_kinds=matrix_kinds(matrix_unit(f"sm_{cc[0]}{cc[1]}")))
        mma = policy.matrix_units
        CUDAPrinter.share_reads = not a.no_shared_reads
        ssa_fixes.linear_lowering_scan()
        results = {}
        compile_cuda = numba_cuda_compiler.compile_cuda

        def keep_result(*args, **kw):  # compile_ptx returns the PTX only; the pass timings are on the result
            results["last"] = compile_cuda(*args, **kw)
            return results["last"]

        numba_cuda_compiler.compile_cuda = keep_result
        ptxas = shutil.which("ptxas") or next((str(p) for p in Path("/usr/local").glob("cuda*/bin/ptxas")), None)
    else:
        from polystrata.codegen.cpu import render
        from polystrata.runtimes.cpu import CPURuntime

        policy = CPURuntime.policy
    if not a.numba_passes:
        from polystrata.runtimes import numba_ssa

        numba_ssa.install()
    kernels = [k for k in distinct_kernels(a.arch, a.preset, a.qtype, policy, parse_knobs(a.knob)) if a.only in k.name]
    print(f"{len(kernels)} kernels; seconds: {' '.join(COLUMNS)} total", flush=True)
    with tempfile.TemporaryDirectory(prefix="compile-times-") as tmp:
        folder = Path(tmp)
        for k in kernels:
            source = render(k, shuffles=True, native=True, mma=mma) if a.target == "cuda" else render(k)
            fn = load(source, k.name, folder)
            started = time.perf_counter()
            if a.target == "cuda":
                ptx, _ = cuda.compile_ptx(fn.py_func, numba_signature(k), cc=cc)
                total, timings = time.perf_counter() - started, results["last"].metadata["pipeline_times"]
                extra = ptx_stats(ptx, cc, ptxas, folder)
            else:
                signature = numba_signature(k, grid_sizes=True)
                fn.compile(signature)
                total, timings = time.perf_counter() - started, fn.overloads[signature].metadata["pipeline_times"]
                extra = ""
            times = " ".join(f"{v:.1f}" for v in stages(timings, total).values())
            print(f"{k.name} ({source.count(chr(10))} lines): {times} {total:.1f}  {extra}", flush=True)


if __name__ == "__main__":
    main()

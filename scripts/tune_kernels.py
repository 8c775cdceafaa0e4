"""Compile, without a GPU, the candidate kernels `polystrata tune` tries first on a GPU: each knob changed alone
(`KnobSpace.singles`) for every kernel instance of a model's plans, into the kernel cache, so that a tune on the
device loads their PTX instead of compiling each (numba-cuda takes 15-60 s a tile kernel; a device call has 10
minutes). The pairs tune tries next depend on which singles were faster there, so they are not compiled here.

    python scripts/tune_kernels.py MODEL.gguf [--arch sm_90] [--plans prefill] [--only PATTERN] [-c 4096]

The plans are those `tune` makes (`Engine(tuning=False)`: the default knobs, steps of 1 and of `-ub` tokens), so
the candidate kernels' sources, and with them their cache keys, are the ones the device's tune compiles. Pack the
cache for the device with the other kernels: `scripts/device_kernels.sh` (POLYSTRATA_HOME as there).
"""

from __future__ import annotations

import argparse
import re
import time

from polystrata.compiler import DEFAULT_UBATCH, compile_plans
from polystrata.engine import tensor_table
from polystrata.gguf import GGUFFile
from polystrata.models import build_graph
from polystrata.targets import make_runtime
from polystrata.tuning.tuner import Tuner, parse_plans, runs_at, timed_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--target", default="cuda")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--plans", default="decode,prefill")
    ap.add_argument("--only", default="^(matmul|moe_ffn)\\.", help="kernel instances whose signature matches")
    ap.add_argument("-c", "--ctx", type=int, default=4096)
    ap.add_argument("-ub", "--ubatch", type=int, default=DEFAULT_UBATCH)
    a = ap.parse_args()
    rt = make_runtime(a.target, arch=a.arch)
    only = re.compile(a.only)
    with GGUFFile(a.model) as f:
        tensors = tensor_table(f)
        graphs = {name: build_graph(f.metadata, tensors, all_logits=False) for name in parse_plans(a.plans)}
        steps = {id(g): 1 if name == "decode" else a.ubatch for name, g in graphs.items()}
        plans = compile_plans(f, list(graphs.values()), rt, a.ctx, "f16", steps)
    kernels, seen = {}, set()
    for name, graph in graphs.items():
        plan = plans[id(graph)]
        for m, sites in enumerate(plan.group_sites):
            first = plan.groups.index(m)
            for s in sites:
                if s.signature in seen or not only.search(s.signature):
                    continue
                seen.add(s.signature)
                step = plan.step_symbols(*timed_step(name, plan, a.ctx, s.rows))  # the step tune times it at
                for _, launches, _ in Tuner.lower_candidates(rt, plan, m, first, s.signature, s.space.singles(),
                                                             step, set(), {}):
                    kernels.update((la.kernel.fingerprint(), la.kernel) for la in launches if runs_at(la, step))
    t0 = time.time()
    rt.compile_all(kernels.values())  # compiled in worker processes where the runtime has them, into the cache
    print(f"{len(seen)} kernel instances: {len(kernels)} distinct candidate kernels in the kernel cache "
          f"({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()

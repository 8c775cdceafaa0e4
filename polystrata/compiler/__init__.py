"""The compiler: graph IR -> plan of kernel launches for a target (passes.py), and its executor (executor.py)."""

from __future__ import annotations

from polystrata.compiler.passes import build_plan
from polystrata.compiler.plan import Plan
from polystrata.errors import PolystrataError
from polystrata.gguf import GGUFFile
from polystrata.ir.formats import KV_FORMATS
from polystrata.ir.graph import Graph
from polystrata.runtimes.base import Runtime

# The default step size (llama.cpp's -ub/--ubatch-size): the most tokens one step of a prompt plan computes; a
# longer prompt runs in steps of this many.
DEFAULT_UBATCH = 256


def check_kv_type(kv_type: str) -> None:
    """Refuse a KV cache format (`--kv-type`) that no description names."""
    if kv_type not in KV_FORMATS:
        raise PolystrataError(f"unknown KV cache type '{kv_type}' (known: {', '.join(KV_FORMATS)})")


def compile_plans(
    file: GGUFFile, graphs: list[Graph], runtime: Runtime, n_ctx: int, kv_type: str = "f16",
    steps: dict[int, int] | None = None, stream_experts: bool = False, knobs: dict | None = None,
) -> dict[int, Plan]:
    """Plans of `graphs` for `runtime`: id(graph) -> Plan. `steps`: id(graph) -> the most tokens a step of its
    plan takes (default `DEFAULT_UBATCH`; 1 for a plan of decode steps, whose recipes may then specialize).
    `stream_experts`: plans for a device cache of MoE expert slots (`runtimes/memory.py`). `knobs`: overrides by
    knob space or kernel instance (the tuning database's choices: `polystrata.tuning`)."""
    check_kv_type(kv_type)
    formats = {name: t.fmt for name, t in file.tensors.items()}
    kv = KV_FORMATS[kv_type]
    return {
        id(g): build_plan(g, formats, kv, n_ctx, (steps or {}).get(id(g), DEFAULT_UBATCH), knobs=knobs,
                          stream_experts=stream_experts, policy=runtime.policy)
        for g in graphs
    }


__all__ = ["DEFAULT_UBATCH", "Plan", "build_plan", "check_kv_type", "compile_plans"]

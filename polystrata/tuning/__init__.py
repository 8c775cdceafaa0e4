"""Kernel autotuning: the tuning database (`db.py`) and `polystrata tune`'s search (`tuner.py`).

A recipe declares its knob space (`codegen.recipes.KnobSpace`); each kernel instance it lowers is named by a
signature (`KnobSpace.signature`). `tune` searches the space of each instance of a model's plans on this device
and keeps a winner in the database only where it beats the default beyond the noise; `compile`, `run` and `bench`
put the database's choices for this device into the runtime's policy (`apply_tuning`), where the compiler reads
them as per-instance knob overrides.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from polystrata.runtimes.base import Runtime
from polystrata.tuning.db import TuningDB


def machine_key(rt: Runtime) -> tuple[str, str, str]:
    """(target, device, compiler) of a runtime: the part of the database's key that names the machine."""
    return rt.name, rt.device, rt.compiler_version()


def apply_tuning(rt: Runtime, db: TuningDB | None = None) -> int:
    """Put the database's choices for this runtime's device and compiler into its policy; returns how many."""
    choices = (db or TuningDB()).choices(*machine_key(rt))
    rt.policy = replace(rt.policy, tuned=choices)
    return len(choices)


def tuned_signatures(plans: dict[Any, Any]) -> list[str]:
    """The kernel instances of `plans` (id -> Plan) that tuned choices set, sorted."""
    return sorted({s.signature for p in plans.values() for sites in p.group_sites for s in sites if s.tuned})


__all__ = ["TuningDB", "apply_tuning", "machine_key", "tuned_signatures"]

"""`polystrata tune`: the command line of the tuner (`tuner.py`) and of the tuning database (`db.py`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from polystrata.errors import UsageError


def add_tune_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `tune` subcommand and its options to `subparsers`; returns its parser."""
    from polystrata.cli import ctx_arg, model_arg, target_arg, threads_arg, ubatch_arg
    p = subparsers.add_parser("tune", help="search each kernel's schedule knobs on this device and keep the winners "
                                           "in the tuning database")
    model_arg(p, optional=True)
    target_arg(p, tuning=False)  # a session starts from the default knobs
    ctx_arg(p, "the model's, as run takes it (attention kernels are made for the context)")
    ubatch_arg(p, "; the prefill kernels tuned are those of this step size, as run -ub takes it")
    threads_arg(p)
    p.add_argument("--budget", default="10m", help="time for the search: NUMBER with s, m or h (the model's load and "
                                                   "its default kernels' compile come before it)")
    p.add_argument("--only", default=None, metavar="PATTERN",
                   help="tune only kernel instances whose signature matches this regular expression")
    p.add_argument("--plans", default="decode,prefill", help="plans whose kernels to tune: decode, prefill")
    p.add_argument("-j", "--jobs", type=int, default=None,
                   help="worker processes compiling candidates ahead of their measurement (1: none; default: on "
                        "the cpu target half the CPUs, at most 4; on the other targets all but two, at most 8)")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--show", action="store_true", help="list the database's entries and their gains, then stop")
    what.add_argument("--export", metavar="FILE", default=None, help="write the database's entries to FILE (JSON)")
    what.add_argument("--import", dest="import_file", metavar="FILE", default=None,
                      help="add the entries of FILE (JSON from --export) to the database")
    p.set_defaults(model_required=False)
    return p


def format_rows(rows: list[dict]) -> str:
    """`tune --show`: one line per entry, its gain over the default."""
    if not rows:
        return "the tuning database is empty"
    out = []
    for r in rows:
        gain = r["default_s"] / r["best_s"] if r["best_s"] > 0 else 1.0
        knobs = ", ".join(f"{k}={v}" for k, v in sorted(r["knobs"].items())) or "default"
        out.append(f"{r['signature']}  [{r['target']}: {r['device']}; {r['compiler']}]  {knobs}  "
                   f"{r['default_s'] * 1e6:.1f} -> {r['best_s'] * 1e6:.1f} us (x{gain:.2f}, ±{100 * r['spread']:.0f}%)"
                   f"  {r['date']}")
    return "\n".join(out)


def cmd_tune(a) -> int:
    """Run `polystrata tune` (or its database commands: --show, --export, --import)."""
    from polystrata.tuning.db import TuningDB

    db = TuningDB()
    if a.show:
        print(format_rows(db.rows()))
        return 0
    if a.export:
        n = db.export(Path(a.export))
        print(f"wrote {n} entries to {a.export}", file=sys.stderr)
        return 0
    if a.import_file:
        n = db.import_file(Path(a.import_file))
        print(f"imported {n} entries into {db.path}", file=sys.stderr)
        return 0
    return _tune(a, db)


def _tune(a, db) -> int:
    from polystrata.cli import _resolve
    from polystrata.engine import Engine
    from polystrata.targets import resolve_target
    from polystrata.tuning.tuner import Tuner, default_jobs, parse_budget, parse_plans

    if a.model is None:
        a.command_parser.error("the following arguments are required: MODEL (or -m MODEL)")
    if a.jobs is not None and a.jobs < 1:
        raise UsageError("-j/--jobs must be at least 1")
    budget, plans = parse_budget(a.budget), parse_plans(a.plans)
    if a.only:
        import re

        try:
            re.compile(a.only)
        except re.error as e:
            raise UsageError(f"--only is not a regular expression: {e}") from None
    if resolve_target(a.target) == "reference":
        raise UsageError("tune needs a kernel target (cpu, cuda, hip, opencl), not the reference executor")
    engine = Engine(_resolve(a.model), target=a.target, n_ctx=a.ctx, kv_type=a.kv_type, tuning=False,
                    n_ubatch=a.n_ubatch)
    tuner = Tuner(engine, db, budget, plans, a.only, a.jobs or default_jobs(engine.runtime.host))
    try:
        tuner.run()
    finally:
        won = [r for r in tuner.results if r.best]
        cut = sum(not r.complete for r in tuner.results)
        print(f"tune: {len(tuner.results) - cut} kernel instances tuned{f' and {cut} cut short' if cut else ''} in "
              f"{tuner.elapsed():.1f} s of the {budget:.0f} s budget, {len(won)} faster than their default",
              file=sys.stderr)
    return 0

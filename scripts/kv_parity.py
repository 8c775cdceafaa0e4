"""What a KV cache type costs on a target, told apart from what the target's plans cost: each KV type's run
against the target's f16-KV run (as `parity --against-kv f16` does) and against the reference executor (f32
throughout, f32 K and V), by the parity metric, over the fixtures' prompts and llama.cpp's greedy continuations.

    python scripts/kv_parity.py MODEL [--target T] [--kv-type K ...] [--knob SPACE.NAME=VALUE ...]

On the GPU plans the matmuls take int8 activations, so two runs that differ in anything diverge by the flips of
those roundings too: against f16 KV a q8 type looks worse there than it is; against the reference, the KV type's
own cost is its run's KL less the f16 run's (docs/benchmarks.md, "Quantized KV on the GPU plans").
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from polystrata.bench import parse_knobs
from polystrata.cli import _resolve, top_k_scores
from polystrata.engine import Engine
from polystrata.parity import Parity

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "data" / "fixtures" / "reference"


def sequences(fixtures: Path) -> list[list[int]]:
    """Each fixture prompt's ids followed by llama.cpp's greedy continuation."""
    out = []
    for name in json.loads((fixtures.parent / "prompts.json").read_text()):
        ref = np.load(fixtures / f"{name}.npz")
        out.append([int(i) for i in np.concatenate([ref["ids"], ref["greedy"]])])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a GGUF path or zoo name (smollm2-135m, gemma3-270m)")
    ap.add_argument("--fixtures", default=None, help="default: tests/data/fixtures/reference/<smollm2|gemma3>")
    ap.add_argument("--target", default="auto")
    ap.add_argument("--kv-type", action="append", default=None, help="default: f16, q8_0, q8_g64")
    ap.add_argument("--knob", action="append", default=[], help="SPACE.NAME=VALUE, for every run on the target")
    a = ap.parse_args()
    path = _resolve(a.model)
    fixtures = Path(a.fixtures) if a.fixtures else FIXTURES / ("gemma3" if "gemma" in path.name.lower() else "smollm2")
    seqs = sequences(fixtures)
    knobs = parse_knobs(a.knob) if a.knob else None

    def run(target: str, kv: str) -> list[np.ndarray]:
        eng = Engine(path, target=target, kv_type=kv, knobs=knobs if target != "reference" else None,
                     all_logits=True)
        return [eng.score(ids) for ids in seqs]

    refs = {"reference": run("reference", "f16")}
    kvs = a.kv_type or ["f16", "q8_0", "q8_g64"]
    for kv in ["f16", *(k for k in kvs if k != "f16")]:
        logits = run(a.target, kv)
        if kv == "f16":
            refs["f16 KV"] = logits
        for against, base in refs.items():
            if against == "f16 KV" and kv == "f16":
                continue
            par = Parity()
            for b, x in zip(base, logits):
                top = top_k_scores(b, 40)
                par.add(top["top_ids"], top["top_logits"], x)
            print(f"kv_parity {path.name} {a.target} {kv} KV vs {against}: {par}", flush=True)


if __name__ == "__main__":
    main()

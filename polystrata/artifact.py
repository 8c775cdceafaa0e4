"""Compile artifacts: a directory holding a YAML manifest (the plan) and the graph IR dump.

`compile` is a plan, not a copy of the weights: the manifest records the model's path and sha256 so that `run`
can refuse a model file that changed since, the architecture, the target and device, a graph summary, the
kernels with their schedule choices (none on the reference target) and the memory plan.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import yaml

from polystrata import __version__
from polystrata.engine import DEFAULT_CTX, tensor_table
from polystrata.errors import PolystrataError
from polystrata.gguf import GGUFFile
from polystrata.models import build_graph
from polystrata.targets import make_runtime, resolve_target

MANIFEST = "manifest.yaml"
GRAPH_DUMP = "graph.ir"
KERNELS_DUMP = "kernels.ir"
FORMAT_VERSION = 1


def file_sha256(path: Path) -> str:
    """sha256 of a file, read in 8 MiB pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(8 << 20), b""):
            h.update(block)
    return h.hexdigest()


def is_artifact(arg: str | os.PathLike) -> bool:
    """Whether `arg` names a compile artifact directory."""
    return (Path(arg) / MANIFEST).is_file()


def write_artifact(
    model_path: Path, target: str, out: str | os.PathLike, kv_type: str = "f16", arch: str | None = None,
    gpu_mem: str | None = None, expert_slots: int | None = None,
) -> tuple[Path, str]:
    """Plan `model_path` for `target` (within the device-memory budget `gpu_mem`, as `run` would: see
    `runtimes.memory.fit_plans`), compile its kernels (through the binary cache), and write the artifact
    directory `out` atomically. Returns the path and a one-line report of the kernel cache."""
    target = resolve_target(target)
    out = Path(out)
    if out.exists() and not is_artifact(out):
        raise PolystrataError(f"{out} exists and is not a PolyStrata artifact; choose another -o")
    with GGUFFile(model_path) as f:
        tensors = tensor_table(f)
        decode = build_graph(f.metadata, tensors, all_logits=False)
        prefill = build_graph(f.metadata, tensors, all_logits=False)
        score = build_graph(f.metadata, tensors, all_logits=True)
        weight_bytes = sum(f.tensors[n].nbytes for n in decode.weights)
        meta = dict(decode.meta)
        n_ctx = min(int(meta["n_ctx_train"]), DEFAULT_CTX)
        kernels: list[dict[str, Any]] = []
        sources: dict[str, str] = {}
        binaries: dict[str, bytes] = {}
        kernel_ir = ""
        report = "reference target: no kernels"
        device = "host CPU (numpy float32)"
        memory_plan: dict[str, Any] = {}
        if target != "reference":
            from polystrata.runtimes.memory import fit_plans

            rt = make_runtime(target, arch=arch)
            device = rt.device
            # As the engine runs them: one-token steps, prompt chunks (last logits), scoring (every token's).
            plans, mem = fit_plans(f, [score, prefill, decode], {id(decode): 1}, rt, None, int(meta["n_ctx_train"]),
                                   kv_type, gpu_mem, expert_slots, DEFAULT_CTX)
            n_ctx = mem.n_ctx
            memory_plan = {**mem.manifest(), "plan": mem.describe()}
            for name, plan in (("decode", plans[id(decode)]), ("prefill", plans[id(prefill)]),
                               ("score", plans[id(score)])):
                for entry in plan.kernel_summary():
                    kernels.append({"plan": name, **entry})
                kernel_ir += f"# plan: {name}\n" + plan.dump_kernels()
                for la in plan.launches:
                    key = f"{la.kernel.name}-{la.kernel.fingerprint()}"
                    if key not in sources:
                        ck = rt.compile(la.kernel)
                        sources[key] = ck.source
                        if isinstance(getattr(ck.handle, "code", None), bytes):  # code objects (hip) travel along
                            binaries[key] = ck.handle.code
            total = rt.cache_hits + rt.cache_misses
            report = (
                f"{total} kernels: {rt.cache_hits} from the binary cache, {rt.cache_misses} compiled"
                + (" (cache hit)" if rt.cache_misses == 0 else "")
            )
    kv_bytes = 4 * 2 * n_ctx * meta["n_layer"] * meta["n_head_kv"] * meta["head_dim"]
    manifest: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "polystrata": __version__,
        "model": {"path": str(model_path.resolve()), "sha256": file_sha256(model_path)},
        "arch": decode.arch,
        "target": {"name": target, "device": device, **({"arch": arch} if arch else {})},
        "graph": {**decode.summary(), "hparams": meta},
        "kernels": kernels,
        "memory": {
            "weights_bytes": int(weight_bytes), "kv_type": kv_type if target != "reference" else "f32",
            "n_ctx": n_ctx, "kv_bytes_f32": int(kv_bytes), **memory_plan,
        },
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        (tmp / MANIFEST).write_text(yaml.safe_dump(manifest, sort_keys=False))
        (tmp / GRAPH_DUMP).write_text(decode.dump() + "\n")
        if kernel_ir:
            (tmp / KERNELS_DUMP).write_text(kernel_ir)
            src = tmp / "src"
            src.mkdir()
            for name, text in sources.items():
                (src / f"{name}.{_EXT.get(target, 'txt')}").write_text(text)
            for name, code in binaries.items():
                (src / f"{name}.{arch or 'bin'}.co").write_bytes(code)
        old = None
        if out.exists():
            old = out.with_name(f".{out.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out, old)
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out, report


_EXT = {"cpu": "py", "opencl": "cl", "cuda": "py", "hip": "hip"}


def load_artifact(path: str | os.PathLike) -> dict[str, Any]:
    """Read and check a manifest: known format, and the model file still the one that was compiled."""
    p = Path(path) / MANIFEST
    try:
        m = yaml.safe_load(p.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise PolystrataError(f"cannot read artifact {path}: {e}") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT_VERSION:
        raise PolystrataError(f"{p}: not an artifact of this PolyStrata version; compile the model again")
    model = Path(m["model"]["path"])
    if not model.is_file():
        raise PolystrataError(f"{path}: the model {model} is gone; compile again")
    if file_sha256(model) != m["model"]["sha256"]:
        raise PolystrataError(f"{path}: the model {model} changed since it was compiled; compile again")
    return m

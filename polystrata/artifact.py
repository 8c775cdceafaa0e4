"""Compile artifacts: a directory holding a YAML manifest (the plan), the graph IR dump, the kernel sources and
the compiled kernels.

`compile` is a plan, not a copy of the weights: the manifest records the model's path (relative to the artifact)
and sha256, by which `run` finds the model (`find_model`), the architecture, the target and device, a graph
summary, the kernels with their schedule choices (none on the reference target) and the memory plan. The
compiled kernels (`kernels/`, as the kernel cache keeps them) spare `run` the compile on a machine with the same
device and compiler versions.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import yaml

from polystrata import __version__
from polystrata.compiler import DEFAULT_UBATCH
from polystrata.engine import DEFAULT_CTX, check_parallel, check_ubatch, tensor_table
from polystrata.errors import PolystrataError, writing
from polystrata.gguf import GGUFFile
from polystrata.models import build_graph
from polystrata.paths import file_lock, file_sha256
from polystrata.runtimes.base import CacheEntry
from polystrata.targets import KERNEL_TARGETS, make_runtime, resolve_target, runtime_class

MANIFEST = "manifest.yaml"
GRAPH_DUMP = "graph.ir"
KERNELS_DUMP = "kernels.ir"
SOURCES = "src"
# The compiled kernels, laid out as the kernel cache is (`runtimes/base.py`'s CacheEntry: each kernel's files, its
# compiler's `__pycache__/` files and its sha256 record): `run` copies what the cache lacks from here.
KERNELS = "kernels"
# The manifest's first line: what tells an artifact from a folder that merely holds a file named manifest.yaml.
FORMAT = "polystrata-artifact/1"
# Everything an artifact directory holds; `compile -o` replaces a directory only if it holds nothing else.
_TOP_FILES = frozenset({MANIFEST, GRAPH_DUMP, KERNELS_DUMP})


@functools.cache
def _source_suffixes() -> frozenset[str]:
    """What files in an artifact's `src/` end with: each kernel target's source extension."""
    return frozenset(f".{runtime_class(t).source_ext}" for t in KERNEL_TARGETS)


def is_artifact(arg: str | os.PathLike) -> bool:
    """Whether `arg` is a directory with a manifest, to be read as an artifact (`read_artifact` checks it)."""
    return (Path(arg) / MANIFEST).is_file()


def _read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest of `directory`, refused unless it is UTF-8 YAML carrying the format marker."""
    p = directory / MANIFEST
    try:
        m = yaml.safe_load(p.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise PolystrataError(f"{p} is not UTF-8 text; not a PolyStrata artifact") from None
    except (OSError, yaml.YAMLError) as e:
        reason = e.strerror if isinstance(e, OSError) else " ".join(str(e).split())
        raise PolystrataError(f"cannot read artifact {directory}: {reason}") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise PolystrataError(
            f"{p} has no 'format: {FORMAT}': not an artifact of this PolyStrata version; compile the model again"
        )
    return m


def _foreign_entry(directory: Path) -> str | None:
    """The first entry of `directory` that no artifact holds (a name, relative), or None."""
    with os.scandir(directory) as entries:
        for e in entries:
            if e.name in _TOP_FILES and e.is_file(follow_symlinks=False):
                continue
            if e.name not in (SOURCES, KERNELS) or not e.is_dir(follow_symlinks=False):
                return e.name
            foreign = _foreign_file(Path(e.path), e.name)
            if foreign is not None:
                return foreign
    return None


def _foreign_file(folder: Path, name: str) -> str | None:
    """The first entry of an artifact's `src/` or `kernels/` that no artifact holds (a relative name), or None:
    `src/` holds kernel sources, `kernels/` the kernel cache's files and one `__pycache__/` of them."""
    with os.scandir(folder) as entries:
        for s in entries:
            if name == KERNELS and s.name == "__pycache__" and s.is_dir(follow_symlinks=False):
                inner = _foreign_file(Path(s.path), f"{KERNELS}/__pycache__")
                if inner is not None:
                    return inner
            elif not s.is_file(follow_symlinks=False) or (
                name == SOURCES and Path(s.name).suffix not in _source_suffixes()
            ):
                return f"{name}/{s.name}"
    return None


def check_replaceable(out: Path) -> None:
    """Refuse an output path that holds anything but an artifact: `compile -o` replaces what is there.

    Nothing there, or an empty directory, is fine; so is an artifact (a manifest with the format marker and
    only the files an artifact has). A file, a symbolic link, or a directory holding anything else is refused,
    so that compiling can never delete a user's files.
    """
    if not os.path.lexists(out):
        return
    if out.is_symlink() or not out.is_dir():
        raise PolystrataError(f"{out} exists and is not a directory; choose another -o")
    try:
        if not any(out.iterdir()):
            return
        foreign = _foreign_entry(out)
        marked = _has_marker(out)
    except OSError as e:
        raise PolystrataError(f"cannot look into {out}: {e.strerror or e}") from None
    if foreign is not None:
        raise PolystrataError(
            f"{out} holds {foreign}, which is not part of a PolyStrata artifact; compiling there would delete it: "
            "choose another -o"
        )
    if not marked:
        raise PolystrataError(
            f"{out} is not a PolyStrata artifact (no {MANIFEST} with 'format: {FORMAT}'); compiling there would "
            "replace it: choose another -o"
        )


def _has_marker(directory: Path) -> bool:
    try:
        _read_manifest(directory)
    except PolystrataError:
        return False
    return True


def write_artifact(
    model_path: Path, target: str, out: str | os.PathLike, kv_type: str = "f16", arch: str | None = None,
    n_ctx: int | None = None, gpu_mem: str | None = None, expert_slots: int | None = None, tuning: bool = True,
    n_ubatch: int | None = None, n_seq: int = 1, knobs: dict | None = None,
) -> tuple[Path, str]:
    """Plan `model_path` for `target` with a KV cache of `n_ctx` tokens (default: the trained context, reduced to what
    the device-memory budget `gpu_mem` holds, as `run` would: see `runtimes.memory.fit_plans`), compile the kernels
    of the plans `run`, `chat` and `serve` run (not scoring's), through the binary cache, and write the artifact
    directory `out` atomically. Returns the path and a one-line report of the kernel cache. `tuning`: take the
    tuning database's knobs for this device (the manifest's `tuned` per kernel says which). `n_ubatch`: the step
    size of the prompt plans (`Engine`'s; the manifest's `memory.n_ubatch`, which `run` plans with). `n_seq`: the
    sequences `serve -np N` decodes at once; above 1 the plan of a step's last N rows' logits
    (`Engine(logit_rows=N)`) is compiled too (the manifest's `memory.n_parallel`), so that `serve ARTIFACT -np N`
    compiles nothing. `knobs`: schedule knobs for every kernel of their spaces (`compile --knob`; the manifest's
    `knobs`, which `run ARTIFACT` plans with unless given its own)."""
    if n_ubatch is not None:
        check_ubatch(n_ubatch, n_ctx)
    step = n_ubatch or DEFAULT_UBATCH
    check_parallel(n_seq, step, n_ctx)  # before anything loads
    target = resolve_target(target)
    if target == "reference":
        from polystrata.runtimes.memory import check_reference_flags

        check_reference_flags(gpu_mem, expert_slots)
    out = Path(os.path.abspath(out))  # absolute, so that `-o .` has a name and a parent to write the temp dir in
    check_replaceable(out)  # before compiling, to fail fast; again before the swap
    with GGUFFile(model_path) as f:
        tensors = tensor_table(f)
        decode = build_graph(f.metadata, tensors, all_logits=False)
        check_parallel(n_seq, step, graph=decode)  # a recurrent model: before any plan
        prefill = build_graph(f.metadata, tensors, all_logits=False)
        # Steps of several sequences wanting some rows' logits (`polystrata.batch`): as `serve -np N` plans them.
        rows = build_graph(f.metadata, tensors, all_logits=False, last_rows=n_seq) if n_seq > 1 else None
        weight_bytes = sum(f.tensors[n].nbytes for n in decode.weights)
        meta = dict(decode.meta)
        n_ctx_asked = n_ctx
        n_ctx = n_ctx or min(int(meta["n_ctx_train"]), DEFAULT_CTX)  # the reference's (kernel targets: fit_plans)
        kernels: list[dict[str, Any]] = []
        sources: dict[str, str] = {}
        binaries: list[CacheEntry] = []  # the kernel cache's entries of the compiled kernels
        kernel_ir = ""
        report = "reference target: no kernels"
        device = "host CPU (numpy float32)"
        source_ext = ""  # the kernel target's, for the sources' file names
        memory_plan: dict[str, Any] = {}
        if target != "reference":
            from polystrata.runtimes.memory import fit_plans

            rt = make_runtime(target, arch=arch)
            if tuning:
                from polystrata.tuning import apply_tuning

                apply_tuning(rt)
            rt.set_knobs(knobs)
            device, source_ext = rt.device, rt.source_ext
            # As `run`, `chat` and `serve`'s engine plans them: one-token steps, prompt chunks (last logits), and
            # with several sequences the steps of their rows (the last rows' logits). Not scoring's plan (every
            # token's logits, `Engine(all_logits=True)`): `score ARTIFACT` makes it, compiling any kernel the
            # artifact lacks.
            graphs = [prefill, decode, *([rows] if rows else [])]
            steps = {id(g): step for g in graphs} | {id(decode): 1}
            plans, mem = fit_plans(f, graphs, steps, rt, n_ctx_asked, int(meta["n_ctx_train"]), kv_type, gpu_mem,
                                   expert_slots)
            n_ctx = mem.n_ctx
            check_parallel(n_seq, step, n_ctx)  # the context the budget holds, before anything compiles
            memory_plan = {**mem.manifest(), "plan": mem.describe()}
            named = (("decode", plans[id(decode)]), ("prefill", plans[id(prefill)]),
                     *((("rows", plans[id(rows)]),) if rows else ()))
            for name, plan in named:
                for entry in plan.kernel_summary():
                    kernels.append({"plan": name, **entry})
                kernel_ir += f"# plan: {name}\n" + plan.dump_kernels()
            compiled = rt.compile_all(la.kernel for _, plan in named for la in plan.launches)
            for fp, ck in compiled.items():
                sources[f"{ck.kernel.name}-{fp}"] = ck.source
                if ck.entry is not None:  # a kernel the runtime keeps in no cache has nothing to carry
                    binaries.append(ck.entry)
            total = rt.cache_hits + rt.cache_misses
            report = (
                f"{total} kernels: {rt.cache_hits} from the binary cache, {rt.cache_misses} compiled"
                + (" (cache hit)" if rt.cache_misses == 0 else "")
            )
    if n_ubatch is not None:  # the context the budget holds may be smaller than the one asked for
        check_ubatch(n_ubatch, n_ctx)
    check_parallel(n_seq, step, n_ctx)
    kv_bytes = 4 * 2 * n_ctx * meta["n_layer"] * meta["n_head_kv"] * meta["head_dim"]
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "polystrata": __version__,
        # Relative to the artifact, so that an artifact moved together with its model still finds it.
        "model": {"path": Path(os.path.relpath(model_path.resolve(), out)).as_posix(),
                  "sha256": file_sha256(model_path)},
        "arch": decode.arch,
        "target": {"name": target, "device": device, **({"arch": arch} if arch else {})},
        "graph": {**decode.summary(), "hparams": meta},
        "kernels": kernels,
        **({"knobs": knobs} if knobs and target != "reference" else {}),
        "memory": {
            "weights_bytes": int(weight_bytes), "kv_type": kv_type if target != "reference" else "f32",
            "n_ctx": n_ctx, "n_ubatch": step, "n_parallel": n_seq, "kv_bytes_f32": int(kv_bytes), **memory_plan,
        },
    }
    with writing(out):
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        try:
            (tmp / MANIFEST).write_text(yaml.safe_dump(manifest, sort_keys=False), encoding="utf-8")
            (tmp / GRAPH_DUMP).write_text(decode.dump() + "\n")
            if kernel_ir:
                (tmp / KERNELS_DUMP).write_text(kernel_ir)
                src = tmp / SOURCES
                src.mkdir()
                for name, text in sources.items():
                    (src / f"{name}.{source_ext}").write_text(text)
                (tmp / KERNELS).mkdir()
                for entry in binaries:
                    with file_lock(entry.lock):  # not while another process adds to it
                        entry.copy_to(tmp / KERNELS)
                    if not CacheEntry(tmp / KERNELS / entry.path.name, entry.key).verify():
                        raise PolystrataError(f"the kernel cache entry {entry.path} changed while it was copied; "
                                              "compile again")
            _swap_in(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out, report


def _swap_in(new: Path, out: Path) -> None:
    """Put directory `new` at `out`, replacing an old artifact there (checked again: the compile took a while)."""
    old = None
    if os.path.lexists(out):
        check_replaceable(out)
        # A fresh name for the old artifact: a fixed one could be a folder of the user's, and be deleted.
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
        try:
            os.replace(out, old)  # onto the empty directory mkdtemp made
        except BaseException:
            old.rmdir()
            raise
    try:
        os.replace(new, out)
    except BaseException:
        if old is not None:
            os.replace(old, out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def kernel_store(path: str | os.PathLike) -> Path | None:
    """The compiled kernels an artifact holds (a directory laid out as the kernel cache), or None."""
    store = Path(path) / KERNELS
    return store if store.is_dir() else None


def read_artifact(path: str | os.PathLike) -> dict[str, Any]:
    """Read and check a manifest: known format and the fields `run` needs. The model it was compiled from is found
    apart (`find_model`: hashing it takes a while), after what the manifest alone can refuse."""
    m = _read_manifest(Path(path))
    fields = (("model", "path"), ("model", "sha256"), ("target", "name"), ("memory", "kv_type"), ("memory", "n_ctx"))
    for keys in fields:
        v: Any = m
        for k in keys:
            v = v.get(k) if isinstance(v, dict) else None
        ok = isinstance(v, int) and not isinstance(v, bool) and v > 0 if keys[-1] == "n_ctx" else isinstance(v, str)
        if not ok or not v:
            raise PolystrataError(f"{path}: the manifest has no {'.'.join(keys)}; compile the model again")
    # Absent in artifacts from before -ub and -np: planned with the default step size and for one sequence.
    for key, what in (("n_ubatch", "step size"), ("n_parallel", "count of parallel sequences")):
        v = m["memory"].get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise PolystrataError(f"{path}: the manifest's memory.{key} is not a positive {what}; compile the "
                                  "model again")
    knobs = m.get("knobs")
    if knobs is not None and not (isinstance(knobs, dict) and all(
            isinstance(space, str) and isinstance(values, dict) for space, values in knobs.items())):
        raise PolystrataError(f"{path}: the manifest's knobs are not knob spaces of knobs; compile the model again")
    return m


def find_model(directory: Path, recorded: str, sha256: str, model: str | os.PathLike | None = None) -> Path:
    """The GGUF file with this `sha256`: `model` (`run --model`: a path or zoo name) if given, else the `recorded`
    path (relative to the artifact `directory`; absolute in artifacts from before), else a zoo model of that
    digest in the cache."""
    from polystrata import zoo

    if model is not None:
        path = zoo.resolve_model(model)  # a file, or a zoo name
        if file_sha256(path) != sha256:
            raise PolystrataError(f"{model} is not the model {directory} was compiled from (its sha256 differs)")
        return path
    path = directory / recorded
    if path.is_file() and file_sha256(path) == sha256:
        return path
    cached = zoo.cached_by_sha256(sha256)
    if cached is not None:
        return cached
    state = "has changed" if path.is_file() else "is gone"
    raise PolystrataError(f"{directory}: the model it was compiled from ({path}) {state} and no zoo model in the "
                          f"cache has its sha256 {sha256[:16]}…; give the file with -m PATH, or compile again")

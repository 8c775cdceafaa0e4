"""What every target runtime provides: device buffers, kernel compilation through a binary cache, launches.

A target is one renderer (`codegen/<target>.py`: kernel IR -> source), one runtime (`runtimes/<target>.py`:
a `Runtime` subclass) and its line in `polystrata/targets.py`'s registry. The executor
(`polystrata/compiler/executor.py`) drives any runtime through this interface only, optional abilities included
(they have defaults here). Also here: the kernel cache, and what the C-API targets share (`PackedLaunch`,
`DeviceBuffer`, `compile_in_child`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from polystrata import interrupt
from polystrata.codegen.policy import HOST_POLICY, Policy
from polystrata.codegen.pyfamily import NUMPY_DTYPES
from polystrata.errors import PolystrataError
from polystrata.ir.expr import Bin, Const, Expr, Var
from polystrata.ir.kernel import DTYPE_BYTES, Buf, Call, Kernel, Scalar, expr_str, stable_digest
from polystrata.paths import atomic_write, file_lock, file_sha256, home_dir, private_dir
from polystrata.progress import Progress


def cache_dir(target: str) -> Path:
    """Where compiled kernels of `target` are kept: `<home>/kernels/<target>` (see `polystrata.paths`), created
    user-only: whoever can write there can run code as the user."""
    return private_dir(home_dir() / "kernels" / target)


def cache_key(source: str, target: str, device: str, compiler: str) -> str:
    """Binary-cache key: a hash of the source, the intrinsic modules it imports (`intrinsics_digest`), target,
    device and compiler version."""
    return stable_digest((source, intrinsics_digest(source), target, device, compiler), 24)


_INTRINSICS_IMPORT = re.compile(r"^from polystrata\.codegen(?:\.(\w+))? import ([\w, ]+)", re.M)


def intrinsics_digest(source: str) -> str:
    """A hash of the project's intrinsic modules (`codegen/*_intrinsics.py`) that `source` imports, and those they
    import: their code is compiled into the kernel, so a change there must miss the cache as a change of the
    source does. "" for a source that imports none (C family)."""
    return _modules_digest(frozenset(_intrinsic_imports(source)))


def _intrinsic_imports(text: str) -> set[str]:
    found = set()
    for module, names in _INTRINSICS_IMPORT.findall(text):
        found |= {module} if module else {n.strip() for n in names.split(",")}
    return {m for m in found if m.endswith("_intrinsics")}


@functools.cache
def _modules_digest(modules: frozenset[str]) -> str:
    if not modules:
        return ""
    seen, todo, texts = set(), sorted(modules), []
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        text = Path(importlib.util.find_spec(f"polystrata.codegen.{m}").origin).read_text()
        texts.append((m, text))
        todo += sorted(_intrinsic_imports(text) - seen)
    return stable_digest(sorted(texts), 16)


class CacheEntry:
    """One kernel in the kernel cache: its file `path` (`<stem>.<ext>`), what its compiler keeps beside it
    (Numba's index and machine code `__pycache__/<stem>.*`), and the record `<stem>.sha256.json` of the key that
    produced them and of each file's sha256, written after a build and checked before any of them is loaded."""

    def __init__(self, path: Path, key: str):
        self.path, self.key = path, key
        stem = path.name.split(".", 1)[0]
        self.record = path.with_name(f"{stem}.sha256.json")
        # Held while the entry is checked, loaded or built: another process that wants the same entry waits for
        # the build rather than discarding its half-written files. A dot file, so not one of the entry's files.
        self.lock = path.with_name(f".{stem}.lock")
        self._globs = (f"{stem}.*", f"__pycache__/{stem}.*")

    def files(self) -> dict[str, Path]:
        """The entry's files on disk but the record, by name relative to the cache directory."""
        found = {}
        for pattern in self._globs:
            for f in self.path.parent.glob(pattern):
                # Unfinished writes aside: Numba's (`<file>.tmp.<uid>`) while another process fills the entry.
                if f != self.record and ".tmp." not in f.name:
                    found[f.relative_to(self.path.parent).as_posix()] = f
        return found

    def verify(self) -> bool | None:
        """True: the files are exactly those recorded, with their digests, under this key. None: no record (a
        build never finished, or a cache from before records: rebuilt silently). False: corrupt."""
        try:
            text = self.record.read_bytes()
        except FileNotFoundError:
            return None
        except OSError:
            return False
        try:
            record = json.loads(text)
            files = self.files()
            return (record["key"] == self.key and set(record["sha256"]) == set(files) and self.path.name in files
                    and all(file_sha256(f) == record["sha256"][name] for name, f in files.items()))
        except (ValueError, KeyError, TypeError, OSError):
            return False

    def seal(self) -> None:
        """Record the key and the digests of the files now on disk (after a build, or after the compiler added
        to its own cache)."""
        record = {"key": self.key, "sha256": {name: file_sha256(f) for name, f in sorted(self.files().items())}}
        atomic_write(self.record, json.dumps(record, indent=1) + "\n")

    def copy_to(self, directory: Path) -> None:
        """Copy the files and then the record into `directory` (an artifact's `kernels/`, or a cache directory),
        keeping their modification times (older Numba versions stamp a cached source by its mtime; 0.68 hashes it)."""
        for name, f in sorted(self.files().items()):
            (directory / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, directory / name)
        shutil.copy2(self.record, directory / self.record.name)

    def discard(self) -> None:
        """Remove the record and every file of the entry."""
        for f in (self.record, *self.files().values()):
            f.unlink(missing_ok=True)

    def snapshot(self) -> dict[str, tuple[int, int]]:
        """(size, mtime) of each file: what a load changed, if anything."""
        out = {}
        for name, f in self.files().items():
            with contextlib.suppress(FileNotFoundError):
                st = f.stat()
                out[name] = (st.st_size, st.st_mtime_ns)
        return out


def _warn_rebuilt(path: Path, where: str = "kernel cache entry") -> None:
    """The one line that says a corrupt cache entry was thrown away."""
    print(f"warning: {where} {path} was corrupt; rebuilt", file=sys.stderr)


def log_head(text: str, lines: int = 20) -> str:
    """The first `lines` non-blank lines of a compiler's log (and "..." where there were more), for an error."""
    kept = [ln for ln in text.splitlines() if ln.strip()]
    return "\n".join(kept[:lines]) + ("\n..." if len(kept) > lines else "")


def numba_signature(kernel: Kernel, grid_sizes: bool = False) -> tuple:
    """Numba argument types of a kernel: 1-D C arrays of the storage dtypes, int32 / float32 scalars, and with
    `grid_sizes` an int64 per grid dimension after them (the CPU target's host loop)."""
    import numba

    types = tuple(numba.types.Array(numba.from_dtype(np.dtype(NUMPY_DTYPES[p.dtype])), 1, "C") if isinstance(p, Buf)
                  else numba.types.float32 if p.dtype == "f32" else numba.types.int32 for p in kernel.params)
    return types + (numba.types.int64,) * (len(kernel.grid) if grid_sizes else 0)


def compile_in_child(compiler: str, source: str, args: Sequence[str], tool: str, kernel: str, arch: str) -> bytes:
    """The bytes that `compiler` ("module:function", called as `function(source, *args)`) returns, computed in a
    child Python process: for compilers that can abort the whole process (hiprtc on an architecture it does not
    know), whose crash then becomes a PolystrataError instead of the caller's death."""
    with tempfile.TemporaryDirectory(prefix="polystrata-compile-") as tmp:
        out = Path(tmp) / "code.o"
        cmd = [sys.executable, "-m", "polystrata.runtimes.base", compiler, str(out), *args]
        p = subprocess.run(cmd, input=source.encode(), capture_output=True)
        text = log_head(p.stderr.decode(errors="replace"))
        if p.returncode < 0:
            sig = signal.Signals(-p.returncode).name
            raise PolystrataError(f"{tool} crashed ({sig}) compiling kernel {kernel} for {arch}:\n{text}")
        if p.returncode != 0 or not out.exists():
            raise PolystrataError(f"{tool} build of kernel {kernel} failed for {arch}:\n{text}")
        return out.read_bytes()


def _compile_child(argv: list[str]) -> int:
    """`compile_in_child`'s child: `COMPILER OUT [args...]`, the source on stdin, the log on stderr."""
    if len(argv) < 2 or ":" not in argv[0]:
        sys.exit("usage: python -m polystrata.runtimes.base MODULE:FUNCTION OUT [args...] < source")
    module, function = argv[0].split(":")
    try:
        code = getattr(importlib.import_module(module), function)(sys.stdin.read(), *argv[2:])
    except PolystrataError as e:
        print(e, file=sys.stderr)
        return 1
    Path(argv[1]).write_bytes(code)
    return 0


_LIBS: dict[str, ctypes.CDLL] = {}  # load_library's, by kind


def load_library(kind: str, names: Sequence[str], missing: str) -> ctypes.CDLL:
    """The first of the shared libraries `names` that loads, kept as `kind`; PolystrataError(`missing`) if none."""
    if kind not in _LIBS:
        for name in names:
            with contextlib.suppress(OSError):
                _LIBS[kind] = ctypes.CDLL(name)
                break
        else:
            raise PolystrataError(missing)
    return _LIBS[kind]


def cpu_name() -> str:
    """The CPU model name from /proc/cpuinfo, falling back to what `platform` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                # x86 says "model name"; some ARM kernels say "Model" or only "Hardware".
                if key.strip() in ("model name", "Model", "Hardware") and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def host_memory() -> tuple[int, int] | None:
    """(available, total) bytes of host memory, where the system says. Available, on Linux, is the kernel's
    MemAvailable: free memory and the page cache it can reclaim (an mmapped model file already read is there)."""
    try:
        with open("/proc/meminfo") as f:
            info = {k: int(v.split()[0]) << 10 for k, v in (line.split(":", 1) for line in f if ":" in line)}
        return info["MemAvailable"], info["MemTotal"]
    except (OSError, KeyError, ValueError, IndexError):
        pass
    try:
        pages, avail = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_AVPHYS_PAGES")
        size = os.sysconf("SC_PAGE_SIZE")
        return avail * size, pages * size
    except (ValueError, OSError):
        return None


def eval_int(e: Expr, env: dict[str, int]) -> int:
    """Evaluate an integer expression of scalars (grid sizes) on the host."""
    if isinstance(e, Const):
        return int(e.value)
    if isinstance(e, Var):
        return int(env[e.name])
    if isinstance(e, Bin):
        a, b = eval_int(e.a, env), eval_int(e.b, env)
        ops = {"+": a + b, "-": a - b, "*": a * b}
        if e.op in ops:
            return ops[e.op]
        if e.op == "//":
            return a // b
        if e.op == "%":
            return a % b
    if isinstance(e, Call) and e.fn in ("min", "max"):
        vals = [eval_int(a, env) for a in e.args]
        return min(vals) if e.fn == "min" else max(vals)
    raise ValueError(f"grid size {expr_str(e)} is not a host integer expression")


class PackedLaunch:
    """A launch through a C driver API with its arguments packed once: `ptrs`, the array of pointers to each
    argument's value that `cuLaunchKernel` and `hipModuleLaunchKernel` take (the values live as long as it)."""

    def __init__(self, fn: Any, grid: Sequence[int], lanes: int, values: list):
        self.fn, self.lanes, self.values = fn, lanes, values
        self.grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
        self.ptrs = (ctypes.c_void_p * max(len(values), 1))(*[ctypes.addressof(v) for v in values])
        self.empty = min(self.grid) <= 0
        self.programmatic = False  # launched early, its kernel waiting for the one before (cuda, sm_90+)
        self.config = None  # the driver's launch configuration where it needs one, made at the first launch


def scalar_value(p: Scalar, value: int | float) -> ctypes.c_float | ctypes.c_int32:
    """A scalar argument as the C type of its parameter (float32 or int32)."""
    return ctypes.c_float(float(value)) if p.dtype == "f32" else ctypes.c_int32(int(value))


class DeviceBuffer:
    """Device memory behind a pointer (targets driven through a C API through ctypes), freed with the object by
    `free(ptr)`."""

    def __init__(self, ptr: int, nbytes: int, free: Callable[[int], Any] | None = None):
        self.ptr, self.nbytes, self.free = ptr, nbytes, free

    def __del__(self):
        if self.free is not None and self.ptr:
            self.free(self.ptr)


class _Probed(Exception):
    """`Runtime._built`'s answer, raised from inside `compile` before anything is loaded or built."""

    def __init__(self, built: bool):
        super().__init__(built)
        self.built = built


def compile_pool(workers: int):
    """A pool of `workers` processes for `compile_in_worker` (submit through `submit_compile`): spawned, not forked
    (the parent may hold a driver's context and Numba's threads), each leaving Ctrl-C, which reaches the whole
    process group, to the parent (in a worker it would interrupt LLVM midway and print a traceback), and ending
    when the parent does (a Ctrl-C ends the parent without waiting for the compiles it started; an orphaned worker
    waited forever)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_start,
                               initargs=(os.getpid(),))


def submit_compile(pool, *args) -> Any:
    """`pool.submit(compile_in_worker, *args)` with SIGINT blocked meanwhile: a worker the pool starts for it
    inherits the mask, so a Ctrl-C cannot reach it before `_worker_start` has set the key aside."""
    if not hasattr(signal, "pthread_sigmask"):
        return pool.submit(compile_in_worker, *args)
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        return pool.submit(compile_in_worker, *args)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def stop_pool(pool) -> None:
    """End a `compile_pool` now (after a Ctrl-C or an error): the compiles not started are dropped and the running
    ones killed, whose cache entries, written atomically, are then never there."""
    terminate = getattr(pool, "terminate_workers", None)  # Python 3.14
    if terminate is not None:
        terminate()
    else:
        for proc in list((getattr(pool, "_processes", None) or {}).values()):
            proc.terminate()
    pool.shutdown(wait=True, cancel_futures=True)


def _worker_start(parent: int) -> None:
    # A handler that does nothing rather than SIG_IGN: a compiler's child process (hip's) gets the default back at
    # exec, so a terminal's Ctrl-C still ends it.
    signal.signal(signal.SIGINT, lambda signum, frame: None)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.25)
        os._exit(1)

    threading.Thread(target=watch, name="polystrata-parent-watch", daemon=True).start()


def compile_in_worker(target: str, kernels: list[Kernel], arch: str | None = None) -> int:
    """A worker process's job: compile `kernels` for `target` into the kernel cache, from which the parent then
    loads them (`Runtime.compile_all`, the tuner's candidates); returns how many. `arch`: the architecture of a
    runtime that takes one, whose worker then only compiles (it opens no device)."""
    from polystrata.targets import make_runtime, runtime_class

    os.environ["POLYSTRATA_COMPILE_JOBS"] = "1"  # a worker does not start workers of its own
    rt = make_runtime(target) if arch is None else runtime_class(target)(arch=arch, compile_only=True)
    for k in kernels:
        rt.compile(k)
    return len(kernels)


class CompiledKernel:
    """A kernel ready to launch on one runtime; `cached`: it came from the kernel cache (for `compile`'s report)."""

    def __init__(self, kernel: Kernel, handle: Any, source: str, cached: bool, entry: CacheEntry | None = None):
        self.kernel = kernel
        self.handle = handle
        self.source = source
        self.cached = cached
        self.entry = entry  # its files in the kernel cache (what `compile -o` copies into the artifact)


class Runtime(ABC):
    """A device: buffers, compilation (with a binary cache) and launches.

    A subclass declares what the rest of the project asks about its target (`polystrata/targets.py` registers
    the class by name, and nothing else names targets): the class attributes below and `present`. Optional
    abilities (pre-packed launches, device graphs, device timing marks, the memory mechanisms) have working
    defaults here; a target overrides those it does better."""

    name: str = ""
    device: str = ""
    compiler: str = ""  # the compiler and its version (and the driver's where it compiles)
    # What the target states about itself: lanes per group, subgroup width, wide loads, int8 dot products, local
    # memory, preferred layouts, and its default schedule knobs (`codegen/policy.py`). The recipes read it; a
    # device whose lane counts are known only once opened replaces it in `__init__` (`Policy.with_shape`).
    policy: Policy = HOST_POLICY
    # Kernels run on the host CPU: host memory is the device memory (experts stay resident), and `bench`
    # measures the host's bandwidth and reports `threads()`.
    host: bool = False
    # File extension of the rendered source (an artifact's `src/` files).
    source_ext: str = "txt"
    # The constructor takes `arch=`, the GPU architecture to compile for (`--arch`), and `compile_only=`; `arch`:
    # the one this runtime compiles for.
    takes_arch: bool = False
    arch: str | None = None
    # Compiles but cannot launch here (hip without a GPU): `targets.available_kernel_targets` leaves it out.
    compile_only: bool = False
    # `begin_capture` / `end_capture` / `replay` replay a decode step with one call (the executor captures where
    # set); the defaults below record prepared launches and re-launch them, which saves nothing.
    graphs: bool = False

    @classmethod
    def present(cls) -> bool:
        """Whether this machine has a device of this target that `--target auto` should pick (default: no)."""
        return False

    def threads(self) -> int | None:
        """Host threads the kernels run on (host targets; None on a device)."""
        return None

    @property
    def lanes(self) -> int:
        """Lanes per group that recipes use on this device (`policy.lanes`)."""
        return self.policy.lanes

    @property
    def subgroup(self) -> int:
        """The subgroup (warp) width (`policy.subgroup`)."""
        return self.policy.subgroup

    @property
    def wide_loads(self) -> bool:
        """Whether the compiler merges runs of aligned neighbouring loads into 16-byte loads (recipes then give
        each lane runs of consecutive words: `codegen/recipes/_matvec.use_runs`)."""
        return self.policy.wide_loads

    @property
    def matrix_units(self) -> bool:
        """Whether the renderer spells tile products (`ir.kernel.TileMMA`) on matrix units (tensor cores, MFMA,
        WMMA): prefill matmuls then take `codegen/recipes/tile_mma.py`'s kernels (`policy.matrix_units`)."""
        return self.policy.matrix_units

    def set_knobs(self, knobs: dict | None) -> None:
        """Schedule knobs (knob space -> knob -> value) for every kernel of their spaces (`--knob`), over the tuning
        database's choices (`polystrata.tuning.apply_tuning`)."""
        if knobs:
            self.policy = replace(self.policy, tuned={**self.policy.tuned, **knobs})

    def compiler_version(self) -> str:
        """The compiler (and driver) this runtime's binaries depend on (`compiler`, set by each runtime), for keys
        of caches of measurements such as the tuning database."""
        return self.compiler

    def __init__(self) -> None:
        self.cache_hits = 0
        self.cache_misses = 0
        self._compiled: dict[str, CompiledKernel] = {}  # cache key -> kernel compiled in this process
        self._recording: list | None = None  # prepared launches of an open capture
        self._staging: np.ndarray | None = None  # see `staging`
        # Directories of compiled kernels laid out as the cache is (an artifact's `kernels/`), copied into the
        # cache when it lacks an entry: a run from an artifact compiles nothing the artifact holds.
        self.kernel_stores: list[Path] = []
        self._probing = False  # see `_built`

    def compile_all(self, kernels: Iterable[Kernel]) -> dict[str, CompiledKernel]:
        """Compile each distinct kernel once (`compile`), showing "compiling kernels k/N (h from the cache)";
        returns them by fingerprint. Kernels the cache lacks are compiled first in `compile_workers` processes
        where that is more than one (into the cache, which this process then loads from; they count as compiled,
        not as cache hits)."""
        todo = {k.fingerprint(): k for k in kernels}
        out: dict[str, CompiledKernel] = {}
        hits = self.cache_hits
        workers = self.compile_workers()
        missing = [fp for fp, k in todo.items() if not self._built(k)] if workers > 1 and len(todo) > 1 else []
        pool, futures = None, {}
        try:
            if len(missing) > 1:
                pool = compile_pool(min(workers, len(missing)))
                futures = {fp: submit_compile(pool, self.name, [todo[fp]], self.arch) for fp in missing}
            with Progress("compiling kernels", len(todo)) as bar:
                for fp, kernel in todo.items():
                    built = False
                    if fp in futures:
                        # A worker that failed (the kernel's own error, a broken pool) leaves the kernel to this
                        # process, which compiles it (and reports its error) as it would without workers.
                        with contextlib.suppress(Exception):
                            futures[fp].result()
                            built = True
                    out[fp] = self.compile(kernel)
                    if built and out[fp].cached:  # loaded from the entry its worker has just written
                        self.cache_hits, self.cache_misses = self.cache_hits - 1, self.cache_misses + 1
                        out[fp].cached = False
                    bar.update(note=f"{self.cache_hits - hits} from the cache")
        except BaseException:
            if pool is not None:  # an error here or a Ctrl-C: the workers' compiles are not waited for
                stop_pool(pool)
            raise
        if pool is not None:
            pool.shutdown()
        return out

    def compile_workers(self) -> int:
        """Processes `compile_all` compiles in: `POLYSTRATA_COMPILE_JOBS`, else half the usable CPUs, at most 8
        (1: in this process)."""
        from polystrata.threads import usable_cpus

        env = os.environ.get("POLYSTRATA_COMPILE_JOBS")
        if env is not None:
            try:
                return max(1, int(env))
            except ValueError:
                raise PolystrataError(f"POLYSTRATA_COMPILE_JOBS must be a whole number, not {env!r}") from None
        return max(1, min(8, usable_cpus() // 2))

    def _built(self, kernel: Kernel) -> bool:
        """Whether `compile(kernel)` would find it compiled (in this process, the kernel cache or a kernel store),
        found without loading or building it."""
        self._probing = True
        try:
            self.compile(kernel)
        except _Probed as probed:
            return probed.built
        finally:
            self._probing = False
        return True

    def _compile_cached(self, kernel: Kernel, source: str, key: str, filename: str,
                        load: Callable[[Path], Any], build: Callable[[Path], Any]) -> CompiledKernel:
        """The one cache sequence of every target: this process's kernels, then a verified entry `filename` of
        the kernel cache turned into a handle by `load(path)`, else `build(path)`: compile `source`, write the
        entry (atomically) and return the handle; the entry's record is written last. A corrupt entry, or one
        that fails to load, is discarded with one warning and rebuilt. Counts cache hits and misses."""
        if key in self._compiled:
            return self._compiled[key]
        entry = CacheEntry(cache_dir(self.name) / filename, key)
        if self._probing:  # `_built`: answer before loading or building anything
            raise _Probed(entry.verify() is True or bool(self._copy_from_stores(entry)))
        with interrupt.held_back(), file_lock(entry.lock):  # a Ctrl-C inside a compiler waits (see interrupt)
            handle, cached = self._load_or_build(entry, load, build)
        if cached:
            self.cache_hits += 1
        else:
            self.cache_misses += 1
        ck = self._compiled[key] = CompiledKernel(kernel, handle, source, cached, entry)
        return ck

    def _load_or_build(self, entry: CacheEntry, load: Callable[[Path], Any],
                       build: Callable[[Path], Any]) -> tuple[Any, bool]:
        """`_compile_cached`'s work on the disk, under the entry's lock: (handle, whether it came from the cache)."""
        handle, cached = None, False
        state = entry.verify()
        if state is None:
            state = self._copy_from_stores(entry)
        if not state:  # no files left that a build could trip over (a half-built entry, one from before records)
            entry.discard()
            if state is False:
                _warn_rebuilt(entry.path)
        else:
            before = entry.snapshot()
            try:
                handle = load(entry.path)
            except Exception:  # whatever a damaged entry makes a loader raise (pickle, EOF, driver errors): rebuild
                entry.discard()
                _warn_rebuilt(entry.path)
            else:
                # A loader that wrote to the entry (Numba compiling what its cache lacked) built, not loaded.
                cached = entry.snapshot() == before
        if handle is None:
            handle = build(entry.path)
        if not cached:
            entry.seal()
        return handle, cached

    def _compile_code(self, kernel: Kernel, source: str, key: str, ext: str, load: Callable[[bytes], Any],
                      build: Callable[[], tuple[bytes, Any]]) -> CompiledKernel:
        """`_compile_cached` for compilers whose output is one binary (`<kernel>_<key>.<ext>`, written atomically):
        `load(code)` makes a handle of the cached bytes; `build()` compiles `source`: (its bytes, a handle)."""

        def built(path: Path) -> Any:
            code, handle = build()
            atomic_write(path, code)
            return handle

        return self._compile_cached(kernel, source, key, f"{kernel.name}_{key}.{ext}",
                                    lambda path: load(path.read_bytes()), built)

    def _compile_python(self, kernel: Kernel, source: str, key: str, signature: tuple | None) -> CompiledKernel:
        """`_compile_cached` for the Numba targets: the entry is the source itself (`k_<key>.py`), imported as a
        module named after the key (Numba's cache re-imports it by that name in a new process) and compiled now
        for `signature` (`numba_signature`; None: at the first launch), or loaded from Numba's own cache that it
        keeps beside the source (`__pycache__`)."""

        def load(path: Path) -> Any:
            name = f"polystrata_{self.name}_kernel_{key}"
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
            fn = getattr(module, kernel.name)
            if signature is not None:
                fn.compile(signature)
            return fn

        def build(path: Path) -> Any:
            atomic_write(path, source)
            try:
                return load(path)
            except Exception as e:  # Numba's typing and lowering errors, whatever their class
                raise PolystrataError(f"{self.name} build of kernel {kernel.name} failed on {self.device}:\n"
                                      f"{log_head(str(e))}") from None

        return self._compile_cached(kernel, source, key, f"k_{key}.py", load, build)

    def _copy_from_stores(self, entry: CacheEntry) -> bool | None:
        """Fill a missing cache entry from the first kernel store that holds it verified (`entry.verify()` of the
        copy); a store's corrupt entry is passed over with one warning, and the kernel rebuilt."""
        for store in self.kernel_stores:
            shipped = CacheEntry(store / entry.path.name, entry.key)
            state = shipped.verify()
            if state:
                entry.discard()  # a build's leftovers, which `files()` would count as the entry's
                shipped.copy_to(entry.path.parent)
                return entry.verify()
            if state is False:
                _warn_rebuilt(shipped.path, "artifact kernel")
                return None
        return None

    @abstractmethod
    def render(self, kernel: Kernel) -> str:
        """Source of `kernel` for this target."""

    @abstractmethod
    def compile(self, kernel: Kernel) -> CompiledKernel:
        """Compile (or fetch from the binary cache) one kernel."""

    @abstractmethod
    def alloc(self, shape: Sequence[int], dtype: str) -> Any:
        """A device buffer of IR dtype `dtype`."""

    def upload(self, array: np.ndarray) -> Any:
        """A device buffer holding a copy of `array` (storage dtype as the IR expects). Default, for targets whose
        buffers are bytes: `alloc` then `write`."""
        host = np.ascontiguousarray(array).reshape(-1)
        buf = self.alloc((max(host.nbytes, 4),), "u8")
        self.write(buf, host)
        return buf

    def download(self, buf: Any, shape: Sequence[int], dtype: str) -> np.ndarray:
        """Copy a device buffer's leading values back to the host, waiting for queued work (f16 comes back as
        f32)."""
        out = np.empty(tuple(shape), NUMPY_DTYPES[dtype])
        if out.nbytes:
            self._check_fits(buf, 0, out.nbytes, "download")
            self.read_bytes(buf, out.reshape(-1).view(np.uint8))
        return out.view(np.float16).astype(np.float32) if dtype == "f16" else out

    def download_rows(self, buf: Any, width: int, rows: Sequence[int], dtype: str) -> np.ndarray:
        """Rows `rows` of a device buffer of rows of `width` values, [len(rows), width], waiting for queued work:
        each run of consecutive rows in one read (a step's logits: only the rows to sample leave the device)."""
        out = np.empty((len(rows), width), NUMPY_DTYPES[dtype])
        row_bytes = width * out.itemsize
        flat = out.reshape(-1).view(np.uint8)
        i = 0
        while i < len(rows):
            j = i + 1
            while j < len(rows) and rows[j] == rows[j - 1] + 1:
                j += 1
            offset, nbytes = int(rows[i]) * row_bytes, (j - i) * row_bytes
            self._check_fits(buf, offset, nbytes, "download")
            self.read_bytes(buf, flat[i * row_bytes : i * row_bytes + nbytes], offset)
            i = j
        return out.view(np.float16).astype(np.float32) if dtype == "f16" else out

    def write(self, buf: Any, array: np.ndarray) -> None:
        """Overwrite a device buffer's leading bytes with `array`'s bytes (inputs for one step)."""
        self.write_region(buf, 0, array)

    def write_region(self, buf: Any, offset: int, array: np.ndarray) -> None:
        """Overwrite bytes [offset, offset + array.nbytes) of a device buffer, in order with the compute queue."""
        host = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        self._check_fits(buf, offset, host.nbytes, "write")
        if host.nbytes:
            self.write_bytes(buf, offset, host)

    def _check_fits(self, buf: Any, offset: int, nbytes: int, what: str) -> None:
        size = self.buffer_bytes(buf)
        if offset + nbytes > size:
            raise PolystrataError(f"{what} of {nbytes} bytes at {offset} beyond a {size}-byte {self.name} buffer")

    def buffer_bytes(self, buf: Any) -> int:
        """Size of a device buffer in bytes."""
        return int(buf.nbytes)

    @abstractmethod
    def read_bytes(self, buf: Any, out: np.ndarray, offset: int = 0) -> None:
        """Copy `out.nbytes` bytes of a device buffer from byte `offset` on (in bounds) into the host bytes `out`
        (uint8), after the work queued so far."""

    @abstractmethod
    def write_bytes(self, buf: Any, offset: int, host: np.ndarray) -> None:
        """Copy the host bytes `host` (uint8, in bounds) into a device buffer at byte `offset`, in queue order;
        `host` may change once this returns."""

    @abstractmethod
    def launch(self, ck: CompiledKernel, args: Sequence[Any], grid: Sequence[int]) -> None:
        """Run `ck` on `grid` groups with `args` in the kernel's parameter order (buffers and scalars)."""

    def sync(self) -> None:  # noqa: B027 - targets without queues have nothing to wait for
        """Wait for queued work."""

    # --- optional abilities (defaults that work everywhere) ----------------------------------------------------

    def prepare(self, ck: CompiledKernel, args: Sequence[Any], grid: Sequence[int]) -> Any:
        """One launch packed for `launch_prepared`, which re-runs it without converting the arguments again (the
        buffers must stay alive). Default: the launch's arguments as given."""
        return ck, list(args), [int(g) for g in grid]

    def launch_prepared(self, prepared: Any) -> None:
        """Run a `prepare`d launch (recorded instead while a capture is open)."""
        if self._recording is not None:
            self._recording.append(prepared)
        else:
            self.launch(*prepared)

    def begin_capture(self) -> None:
        """Start recording prepared launches into a graph; they run at `replay`, not now."""
        if self._recording is not None:
            raise PolystrataError(f"a {self.name} graph capture is already open")
        self._recording = []

    def end_capture(self) -> Any:
        """Close the capture; returns the graph for `replay` (default: the recorded launches)."""
        if self._recording is None:
            raise PolystrataError("end_capture without begin_capture")
        graph, self._recording = self._recording, None
        return graph

    def replay(self, graph: Any) -> None:
        """Run a captured graph (asynchronous, like a launch)."""
        for prepared in graph:
            self.launch_prepared(prepared)

    def mark(self) -> Any:
        """A device timing event after the work queued so far; None where the target has no device clock."""
        return None

    def elapsed(self, start: Any, end: Any) -> float | None:
        """Seconds of device time between two `mark`s (events with `seconds_since`), once `end` is reached; None
        without marks."""
        return None if start is None or end is None else end.seconds_since(start)

    def kernel_resources(self, ck: CompiledKernel) -> dict[str, int]:
        """What a compiled kernel holds (registers, local and shared bytes, groups per multiprocessor), where the
        target's driver says; empty by default."""
        return {}

    def memory_info(self) -> tuple[int, int] | None:
        """(free, total) bytes of device memory, where known."""
        return None

    # --- memory mechanisms (runtimes/memory.py decides; these only move bytes) ---------------------------------

    def free(self, buf: Any) -> None:  # noqa: B027 - by default a buffer goes with its last reference
        """Release a device buffer now (the caller holds no other reference to it)."""

    def staging(self, nbytes: int) -> np.ndarray:
        """A host buffer of at least `nbytes` from `alloc_host`, kept and grown (doubling) across calls: where
        downloads land before they are copied out."""
        if self._staging is None or self._staging.nbytes < nbytes:
            size = max(nbytes, 2 * (self._staging.nbytes if self._staging is not None else 0), 1 << 16)
            self._staging = self.alloc_host(size)
        return self._staging

    def alloc_host(self, nbytes: int) -> np.ndarray:
        """A host staging buffer of `nbytes` bytes (uint8) for `copy_async`: page-locked where the target has
        such memory (copies from it run at the link's full speed), else an ordinary array."""
        return np.empty(nbytes, np.uint8)

    def device_view(self, host: np.ndarray, dtype: str) -> Any:
        """A buffer handle through which kernels read `host` (an `alloc_host` array, as IR dtype `dtype`) in place
        over the host link, or None where the target cannot (the default). `host` must not change afterwards:
        a target may keep a copy."""
        return None

    def copy_async(self, buf: Any, offset: int, host: np.ndarray) -> Any:
        """Start copying `host`'s bytes into `buf` at byte `offset` on a second queue, beside the compute queue's
        work; returns an event for `wait_for` / `wait_host`, or None when the copy is already complete. `host`
        (an `alloc_host` buffer) must not change until then. The copy is not ordered with the compute queue's
        work queued before it (`alloc`'s zero fill included): the caller syncs where it must. Default: a
        synchronous `write_region`."""
        self.write_region(buf, offset, host)
        return None

    def wait_for(self, event: Any) -> None:  # noqa: B027 - synchronous copies leave nothing to wait for
        """Make launches queued after this call wait until `event` (from `copy_async`) completes."""

    def wait_host(self, event: Any) -> None:
        """Block the host until `event` (from `copy_async`: an object with `wait()`, or None) completes."""
        if event is not None:
            event.wait()

    def args_for(self, kernel: Kernel, buffers: dict[str, Any], scalars: dict[str, int | float]) -> list[Any]:
        """Launch arguments in parameter order: buffer handles and scalars converted to their dtype."""
        out: list[Any] = []
        for p in kernel.params:
            if isinstance(p, Buf):
                out.append(buffers[p.name])
            else:
                assert isinstance(p, Scalar)
                v = scalars[p.name]
                out.append(np.float32(v) if p.dtype == "f32" else np.int32(v))
        return out


class DriverRuntime(Runtime):
    """A runtime over a C driver API through ctypes (hip's AMD and NVIDIA backends; the start of a port to another
    such API): memory in zeroed `DeviceBuffer`s, launches packed once into `PackedLaunch`es and recorded while a
    capture is open. `compile_only` without a device: buffers and launches then raise `no_device`. A subclass
    implements `_malloc`, `_copy` and `_launch`, and its compiled kernels' handles have a `function`."""

    def no_device(self) -> str:
        """The error of a compile-only runtime asked for buffers or launches."""
        return f"no {self.name} device here: compile only"

    @property
    def gpu(self) -> bool:
        """A device runs this runtime's kernels (not compile-only)."""
        return not self.compile_only

    def _need_gpu(self) -> None:
        if not self.gpu:
            raise PolystrataError(self.no_device())

    @abstractmethod
    def _malloc(self, nbytes: int) -> DeviceBuffer:
        """`nbytes` of device memory, zeroed (like the CPU target's buffers)."""

    @abstractmethod
    def _copy(self, to_device: bool, dev: int, host: int, nbytes: int) -> None:
        """A synchronous copy of `nbytes` between device address `dev` and host address `host`."""

    @abstractmethod
    def _launch(self, p: PackedLaunch) -> None:
        """Queue a packed launch (not empty, no capture open)."""

    def alloc(self, shape: Sequence[int], dtype: str) -> DeviceBuffer:
        self._need_gpu()
        return self._malloc(max(int(np.prod(shape)) * DTYPE_BYTES[dtype], 4))

    def read_bytes(self, buf: DeviceBuffer, out: np.ndarray, offset: int = 0) -> None:
        self._copy(False, buf.ptr + offset, out.ctypes.data, out.size)

    def write_bytes(self, buf: DeviceBuffer, offset: int, host: np.ndarray) -> None:
        self._copy(True, buf.ptr + offset, host.ctypes.data, host.size)

    def prepare(self, ck: CompiledKernel, args: Sequence[Any], grid: Sequence[int]) -> PackedLaunch:
        self._need_gpu()
        values = [ctypes.c_void_p(a.ptr) if isinstance(p, Buf) else scalar_value(p, a)
                  for p, a in zip(ck.kernel.params, args)]
        return PackedLaunch(ck.handle.function, grid, ck.kernel.lanes, values)

    def launch_prepared(self, p: PackedLaunch) -> None:
        if self._recording is not None:
            super().launch_prepared(p)
        elif not p.empty:
            self._launch(p)

    def launch(self, ck: CompiledKernel, args: Sequence[Any], grid: Sequence[int]) -> None:
        self.launch_prepared(self.prepare(ck, args, grid))


if __name__ == "__main__":
    sys.exit(_compile_child(sys.argv[1:]))

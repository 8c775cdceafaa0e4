"""What every target runtime provides: device buffers, kernel compilation through a binary cache, launches.

A target is one renderer (`codegen/<target>.py`: kernel IR -> source) and one runtime (`runtimes/<target>.py`:
a `Runtime` subclass). The executor (`polystrata/compiler/executor.py`) drives any runtime through this
interface only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from polystrata.ir.kernel import Buf, Call, Kernel, Scalar, expr_str, stable_digest
from polystrata.ir.quant import Bin, Const, Expr, Var
from polystrata.paths import atomic_write, file_lock, home_dir, private_dir
from polystrata.progress import Progress


def cache_dir(target: str) -> Path:
    """Where compiled kernels of `target` are kept: `<home>/kernels/<target>` (see `polystrata.paths`), created
    user-only: whoever can write there can run code as the user."""
    return private_dir(home_dir() / "kernels" / target)


def cache_key(source: str, target: str, device: str, compiler: str) -> str:
    """Binary-cache key: a hash of the source, target, device and compiler version."""
    return stable_digest((source, target, device, compiler), 24)


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


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
                    and all(_sha256(f) == record["sha256"][name] for name, f in files.items()))
        except (ValueError, KeyError, TypeError, OSError):
            return False

    def seal(self) -> None:
        """Record the key and the digests of the files now on disk (after a build, or after the compiler added
        to its own cache)."""
        record = {"key": self.key, "sha256": {name: _sha256(f) for name, f in sorted(self.files().items())}}
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


def host_memory() -> tuple[int, int] | None:
    """(available, total) bytes of host memory, where the system says."""
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


class CompiledKernel:
    """A kernel ready to launch on one runtime; `cached`: it came from the kernel cache (for `compile`'s report)."""

    def __init__(self, kernel: Kernel, handle: Any, source: str, cached: bool, entry: CacheEntry | None = None):
        self.kernel = kernel
        self.handle = handle
        self.source = source
        self.cached = cached
        self.entry = entry  # its files in the kernel cache (what `compile -o` copies into the artifact)


class Runtime(ABC):
    """A device: buffers, compilation (with a binary cache) and launches."""

    name: str = ""
    device: str = ""
    # Lanes per group that recipes should use on this device (1 on the CPU), and the subgroup (warp) width.
    lanes: int = 1
    subgroup: int = 1
    # Whether the compiler merges runs of aligned neighbouring loads into 16-byte loads (recipes then give each
    # lane runs of consecutive words: `codegen/recipes/_matvec.use_runs`).
    wide_loads: bool = False

    def __init__(self) -> None:
        self.cache_hits = 0
        self.cache_misses = 0
        self._compiled: dict[str, CompiledKernel] = {}  # cache key -> kernel compiled in this process
        # Directories of compiled kernels laid out as the cache is (an artifact's `kernels/`), copied into the
        # cache when it lacks an entry: a run from an artifact compiles nothing the artifact holds.
        self.kernel_stores: list[Path] = []

    def compile_all(self, kernels: Iterable[Kernel]) -> dict[str, CompiledKernel]:
        """Compile each distinct kernel once (`compile`), showing "compiling kernels k/N (h from the cache)";
        returns them by fingerprint."""
        todo = {k.fingerprint(): k for k in kernels}
        out: dict[str, CompiledKernel] = {}
        hits = self.cache_hits
        with Progress("compiling kernels", len(todo)) as bar:
            for fp, kernel in todo.items():
                out[fp] = self.compile(kernel)
                bar.update(note=f"{self.cache_hits - hits} from the cache")
        return out

    def _compile_cached(self, kernel: Kernel, source: str, key: str, filename: str,
                        load: Callable[[Path], Any], build: Callable[[Path], Any]) -> CompiledKernel:
        """The one cache sequence of every target: this process's kernels, then a verified entry `filename` of
        the kernel cache turned into a handle by `load(path)`, else `build(path)`: compile `source`, write the
        entry (atomically) and return the handle; the entry's record is written last. A corrupt entry, or one
        that fails to load, is discarded with one warning and rebuilt. Counts cache hits and misses."""
        if key in self._compiled:
            return self._compiled[key]
        entry = CacheEntry(cache_dir(self.name) / filename, key)
        with file_lock(entry.lock):
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

    @abstractmethod
    def upload(self, array: np.ndarray) -> Any:
        """A device buffer holding a copy of `array` (storage dtype as the IR expects)."""

    @abstractmethod
    def download(self, buf: Any, shape: Sequence[int], dtype: str) -> np.ndarray:
        """Copy a device buffer back to the host."""

    @abstractmethod
    def write(self, buf: Any, array: np.ndarray) -> None:
        """Overwrite a device buffer's leading bytes with `array` (inputs for one step)."""

    @abstractmethod
    def launch(self, ck: CompiledKernel, args: Sequence[Any], grid: Sequence[int]) -> None:
        """Run `ck` on `grid` groups with `args` in the kernel's parameter order (buffers and scalars)."""

    def sync(self) -> None:  # noqa: B027 - targets without queues have nothing to wait for
        """Wait for queued work."""

    def memory_info(self) -> tuple[int, int] | None:
        """(free, total) bytes of device memory, where known."""
        return None

    # --- memory mechanisms (runtimes/memory.py decides; these only move bytes) ---------------------------------

    def free(self, buf: Any) -> None:  # noqa: B027 - by default a buffer goes with its last reference
        """Release a device buffer now (the caller holds no other reference to it)."""

    def alloc_host(self, nbytes: int) -> np.ndarray:
        """A host staging buffer of `nbytes` bytes (uint8) for `copy_async`: page-locked where the target has
        such memory (copies from it run at the link's full speed), else an ordinary array."""
        return np.empty(nbytes, np.uint8)

    def write_region(self, buf: Any, offset: int, array: np.ndarray) -> None:
        """Overwrite bytes [offset, offset + array.nbytes) of a device buffer, in order with the compute queue."""
        raise NotImplementedError(f"the {self.name} runtime cannot write part of a buffer")

    def copy_async(self, buf: Any, offset: int, host: np.ndarray) -> Any:
        """Start copying `host`'s bytes into `buf` at byte `offset` on a second queue, beside the compute queue's
        work; returns an event for `wait_for` / `wait_host`, or None when the copy is already complete. `host`
        (an `alloc_host` buffer) must not change until then. Default: a synchronous `write_region`."""
        self.write_region(buf, offset, host)
        return None

    def wait_for(self, event: Any) -> None:  # noqa: B027 - synchronous copies leave nothing to wait for
        """Make launches queued after this call wait until `event` (from `copy_async`) completes."""

    def wait_host(self, event: Any) -> None:  # noqa: B027 - synchronous copies leave nothing to wait for
        """Block the host until `event` (from `copy_async`) completes."""

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

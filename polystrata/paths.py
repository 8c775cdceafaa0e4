"""Where PolyStrata keeps its files: one home directory (`$POLYSTRATA_HOME`, else `~/.cache/polystrata`) holding
`models/` (the zoo) and `kernels/` (the kernel cache), and how files there are written and locked."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

DEFAULT_HOME = "~/.cache/polystrata"


def home_dir() -> Path:
    """PolyStrata's home: `$POLYSTRATA_HOME` with `~` expanded; unset or empty means `~/.cache/polystrata`."""
    return Path(os.environ.get("POLYSTRATA_HOME") or DEFAULT_HOME).expanduser()


def private_dir(path: Path) -> Path:
    """Create `path` and its missing parents with user-only permissions (0o700); existing ones are left as
    they are. Returns `path`."""
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for d in reversed(missing):
        # mode applies to this directory only (makedirs gives parents the umask's default), hence one by one.
        d.mkdir(mode=0o700, exist_ok=True)
    return path


@contextmanager
def file_lock(path: Path, waiting: str | None = None) -> Iterator[None]:
    """Hold an exclusive lock on `path` (created if missing), waiting for another process that holds it; print
    `waiting` to stderr first if it has to wait. The kernel drops the lock of a process that dies, however it
    dies."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting:
                print(waiting, file=sys.stderr)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


@contextmanager
def atomic_file(path: Path, mode: int | None = None, durable: bool = False) -> Iterator[BinaryIO]:
    """A temporary file (opened for binary writing) that replaces `path` in one rename when the block ends: no
    reader ever sees half of it, and on an exception it is removed and `path` left as it was. `mode`: the file's
    permissions (default: mkstemp's user-only 0o600); `durable`: the file and the rename are on disk (fsync)
    before the block returns."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            if durable:
                f.flush()
                os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        # Makes the rename itself durable; not possible on every platform, hence best effort.
        with contextlib.suppress(OSError, AttributeError):
            dfd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)


def atomic_write(path: Path, data: bytes | str, mode: int | None = None) -> None:
    """Write `path` through a temporary file and a rename (`atomic_file`). `mode`: the file's permissions
    (default: mkstemp's user-only 0o600)."""
    with atomic_file(path, mode) as f:
        f.write(data.encode() if isinstance(data, str) else data)


def file_sha256(path: str | os.PathLike) -> str:
    """The sha256 of a file's bytes, as hex."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()

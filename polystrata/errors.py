"""Errors meant for people: the CLI prints `error: <message>` and exits 1, without a traceback."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


class PolystrataError(Exception):
    """Base of every error whose message is shown to the user as is."""


class UsageError(PolystrataError):
    """The command line asks for something impossible or misses something (exit code 2, as argparse's errors)."""


class GGUFError(PolystrataError):
    """A GGUF file is malformed, truncated, or uses something this build does not know."""


class UnsupportedError(PolystrataError):
    """A model, architecture, format or option that PolyStrata does not support."""


class ZooError(PolystrataError):
    """A model could not be fetched or verified."""


@contextmanager
def writing(path: str | os.PathLike) -> Iterator[None]:
    """Within it, an OSError (disk full, read-only, no permission) becomes a PolystrataError naming `path`.

    A failed write() reports no file name of its own: without this, a full disk reads `error: No space left on
    device` with no word of which file it was writing.
    """
    try:
        yield
    except OSError as e:
        raise PolystrataError(f"cannot write {os.fspath(path)}: {e.strerror or e}") from e

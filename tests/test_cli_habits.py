"""llama.cpp's flags (-m, -s, -ngl, bench -o, --version, defaults in help), list/rm of pulled models, info --json,
parity's refusal of another model's fixtures, and the README's first command."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

from polystrata import zoo
from polystrata.cli import main
from polystrata.engine import gpu_layers_target
from polystrata.errors import UnsupportedError
from polystrata.synth import synth_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return synth_model("llama", tmp_path_factory.mktemp("m") / "tiny.gguf", preset="tiny", qtype="Q8_0", seed=0)


def polystrata(capsys, *argv: str) -> tuple[int, str, str]:
    """`polystrata argv` in this process: exit code, stdout, stderr."""
    try:
        rc = main(list(argv))
    except SystemExit as e:  # argparse's usage errors, --version and --help
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert lines and lines[-1].startswith("error: ") and "Traceback" not in err, err
    return lines[-1]


# --- llama.cpp's flags ---------------------------------------------------------------------------------------------


def test_model_flag_and_seed_short_flag(capsys, tiny):
    args = ("--target", "reference", "-n", "5", "--raw", "-p", "hello")
    rc, by_position, _ = polystrata(capsys, "run", str(tiny), *args, "-s", "9")
    assert rc == 0
    assert polystrata(capsys, "run", "-m", str(tiny), *args, "--seed", "9")[1] == by_position
    rc, _, err = polystrata(capsys, "run", str(tiny), "-m", str(tiny), *args)
    assert rc == 2 and one_line_error(err).startswith("error: give the model once, as MODEL or as -m MODEL")
    rc, _, err = polystrata(capsys, "info")
    assert rc == 2 and "required: MODEL" in one_line_error(err)
    assert polystrata(capsys, "info", "-m", str(tiny))[0] == 0


def test_repeat_last_n_is_checked(capsys, tiny):
    rc, _, err = polystrata(capsys, "run", str(tiny), "--target", "reference", "-p", "x", "--repeat-last-n", "-2")
    assert rc == 1 and "repeat-last-n must be >= -1" in one_line_error(err)


@pytest.mark.parametrize("asked, resolved, ngl, expect", [
    ("auto", "cuda", None, "cuda"), ("auto", "cuda", 0, "cpu"), ("auto", "cpu", 0, "cpu"),
    ("reference", "reference", 0, "reference"), ("auto", "cuda", 30, "cuda"), ("auto", "cuda", 99, "cuda"),
    ("auto", "cuda", -1, "cuda"), ("cpu", "cpu", 12, "cpu"), ("hip", "hip", 30, "hip"),
    ("cuda", "cuda", 0, "-ngl 0 keeps the model on the CPU, but the target cuda is a GPU"),
    ("auto", "opencl", 12, "-ngl 12 would split the model's 30 layers between the GPU and the CPU"),
])
def test_gpu_layers_map_onto_a_target(asked, resolved, ngl, expect):
    if " " not in expect:
        assert gpu_layers_target(asked, resolved, ngl, 30) == expect
    else:
        with pytest.raises(UnsupportedError, match=expect):
            gpu_layers_target(asked, resolved, ngl, 30)


def test_ngl_is_a_number_never_n_gl(capsys, tiny):
    rc, _, err = polystrata(capsys, "run", str(tiny), "-ngl", "99", "--target", "reference", "-n", "2", "-p", "a")
    assert rc == 0, err
    rc, _, err = polystrata(capsys, "run", str(tiny), "-ngl", "gl", "-p", "a")
    assert rc == 2 and "-ngl/--n-gpu-layers/--gpu-layers: expected a layer count" in one_line_error(err)
    rc, _, err = polystrata(capsys, "run", str(tiny), "-ngl", "0", "--target", "cuda", "-p", "a")
    assert rc == 1 and one_line_error(err) == "error: -ngl 0 keeps the model on the CPU, but the target cuda is a GPU"
    rc, _, err = polystrata(capsys, "compile", str(tiny), "-ngl", "0", "--target", "hip", "-o", "unused")
    assert rc == 1 and one_line_error(err) == "error: -ngl 0 keeps the model on the CPU, but the target hip is a GPU"


def test_bench_output_formats(capsys, monkeypatch, tiny):
    monkeypatch.setenv("POLYSTRATA_BANDWIDTH", "1e11")  # no bandwidth measurement: a quick test
    args = ("bench", str(tiny), "--target", "reference", "-p", "4", "-n", "2", "-r", "1")
    rc, out, _ = polystrata(capsys, *args, "-o", "csv")
    assert rc == 0
    rows = list(csv.DictReader(io.StringIO(out)))
    assert [r["test"] for r in rows] == ["pp", "tg"] and [r["n_tokens"] for r in rows] == ["4", "2"]
    assert all(float(r["tok_s_mean"]) > 0 for r in rows) and rows[0]["target"] == "reference"
    for flags in (("-o", "json"), ("--json",)):
        rc, out, _ = polystrata(capsys, *args, *flags)
        assert rc == 0 and json.loads(out)["tg"]["n"] == 2
    rc, out, _ = polystrata(capsys, *args)
    assert rc == 0 and out.startswith("| model") and "tg2" in out
    rc, _, err = polystrata(capsys, *args, "-o", "xml")
    assert rc == 2 and "invalid choice: 'xml'" in one_line_error(err)


def test_version_and_help_show_defaults_presets_and_zoo(capsys):
    from polystrata import __version__

    rc, out, _ = polystrata(capsys, "--version")
    assert rc == 0 and out.strip() == f"polystrata {__version__}"
    rc, out, _ = polystrata(capsys, "--help")
    flat = " ".join(out.split())
    assert rc == 0 and "smollm2-135m" in flat and "gemma3-270m" in flat and "llama3-8b" in flat
    assert "qwen3-30b-a3b" in flat
    rc, out, _ = polystrata(capsys, "run", "--help")
    flat = " ".join(out.split())
    assert "(default: 0.8)" in flat and "(default: 64)" in flat and "(default: auto)" in flat
    assert "(default: None)" not in flat and "(default: False)" not in flat


# --- list, rm, info --json -------------------------------------------------------------------------------------------


def test_list_and_rm_pulled_models(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("POLYSTRATA_HOME", str(tmp_path))
    rc, out, err = polystrata(capsys, "list")
    assert rc == 0 and out == "" and "polystrata pull NAME" in err
    model = zoo.ZOO["smollm2-135m"]
    path = zoo.models_dir() / model.filename
    path.parent.mkdir(parents=True)
    path.write_bytes(b"\0" * 3 * 2**20)
    sidecar = path.with_name(path.name + ".sha256")
    sidecar.write_text("{}")
    rc, out, _ = polystrata(capsys, "list")
    assert rc == 0 and out.split() == ["smollm2-135m", "3.0", "MiB", str(path)]
    rc, _, err = polystrata(capsys, "rm", "smollm2-135m")
    assert rc == 0 and not path.exists() and not sidecar.exists() and str(path) in err
    assert polystrata(capsys, "list")[1] == ""
    rc, _, err = polystrata(capsys, "rm", "smollm2-135m")
    assert rc == 1 and one_line_error(err).startswith("error: smollm2-135m is not pulled")
    rc, _, err = polystrata(capsys, "rm", "llama-70b")
    assert rc == 1 and one_line_error(err).startswith("error: unknown zoo model 'llama-70b'")


def test_info_json(capsys, tiny):
    rc, out, _ = polystrata(capsys, "info", str(tiny), "--json", "--tensors")
    info = json.loads(out)
    assert rc == 0 and info["architecture"] == "llama" and info["file"] == str(tiny)
    assert info["hparams"]["n_layer"] >= 1 and "Q8_0" in info["types"] and "F32" in info["types"]
    assert len(info["tensors"]) == info["n_tensors"] == sum(t["tensors"] for t in info["types"].values())
    assert info["tensor_bytes"] == sum(t["bytes"] for t in info["tensors"])
    text = polystrata(capsys, "info", str(tiny))[1]
    assert "architecture: llama" in text and f"tensors: {info['n_tensors']}," in text


# --- parity --------------------------------------------------------------------------------------------------------


def test_parity_refuses_fixtures_of_another_model(capsys, tiny, fixtures_dir):
    for model in ("gemma3", "smollm2"):
        rc, _, err = polystrata(capsys, "parity", str(tiny), "--fixtures", str(fixtures_dir / model),
                                "--target", "reference")
        assert rc == 1 and one_line_error(err) == (
            f"error: the fixtures in {fixtures_dir / model} were not made with {tiny.name}: the prompt 'capital' is "
            "not tokenized as this model tokenizes it")


@pytest.mark.slow
def test_parity_takes_the_fixtures_of_its_own_model(capsys, smollm2_path, fixtures_dir):
    rc, out, _ = polystrata(capsys, "parity", str(smollm2_path), "--fixtures", str(fixtures_dir / "smollm2"),
                            "--target", "cpu")
    assert rc == 0 and out.startswith(f"parity {smollm2_path.name} cpu: KL")


# --- the README's first command --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_readme_first_command_answers_paris(capsys, smollm2_path):
    """The README's quick start (the default model), greedy, on the reference target: the quickest to run here."""
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    command = next(line for line in readme.splitlines() if "polystrata run -p" in line)
    assert '-p "What is the capital of France?" --temp 0' in command
    rc, out, _ = polystrata(capsys, "run", str(smollm2_path), "-p", "What is the capital of France?", "--temp", "0",
                            "--target", "reference", "-n", "16")
    assert rc == 0 and "Paris" in out, out

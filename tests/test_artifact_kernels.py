"""Artifacts that save the wait: `compile -o` keeps the compiled kernels, `run ARTIFACT` on an empty kernel cache
compiles nothing, and the model is found by its sha256. Also the progress lines these waits print."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import yaml

from polystrata import progress, server, zoo
from polystrata.artifact import KERNELS, write_artifact
from polystrata.cli import main
from polystrata.errors import PolystrataError
from polystrata.paths import file_sha256
from polystrata.synth import synth_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A folder with a tiny model: the one test_cli uses, at the same context, so the kernels are shared."""
    d = tmp_path_factory.mktemp("bundle")
    synth_model("llama", d / "tiny.gguf", preset="tiny", qtype="Q8_0", seed=0)
    return d


@pytest.fixture(scope="module")
def bundle(tiny) -> Path:
    """The tiny model's folder with its cpu artifact `art` beside it."""
    write_artifact(tiny / "tiny.gguf", "cpu", tiny / "art")
    return tiny


@pytest.fixture
def lines(monkeypatch):
    """Every progress step printed as a plain line."""
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    monkeypatch.setattr(progress, "LINE_EVERY_S", 0.0)


def _compiles(err: str) -> tuple[int, int, int]:
    """(done, total, from the cache) of the last "compiling kernels" line."""
    k, n, hits = re.findall(r"^compiling kernels (\d+)/(\d+) \((\d+) from the cache\)$", err, re.M)[-1]
    return int(k), int(n), int(hits)


def _fresh_home(monkeypatch, tmp_path: Path) -> Path:
    home = tmp_path / "home"
    monkeypatch.setenv("POLYSTRATA_HOME", str(home))
    return home


def test_artifact_holds_every_kernel_as_the_cache_does(bundle):
    art = bundle / "art"
    m = yaml.safe_load((art / "manifest.yaml").read_text())
    records = list((art / KERNELS).glob("*.sha256.json"))
    assert records and len(records) == len(list((art / "src").iterdir())) == len({k["id"] for k in m["kernels"]})
    assert any((art / KERNELS / "__pycache__").iterdir())  # Numba's machine code travels along


def test_run_from_an_artifact_on_an_empty_cache_compiles_nothing(bundle, tmp_path, monkeypatch, capsys, lines):
    moved = tmp_path / "moved"
    shutil.copytree(bundle, moved)  # the artifact and its model moved together: found relative to the artifact
    home = _fresh_home(monkeypatch, tmp_path)
    assert main(["run", str(moved / "art"), "-p", "hi", "-n", "3", "--temp", "0", "--raw"]) == 0
    out, err = capsys.readouterr()
    k, n, hits = _compiles(err)
    assert k == n == hits > 0 and "warning" not in err
    assert len(list((home / "kernels" / "cpu").glob("*.sha256.json"))) == n
    # The same text as the model run directly, kernels compiled or not.
    assert main(["run", str(moved / "tiny.gguf"), "-p", "hi", "-n", "3", "--temp", "0", "--raw"]) == 0
    assert capsys.readouterr().out == out
    # An artifact with kernels is still an artifact to replace.
    write_artifact(moved / "tiny.gguf", "cpu", moved / "art")
    (moved / "art" / KERNELS / "__pycache__" / "mine").mkdir()
    with pytest.raises(PolystrataError, match="kernels/__pycache__/mine, which is not part of a PolyStrata"):
        write_artifact(moved / "tiny.gguf", "cpu", moved / "art")


def test_score_an_artifact(bundle, tmp_path, capsys):
    """An artifact holds the plans `run`, `chat` and `serve` run, not scoring's (every token's logits, which they
    never compute): `score ARTIFACT` makes it, with a line saying so, in the artifact's target and context, and
    writes what `score MODEL` writes there."""
    import numpy as np

    art = bundle / "art"
    m = yaml.safe_load((art / "manifest.yaml").read_text())
    assert {k["plan"] for k in m["kernels"]} == {"decode", "prefill"}
    text = ["--text", "one two three four"]
    assert main(["score", str(art), *text, "-o", str(tmp_path / "art.npz")]) == 0
    assert (f"{art} holds the plans of run, chat and serve; score plans every token's logits too (kernels the "
            "artifact lacks are compiled)") in capsys.readouterr().err
    ctx = str(m["memory"]["n_ctx"])
    assert main(["score", str(bundle / "tiny.gguf"), "--target", "cpu", "-c", ctx, *text, "-o",
                 str(tmp_path / "model.npz")]) == 0
    got, want = np.load(tmp_path / "art.npz"), np.load(tmp_path / "model.npz")
    assert got.files == want.files and all(np.array_equal(got[k], want[k]) for k in got.files)


def test_damaged_artifact_kernel_is_rebuilt_with_one_warning(bundle, tmp_path, monkeypatch, capsys, lines):
    art = tmp_path / "art"
    shutil.copytree(bundle / "art", art)
    victim = sorted((art / KERNELS).glob("k_*.py"))[0]
    victim.write_text(victim.read_text() + "\n# edited\n")
    _fresh_home(monkeypatch, tmp_path)
    assert main(["run", str(art), "--model", str(bundle / "tiny.gguf"), "-p", "hi", "-n", "2", "--raw"]) == 0
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("warning")]
    assert warnings == [f"warning: artifact kernel {victim} was corrupt; rebuilt"]
    k, n, hits = _compiles(err)
    assert k == n and hits == n - 1


def test_model_found_by_sha256(tmp_path, monkeypatch, capsys):
    (tmp_path / "m").mkdir()
    model = synth_model("llama", tmp_path / "m" / "tiny.gguf", preset="tiny", qtype="F16", seed=3)
    other = synth_model("llama", tmp_path / "other.gguf", preset="tiny", qtype="F16", seed=4)
    art = tmp_path / "art"
    write_artifact(model, "reference", art)
    run = ["run", str(art), "-p", "hi", "-n", "2", "--raw", "--temp", "0"]
    assert main(run) == 0
    text = capsys.readouterr().out
    kept = tmp_path / "kept.gguf"
    model.rename(kept)
    assert main(run) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "is gone and no zoo model in the cache has its sha256" in err
    assert "-m PATH" in err and len(err.splitlines()) == 1
    assert main([*run, "--model", str(kept)]) == 0 and capsys.readouterr().out == text
    assert main([*run, "--model", str(other)]) == 1
    assert f"{other} is not the model {art} was compiled from" in capsys.readouterr().err
    # A zoo model with that digest, in the cache: found there.
    home = _fresh_home(monkeypatch, tmp_path)
    (home / "models").mkdir(parents=True)
    shutil.copy(kept, home / "models" / "tiny.gguf")
    entry = zoo.ZooModel("tiny", "tiny.gguf", file_sha256(kept), ())
    monkeypatch.setitem(zoo.ZOO, "tiny", entry)
    assert main(run) == 0 and capsys.readouterr().out == text
    # Without an artifact, -m/--model names the model (llama.cpp's -m); with a model too, one is too many.
    assert main(["run", "--model", str(kept), "--target", "reference", *run[2:]]) == 0
    assert capsys.readouterr().out == text
    with pytest.raises(SystemExit) as usage:
        main(["run", str(kept), "--model", str(kept), "-n", "1"])
    assert usage.value.code == 2 and "give the model once" in capsys.readouterr().err


def test_serve_an_artifact_compiled_for_its_parallel_sequences(tmp_path, monkeypatch, capsys, lines):
    """`compile -np 4` plans the steps of 4 sequences too (the plan of the last 4 rows' logits), so `serve ARTIFACT
    -np 4` on an empty kernel cache compiles nothing; another -np plans those steps again, with a line saying so,
    and compiles nothing either: every kernel takes its row count at run time, the last rows' too. The manifest
    counts the plans' shared scratch as the engine does. An -np the step size cannot hold is refused from the
    manifest, before the model is looked for."""
    # test_batch's model and context: the kernels of its 4-row plan compile once per run.
    (tmp_path / "m").mkdir()
    model = synth_model("llama", tmp_path / "m" / "tiny.gguf", preset="tiny", qtype="Q8_0", seed=7)
    art = tmp_path / "m" / "art"
    assert main(["compile", str(model), "--target", "cpu", "-c", "64", "-np", "4", "-o", str(art)]) == 0
    capsys.readouterr()
    m = yaml.safe_load((art / "manifest.yaml").read_text())
    assert m["memory"]["n_parallel"] == 4 and any(k["plan"] == "rows" for k in m["kernels"])
    served: list = []
    monkeypatch.setattr(server, "serve", lambda eng, n_seq, sock, *a: (sock.close(), served.append((eng, n_seq))))
    _fresh_home(monkeypatch, tmp_path)
    assert main(["serve", str(art), "-np", "4", "--port", "0"]) == 0
    err = capsys.readouterr().err
    k, n, hits = _compiles(err)
    assert k == n == hits > 0 and "was compiled for" not in err
    eng = served[-1][0]
    assert served[-1][1] == 4 and eng.graph_rows.outputs[0].type.shape[0] == 4
    assert eng.memory.scratch_bytes == m["memory"]["scratch_bytes"]
    assert main(["serve", str(art), "-np", "2", "--port", "0"]) == 0
    err = capsys.readouterr().err
    assert f"{art} was compiled for 4 parallel sequences (compile -np); -np 2 plans the steps of 2 sequences" in err
    k, n, hits = _compiles(err)
    assert k == n == hits
    shutil.copytree(art, tmp_path / "alone")  # without its model: not found, and not looked for
    assert main(["serve", str(tmp_path / "alone"), "-np", "300"]) == 1
    assert capsys.readouterr().err.startswith("error: -np 300 does not fit a step of 256 rows (-ub 256)")


def test_progress_on_long_waits_but_not_under_json(bundle, tmp_path, capsys, lines):
    assert main(["synth", "--arch", "llama", "-o", str(tmp_path / "t.gguf")]) == 0
    err = capsys.readouterr().err
    assert re.search(r"^writing tensors (\d+)/\1$", err, re.M)
    assert main(["compile", str(bundle / "tiny.gguf"), "--target", "cpu", "-o", str(tmp_path / "art")]) == 0
    k, n, hits = _compiles(capsys.readouterr().err)
    assert k == n == hits > 0
    # The context of the artifact (the model's 2048): the same kernels, compiled once in a test run.
    bench = ["bench", str(bundle / "tiny.gguf"), "--target", "cpu", "-p", "4", "-n", "2", "-r", "1", "-c", "2048"]
    assert main(bench) == 0
    assert _compiles(capsys.readouterr().err)[0] > 0
    assert main([*bench, "--json"]) == 0
    assert "compiling kernels" not in capsys.readouterr().err


@pytest.mark.parametrize("target", [pytest.param(t, marks=pytest.mark.target(t)) for t in ("opencl", "cuda", "hip")])
def test_device_artifact_on_an_empty_cache_compiles_nothing(target, tiny, tmp_path, monkeypatch, capsys, lines):
    """OpenCL binaries here (PoCL); cubins and hip code objects on a GPU machine (pytest -k device_artifact)."""
    from polystrata.targets import make_runtime

    if target == "cuda" and os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        pytest.skip("the CUDA simulator compiles nothing to keep")
    try:
        rt = make_runtime(target)
    except (ImportError, OSError, PolystrataError) as e:
        pytest.skip(str(e))
    if getattr(rt, "gpu", True) is False:
        pytest.skip(f"{target} compiles here but has no GPU to run on")
    art = tmp_path / "art"
    write_artifact(tiny / "tiny.gguf", target, art)
    assert list((art / KERNELS).glob("*.sha256.json"))
    _fresh_home(monkeypatch, tmp_path)
    assert main(["run", str(art), "--model", str(tiny / "tiny.gguf"), "-p", "hi", "-n", "2", "--raw"]) == 0
    k, n, hits = _compiles(capsys.readouterr().err)
    assert k == n == hits > 0


def test_compile_knobs_are_the_artifacts_own(bundle, tmp_path, monkeypatch, capsys):
    """`compile --knob` plans with the knob and records it in the manifest; `serve ARTIFACT` plans with the
    manifest's knobs unless --knob gives its own; a manifest whose knobs are not knob spaces is refused."""
    art = tmp_path / "art"
    compile_ = ["compile", str(bundle / "tiny.gguf"), "--target", "cpu", "--knob", "embed.chunk=4", "-o", str(art)]
    assert main(compile_) == 0
    m = yaml.safe_load((art / "manifest.yaml").read_text())
    assert m["knobs"] == {"embed": {"chunk": 4}}
    assert {k["knobs"]["chunk"] for k in m["kernels"] if k["name"].startswith("embed")} == {4}
    served: list = []
    monkeypatch.setattr(server, "serve", lambda eng, n_seq, sock, *a: (sock.close(), served.append(eng)))
    assert main(["serve", str(art), "--port", "0"]) == 0
    assert served[-1].runtime.policy.tuned["embed"] == {"chunk": 4}
    assert main(["serve", str(art), "--port", "0", "--knob", "embed.chunk=2"]) == 0
    assert served[-1].runtime.policy.tuned["embed"] == {"chunk": 2}
    m["knobs"] = {"embed": 4}
    (art / "manifest.yaml").write_text(yaml.safe_dump(m))
    capsys.readouterr()
    assert main(["serve", str(art), "--port", "0"]) == 1
    assert "the manifest's knobs are not knob spaces of knobs" in capsys.readouterr().err

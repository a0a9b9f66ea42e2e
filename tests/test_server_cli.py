"""`ds4mlx serve` as a process: flags, demo model, one request, clean SIGINT exit."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from signal_helpers import ctrl_c_default


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(url: str, proc, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise AssertionError(f"server exited early: {proc.stdout.read()}")
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=2).read()
            return
        except OSError:
            time.sleep(0.2)
    raise AssertionError("server did not come up")


def test_serve_process_demo_model(tmp_path):
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "ds4mlx.cli",
        "serve",
        "--port",
        str(port),
        "--ctx",
        "1024",
        "--tokens",
        "3",
        "--chdir",
        str(tmp_path),
        "--trace",
        "trace.jsonl",
        "--cors",
        "--alias",
        "claude-*",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=ctrl_c_default)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_up(url, proc)
        models = json.loads(urllib.request.urlopen(url + "/v1/models").read())
        assert models["data"][0]["context_length"] == 1024
        assert models["data"][0]["top_provider"]["max_completion_tokens"] == 3
        req = urllib.request.Request(
            url + "/v1/messages",
            data=json.dumps({"model": "claude-sonnet-4", "messages": [{"role": "user", "content": "hi"}]}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req) as r:
            body = json.loads(r.read())
            assert r.headers["Access-Control-Allow-Origin"] == "*"
        assert body["model"] == "claude-sonnet-4" and body["usage"]["output_tokens"] <= 3  # --tokens default
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "listening on" in out and "prefill chunk" in out  # prefill progress in the server log
    lines = (tmp_path / "trace.jsonl").read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["route"] == "/v1/messages"


@pytest.mark.parametrize("args", [["--port", "0"], ["--ctx", "-1"], ["--tokens", "x"], ["--bogus"]])
def test_bad_flags_exit_2(args):
    proc = subprocess.run(
        [sys.executable, "-m", "ds4mlx.cli", "serve", *args],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=120,
    )
    assert proc.returncode == 2 and "usage" in proc.stderr

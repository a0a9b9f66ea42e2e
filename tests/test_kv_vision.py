"""The disk KV cache never stores vision state (docs/vision.md §3): `ds4mlx serve -m
demo:qwen4_exp --vision demo --kv-disk-dir kv`, an image request and the shutdown
checkpoint leave no file; the same server run with a text request stores one."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import requests

sys.path.insert(0, str(Path(__file__).parent))
from test_kv_server import Server  # noqa: E402
from vision_helpers import data_uri, image_bytes  # noqa: E402

FLAGS = ("-m", "demo:qwen4_exp", "--vision", "demo", "--ctx", "4096", "--kv-cache-min-tokens", "16")


def _checkpoints(root: Path) -> list[Path]:
    kv = root / "kv"
    return [p for p in kv.rglob("*") if p.is_file() and p.suffix != ".lock"] if kv.exists() else []


def _chat(s: Server, content) -> dict:
    body = {"model": "m", "max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": content}]}
    r = requests.post(s.url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture
def serve_kv(tmp_path):
    made: list[Server] = []

    def make() -> Server:
        made.append(Server(tmp_path, *FLAGS))
        return made[-1].start()

    yield make
    for s in made:
        s.kill()


def test_image_sessions_never_reach_the_disk_cache(serve_kv, tmp_path):
    s = serve_kv()
    words = "describe the picture in great detail please " * 8
    _chat(s, [{"type": "text", "text": words}, {"type": "image_url", "image_url": {"url": data_uri(image_bytes())}}])
    log = s.stop()  # SIGINT: the shutdown checkpoint of the live (image) session
    assert _checkpoints(tmp_path) == [], log[-2000:]

    s = serve_kv()
    _chat(s, words * 3)
    s.stop()
    assert _checkpoints(tmp_path), "a text-only session is stored"

"""Odd entries in the disk KV cache directory: only regular files are ever
opened.  A FIFO named like a checkpoint (a plain open() blocks on it forever),
a directory, a symlink or a misnamed file is skipped with one log line, at
start-up and when it appears while running; a real `ds4mlx serve` with such a
directory starts, answers and keeps answering."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

from ds4mlx.kv import store as ks
from ds4mlx.kv.store import KVStore

sys.path.insert(0, str(Path(__file__).parent))
from signal_helpers import ctrl_c_default  # noqa: E402
from test_server_cli import free_port, wait_up  # noqa: E402

SHA = "0123456789abcdef0123456789abcdef01234567"


def open_store(d) -> KVStore:
    return KVStore(str(d), 1 << 20, "deepseek-v4-flash-test", 4, 4096, 4)


def in_thread(fn, timeout: float = 30.0):
    """Run fn in a daemon thread; fail (not hang) if it blocks."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "blocked (opened a FIFO?)"
    return out[0] if out else None


def odd_entries(d: Path) -> dict[str, str]:
    os.mkfifo(d / f"{SHA}.kv")
    (d / f"{SHA[:-1]}8.kv").mkdir()
    (d / "notes.txt").write_text("x")
    (d / "target").write_bytes(b"\0" * 200)
    os.symlink(d / "target", d / f"{SHA[:-1]}9.kv")
    os.mkfifo(d / ks.META_NAME)
    return {
        f"{SHA}.kv": "FIFO",
        f"{SHA[:-1]}8.kv": "directory",
        f"{SHA[:-1]}9.kv": "symlink",
        "notes.txt": "misnamed",
        "target": "misnamed",
    }


def test_store_skips_fifo_directory_symlink_and_misnamed_entries(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="ds4mlx.kvstore")
    odd = odd_entries(tmp_path)
    store = in_thread(lambda: open_store(tmp_path))
    store.store("system prompt", 10, [b"abc"], "cold")
    for _ in range(3):  # scanned again and again: still one line per entry
        assert in_thread(lambda: store.lookup("system prompt and more")).payload == b"abc"
        assert [e.sha for e in in_thread(store.entries)] == [ks.sha1_hex(b"system prompt")]
    skips = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    for name in odd:
        assert sum(os.path.join(str(tmp_path), name) + ":" in m for m in skips) == 1, (name, skips)
    for name in odd:  # left alone, never deleted
        assert os.path.lexists(tmp_path / name)
    assert any(ks.META_NAME in r.getMessage() for r in caplog.records)  # FIFO meta: ignored, logged


def test_fifo_created_while_running_does_not_hang_the_store(tmp_path):
    store = open_store(tmp_path)
    store.store("system prompt", 10, [b"abc"], "cold")
    os.mkfifo(tmp_path / f"{SHA}.kv")
    assert in_thread(lambda: store.lookup("system prompt and more")).payload == b"abc"
    assert in_thread(lambda: store.store("another prompt", 10, [b"def"], "cold"))
    assert len(in_thread(store.entries)) == 2


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file of mode 000")
def test_unreadable_entry_is_skipped(tmp_path, caplog):
    store = open_store(tmp_path)
    path = store.store("system prompt", 10, [b"abc"], "cold")
    os.chmod(path, 0)
    try:
        assert store.lookup("system prompt and more") is None and store.entries() == []
        assert any("skipping" in r.getMessage() for r in caplog.records)
        assert os.path.exists(path)
    finally:
        os.chmod(path, 0o600)


def _chat(url: str) -> dict:
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_serve_with_a_fifo_in_the_kv_dir_starts_and_keeps_answering(tmp_path):
    kv = tmp_path / "kv"
    kv.mkdir()
    os.mkfifo(kv / f"{SHA}.kv")
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
        "2",
        "--kv-disk-dir",
        str(kv),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=ctrl_c_default)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_up(url, proc)
        assert _chat(url)["object"] == "chat.completion"
        os.mkfifo(kv / f"{SHA[:-1]}8.kv")  # appears while running
        assert _chat(url)["object"] == "chat.completion"
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert out.count(f"skipping {kv / SHA}.kv") == 1, out

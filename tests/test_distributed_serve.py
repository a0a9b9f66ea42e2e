"""`ds4mlx serve --distributed tp|ep|pipeline` over two local ring ranks (issue #25).

The demo model served sharded answers a conversation exactly as the single-process
server does (greedy): a first turn, a second turn that extends the live session, and
the first turn asked again (restored from rank 0's checkpoint and every follower's own
shard).  A follower that dies makes the next request fail with the distributed error
and rank 0 exit 1 instead of hanging.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from distributed_helpers import REPO, free_ports, logs, start_ranks, stop  # noqa: E402

UP_TIMEOUT = 300
TURN1 = [{"role": "user", "content": "hello there"}]


# end to end (servers, several processes or models, whole files): the slow tier, which CI runs second
pytestmark = pytest.mark.slow


def serve_cmd(port: int, plan: str | None) -> list[str]:
    cmd = [sys.executable, "-m", "ds4mlx.cli", "serve", "--port", str(port), "--ctx", "1024", "--nothink"]
    return cmd + (["--distributed", plan] if plan else [])


def wait_up(url: str, procs, timeout: float = UP_TIMEOUT) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if any(p.poll() is not None for p in procs):
            raise AssertionError("a rank exited before the server came up")
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=2).read()
            return
        except OSError:
            time.sleep(0.5)
    raise AssertionError("server did not come up")


def chat(url: str, messages: list, max_tokens: int = 8) -> dict:
    body = {"model": "demo", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    req = urllib.request.Request(
        url + "/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=240) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return {"http_status": e.code, "body": e.read().decode(errors="replace")}


def conversation(url: str) -> list[str]:
    first = chat(url, TURN1)["choices"][0]["message"]["content"]
    turn2 = TURN1 + [{"role": "assistant", "content": first}, {"role": "user", "content": "and then?"}]
    second = chat(url, turn2)["choices"][0]["message"]["content"]
    again = chat(url, TURN1)["choices"][0]["message"]["content"]  # a checkpoint restore
    return [first, second, again]


@pytest.fixture(scope="module")
def single_answers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("single")
    port = free_ports(1)[0]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    log = open(tmp / "rank0.log", "wb")
    proc = subprocess.Popen(serve_cmd(port, None), env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        wait_up(f"http://127.0.0.1:{port}", [proc])
        return conversation(f"http://127.0.0.1:{port}")
    finally:
        stop([proc])


def sharded_server(plan: str, tmp: Path):
    port = free_ports(1)[0]
    procs = start_ranks(serve_cmd(port, plan), 2, tmp)
    try:
        wait_up(f"http://127.0.0.1:{port}", procs)
    except AssertionError as e:
        stop(procs)
        raise AssertionError(f"{e}\n{logs(2, tmp)}") from None
    return f"http://127.0.0.1:{port}", procs


def wait_exit(procs, timeout: float = 120) -> list:
    end = time.monotonic() + timeout
    while time.monotonic() < end and any(p.poll() is None for p in procs):
        time.sleep(0.2)
    return [p.poll() for p in procs]


@pytest.mark.parametrize("plan", ["tp", "ep", "pipeline"])
def test_sharded_server_answers_as_single_process(plan, single_answers, tmp_path):
    url, procs = sharded_server(plan, tmp_path)
    try:
        answers = conversation(url)
        procs[0].send_signal(signal.SIGINT)  # rank 0 stops; it tells the follower to exit
        codes = wait_exit(procs)
    finally:
        stop(procs)
    assert answers == single_answers, logs(2, tmp_path)
    assert codes == [0, 0], logs(2, tmp_path)


def test_dead_rank_fails_the_request_and_stops_the_server(tmp_path):
    url, procs = sharded_server("tp", tmp_path)
    try:
        assert chat(url, TURN1)["choices"][0]["message"]["content"] is not None
        procs[1].kill()
        procs[1].wait()
        reply = chat(url, TURN1 + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "more"}])
        codes = wait_exit(procs[:1])
    finally:
        stop(procs)
    text = json.dumps(reply)
    assert "a rank left the group" in text, (reply, logs(2, tmp_path))
    assert codes == [1], logs(2, tmp_path)


def stats(url: str) -> dict:
    return json.loads(urllib.request.urlopen(url + "/v1/ds4mlx/stats", timeout=30).read())


def test_disk_kv_cache_restores_every_rank_after_a_restart(tmp_path):
    """tp with --kv-disk-dir: the shutdown save holds rank 0's file and the follower's own
    shard snapshot; after a restart the next turn restores from disk on both ranks and
    answers as a single process that never stopped."""
    system = " ".join(f"Rule {i}: answer briefly and name the rule number." for i in range(60))
    turn1 = [{"role": "system", "content": system}, {"role": "user", "content": "hello there"}]
    disk = ["--kv-disk-dir", str(tmp_path / "kv"), "--kv-cache-min-tokens", "64"]
    port = free_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    log = open(tmp_path / "single.log", "wb")
    single = subprocess.Popen(serve_cmd(port, None), env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        wait_up(url, [single])
        first = chat(url, turn1)["choices"][0]["message"]["content"]
        turn2 = turn1 + [{"role": "assistant", "content": first}, {"role": "user", "content": "and then?"}]
        want = chat(url, turn2)["choices"][0]["message"]["content"]
    finally:
        stop([single])
    runs = []
    for i in range(2):
        run_dir = tmp_path / f"run{i}"
        run_dir.mkdir()
        port = free_ports(1)[0]
        procs = start_ranks(serve_cmd(port, "tp") + disk, 2, run_dir)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_up(url, procs)
            runs.append(chat(url, turn1 if i == 0 else turn2)["choices"][0]["message"]["content"])
            runs.append(stats(url)["engine"]["last_cache_source"])
            procs[0].send_signal(signal.SIGINT)  # the shutdown save, then STOP to the follower
            codes = wait_exit(procs)
        finally:
            stop(procs)
        assert codes == [0, 0], logs(2, run_dir)
    assert list((tmp_path / "kv" / "rank1-of-2-tp").glob("*.snap")), "the follower kept no shard snapshot"
    assert runs[0] == first and runs[2] == want, (runs, first, want)
    assert runs[3] == "disk-text", runs

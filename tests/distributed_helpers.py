"""Start N local ranks of a command on MLX's ring backend (a generated hostfile).

`run_ranks(cmd, n, tmp)`: every rank runs `cmd` with MLX_HOSTFILE / MLX_RANK set; all
must exit 0 within `timeout` seconds, else every rank is killed and the test fails with
each rank's output (a hang fails, it does not wait forever).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest
from signal_helpers import ctrl_c_default

REPO = Path(__file__).resolve().parents[1]


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def ring_env(n: int, tmp: Path) -> list[dict]:
    hostfile = tmp / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(n)]))
    base = dict(os.environ, PYTHONPATH=str(REPO), MLX_HOSTFILE=str(hostfile), OMP_NUM_THREADS="1")
    return [dict(base, MLX_RANK=str(r)) for r in range(n)]


def start_ranks(cmd: list[str], n: int, tmp: Path, extra_env: dict | None = None) -> list[subprocess.Popen]:
    procs = []
    for r, env in enumerate(ring_env(n, tmp)):
        env.update(extra_env or {})
        log = open(tmp / f"rank{r}.log", "wb")
        p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, preexec_fn=ctrl_c_default)
        procs.append(p)  # rank 0 is stopped with SIGINT
    return procs


def logs(n: int, tmp: Path) -> str:
    return "\n".join(f"--- rank {r}:\n" + (tmp / f"rank{r}.log").read_text(errors="replace")[-4000:] for r in range(n))


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()


def run_ranks(cmd: list[str], n: int, tmp: Path, timeout: float = 240) -> None:
    procs = start_ranks(cmd, n, tmp)
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                pytest.fail(f"ranks still running after {timeout}s:\n{logs(n, tmp)}")
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
    finally:
        stop(procs)
    codes = [p.returncode for p in procs]
    assert codes == [0] * n, f"exit codes {codes}:\n{logs(n, tmp)}"

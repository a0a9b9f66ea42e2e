"""bash with background jobs: bash, bash_status, bash_stop (ds4-agent's tools,
antirez/ds4 ds4_agent.c "bash job" section).

Each command runs as `bash -c COMMAND` in the project directory, spawned with
`subprocess` (close_fds, a new session so a stop reaches the whole process
group; CPython spawns with vfork/posix_spawn, so the model process's memory is
never copied).  stdout and stderr go to one log file.  `bash` waits in the
foreground until the command ends, `timeout_sec` passes (the job is killed) or
`refresh_sec` passes (the job stays in the background and the model is told
its number: bash_status / bash_stop).  A cooperative stop (Ctrl+C) kills the
foreground job at the next poll.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .errors import ToolError

DEFAULT_TIMEOUT_SEC = 120.0
HEAD_BYTES = 8 * 1024  # ds4_agent.c AGENT_BASH_HEAD_BYTES
TAIL_BYTES = 32 * 1024  # ds4_agent.c AGENT_BASH_TAIL_BYTES
POLL_SEC = 0.05


@dataclass
class Job:
    number: int
    command: str
    proc: subprocess.Popen
    log_path: str
    started: float = field(default_factory=time.monotonic)
    reported: int = 0  # bytes of the log already shown to the model
    stopped: str = ""  # why it was killed ("", "timeout", "stopped")

    def returncode(self) -> int | None:
        return self.proc.poll()


def _clip(data: bytes) -> str:
    """Head and tail of a long output, the middle elided."""
    if len(data) > HEAD_BYTES + TAIL_BYTES:
        cut = len(data) - HEAD_BYTES - TAIL_BYTES
        data = data[:HEAD_BYTES] + f"\n[... {cut} bytes elided ...]\n".encode() + data[-TAIL_BYTES:]
    return data.decode("utf-8", "replace")


class BashJobs:
    def __init__(self, cwd: str, stop_requested: Callable[[], bool] = lambda: False):
        self.cwd = cwd
        self.stop_requested = stop_requested
        self._jobs: dict[int, Job] = {}
        self._next = 1
        self._lock = threading.Lock()
        self._dir = tempfile.mkdtemp(prefix="ds4mlx-agent-bash-")

    # -- tools -----------------------------------------------------------------------
    def run(self, args: dict) -> str:
        command = args.get("command")
        if not isinstance(command, str) or not command.strip():
            raise ToolError("command is required")
        timeout = _num(args.get("timeout_sec"), DEFAULT_TIMEOUT_SEC)
        refresh = _num(args.get("refresh_sec"), None)
        job = self._spawn(command)
        return self._wait_report(job, timeout, refresh)

    def status(self, args: dict) -> str:
        job = self._job(args)
        refresh = _num(args.get("refresh_sec"), 0.0)
        return self._wait_report(job, None, refresh)

    def stop(self, args: dict) -> str:
        job = self._job(args)
        if job.returncode() is None:
            self._kill(job, "stopped")
        return self._report(job)

    # -- machinery -------------------------------------------------------------------
    def _job(self, args: dict) -> Job:
        n = _num(args.get("job"), None)
        job = self._jobs.get(int(n)) if n is not None else None
        if job is None:
            raise ToolError(f"no bash job {args.get('job')!r}; jobs: {sorted(self._jobs) or 'none'}")
        return job

    def _spawn(self, command: str) -> Job:
        with self._lock:
            n = self._next
            self._next += 1
        log_path = os.path.join(self._dir, f"job{n}.log")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                ["bash", "-c", command],
                cwd=self.cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                close_fds=True,
                start_new_session=True,
            )
        job = Job(n, command, proc, log_path)
        self._jobs[n] = job
        return job

    def _wait_report(self, job: Job, timeout: float | None, refresh: float | None) -> str:
        t0 = time.monotonic()
        while job.returncode() is None:
            waited = time.monotonic() - t0
            if self.stop_requested():
                self._kill(job, "stopped")
                break
            if timeout is not None and waited >= timeout:
                self._kill(job, "timeout")
                break
            if refresh is not None and waited >= refresh:
                break
            try:
                job.proc.wait(POLL_SEC)
            except subprocess.TimeoutExpired:
                pass
        return self._report(job)

    def _kill(self, job: Job, why: str) -> None:
        job.stopped = why
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(job.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                job.proc.wait(2.0)
                return
            except subprocess.TimeoutExpired:
                continue

    def _report(self, job: Job) -> str:
        with open(job.log_path, "rb") as f:
            f.seek(job.reported)
            new = f.read()
        job.reported += len(new)
        rc = job.returncode()
        out = _clip(new)
        if rc is None:
            state = (
                f"job {job.number} (pid {job.proc.pid}) still running after {time.monotonic() - job.started:.0f} s; "
                "call bash_status to check it or bash_stop to terminate it"
            )
        elif job.stopped == "timeout":
            state = f"job {job.number} killed: timeout"
        elif job.stopped == "stopped":
            state = f"job {job.number} stopped"
        else:
            state = f"exit code {rc}"
        return f"$ {job.command}\n{out}{'' if not out or out.endswith(chr(10)) else chr(10)}[{state}]"

    def running(self) -> list[int]:
        return [n for n, j in self._jobs.items() if j.returncode() is None]

    def close(self) -> None:
        """Kill every job still running (the agent exits)."""
        for job in list(self._jobs.values()):
            if job.returncode() is None:
                self._kill(job, "stopped")


def _num(v, default):
    if v is None or v == "":
        return default
    try:
        return float(v)
    except (TypeError, ValueError):
        return default

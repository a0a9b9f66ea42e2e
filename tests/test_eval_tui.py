"""The eval TUI under a real pseudo-terminal (tmux, its own server socket):
Down/Enter switch cases, p pauses, q quits and prints the report."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from ds4mlx.eval import load_cases
from ds4mlx.eval.trace import parse_trace

# serial: tmux and the TUI's key timing want the machine to themselves (CI runs them alone)
pytestmark = [pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux not installed"), pytest.mark.serial]
REPO = Path(__file__).resolve().parent.parent


class Tmux:
    def __init__(self, name: str, cols: int = 120, rows: int = 32):
        self.sock = f"ds4mlx-eval-test-{os.getpid()}-{name}-unstarted"
        self.name = name
        self.cols, self.rows = cols, rows

    def _t(self, *args: str) -> str:
        return subprocess.run(["tmux", "-L", self.sock, *args], capture_output=True, text=True, timeout=30).stdout

    def start(self, command: str) -> None:
        # a fresh server per start, named uniquely: reusing a socket right after kill-server
        # races its shutdown ("server exited unexpectedly" — CI once hit it when every test's
        # first start reused the previous test's socket name). Tried again on another socket
        # if tmux's server still dies while starting: that is tmux's failure, not the program's.
        for _ in range(3):
            self.sock = f"ds4mlx-eval-test-{os.getpid()}-{self.name}-{uuid.uuid4().hex[:8]}"
            argv = ["tmux", "-L", self.sock, "-f", "/dev/null", "new-session", "-d", "-s", self.name]
            argv += ["-x", str(self.cols), "-y", str(self.rows), command]
            r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
            if r.returncode == 0:
                return
            self.kill()
            time.sleep(0.5)
        raise AssertionError(f"tmux new-session failed ({r.returncode}): {r.stderr.strip()}")

    def screen(self) -> str:
        return self._t("capture-pane", "-p", "-t", self.name)

    def keys(self, *keys: str) -> None:
        for k in keys:
            self._send("send-keys", "-t", self.name, k)
            time.sleep(0.15)

    def _send(self, *args: str) -> None:
        """A tmux command that must take effect: retried, and its failure said (a key that
        tmux did not send must not read as a key the program ignored; a loaded CI machine
        once ran an eval to its end after a Ctrl-C that never arrived)."""
        for _ in range(3):
            r = subprocess.run(["tmux", "-L", self.sock, *args], capture_output=True, text=True, timeout=30)
            if r.returncode == 0:
                return
            time.sleep(0.3)
        raise AssertionError(f"tmux {' '.join(args)} failed ({r.returncode}): {r.stderr.strip()}")

    def wait_for(self, predicate, timeout: float = 60.0) -> str:
        end = time.monotonic() + timeout
        screen = ""
        while time.monotonic() < end:
            screen = self.screen()
            if predicate(screen):
                return screen
            time.sleep(0.1)
        raise AssertionError(f"screen never matched:\n{screen}")

    def kill(self) -> None:
        subprocess.run(["tmux", "-L", self.sock, "kill-server"], capture_output=True, timeout=30)


def _row(screen: str, index: int) -> str:
    for line in screen.splitlines():
        left = line.split(" | ")[0]
        if left[1:4] == f"{index:>2} ":
            return left
    return ""


@pytest.fixture
def tmux():
    t = Tmux("evaltui")
    yield t
    t.kill()


def test_tui_keys_and_report(tmp_path, tmux):
    cases = load_cases("core")[:4]
    words = " ".join(f"step{i}" for i in range(60))
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"default": f"{words}</think>\nAnswer: B", "delay": 0.15, "prefill_delay": 0.3}))
    trace = tmp_path / "trace.txt"
    cmd = (
        f"cd {REPO} && {sys.executable} -m ds4mlx.cli eval --backend fake --fake-script {script} "
        + " ".join(f"--case-id {c['id']}" for c in cases)
        + f" --trace {trace} --pause-ms 1; echo EXIT=$?; sleep 300"
    )
    tmux.start(cmd)

    screen = tmux.wait_for(lambda s: "ds4-eval (p)ause (q)uit" in s and " RUN " in _row(s, 1))
    assert "score 0/4  failed 0" in screen
    assert "GPQA Diamond: An intelligent civilization" in _row(screen, 1)
    assert all(" PEND " in _row(screen, i) for i in (2, 3, 4))
    assert "THINK" in screen and "GPQA Diamond/recNu3MXkvWU" in screen  # right pane status line
    assert "An intelligent civilization in the Large Magellanic" in screen  # question preview

    # Down places the cursor on the running case, two more move it to case 3
    tmux.keys("Down", "Down", "Down")
    screen = tmux.wait_for(lambda s: _row(s, 3).startswith(">"))
    # the right pane follows the selection
    assert "AIME2025/aime2025-01" in screen

    tmux.keys("Enter")  # run case 3 next: case 1 is abandoned (SWITCHED) and back to PEND
    screen = tmux.wait_for(lambda s: " RUN " in _row(s, 3) and " PEND " in _row(s, 1))
    tmux.wait_for(lambda s: "step3" in s)  # live tail of case 3's thinking

    tmux.keys("p")
    screen = tmux.wait_for(lambda s: "PAUSED" in s)
    assert " RUN " in _row(screen, 3)

    tmux.keys("q")  # quit also unpauses; the report goes to the normal screen
    screen = tmux.wait_for(lambda s: "EXIT=" in s)
    assert "EXIT=0" in screen
    assert "ds4-eval: 0/4 passed, runtime 00h:00m" in screen
    assert "#   state      prompt      gen    total given    correct  test" in screen
    rows = {int(line[:3]): line for line in screen.splitlines() if line[:3].strip().isdigit()}
    assert rows[3].split()[1] == "STOPPED" and rows[3].endswith("AIME2025/aime2025-01")
    assert rows[1].split()[1] == "PENDING" and rows[2].split()[1] == "PENDING"
    assert "ds4-eval (p)ause" not in screen  # the alternate screen is gone

    recs = parse_trace(trace.read_bytes())
    assert [(r.id, r.status) for r in recs] == [(cases[0]["id"], "SWITCHED"), (cases[2]["id"], "STOPPED")]
    assert recs[1].output.startswith("step0 step1") and "</think>" not in recs[1].output
    assert trace.read_text().rstrip().endswith("passed: 0\nfailed: 0\ntotal: 4")


def test_small_terminal_falls_back_to_plain(tmp_path, tmux):
    tmux.cols, tmux.rows = 80, 24
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"default": "hm</think>\nAnswer: B"}))
    tmux.start(
        f"cd {REPO} && {sys.executable} -m ds4mlx.cli eval --backend fake --fake-script {script} "
        f"--case-id 1; echo EXIT=$?; sleep 300"
    )
    screen = tmux.wait_for(lambda s: "EXIT=" in s)
    assert "PASSED got B expected B" in screen and "EXIT=0" in screen


def test_ctrl_c_quits_cleanly_with_130(tmp_path, tmux):
    """Ctrl-C in the TUI: report printed, exit 130, the worker joined (no abort, no traceback)."""
    script = tmp_path / "script.json"
    script.write_text(
        json.dumps({"default": " ".join(f"w{i}" for i in range(400)) + "</think>\nAnswer: B", "delay": 0.05})
    )
    trace = tmp_path / "trace.txt"
    for attempt in range(3):
        if trace.exists():
            trace.unlink()
        cmd = (
            f"cd {REPO} && {sys.executable} -m ds4mlx.cli eval --backend fake --fake-script {script} "
            f"--case-id 1 --case-id 2 --trace {trace} --pause-ms 1; echo EXIT=$?; sleep 300"
        )
        tmux.start(cmd)
        tmux.wait_for(lambda s: " RUN " in _row(s, 1) and "w3" in s)
        time.sleep(0.1 * attempt)  # a different point of the run each time
        tmux.keys("C-c")
        screen = tmux.wait_for(lambda s: "EXIT=" in s)
        assert "EXIT=130" in screen, screen
        assert "Traceback" not in screen and "terminate called" not in screen
        assert "ds4-eval: 0/2 passed" in screen
        rows = {int(line[:3]): line for line in screen.splitlines() if line[:3].strip().isdigit()}
        assert rows[1].split()[1] == "STOPPED" and rows[2].split()[1] == "PENDING"
        recs = parse_trace(trace.read_bytes())
        assert [r.status for r in recs] == ["STOPPED"]  # written by the worker before the exit
        assert trace.read_text().rstrip().endswith("total: 2")
        tmux.kill()


def test_ctrl_c_with_the_in_process_model_exits_130_not_134(tmp_path, tmux):
    """The MLX backend: Ctrl-C while its worker is inside MLX (prefill / first steps)
    used to exit under that thread: 'terminate called without an active exception',
    exit 134 (5 of 5 tries on the demo model before the fix)."""
    pytest.importorskip("mlx.core")
    err = tmp_path / "err.txt"
    for attempt in range(2):
        cmd = (
            f"cd {REPO} && {sys.executable} -m ds4mlx.cli eval --questions 3 --tokens 300 --pause-ms 1 "
            f"2>{err}; echo EXIT=$?; sleep 300"
        )
        tmux.start(cmd)
        tmux.wait_for(lambda s: "ds4-eval (p)ause" in s, timeout=120)
        time.sleep(0.3 * attempt)
        tmux.keys("C-c")
        screen = tmux.wait_for(lambda s: "EXIT=" in s, timeout=120)
        assert "EXIT=130" in screen and "terminate called" not in screen, screen
        assert "ds4-eval: 0/3 passed" in screen
        assert "Traceback" not in err.read_text()
        tmux.kill()


def test_error_reason_outlives_the_tui(tmp_path, tmux):
    """An ERROR case in the TUI: after the screen closes the report still says why."""
    cases = load_cases("core")[:2]
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"default": "</think>Answer: B", "error": {cases[1]["id"]: "connection refused"}}))
    tmux.start(
        f"cd {REPO} && {sys.executable} -m ds4mlx.cli eval --backend fake --fake-script {script} "
        f"--questions 2 --pause-ms 1; echo EXIT=$?; sleep 300"
    )
    screen = tmux.wait_for(lambda s: "EXIT=" in s)
    assert "EXIT=1" in screen
    rows = {int(line[:3]): line for line in screen.splitlines() if line[:3].strip().isdigit()}
    assert rows[2].split()[1] == "ERROR"
    assert f"  2 ERROR SuperGPQA/{cases[1]['id']}: decode failed: connection refused" in screen

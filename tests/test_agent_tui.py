"""The agent's terminal UI driven in tmux (send-keys, capture-pane): the status
bar, a tool card, an approval prompt, Ctrl+C stopping a running bash job, a
Markdown answer, /save and /list, and a clean terminal after leaving."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
HERE = Path(__file__).parent


def tmux(socket: str, *args) -> str:
    return subprocess.run(["tmux", "-L", socket, *args], check=True, capture_output=True, text=True).stdout


class Pane:
    # each pane on its own tmux server, named after it (-L): starting a session on a shared
    # server while the previous test's kill-session shuts that server down races the shutdown
    def __init__(self, name: str):
        self.name = name

    def text(self) -> str:
        return tmux(self.name, "capture-pane", "-p", "-t", self.name)

    def wait_for(self, needle: str, timeout: float = 90.0) -> str:
        """Poll the pane until `needle` shows (waiting for output, not timing it)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            screen = self.text()
            if needle in screen:
                return screen
            time.sleep(0.1)
        raise AssertionError(f"{needle!r} never appeared; screen:\n{self.text()}")

    def send(self, *keys: str) -> None:
        tmux(self.name, "send-keys", "-t", self.name, *keys)


@pytest.fixture
def pane(tmp_path):
    (tmp_path / "a.txt").write_text("hi\n")
    name = f"ds4mlx-agent-{uuid.uuid4().hex[:8]}"
    env = f"PYTHONPATH={os.environ.get('PYTHONPATH', HERE.parent)}"
    cmd = (
        f"env {env} {sys.executable} {HERE / 'agent_tui_app.py'} {tmp_path} {tmp_path / 'sessions'}; echo EXITED rc=$?; "
        "stty -a | tr ' ;' '\\n\\n' | grep -x -e echo -e icanon -e -echo -e -icanon | sort | tr '\\n' ' '; "
        "echo; sleep 120"
    )
    tmux(name, "-f", "/dev/null", "new-session", "-d", "-s", name, "-x", "110", "-y", "40", "bash", "--norc", "-c", cmd)
    try:
        yield Pane(name)
    finally:
        subprocess.run(["tmux", "-L", name, "kill-server"], capture_output=True)


def test_tui_status_bar_card_approval_stop_answer_and_clean_exit(pane, tmp_path):
    pane.wait_for("ds4mlx agent in")
    screen = pane.wait_for("ctx 0/4096")  # the status bar
    assert "gen 0 0.0 t/s | idle" in screen
    pane.send("run the slow job", "Enter")
    pane.wait_for("allow bash?")
    screen = pane.wait_for("APPROVAL: y/N")
    assert "$ sleep 60" in screen and "APPROVAL: y/N" in screen and "allow? [y/N] >" in screen
    pane.send("y", "Enter")
    screen = pane.wait_for("[running]")
    assert "bash $ sleep 60" in screen and "DSML" not in screen
    pane.send("C-c")
    screen = pane.wait_for("[stopped]")
    assert "job 1 stopped" in screen
    pane.wait_for("turn stopped")
    pane.send("hello", "Enter")
    screen = pane.wait_for("the project has")
    assert "Hello there, the project has a.txt." in screen  # Markdown rendered, no ** or backticks
    screen = pane.wait_for("gen ")  # the status bar is redrawn after the answer (not in the same frame)
    assert "t/s" in screen
    pane.send("/save demo", "Enter")
    pane.wait_for("demo.json")
    pane.send("/list", "Enter")
    screen = pane.wait_for("messages")
    assert "demo  " in screen and (tmp_path / "sessions" / "demo.json").exists()
    pane.send("C-d")
    pane.wait_for("EXITED rc=0")
    screen = pane.wait_for("icanon")
    tail = screen[screen.index("EXITED rc=0") :]
    assert "echo icanon" in tail and "-echo" not in tail and "-icanon" not in tail  # the terminal is restored

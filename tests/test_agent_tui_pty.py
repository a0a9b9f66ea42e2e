"""A multi-turn task in the agent's terminal UI under a pseudo-terminal (pexpect):
a write approved with `y`, a read of it in the next turn, then ds4-agent's runtime
commands (/status, /hints, /save, /list with ids, /strip, /del refused for the open
session, /new, /del, /think through ds4's thinking flags) and a clean exit on Ctrl+D."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

pexpect = pytest.importorskip("pexpect")
HERE = Path(__file__).parent
pytestmark = pytest.mark.serial  # a pty's prompt timing wants the machine to itself (CI runs it alone)


@pytest.fixture
def tui(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.environ.get("PYTHONPATH", str(HERE.parent)), TERM="xterm", COLUMNS="120")
    child = pexpect.spawn(
        sys.executable,
        [str(HERE / "agent_tui_app.py"), str(tmp_path), str(tmp_path / "sessions")],
        env=env,
        encoding="utf-8",
        dimensions=(40, 120),
        timeout=90,
    )
    try:
        yield child
    finally:
        if child.isalive():
            child.terminate(force=True)


def test_tui_multi_turn_task_and_runtime_commands(tui, tmp_path):
    tui.expect("Ctrl\\+D to leave")
    tui.sendline("write hello please")
    tui.expect("allow\\? \\[y/N\\]")  # the approval question of the write
    tui.sendline("y")
    tui.expect("Wrote")
    assert (tmp_path / "hello.txt").read_text() == "hello from the agent\n"
    tui.sendline("now read it back")
    tui.expect("It says: hello from the agent.")
    tui.sendline("/status")
    tui.expect("conversation: 9 messages")
    tui.expect("hints: off")
    tui.sendline("/hints on")
    tui.expect("hints on")
    tui.sendline("/save first")
    tui.expect("session saved to")
    tui.sendline("/list")
    tui.expect(r"([0-9a-f]{8})  first  ")
    sid = tui.match.group(1)
    tui.sendline(f"/strip {sid}")
    tui.expect(f"stripped session {sid} \\(0 KV checkpoints")  # no disk KV cache in this app
    tui.sendline(f"/del {sid}")
    tui.expect("that session is open")
    tui.sendline("/new")
    tui.expect("new conversation")
    tui.sendline("/del first")
    tui.expect(f"deleted session {sid}")
    assert not (tmp_path / "sessions" / "first.json").exists()
    tui.sendline("/think 40")
    tui.expect("think: --think-level requires a DeepSeek V4.1 model")
    tui.sendline("/think max")
    tui.expect("warning: /think max needs --ctx >= ")  # ds4's downgrade at a small context
    tui.sendline("/bogus")
    tui.expect(re.escape("unknown command /bogus (/help)"))
    tui.sendcontrol("d")
    tui.expect(pexpect.EOF)
    tui.close()
    assert tui.exitstatus == 0

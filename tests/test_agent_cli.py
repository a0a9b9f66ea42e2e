"""`ds4mlx agent` from the command line: `-p` with a session file on the
scripted model (argument parsing, the plain front end, the session written
and reopened), and the demo model end to end."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
from agent_helpers import ScriptedModel, dsml, steps

from ds4mlx.agent import cli, sessions
from ds4mlx.agent.plain import run_prompt


@pytest.fixture(scope="module")
def tok():
    from ds4mlx.runtime.tokenizer import Tokenizer

    return Tokenizer.default()


def parse(*argv):
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return p.parse_args(list(argv))


def test_prompt_mode_runs_the_task_and_saves_the_session(tok, tmp_path, capsys):
    (tmp_path / "a.txt").write_text("hi\n")
    script = steps(dsml("list", path="."), dsml("bash", command="echo made > b.txt"), "Listed **a.txt**, made b.txt.")
    sess = tmp_path / "s.json"
    args = parse("-p", "list the files", "--yes", "--cwd", str(tmp_path), "--ctx", "4096", "--session", str(sess))
    engine, worker = cli.build(args, ScriptedModel(tok, script), tok)
    worker.session_path = str(sess)
    try:
        assert run_prompt(worker, args.prompt, args.session) == 0
    finally:
        worker.close()
        engine.close()
    out, err = capsys.readouterr()
    assert out == "Listed **a.txt**, made b.txt.\n"  # not a terminal: the answer as written
    assert "list path=." in err and "bash $ echo made > b.txt" in err and "turn answered" in err
    assert (tmp_path / "b.txt").read_text() == "made\n"
    data = sessions.load(str(sess))
    assert [m.role for m in data["messages"]] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
        "tool",
        "assistant",
    ]
    assert data["cwd"] == str(tmp_path.resolve())


def test_demo_model_lists_the_files_end_to_end_with_streamed_experts(tmp_path):
    """The 64 GB Mac command line: routed experts streamed from the file behind a 2-expert cache."""
    (tmp_path / "a.txt").write_text("hi\n")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent.parent))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "ds4mlx.cli",
            "agent",
            "--stream-experts",
            "--expert-cache-count",
            "2",
            "-p",
            "list the files",
            "--yes",
            "--cwd",
            str(tmp_path),
            "-n",
            "16",  # short gibberish replies: the loop, not their length, is what runs end to end
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "RANDOM weights" in r.stderr and "turn " in r.stderr  # the turn ended, whatever the gibberish did
    assert "budget 2 experts" in r.stderr  # the engine streamed its experts ...
    assert "ds4mlx: expert cache:" in r.stderr and "misses" in r.stderr  # ... and reported the cache at exit
    assert (tmp_path / "a.txt").read_text() == "hi\n"

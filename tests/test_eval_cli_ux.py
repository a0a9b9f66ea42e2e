"""What a new user sees around a run: the demo model's random weights, a loading
notice, Ctrl-C during the load, what --help promises."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from signal_helpers import ctrl_c_default

from ds4mlx.eval.cli import _loading_notice, add_arguments

REPO = Path(__file__).resolve().parent.parent


class _Backend:
    def __init__(self, name):
        self.name = name


def test_demo_model_warns_about_random_weights(capsys):
    _loading_notice(argparse.Namespace(model=None, endpoint=None), _Backend("mlx"))
    err = capsys.readouterr().err
    assert "demo model, which has RANDOM weights" in err and "ds4-eval: loading the demo model ..." in err
    _loading_notice(argparse.Namespace(model="/m/flash.gguf", endpoint=None), _Backend("mlx"))
    err = capsys.readouterr().err
    assert "RANDOM" not in err and "ds4-eval: loading /m/flash.gguf ..." in err
    _loading_notice(argparse.Namespace(model=None, endpoint="http://h:1"), _Backend("endpoint"))
    assert capsys.readouterr().err == "ds4-eval: using http://h:1\n"


def test_ctrl_c_during_the_load_exits_130_without_traceback(tmp_path):
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"open_delay": 60}))
    trace = tmp_path / "trace.txt"
    trace.write_text("# ds4-eval trace\n\nkept\n")
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ds4mlx.cli",
            "eval",
            "--backend",
            "fake",
            "--fake-script",
            str(script),
            "--plain",
            "--case-id",
            "1",
            "--trace",
            str(trace),
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=ctrl_c_default,  # SIGINT as at a terminal, however pytest was started
    )
    deadline = time.monotonic() + 30
    while "context auto-sized" not in (err := _peek(p)) and time.monotonic() < deadline:
        time.sleep(0.05)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 130
    assert "ds4-eval: interrupted while loading the model" in err and "Traceback" not in err
    assert trace.read_text() == "# ds4-eval trace\n\nkept\n"


def _peek(p) -> str:
    """stderr so far, without blocking (the child writes a line, then sleeps)."""
    import select

    buf = getattr(p, "_seen", "")
    while select.select([p.stderr], [], [], 0)[0]:
        line = p.stderr.readline()
        if not line:
            break
        buf += line
    p._seen = buf
    return buf


def test_help_states_scaled_budgets():
    parser = argparse.ArgumentParser(prog="ds4mlx eval")
    add_arguments(parser)
    text = " ".join(parser.format_help().split())
    assert "default 1024; below --tokens 2048 it is half the budget" in text
    assert "default 512; below --tokens 2048 it is a quarter of the budget" in text
    assert "--report FILE.json" in text and "--baseline FILE.json" in text and "--max-drop N" in text


def test_mtp_timing_is_refused_by_eval_in_one_line(capsys):
    from ds4mlx.eval.cli import run

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert run(p.parse_args(["--mtp-timing"])) == 2
    err = capsys.readouterr().err
    assert "--mtp-timing is not measured by eval" in err and err.count("\n") == 1

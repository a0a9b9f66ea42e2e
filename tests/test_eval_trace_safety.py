"""No operation of `ds4mlx eval` loses a completed trace record: a model that fails
to load, a narrower `--retry-incomplete` selection, a torn last record, and SIGKILL
at random points of a run (then `--retry-incomplete` finishes it)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from ds4mlx.cli.commands import main
from ds4mlx.eval import load_cases
from ds4mlx.eval.trace import TraceRecord, completed_records, format_record, parse_trace

REPO = Path(__file__).resolve().parent.parent
CORE = load_cases("core")


def _rec(i, case, status, output):
    return TraceRecord(
        i,
        14,
        case["source"],
        case["id"],
        case["domain"],
        case["title"],
        status,
        "B" if status in ("PASSED", "FAILED") else "?",
        case["answer"],
        output=output,
    )


def _trace_with(tmp_path, n_done=14, extra=()):
    text = (
        "# ds4-eval trace\nmodel: x\n\n"
        + "".join(
            format_record(_rec(i + 1, c, "PASSED" if c["answer"] == "B" else "FAILED", f"</think>Answer: B {i}"), c)
            for i, c in enumerate(CORE[:n_done])
        )
        + "".join(extra)
    )
    p = tmp_path / "trace.txt"
    p.write_text(text)
    return p, text


def _script(tmp_path, script):
    p = tmp_path / "script.json"
    p.write_text(json.dumps(script))
    return str(p)


def test_retry_with_a_model_that_fails_to_load_keeps_the_trace(tmp_path, capsys):
    trace, before = _trace_with(tmp_path)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"junk")
    for extra in (["--retry-incomplete"], []):  # retry, and a fresh run over an old trace
        rc = main(["eval", "--plain", "-m", str(bad), "--questions", "20", "--trace", str(trace), *extra])
        err = capsys.readouterr().err
        assert rc == 2 and f"{bad}: not a GGUF file" in err  # a broken model file: one line, exit 2
        assert trace.read_text() == before


def test_retry_with_a_narrower_selection_keeps_the_other_records(tmp_path, capsys):
    stopped = format_record(_rec(15, CORE[14], "STOPPED", "half"), CORE[14])
    trace, before = _trace_with(tmp_path, extra=[stopped])
    script = _script(tmp_path, {"default": "</think>Answer: B"})
    rc = main(
        [
            "eval",
            "--backend",
            "fake",
            "--fake-script",
            script,
            "--plain",
            "--questions",
            "3",
            "--trace",
            str(trace),
            "--retry-incomplete",
            "--tokens",
            "16",
        ]
    )
    capsys.readouterr()
    assert trace.read_text().startswith(before)  # never rewritten, only appended to
    done = completed_records(parse_trace(trace.read_bytes()))
    assert len(done) == 14 and rc in (0, 1)
    # a later retry over everything reruns only the stopped case
    rc = main(
        [
            "eval",
            "--backend",
            "fake",
            "--fake-script",
            script,
            "--plain",
            "--questions",
            "15",
            "--trace",
            str(trace),
            "--retry-incomplete",
            "--tokens",
            "16",
        ]
    )
    out = capsys.readouterr().out
    assert "[15/15]" in out and "[1/15]" not in out
    done = completed_records(parse_trace(trace.read_bytes()))
    assert len(done) == 15 and done[(CORE[14]["source"], CORE[14]["id"])].status in ("PASSED", "FAILED")


def test_torn_last_record_is_rerun_and_the_rest_kept(tmp_path, capsys):
    whole = format_record(_rec(2, CORE[1], "PASSED", "</think>Answer: C"), CORE[1])
    torn = whole[: whole.index("MODEL_OUTPUT_BEGIN") + 30]  # killed while writing the output block
    trace, before = _trace_with(tmp_path, n_done=1, extra=[torn])
    script = _script(tmp_path, {"default": "</think>Answer: C"})
    rc = main(
        [
            "eval",
            "--backend",
            "fake",
            "--fake-script",
            script,
            "--plain",
            "--questions",
            "2",
            "--trace",
            str(trace),
            "--retry-incomplete",
            "--tokens",
            "16",
        ]
    )
    out = capsys.readouterr().out
    assert "[2/2]" in out and "[1/2]" not in out and rc == 0
    recs = parse_trace(trace.read_bytes())
    assert trace.read_text().startswith(before)
    assert [(r.id, r.status, r.output_ok) for r in recs] == [
        (CORE[0]["id"], "PASSED", True),
        (CORE[1]["id"], "PASSED", False),
        (CORE[1]["id"], "PASSED", True),
    ]
    assert main(["eval", "--regrade", str(trace)]) == 0  # the torn record is superseded, not a parse error
    assert (
        capsys.readouterr()
        .out.strip()
        .endswith("passed=2 failed=0 not_graded=0 changed=0 unknown=0 parse_errors=0 superseded=1")
    )


def _completed(trace: Path) -> dict:
    if not trace.exists():
        return {}
    return {k: (r.status, r.output) for k, r in completed_records(parse_trace(trace.read_bytes())).items()}


def test_sigkill_at_random_points_then_retry_completes(tmp_path, capsys):
    n = 20
    script = _script(
        tmp_path,
        {
            "cases": {
                c["id"]: f"thinking about case {i} " * 3 + f"</think>Answer: {'BC'[i % 2]}"
                for i, c in enumerate(CORE[:n])
            },
            "delay": 0.01,
        },
    )
    trace = tmp_path / "trace.txt"
    cmd = [
        sys.executable,
        "-m",
        "ds4mlx.cli",
        "eval",
        "--backend",
        "fake",
        "--fake-script",
        script,
        "--plain",
        "--questions",
        str(n),
        "--tokens",
        "40",
        "--trace",
        str(trace),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    rng = random.Random(18)
    seen: dict = {}
    progress: list[int] = []
    for k in range(20):
        extra = ["--retry-incomplete"] if k else []
        size0 = trace.stat().st_size if trace.exists() else -1
        p = subprocess.Popen(cmd + extra, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if rng.random() < 0.2:  # during start-up, before the trace is touched
            time.sleep(rng.uniform(0.0, 0.1))
        else:  # once the run has written its header: somewhere in the cases
            deadline = time.monotonic() + 30
            while (trace.stat().st_size if trace.exists() else -1) == size0 and time.monotonic() < deadline:
                time.sleep(0.005)
            time.sleep(rng.uniform(0.0, 0.25))
        p.send_signal(signal.SIGKILL)
        p.wait()
        now = _completed(trace)
        assert all(now.get(key) == val for key, val in seen.items()), f"kill {k} lost a completed record"
        seen = now
        progress.append(len(now))
    done = subprocess.run(cmd + ["--retry-incomplete"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode in (0, 1), done.stderr
    final = _completed(trace)
    assert all(final[key] == val for key, val in seen.items())
    assert sorted(final) == sorted((c["source"], c["id"]) for c in CORE[:n])
    for i, c in enumerate(CORE[:n]):
        assert final[(c["source"], c["id"])][1].endswith(f"</think>Answer: {'BC'[i % 2]}")
    recs = parse_trace(trace.read_bytes())
    graded = [(r.source, r.id) for r in recs if r.output_ok and r.status in ("PASSED", "FAILED")]
    assert len(graded) == n  # no completed case was run twice
    assert progress[-1] < n and max(progress) > 0  # the kills landed before the end and after some records
    assert main(["eval", "--regrade", str(trace)]) in (0, 1)
    assert "parse_errors=0" in capsys.readouterr().out  # a torn record was always run again


def test_fresh_run_keeps_the_trace_it_replaces(tmp_path, capsys):
    trace, before = _trace_with(tmp_path)
    script = _script(tmp_path, {"default": "</think>Answer: B"})
    rc = main(
        [
            "eval",
            "--backend",
            "fake",
            "--fake-script",
            script,
            "--plain",
            "--questions",
            "2",
            "--trace",
            str(trace),
            "--tokens",
            "16",
        ]
    )
    capsys.readouterr()
    assert rc in (0, 1)
    assert (tmp_path / "trace.txt.prev").read_text() == before
    assert len(parse_trace(trace.read_bytes())) == 2

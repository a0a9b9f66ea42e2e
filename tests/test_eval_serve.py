"""`ds4mlx eval --endpoint` against the real `ds4mlx serve` (demo model) on 127.0.0.1:
the whole path — eval prompts, OpenAI SSE from our server, trace, report."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from scripted_model import serve  # noqa: E402

from ds4mlx.cli.commands import main  # noqa: E402
from ds4mlx.eval.trace import parse_trace  # noqa: E402


@pytest.fixture(scope="module")
def demo_server(shared_demo):
    model, tok = shared_demo()
    with serve(tok, model, ctx=4096) as s:
        yield s


def test_eval_endpoint_against_ds4mlx_serve(demo_server, tmp_path, capsys):
    trace = tmp_path / "trace.txt"
    rc = main(
        [
            "eval",
            "--endpoint",
            demo_server.url,
            "--plain",
            "--case-id",
            "1",
            "--case-id",
            "2",
            "--tokens",
            "24",
            "--trace",
            str(trace),
            "--seed",
            "5",
        ]
    )
    out, err = capsys.readouterr()
    recs = parse_trace(trace.read_bytes())
    assert len(recs) == 2
    # random weights: the answers are wrong or missing, but every case ran to a graded end
    assert all(r.status in ("PASSED", "FAILED") for r in recs), [r.status for r in recs]
    assert rc == (1 if any(r.status == "FAILED" for r in recs) else 0), out + err  # ds4-eval: 1 when a case failed
    for r in recs:
        assert r.int_field("prompt_tokens") > 100  # the eval prompt, tokenized by the server
        assert 0 < r.int_field("generated_tokens") <= 24
    assert "context sized by the server" in err and "GPQA Diamond" in out and "SuperGPQA" in out


def test_hard_smoke_report_and_better_baseline_against_ds4mlx_serve(demo_server, tmp_path, capsys):
    """The issue's acceptance run (short budget: random weights, 2 CPU cores): a valid
    report, and a crafted better baseline makes the run exit 1."""
    import json

    from ds4mlx.eval import load_cases

    cases = load_cases("hard-smoke")
    better = {
        "format": "ds4mlx-eval-report/1",
        "totals": {"passed": len(cases)},
        "cases": [{"source": c["source"], "id": c["id"], "status": "PASSED"} for c in cases],
    }
    (tmp_path / "better.json").write_text(json.dumps(better))
    report = tmp_path / "r.json"
    rc = main(
        [
            "eval",
            "--endpoint",
            demo_server.url,
            "--suite",
            "hard-smoke",
            "--plain",
            "--tokens",
            "4",
            "--seed",
            "3",
            "--report",
            str(report),
            "--baseline",
            str(tmp_path / "better.json"),
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 1, out + err
    r = json.loads(report.read_text())
    assert r["complete"] and r["suite"] == "hard-smoke" and r["backend"] == "endpoint"
    assert [(c["source"], c["id"]) for c in r["cases"]] == [(c["source"], c["id"]) for c in cases]
    assert all(
        c["status"] in ("PASSED", "FAILED") and 0 < c["tokens"] <= 4 and c["prompt_tokens"] > 50 for c in r["cases"]
    )
    t = r["totals"]
    assert t["passed"] + t["failed"] == t["total"] == len(cases) and t["errors"] == 0
    assert sum(s["total"] for s in r["sources"].values()) == len(cases)
    assert f"ds4-eval: baseline {len(cases)} passed, this run {t['passed']}: drop" in out and "dropped" in out

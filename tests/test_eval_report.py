"""`--report FILE.json`, `--baseline FILE.json --max-drop N` and the exit codes CI
relies on, on the scripted fake backend."""

from __future__ import annotations

import json

from ds4mlx.cli.commands import main
from ds4mlx.eval import load_cases

CORE = load_cases("core")
C1, C2, C3 = CORE[0], CORE[1], CORE[2]  # GPQA (B), SuperGPQA (C), AIME (70)


def _script(tmp_path, script):
    p = tmp_path / "script.json"
    p.write_text(json.dumps(script))
    return str(p)


def _eval(capsys, *argv):
    rc = main(["eval", "--backend", "fake", "--plain", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _three(tmp_path, capsys, *extra, answers=("B", "C", "71")):
    outputs = {c["id"]: f"hm hm.</think>\nAnswer: {a}" for c, a in zip((C1, C2, C3), answers)}
    script = _script(tmp_path, {"cases": outputs})
    return _eval(capsys, "--fake-script", script, "--questions", "3", "--tokens", "32", *extra)


def test_report_json_per_case_totals_and_sources(tmp_path, capsys):
    path = tmp_path / "r.json"
    rc, out, _ = _three(tmp_path, capsys, "--report", str(path))
    assert rc == 1  # ds4-eval: a failed case
    r = json.loads(path.read_text())
    assert r["format"] == "ds4mlx-eval-report/1" and r["suite"] == "core" and r["complete"] is True
    assert [(c["id"], c["source"], c["status"], c["expected"], c["extracted"]) for c in r["cases"]] == [
        (C1["id"], "GPQA Diamond", "PASSED", "B", "B"),
        (C2["id"], "SuperGPQA", "PASSED", "C", "C"),
        (C3["id"], "AIME2025", "FAILED", "70", "71"),
    ]
    for c, case in zip(r["cases"], (C1, C2, C3)):
        assert c["suite"] == "core" and c["domain"] == case["domain"]
        assert c["tokens"] == 5 and c["seconds"] >= 0 and c["tps"] >= 0 and c["prompt_tokens"] > 0
    t = r["totals"]
    assert (t["passed"], t["failed"], t["errors"], t["skipped"], t["total"], t["tokens"]) == (2, 1, 0, 0, 3, 15)
    assert r["sources"]["AIME2025"]["failed"] == 1 and r["sources"]["GPQA Diamond"]["passed"] == 1
    # the plain summary states time and t/s
    head = next(x for x in out.splitlines() if x.startswith("ds4-eval: 2/3 passed"))
    assert "15 tokens generated in" in head and head.endswith(" t/s)")


def test_baseline_gate(tmp_path, capsys):
    base = tmp_path / "base.json"
    _three(tmp_path, capsys, "--report", str(base))  # 2 passed
    rc, out, _ = _three(tmp_path, capsys, "--baseline", str(base))
    assert rc == 0 and "ds4-eval: baseline 2 passed, this run 2: drop 0 (max 0) ok" in out  # failed case, same count
    better = json.loads(base.read_text())
    better["totals"]["passed"] = 3
    better["cases"][2]["status"] = "PASSED"
    (tmp_path / "better.json").write_text(json.dumps(better))
    rc, out, _ = _three(tmp_path, capsys, "--baseline", str(tmp_path / "better.json"))
    assert rc == 1
    assert f"ds4-eval: regression AIME2025/{C3['id']}: baseline PASSED, now FAILED (extracted 71, expected 70)" in out
    assert "drop 1 (max 0) dropped" in out
    rc, out, _ = _three(tmp_path, capsys, "--baseline", str(tmp_path / "better.json"), "--max-drop", "1")
    assert rc == 0
    # worse run: two drops
    rc, out, _ = _three(tmp_path, capsys, "--baseline", str(base), "--max-drop", "1", answers=("A", "A", "71"))
    assert rc == 1 and "ds4-eval: baseline 2 passed, this run 0: drop 2 (max 1) dropped" in out


def test_baseline_harness_errors_exit_2(tmp_path, capsys):
    base = tmp_path / "base.json"
    _three(tmp_path, capsys, "--report", str(base))
    script = _script(tmp_path, {"default": "</think>Answer: B", "error": {C2["id"]: "boom"}})
    rc, out, _ = _eval(capsys, "--fake-script", script, "--questions", "3", "--tokens", "16", "--baseline", str(base))
    assert rc == 2 and "baseline not compared: the run has 1 error(s)" in out
    rc, _, err = _eval(capsys, "--fake-script", script, "--questions", "1", "--baseline", str(tmp_path / "nope.json"))
    assert rc == 2 and "cannot read baseline" in err
    (tmp_path / "junk.json").write_text("{}")
    rc, _, err = _eval(capsys, "--fake-script", script, "--questions", "1", "--baseline", str(tmp_path / "junk.json"))
    assert rc == 2 and "not a ds4-eval report" in err
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"junk")
    rc = main(["eval", "--plain", "-m", str(bad), "--questions", "1", "--baseline", str(base)])
    assert rc == 2 and f"{bad}: not a GGUF file" in capsys.readouterr().err
    rc, _, err = _eval(capsys, "--questions", "1", "--max-drop", "2")
    assert rc == 2 and "--max-drop needs --baseline" in err


def test_everything_skipped_is_not_success(tmp_path, capsys):
    path = tmp_path / "r.json"
    rc, out, err = _eval(capsys, "--questions", "2", "--tokens", "8", "--ctx", "20", "--report", str(path))
    assert rc == 2 and "ds4-eval: no case was graded (2 skipped)" in err
    assert json.loads(path.read_text())["totals"]["skipped"] == 2


def test_long_answers_keep_the_report_columns(tmp_path, capsys):
    hard = load_cases("hard")
    long_case = next(c for c in hard if len(c["answer"]) > 8)
    script = _script(tmp_path, {"default": "</think>Answer: " + "x" * 40})
    rc, out, _ = _eval(
        capsys,
        "--suite",
        "hard",
        "--fake-script",
        script,
        "--case-id",
        long_case["id"],
        "--case-id",
        hard[0]["id"],
        "--tokens",
        "16",
    )
    rows = [x for x in out.splitlines() if x[:3].strip().isdigit()]
    assert len(rows) == 2
    starts = {
        row.index(c["source"] + "/") for row, c in zip(rows, sorted([long_case, hard[0]], key=lambda c: c["index"]))
    }
    assert len(starts) == 1  # the test column starts at the same place on every row
    assert "~" in out

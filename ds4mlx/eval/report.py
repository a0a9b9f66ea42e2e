"""The machine-readable report (`--report FILE.json`) and the CI gate
(`--baseline FILE.json --max-drop N`).

The report is one JSON object: `format`, `suite`, `model`, `backend`, `complete`,
`cases` (per case: index, id, suite, source, domain, status, expected, extracted,
prompt_tokens, tokens, seconds, tps, error), `totals` and `sources` (the same counts
per source).  A baseline is a report of an earlier run; the gate compares pass counts.
"""

from __future__ import annotations

import json
from typing import Any

from ..io.atomic_file import atomic_write

REPORT_FORMAT = "ds4mlx-eval-report/1"
GATE_OK, GATE_DROPPED, GATE_HARNESS_ERROR = 0, 1, 2
FINISHED = ("PASSED", "FAILED", "SKIPPED")


def _tps(tokens: int, seconds: float) -> float:
    return round(tokens / seconds, 3) if seconds > 0 and tokens else 0.0


def _counts(statuses: list[str]) -> dict[str, int]:
    return {
        "passed": statuses.count("PASSED"),
        "failed": statuses.count("FAILED"),
        "errors": statuses.count("ERROR"),
        "skipped": statuses.count("SKIPPED"),
        "other": sum(s not in ("PASSED", "FAILED", "ERROR", "SKIPPED") for s in statuses),
        "total": len(statuses),
    }


def build_report(runner: Any) -> dict[str, Any]:
    """The report of a runner after (or during) its run."""
    cases = []
    for cr in runner.runs:
        c = cr.case
        graded = cr.status in ("PASSED", "FAILED")
        ran = cr.status != "PENDING"
        cases.append(
            {
                "index": cr.pos + 1,
                "id": c["id"],
                "suite": runner.opts.suite,
                "source": c["source"],
                "domain": c["domain"],
                "status": cr.status,
                "expected": c["answer"],
                "extracted": (cr.picked or None) if graded else None,
                "prompt_tokens": cr.prompt_tokens if ran else 0,
                "tokens": cr.generated if ran else 0,
                "seconds": round(cr.elapsed, 3) if ran else 0.0,
                "tps": _tps(cr.generated, cr.elapsed) if ran else 0.0,
                "error": cr.error or None,
                "carried_over": cr.carried is not None,
            }
        )
    tokens = sum(x["tokens"] for x in cases)
    seconds = sum(cr.elapsed for cr in runner.runs if cr.status != "PENDING")
    totals = {
        **_counts([x["status"] for x in cases]),
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tps": _tps(tokens, seconds),
        "runtime_seconds": round(runner.runtime, 3),
    }
    sources: dict[str, list[dict[str, Any]]] = {}
    for x in cases:
        sources.setdefault(x["source"], []).append(x)
    return {
        "format": REPORT_FORMAT,
        "suite": runner.opts.suite,
        "model": runner.backend.model,
        "backend": runner.backend.name,
        "seed": runner.opts.seed,
        "complete": all(x["status"] in FINISHED for x in cases),
        "cases": cases,
        "totals": totals,
        "sources": {
            src: {
                **_counts([x["status"] for x in group]),
                "tokens": sum(x["tokens"] for x in group),
                "seconds": round(sum(x["seconds"] for x in group), 3),
            }
            for src, group in sources.items()
        },
    }


def write_json_atomic(path: str, data: Any) -> None:
    with atomic_write(path, "w", temp_prefix=".ds4-eval-report-", fsync=True, permissions=0o644, encoding="utf-8") as f:
        json.dump(data, f, indent=1, ensure_ascii=False)
        f.write("\n")


def read_baseline(path: str) -> tuple[dict[str, Any] | None, str]:
    """(report, "") or (None, why)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        return None, f"cannot read baseline '{path}': {e.strerror}"
    except ValueError as e:
        return None, f"baseline '{path}' is not JSON: {e}"
    if (
        not isinstance(data, dict)
        or not isinstance(data.get("totals"), dict)
        or not isinstance(data["totals"].get("passed"), int)
    ):
        return None, f"baseline '{path}' is not a ds4-eval report (no totals.passed)"
    return data, ""


def gate(report: dict[str, Any], baseline: dict[str, Any], max_drop: int) -> tuple[int, list[str]]:
    """Exit code and the lines that explain it: 2 when the run is not a complete,
    error-free run, 1 when passes dropped by more than `max_drop`, else 0."""
    t, b = report["totals"], baseline["totals"]
    lines = []
    if t["errors"] or not report["complete"]:
        lines.append(
            f"ds4-eval: baseline not compared: the run has {t['errors']} error(s) and {t['other']} unfinished case(s)"
        )
        return GATE_HARNESS_ERROR, lines
    if t["passed"] + t["failed"] == 0:
        lines.append("ds4-eval: baseline not compared: no case was graded")
        return GATE_HARNESS_ERROR, lines
    drop = b["passed"] - t["passed"]
    was = {(c.get("source"), c.get("id")): c.get("status") for c in baseline.get("cases") or [] if isinstance(c, dict)}
    for c in report["cases"]:
        if was.get((c["source"], c["id"])) == "PASSED" and c["status"] != "PASSED":
            lines.append(
                f"ds4-eval: regression {c['source']}/{c['id']}: baseline PASSED, now {c['status']} "
                f"(extracted {c['extracted'] or '?'}, expected {c['expected']})"
            )
    verdict = "dropped" if drop > max_drop else "ok"
    lines.append(
        f"ds4-eval: baseline {b['passed']} passed, this run {t['passed']}: "
        f"drop {max(0, drop)} (max {max_drop}) {verdict}"
    )
    return (GATE_DROPPED if drop > max_drop else GATE_OK), lines

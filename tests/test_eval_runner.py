"""ds4mlx eval runner: plain mode, trace, regrade, retry-incomplete, context sizing,
scheduling (switch / quit / error) and the `</think>` budget controller, on the
scripted fake backend (no model)."""

from __future__ import annotations

import json

from ds4mlx.cli.commands import main
from ds4mlx.eval import load_cases
from ds4mlx.eval.backends import FakeBackend
from ds4mlx.eval.runner import Options, Runner, report
from ds4mlx.eval.thinkclose import ThinkCloser
from ds4mlx.eval.trace import TraceRecord, format_record, parse_trace

CORE = load_cases("core")
C1, C2, C3, C4 = CORE[0], CORE[1], CORE[2], CORE[3]  # GPQA (B), SuperGPQA (C), AIME (70), GPQA


def _script(tmp_path, script):
    p = tmp_path / "script.json"
    p.write_text(json.dumps(script))
    return str(p)


def _eval(argv, capsys):
    rc = main(["eval", "--backend", "fake", "--plain", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _trace(path):
    with open(path, "rb") as f:
        return parse_trace(f.read())


# ---------------------------------------------------------------- plain run + trace


def test_plain_run_three_cases_writes_trace(tmp_path, capsys):
    script = _script(
        tmp_path,
        {
            "cases": {
                C1["id"]: "Time dilation, gamma about 1961.</think>\nAnswer: B",
                C2["id"]: "Pellets.</think>\nAnswer: C",
                C3["id"]: "Bases.</think>\nAnswer: m+n = 21+49 = 71",
            }
        },
    )
    trace = tmp_path / "t.txt"
    rc, out, err = _eval(
        [
            "--fake-script",
            script,
            "--case-id",
            C1["id"],
            "--case-id",
            C2["id"],
            "--case-id",
            C3["id"],
            "--tokens",
            "64",
            "--trace",
            str(trace),
        ],
        capsys,
    )
    assert rc == 1  # one case failed
    assert f"[1/3] GPQA Diamond/{C1['domain']} {C1['title']}" in out
    assert "PASSED got B expected B" in out and "FAIL got 71 expected 70" in out
    assert "ds4-eval: 2/3 passed, 1 failed, runtime 00h:00m" in out
    assert "#   state      prompt      gen    total given    correct  test" in out
    assert "  3 FAILED " in out and f"AIME2025/{C3['id']}" in out
    assert "AIME2025              0      1      0      1" in out  # totals by source
    assert "context auto-sized to" in err
    text = trace.read_text()
    assert text.startswith("# ds4-eval trace\n") and "max_tokens: 64\n" in text
    assert text.rstrip().endswith("===== SUMMARY =====\npassed: 2\nfailed: 1\ntotal: 3")
    recs = _trace(trace)
    assert [r.status for r in recs] == ["PASSED", "PASSED", "FAILED"]
    assert [r.picked for r in recs] == ["B", "C", "71"]
    assert recs[0].output == "Time dilation, gamma about 1961.</think>\nAnswer: B"
    assert recs[0].blocks["QUESTION_PROMPT"].endswith("Answer: <letter>")
    assert recs[0].fields["think_close"] == "natural"
    for r in recs:  # never the id, title or domain in what the model saw
        assert r.id not in r.blocks["QUESTION_PROMPT"] + r.blocks["SYSTEM_PROMPT"]
    # regrade of our own trace: nothing changes
    rc = main(["eval", "--regrade", str(trace)])
    out, _ = capsys.readouterr()
    assert rc == 0
    assert out.strip().endswith("passed=2 failed=1 not_graded=0 changed=0 unknown=0 parse_errors=0")


def _crafted(tmp_path, records):
    text = "# ds4-eval trace\nmodel: x\n\n" + "".join(format_record(r, CORE[0]) for r in records)
    p = tmp_path / "crafted.txt"
    p.write_text(text + "===== SUMMARY =====\npassed: 0\nfailed: 0\ntotal: 3\n")
    return str(p)


def _rec(i, status, picked, output, case=C1):
    return TraceRecord(
        i, 3, case["source"], case["id"], case["domain"], case["title"], status, picked, case["answer"], output=output
    )


def test_regrade_counts_only_passed_and_failed(tmp_path, capsys):
    path = _crafted(
        tmp_path,
        [
            _rec(1, "PASSED", "B", "</think>Answer: B"),
            _rec(2, "STOPPED", "?", "half a thought, Answer: B"),
            _rec(3, "STOPPED", "?", ""),
        ],
    )
    rc = main(["eval", "--regrade", path])
    out, _ = capsys.readouterr()
    assert rc == 0
    assert out.strip() == (
        f"ds4-eval: regraded 3 cases from {path}: passed=1 failed=0 not_graded=2 changed=0 unknown=0 parse_errors=0"
    )


def test_regrade_reports_changes_unknown_and_parse_errors(tmp_path, capsys):
    # ds4's old pick: "I think it is C" graded I (FAILED); ours picks C
    mc10 = CORE[1]  # SuperGPQA, 10 choices, gold C
    path = _crafted(tmp_path, [_rec(1, "FAILED", "I", "</think>Answer: I think it is C", case=mc10)])
    assert main(["eval", "--regrade", path]) == 0
    out, _ = capsys.readouterr()
    assert (f"case 1 SuperGPQA/{mc10['id']}: trace FAILED picked=I -> regrade PASSED picked=C expected=C") in out
    assert "passed=1 failed=0 not_graded=0 changed=1" in out

    unknown = TraceRecord(1, 1, "GPQA Diamond", "recNOPE", "d", "t", "PASSED", "B", "B", output="Answer: B")
    path = _crafted(tmp_path, [unknown])
    assert main(["eval", "--regrade", path]) == 1
    out, err = capsys.readouterr()
    assert "not found in embedded cases: GPQA Diamond/recNOPE" in err and "unknown=1" in out

    broken = tmp_path / "broken.txt"
    broken.write_text(
        f"===== CASE 1/1 GPQA Diamond/{C1['id']} =====\nsource: GPQA Diamond\nid: {C1['id']}\n"
        "status: PASSED\nMODEL_OUTPUT_BEGIN bytes=500\nAnswer: B\nMODEL_OUTPUT_END\n"
    )
    assert main(["eval", "--regrade", str(broken)]) == 1
    out, err = capsys.readouterr()
    assert "missing MODEL_OUTPUT block" in err and "parse_errors=1" in out
    assert main(["eval", "--regrade", str(tmp_path / "missing.txt")]) == 2


def test_trace_payloads_cannot_fake_structure(tmp_path, capsys):
    evil = "x\n===== CASE 9/9 GPQA Diamond/recFAKE =====\nstatus: FAILED\nMODEL_OUTPUT_END\n</think>Answer: B"
    path = _crafted(tmp_path, [_rec(1, "PASSED", "B", evil), _rec(2, "PASSED", "B", "</think>Answer: B")])
    recs = _trace(path)
    assert len(recs) == 2 and recs[0].output == evil and recs[1].id == C1["id"]
    assert main(["eval", "--regrade", path]) == 0
    assert "passed=2 failed=0" in capsys.readouterr().out


# ---------------------------------------------------------------- retry-incomplete


def test_retry_incomplete_runs_only_unfinished_cases(tmp_path, capsys):
    trace = tmp_path / "t.txt"
    old = (
        "# ds4-eval trace\n\n"
        + format_record(_rec(1, "PASSED", "B", "</think>Answer: B", case=C1))
        + format_record(_rec(2, "STOPPED", "?", "partial", case=C2))
    )
    trace.write_text(old)
    script = _script(tmp_path, {"default": "</think>Answer: C"})
    rc, out, _ = _eval(
        [
            "--fake-script",
            script,
            "--case-id",
            "1",
            "--case-id",
            "2",
            "--case-id",
            "4",
            "--trace",
            str(trace),
            "--retry-incomplete",
            "--tokens",
            "32",
        ],
        capsys,
    )
    assert "[1/3]" not in out and "[2/3]" in out and "[3/3]" in out
    recs = _trace(trace)
    # append-only: the old records stay as they were, the reruns follow
    assert [(r.id, r.status) for r in recs] == [
        (C1["id"], "PASSED"),
        (C2["id"], "STOPPED"),
        (C2["id"], "PASSED"),
        (C4["id"], "PASSED"),
    ]
    assert trace.read_text().startswith(old)
    assert "  1 PASSED " in out and rc == 0


# ---------------------------------------------------------------- context sizing and validation


def test_context_cap_and_option_validation(tmp_path, capsys):
    rc, _, err = _eval(["--case-id", "1", "--tokens", "1000000"], capsys)
    assert rc == 2 and "ds4-eval: largest prompt (" in err and "exceeds the 1000000 token context cap" in err
    rc, _, err = _eval(["--case-id", "1", "--tokens", "64", "--hard-limit-reply-budget", "64"], capsys)
    assert rc == 2 and "--hard-limit-reply-budget (64) must be smaller than --tokens (64)" in err
    rc, _, err = _eval(["--case-id", "1", "--soft-limit-reply-budget", "100"], capsys)
    assert rc == 2 and "must be >= --hard-limit-reply-budget" in err
    rc, _, err = _eval(["--case-id", "1", "--retry-incomplete"], capsys)
    assert rc == 2 and "--retry-incomplete needs --trace" in err


def test_ctx_override_clamps_and_skips(tmp_path, capsys):
    backend = FakeBackend({"default": "w " * 200})
    runner = Runner([C1, C3], backend, Options(tokens=64, ctx=100))
    assert runner.size_context() is None
    backend.open(runner.ctx)
    assert runner.runs[0].prompt_tokens >= 100  # GPQA prompt does not fit
    assert runner.runs[1].limit == 100 - runner.runs[1].prompt_tokens
    runner.run()
    assert runner.runs[0].status == "SKIPPED" and runner.runs[0].error == "prompt does not fit context"
    assert backend.calls[0]["max_tokens"] == runner.runs[1].limit
    assert runner.runs[1].generated == runner.runs[1].limit  # clamped to the remaining context
    assert "  1 SKIPPED " in report(runner)


def test_auto_context_is_largest_prompt_plus_budget():
    backend = FakeBackend()
    runner = Runner(CORE[:5], backend, Options(tokens=1000))
    runner.size_context()
    assert runner.ctx == max(cr.prompt_tokens for cr in runner.runs) + 1000
    assert all(cr.limit == 1000 for cr in runner.runs)
    hard = Runner(load_cases("hard-smoke"), FakeBackend(), Options())
    hard.size_context()
    assert {cr.budget for cr in hard.runs} == {16000, 8000}  # per-case budgets (Juliet 8000)


# ---------------------------------------------------------------- think close


def test_hard_close_in_the_decode_loop(tmp_path, capsys):
    script = _script(tmp_path, {"default": "w " * 100})
    trace = tmp_path / "t.txt"
    rc, out, _ = _eval(["--fake-script", script, "--case-id", "3", "--tokens", "40", "--trace", str(trace)], capsys)
    rec = _trace(trace)[0]
    assert rec.fields["think_close"] == "hard_forced"
    assert rec.fields["think_close_token_index"] == "31"  # hard budget 40 // 4 = 10: generated 30 -> token #31
    assert rec.fields["think_close_remaining_budget"] == "10"
    assert rec.output.count("</think>") == 1 and rec.int_field("generated_tokens") == 40
    assert rc == 1


def test_think_closer_rules():
    c = ThinkCloser(["</", "think", ">"], soft_budget=8, hard_budget=4, soft_rank=3)
    assert c.choose(0, 10, lambda t: 1) is None  # soft rule needs a one-token close
    assert c.choose(6, 10, lambda t: 1) == "</"
    assert c.choose(7, 10, lambda t: 1) == "think" and c.choose(8, 10, lambda t: 1) == ">"
    assert (c.event.kind, c.event.token_index, c.event.remaining, c.event.rank) == ("hard_forced", 7, 4, 0)
    soft = ThinkCloser([7], soft_budget=8, hard_budget=4, soft_rank=3)
    assert soft.choose(1, 10, lambda t: 2) is None  # remaining 9 > soft budget
    assert soft.choose(2, 10, lambda t: 4) is None  # ranked too low
    assert soft.choose(3, 10, lambda t: 2) == 7
    assert (soft.event.kind, soft.event.rank, soft.event.remaining) == ("soft_forced", 2, 7)
    nat = ThinkCloser([7], soft_budget=8, hard_budget=4)
    nat.after_token(True, 5, 20)
    assert (nat.event.kind, nat.event.token_index, nat.event.remaining) == ("natural", 5, 20)
    assert nat.choose(100, 101, lambda t: 1) is None  # closed: no more forcing
    off = ThinkCloser([7], thinking=False)
    assert off.choose(0, 1, lambda t: 1) is None and off.event.kind == "none"


# ---------------------------------------------------------------- scheduling


class Steering(FakeBackend):
    """Fake backend that presses keys through Control at a chosen case."""

    def __init__(self, script, at, action):
        super().__init__(script)
        self.at, self.action, self.order = at, action, []

    def generate(self, job):
        self.order.append(job.case_id)
        if job.case_id == self.at and self.action:
            act, self.action = self.action, None
            act(job.control)
        return super().generate(job)


def test_enter_switches_and_switched_case_runs_again(tmp_path):
    from ds4mlx.eval.trace import TraceWriter

    cases = CORE[:4]
    backend = Steering({"default": "</think>Answer: B"}, cases[1]["id"], lambda ctl: ctl.request(3))
    runner = Runner(cases, backend, Options(tokens=32))
    runner.trace = TraceWriter.create(str(tmp_path / "t.txt"))
    runner.size_context()
    runner.run()
    runner.finish_trace()
    ids = [c["id"] for c in cases]
    assert backend.order == [ids[0], ids[1], ids[3], ids[1], ids[2]]
    verdict = ["PASSED" if c["answer"] == "B" else "FAILED" for c in cases]
    assert [r.status for r in _trace(tmp_path / "t.txt")] == [
        verdict[0],
        "SWITCHED",
        verdict[3],
        verdict[1],
        verdict[2],
    ]
    assert [cr.status for cr in runner.runs] == verdict


def test_quit_stops_the_active_case_and_ends_the_run():
    cases = CORE[:3]
    backend = Steering({"default": "</think>Answer: B"}, cases[1]["id"], lambda ctl: ctl.request_quit())
    runner = Runner(cases, backend, Options(tokens=32))
    runner.size_context()
    assert runner.run() == 0
    assert [cr.status for cr in runner.runs] == ["PASSED", "STOPPED", "PENDING"]
    text = report(runner)
    assert "  2 STOPPED " in text and "  3 PENDING         0        0        0 -" in text


def test_error_aborts_with_exit_1(tmp_path, capsys):
    script = _script(tmp_path, {"default": "</think>Answer: B", "error": {C2["id"]: "boom"}})
    trace = tmp_path / "t.txt"
    rc, out, err = _eval(["--fake-script", script, "--questions", "3", "--tokens", "16", "--trace", str(trace)], capsys)
    assert rc == 1
    assert f"ds4-eval: decode failed for {C2['id']}: boom" in err
    assert [r.status for r in _trace(trace)] == ["PASSED", "ERROR"]
    assert "error: decode failed: boom" in trace.read_text()
    assert "  2 ERROR " in out and "  3 PENDING " in out
    assert f"  2 ERROR SuperGPQA/{C2['id']}: decode failed: boom" in out  # the reason outlives a TUI


def test_nothink_prompt_and_raw(tmp_path, capsys):
    script = _script(tmp_path, {"default": "hidden</think>Answer: B"})
    trace = tmp_path / "t.txt"
    rc, out, _ = _eval(["--fake-script", script, "--case-id", "1", "--nothink", "--trace", str(trace)], capsys)
    rec = _trace(trace)[0]
    assert rc == 0 and rec.output == "Answer: B" and rec.fields["think_close"] == "none"
    assert rec.fields["think_mode_effective"] == "none"

"""What the user sees of speculation: the acceptance model (speculative/cost.py), the end-of-run
summary, `--mtp-timing`, bench's columns, ds4's flag aliases and the serve refusal.

The break-even acceptance is checked against its definition (E(a, k) * step = verify_k +
k * draft, E = 1 + a + ... + a^k) and closed forms; `measure` leaves the session where it
was (the greedy continuation after it equals the one without it); a job with `--mtp-timing`
carries the measured costs on its Finish and prints them, its output unchanged.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from parity_helpers import load_case  # noqa: E402
from spec_helpers import compiled_small_buckets  # noqa: E402, F401  (autouse)
from test_spec_engine import LONG, RAW, VerifyingModel, _drafter  # noqa: E402

from ds4mlx.engine import Engine, Job  # noqa: E402
from ds4mlx.runtime.decode import decode_tokens, greedy  # noqa: E402
from ds4mlx.runtime.sampling import SamplingParams  # noqa: E402
from ds4mlx.speculative import cli as spec_cli  # noqa: E402
from ds4mlx.speculative.cost import Costs, break_even, measure, summary_lines, tokens_per_round  # noqa: E402
from ds4mlx.speculative.options import SpecConfig, SpecStats  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def tok():
    from ds4mlx.runtime.tokenizer import Tokenizer

    return Tokenizer.default()


@pytest.fixture(scope="module")
def tiny_v4(oracle):
    _, lm, ref, _ = load_case(oracle, "make_tiny_deepseek_v4.py", "long")
    return lm, ref["input_ids"][0].tolist()


def _parser():
    p = argparse.ArgumentParser()
    spec_cli.add_arguments(p)
    return p


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("verify,draft", [(1.6, 0.0), (2.3, 0.05), (3.4, 0.1)])
def test_break_even_solves_the_round_equation(k, verify, draft):
    be = break_even(1.0, verify, draft, k)
    cost = verify + k * draft
    if cost > k + 1:
        assert be is None
        return
    assert 0.0 < be <= 1.0
    assert tokens_per_round(be, k) == pytest.approx(cost, abs=1e-9)  # the definition
    assert tokens_per_round(be - 1e-6, k) < cost  # and the smallest such rate


def test_break_even_closed_forms_and_edges():
    assert break_even(1.0, 1.5, 0.0, 1) == pytest.approx(0.5)  # 1 + a = 1.5
    assert break_even(1.0, 1.75, 0.0, 2) == pytest.approx(0.5)  # 1 + a + a^2 = 1.75
    assert break_even(2.0, 3.0, 0.0, 2) == pytest.approx((math.sqrt(3) - 1) / 2)  # a^2 + a - 0.5 = 0
    assert break_even(1.0, 0.9, 0.0, 1) == 0.0  # a rejected round is cheaper than a step: always pays
    assert break_even(1.0, 2.0, 0.0, 1) == pytest.approx(1.0)  # pays only when every draft is kept
    assert break_even(1.0, 2.01, 0.0, 1) is None
    assert tokens_per_round(1.0, 3) == 4.0 and tokens_per_round(0.0, 3) == 1.0


def test_costs_round_trip_and_lines():
    c = Costs(step_ms=10.0, verify_ms={1: 15.0, 2: 40.0}, draft_ms=0.5)
    back = Costs.from_dict(c.as_dict())
    assert back.verify_ms == c.verify_ms and back.step_ms == 10.0 and back.draft_ms == 0.5
    d = c.as_dict()
    assert d["breakeven_k1"] == round(break_even(10.0, 15.0, 0.5, 1), 3) and d["breakeven_k2"] is None
    lines = c.lines()
    assert lines[0].startswith(
        "k=1: verify of 2 tokens 15.00 ms = 1.50 plain steps (10.00 ms), with 0.50 ms per draft pays above acceptance"
    )
    assert lines[1].endswith("never pays")


def test_summary_lines_of_a_finish():
    assert summary_lines(None) == [] and summary_lines({}) == []
    st = SpecStats(rounds=4, drafted=8, accepted=6, emitted=10, rollbacks=1, draft_seconds=0.008, verify_seconds=0.2)
    lines = summary_lines(st.as_dict())
    assert lines == [
        "speculation: drafted 8, accepted 6 (75.0%), 2.50 tokens per verify, "
        "verify 50.00 ms per round (4 rounds), draft 1.00 ms per token"
    ]
    st.costs = Costs(step_ms=10.0, verify_ms={1: 15.0}).as_dict()
    assert summary_lines(st.as_dict())[1].startswith("k=1: verify of 2 tokens 15.00 ms = 1.50 plain steps")


def test_measure_leaves_the_session_where_it_was(tiny_v4):
    lm, ids = tiny_v4
    prompt, n = ids[:40], 24

    def continuation(calibrate: bool):
        s = lm.new_session(ctx=len(prompt) + n + 16)
        logits = s.prefill(prompt)
        before = list(s.tokens)
        if calibrate:
            costs = measure(s, s.tokens[-1], reps=1)
            assert s.tokens == before
            assert costs.step_ms > 0 and sorted(costs.verify_ms) == [1, 2, 3, 4]
            assert all(v > 0 for v in costs.verify_ms.values())
        return list(decode_tokens(s, logits, greedy(lm.vocab_size), limit=n))

    assert continuation(True) == continuation(False)
    s = lm.new_session(ctx=8)
    s.prefill(prompt[:4])
    assert measure(s, 1) is None  # no room for a verify of 5 tokens


def test_mtp_timing_job_carries_the_costs_and_keeps_the_output(tok):
    plain = Engine(VerifyingModel(tok, LONG), tok, ctx=4096)
    try:
        want = list(plain.generate(Job(prompt_text=RAW, api="completions", raw=True, params=GREEDY, max_tokens=120)))
        expected = list(plain.session.tokens)
    finally:
        plain.close()
    model = VerifyingModel(tok, LONG)
    spec = SpecConfig(_drafter(expected, model.vocab_size), depth=3, margin=0, timing=True)
    eng = Engine(model, tok, ctx=4096, speculation=spec)
    try:
        got = list(eng.generate(Job(prompt_text=RAW, api="completions", raw=True, params=GREEDY, max_tokens=120)))
        assert list(eng.session.tokens) == expected  # the calibration's forwards were rolled back
    finally:
        eng.close()
    assert got[-1].raw_text == want[-1].raw_text
    costs = got[-1].speculation["costs"]
    assert costs["step_ms"] > 0 and {f"breakeven_k{k}" for k in (1, 2, 3, 4)} <= set(costs)
    lines = summary_lines(got[-1].speculation)
    assert lines[0].startswith("speculation: drafted") and len(lines) == 5


def test_ds4_flag_aliases():
    p = _parser()
    a = p.parse_args(["--mtp-model", "s.gguf"])
    assert spec_cli.mtp_file(a) == "s.gguf" and spec_cli.speculation_requested(a)
    assert spec_cli.mtp_file(p.parse_args(["--dspark", "--mtp-model", "s.gguf"])) is None  # the drafter's file
    assert spec_cli.speculation_requested(p.parse_args(["--mtp-timing"]))
    assert not spec_cli.speculation_requested(p.parse_args([]))
    with pytest.raises(spec_cli.SpecUsageError, match="two different files"):
        spec_cli.spec_config(p.parse_args(["--mtp", "a.gguf", "--mtp-model", "b.gguf"]), None, ctx=64)
    with pytest.raises(spec_cli.SpecUsageError, match="exclude each other"):
        spec_cli.spec_config(p.parse_args(["--dspark", "--draft-model", "demo"]), None, ctx=64)


def test_mtp_timing_implies_mtp_on_the_tiny_v4(tiny_v4):
    lm, _ = tiny_v4
    lm.random_weights = True  # a synthetic model: --mtp draws a random head
    try:
        spec = spec_cli.spec_config(_parser().parse_args(["--mtp-timing"]), lm, ctx=64)
    finally:
        del lm.random_weights
    try:
        assert spec.timing and spec.drafter.name == "MTP head"
    finally:
        spec.drafter.close()


def test_serve_runs_batched_sessions_with_speculation_off_and_says_why(caplog):
    """`serve --batched-session 2` with any speculation flag: the server is built, its engine
    has 2 slots and no speculation (no drafter or MTP file loaded), one warning line says why."""
    import logging

    import ds4mlx
    from ds4mlx.serve import cli as serve_cli

    p = argparse.ArgumentParser()
    serve_cli.add_arguments(p)
    demo = ds4mlx.load(None)
    for flags in (["--mtp"], ["--dspark"], ["--draft-model", "no/such/model"], ["--mtp-timing"], ["--mtp", "no.gguf"]):
        args = p.parse_args(["--batched-session", "2", *flags])
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ds4mlx.serve"):
            engine, _ = serve_cli.build(args, loaded=demo)
        try:
            assert engine.slots == 2 and engine.speculation is None
        finally:
            engine.close()
        said = [r.getMessage() for r in caplog.records if "speculative decoding off" in r.getMessage()]
        assert said == [
            "speculative decoding off: --batched-session 2 decodes the slots in one shared forward per step, "
            "which a drafter does not follow (--batched-session 1 speculates)"
        ]
    args = p.parse_args(["--batched-session", "1", "--mtp"])
    assert spec_cli.off_for_slots(args, 1) is None and args.mtp == ""  # one slot: speculation stays asked
    args = p.parse_args(["--batched-session", "4"])
    assert spec_cli.off_for_slots(args, 4) is None  # nothing asked: nothing said


def test_bench_rows_carry_the_counters_and_the_acceptance_model(tiny_v4, tmp_path):
    import csv

    from ds4mlx.bench.frontier import SPEC_COLUMNS, run_bench, write_csv
    from ds4mlx.speculative.drafter import ScriptedDrafter

    lm, ids = tiny_v4

    class Ids:  # the tiny model's own token ids as the bench text
        eos_id = None

        def encode(self, text):
            return ids[:40]

    drafter = ScriptedDrafter(lambda ctx, k: [(t + 1) % lm.vocab_size for t in ctx[-k:]])  # mostly wrong
    spec = SpecConfig(drafter, depth=2, margin=0)
    rows = run_bench(lm, Ids(), [24, 40], gen_tokens=6, chunk=16, speculation=spec)
    path = tmp_path / "bench.csv"
    write_csv(rows, path)
    with open(path, newline="") as f:
        got = list(csv.DictReader(f))
    assert len(got) == 2 and set(SPEC_COLUMNS) <= set(got[0])
    for r in got:
        assert int(r["spec_drafted"]) > 0 and float(r["spec_verify_ms"]) > 0 and float(r["spec_step_ms"]) > 0
        for k in (1, 2, 3, 4):
            be = r[f"spec_breakeven_k{k}"]
            assert be == "never" or 0.0 <= float(be) <= 1.0
            assert float(r[f"spec_verify_ms_k{k}"]) > 0


def test_chat_prints_the_counters_and_the_acceptance_model(tmp_path):
    """`ds4mlx chat --mtp --mtp-timing` on the demo model: after an answer, beside its t/s line,
    what speculation did (drafted, accepted, rate, verify cost) and the break-even per k."""
    pytest.importorskip("pexpect")
    import pexpect
    from test_cli_repl import ANSI, PROMPT, spawn

    child = spawn(tmp_path, "--nothink", "--mtp", "--mtp-draft", "2", "--mtp-timing", "-n", "24", "--temp", "0")
    try:
        child.sendline("hello")
        child.expect(r"k=4: verify of 5 tokens[^\r\n]*")
        text = ANSI.sub("", child.before + child.after)
        child.expect_exact(PROMPT)
        assert re.search(r"speculation: drafted \d+, accepted \d+ \(\d+\.\d%\)", text), text[-2000:]
        assert "verify" in text and "generation" in text  # beside the t/s status line
        for k in (1, 2, 3):
            assert f"k={k}: verify of {k + 1} tokens" in text
        child.sendline("/quit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)

"""Per-request speculation counters (issue #21): drafted, accepted, acceptance rate, verify cost.

The engine gives every job its own SpecStats and adds it to the totals of
`/v1/ds4mlx/stats`; the job's numbers ride on its Finish (`speculation`) and into the
`serve --trace` line.  The in-process eval backend does the same per case: the numbers
go to the case's trace record (`spec_*` lines, docs/eval.md §9) and the run's totals,
the sum of the cases', to the trace SUMMARY.  Here: per-request numbers add up to the
totals exactly, on the scripted model with a drafter that is wrong at rotating positions.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from scripted_model import serve  # noqa: E402
from test_spec_engine import LONG, RAW, VerifyingModel, _drafter  # noqa: E402

from ds4mlx.engine import Engine, Job  # noqa: E402
from ds4mlx.eval import load_cases  # noqa: E402
from ds4mlx.eval.inprocess import InProcessBackend  # noqa: E402
from ds4mlx.eval.runner import Options, Runner  # noqa: E402
from ds4mlx.eval.trace import TraceWriter, parse_trace  # noqa: E402
from ds4mlx.runtime.events import Finish  # noqa: E402
from ds4mlx.runtime.sampling import SamplingParams  # noqa: E402
from ds4mlx.speculative.options import SpecConfig, SpecStats  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)
COUNTERS = ("rounds", "drafted", "accepted", "emitted", "rollbacks")


@pytest.fixture(scope="module")
def tok():
    from ds4mlx.runtime.tokenizer import Tokenizer

    return Tokenizer.default()


def _plain_tokens(tok, n):
    model = VerifyingModel(tok, LONG)
    eng = Engine(model, tok, ctx=4096)
    try:
        list(eng.generate(Job(prompt_text=RAW, api="completions", raw=True, params=GREEDY, max_tokens=n)))
        return list(eng.session.tokens)
    finally:
        eng.close()


def test_stats_dict_has_the_verify_cost():
    st = SpecStats(rounds=4, drafted=8, accepted=6, emitted=10, rollbacks=1, draft_seconds=0.5, verify_seconds=0.2)
    d = st.as_dict()
    assert d["acceptance_rate"] == 0.75 and d["tokens_per_round"] == 2.5
    assert d["verify_ms_per_round"] == 50.0 and d["verify_seconds"] == 0.2
    assert SpecStats().as_dict()["verify_ms_per_round"] == 0.0


def test_each_finish_carries_its_jobs_counters_and_they_add_up_to_the_totals(tok):
    expected = _plain_tokens(tok, 150)
    model = VerifyingModel(tok, LONG)
    eng = Engine(model, tok, ctx=4096, speculation=SpecConfig(_drafter(expected, model.vocab_size), depth=3, margin=0))
    per = []
    try:
        for n in (150, 40):
            evs = list(eng.generate(Job(prompt_text=RAW, api="completions", raw=True, params=GREEDY, max_tokens=n)))
            fin = evs[-1]
            assert isinstance(fin, Finish) and fin.speculation is not None
            per.append(fin.speculation)
        totals = eng.stats
    finally:
        eng.close()
    for d in per:
        assert d["drafted"] > d["accepted"] > 0
        assert d["acceptance_rate"] == round(d["accepted"] / d["drafted"], 4)
        assert d["verify_seconds"] > 0 and d["verify_ms_per_round"] > 0
    assert totals.spec_drafted == sum(d["drafted"] for d in per)
    assert totals.spec_accepted == sum(d["accepted"] for d in per)
    assert totals.spec_rounds == sum(d["rounds"] for d in per)
    # a job that does not speculate says so
    plain = Engine(VerifyingModel(tok, LONG), tok, ctx=4096)
    try:
        evs = list(plain.generate(Job(prompt_text=RAW, api="completions", raw=True, params=GREEDY, max_tokens=5)))
    finally:
        plain.close()
    assert evs[-1].speculation is None


def test_serve_trace_lines_carry_the_requests_counters(tok, tmp_path):
    import urllib.request

    expected = _plain_tokens(tok, 200)
    model = VerifyingModel(tok, LONG)
    trace = tmp_path / "serve.jsonl"
    with serve(tok, model, trace=str(trace)) as srv:
        srv.engine.speculation = SpecConfig(_drafter(expected, model.vocab_size), depth=3, margin=0)
        for n in (60, 25):
            body = json.dumps({"model": "x", "prompt": "hi", "max_tokens": n, "temperature": 0}).encode()
            req = urllib.request.Request(srv.url + "/v1/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                r.read()
        with urllib.request.urlopen(srv.url + "/v1/ds4mlx/stats", timeout=30) as r:
            totals = json.loads(r.read())["engine"]
    lines = [json.loads(x) for x in trace.read_text().splitlines() if x.strip()]
    specs = [x["speculation"] for x in lines]
    assert len(specs) == 2 and all(s and s["drafted"] > 0 for s in specs)
    assert totals["spec_drafted"] == sum(s["drafted"] for s in specs)
    assert totals["spec_accepted"] == sum(s["accepted"] for s in specs)


class PlanDrafter:
    """Drafts the scripted session's own plan after x0, one token wrong every third round."""

    name = "plan"

    def __init__(self, backend):
        self.backend, self.calls = backend, 0

    def propose(self, context, x0, k, rule, margin=0.0):
        s = self.backend._session
        plan = [t for t, _ in s._plan] + [s.model.eos_id] * (k + 1)
        g = s._gen + 1  # x0 is fed first
        drafts = list(plan[g : g + k])
        self.calls += 1
        if self.calls % 3 == 0 and drafts:
            drafts[-1] = (drafts[-1] + 1) % s.model.vocab_size
        return drafts, None


def _eval(tok, tmp_path, spec: bool):
    cases = load_cases("core")[:3]
    model = VerifyingModel(tok, "Let me think about it " * 12 + "</think>\n\nAnswer: B")
    backend = InProcessBackend(loaded=(model, tok))
    if spec:
        backend._spec_args = SpecConfig(PlanDrafter(backend), depth=3, margin=0)
    runner = Runner(cases, backend, Options(tokens=200))
    path = tmp_path / ("spec.txt" if spec else "plain.txt")
    runner.trace = TraceWriter.create(str(path))
    assert runner.size_context() is None
    backend.open(runner.ctx)
    rc = runner.run()
    runner.finish_trace()
    data = path.read_bytes()
    return rc, parse_trace(data), data.decode(), backend


def test_eval_trace_records_carry_each_cases_counters_and_the_summary_their_sum(tok, tmp_path):
    rc0, plain, plain_text, _ = _eval(tok, tmp_path, spec=False)
    rc, recs, text, backend = _eval(tok, tmp_path, spec=True)
    assert rc == rc0 and [r.output for r in recs] == [r.output for r in plain] and len(recs) == 3
    assert "spec_drafted" not in plain_text  # ds4's record unchanged without speculation
    sums = dict.fromkeys(COUNTERS, 0)
    for r in recs:
        got = {c: r.int_field(f"spec_{c}") for c in COUNTERS}
        assert got["drafted"] > got["accepted"] > 0 and got["rollbacks"] > 0
        rate = r.float_field("spec_acceptance_rate")
        assert rate == pytest.approx(got["accepted"] / got["drafted"], abs=1e-4)
        assert r.float_field("spec_verify_seconds") > 0 and r.float_field("spec_verify_ms_per_round") > 0
        for c in COUNTERS:
            sums[c] += got[c]
    summary = text[text.index("===== SUMMARY =====") :]
    fields = dict(line.split(": ", 1) for line in summary.splitlines()[1:] if ": " in line)
    for c in COUNTERS:
        assert int(fields[f"spec_{c}"]) == sums[c] == getattr(backend.spec_stats, c)

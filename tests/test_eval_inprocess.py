"""The in-process backend: real tokenizer, the scripted model double behind the
Session contract (tests/scripted_model.py), the ds4 decode loop with the
`</think>` controller.  Plus the acceptance run on the demo model when
`ds4mlx.load(None)` is available."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mlx.core")

from ds4mlx.eval import load_cases  # noqa: E402
from ds4mlx.eval.inprocess import InProcessBackend  # noqa: E402
from ds4mlx.eval.runner import Options, Runner  # noqa: E402
from ds4mlx.eval.trace import TraceWriter, parse_trace  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from scripted_model import ScriptedModel  # noqa: E402

CORE = load_cases("core")


@pytest.fixture(scope="module")
def tok():
    try:
        from ds4mlx.runtime.tokenizer import Tokenizer

        return Tokenizer.default()
    except (ImportError, FileNotFoundError) as e:  # pragma: no cover
        pytest.skip(f"no DeepSeek tokenizer: {e}")


def _run(tok, script, cases, tmp_path, **opts):
    model = ScriptedModel(tok, script)
    backend = InProcessBackend(loaded=(model, tok), temperature=opts.pop("temperature", 0.0))
    runner = Runner(cases, backend, Options(**opts))
    runner.trace = TraceWriter.create(str(tmp_path / "t.txt"))
    assert runner.size_context() is None
    backend.open(runner.ctx)
    rc = runner.run()
    runner.finish_trace()
    return rc, runner, model, parse_trace((tmp_path / "t.txt").read_bytes())


def test_natural_close_and_eos(tok, tmp_path):
    rc, runner, model, recs = _run(tok, "Gamma is about 1961.</think>\n\nAnswer: B", CORE[:1], tmp_path, tokens=64)
    cr = runner.runs[0]
    assert rc == 0 and cr.status == "PASSED" and cr.picked == "B"
    assert cr.prompt_tokens == len(tok.encode(cr.prompt.text))
    assert cr.prompt.text.startswith("<\uff5cbegin\u2581of\u2581sentence\uff5c>You are solving")
    assert cr.prompt.text.endswith("Answer: <letter><\uff5cAssistant\uff5c><think>")
    rec = recs[0]
    assert rec.output == "Gamma is about 1961.</think>\n\nAnswer: B"
    assert rec.int_field("generated_tokens") == len(tok.encode(rec.output))  # EOS not counted
    assert rec.fields["think_close"] == "natural"
    assert rec.int_field("think_close_token_index") == len(tok.encode("Gamma is about 1961.</think>"))


def test_hard_close_injects_plain_text_close_tokens(tok, tmp_path):
    rc, runner, model, recs = _run(tok, "word " * 300, CORE[2:3], tmp_path, tokens=40)
    rec = recs[0]
    assert rec.fields["think_close"] == "hard_forced"
    assert rec.int_field("think_close_token_index") == 31 and rec.int_field("think_close_remaining_budget") == 10
    assert rec.int_field("generated_tokens") == 40
    assert "</think>" in rec.output
    close = tok.encode("</") + tok.encode("think>")
    assert len(close) == 3 and tok.encode("</think>")[0] not in close  # ordinary tokens, not the special id
    session = runner.backend._session
    gen = session.tokens[runner.runs[0].prompt_tokens :]
    assert gen[30:33] == close


def test_sampling_path_and_session_reuse(tok, tmp_path):
    rc, runner, model, recs = _run(tok, "ok</think>Answer: B", CORE[:2], tmp_path, tokens=32, temperature=0.7, seed=5)
    assert [r.output for r in recs] == ["ok</think>Answer: B"] * 2
    assert model.prefill_calls == 2  # one session, each case prefilled from scratch


DEMO = importlib.util.find_spec("ds4mlx.io.loader") is not None


@pytest.mark.slow
@pytest.mark.skipif(not DEMO, reason="ds4mlx.io.loader (demo model) not available yet")
def test_acceptance_demo_model_three_cases(tmp_path):
    trace = tmp_path / "t.txt"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "ds4mlx.cli",
            "eval",
            "--plain",
            "--case-id",
            "1",
            "--case-id",
            "2",
            "--case-id",
            "3",
            "--tokens",
            "64",
            "--trace",
            str(trace),
        ],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert r.returncode in (0, 1), r.stderr
    recs = parse_trace(trace.read_bytes())
    assert len(recs) == 3 and all(x.status in ("PASSED", "FAILED") for x in recs)
    assert all(x.int_field("generated_tokens") <= 64 for x in recs)
    assert "ds4-eval:" in r.stdout and "#   state" in r.stdout

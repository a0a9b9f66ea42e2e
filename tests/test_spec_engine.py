"""Speculative decoding inside the engine (issue #21 step 4): the stream equals token by token.

On the scripted model (tests/scripted_model.py, given verify / checkpoint / rollback) a
drafter that is wrong at rotating positions runs through >= 200 tokens of text into a
tool call, a stop string, max_tokens and ignore_eos: the events, the finish and the
session's tokens afterwards equal the engine without speculation (unconsumed speculative
tokens are dropped at a tool-call end, a stop string, the limit).  On the tiny V4 oracle
(sliding window 16) the engine's greedy output with a self-draft equals plain decoding
over 210 tokens, and the counters reach EngineStats.
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from parity_helpers import load_case  # noqa: E402
from scripted_model import ScriptedModel, ScriptedSession  # noqa: E402

from ds4mlx.chat.families.deepseek_v4.template import render  # noqa: E402
from ds4mlx.engine import Engine, Job  # noqa: E402
from ds4mlx.io.loader import load  # noqa: E402
from ds4mlx.runtime.events import Finish  # noqa: E402
from ds4mlx.runtime.sampling import SamplingParams  # noqa: E402
from ds4mlx.serve.openai import parse_chat  # noqa: E402
from ds4mlx.speculative.drafter import ModelDrafter, ScriptedDrafter  # noqa: E402
from ds4mlx.speculative.options import SpecConfig  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)
DSML_CALL = (
    '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="bash">\n'
    '<｜DSML｜parameter name="command" string="true">ls /tmp</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
]
RAW = "<｜begin▁of▁sentence｜>You are a helpful assistant<｜User｜>hi<｜Assistant｜></think>"
LONG = " ".join(f"word{i} and some more text, number {i * 7}." for i in range(40))  # > 200 tokens


class VerifyingSession(ScriptedSession):
    """The scripted session with the speculative-decoding primitive."""

    def verify(self, ids):
        return mx.stack([self.step(int(t)) for t in ids])

    def checkpoint(self):
        return (list(self.tokens), list(self._plan), self._gen, self._last)

    def rollback(self, cp):
        self.tokens, self._plan, self._gen, self._last = list(cp[0]), list(cp[1]), cp[2], cp[3]

    def cache_arrays(self):
        return []


class VerifyingModel(ScriptedModel):
    def new_session(self, ctx: int = 4096, chunk: int = 512):
        return VerifyingSession(self, ctx)


@pytest.fixture(scope="module")
def tok():
    from ds4mlx.runtime.tokenizer import Tokenizer

    return Tokenizer.default()


def _drafter(expected, vocab):
    """Right drafts from the plain run's tokens, one wrong at a position rotating with the context."""

    def propose(ctx, k):
        cont = expected[len(ctx) : len(ctx) + k]
        at = len(ctx) % (k + 2)
        return [(t + 1) % vocab if i == at else t for i, t in enumerate(cont)]

    return ScriptedDrafter(propose)


def _events(evs):
    return [
        (type(e).__name__, getattr(e, "text", None), getattr(e, "name", None), getattr(e, "arguments", None))
        for e in evs
        if not isinstance(e, Finish)
    ]


def _run_pair(tok, script, job_kw, depth=3):
    """(plain events, plain tokens, spec events, spec tokens, spec engine)."""
    out = []
    expected = None
    for spec in (False, True):
        model = VerifyingModel(tok, script)
        cfg = SpecConfig(_drafter(expected, model.vocab_size), depth=depth, margin=0) if spec else None
        eng = Engine(model, tok, ctx=4096, speculation=cfg)
        try:
            evs = list(eng.generate(Job(**job_kw)))
            toks = list(eng.session.tokens) if eng.session is not None else None
        finally:
            eng.close()
        expected = toks
        out.append((evs, toks, eng))
    (pe, pt, _), (se, st, eng) = out
    return pe, pt, se, st, eng


def _finish(evs):
    f = evs[-1]
    assert isinstance(f, Finish)
    return f.reason, f.raw_text, f.usage.completion_tokens


def test_tool_call_start_discards_unconsumed_speculation(tok):
    c = parse_chat({"messages": [{"role": "user", "content": "List /tmp"}], "tools": TOOLS}, ctx=4096)
    job = dict(prompt_text=render(c), api="chat", thinking=c.thinking, tools_active=True, params=GREEDY)
    pe, pt, se, st, eng = _run_pair(tok, "Thinking " + LONG + "</think>Sure." + DSML_CALL + " SHOULD NOT APPEAR", job)
    assert _finish(pe)[0] == "tool_calls" and _finish(pe)[2] > 200
    assert _events(se) == _events(pe) and _finish(se) == _finish(pe)
    assert st == pt  # the session holds exactly what the stream consumed
    assert eng.stats.spec_drafted > 0 and 0 < eng.stats.spec_accepted < eng.stats.spec_drafted


def test_stop_string_max_tokens_and_ignore_eos_are_exact(tok):
    pe, pt, se, st, _ = _run_pair(
        tok,
        LONG + " STOPHERE and beyond",
        dict(prompt_text=RAW, api="completions", raw=True, params=GREEDY, stop=["STOPHERE"]),
    )
    assert _finish(pe)[0] == "stop" and _events(se) == _events(pe) and _finish(se) == _finish(pe)
    for n in (1, 2, 7, 201):
        pe, _, se, _, _ = _run_pair(
            tok, LONG, dict(prompt_text=RAW, api="completions", raw=True, params=GREEDY, max_tokens=n), depth=4
        )
        assert _finish(pe)[2] == n and _events(se) == _events(pe) and _finish(se) == _finish(pe)
    pe, pt, se, st, _ = _run_pair(
        tok, "short", dict(prompt_text=RAW, api="completions", raw=True, params=GREEDY, max_tokens=30, ignore_eos=True)
    )
    assert _finish(pe)[2] == 30 and _events(se) == _events(pe) and st == pt


def test_engine_greedy_self_draft_on_the_tiny_v4(oracle, tok):
    folder, _, ref, _ = load_case(oracle, "make_tiny_deepseek_v4.py", "long")
    lm, _ = load(str(folder), verbose=False)  # evaluated arrays: the engine's worker thread runs it
    ids = ref["input_ids"][0].tolist()[:8]  # ids of the oracle's 512-token vocabulary, given as such
    prompt = tok.decode(ids)
    runs = []
    for spec in (None, SpecConfig(ModelDrafter(lm, ctx=512), depth=3, margin=0)):
        eng = Engine(lm, tok, ctx=512, speculation=spec)
        try:
            evs = list(
                eng.generate(
                    Job(
                        prompt_text=prompt,
                        prompt_ids=ids,
                        api="completions",
                        raw=True,
                        params=GREEDY,
                        max_tokens=210,
                        ignore_eos=True,
                    )
                )
            )
            runs.append((_finish(evs), list(eng.session.tokens), eng.stats))
        finally:
            eng.close()
    (pf, ptoks, _), (sf, stoks, stats) = runs
    assert pf[2] == 210 and sf == pf and stoks == ptoks
    assert stats.spec_accepted == stats.spec_drafted > 0 and stats.spec_acceptance_rate == 1.0


def test_flags_that_cannot_be_honoured_are_usage_errors(oracle):
    import argparse

    from ds4mlx.speculative import cli as spec_cli

    p = argparse.ArgumentParser()
    spec_cli.add_arguments(p)
    assert spec_cli.spec_config(p.parse_args([]), None, ctx=64) is None
    folder, lm, _, _ = load_case(oracle, "make_tiny_deepseek_v4.py", "long")
    for argv, msg in (
        (["--mtp", "--draft-model", "demo"], "exclude each other"),
        (["--draft-model", "demo"], "vocabulary"),  # the demo's 129280 ids vs the oracle's 512
        (["--draft-model", str(folder), "--mtp-draft", "0"], "at least 1"),
        (["--mtp"], "no MTP tensors"),  # an HF folder without mtp.* and not a demo
    ):
        with pytest.raises(spec_cli.SpecUsageError, match=msg):
            spec_cli.spec_config(p.parse_args(argv), lm, ctx=64)
    a = p.parse_args(["--mtp", "x.gguf"])
    assert spec_cli.mtp_file(a) == "x.gguf" and spec_cli.mtp_file(p.parse_args(["--mtp"])) is None


def test_server_stats_carry_the_speculation_counters(tok):
    import json
    import urllib.request

    from scripted_model import serve

    model = VerifyingModel(tok, LONG)
    plain, plain_tokens = None, []
    with serve(tok, model) as srv:
        for spec in (False, True):
            if spec:  # the engine reads its speculation per job
                srv.engine.speculation = SpecConfig(_drafter(plain_tokens, model.vocab_size), depth=3, margin=0)
            body = json.dumps({"model": "x", "prompt": "hi", "max_tokens": 120, "temperature": 0}).encode()
            req = urllib.request.Request(srv.url + "/v1/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                text = json.loads(r.read())["choices"][0]["text"]
            if not spec:
                plain, plain_tokens[:] = text, srv.engine.session.tokens
        with urllib.request.urlopen(srv.url + "/v1/ds4mlx/stats", timeout=30) as r:
            stats = json.loads(r.read())["engine"]
    assert text == plain
    assert stats["spec_drafted"] > stats["spec_accepted"] > 0 and stats["spec_rounds"] > 0
    assert stats["spec_acceptance_rate"] == round(stats["spec_accepted"] / stats["spec_drafted"], 4)

"""The engine's decode keeps the host off the device's critical path: each decode step is
issued and dispatched, fed the token drawn on the device, before the host reads that token
and works on it (detokenizer, parser, events) — through the engine's one slot and through
its batched-session path.  On the stand-in model (bench/stub_model.py) of
bench/engine_host.py, whose greedy decode must write the text on."""

from __future__ import annotations

import mlx.core as mx
import pytest

from ds4mlx.bench import engine_host, frontier
from ds4mlx.bench.stub_model import stub_model
from ds4mlx.engine import Engine
from ds4mlx.runtime.session import Session
from ds4mlx.runtime.tokenizer import Tokenizer

CTX, GEN = 40, 12


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.default()


@pytest.fixture(scope="module")
def text_ids(tok):
    return frontier.bench_tokens(tok, 256)


class RecordingTokenizer:
    """The tokenizer, logging each token the host reads into text."""

    def __init__(self, tok, log: list):
        self._tok, self._log = tok, log

    def token_bytes(self, i: int) -> bytes:
        self._log.append(("host", int(i)))
        return self._tok.token_bytes(i)

    def __getattr__(self, name):
        return getattr(self._tok, name)


def record_steps(model, log: list):
    """Log every decode forward of the stand-in (run each step under DS4MLX_DECODE=eager)."""
    inner = model.model
    forward = inner.static_forward

    def recording(ids, ctx):
        log.append(("step", ctx.rows))
        return forward(ids, ctx)

    inner.static_forward = recording


@pytest.mark.parametrize("slots", [1, 2], ids=["engine", "batched"])
def test_step_dispatched_before_the_host_reads_its_token(monkeypatch, tok, text_ids, slots):
    monkeypatch.setenv("DS4MLX_DECODE", "eager")  # the stand-in's Python forward runs every step
    log: list = []
    model = stub_model(tok, text_ids)
    record_steps(model, log)
    fed: list = []  # per step: was its token a device array (not read by the host first)?
    step = Session.step

    def logged_step(self, token, undoable=False):
        fed.append(isinstance(token, mx.array))
        return step(self, token, undoable)

    monkeypatch.setattr(Session, "step", logged_step)
    async_eval = mx.async_eval

    def logged_async_eval(*arrays):
        log.append(("dispatch", None))
        return async_eval(*arrays)

    monkeypatch.setattr(mx, "async_eval", logged_async_eval)
    eng = Engine(model, RecordingTokenizer(tok, log), ctx=CTX + GEN + 8, slots=slots)
    try:
        ids = text_ids[:CTX]
        job = engine_host.completion_job(tok.decode(ids), ids, GEN, ignore_eos=True)
        _, n, text = engine_host.timed_job(eng, job)
    finally:
        eng.close()
    assert n == GEN
    assert text == tok.decode(text_ids[CTX : CTX + GEN])  # greedy writes the text on
    assert fed and all(fed)  # every step fed the token drawn on the device, never a host int
    reads = [i for i, e in enumerate(log) if e[0] == "host"]
    steps = [i for i, e in enumerate(log) if e[0] == "step"]
    assert len(reads) == GEN and len(steps) >= GEN
    for k, at in enumerate(reads):
        # the step consuming token k (the (k+1)-th decode forward) and a dispatch after it
        # happened before the host read token k
        assert steps[k] < at, f"token {k} read before its step was issued"
        assert any(e[0] == "dispatch" for e in log[steps[k] : at]), f"token {k} read before its step was dispatched"


def test_paths_decode_the_same_text(tok, text_ids):
    """The harness's engine paths (one slot, batched slots) stream the stand-in's text."""
    runs = engine_host.Paths(stub_model(tok, text_ids), tok, CTX, GEN)
    try:
        want = tok.decode(frontier.bench_tokens(tok, CTX + GEN)[CTX:])
        for path in ("engine", "batched"):
            us, n, text = runs.run(path)
            assert (n, text) == (GEN, want), path
            assert len(us) == len(engine_host.COLUMNS)
    finally:
        runs.close()

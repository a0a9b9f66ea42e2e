"""Mixed batches (engine/batch.py, docs/kv-cache.md §11): each engine step carries the
decode rows of every running request plus prefill chunks under a token budget, so a
long prompt advances chunk by chunk between the running streams' tokens.

The oracle is the same requests run one at a time on a one-slot engine with the same
prefill chunk (a prompt splits at the same positions alone or batched), on the tiny
random-weight demo model of every family."""

from __future__ import annotations

import threading

import pytest

from ds4mlx.engine import Engine, Failed, Job
from ds4mlx.engine.batch import ChunkRequest, plan_step
from ds4mlx.runtime.decode import StepRequest
from ds4mlx.runtime.events import Finish, PrefillProgress, Started
from ds4mlx.runtime.sampling import SamplingParams
from ds4mlx.serve.prepare import ServeConfig, prepare

FAMILIES = ["deepseek_v4", "deepseek_v41", "glm_moe_dsa", "glm5_next", "qwen4_exp"]
CHUNK = 4  # small: every prompt splits into several chunks
CTX = 1024
GREEDY = SamplingParams(temperature=0.0)

CONVERSATIONS = [
    [{"role": "user", "content": "Hi."}],
    [{"role": "user", "content": "Write a short poem about the sea, the wind and the gulls over the harbour."}],
    [
        {"role": "system", "content": "You are a terse assistant that answers in one line."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy, and how many people live there?"},
    ],
    [{"role": "user", "content": "def fibonacci(n):\n    # explain this function line by line\n"}],
]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, shared_demo):
    fam = request.param
    return fam, shared_demo(None if fam == "deepseek_v4" else f"demo:{fam}")


def chat_job(engine: Engine, messages: list[dict], max_tokens: int = 8) -> Job:
    """A chat request as the server builds it: thinking off, temperature 0."""
    body = {"messages": messages, "thinking": {"type": "disabled"}, "temperature": 0, "max_tokens": max_tokens}
    cfg = ServeConfig(ctx=CTX, family=engine.protocol.family)
    job = prepare(cfg, engine, None, "chat", body).job
    assert job.thinking == "none" and job.params.greedy
    return job


def raw_job(prompt: str, max_tokens: int, **kw) -> Job:
    return Job(prompt_text=prompt, api="completions", raw=True, max_tokens=max_tokens, params=GREEDY, **kw)


def run_alone(engine: Engine, job: Job) -> Finish:
    return list(engine.generate(job))[-1]


def submit_held(engine: Engine, jobs: list[Job], log: list) -> list:
    """Submit every job while the worker is held, so one admission starts them all;
    `log` gets (job index, event) in the order the worker emitted them."""
    gate, holding = threading.Event(), threading.Event()
    hold = threading.Thread(target=engine.run_on_worker, args=(lambda e: holding.set() or gate.wait(60),))
    hold.start()
    assert holding.wait(60)
    handles = [engine.submit(j, lambda ev, i=i: log.append((i, ev))) for i, j in enumerate(jobs)]
    gate.set()
    hold.join()
    for h in handles:
        assert h.done.wait(300)
    return handles


def chunks_of(log: list, i: int) -> list[int]:
    """Positions in `log` of job i's prefill chunks (the progress after each chunk)."""
    starts = {}
    out = []
    for n, (j, ev) in enumerate(log):
        if j == i and isinstance(ev, PrefillProgress):
            if j not in starts:
                starts[j] = ev.done  # the first progress: what was reused, before any chunk
            elif ev.done > starts[j]:
                out.append(n)
    return out


# --------------------------------------------------------------------------- the plan
def test_a_step_takes_every_row_and_chunks_in_order_under_the_budget():
    rows = [StepRequest(None, 1, False) for _ in range(3)]
    a, b, c = ChunkRequest(None, [1] * 8), ChunkRequest(None, [1] * 2), ChunkRequest(None, [1] * 3)
    plan = plan_step([a, rows[0], b, rows[1], c, rows[2]], budget=8)
    assert plan.rows == rows  # every running request decodes
    assert plan.chunks == [a]  # the first chunk always goes, even past the budget; b waits
    plan = plan_step([rows[0], b, c, a], budget=8)
    assert plan.chunks == [b, c] and plan.tokens == 6  # short chunks share a step while they fit
    assert plan_step([a, b], budget=16).chunks == [a, b]
    assert plan_step(rows, budget=1).chunks == [] and plan_step([], budget=8).tokens == 0


# --------------------------------------------------------------------------- every family
def test_concurrent_greedy_conversations_equal_one_by_one(family):
    """N conversations at once on N slots, prompts in 4-token chunks interleaved with the
    others' decode rows: each equals its run alone (text, finish, usage)."""
    fam, (model, tk) = family
    solo = Engine(model, tk, ctx=CTX, prefill_chunk=CHUNK)
    try:
        want = [run_alone(solo, chat_job(solo, c)) for c in CONVERSATIONS]
    finally:
        solo.close()
    eng = Engine(model, tk, ctx=CTX, slots=len(CONVERSATIONS), prefill_chunk=CHUNK)
    log: list = []
    try:
        handles = submit_held(eng, [chat_job(eng, c) for c in CONVERSATIONS], log)
    finally:
        eng.close()
    assert sorted(h.slot for h in handles) == list(range(len(CONVERSATIONS)))
    for w, h in zip(want, handles):
        got = h.result
        assert (got.reason, got.raw_text, got.usage) == (w.reason, w.raw_text, w.usage), fam
        assert got.usage.prompt_tokens > CHUNK  # it was prefilled in several chunks
    assert eng.stats.mixed_steps > 0  # steps carried decode rows and a prefill chunk together
    # the longest prompt was still prefilling when the first answer started
    longest = max(range(len(CONVERSATIONS)), key=lambda i: handles[i].result.usage.prompt_tokens)
    first_start = min(n for n, (_, ev) in enumerate(log) if isinstance(ev, Started))
    assert chunks_of(log, longest)[-1] > first_start


# --------------------------------------------------------------------------- decode keeps going
def test_a_running_stream_decodes_between_the_chunks_of_long_prompts(shared_demo):
    """A stream decoding while two long prompts arrive: every prefill chunk of theirs is
    one step, and each step carries the stream's decode row — between any two chunks
    (of either prompt) the stream decoded a token.  Order of events, not time."""
    model, tk = shared_demo()
    long_text = " ".join(["The quick brown fox jumps over the lazy dog."] * 6)
    short = raw_job("Once upon a time", 200, ignore_eos=True)
    longs = [raw_job(f"{k}: {long_text}", 2) for k in "AB"]
    eng = Engine(model, tk, ctx=CTX, slots=3, prefill_chunk=CHUNK)
    # at each chunk of a long prompt: the tokens the short stream's session holds (read on
    # the worker thread, which emits the events)
    at_chunk: list[int] = []
    started, ended = threading.Event(), threading.Event()
    box = {}

    def on_short(ev):
        if isinstance(ev, Started):
            started.set()
        if isinstance(ev, Finish):
            ended.set()

    def on_long(ev):
        if isinstance(ev, PrefillProgress) and ev.done > 0 and not ended.is_set():
            at_chunk.append(len(eng.runners[box["short"].slot].slot))

    try:
        box["short"] = hs = eng.submit(short, on_short)
        assert started.wait(120)
        hl = [eng.submit(j, on_long) for j in longs]
        for h in (hs, *hl):
            assert h.done.wait(300)
    finally:
        eng.close()
    assert hs.result.usage.completion_tokens == 200 and all(h.result.reason == "length" for h in hl)
    n_chunks = -(-len(tk.encode(f"A: {long_text}")) // CHUNK)
    assert len(at_chunk) >= 2 * n_chunks - 2  # both prompts prefilled while it decoded, chunk by chunk
    assert all(b > a for a, b in zip(at_chunk, at_chunk[1:])), at_chunk  # a token between any two


def test_a_job_cancelled_while_its_chunk_waits_for_a_step_ends_cancelled(shared_demo):
    """Two long prompts at once: the second's chunks wait for the first's; cancelled
    while waiting, it ends "cancelled during prefill" and the first is unaffected."""
    model, tk = shared_demo()
    text = " ".join(["A long prompt about lighthouses and the sea."] * 4)
    jobs = [raw_job(f"{k} {text}", 3) for k in "AB"]
    solo = Engine(model, tk, ctx=CTX, prefill_chunk=CHUNK)
    try:
        want = run_alone(solo, jobs[0])
    finally:
        solo.close()
    eng = Engine(model, tk, ctx=CTX, slots=2, prefill_chunk=CHUNK)
    log: list = []

    def cancel_b(i, ev):
        log.append((i, ev))
        if i == 0 and isinstance(ev, PrefillProgress) and ev.done >= 2 * CHUNK:
            handles[1].cancel()  # B has not run a chunk yet: A's prefill goes first

    handles: list = []
    gate, holding = threading.Event(), threading.Event()
    hold = threading.Thread(target=eng.run_on_worker, args=(lambda e: holding.set() or gate.wait(60),))
    hold.start()
    try:
        assert holding.wait(60)
        handles += [eng.submit(j, lambda ev, i=i: cancel_b(i, ev)) for i, j in enumerate(jobs)]
        gate.set()
        hold.join()
        for h in handles:
            assert h.done.wait(300)
    finally:
        eng.close()
    a, b = handles[0].result, handles[1].result
    assert (a.reason, a.raw_text, a.usage) == (want.reason, want.raw_text, want.usage)
    assert b.reason == "cancelled" and b.error == "cancelled during prefill"
    assert b.usage.completion_tokens == 0 and b.usage.prompt_tokens > 2 * CHUNK


def test_a_failed_chunk_fails_its_job_only(monkeypatch, shared_demo):
    """A prefill forward that raises fails its own job (500, nothing started) and the
    session it left half-written is dropped; the job decoding beside it is unaffected."""
    from ds4mlx.runtime import session as session_mod

    model, tk = shared_demo()
    poison = tk.encode(" zebra")[-1]
    prefill = session_mod.Session.prefill

    def failing(self, ids, *a, **kw):
        if poison in list(ids):
            raise RuntimeError("prefill exploded")
        return prefill(self, ids, *a, **kw)

    good = raw_job("Once upon a time", 12)
    solo = Engine(model, tk, ctx=CTX, prefill_chunk=CHUNK)
    try:
        want = run_alone(solo, good)
    finally:
        solo.close()
    monkeypatch.setattr(session_mod.Session, "prefill", failing)
    eng = Engine(model, tk, ctx=CTX, slots=2, prefill_chunk=CHUNK)
    log: list = []
    try:
        hg, hb = submit_held(eng, [good, raw_job("A story about a zebra in the savanna", 4)], log)
        bad_events = [ev for i, ev in log if i == 1]
        assert isinstance(bad_events[-1], Failed) and bad_events[-1].status == 500
        assert "prefill exploded" in bad_events[-1].message
        assert (hg.result.reason, hg.result.raw_text, hg.result.usage) == (want.reason, want.raw_text, want.usage)
        assert len(eng.runners[hb.slot].slot) == 0  # the half-prefilled session was dropped
    finally:
        eng.close()

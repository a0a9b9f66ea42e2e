"""Session batching (`--batched-session N`, docs/kv-cache.md §11) on the demo model:
several resident sessions, jobs interleaved per token, routing by the reuse ladder,
eviction.  The oracle is the same work done one job at a time on a one-slot engine."""

from __future__ import annotations

import asyncio
import json
import queue
import threading

import aiohttp
import pytest

from ds4mlx.engine import Engine, Job
from ds4mlx.engine.slots import STALE_AFTER_S, Slot, eviction_victim, route
from ds4mlx.runtime.events import Finish, TextDelta
from ds4mlx.runtime.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=1.0, top_p=0.95, top_k=40, min_p=0.0, seed=1234)


@pytest.fixture(scope="module")
def demo(shared_demo):
    return shared_demo()


def raw_job(prompt: str, n: int = 10, params: SamplingParams = GREEDY) -> Job:
    return Job(prompt_text=prompt, api="completions", raw=True, max_tokens=n, params=params)


def run_alone(engine: Engine, job: Job) -> Finish:
    return [ev for ev in engine.generate(job)][-1]


def run_together(engine: Engine, jobs: list[Job], on_event=None):
    """Submit every job at once; [(handle, events)] once all ended."""
    out = []
    for job in jobs:
        evs: list = []
        box = {}

        def emit(ev, evs=evs, box=box):
            evs.append(ev)
            if on_event is not None:
                on_event(box["h"], ev)

        h = engine.submit(job, emit)
        box["h"] = h
        out.append((h, evs))
    for h, _ in out:
        assert h.done.wait(120)
    return out


# --------------------------------------------------------------------------- the router's policy
def _slot(i, n, idle, now=10_000.0):
    s = Slot(i, session=[0] * n)
    s.last_used = now - idle
    return s


def test_eviction_empty_then_stale_oldest_then_shortest():
    now = 10_000.0
    long_stale, short_new, empty = _slot(0, 900, STALE_AFTER_S + 5), _slot(1, 10, 1), _slot(2, 0, 0)
    assert eviction_victim([long_stale, short_new, empty], now) == (empty, False)
    older = _slot(3, 2000, STALE_AFTER_S + 50)
    assert eviction_victim([long_stale, short_new, older], now) == (older, True)
    a, b = _slot(0, 300, 60), _slot(1, 200, 10)
    assert eviction_victim([a, b], now) == (b, False)


def test_route_prefers_the_longest_reuse_and_evicts_only_without_one():
    now = 10_000.0
    a, b, c = _slot(0, 50, 5), _slot(1, 80, 5), _slot(2, 0, 0)
    r = route([a, b, c], lambda s: {0: 50, 1: 80}.get(s.index, 0), now)
    assert (r.slot, r.reusable) == (b, 80)
    r = route([a, b, c], lambda s: 0, now)
    assert (r.slot, r.reusable) == (c, 0)


def test_route_without_reuse_takes_the_same_conversations_slot():
    now = 10_000.0
    a, b, c = _slot(0, 50, 5), _slot(1, 20, 5), _slot(2, 0, 0)
    r = route([a, b], lambda s: 0, now, shared=lambda s: {0: 30, 1: 3}[s.index])
    assert (r.slot, r.shared) == (a, 30)  # over half of a's tokens: a's conversation, though the longer
    r = route([a, b], lambda s: 0, now, shared=lambda s: {0: 20, 1: 3}[s.index])
    assert (r.slot, r.shared) == (b, 0)  # under half: the policy's victim, the shortest
    assert route([a, b, c], lambda s: 0, now, shared=lambda s: 30).slot == c  # an empty slot first


# --------------------------------------------------------------------------- one forward, B rows
@pytest.mark.parametrize("face", [None, "reference"])
def test_rows_stepped_together_equal_each_alone(demo, face, monkeypatch, request):
    """`step_together`: B sessions at different positions (different buffer buckets) in
    one forward give each row the logits of its own step, within 1e-5 (float32 CPU), and
    leave each session where its own step would (the next steps agree too; undo works).
    face "reference": the GPU step's structure (attn_prep, the compressors' launches, the
    rows' attention offered to attend_rows) with the kernels' reference faces."""
    import numpy as np

    from ds4mlx.kernels import sparse_attention
    from ds4mlx.runtime import stepper
    from ds4mlx.runtime.session import can_step_together, step_together

    model, tk = demo
    inner = model.new_session(8).model
    stepper.forget(inner)  # a trace of the other face must not serve this one (nor later tests)
    request.addfinalizer(lambda: stepper.forget(inner))
    monkeypatch.setattr(sparse_attention, "FORCE_FACE", face)
    prompts = [tk.encode(p) for p in PROMPTS] + [tk.encode("x")]
    alone = [model.new_session(1024) for _ in prompts]
    rows = [model.new_session(1024) for _ in prompts]
    for a, r, p in zip(alone, rows, prompts):
        a.prefill(p)
        r.prefill(p)
    rounds = [[5, 7, 9, 11, 13], [17, 19, 23, 29, 31]]
    for k, toks in enumerate(rounds):
        want = [np.asarray(a.step(t)) for a, t in zip(alone, toks)]  # the first: the model's check
        assert can_step_together(rows)
        got = [np.asarray(lg) for lg in step_together(rows, toks, undoable=k == 1)]
        for w, g in zip(want, got):
            assert np.abs(w - g).max() <= 1e-5
            assert int(w.argmax()) == int(g.argmax())
    for r in rows:
        r.undo_step()  # the second round was undoable: back to one step past the prompt
    again = [np.asarray(lg) for lg in step_together(rows, rounds[1])]
    for w, g in zip(want, again):
        assert np.abs(w - g).max() <= 1e-5
    assert all(list(r.tokens) == list(a.tokens) for r, a in zip(rows, alone))


# --------------------------------------------------------------------------- engine
PROMPTS = [
    "The lighthouse keeper wrote in his log that",
    "A recipe for bread starts with",
    "def fibonacci(n):",
    "Once upon a time, in a kingdom by the sea,",
]


def test_interleaved_jobs_equal_one_by_one(demo):
    model, tk = demo
    params = [GREEDY, SAMPLED, GREEDY, SAMPLED]
    solo = Engine(model, tk, ctx=1024)
    try:
        want = [run_alone(solo, raw_job(p, 12, q)) for p, q in zip(PROMPTS, params)]
    finally:
        solo.close()
    eng = Engine(model, tk, ctx=1024, slots=4, prefill_chunk=4)
    seen_running = []
    try:
        got = run_together(
            eng,
            [raw_job(p, 12, q) for p, q in zip(PROMPTS, params)],
            on_event=lambda h, ev: seen_running.append(len(eng.running)) if isinstance(ev, TextDelta) else None,
        )
    finally:
        eng.close()
    assert max(seen_running) > 1  # they really ran at the same time
    assert eng.stats.shared_steps > 0  # and their decode steps shared forwards
    assert sorted(h.slot for h, _ in got) == [0, 1, 2, 3]
    for w, (h, evs) in zip(want, got):
        fin = evs[-1]
        assert isinstance(fin, Finish)
        assert fin.raw_text == w.raw_text
        assert "".join(ev.text for ev in evs if isinstance(ev, TextDelta)) == w.raw_text
        assert fin.usage == w.usage


@pytest.mark.parametrize("family", ["qwen4_exp", "glm_moe_dsa", "glm5_next"])
def test_greedy_jobs_together_equal_one_by_one(family, shared_demo):
    """Any family with a static forward over the context batches: four greedy jobs on the
    Qwen3.8 demo (Gated DeltaNet, PLE, QSA attention), GLM 5.2's (MLA + DSA) or GLM 5.3's
    (KDA, k-pool MLA, mHC) run at once on four slots, their decode steps sharing forwards,
    and give the text and usage each gives alone."""
    model, tk = shared_demo(f"demo:{family}")
    solo = Engine(model, tk, ctx=1024)
    try:
        want = [run_alone(solo, raw_job(p, 10)) for p in PROMPTS]
    finally:
        solo.close()
    eng = Engine(model, tk, ctx=1024, slots=4, prefill_chunk=4)
    try:
        got = run_together(eng, [raw_job(p, 10) for p in PROMPTS])
    finally:
        eng.close()
    assert eng.stats.shared_steps > 0  # their decode steps shared forwards
    for w, (_, evs) in zip(want, got):
        assert isinstance(evs[-1], Finish)
        assert evs[-1].raw_text == w.raw_text and evs[-1].usage == w.usage


def test_returning_conversation_keeps_its_slot(demo):
    model, tk = demo
    eng = Engine(model, tk, ctx=1024, slots=2)
    try:
        a1 = raw_job(PROMPTS[0])
        first = run_together(eng, [a1])[0]
        b = run_together(eng, [raw_job(PROMPTS[1])])[0]
        assert first[0].slot != b[0].slot
        fa = first[1][-1]
        # A comes back with its answer and more: its own slot, everything it holds reused
        a2 = raw_job(PROMPTS[0] + fa.raw_text + " and then")
        h, evs = run_together(eng, [a2])[0]
        assert h.slot == first[0].slot
        live_a = fa.usage.prompt_tokens + fa.usage.completion_tokens
        assert evs[-1].usage.cached_tokens == live_a
        assert eng.stats.last_cache_source in ("memory-token", "memory-text")
        # a stranger takes the shorter of the two (nothing to reuse, no slot empty)
        h3, _ = run_together(eng, [raw_job("Completely unrelated: the stock market")])[0]
        assert h3.slot == b[0].slot
    finally:
        eng.close()


def test_a_retry_takes_its_own_conversations_slot_not_another_clients(demo):
    """No slot continues a retry that rewrote its end: the victim is the slot holding the
    same conversation's earlier state (at least half its tokens shared), though it is the
    longer one, so the other client's live session stays where it is."""
    model, tk = demo
    base = " ".join(PROMPTS)
    eng = Engine(model, tk, ctx=1024, slots=2)
    try:
        a, _ = run_together(eng, [raw_job(base + " The end.")])[0]
        b, evs = run_together(eng, [raw_job(PROMPTS[1])])[0]
        assert len(eng.runners[a.slot].slot) > len(eng.runners[b.slot].slot)  # "the shortest" would take B's
        retry, _ = run_together(eng, [raw_job(base + " A new ending:")])[0]
        assert retry.slot == a.slot
        fb = evs[-1]
        back, evs = run_together(eng, [raw_job(PROMPTS[1] + fb.raw_text + " and then")])[0]
        assert back.slot == b.slot and eng.stats.last_cache_source in ("memory-token", "memory-text")
        assert evs[-1].usage.cached_tokens == fb.usage.prompt_tokens + fb.usage.completion_tokens
    finally:
        eng.close()


def test_more_jobs_than_slots_wait_and_never_evict_a_running_one(demo):
    model, tk = demo
    solo = Engine(model, tk, ctx=1024)
    try:
        want = [run_alone(solo, raw_job(p)) for p in PROMPTS]
    finally:
        solo.close()
    eng = Engine(model, tk, ctx=1024, slots=2)
    try:
        got = run_together(
            eng,
            [raw_job(p) for p in PROMPTS],
        )
    finally:
        eng.close()
    for w, (_, evs) in zip(want, got):
        assert evs[-1].raw_text == w.raw_text and evs[-1].usage == w.usage
    assert {h.slot for h, _ in got} == {0, 1}


def test_cancel_one_row_leaves_the_others_intact(demo):
    model, tk = demo
    solo = Engine(model, tk, ctx=1024)
    try:
        want = [run_alone(solo, raw_job(p, 16)) for p in PROMPTS[:3]]
    finally:
        solo.close()
    eng = Engine(model, tk, ctx=1024, slots=3)
    victim = {}

    def on_event(h, ev):
        if isinstance(ev, TextDelta) and h.job is victim.get("job"):
            h.cancel()  # after its first piece of text, mid-decode, the others running

    jobs = [raw_job(p, 16) for p in PROMPTS[:3]]
    victim["job"] = jobs[1]
    try:
        got = run_together(eng, jobs, on_event=on_event)
    finally:
        eng.close()
    assert got[1][1][-1].reason == "cancelled"
    assert got[1][1][-1].usage.completion_tokens < 16
    for i in (0, 2):
        fin = got[i][1][-1]
        assert fin.reason == want[i].reason and fin.raw_text == want[i].raw_text and fin.usage == want[i].usage


def test_mixed_prefill_quantum_interleaves_a_long_prefill(demo):
    model, tk = demo
    long_prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * 12)
    solo = Engine(model, tk, ctx=1024, prefill_quantum=8)
    try:
        want = [run_alone(solo, raw_job(PROMPTS[0], 12)), run_alone(solo, raw_job(long_prompt, 4))]
    finally:
        solo.close()
    eng = Engine(model, tk, ctx=1024, slots=2, prefill_quantum=8)
    order: list[tuple[str, str]] = []
    short, long = raw_job(PROMPTS[0], 12), raw_job(long_prompt, 4)
    try:
        got = run_together(
            eng,
            [short, long],
            on_event=lambda h, ev: order.append(("short" if h.job is short else "long", type(ev).__name__)),
        )
    finally:
        eng.close()
    for w, (_, evs) in zip(want, got):
        assert evs[-1].raw_text == w.raw_text and evs[-1].usage == w.usage
    # the short job decoded while the long prompt was still prefilling, in 8-token chunks
    long_chunks = [i for i, o in enumerate(order) if o == ("long", "PrefillProgress")]
    short_text = [i for i, o in enumerate(order) if o == ("short", "TextDelta")]
    assert len(long_chunks) > len(tk.encode(long_prompt)) // 8
    assert short_text and short_text[0] < long_chunks[-1]


# --------------------------------------------------------------------------- HTTP
def _chat(messages, seed=None):
    body = {
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 8,
        "thinking": {"type": "disabled"},
        "temperature": 0 if seed is None else 1.0,
    }
    if seed is not None:
        body["seed"] = seed
    return body


async def _stream(cs, url, body):
    async with cs.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200
        raw = await r.text()
    chunks = [json.loads(line[6:]) for line in raw.split("\n") if line.startswith("data: {")]
    assert raw.rstrip().endswith("data: [DONE]")
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    usage = [c["usage"] for c in chunks if c.get("usage")][-1]
    return text, usage


def _serve(model, tk, slots):
    from ds4mlx.serve.app import BackgroundServer, make_app
    from ds4mlx.serve.prepare import ServeConfig

    eng = Engine(model, tk, ctx=1024, default_max_tokens=8, slots=slots)
    server = BackgroundServer(make_app(eng, ServeConfig(ctx=1024, tokens=8), None)).start()
    return eng, server


def _conversations():
    return [[{"role": "user", "content": f"Conversation {i}: {p}"}] for i, p in enumerate(PROMPTS)]


def test_four_streamed_conversations_on_two_slots_equal_one_by_one(demo):
    """Two turns of four conversations, each turn of all four streamed at once on 2
    slots.  The two conversations still resident after turn 1 reuse all of their
    session (the router keeps them on their slot), the other two are prefilled cold.
    The oracle runs each conversation alone on a one-slot server: turn 1 then turn 2
    (its live session reused), and turn 2 again after another conversation (cold):
    text and usage (cached_tokens included) equal the batched run's."""
    model, tk = demo
    seeds = [None, 7, None, 11]

    async def batched(eng, url):
        convs = _conversations()
        results = []
        async with aiohttp.ClientSession() as cs:
            for _ in range(2):
                # hold the worker until all four are queued: one admission sees them all.  The
                # hold must be running before the first request is sent: a request that reaches
                # the worker first starts alone, and may evict a conversation's slot that a turn
                # queued behind the hold would have reused (the flake of loaded full runs)
                gate, holding = threading.Event(), threading.Event()
                hold = threading.Thread(target=eng.run_on_worker, args=(lambda e: holding.set() or gate.wait(60),))
                hold.start()
                assert holding.wait(60)
                pending = [asyncio.ensure_future(_stream(cs, url, _chat(c, s))) for c, s in zip(convs, seeds)]
                while eng.queue_depth < 4:
                    await asyncio.sleep(0.01)
                gate.set()
                out = await asyncio.gather(*pending)
                hold.join()
                for c, (text, _) in zip(convs, out):
                    c.append({"role": "assistant", "content": text})
                    c.append({"role": "user", "content": "Go on."})
                results.append(out)
        return convs, results

    async def alone(url, convs):
        live, cold = [], []
        async with aiohttp.ClientSession() as cs:
            for c, s in zip(convs, seeds):
                first = await _stream(cs, url, _chat(c[:1], s))
                live.append((first, await _stream(cs, url, _chat(c[:3], s))))
            for i, (c, s) in enumerate(zip(convs, seeds)):
                await _stream(cs, url, _chat(convs[(i + 1) % 4][:1], s))  # someone else's turn
                cold.append(await _stream(cs, url, _chat(c[:3], s)))
        return live, cold

    eng, server = _serve(model, tk, 2)
    try:
        convs, (turn1, turn2) = asyncio.run(batched(eng, server.url))
    finally:
        server.stop()
        eng.close()
    eng, server = _serve(model, tk, 1)
    try:
        live, cold = asyncio.run(alone(server.url, convs))
    finally:
        server.stop()
        eng.close()
    reused = 0
    for i in range(4):
        (first, second_live), second_cold = live[i], cold[i]
        assert turn1[i] == first
        assert first[1]["prompt_tokens_details"]["cached_tokens"] == 0
        resident = turn2[i][1]["prompt_tokens_details"]["cached_tokens"] > 0
        assert turn2[i] == (second_live if resident else second_cold)
        reused += resident
        assert second_live[1]["prompt_tokens_details"]["cached_tokens"] == sum(
            first[1][k] for k in ("prompt_tokens", "completion_tokens")
        )
        assert second_cold[1]["prompt_tokens_details"]["cached_tokens"] == 0
    assert reused == 2


def test_queue_events_reach_every_client(demo):
    """Submitting from many threads at once loses no job."""
    model, tk = demo
    eng = Engine(model, tk, ctx=512, slots=2)
    q: queue.Queue = queue.Queue()
    try:
        threads = [
            threading.Thread(target=lambda i=i: q.put((i, run_alone(eng, raw_job(PROMPTS[i % 4], 3)))))
            for i in range(6)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        eng.close()
    done = [q.get_nowait() for _ in range(q.qsize())]
    assert len(done) == 6 and all(f.reason == "length" and f.usage.completion_tokens == 3 for _, f in done)


def test_an_evicted_slot_is_saved_to_disk_and_restored_when_its_conversation_returns(demo, tmp_path):
    from ds4mlx.engine.checkpoints import MemoryCheckpoints
    from ds4mlx.kv.cache import DiskKVCache
    from ds4mlx.kv.policy import KVCacheOptions

    model, tk = demo
    opt = KVCacheOptions(disk_dir=str(tmp_path / "kv"), min_tokens=8, cold_max_tokens=0, continued_interval_tokens=0)
    cache = DiskKVCache.open(opt, model, ctx=1024)
    # no memory checkpoints: the disk is the only way back
    eng = Engine(model, tk, ctx=1024, slots=2, cache=cache, checkpoints=MemoryCheckpoints(budget_bytes=0))
    try:
        a = run_together(eng, [raw_job(PROMPTS[0])])[0]
        run_together(eng, [raw_job(PROMPTS[3] + " " + PROMPTS[1] + " " + PROMPTS[2])])
        # a stranger evicts the shorter conversation (A): its session goes to disk
        h, _ = run_together(eng, [raw_job("Completely unrelated: the stock market")])[0]
        assert h.slot == a[0].slot
        assert cache.stats()["stores"].get("evict") == 1
        fa = a[1][-1]
        back, evs = run_together(eng, [raw_job(PROMPTS[0] + fa.raw_text + " and then")])[0]
        assert eng.stats.last_cache_source == "disk-text"
        assert evs[-1].usage.cached_tokens == fa.usage.prompt_tokens + fa.usage.completion_tokens
    finally:
        eng.close()


def test_tool_output_continuations_find_their_own_slot():
    """Two Responses tool turns on two slots; each continuation sends only its tool
    output (it needs the live state holding its call): each goes back to its slot,
    in either order, reusing all of it.  On one slot the first is gone (400: unknown call id)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from scripted_model import ScriptedModel, serve

    from ds4mlx.runtime.tokenizer import Tokenizer

    tok = Tokenizer.default()
    dsml = 'ok.</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
    model = ScriptedModel(tok, lambda p: "ok.</think>done." if "<tool_result>" in p else dsml)
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]

    async def post(cs, url, body):
        async with cs.post(url + "/v1/responses", json=body) as r:
            return r.status, await r.json()

    async def go(url):
        async with aiohttp.ClientSession() as cs:
            turns = [await post(cs, url, {"input": f"go {who}", "tools": tools}) for who in ("A", "B")]
            outs = []
            for status, body in reversed(turns):
                assert status == 200
                call_id = body["output"][-1]["call_id"]
                item = {"type": "function_call_output", "call_id": call_id, "output": "r"}
                outs.append((body, await post(cs, url, {"input": [item], "tools": tools})))
            return outs

    with serve(tok, model, ctx=1024, slots=2) as s:
        for first, (status, body) in asyncio.run(go(s.url)):
            assert status == 200 and body["output"][-1]["content"][0]["text"] == "done."
            u0, u = first["usage"], body["usage"]
            assert u["input_tokens_details"]["cached_tokens"] == u0["input_tokens"] + u0["output_tokens"]
    with serve(tok, model, ctx=1024, slots=1) as s:
        assert [status for _, (status, _) in asyncio.run(go(s.url))] == [200, 400]  # B's state replaced A's

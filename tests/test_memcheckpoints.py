"""The in-memory checkpoints: their bound and eviction order, and the reuse they give
(a retry that rewrites the prompt's tail, a returning client, a new turn after a long answer)."""

import pytest

from ds4mlx.engine.checkpoints import MemoryCheckpoints


class FakeSession:
    def __init__(self, n: int, nbytes: int = 10):
        self.tokens = list(range(n))
        self.nbytes = nbytes

    def snapshot(self) -> bytes:
        return bytes(self.nbytes)


def lengths(cps: MemoryCheckpoints, n: int = 100) -> list[int]:
    """The checkpoint each prefix length restores (0: none)."""
    ids = list(range(n))
    return [len(cp.tokens) if (cp := cps.best(ids[:k])) else 0 for k in range(n + 1)]


def test_frontiers_are_the_aligned_positions_past_the_minimum():
    cps = MemoryCheckpoints(budget_bytes=1000, min_tokens=16, every=8)
    assert [n for n in range(40) if cps.due(n)] == [16, 24, 32]
    assert not MemoryCheckpoints(budget_bytes=1000, min_tokens=16, every=0).due(16)
    assert not MemoryCheckpoints(budget_bytes=0, min_tokens=16, every=8).due(16)


def test_the_nearest_checkpoint_below_the_common_prefix_is_restored():
    cps = MemoryCheckpoints(budget_bytes=1000, entries=8, min_tokens=8, every=8)
    cps.save(list(range(10)), FakeSession(10))  # the prompt's end
    for n in (16, 24):
        cps.save(list(range(n)), FakeSession(n), frontier=True)
    got = lengths(cps, 30)
    assert got[9] == 0 and got[10:16] == [10] * 6 and got[16:24] == [16] * 8 and got[24:] == [24] * 7


def test_frontiers_evict_older_frontiers_before_the_newest_prompt_end():
    cps = MemoryCheckpoints(budget_bytes=1000, entries=3, min_tokens=8, every=8)
    cps.save(list(range(10)), FakeSession(10))
    for n in (16, 24, 32, 40):
        cps.save(list(range(n)), FakeSession(n), frontier=True)
    assert sorted(len(c.tokens) for c in cps._items) == [10, 32, 40]  # a retry still restores the prompt
    cps = MemoryCheckpoints(budget_bytes=35, entries=8, min_tokens=8, every=8)  # the byte bound, too
    cps.save(list(range(10)), FakeSession(10))
    for n in (16, 24, 32):
        cps.save(list(range(n)), FakeSession(n), frontier=True)
    assert sorted(len(c.tokens) for c in cps._items) == [10, 24, 32]


def test_a_generation_frontier_restores_the_exact_decoded_state():
    """Demo model, the compiled lookahead decode: a frontier snapshot taken while
    generating, restored for a prompt that leaves the answer there, continues bit for
    bit like a session that stopped generating at that frontier."""
    import numpy as np

    import ds4mlx
    from ds4mlx.engine import Engine, Job
    from ds4mlx.runtime.sampling import GREEDY

    model, tok = ds4mlx.load(None)
    every = 16

    def job(ids, n):
        return Job(prompt_text=tok.decode(ids), prompt_ids=list(ids), params=GREEDY, max_tokens=n, thinking="none")

    def run(eng, ids, n):
        *_, fin = eng.generate(job(ids, n))
        assert fin.reason in ("stop", "length"), fin
        return fin

    p1 = tok.encode("<｜begin▁of▁sentence｜><｜User｜>Tell me a long story about a lighthouse.<｜Assistant｜></think>")
    a = Engine(model, tok, ctx=1024, prefill_chunk=96)
    a.checkpoints = MemoryCheckpoints(budget_bytes=1 << 30, entries=8, min_tokens=8, every=every)
    f1 = run(a, p1, 40)
    gen = list(a.session.tokens)[len(p1) :]
    assert len(gen) == 40  # the demo weights do not end within 40 tokens
    keep = len(p1) + 21
    frontier = keep // every * every
    assert len(p1) < frontier
    ids2 = p1 + gen[: keep - len(p1)] + tok.encode("<｜end▁of▁sentence｜><｜User｜>Shorter.<｜Assistant｜></think>")
    f2 = run(a, ids2, 6)
    assert a.stats.last_cache_source == "memory-checkpoint" and f2.usage.cached_tokens == frontier

    b = Engine(model, tok, ctx=1024, prefill_chunk=96)  # stopped generating at the frontier itself
    b.checkpoints = MemoryCheckpoints(budget_bytes=0)
    assert run(b, p1, frontier - len(p1)).raw_text == tok.decode(gen[: frontier - len(p1)])
    g2 = run(b, ids2, 6)
    assert b.stats.last_cache_source == "memory-token" and g2.usage.cached_tokens == frontier
    assert f2.raw_text == g2.raw_text and a.session.tokens == b.session.tokens
    assert np.array_equal(np.asarray(a.session.last_logits), np.asarray(b.session.last_logits))
    assert f1.usage.completion_tokens == 40
    a.close()
    b.close()


def test_tail_checkpoints_sit_tail_tokens_before_the_prompt_end_and_go_last():
    cps = MemoryCheckpoints(budget_bytes=1000, entries=3, min_tokens=8, every=8, tail=6)
    assert cps.tail_point(20, 0) == 14 and cps.tail_point(20, 14) == 0 and cps.tail_point(12, 0) == 0
    assert MemoryCheckpoints(budget_bytes=1000, min_tokens=8, tail=0).tail_point(20, 0) == 0
    cps.save(list(range(14)), FakeSession(14), kind="tail")
    cps.save(list(range(20)), FakeSession(20))
    for n in (24, 32, 40):
        cps.save(list(range(n)), FakeSession(n), kind="evicted")
    assert sorted(len(c.tokens) for c in cps._items) == [14, 20, 40]  # a retry still restores its tail
    assert lengths(cps, 30)[14:20] == [14] * 6


# --------------------------------------------------------------------------- prefix reuse on the demo model
@pytest.fixture(scope="module")
def demo(shared_demo):
    return shared_demo()


def words(tok, text: str, n: int) -> list[int]:
    """The first n token ids of `text` repeated."""
    ids = tok.encode(" ".join(text.split() * (n // 4 + 1)))
    assert len(ids) >= n
    return ids[:n]


def _engine(demo, budget: int = 1 << 30, **kw):
    from ds4mlx.engine import Engine

    model, tok = demo
    eng = Engine(model, tok, ctx=2048, prefill_chunk=128, **kw)
    eng.checkpoints = MemoryCheckpoints(budget_bytes=budget, min_tokens=64)
    return eng


def _run(eng, ids, n: int, slot: int | None = None):
    """Greedy raw job of `n` tokens; `slot`: the slot it must have run on."""
    import queue

    from ds4mlx.engine import Job
    from ds4mlx.runtime.events import Finish
    from ds4mlx.runtime.sampling import GREEDY

    job = Job(prompt_text=eng.tokenizer.decode(ids), prompt_ids=list(ids), raw=True, params=GREEDY, max_tokens=n)
    q: queue.Queue = queue.Queue()
    h = eng.submit(job, q.put)
    while not isinstance(fin := q.get(timeout=300), Finish):
        pass
    assert fin.reason == "length", fin
    assert slot is None or h.slot == slot
    return fin


def test_a_retry_that_rewrites_the_prompts_last_200_tokens_prefills_at_most_256(demo):
    """The prompt's tail checkpoint (256 tokens before its end): a retry whose last 200
    tokens differ restores it and prefills the rest, and answers as a fresh engine does.
    Two slots: the retry runs on the other one (the first's live state does not continue
    it, the empty slot is the victim): the checkpoints are every slot's."""
    model, tok = demo
    first = words(tok, "the lighthouse keeper counted ships in the fog", 600)
    retry = first[:400] + words(tok, "a different ending about trains and rain", 200)
    assert len(first) == len(retry) == 600 and first[400] != retry[400]
    eng = _engine(demo, slots=2)
    try:
        _run(eng, first, 4, slot=0)
        before = eng.stats.prefill_tokens
        got = _run(eng, retry, 8, slot=1)
        assert eng.stats.last_cache_source == "memory-checkpoint"
        assert eng.stats.prefill_tokens - before == 256 == len(retry) - got.usage.cached_tokens
        assert eng.stats.reused_tokens == got.usage.cached_tokens
    finally:
        eng.close()
    fresh = _engine(demo)  # the oracle: the retry alone (the same chunk ends: the tail point is one)
    try:
        want = _run(fresh, retry, 8)
    finally:
        fresh.close()
    assert got.raw_text == want.raw_text and got.usage.cached_tokens == 344


def test_two_clients_on_one_slot_do_not_evict_each_other(demo):
    """A's live session, replaced by B's request, is kept in memory: A's next turn
    continues it (prefilling only the new tokens), as if B had never come."""
    model, tok = demo
    a1 = words(tok, "client A asks about the history of bridges", 200)
    b1 = words(tok, "client B wants a recipe for bread and soup", 200)
    more = words(tok, "and then what happened next", 20)
    eng = _engine(demo)
    try:
        fa = _run(eng, a1, 6)
        a_live = list(eng.session.tokens)
        _run(eng, b1, 6)
        before = eng.stats.prefill_tokens
        got = _run(eng, a_live + more, 6)
        assert eng.stats.last_cache_source == "memory-checkpoint"
        assert got.usage.cached_tokens == len(a_live) == len(a1) + fa.usage.completion_tokens
        assert eng.stats.prefill_tokens - before == len(more)
    finally:
        eng.close()
    alone = _engine(demo)  # the oracle: A's two turns without B
    try:
        _run(alone, a1, 6)
        want = _run(alone, a_live + more, 6)
        assert alone.stats.last_cache_source == "memory-token"
    finally:
        alone.close()
    assert got.raw_text == want.raw_text

"""The bound and eviction order of the in-memory checkpoints (#17 item 5)."""

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
    from ds4mlx.sampling import GREEDY

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

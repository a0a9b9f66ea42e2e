"""The bound and eviction order of the in-memory checkpoints (#17 item 5)."""

from ds4mlx.memcheckpoints import MemoryCheckpoints


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

"""Resident session slots for `--batched-session N` (docs/kv-cache.md §11).

A slot is one live session with its own protocol bindings and disk-cache hook
state (engine/bindings.py).  The scheduler routes a job to the free slot whose live state the reuse
ladder can continue the furthest; when none can, it evicts a victim: an empty
slot first, then the slot holding an earlier state of the same conversation (its
tokens share at least half of themselves with the request: a retry, an edited
turn), then a slot idle for over an hour (oldest first), else the shortest.
A slot running a job is never a candidate.  This module only decides; the
scheduler owns the slots and the runners run the jobs on them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

STALE_AFTER_S = 3600.0  # ds4's SLOT_STALE_AFTER_SEC: idle this long = a forgotten conversation


@dataclass
class Slot:
    index: int
    session: Any = None
    cache: Any = None  # the disk cache hooks' view for this slot (its own save frontier)
    binding: Any = None  # the live session's protocol bindings (engine/bindings.py): the front end's
    thinking: Any = None  # ... and the thinking one
    active: Any = None  # the JobHandle running here, None = free
    last_used: float = 0.0  # time.monotonic() when its last job ended
    # detokenized live text, memoized for the router's memory-text probe
    text_key: tuple | None = None
    text: str = ""

    def __len__(self) -> int:
        return len(self.session) if self.session is not None else 0

    def idle_s(self, now: float | None = None) -> float:
        return (time.monotonic() if now is None else now) - self.last_used


@dataclass(frozen=True)
class Route:
    slot: Slot
    reusable: int  # live tokens the ladder reuses (0 = the slot's state is replaced)
    stale: bool = False  # the victim was picked for having been idle over STALE_AFTER_S
    shared: int = 0  # the victim was picked for sharing this many tokens with the request


def same_conversation(free: Sequence[Slot], shared: Callable[[Slot], int]) -> tuple[Slot, int] | None:
    """The slot sharing the most tokens with the request, if they are at least half of
    its own (an earlier state of the request's conversation), with that count."""
    best = max(((shared(s), s) for s in free if len(s)), key=lambda t: t[0], default=None)
    return (best[1], best[0]) if best is not None and best[0] > 0 and 2 * best[0] >= len(best[1]) else None


def eviction_victim(free: Sequence[Slot], now: float | None = None) -> tuple[Slot, bool]:
    """(victim, stale): empty slots first, then idle > STALE_AFTER_S oldest first,
    else the shortest (least prefilled work lost; the longest idle on a tie)."""
    now = time.monotonic() if now is None else now
    empty = [s for s in free if len(s) == 0]
    if empty:
        return empty[0], False
    stale = [s for s in free if s.idle_s(now) > STALE_AFTER_S]
    if stale:
        return min(stale, key=lambda s: s.last_used), True
    return min(free, key=lambda s: (len(s), s.last_used)), False


def route(
    free: Sequence[Slot],
    reusable: Callable[[Slot], int],
    now: float | None = None,
    shared: Callable[[Slot], int] | None = None,
) -> Route:
    """The free slot with the longest reusable prefix (`reusable(slot)`, the reuse
    ladder's probe); if no slot reuses anything, the eviction victim: an empty slot,
    else the same conversation's (`shared(slot)`: tokens in common with the request),
    else `eviction_victim`'s."""
    best, best_n = None, 0
    for s in free:
        n = reusable(s) if len(s) else 0
        if n > best_n:
            best, best_n = s, n
    if best is not None:
        return Route(best, best_n)
    same = same_conversation(free, shared) if shared is not None and all(len(s) for s in free) else None
    if same is not None:
        return Route(same[0], 0, shared=same[1])
    victim, stale = eviction_victim(free, now)
    return Route(victim, 0, stale)

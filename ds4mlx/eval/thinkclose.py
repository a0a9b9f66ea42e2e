"""The `</think>` budget controller of ds4-eval (docs/eval.md §3) and the
token-level generation loop shared by the in-process and the fake backends.

While thinking is open, with `remaining = limit - generated` before each step:
1. a forced close sequence in progress emits its next token;
2. `remaining <= hard_budget`: hard close (the first close token now, the rest next);
3. `remaining <= soft_budget` and the close sequence is one token ranked within
   the top `soft_rank` logits: soft close;
4. otherwise the sampler decides.
The close sequence is the *plain-text* tokenization of `</think>` (ds4 does not
use the special id here), so with a real tokenizer the soft rule never fires.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..chat.markers import THINK_CLOSE


@dataclass
class CloseEvent:
    kind: str = "none"  # none | natural | soft_forced | hard_forced
    token_index: int = 0
    remaining: int = 0
    rank: int = 0


def default_budgets(limit: int, soft: int | None = None, hard: int | None = None) -> tuple[int, int]:
    """ds4's 1024/512 budgets, scaled down for small limits unless given explicitly."""
    h = hard if hard is not None else min(512, max(1, limit // 4))
    s = soft if soft is not None else max(h, min(1024, max(1, limit // 2)))
    return s, h


class ThinkCloser:
    def __init__(
        self,
        close_ids: Sequence[Hashable],
        *,
        soft_budget: int = 1024,
        hard_budget: int = 512,
        soft_rank: int = 3,
        thinking: bool = True,
    ):
        self.close_ids = list(close_ids)
        self.soft_budget = soft_budget
        self.hard_budget = hard_budget
        self.soft_rank = soft_rank
        self.open = thinking
        self.pending: list[Hashable] = []
        self.event = CloseEvent()
        self._forced = False

    def choose(self, generated: int, limit: int, rank_of: Callable[[Hashable], int]) -> Hashable | None:
        """A forced token for this step, or None to let the sampler pick."""
        if not self.open:
            return None
        remaining = limit - generated
        if self.pending:
            return self.pending.pop(0)
        if remaining <= self.hard_budget and self.close_ids:
            self.pending = self.close_ids[1:]
            self._record("hard_forced", generated + 1, remaining, 0)
            return self.close_ids[0]
        if remaining <= self.soft_budget and len(self.close_ids) == 1:
            rank = rank_of(self.close_ids[0])
            if 1 <= rank <= self.soft_rank:
                self._record("soft_forced", generated + 1, remaining, rank)
                return self.close_ids[0]
        return None

    def _record(self, kind: str, index: int, remaining: int, rank: int) -> None:
        self._forced = True
        if self.event.kind == "none":
            self.event = CloseEvent(kind, index, remaining, rank)

    def after_token(self, closed_now: bool, generated: int, remaining_before: int) -> None:
        """Call after each appended token; `closed_now` = raw now contains `</think>`."""
        if self.open and closed_now:
            self.open = False
            self.pending = []
            if self.event.kind == "none":
                self.event = CloseEvent("natural", generated, remaining_before, 0)


class Interrupted(Exception):
    """Raised by `Control.check()`: the case was stopped (`q`) or switched (Enter)."""

    def __init__(self, status: str):
        super().__init__(status)
        self.status = status  # STOPPED | SWITCHED


@dataclass
class GenResult:
    raw: str = ""
    prompt_tokens: int = 0
    generated_tokens: int = 0
    finish: str = "length"  # stop | length | stopped | switched | error | skipped
    close: CloseEvent = field(default_factory=CloseEvent)
    elapsed: float = 0.0  # generation phase only, pauses excluded
    error: str = ""
    spec: dict | None = None  # speculative decoding: this case's counters (SpecStats.as_dict())


class Xorshift64Star:
    """ds4's sampler RNG (xorshift64*, shifts 12/25/27)."""

    def __init__(self, seed: int):
        self.state = (seed & 0xFFFFFFFFFFFFFFFF) or 0x9E3779B97F4A7C15

    def next_u64(self) -> int:
        x = self.state
        x ^= x >> 12
        x ^= (x << 25) & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 27
        self.state = x
        return (x * 0x2545F4914F6CDD1D) & 0xFFFFFFFFFFFFFFFF

    def uniform(self) -> float:
        return ((self.next_u64() >> 40) & 0xFFFFFF) / float(1 << 24)


def run_token_loop(
    *,
    limit: int,
    closer: ThinkCloser,
    control: Any,
    pick: Callable[[], Hashable],
    rank_of: Callable[[Hashable], int],
    is_eos: Callable[[Hashable], bool],
    advance: Callable[[Hashable], str],
    on_text: Callable[[str], None],
    result: GenResult,
) -> GenResult:
    """The ds4-eval decode loop.  `pick()` samples from the current logits,
    `advance(tok)` evaluates the token and returns its text.  Sets result.raw,
    generated_tokens, finish, close and elapsed."""
    raw: list[str] = []
    tail = ""
    t_start = time.monotonic()
    paused0 = control.paused_seconds if control is not None else 0.0
    generated = 0
    result.finish = "length"
    try:
        while generated < limit:
            if control is not None:
                control.check()
            remaining = limit - generated
            tok = closer.choose(generated, limit, rank_of)
            if tok is None:
                tok = pick()
            if is_eos(tok):
                result.finish = "stop"
                break
            text = advance(tok)
            generated += 1
            raw.append(text)
            on_text(text)
            tail = (tail + text)[-(len(THINK_CLOSE) + len(text)) :]
            if closer.open:
                closer.after_token(THINK_CLOSE in tail, generated, remaining)
    except Interrupted as e:
        result.finish = e.status.lower()
    finally:
        paused = (control.paused_seconds if control is not None else 0.0) - paused0
        result.elapsed = max(0.0, time.monotonic() - t_start - paused)
        result.raw = "".join(raw)
        result.generated_tokens = generated
        result.close = closer.event
    return result

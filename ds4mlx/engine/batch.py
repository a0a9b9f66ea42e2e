"""One engine step: planned, then run (docs/kv-cache.md §11).

A step carries the decode rows of every running request plus prefill chunks of
the requests still prefilling, under a token budget (vLLM v1's `{request:
n_tokens}` schedule, llama.cpp's one batch per `update_slots`).  Each request
asks for its next piece of work by yielding it: a `StepRequest` (one decode
token, decode.py) or a `ChunkRequest` (its next prefill chunk, engine/prefill.py).

`plan_step` decides what runs: every decode row (one token each), then the
chunks in admission order while rows + chunk tokens fit the budget — the first
chunk always goes, so a prefill advances by at least one chunk a step and a
running stream waits for at most one chunk between its tokens.  `run_plan` runs
it: the rows in one forward where the family can (`decode.run_steps`), then the
chunks (a prefill forward each).  A chunk that is not planned waits, with its
request, for a later step; where its chunk ends never depends on what else runs
(engine/prefill.py `chunk_ends`), so a prompt splits the same alone or batched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from ..runtime.decode import StepRequest, run_steps


class ChunkRequest:
    """A prefill chunk a request waits for: feed `ids` to `session` (`Session.prefill`)."""

    __slots__ = ("session", "ids", "logits", "error")

    def __init__(self, session, ids: list[int]):
        self.session, self.ids = session, ids
        self.logits = None
        self.error: BaseException | None = None

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def ran(self) -> bool:
        return self.logits is not None or self.error is not None

    def run(self) -> None:
        try:
            self.logits = self.session.prefill(self.ids)
        except Exception as e:  # noqa: BLE001 - its request raises it
            self.error = e

    def result(self):
        """The last token's logits (np [V]); the chunk's failure is raised here."""
        if self.error is not None:
            raise self.error
        return self.logits


Work = StepRequest | ChunkRequest


@dataclass
class StepPlan:
    rows: list[StepRequest] = field(default_factory=list)  # decode rows, one token each
    chunks: list[ChunkRequest] = field(default_factory=list)  # prefill chunks, in admission order

    @property
    def tokens(self) -> int:
        return len(self.rows) + sum(len(c) for c in self.chunks)


def plan_step(wants: Sequence[Work], budget: int) -> StepPlan:
    """What one step runs of the work the requests wait for (in admission order): every
    decode row, then prefill chunks while the step's tokens fit `budget`; the first chunk
    always runs (a prefill never starves behind many rows, and a chunk is never cut)."""
    plan = StepPlan(rows=[w for w in wants if isinstance(w, StepRequest)])
    used = len(plan.rows)
    for w in wants:
        if isinstance(w, ChunkRequest) and (not plan.chunks or used + len(w) <= budget):
            plan.chunks.append(w)
            used += len(w)
    return plan


def run_plan(plan: StepPlan, together: bool = True) -> int:
    """Run a step: the decode rows (one forward where the family can; lazy, their loops
    read them), then the prefill chunks.  Returns how many rows shared a forward."""
    shared = run_steps(plan.rows, together) if plan.rows else 0
    if plan.chunks:  # the rows go to the device first: the chunk's forward queues behind them
        mx.async_eval([r.logits for r in plan.rows if r.logits is not None])
    for c in plan.chunks:
        c.run()
    return shared

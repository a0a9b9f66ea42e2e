"""What the agent worker tells a front end (called on the worker thread).

A front end renders these; it never sees raw tool-call text.  Answer and reasoning
text are the engine's own deltas (`events.TextDelta` / `events.ReasoningDelta`),
passed through; the rest is the agent's.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..runtime.events import ReasoningDelta, TextDelta

# tool card lifecycle
PARSING, AWAITING_APPROVAL, RUNNING, DONE, FAILED, STOPPED, DENIED = (
    "parsing",
    "awaiting approval",
    "running",
    "done",
    "failed",
    "stopped",
    "denied",
)


@dataclass
class Status:
    state: str = "idle"  # idle | prefill | generating | tool | compacting
    ctx_used: int = 0
    ctx_total: int = 0
    generated: int = 0
    gen_tps: float = 0.0
    greedy: bool = False  # sampling greedily inside tool-call structure
    prefill_done: int = 0
    prefill_total: int = 0
    prefill_tps: float = 0.0
    cached: int = 0  # tokens reused by the last job (live session or disk checkpoint)


@dataclass(frozen=True)
class ToolCard:
    index: int
    name: str
    state: str
    summary: str = ""  # the one-line view: `$ cmd`, a path
    detail: str = ""  # result head / error


@dataclass(frozen=True)
class Notice:
    text: str
    kind: str = "info"  # info | compaction | error | session


@dataclass(frozen=True)
class TurnEnd:
    reason: str  # answered | stopped | error | max_steps
    error: str | None = None


__all__ = [
    "PARSING",
    "AWAITING_APPROVAL",
    "RUNNING",
    "DONE",
    "FAILED",
    "STOPPED",
    "DENIED",
    "Status",
    "TextDelta",
    "ReasoningDelta",
    "ToolCard",
    "Notice",
    "TurnEnd",
]

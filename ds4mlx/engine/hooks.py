"""Where the disk KV cache plugs into the engine (docs/kv-cache.md §2 steps 8–10, §5;
the call points kv/policy.py describes).

Every hook runs on the worker thread and gets the `SlotContext` of the slot whose
job reached the call point (with `--batched-session N` each slot has its own hooks
object, `for_slot()`).  The default does nothing; a hook that raises is logged and
ignored (`call_hook`): the cache must never break generation.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .job import Job

log = logging.getLogger("ds4mlx.engine")


class SlotContext(Protocol):
    """What a hook may use of the slot it runs for (engine/runner.py's SlotRunner)."""

    session: Any  # the slot's live session (session.py)
    tokenizer: Any
    tool_memory: Any

    def tokenize(self, text: str) -> list[int]: ...

    def reset_session(self) -> None:
        """Empty the slot's session (a restore that failed half-way)."""

    def live_visible_text(self) -> str | None:
        """The visible transcript a binding remembers for the live session: the key of visible-keyed saves."""

    def live_visible_key(self) -> tuple[str, str] | None:
        """(kind, visible transcript) of `live_visible_text`."""


class CacheHooks:
    """The engine's cache call points; the default does nothing."""

    def on_miss(self, slot: SlotContext) -> None:
        """Full live miss, before the live session is replaced (evict save)."""

    def try_load(self, slot: SlotContext, job: Job) -> tuple[list[int], int] | None:
        """disk-text reuse: restore a checkpoint into slot.session and return
        (effective tokens, cached) — cached == len(slot.session)."""
        return None

    def cold_save_point(self, slot: SlotContext, job: Job, effective: list[int]) -> int:
        """Cold prefill: a prefix length to checkpoint (0 = none).  The engine
        prefills exactly that many tokens, calls `on_cold_prefix`, then goes on."""
        return 0

    def on_cold_prefix(self, slot: SlotContext, job: Job, n_tokens: int) -> None:
        """The session holds exactly the first n_tokens of the prompt (cold save)."""

    def prefill_stops(self, slot: SlotContext, job: Job, start: int, end: int) -> Sequence[int]:
        """Absolute positions in (start, end) where a prefill chunk must end
        (continued-save frontiers), on top of the absolute multiples of the
        prefill chunk."""
        return ()

    def on_progress(self, slot: SlotContext, job: Job) -> None:
        """After each prefill chunk and each decoded token, except while a tool
        call is being generated (continued saves)."""

    def after_prefill(self, slot: SlotContext, job: Job) -> None:
        """The prompt is synced; generation starts next."""

    def on_shutdown(self, slot: SlotContext) -> None:
        """Save the live session at exit."""


def call_hook(fn, *args):
    """Run a hook; its failure is logged, never raised (the cache must never break generation)."""
    try:
        return fn(*args)
    except Exception:
        log.exception("disk cache hook %s failed", getattr(fn, "__name__", fn))
        return None

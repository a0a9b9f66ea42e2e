"""The reuse ladder (docs/kv-cache.md §2): how much of a slot's state a request
continues, cheapest first — the live session's protocol bindings, its tokens, its
text, an in-memory checkpoint, the disk cache (through the hooks), else cold.

No partial reuse of the live session: truncating a V4 session means recomputing it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from .bindings import KEEP_BINDING, KEEP_THINKING, visible_prefix
from .hooks import call_hook
from .job import Failed, Job, LiveBinding
from .runner import SlotRunner

log = logging.getLogger("ds4mlx.engine")

# (effective tokens, cached, source, binding kept): what a request's prefill starts from
Plan = tuple[list[int], int, str, "str | None"]


@dataclass(frozen=True)
class Rung:
    """A rung of the live ladder a slot serves."""

    source: str  # the reuse source reported in the stats
    tail: str | None  # text to tokenize after the live tokens; None = the request's own ids
    kept: str | None  # the binding that stays valid (engine/bindings.py), None = none

    @property
    def live_state(self) -> bool:
        """Served through the front end's binding: enough for a request that `requires_live`."""
        return self.kept == KEEP_BINDING


def live_rung(r: SlotRunner, job: Job, ids: list[int]) -> Rung | None:
    """The first rung of the live ladder (docs/kv-cache.md §2 steps 1-3, 5-7) the slot's
    session serves, or None.  Tokenizes nothing: the router probes every free slot with it."""
    live = r.session.tokens
    pos = len(live)
    if pos == 0:
        return None
    prompt = job.prompt_text
    front, think = r.bindings()
    want: LiveBinding | None = job.binding
    mine = front if want is not None and front is not None and front.key == want.key else None
    # 1. <key>-visible: the front end's remembered visible transcript
    if want is not None and want.visible:
        n = visible_prefix(mine, pos, prompt)
        if n is not None:
            return Rung(f"{want.key}-visible", prompt[n:], KEEP_BINDING)
    # 2./3. tool-output continuation by call ids
    if (
        want is not None
        and job.continuation_tail is not None
        and job.continuation_ids
        and mine is not None
        and mine.live_tokens == pos
        and mine.call_ids == job.continuation_ids
    ):
        return Rung(f"{want.key}-tool-output", job.continuation_tail, KEEP_BINDING)
    # 5. memory-token: the live tokens are a prefix of the request tokens
    if len(ids) >= pos and list(ids[:pos]) == list(live):
        return Rung("memory-token", None, None)
    # 6. thinking-visible (a front end without a visible binding of its own)
    if not job.raw and not (want is not None and want.visible):
        n = visible_prefix(think, pos, prompt)
        if n is not None:
            return Rung("thinking-visible", prompt[n:], KEEP_THINKING)
    # 7. memory-text: decode(live) is a byte prefix of the prompt
    live_text = r.live_text()
    if prompt.startswith(live_text):
        return Rung("memory-text", prompt[len(live_text) :], None)
    return None


def reusable(r: SlotRunner, job: Job) -> int:
    """Live tokens of the slot a job would continue (0 = none): the router's probe."""
    if job.prompt_ids is None:
        job.prompt_ids = r.tokenize(job.prompt_text)
    rung = live_rung(r, job, job.prompt_ids)
    return len(r.slot) if rung is not None and not (job.requires_live and not rung.live_state) else 0


def shared_tokens(r: SlotRunner, job: Job) -> int:
    """Tokens the slot's session has in common with the request (its leading ones):
    the router's sign of the same conversation."""
    if job.prompt_ids is None:
        job.prompt_ids = r.tokenize(job.prompt_text)
    live, ids = r.session.tokens, job.prompt_ids
    return next((i for i, (a, b) in enumerate(zip(live, ids)) if a != b), min(len(live), len(ids)))


def plan(r: SlotRunner, job: Job, ids: list[int]) -> Plan | Failed:
    """-> (effective tokens, cached, source, binding kept) or Failed."""
    live = list(r.session.tokens)
    pos = len(live)
    rung = live_rung(r, job, ids)
    if rung is not None and rung.live_state:
        return live + r.tokenize(rung.tail or ""), pos, rung.source, rung.kept
    # 4. the request cannot be served without the live state it refers to
    if job.requires_live:
        return Failed(409, (job.binding or LiveBinding("")).missing)
    if rung is not None:
        return (ids if rung.tail is None else live + r.tokenize(rung.tail)), pos, rung.source, rung.kept
    if pos > 0:
        common = next((i for i, (a, b) in enumerate(zip(live, ids)) if a != b), min(pos, len(ids)))
        log.info("live kv cache miss live=%d prompt=%d common=%d", pos, len(ids), common)
        r.checkpoint_evicted()  # its client's next turn restores it instead of prefilling again
    # 7b. an in-memory checkpoint (engine/checkpoints.py; the live session cannot rewind)
    cp = r.checkpoints.best(ids)
    if cp is not None and r.restore_checkpoint(cp):
        if pos > 0:
            call_hook(r.cache.on_miss, r)
        return ids, len(cp.tokens), "memory-checkpoint", None
    # 8.–10. disk cache, then cold
    if pos > 0:
        call_hook(r.cache.on_miss, r)
    loaded = call_hook(r.cache.try_load, r, job)
    if loaded:
        eff, cached = loaded
        return list(eff), int(cached), "disk-text", None
    return ids, 0, "none", None

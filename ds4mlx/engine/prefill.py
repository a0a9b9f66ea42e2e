"""A request's prefill: bring its slot's session to the planned tokens, evaluating
only the part not reused, in chunks (docs/kv-cache.md §2, §5)."""

from __future__ import annotations

import logging
import time

from ..runtime.events import PrefillProgress
from .batch import ChunkRequest
from .hooks import call_hook
from .job import JobHandle, job_kind
from .runner import SlotRunner

log = logging.getLogger("ds4mlx.engine")


def chunk_ends(r: SlotRunner, h: JobHandle, cached: int, total: int, marks: tuple[int, ...]) -> list[int]:
    """Where the prefill chunks of (cached, total] end, absolute positions: multiples of
    the prefill chunk (a resumed prefill realigns) and of the prefill quantum, the
    `marks` (the cold save point, the tail checkpoint; 0 = none) and the cache's
    continued frontiers."""
    eng = r.engine
    step = eng.prefill_chunk
    stops = {*range(cached - cached % step + step, total, step), total, *(m for m in marks if m)}
    q = eng.prefill_quantum
    if q is not None and q < step:
        stops.update(range(cached - cached % q + q, total, q))
    extra = call_hook(r.cache.prefill_stops, r, h.job, cached, total) or ()
    stops.update(p for p in extra if cached < p < total)
    return sorted(stops)


def sync(r: SlotRunner, h: JobHandle, effective: list[int], cached: int):
    """Bring the session to `effective`, evaluating only `effective[cached:]`.
    Returns (logits for the next token, or None if cancelled; tokens reused).
    A generator: it yields each chunk's `ChunkRequest` and goes on once a step ran it."""
    s = r.session
    if cached == 0 or cached != len(s) or list(s.tokens[:cached]) != effective[:cached]:
        if len(s):
            r.reset_session()
        cached = 0
    suffix = effective[cached:]
    total = len(effective)
    h.emit(PrefillProgress(cached, total))
    if not suffix:
        logits = getattr(s, "last_logits", None)
        if logits is not None:
            return logits, cached
        # No logits kept for the last token: evaluate it again.
        r.reset_session()
        cached, suffix = 0, list(effective)
    cold = 0
    if cached == 0:
        cold = int(call_hook(r.cache.cold_save_point, r, h.job, effective) or 0)
        cold = cold if 0 < cold <= len(effective) else 0
    tail = r.tail_point(total, cached)  # a retry that rewrites the prompt's end restores it
    return (yield from _chunks(r, h, effective, cached, cold, tail))


def _chunks(r: SlotRunner, h: JobHandle, effective: list[int], cached: int, cold: int, tail: int):
    """Prefill effective[cached:] chunk by chunk, each a `ChunkRequest` the scheduler runs."""
    s, stats = r.session, r.engine.stats
    total = len(effective)
    suffix = effective[cached:]
    done = cached
    t0 = time.monotonic()
    logits = None
    start = 0
    for end in (p - cached for p in chunk_ends(r, h, cached, total, (cold, tail))):
        if h.cancelled:
            return None, cached
        chunk = suffix[start:end]
        start = end
        work = ChunkRequest(s, chunk)
        yield work  # the scheduler runs it in a step (engine/batch.py)
        if not work.ran:  # cancelled while it waited for its step
            return None, cached
        logits = work.result()
        stats.prefill_tokens += len(chunk)
        done += len(chunk)
        if tail and done == tail:
            r.checkpoint_tail(effective[:tail])
        if cold and done == cold:
            call_hook(r.cache.on_cold_prefix, r, h.job, cold)
        call_hook(r.cache.on_progress, r, h.job)
        h.emit(PrefillProgress(done, total))
        dt = time.monotonic() - t0
        log.info(
            "%s prefill chunk %d/%d (%.1f%%) %.2f t/s %.3fs",
            job_kind(h.job),
            done - cached,
            total - cached,
            100.0 * (done - cached) / max(total - cached, 1),
            (done - cached) / dt if dt > 0 else 0.0,
            dt,
        )
    return logits, cached

"""One request's life on its slot, the per-request state machine: plan the reuse
(engine/reuse.py), prefill what is not reused (engine/prefill.py), decode
(engine/decoding.py), finish.  A generator the scheduler advances one turn at a
time: it yields the work each step runs for it (engine/batch.py) — a `ChunkRequest`
before each prefill chunk, with batched decode steps the `StepRequest` of each
token — and None at the other token boundaries.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from ..runtime.events import Finish, Started, Usage
from . import reuse
from .batch import Work
from .decoding import Decoding
from .hooks import call_hook
from .job import Failed, JobHandle, job_kind
from .prefill import sync
from .prompt_logprobs import prompt_logprobs
from .runner import SlotRunner

log = logging.getLogger("ds4mlx.engine")


def run_request(r: SlotRunner, h: JobHandle) -> Iterator[Work | None]:
    """Run one job on the runner's slot."""
    job, eng = h.job, r.engine
    eng.stats.jobs += 1
    ids = job.prompt_ids if job.prompt_ids is not None else r.tokenize(job.prompt_text)
    if r.live_images is not None and not job.images:
        r.reset_session()  # a text request never reuses image KV (docs/vision.md §3)
        r.live_images = None
    if job.images:
        from ..vision import reuse as image_reuse  # only image jobs load the vision code

        plan = image_reuse.plan(r, job, ids)
    else:
        plan = reuse.plan(r, job, ids)
    if isinstance(plan, Failed):
        h.emit(plan)
        return
    effective, cached, source, kept = plan
    eng.stats.last_cache_source = source
    if len(effective) >= eng.ctx:
        h.emit(Failed(500, "prompt exceeds context"))
        return
    if cached:
        log.info("%s live kv reuse source=%s cached=%d prompt=%d", job_kind(job), source, cached, len(effective))
    if job.images:
        logits, cached = yield from _prefill_images(r, h, effective, cached)
    else:
        logits, cached = yield from sync(r, h, effective, cached)
    prompt_tokens = len(effective)
    if logits is None:  # cancelled during prefill; the session keeps the evaluated prefix
        r.clear_bindings(keep=None)
        eng.stats.cancelled += 1
        usage = Usage(prompt_tokens, 0, cached, prompt_tokens - cached)
        h.finish(Finish("cancelled", usage, error="cancelled during prefill"))
        return
    eng.stats.reused_tokens += cached
    r.clear_bindings(keep=kept)
    r.checkpoint(effective, cached)
    call_hook(r.cache.after_prefill, r, job)
    echoed = None
    if job.echo is not None and job.logprobs is not None:
        echoed = prompt_logprobs(eng.model, eng.tokenizer, list(effective), job.echo, int(job.logprobs))
    h.started = True
    # source: where `cached` came from (/metrics)
    h.emit(Started(prompt_tokens, cached, source, echo=job.echo, prompt_logprobs=echoed))
    yield from Decoding(r, h, logits, prompt_tokens, cached, echoed).steps()


def _prefill_images(r: SlotRunner, h: JobHandle, effective: list[int], cached: int):
    """The prefill of a prompt with image blocks (docs/vision.md): their encoder rows in place."""
    from ..vision import reuse as image_reuse

    job = h.job
    r.live_images = image_reuse.record(job.images, effective)  # before the prefill: hooks stay silent
    with image_reuse.rows_installed(r, job, cached):
        logits, cached = yield from sync(r, h, effective, cached)
    if logits is None:
        r.reset_session()  # a half-prefilled image block is no reusable state
        r.live_images = None
    else:
        image_reuse.keep_checkpoint(r, job, effective)
    return logits, cached

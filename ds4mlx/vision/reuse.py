"""Which live KV an image request may reuse, and keeping vision state off the caches
(docs/vision.md §3).

An image token's KV rows depend on the image, not on its token id: equal tokens do not
prove equal KV.  So the engine records, for the live session, the image spans
(position, length, fingerprint) it prefilled (`LiveImages`), and an image request reuses
the live prefix only when

* the live tokens are a prefix of the request's tokens,
* every live image span is, exactly, a span of the request, and every request span
  that starts inside the reused prefix is a live span (same position, length and
  fingerprint), and no request span is cut by the end of the reused prefix;

else the one image checkpoint (`VisionCheckpoint`: the session at the end of the
last image prompt, with its spans) is tried under the same rule (a retry, the same
conversation sent again); otherwise the session is rebuilt from the first token.  A text
request never reuses a session holding images (the engine resets it first).  While images are live,
`GuardedHooks` keeps the disk KV cache (and the engine keeps its memory checkpoints)
from storing the state: their keys are token ids, which cannot tell the images apart.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

from .encoder import ImageRows, ImageSpan, PromptPositions
from .load import backbone_of


@dataclass(frozen=True)
class LiveImages:
    spans: tuple[ImageSpan, ...]
    prefix: tuple[int, ...]  # the session's tokens up to the end of the last span

    def holds(self, tokens: list[int]) -> bool:
        """The session still has these images (it was not reset or replaced since)."""
        n = len(self.prefix)
        return len(tokens) >= n and tuple(tokens[:n]) == self.prefix


def record(spans, tokens: list[int]) -> LiveImages | None:
    if not spans:
        return None
    end = max(s.start + s.length for s in spans)
    return LiveImages(tuple(spans), tuple(tokens[:end]))


def reusable(live: LiveImages | None, live_tokens: list[int], ids: list[int], spans, whole: bool = False) -> int:
    """How many live tokens the request (ids + its image spans) may reuse (0 = none);
    `whole`: the request may be exactly the live tokens (a checkpoint keeps the logits)."""
    pos = len(live_tokens)
    if pos == 0 or len(ids) < pos or (len(ids) == pos and not whole) or ids[:pos] != live_tokens:
        return 0
    live_spans = set(live.spans) if live is not None and live.holds(live_tokens) else set()
    if live is not None and not live_spans:
        return 0  # the recorded images are not in the session any more: nothing is known
    before = {s for s in spans if s.start < pos}
    if any(s.start + s.length > pos for s in before):
        return 0  # the reused prefix would end inside an image block
    return pos if before == live_spans else 0


@dataclass(frozen=True)
class VisionCheckpoint:
    images: LiveImages
    tokens: tuple[int, ...]
    blob: bytes  # Session.snapshot() at the end of the prompt (logits included)


def plan(engine, job, ids: list[int]):
    """(effective tokens, cached, source, binding kept) for an image job (engine/reuse.py)."""
    live_tokens = list(engine.session.tokens)
    n = reusable(engine.live_images, live_tokens, ids, job.images)
    if n:
        return ids, n, "vision-prefix", None
    cp = engine.vision_checkpoint
    if cp is not None and reusable(cp.images, list(cp.tokens), ids, job.images, whole=True):
        try:
            engine.session.restore(cp.blob)
        except ValueError:
            engine.vision_checkpoint = None
        else:
            engine.live_images = cp.images
            return ids, len(cp.tokens), "vision-checkpoint", None
    if live_tokens:
        engine.reset_session()
    return ids, 0, "none", None


def keep_checkpoint(engine, job, effective: list[int]) -> None:
    """The session at the end of an image prompt, for a retry of the same images
    (within the memory-checkpoint budget; one entry)."""
    budget = getattr(engine.checkpoints, "budget", 0)
    if not budget or engine.live_images is None:
        return
    try:
        blob = engine.session.snapshot()
    except Exception:  # a session without snapshots: nothing kept, nothing lost
        return
    if len(blob) <= budget:
        engine.vision_checkpoint = VisionCheckpoint(engine.live_images, tuple(effective), blob)


@contextmanager
def rows_installed(engine, job, cached: int):
    """The encoder rows of the job's images past `cached`, hooked into the model's
    embedding step for the prefill (computed here, on the engine's worker thread)."""
    todo = [(s, im) for s, im in zip(job.images, job.image_inputs) if s.start + s.length > cached]
    bb = backbone_of(engine.model)
    if not todo:
        yield
        return
    hook = ImageRows.for_spans([s for s, _ in todo], [engine.vision.rows(im) for _, im in todo])
    bb.input_rows = hook
    mrope = hasattr(bb, "input_positions")  # a backbone with 3D (t, h, w) rope positions
    if mrope:
        bb.input_positions = PromptPositions(job.images, engine.vision.tower.args.spatial_merge_size)
    try:
        yield
    finally:
        bb.input_rows = None
        if mrope:
            bb.input_positions = None


class GuardedHooks:
    """The engine's CacheHooks, silenced while `vision_live()` (docs/vision.md §3): the
    disk KV cache stores text-only prefixes."""

    SILENCED = ("cold_save_point", "on_cold_prefix", "prefill_stops", "on_progress", "after_prefill", "on_shutdown")

    def __init__(self, inner, vision_live: Callable[[], bool]):
        self.inner, self.vision_live = inner, vision_live

    def __getattr__(self, name):
        fn = getattr(self.inner, name)
        if name not in self.SILENCED or not callable(fn):
            return fn

        def guarded(*args, **kwargs):
            return None if self.vision_live() else fn(*args, **kwargs)

        return guarded

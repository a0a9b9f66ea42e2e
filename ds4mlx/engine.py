"""The engine: one owner of the model and its live session, a FIFO of jobs and
one worker thread that runs them (docs/http-api.md §1.4, docs/kv-cache.md §2).

A front end builds a `Job` (rendered prompt, sampling, limits, protocol
flags), calls `Engine.submit(job, emit)` and receives `ds4mlx.events` through
`emit` (called on the worker thread), ending with one `Finish` — or with a
`Failed` when the job could not start (HTTP status + message).
`Engine.generate(job)` is the blocking iterator form for the CLI and tests.

Per job the worker:
1. picks the longest reusable live state (`_plan_reuse`, docs/kv-cache.md §2
   steps 1–7; no partial reuse: truncating a V4 session means recomputing
   it) — the disk cache plugs in at `CacheHooks`;
2. prefills only the new suffix, in chunks, emitting `PrefillProgress` and
   checking for cancellation between chunks;
3. decodes: sampler (greedy inside DSML structure) -> detokenizer -> stop
   matcher -> output parser -> events; cancellation is checked per token;
4. finishes: final parse, tool ids, tool memory, protocol bindings.

Batching later: the scheduler only touches `_queue`/`_run`; a batched worker
would pop several handles and interleave their decode steps.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from .decode import decode_tokens
from .detok import Detokenizer, StopMatcher
from .events import (
    Finish,
    PrefillProgress,
    Started,
    TextDelta,
    Usage,
)
from .memcheckpoints import MemoryCheckpoints
from .prefill_chunk import default_chunk
from .sampling import GREEDY, DeviceSampler, Sampler, SamplingParams

log = logging.getLogger("ds4mlx.engine")

UNTERMINATED_TOOL_CALL = "unterminated tool call"  # chat.markers.PARSE_UNTERMINATED_TOOL_CALL


@dataclass(frozen=True)
class Failed:
    """Terminal event of a job that could not start generating.  The front end
    answers HTTP `status` with `message` if it has not sent anything yet."""

    status: int
    message: str


@dataclass
class Job:
    """One generation request, already rendered and validated."""

    prompt_text: str
    prompt_ids: list[int] | None = None  # tokenization of prompt_text (if done for the ctx check)
    api: str = "chat"  # chat | completions | anthropic | responses
    raw: bool = False  # completions: the raw text is the output (no reasoning/DSML split)
    thinking: str = "high"  # none | high | max
    tools_active: bool = False
    params: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None  # None = the engine default (--tokens)
    stop: Sequence[str] = ()
    ignore_eos: bool = False
    tool_id_prefix: str = "call_"
    # tool_choice required / named: text forced at the start of the answer (after
    # the reasoning), e.g. the DSML block open and invoke tag (build.force_text).
    force_text: str | None = None
    # Live tool-output continuation (Responses / Anthropic, docs/kv-cache.md §2 steps 2–4):
    # the rendered live tail (docs/chat-template.md §4.5, starts with ⟨EOS⟩) and the id set
    # of the trailing tool outputs; `requires_live` = the request cannot be served
    # without that live state (its tool outputs answer calls it does not replay).
    continuation_tail: str | None = None
    continuation_ids: frozenset = frozenset()
    requires_live: bool = False
    preserves_reasoning: bool = False  # the prompt renders old reasoning (tool context)
    responses_summary: bool = False  # Responses reasoning.summary opted in
    label: str = ""  # for logs / trace
    family: str | None = None  # chat protocol family (chat/protocol.py); None = the engine's
    tool_schemas: Sequence[str] = ()  # active tool schema lines (typed arguments for tag-based calls)
    # image input (docs/vision.md): the image-token blocks in prompt_ids (vision.encoder.ImageSpan)
    # and their images (chat.images.ImageInput), in the same order
    images: Sequence = ()
    image_inputs: Sequence = ()


@dataclass
class EngineStats:
    """Counters for tests and logs (monotonic, whole process)."""

    jobs: int = 0
    prefill_tokens: int = 0  # prompt tokens evaluated by prefill (reused ones excluded)
    decode_tokens: int = 0  # sampled tokens evaluated into the session
    cancelled: int = 0
    cancel_requests: int = 0
    greedy_tokens: int = 0  # tokens sampled greedily because of DSML structure
    last_cache_source: str = "none"


class CacheHooks:
    """Where the disk KV cache plugs in (docs/kv-cache.md §2 steps 8–10, §5; the
    call points kv/policy.py describes).  All run on the worker thread; the
    default does nothing.  `engine.live_visible_text()` gives the visible key
    of the live session for visible-keyed evict/shutdown saves."""

    def on_miss(self, engine: Engine) -> None:
        """Full live miss, before the live session is replaced (evict save)."""

    def try_load(self, engine: Engine, job: Job) -> tuple[list[int], int] | None:
        """disk-text reuse: restore a checkpoint into engine.session and return
        (effective tokens, cached) — cached == len(engine.session)."""
        return None

    def cold_save_point(self, engine: Engine, job: Job, effective: list[int]) -> int:
        """Cold prefill: a prefix length to checkpoint (0 = none).  The engine
        prefills exactly that many tokens, calls `on_cold_prefix`, then goes on."""
        return 0

    def on_cold_prefix(self, engine: Engine, job: Job, n_tokens: int) -> None:
        """The session holds exactly the first n_tokens of the prompt (cold save)."""

    def prefill_stops(self, engine: Engine, job: Job, start: int, end: int) -> Sequence[int]:
        """Absolute positions in (start, end) where a prefill chunk must end
        (continued-save frontiers), on top of the absolute multiples of the
        prefill chunk."""
        return ()

    def on_progress(self, engine: Engine, job: Job) -> None:
        """After each prefill chunk and each decoded token, except while a tool
        call is being generated (continued saves)."""

    def after_prefill(self, engine: Engine, job: Job) -> None:
        """The prompt is synced; generation starts next."""

    def on_shutdown(self, engine: Engine) -> None:
        """Save the live session at exit."""


def _call_hook(fn, *args):
    try:
        return fn(*args)
    except Exception:  # the cache must never break generation
        log.exception("disk cache hook %s failed", getattr(fn, "__name__", fn))
        return None


@dataclass
class _Binding:
    live_tokens: int
    visible_text: str | None = None
    call_ids: frozenset = frozenset()


class JobHandle:
    _ids = itertools.count(1)

    def __init__(self, engine: Engine, job: Job, emit: Callable[[Any], None]):
        self.id = next(self._ids)
        self.job = job
        self._engine = engine
        self._emit = emit
        self._cancel = threading.Event()
        self.done = threading.Event()
        self.started = False  # Started was emitted (errors after it end as Finish("error"))
        self.result: Finish | None = None

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def cancel(self) -> None:
        """Stop at the next prefill-chunk / token boundary (or before starting)."""
        if not self._cancel.is_set() and not self.done.is_set():
            self._engine.stats.cancel_requests += 1
        self._cancel.set()

    def emit(self, ev) -> None:
        try:
            self._emit(ev)
        except Exception:  # a dead consumer must never kill the worker
            log.exception("event consumer failed")


class _WorkerCall:
    """A callable queued with the jobs (`Engine.run_on_worker`)."""

    def __init__(self, fn):
        self.fn = fn
        self.done = threading.Event()
        self.result = None
        self.error: BaseException | None = None

    def run(self, engine: Engine) -> None:
        try:
            self.result = self.fn(engine)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            self.error = e
        finally:
            self.done.set()


class _RawOutput:
    """Completions: every released piece of raw text is content."""

    structural = False
    stop_now = False

    def feed(self, text: str):
        return [TextDelta(text)] if text else []

    def finish(self, truncated: bool = False):
        return [], None


def default_parser_factory(job: Job, tool_memory=None):
    if job.raw:
        return _RawOutput()
    from .chat.protocol import get_protocol

    return get_protocol(job.family).make_parser(
        job.thinking != "none", job.tools_active, job.tool_id_prefix, tool_memory, tool_schemas=job.tool_schemas
    )


def _stop_ids(tokenizer, protocol) -> frozenset:
    """Token ids of the protocol's end-of-turn strings (they stop like EOS)."""
    lookup = getattr(tokenizer, "token_to_id", None)
    ids = (lookup(s) for s in protocol.stop_strings) if lookup is not None else ()
    return frozenset(i for i in ids if i is not None)


def _calls_of(parsed) -> list:
    if parsed is None:
        return []
    calls = getattr(parsed, "calls", None)
    if calls is None:
        calls = getattr(parsed, "tool_calls", None)
    return list(calls or [])


class Engine:
    def __init__(
        self,
        model,
        tokenizer,
        ctx: int = 32768,
        *,
        default_max_tokens: int = 393216,
        prefill_chunk: int | None = None,
        tool_memory=None,
        cache: CacheHooks | None = None,
        parser_factory: Callable[..., Any] = default_parser_factory,
        protocol=None,
        checkpoints: MemoryCheckpoints | None = None,
    ):
        from .chat.protocol import protocol_for_model

        self.model = model
        # the chat protocol of the model's family (rendering and output parsing)
        self.protocol = protocol if protocol is not None else protocol_for_model(model)
        self.stop_ids = _stop_ids(tokenizer, self.protocol)
        self.tokenizer = tokenizer
        self.ctx = int(ctx)
        self.default_max_tokens = int(default_max_tokens)
        self.prefill_chunk = max(1, int(prefill_chunk or default_chunk()))  # prefill_chunk.py
        self.tool_memory = tool_memory
        self.cache = cache or CacheHooks()
        self.parser_factory = parser_factory
        self.checkpoints = checkpoints if checkpoints is not None else MemoryCheckpoints()
        self.stats = EngineStats()
        self.session = None
        self.vision = None  # vision.encoder.VisionEncoder (enable_vision)
        self.live_images = None  # vision.reuse.LiveImages: the images the live session holds
        self.vision_checkpoint = None  # vision.reuse.VisionCheckpoint: the last image prompt's end
        self._bind_lock = threading.Lock()
        self._responses: _Binding | None = None
        self._anthropic: _Binding | None = None
        self._thinking: _Binding | None = None
        self._queue: queue.Queue[JobHandle | None] = queue.Queue()
        self._running: JobHandle | None = None
        self._closed = False
        # Every MLX operation on the session happens on the worker thread: MLX
        # streams are per thread, so the session's arrays are created there too.
        self._ready = threading.Event()
        self._stopped = threading.Event()
        self._init_error: BaseException | None = None
        self._worker = threading.Thread(target=self._run, name="ds4mlx-engine", daemon=True)
        self._worker.start()
        self._ready.wait()
        if self._init_error is not None:
            raise self._init_error

    # ---------------------------------------------------------------- public
    def enable_vision(self, encoder) -> None:
        """Accept image jobs; from now on the disk KV cache hooks stay silent while the
        live session holds images (docs/vision.md §3)."""
        from .vision.reuse import GuardedHooks

        self.vision = encoder
        self.cache = GuardedHooks(self.cache, lambda: self.live_images is not None)

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def tokenize_prefix(self, text: str, limit: int) -> tuple[list[int], bool]:
        """(ids, complete): the tokenizer may stop once more than `limit` ids are certain."""
        bounded = getattr(self.tokenizer, "encode_prefix", None)
        return bounded(text, limit) if callable(bounded) else (self.tokenize(text), True)

    def min_tokens(self, text: str) -> int:
        """A cheap lower bound on len(tokenize(text)) (0 if the tokenizer has none)."""
        bound = getattr(self.tokenizer, "min_tokens", None)
        return bound(text) if callable(bound) else 0

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    def queue_position(self, handle: JobHandle) -> int:
        """1 = the next job to run, 2 = one ahead of it, ...; 0 = not waiting
        (running, finished or cancelled)."""
        with self._queue.mutex:
            for i, h in enumerate(self._queue.queue):
                if h is handle:
                    return i + 1
        return 0

    def submit(self, job: Job, emit: Callable[[Any], None]) -> JobHandle:
        if self._closed:
            raise RuntimeError("engine is shut down")
        h = JobHandle(self, job, emit)
        self._queue.put(h)
        return h

    def generate(self, job: Job) -> Iterator[Any]:
        """Blocking iterator over the job's events (ends after Finish/Failed).
        Closing the iterator early cancels the job."""
        q: queue.Queue = queue.Queue()
        h = self.submit(job, q.put)
        try:
            while True:
                ev = q.get()
                yield ev
                if isinstance(ev, (Finish, Failed)):
                    return
        finally:
            if not h.done.is_set():
                h.cancel()

    def run_on_worker(self, fn: Callable[[Engine], Any], timeout: float | None = None) -> Any:
        """Run `fn(engine)` on the worker thread between jobs and return its
        result (its exception is re-raised here).  For front ends that must touch
        the live session directly (the agent's KV checkpoints): MLX binds the
        session's arrays to the worker thread."""
        if self._closed:
            raise RuntimeError("engine is shut down")
        call = _WorkerCall(fn)
        self._queue.put(call)
        if not call.done.wait(timeout):
            raise TimeoutError("worker call did not run")
        if call.error is not None:
            raise call.error
        return call.result

    def live_call_ids(self, api: str) -> frozenset:
        """Call ids of the remembered live tool turn for `api` (Responses/Anthropic)."""
        with self._bind_lock:
            b = self._responses if api == "responses" else self._anthropic if api == "anthropic" else None
            return b.call_ids if b is not None and b.live_tokens == len(self.session) else frozenset()

    def live_visible_text(self) -> str | None:
        """The visible transcript a Responses / thinking binding remembers for the
        live session (Responses wins), or None: the key of visible-keyed saves."""
        key = self.live_visible_key()
        return key[1] if key else None

    def live_visible_key(self) -> tuple[str, str] | None:
        """(kind, visible transcript) of `live_visible_text`; kind is
        "responses-visible" or "thinking-visible"."""
        with self._bind_lock:
            for kind, b in (("responses-visible", self._responses), ("thinking-visible", self._thinking)):
                if b is not None and b.visible_text and b.live_tokens == len(self.session):
                    return kind, b.visible_text
        return None

    def reset_live(self, ctx: int | None = None, timeout: float = 60.0) -> None:
        """Drop the live session for a fresh one (of `ctx` tokens if given), e.g.
        after the model's steering changed; runs on the worker after the queued
        jobs and returns when done."""
        self.run_on_worker(lambda engine: engine._new_session(ctx), timeout)

    def close(self, timeout: float = 10.0) -> None:
        if self._closed:
            return
        self._closed = True
        if self._running is not None:
            self._running.cancel()
        self._queue.put(None)
        self._stopped.wait(timeout)

    # ---------------------------------------------------------------- worker
    def _run(self) -> None:
        try:
            self.session = self.model.new_session(self.ctx)
        except BaseException as e:  # noqa: BLE001 - re-raised by __init__
            self._init_error = e
            self._stopped.set()
            self._ready.set()
            threading.Event().wait()  # park (see the end of this method)
        self._ready.set()
        while True:
            h = self._queue.get()
            if h is None:
                break
            if isinstance(h, _WorkerCall):
                h.run(self)
                continue
            self._running = h
            try:
                if h.cancelled or self._closed:
                    self.stats.cancelled += 1
                    h.result = Finish("cancelled", error="cancelled before start")
                    h.emit(h.result)
                else:
                    self._generate(h)
            except Exception as e:  # keep serving whatever happened
                log.exception("job %d failed", h.id)
                self._invalidate()
                if h.started:
                    h.result = Finish("error", error=str(e) or type(e).__name__)
                    h.emit(h.result)
                else:
                    h.emit(Failed(500, str(e) or type(e).__name__))
            finally:
                self._running = None
                h.done.set()
        _call_hook(self.cache.on_shutdown, self)  # on the worker: the session's MLX stream lives here
        # drain: everything still queued ends cancelled
        while True:
            try:
                h = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(h, _WorkerCall):
                h.error = RuntimeError("engine is shut down")
                h.done.set()
            elif h is not None:
                h.emit(Finish("cancelled", error="shutdown"))
                h.done.set()
        self._stopped.set()
        # Park instead of returning: when an MLX thread exits, its thread-local
        # MLX state is torn down and may need the GIL; if that races with the
        # interpreter's finalization the process aborts ("terminate called
        # without an active exception").  A parked daemon thread just ends with
        # the process.
        threading.Event().wait()

    def reset_session(self) -> None:
        """Empty the live session (worker thread only: the disk cache calls it when a
        restore fails half-way)."""
        reset = getattr(self.session, "reset", None)
        if reset is not None:
            reset()
        else:
            self.session = self.model.new_session(self.ctx)

    def _new_session(self, ctx: int | None) -> None:
        if ctx is not None:
            self.ctx = int(ctx)
        self.session = self.model.new_session(self.ctx)
        self._clear_bindings(keep=None)

    def _invalidate(self) -> None:
        """Forget the live state (stop-sequence hit, failures)."""
        self.reset_session()
        self._clear_bindings(keep=None)

    def _clear_bindings(self, keep: str | None) -> None:
        with self._bind_lock:
            if keep != "responses":
                self._responses = None
            if keep != "anthropic":
                self._anthropic = None
            if keep != "thinking":
                self._thinking = None

    # ---------------------------------------------------------------- reuse
    def _live_text(self) -> str:
        return self.tokenizer.decode(self.session.tokens)

    def _plan_reuse(self, job: Job, ids: list[int]):
        """-> (effective tokens, cached, source, binding kept) or Failed."""
        tk = self.tokenizer
        live = list(self.session.tokens)
        pos = len(live)
        prompt = job.prompt_text
        with self._bind_lock:
            resp, anth, think = self._responses, self._anthropic, self._thinking

        def visible(b: _Binding | None) -> int | None:
            if b is None or b.live_tokens != pos or pos == 0 or not b.visible_text:
                return None
            if len(b.visible_text) < len(prompt) and prompt.startswith(b.visible_text):
                return len(b.visible_text)
            return None

        if pos > 0:
            # 1. responses-visible
            if job.api == "responses":
                n = visible(resp)
                if n is not None:
                    return live + tk.encode(prompt[n:]), pos, "responses-visible", "responses"
            # 2./3. tool-output continuation by call ids
            for api, b in (("responses", resp), ("anthropic", anth)):
                if (
                    job.api == api
                    and job.continuation_tail is not None
                    and job.continuation_ids
                    and b is not None
                    and b.live_tokens == pos
                    and b.call_ids == job.continuation_ids
                ):
                    return live + tk.encode(job.continuation_tail), pos, f"{api}-tool-output", api
        # 4. the request cannot be served without the live state it refers to
        if job.requires_live:
            which = "Responses" if job.api == "responses" else "Anthropic"
            hist = "input" if job.api == "responses" else "messages"
            return Failed(
                409, f"{which} continuation state is not available; retry by replaying the full {hist} history"
            )
        if pos > 0:
            # 5. memory-token: the live tokens are a prefix of the request tokens
            if len(ids) >= pos and ids[:pos] == live:
                return ids, pos, "memory-token", None
            # 6. thinking-visible (chat, Anthropic)
            if job.api in ("chat", "anthropic") and not job.raw:
                n = visible(think)
                if n is not None:
                    return live + tk.encode(prompt[n:]), pos, "thinking-visible", "thinking"
            # 7. memory-text: decode(live) is a byte prefix of the prompt
            live_text = self._live_text()
            if prompt.startswith(live_text):
                return live + tk.encode(prompt[len(live_text) :]), pos, "memory-text", None
            common = next((i for i, (a, b) in enumerate(zip(live, ids)) if a != b), min(pos, len(ids)))
            log.info("live kv cache miss live=%d prompt=%d common=%d", pos, len(ids), common)
        # 7b. an in-memory checkpoint at the end of an earlier prompt (the live session cannot rewind)
        cp = self.checkpoints.best(ids)
        if cp is not None and self._restore_checkpoint(cp):
            if pos > 0:
                _call_hook(self.cache.on_miss, self)
            return ids, len(cp.tokens), "memory-checkpoint", None
        # 8.–10. disk cache, then cold
        if pos > 0:
            _call_hook(self.cache.on_miss, self)
        loaded = _call_hook(self.cache.try_load, self, job)
        if loaded:
            eff, cached = loaded
            return list(eff), int(cached), "disk-text", None
        return ids, 0, "none", None

    def _restore_checkpoint(self, cp) -> bool:
        """Replace the live session by a checkpoint (False if it does not restore)."""
        try:
            self.session.restore(cp.blob)
        except ValueError:
            log.exception("memory checkpoint restore failed")
            self._reset_session()
            return False
        self.checkpoints.restored += 1
        return True

    def _checkpoint(self, effective: list[int], cached: int) -> None:
        """Keep the session at the end of this prompt for a later request that shares it."""
        if self.live_images is not None:  # token-keyed checkpoints cannot tell images apart
            return
        if self.checkpoints.wants(len(effective), len(effective) - cached):
            try:
                self.checkpoints.save(effective, self.session)
            except Exception:  # a session without snapshots: no checkpoints, nothing lost
                log.exception("memory checkpoint failed")

    def _checkpoint_frontier(self) -> None:
        """While generating: keep the session at an aligned frontier, for a new turn or
        retry whose common prefix ends inside this answer."""
        s = self.session
        if self.live_images is None and self.checkpoints.due(len(s)):
            try:
                self.checkpoints.save(s.tokens, s, frontier=True)
            except Exception:
                log.exception("memory checkpoint failed")

    def _sync(self, h: JobHandle, effective: list[int], cached: int):
        """Bring the session to `effective`, evaluating only `effective[cached:]`.
        Returns (logits for the next token, or None if cancelled; tokens reused)."""
        s = self.session
        if cached == 0 or cached != len(s) or list(s.tokens[:cached]) != effective[:cached]:
            if len(s):
                self.reset_session()
            cached = 0
        suffix = effective[cached:]
        total = len(effective)
        h.emit(PrefillProgress(cached, total))
        if not suffix:
            logits = getattr(s, "last_logits", None)
            if logits is not None:
                return logits, cached
            # No logits kept for the last token: evaluate it again.
            self.reset_session()
            cached, suffix = 0, list(effective)
        cold = 0
        if cached == 0:
            cold = int(_call_hook(self.cache.cold_save_point, self, h.job, effective) or 0)
            cold = cold if 0 < cold <= len(effective) else 0
        # chunk boundaries, absolute positions: multiples of prefill_chunk (a resumed
        # prefill realigns), the cold save point and the cache's continued frontiers
        step = self.prefill_chunk
        stops = {*range(cached - cached % step + step, total, step), total, *([cold] if cold else [])}
        extra = _call_hook(self.cache.prefill_stops, self, h.job, cached, total) or ()
        stops.update(p for p in extra if cached < p < total)
        bounds = sorted(p - cached for p in stops)
        done = cached
        t0 = time.monotonic()
        logits = None
        start = 0
        for end in bounds:
            if h.cancelled:
                return None, cached
            chunk = suffix[start:end]
            start = end
            logits = s.prefill(chunk)
            self.stats.prefill_tokens += len(chunk)
            done += len(chunk)
            if cold and done == cold:
                _call_hook(self.cache.on_cold_prefix, self, h.job, cold)
            _call_hook(self.cache.on_progress, self, h.job)
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

    # ---------------------------------------------------------------- generate
    def _generate(self, h: JobHandle) -> None:
        job = h.job
        tk = self.tokenizer
        self.stats.jobs += 1
        ids = job.prompt_ids if job.prompt_ids is not None else tk.encode(job.prompt_text)
        if self.live_images is not None and not job.images:
            self.reset_session()  # a text request never reuses image KV (docs/vision.md §3)
            self.live_images = None
        if job.images:
            from .vision import reuse

            plan = reuse.plan(self, job, ids)
        else:
            plan = self._plan_reuse(job, ids)
        if isinstance(plan, Failed):
            h.emit(plan)
            return
        effective, cached, source, kept = plan
        self.stats.last_cache_source = source
        if len(effective) >= self.ctx:
            h.emit(Failed(500, "prompt exceeds context"))
            return
        if cached:
            log.info("%s live kv reuse source=%s cached=%d prompt=%d", job_kind(job), source, cached, len(effective))
        if job.images:
            from .vision import reuse

            self.live_images = reuse.record(job.images, effective)  # before the prefill: hooks stay silent
            with reuse.rows_installed(self, job, cached):
                logits, cached = self._sync(h, effective, cached)
            if logits is None:
                self.reset_session()  # a half-prefilled image block is no reusable state
                self.live_images = None
            else:
                reuse.keep_checkpoint(self, job, effective)
        else:
            logits, cached = self._sync(h, effective, cached)
        prompt_tokens = len(effective)
        if logits is None:  # cancelled during prefill; the session keeps the evaluated prefix
            self._clear_bindings(keep=None)
            self.stats.cancelled += 1
            h.result = Finish(
                "cancelled", Usage(prompt_tokens, 0, cached, prompt_tokens - cached), error="cancelled during prefill"
            )
            h.emit(h.result)
            return
        self._clear_bindings(keep=kept)
        self._checkpoint(effective, cached)
        _call_hook(self.cache.after_prefill, self, job)
        h.started = True
        h.emit(Started(prompt_tokens, cached))
        self._decode(h, logits, prompt_tokens, cached)

    def _decode(self, h: JobHandle, logits, prompt_tokens: int, cached: int) -> None:
        job = h.job
        tk = self.tokenizer
        s = self.session
        eos = tk.eos_id
        room = self.ctx - len(s)
        max_tokens = self.default_max_tokens if job.max_tokens is None else max(0, int(job.max_tokens))
        max_tokens = min(max_tokens, room)
        if job.family is None:
            job.family = self.protocol.family
        parser = self.parser_factory(job, self.tool_memory)
        detok = Detokenizer(tk)
        stops = StopMatcher(job.stop)
        sampler = Sampler(job.params.seed)
        ends = {eos, *self.stop_ids}
        banned = sorted(e for e in ends if e is not None) if job.ignore_eos else None
        raw_parts: list[str] = []
        generated: list[int] = []
        finish = "length"
        error = None
        broken = False  # the session may hold a half-evaluated step
        t0 = time.monotonic()

        def push(text: str) -> None:
            if not text:
                return
            raw_parts.append(text)
            for ev in parser.feed(text):
                h.emit(ev)

        if not isinstance(logits, mx.array):
            logits = mx.array(np.asarray(logits, dtype=np.float32))
        force = job.force_text if job.tools_active else None
        forced: list[int] = []
        n_forced = 0

        def pick(logits) -> int:
            # synchronous: this token's choice depends on the host's reading of the last one
            nonlocal force, forced, n_forced
            if force is not None and getattr(parser, "phase", "text") == "text":
                forced, force = tk.encode(force), None  # the answer starts: open the tool call
            if forced:
                n_forced += 1
                return forced.pop(0)
            structural = bool(job.tools_active and getattr(parser, "structural", False))
            params = GREEDY if structural else job.params  # ignore_eos keeps the requested sampling (#17)
            if structural and not job.params.greedy:
                self.stats.greedy_tokens += 1
            return int(sampler.sample(logits, params, generated, banned).item())

        # Forced tool text and greedy-inside-a-tool-call for sampled jobs are host decisions
        # per token: those jobs run the loop synchronously; every other job samples on the
        # device, one token ahead of the host (decode.py).
        host_chooses = force is not None or (job.tools_active and not job.params.greedy)
        if host_chooses:
            sample = pick
        else:
            sample = DeviceSampler(job.params, int(logits.shape[-1]), banned, seed=sampler.seed)
        # forced tool-call header tokens do not count against max_tokens (#17): with forced text
        # the limit is checked here, the context room always
        loop = decode_tokens(
            s,
            logits,
            sample,
            stop_ids=() if job.ignore_eos else [e for e in ends if e is not None],
            lookahead=not host_chooses,
            limit=max_tokens if force is None else None,
        )
        tokens = iter(loop)
        while True:
            if h.cancelled or self._closed:
                finish, error = "cancelled", "cancelled"
                break
            try:
                tok = next(tokens)
            except StopIteration:
                finish = "stop" if loop.stopped_by is not None else "length"
                break
            except Exception as e:
                log.exception("decode step failed")
                finish, error = "error", f"decode failed: {e}"
                broken = True
                break
            generated.append(tok)
            self.stats.decode_tokens += 1
            push(stops.push(detok.feed(tok)))
            if stops.hit is not None:
                finish = "stop"
                break
            if getattr(parser, "stop_now", False):
                finish = "tool_calls"
                break
            if loop.limit is None and (len(generated) - n_forced >= max_tokens or len(generated) >= room):
                finish = "length"  # the limit of a job with forced text (forced tokens not counted)
                break
            if not (job.tools_active and getattr(parser, "phase", "text") in ("tool", "done")):
                _call_hook(self.cache.on_progress, self, job)  # not inside a tool call
                self._checkpoint_frontier()
        if finish != "stop" or stops.hit is None:
            push(stops.push(detok.flush()))
            push(stops.flush())
        if stops.hit is not None:
            finish = "stop"
        truncated = finish == "length"  # lets the parser repair a block cut by max_tokens
        tail_events, parsed = parser.finish(truncated)
        for ev in tail_events:
            h.emit(ev)
        calls = _calls_of(parsed)
        perror = getattr(parsed, "error", None)
        if finish == "cancelled":
            self.stats.cancelled += 1
        elif finish == "error":
            pass
        elif perror == UNTERMINATED_TOOL_CALL:
            # ds4: a block that started but never closed fails the turn (docs/dsml.md §3.1).
            finish, error = "error", perror
        elif calls:
            finish = "tool_calls"
        elif finish == "tool_calls":
            finish = "stop"  # the block closed but did not parse: recovered as text
        if perror and finish != "error":
            log.warning("%s %s returned as assistant text finish=%s", job_kind(job), perror, finish)
        raw_text = "".join(raw_parts)
        if stops.hit is not None or broken:
            # ds4 invalidates the live session on a stop-sequence hit.
            self._invalidate()
        if calls and self.tool_memory is not None and finish == "tool_calls":
            try:
                self.tool_memory.remember([c.id for c in calls], getattr(parsed, "raw_dsml", None))
            except Exception:
                log.exception("tool memory remember failed")
        if stops.hit is None and not job.raw:
            self._remember_bindings(job, parsed, calls, finish, raw_text)
        dt = time.monotonic() - t0
        log.info(
            "%s gen=%d finish=%s%s %.2f t/s",
            job_kind(job),
            len(generated),
            finish,
            f' error="{error}"' if error else "",
            len(generated) / dt if dt > 0 else 0.0,
        )
        usage = Usage(
            prompt_tokens,
            len(generated),
            cached,
            prompt_tokens - cached,
            reasoning_tokens=self._reasoning_tokens(parsed, len(generated)),
        )
        h.result = Finish(finish, usage, raw_text=raw_text, result=parsed, error=error, stop_sequence=stops.hit)
        h.emit(h.result)

    def _reasoning_tokens(self, parsed, generated: int) -> int:
        """How many of the generated tokens were reasoning (its text re-tokenized, with
        the think close; at most all of them)."""
        reasoning = getattr(parsed, "reasoning", None)
        if not reasoning:
            return 0
        closed = getattr(parsed, "content", "") or getattr(parsed, "calls", None)
        return min(generated, len(self.tokenizer.encode(reasoning)) + (1 if closed else 0))

    # ---------------------------------------------------------------- bindings
    def _remember_bindings(self, job: Job, parsed, calls, finish: str, raw_text: str) -> None:
        pos = len(self.session)
        ok = finish not in ("error", "length", "cancelled")
        thinking = job.thinking != "none"
        content = getattr(parsed, "content", "") or ""
        reasoning = getattr(parsed, "reasoning", None)
        raw_dsml = getattr(parsed, "raw_dsml", "") or ""
        call_ids = frozenset(c.id for c in calls)
        resp = anth = think = None
        # the family's own strings: its thinking markers and the text that closes an assistant turn
        proto = self.protocol
        think_open, think_close, turn_end = proto.think_open, proto.think_close, proto.turn_end
        if job.api == "responses" and ok:
            v = ""
            if thinking:
                if job.responses_summary and calls:
                    v += reasoning or ""
                v += think_close
            v += content + (raw_dsml if calls else "") + turn_end
            resp = _Binding(pos, job.prompt_text + v, call_ids)
        if job.api == "anthropic" and ok and calls:
            anth = _Binding(pos, None, call_ids)
        if (
            not calls
            and ok
            and thinking
            and not job.tools_active
            and not job.preserves_reasoning
            and job.prompt_text.endswith(think_open)
            and not _inside_think(job.prompt_text + raw_text, think_open, think_close)
        ):
            think = _Binding(pos, job.prompt_text[: -len(think_open)] + think_close + content + turn_end)
        with self._bind_lock:
            self._responses, self._anthropic, self._thinking = resp, anth, think


def _inside_think(text: str, think_open: str, think_close: str) -> bool:
    return text.rfind(think_open) > text.rfind(think_close)


def job_kind(job: Job) -> str:
    return "completion" if job.raw else "chat"

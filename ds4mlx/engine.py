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

With `slots=N` (`serve --batched-session N`, docs/kv-cache.md §11) the worker keeps
N resident sessions (`slots.Slot`): each queued job is routed to a free slot by
the reuse ladder, and the jobs of all busy slots advance in turns, one prefill
chunk or one decode token each (every job is a generator that yields at those
boundaries).  N = 1 is the single live session: one job at a time, in order.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from .decode import StepRequest, decode_tokens, run_steps
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
from .sampling import GREEDY, DeviceSampler, Penalties, Sampler, SamplingParams
from .slots import Slot, route
from .speculative.loop import loop_for_job
from .speculative.options import SpecStats

log = logging.getLogger("ds4mlx.engine")

BATCHED_DECODE_ENV = "DS4MLX_BATCHED_DECODE"

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
    single_tool_call: bool = False  # parallel_tool_calls false: stop after the first call (chat/protocol.py)
    grammar: Any = None  # structured output (structured.Grammar): the answer's tokens constrained
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
    spec_rounds: int = 0  # speculative decoding (#21): verify forwards
    spec_drafted: int = 0  # draft tokens proposed
    spec_accepted: int = 0  # draft tokens the target kept
    spec_acceptance_rate: float = 0.0
    spec_draft_seconds: float = 0.0  # wall time proposing drafts
    spec_verify_seconds: float = 0.0  # wall time verifying (target forward, acceptance, rollback)
    shared_steps: int = 0  # decode steps that ran in a forward shared with other slots
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
        self.slot: int | None = None  # index of the resident session it ran on (once admitted)
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
    from .chat.protocol import FirstCallOnly, get_protocol

    parser = get_protocol(job.family).make_parser(
        job.thinking != "none", job.tools_active, job.tool_id_prefix, tool_memory, tool_schemas=job.tool_schemas
    )
    return FirstCallOnly(parser) if job.single_tool_call and job.tools_active else parser


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


@dataclass
class _Task:
    """A job admitted to a slot: `steps` is its `_generate` generator once started."""

    handle: JobHandle
    slot: Slot
    steps: Iterator[None] | None = None


# rungs of the ladder that serve a request needing the live tool state (docs/kv-cache.md §2 steps 1-3)
_TOOL_RUNGS = ("responses-visible", "responses-tool-output", "anthropic-tool-output")


def _slot_field(name: str) -> property:
    """An Engine attribute that is the current slot's (`Engine._slot`)."""
    return property(lambda self: getattr(self._slot, name), lambda self, v: setattr(self._slot, name, v))


class Engine:
    # the live session, its protocol bindings and its disk-cache hooks are per slot
    session = _slot_field("session")
    cache = _slot_field("cache")
    _responses = _slot_field("responses")
    _anthropic = _slot_field("anthropic")
    _thinking = _slot_field("thinking")

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
        speculation=None,
        slots: int = 1,
        prefill_quantum: int | None = None,
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
        # --mixed-prefill-quantum: prefill chunks end at its multiples too, so a long
        # prefill yields to the other slots' decode steps that often
        self.prefill_quantum = max(1, int(prefill_quantum)) if prefill_quantum else None
        self.tool_memory = tool_memory
        self._slots = [Slot(i) for i in range(max(1, int(slots)))]
        # with several slots the decode loops hand their steps to the worker, which runs the
        # ready steps of all slots in one forward where the family can
        # (DS4MLX_BATCHED_DECODE=0: one forward per slot, in turn)
        self._defer_steps = len(self._slots) > 1
        self._share_steps = os.environ.get(BATCHED_DECODE_ENV, "1").strip() != "0"
        self._slot = self._slots[0]  # the slot the worker is running now (session, bindings, cache)
        self.cache = cache or CacheHooks()
        for_slot = getattr(self.cache, "for_slot", None)
        for sl in self._slots[1:]:
            sl.cache = for_slot() if callable(for_slot) else self.cache
        self.parser_factory = parser_factory
        self.checkpoints = checkpoints if checkpoints is not None else MemoryCheckpoints()
        self.stats = EngineStats()
        self.speculation = speculation  # speculative.options.SpecConfig, or None
        self.vision = None  # vision.encoder.VisionEncoder (enable_vision)
        self.live_images = None  # vision.reuse.LiveImages: the images the live session holds
        self.vision_checkpoint = None  # vision.reuse.VisionCheckpoint: the last image prompt's end
        self._bind_lock = threading.Lock()
        self._queue: queue.Queue[JobHandle | None] = queue.Queue()
        # taken off _queue by the worker, not yet running (FIFO; guarded by _pending_lock)
        self._pending: collections.deque = collections.deque()
        self._pending_lock = threading.Lock()
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
    def slots(self) -> int:
        return len(self._slots)

    @property
    def running(self) -> list[JobHandle]:
        """The jobs admitted to a slot and not finished."""
        return [sl.active for sl in self._slots if sl.active is not None]

    @property
    def _running(self) -> JobHandle | None:  # one slot's view, as before batching
        jobs = self.running
        return jobs[0] if jobs else None

    @property
    def queue_depth(self) -> int:
        with self._pending_lock:
            return len(self._pending) + self._queue.qsize()

    def queue_position(self, handle: JobHandle) -> int:
        """1 = the next job to run, 2 = one ahead of it, ...; 0 = not waiting
        (running, finished or cancelled)."""
        with self._pending_lock, self._queue.mutex:
            for i, h in enumerate(itertools.chain(self._pending, self._queue.queue)):
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
        """Call ids of the remembered live tool turns for `api` (Responses/Anthropic),
        over every slot."""
        ids: frozenset = frozenset()
        with self._bind_lock:
            for sl in self._slots:
                b = sl.responses if api == "responses" else sl.anthropic if api == "anthropic" else None
                if b is not None and b.live_tokens == len(sl):
                    ids |= b.call_ids
        return ids

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
        for sl in self._slots:
            if sl.active is not None:
                sl.active.cancel()
        self._queue.put(None)
        self._stopped.wait(timeout)

    # ---------------------------------------------------------------- worker
    def _run(self) -> None:
        try:
            for sl in self._slots:
                sl.session = self.model.new_session(self.ctx)
        except BaseException as e:  # noqa: BLE001 - re-raised by __init__
            self._init_error = e
            self._stopped.set()
            self._ready.set()
            threading.Event().wait()  # park (see the end of this method)
        self._ready.set()
        tasks: list[_Task] = []
        stopping = False
        changed = False  # something arrived or ended since the last admission
        while not (stopping and not tasks):
            # take what was submitted: block only when there is nothing to run
            while not stopping:
                try:
                    item = self._queue.get(block=not tasks and not self._pending)
                except queue.Empty:
                    break
                changed = True
                if item is None:
                    stopping = True
                else:
                    with self._pending_lock:
                        self._pending.append(item)
            if changed or any(getattr(h, "cancelled", False) for h in self._pending):
                # once closed, the jobs still pending end "cancelled before start"
                self._admit(tasks)
                changed = False
            steps: list[StepRequest] = []
            for t in list(tasks):  # one turn each: a prefill chunk or a decode token
                alive, step = self._advance(t)
                if not alive:
                    tasks.remove(t)
                    changed = True
                elif step is not None:
                    steps.append(step)
            if steps:  # the decode steps the jobs wait for, together
                self.stats.shared_steps += run_steps(steps, self._share_steps)
        for sl in self._slots:  # on the worker: the sessions' MLX stream lives here
            self._slot = sl
            _call_hook(self.cache.on_shutdown, self)
        # drain: everything still queued ends cancelled
        while True:
            with self._pending_lock:
                h = self._pending.popleft() if self._pending else None
            if h is None:
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

    def _admit(self, tasks: list[_Task]) -> None:
        """Start pending work while it can start: a job needs a free slot, a worker call
        an idle engine (it runs between jobs, as with one slot, and no job queued after
        it starts before it).  Jobs start in order, except that a job which would evict
        a slot that a job queued behind it can reuse waits for that one to start first."""
        progress = True
        while progress:
            progress = False
            with self._pending_lock:
                items = list(self._pending)
            barrier = next((i for i, it in enumerate(items) if isinstance(it, _WorkerCall)), len(items))
            if barrier == 0 and items:
                if tasks:
                    return
                self._take(items[0]).run(self)
                progress = True
                continue
            jobs = items[:barrier]
            for i, h in enumerate(jobs):
                if h.cancelled or self._closed:
                    self._take(h)
                    self.stats.cancelled += 1
                    h.result = Finish("cancelled", error="cancelled before start")
                    h.emit(h.result)
                    h.done.set()
                    progress = True
                    break
                free = [sl for sl in self._slots if sl.active is None]
                if not free:
                    return
                slot = self._route(h, free, jobs[i + 1 :])
                if slot is None:
                    continue  # its victim is wanted by a later job: that one first
                self._take(h)
                t = _Task(h, slot)
                tasks.append(t)
                slot.active = h
                h.slot = slot.index
                progress = True
                break

    def _take(self, item):
        with self._pending_lock:
            self._pending.remove(item)
        return item

    def _route(self, h: JobHandle, free: list[Slot], later: Sequence[JobHandle] = ()) -> Slot | None:
        """The free slot a job runs on, by the reuse ladder; None = wait (the only slots
        it could evict hold state that a job in `later` reuses)."""
        if len(self._slots) == 1:
            return free[0]
        here = self._slot

        def reuse(job: Job):
            def reusable(sl: Slot) -> int:
                self._slot = sl
                rung = self._live_rung(job, self._prompt_ids(job))
                return len(sl) if rung is not None and not (job.requires_live and rung[0] not in _TOOL_RUNGS) else 0

            return reusable

        try:
            r = route(free, reuse(h.job))
            if not r.reusable and len(r.slot):
                wanted = {id(sl) for j in later for sl in free if len(sl) and reuse(j.job)(sl)}
                spare = [sl for sl in free if id(sl) not in wanted]
                if not spare:
                    return None
                r = route(spare, lambda sl: 0)
        except Exception:
            log.exception("job %d: routing failed", h.id)
            return free[0]  # _generate fails the job the same way
        finally:
            self._slot = here
        if r.reusable:
            log.info("slot %d routed job %d reuse=%d", r.slot.index, h.id, r.reusable)
        elif len(r.slot):
            log.info(
                "slot %d evicted for job %d tokens=%d idle=%.0fs%s",
                r.slot.index,
                h.id,
                len(r.slot),
                r.slot.idle_s(),
                " stale" if r.stale else "",
            )
        return r.slot

    def _prompt_ids(self, job: Job) -> list[int]:
        if job.prompt_ids is None:
            job.prompt_ids = self.tokenizer.encode(job.prompt_text)
        return job.prompt_ids

    def _advance(self, t: _Task) -> tuple[bool, StepRequest | None]:
        """Run one turn of a job on its slot: (still running, the decode step it waits for)."""
        h = t.handle
        self._slot = t.slot
        ended = False
        step = None
        try:
            if t.steps is None:
                t.steps = self._generate(h)
            step = next(t.steps)
        except StopIteration:
            ended = True
        except Exception as e:  # keep serving whatever happened
            ended = True
            log.exception("job %d failed", h.id)
            self._invalidate()
            if h.started:
                h.result = Finish("error", error=str(e) or type(e).__name__)
                h.emit(h.result)
            else:
                h.emit(Failed(500, str(e) or type(e).__name__))
        if ended:
            t.slot.active = None
            t.slot.last_used = time.monotonic()
            h.done.set()
        return not ended, step

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
        here = self._slot
        for sl in self._slots:  # a worker call: no job is running on any slot
            self._slot = sl
            self.session = self.model.new_session(self.ctx)
            self._clear_bindings(keep=None)
        self._slot = here

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
        sl, s = self._slot, self.session
        key = (id(s), len(s), s.tokens[-1] if len(s) else None)
        if sl.text_key != key:  # the router probes idle slots again and again
            sl.text_key, sl.text = key, self.tokenizer.decode(s.tokens)
        return sl.text

    def _live_rung(self, job: Job, ids: list[int]):
        """The first rung of the live ladder (docs/kv-cache.md §2 steps 1-3, 5-7) the
        current slot's session serves: (source, text to tokenize after the live tokens
        or None = the request's own ids, binding kept), or None.  Tokenizes nothing:
        the router probes every free slot with it."""
        live = self.session.tokens
        pos = len(live)
        if pos == 0:
            return None
        prompt = job.prompt_text
        with self._bind_lock:
            resp, anth, think = self._responses, self._anthropic, self._thinking

        def visible(b: _Binding | None) -> int | None:
            if b is None or b.live_tokens != pos or not b.visible_text:
                return None
            if len(b.visible_text) < len(prompt) and prompt.startswith(b.visible_text):
                return len(b.visible_text)
            return None

        # 1. responses-visible
        if job.api == "responses":
            n = visible(resp)
            if n is not None:
                return "responses-visible", prompt[n:], "responses"
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
                return f"{api}-tool-output", job.continuation_tail, api
        # 5. memory-token: the live tokens are a prefix of the request tokens
        if len(ids) >= pos and list(ids[:pos]) == list(live):
            return "memory-token", None, None
        # 6. thinking-visible (chat, Anthropic)
        if job.api in ("chat", "anthropic") and not job.raw:
            n = visible(think)
            if n is not None:
                return "thinking-visible", prompt[n:], "thinking"
        # 7. memory-text: decode(live) is a byte prefix of the prompt
        live_text = self._live_text()
        if prompt.startswith(live_text):
            return "memory-text", prompt[len(live_text) :], None
        return None

    def _plan_reuse(self, job: Job, ids: list[int]):
        """-> (effective tokens, cached, source, binding kept) or Failed."""
        tk = self.tokenizer
        live = list(self.session.tokens)
        pos = len(live)
        rung = self._live_rung(job, ids)
        if rung is not None and rung[0] in _TOOL_RUNGS:
            source, tail, kept = rung
            return live + tk.encode(tail), pos, source, kept
        # 4. the request cannot be served without the live state it refers to
        if job.requires_live:
            which = "Responses" if job.api == "responses" else "Anthropic"
            hist = "input" if job.api == "responses" else "messages"
            return Failed(
                409, f"{which} continuation state is not available; retry by replaying the full {hist} history"
            )
        if rung is not None:
            source, tail, kept = rung
            return (ids if tail is None else live + tk.encode(tail)), pos, source, kept
        if pos > 0:
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
            self.reset_session()
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
        Returns (logits for the next token, or None if cancelled; tokens reused).
        A generator: it yields after each chunk (the other slots' turn)."""
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
        q = self.prefill_quantum
        if q is not None and q < step:
            stops.update(range(cached - cached % q + q, total, q))
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
            yield
        return logits, cached

    # ---------------------------------------------------------------- generate
    def _generate(self, h: JobHandle) -> Iterator[StepRequest | None]:
        """Run one job; yields between prefill chunks and decode tokens (with deferred
        steps: the StepRequest of each decode step, for the worker to run)."""
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
                logits, cached = yield from self._sync(h, effective, cached)
            if logits is None:
                self.reset_session()  # a half-prefilled image block is no reusable state
                self.live_images = None
            else:
                reuse.keep_checkpoint(self, job, effective)
        else:
            logits, cached = yield from self._sync(h, effective, cached)
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
        yield from self._decode(h, logits, prompt_tokens, cached)

    def _decode(self, h: JobHandle, logits, prompt_tokens: int, cached: int) -> Iterator[StepRequest | None]:
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
        # logit_bias and penalties (sampling.Penalties; the prompt for the repetition penalty)
        pen = Penalties(job.params, int(logits.shape[-1]), s.tokens) if job.params.penalised else None
        constraint = None  # structured output: the grammar's mask, applied to the answer (not the reasoning)
        if job.grammar is not None:
            from .structured import Constraint

            constraint = Constraint(job.grammar, tk, int(logits.shape[-1]))
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
            constrained = constraint is not None and getattr(parser, "phase", "text") == "text"
            x = constraint.apply(logits) if constrained else logits
            tok = int(sampler.sample(x, params, generated, banned, pen if params is job.params else None).item())
            if constrained:
                constraint.consume(tok)
            return tok

        # Forced tool text and greedy-inside-a-tool-call for sampled jobs are host decisions
        # per token: those jobs run the loop synchronously; every other job samples on the
        # device, one token ahead of the host (decode.py).
        host_chooses = force is not None or (job.tools_active and not job.params.greedy) or constraint is not None
        if host_chooses:
            sample = pick
        else:
            sample = DeviceSampler(job.params, int(logits.shape[-1]), banned, seed=sampler.seed, penalties=pen)
        # forced tool-call header tokens do not count against max_tokens (#17): with forced text
        # the limit is checked here, the context room always
        stop_ids = () if job.ignore_eos else [e for e in ends if e is not None]
        spec_stats = SpecStats()
        loop = None
        if not host_chooses:  # speculation: the same tokens, several per target forward (#21)
            loop = loop_for_job(
                self.speculation, s, logits, job.params, banned=banned, seed=sampler.seed,
                stop_ids=stop_ids, limit=max_tokens, stats=spec_stats,
            )  # fmt: skip
        if loop is None:
            loop = decode_tokens(
                s,
                logits,
                sample,
                stop_ids=stop_ids,
                lookahead=not host_chooses,
                limit=max_tokens if force is None else None,
                defer=self._defer_steps,
            )
        tokens = iter(loop)
        while True:
            if h.cancelled or self._closed:
                finish, error = "cancelled", "cancelled"
                break
            try:
                tok = next(tokens)
                while isinstance(tok, StepRequest):  # deferred: the worker runs it with the others'
                    yield tok
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
            if not getattr(loop, "defer", False):
                yield  # the other slots' turn (a deferred loop gave it at its step request)
        if not broken and hasattr(loop, "settle"):
            loop.settle()  # speculative tokens the output did not take are dropped from the session
            self._count_speculation(spec_stats)
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
            "%s gen=%d finish=%s%s %.2f t/s%s",
            job_kind(job),
            len(generated),
            finish,
            f' error="{error}"' if error else "",
            len(generated) / dt if dt > 0 else 0.0,
            f" spec drafted={spec_stats.drafted} accepted={spec_stats.accepted}" if spec_stats.rounds else "",
        )
        usage = Usage(
            prompt_tokens,
            len(generated),
            cached,
            prompt_tokens - cached,
            reasoning_tokens=self._reasoning_tokens(parsed, len(generated)),
        )
        h.result = Finish(
            finish,
            usage,
            raw_text=raw_text,
            result=parsed,
            error=error,
            stop_sequence=stops.hit,
            speculation=spec_stats.as_dict() if spec_stats.rounds else None,
        )
        h.emit(h.result)

    def _count_speculation(self, st: SpecStats) -> None:
        t = self.stats
        t.spec_rounds += st.rounds
        t.spec_drafted += st.drafted
        t.spec_accepted += st.accepted
        t.spec_draft_seconds = round(t.spec_draft_seconds + st.draft_seconds, 4)
        t.spec_verify_seconds = round(t.spec_verify_seconds + st.verify_seconds, 4)
        t.spec_acceptance_rate = round(t.spec_accepted / t.spec_drafted, 4) if t.spec_drafted else 0.0

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

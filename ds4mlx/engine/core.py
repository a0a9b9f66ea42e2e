"""The engine: one owner of the model and its resident sessions, a queue of jobs and
one worker thread that runs them (docs/http-api.md §1.4, docs/kv-cache.md §2, §11).

A front end builds a `Job` (engine/job.py), calls `Engine.submit(job, emit)` and
receives `ds4mlx.runtime.events` through `emit` (called on the worker thread), ending with
one `Finish` — or with a `Failed` when the job could not start (HTTP status +
message).  `Engine.generate(job)` is the blocking iterator form for the CLI and tests.

The parts: the scheduler (engine/scheduler.py: queue, admission, routing, turns)
over N slots (engine/slots.py), each with its runner (engine/runner.py) that runs
a request's state machine (engine/request.py: the reuse ladder in reuse.py, the
prefill in prefill.py, the decode in decoding.py) on the slot's session; the disk
cache plugs in at `CacheHooks` (engine/hooks.py).  N = 1 (the default) is the single
live session: one job at a time, in order.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

from ..chat.protocol import protocol_for_model
from ..runtime.events import Finish
from ..runtime.prefill_chunk import default_chunk
from .checkpoints import MemoryCheckpoints
from .hooks import CacheHooks
from .job import Failed, Job, JobHandle
from .parser import default_parser_factory, stop_ids
from .runner import SlotRunner
from .scheduler import Scheduler, WorkerCall
from .slots import Slot
from .stats import EngineStats

BATCHED_DECODE_ENV = "DS4MLX_BATCHED_DECODE"


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
        speculation=None,
        slots: int = 1,
        prefill_quantum: int | None = None,
    ):
        self.model = model
        # the chat protocol of the model's family (rendering and output parsing)
        self.protocol = protocol if protocol is not None else protocol_for_model(model)
        self.stop_ids = stop_ids(tokenizer, self.protocol)
        self.tokenizer = tokenizer
        self.ctx = int(ctx)
        self.default_max_tokens = int(default_max_tokens)
        self.prefill_chunk = max(1, int(prefill_chunk or default_chunk()))  # prefill_chunk.py
        # --mixed-prefill-quantum: prefill chunks end at its multiples too, so a long
        # prefill yields to the other slots' decode steps that often
        self.prefill_quantum = max(1, int(prefill_quantum)) if prefill_quantum else None
        # one step's token budget (engine/batch.py): decode rows + prefill chunks; at most
        # one full chunk a step, several short ones where they fit
        self.step_tokens = min(self.prefill_chunk, self.prefill_quantum or self.prefill_chunk)
        self.tool_memory = tool_memory
        self.parser_factory = parser_factory
        self.checkpoints = checkpoints if checkpoints is not None else MemoryCheckpoints()
        self.stats = EngineStats()
        self.speculation = speculation  # speculative.options.SpecConfig, or None
        self.vision = None  # vision.encoder.VisionEncoder (enable_vision)
        self.live_images = None  # vision.reuse.LiveImages: the images the live session holds
        self.vision_checkpoint = None  # vision.reuse.VisionCheckpoint: the last image prompt's end
        self.bind_lock = threading.Lock()  # the slots' protocol bindings (read from other threads)
        self.closed = False
        all_slots = [Slot(i) for i in range(max(1, int(slots)))]
        # with several slots the decode loops hand their steps to the worker, which runs the
        # ready steps of all slots in one forward where the family can
        # (DS4MLX_BATCHED_DECODE=0: one forward per slot, in turn)
        self.defer_steps = len(all_slots) > 1
        all_slots[0].cache = cache or CacheHooks()
        for_slot = getattr(all_slots[0].cache, "for_slot", None)
        for sl in all_slots[1:]:
            sl.cache = for_slot() if callable(for_slot) else all_slots[0].cache
        self.runners = [SlotRunner(self, sl) for sl in all_slots]
        share = os.environ.get(BATCHED_DECODE_ENV, "1").strip() != "0"
        self.scheduler = Scheduler(self, self.runners, share)
        # Every MLX operation on a session happens on the worker thread: MLX
        # streams are per thread, so the sessions' arrays are created there too.
        self._ready = threading.Event()
        self._stopped = threading.Event()
        self._init_error: BaseException | None = None
        self._worker = threading.Thread(target=self._run, name="ds4mlx-engine", daemon=True)
        self._worker.start()
        self._ready.wait()
        if self._init_error is not None:
            raise self._init_error

    # ---------------------------------------------------------------- the first slot
    # With one slot (the default) its session is "the live session"; front ends that
    # touch it directly (the agent's KV checkpoints through run_on_worker, stats) use these.
    @property
    def session(self):
        return self.runners[0].session

    @property
    def cache(self) -> CacheHooks:
        return self.runners[0].slot.cache

    @cache.setter
    def cache(self, hooks: CacheHooks) -> None:
        self.runners[0].slot.cache = hooks

    def reset_session(self) -> None:
        """Empty the first slot's session (worker thread only)."""
        self.runners[0].reset_session()

    def live_visible_text(self) -> str | None:
        """The first slot's visible key of visible-keyed saves (SlotRunner.live_visible_text)."""
        return self.runners[0].live_visible_text()

    def live_visible_key(self) -> tuple[str, str] | None:
        return self.runners[0].live_visible_key()

    # ---------------------------------------------------------------- public
    def enable_vision(self, encoder) -> None:
        """Accept image jobs; from now on the disk KV cache hooks stay silent while the
        live session holds images (docs/vision.md §3)."""
        from ..vision.reuse import GuardedHooks

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
    def worker_thread_id(self) -> int | None:
        """The worker thread's id (its CPU clock: bench/engine_host.py)."""
        return self._worker.ident

    @property
    def slots(self) -> int:
        return len(self.runners)

    @property
    def running(self) -> list[JobHandle]:
        """The jobs admitted to a slot and not finished."""
        return self.scheduler.running()

    @property
    def resident_slots(self) -> list:
        """The slots themselves, for read-only views (GET /slots); the worker owns them."""
        return [r.slot for r in self.runners]

    @property
    def _running(self) -> JobHandle | None:  # one slot's view, as before batching
        jobs = self.running
        return jobs[0] if jobs else None

    @property
    def queue_depth(self) -> int:
        return self.scheduler.depth()

    def queue_position(self, handle: JobHandle) -> int:
        """1 = the next job to run, 2 = one ahead of it, ...; 0 = not waiting
        (running, finished or cancelled)."""
        return self.scheduler.position(handle)

    def submit(self, job: Job, emit: Callable[[Any], None]) -> JobHandle:
        if self.closed:
            raise RuntimeError("engine is shut down")
        h = JobHandle(job, emit, self.stats)
        self.scheduler.put(h)
        return h

    def generate(self, job: Job) -> Iterator[Any]:
        """Blocking iterator over the job's events (ends after Finish/Failed).
        Closing the iterator early cancels the job."""
        q: queue.SimpleQueue = queue.SimpleQueue()  # the cheapest wake per token of the worker's puts
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
        if self.closed:
            raise RuntimeError("engine is shut down")
        call = WorkerCall(fn)
        self.scheduler.put(call)
        if not call.done.wait(timeout):
            raise TimeoutError("worker call did not run")
        if call.error is not None:
            raise call.error
        return call.result

    def live_call_ids(self, key: str) -> frozenset:
        """Call ids of the remembered live tool turns under the front end's binding key
        (`LiveBinding.key`), over every slot."""
        ids: frozenset = frozenset()
        for r in self.runners:
            b, _ = r.bindings()
            if b is not None and b.key == key and b.live_tokens == len(r.slot):
                ids |= b.call_ids
        return ids

    def reset_live(self, ctx: int | None = None, timeout: float = 60.0) -> None:
        """Drop the live sessions for fresh ones (of `ctx` tokens if given), e.g.
        after the model's steering changed; runs on the worker after the queued
        jobs and returns when done."""
        self.run_on_worker(lambda engine: engine.new_sessions(ctx), timeout)

    def new_sessions(self, ctx: int | None = None) -> None:
        """Fresh sessions on every slot (worker thread, no job running)."""
        if ctx is not None:
            self.ctx = int(ctx)
        for r in self.runners:
            r.new_session()

    def close(self, timeout: float = 10.0) -> None:
        if self.closed:
            return
        self.closed = True
        for h in self.running:
            h.cancel()
        self.scheduler.put(None)
        self._stopped.wait(timeout)

    # ---------------------------------------------------------------- worker
    def _run(self) -> None:
        try:
            for r in self.runners:
                r.session = self.model.new_session(self.ctx)
        except BaseException as e:  # noqa: BLE001 - re-raised by __init__
            self._init_error = e
            self._stopped.set()
            self._ready.set()
            threading.Event().wait()  # park (see the end of this method)
        self._ready.set()
        self.scheduler.loop()
        self.scheduler.shutdown()
        self._stopped.set()
        # Park instead of returning: when an MLX thread exits, its thread-local
        # MLX state is torn down and may need the GIL; if that races with the
        # interpreter's finalization the process aborts ("terminate called
        # without an active exception").  A parked daemon thread just ends with
        # the process.
        threading.Event().wait()

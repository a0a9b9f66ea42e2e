"""The scheduler: the job queue, admission, routing to slots and the turns
(docs/kv-cache.md §11; vLLM's scheduler / model-runner seam, llama.cpp's
`update_slots` over slot objects).

Submitted work (a `JobHandle`, or a `WorkerCall` from `Engine.run_on_worker`) is
queued; the worker thread's `loop` admits what can start — a job needs a free
slot, chosen by the reuse ladder (`slots.route` over `reuse.reusable`), a worker
call an idle engine — and then gives every running request one turn on its slot's
runner, up to the work it waits for next: a decode token or a prefill chunk.  Then
one engine step runs (engine/batch.py): the decode rows of every running request
together (`decode.run_steps`: one forward where the family can) and the prefill
chunks the step's token budget (`Engine.step_tokens`) takes, so a long prompt
advances chunk by chunk between the other requests' decode tokens.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..runtime.events import Finish
from . import reuse
from .batch import ChunkRequest, Work, plan_step, run_plan
from .hooks import call_hook
from .job import Failed, JobHandle
from .request import run_request
from .runner import SlotRunner
from .slots import Slot, route

if TYPE_CHECKING:
    from .core import Engine

log = logging.getLogger("ds4mlx.engine")


class WorkerCall:
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


@dataclass
class Task:
    """A job admitted to a slot: `steps` is its `run_request` generator once started,
    `want` the work it waits for (a decode step or a prefill chunk), None at a turn."""

    handle: JobHandle
    runner: SlotRunner
    steps: Iterator[Work | None] | None = None
    want: Work | None = None


class Scheduler:
    def __init__(self, engine: Engine, runners: list[SlotRunner], share_steps: bool = True):
        self.engine = engine
        self.runners = runners
        self.share_steps = share_steps  # DS4MLX_BATCHED_DECODE=0: one forward per slot, in turn
        self.queue: queue.Queue[JobHandle | WorkerCall | None] = queue.Queue()
        # taken off `queue` by the worker, not yet running (FIFO; guarded by pending_lock)
        self.pending: collections.deque = collections.deque()
        self.pending_lock = threading.Lock()

    # ------------------------------------------------ any thread
    def put(self, item: JobHandle | WorkerCall | None) -> None:
        """Queue a job, a worker call, or None: stop once the running jobs ended."""
        self.queue.put(item)

    def running(self) -> list[JobHandle]:
        return [r.slot.active for r in self.runners if r.slot.active is not None]

    def depth(self) -> int:
        with self.pending_lock:
            return len(self.pending) + self.queue.qsize()

    def position(self, handle: JobHandle) -> int:
        """1 = the next job to run, 2 = one ahead of it, ...; 0 = not waiting."""
        with self.pending_lock, self.queue.mutex:
            for i, h in enumerate(itertools.chain(self.pending, self.queue.queue)):
                if h is handle:
                    return i + 1
        return 0

    # ------------------------------------------------ the worker thread
    def loop(self) -> None:
        """Run until stopped (None queued) and every admitted job ended."""
        tasks: list[Task] = []
        stopping = False
        changed = False  # something arrived or ended since the last admission
        while not (stopping and not tasks):
            # take what was submitted: block only when there is nothing to run
            while not stopping:
                idle = not tasks and not self.pending
                if not idle and self.queue.empty():
                    break  # a turn per token: no Empty raised and caught each time
                try:
                    item = self.queue.get(block=idle)
                except queue.Empty:
                    break
                changed = True
                if item is None:
                    stopping = True
                else:
                    with self.pending_lock:
                        self.pending.append(item)
            if changed or any(getattr(h, "cancelled", False) for h in self.pending):
                # once closed, the jobs still pending end "cancelled before start"
                self._admit(tasks)
                changed = False
            for t in list(tasks):  # one turn each, up to the next piece of work it waits for
                if t.want is None and not self._advance(t):
                    tasks.remove(t)
                    changed = True
            self._step(tasks)

    def _step(self, tasks: list[Task]) -> None:
        """One engine step (engine/batch.py): the decode rows of every running request and
        the prefill chunks the budget takes; their requests go on at their next turn."""
        if all(t.want is None for t in tasks):
            return  # one slot's lookahead decode: nothing waits for a step
        for t in tasks:  # a chunk still waiting for its step is not run for a cancelled job
            if isinstance(t.want, ChunkRequest) and t.handle.cancelled:
                t.want = None
        plan = plan_step([t.want for t in tasks if t.want is not None], self.engine.step_tokens)
        if not plan.rows and not plan.chunks:
            return
        stats = self.engine.stats
        stats.shared_steps += run_plan(plan, self.share_steps)
        stats.mixed_steps += bool(plan.rows and plan.chunks)
        ran = {id(w) for w in (*plan.rows, *plan.chunks)}
        for t in tasks:
            if id(t.want) in ran:
                t.want = None

    def shutdown(self) -> None:
        """The slots' shutdown saves, then everything still queued ends cancelled."""
        for r in self.runners:  # on the worker: the sessions' MLX stream lives here
            call_hook(r.cache.on_shutdown, r)
        while True:
            with self.pending_lock:
                h = self.pending.popleft() if self.pending else None
            if h is None:
                try:
                    h = self.queue.get_nowait()
                except queue.Empty:
                    break
            if isinstance(h, WorkerCall):
                h.error = RuntimeError("engine is shut down")
                h.done.set()
            elif h is not None:
                h.emit(Finish("cancelled", error="shutdown"))
                h.done.set()

    # ------------------------------------------------ admission
    def _admit(self, tasks: list[Task]) -> None:
        """Start pending work while it can start: a job needs a free slot, a worker call
        an idle engine (it runs between jobs, as with one slot, and no job queued after
        it starts before it).  Jobs start in order, except that a job which would evict
        a slot that a job queued behind it can reuse waits for that one to start first."""
        while self._admit_one(tasks):
            pass

    def _admit_one(self, tasks: list[Task]) -> bool:
        """Start (or cancel) the first pending item that can go; False when none can."""
        with self.pending_lock:
            items = list(self.pending)
        barrier = next((i for i, it in enumerate(items) if isinstance(it, WorkerCall)), len(items))
        if barrier == 0 and items:
            if tasks:
                return False
            self._take(items[0]).run(self.engine)
            return True
        jobs = items[:barrier]
        for i, h in enumerate(jobs):
            if h.cancelled or self.engine.closed:
                self._take(h)
                self.engine.stats.cancelled += 1
                h.finish(Finish("cancelled", error="cancelled before start"))
                h.done.set()
                return True
            free = [r.slot for r in self.runners if r.slot.active is None]
            if not free:
                return False
            slot = self._route(h, free, jobs[i + 1 :])
            if slot is None:
                continue  # its victim is wanted by a later job: that one first
            self._take(h)
            tasks.append(Task(h, self.runners[slot.index]))
            slot.active = h
            h.slot = slot.index
            return True
        return False

    def _take(self, item):
        with self.pending_lock:
            self.pending.remove(item)
        return item

    def _route(self, h: JobHandle, free: list[Slot], later: Sequence[JobHandle] = ()) -> Slot | None:
        """The free slot a job runs on, by the reuse ladder; None = wait (the only slots
        it could evict hold state that a job in `later` reuses)."""
        if len(self.runners) == 1:
            return free[0]

        def probe(job):
            return lambda sl: reuse.reusable(self.runners[sl.index], job)

        def shared(sl: Slot) -> int:
            return reuse.shared_tokens(self.runners[sl.index], h.job)

        try:
            r = route(free, probe(h.job), shared=shared)
            if not r.reusable and len(r.slot):
                wanted = {id(sl) for j in later for sl in free if len(sl) and probe(j.job)(sl)}
                spare = [sl for sl in free if id(sl) not in wanted]
                if not spare:
                    return None
                r = route(spare, lambda sl: 0, shared=shared)
        except Exception:
            log.exception("job %d: routing failed", h.id)
            return free[0]  # run_request fails the job the same way
        if r.reusable:
            log.info("slot %d routed job %d reuse=%d", r.slot.index, h.id, r.reusable)
        elif len(r.slot):
            log.info(
                "slot %d evicted for job %d tokens=%d idle=%.0fs%s%s",
                r.slot.index,
                h.id,
                len(r.slot),
                r.slot.idle_s(),
                " stale" if r.stale else "",
                f" same-conversation shared={r.shared}" if r.shared else "",
            )
        return r.slot

    # ------------------------------------------------ turns
    def _advance(self, t: Task) -> bool:
        """Run one turn of a job on its slot, up to the work it waits for next (`t.want`:
        a decode step or a prefill chunk; None = a turn boundary).  False once it ended."""
        h = t.handle
        ended = False
        try:
            if t.steps is None:
                t.steps = run_request(t.runner, h)
            t.want = next(t.steps)
        except StopIteration:
            ended = True
        except Exception as e:  # keep serving whatever happened
            ended = True
            log.exception("job %d failed", h.id)
            t.runner.invalidate()
            if h.started:
                h.finish(Finish("error", error=str(e) or type(e).__name__))
            else:
                h.emit(Failed(500, str(e) or type(e).__name__))
        if ended:
            t.runner.slot.active = None
            t.runner.slot.last_used = time.monotonic()
            h.done.set()
        return not ended

"""A generation request as the engine takes it (docs/http-api.md §1.4), and its handle.

A `Job` is API-neutral: a front end renders and validates its request into one, and
what the engine must know of the front end's API comes as data — `raw` (the text is
the output), the tool-protocol flags and a `LiveBinding`, whose key is opaque to the
engine (the front end asks for its live tool state by it again).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..runtime.events import Finish
from ..runtime.sampling import SamplingParams

log = logging.getLogger("ds4mlx.engine")


@dataclass(frozen=True)
class Failed:
    """Terminal event of a job that could not start generating.  The front end
    answers HTTP `status` with `message` if it has not sent anything yet."""

    status: int
    message: str


@dataclass(frozen=True)
class LiveBinding:
    """How a front end continues the live session after this job's turn
    (docs/kv-cache.md §2 steps 1-4).  `key` is opaque here: the front end asks
    `Engine.live_call_ids(key)`, and the reuse sources are `<key>-visible` and
    `<key>-tool-output`."""

    key: str
    # remember every finished turn with its visible transcript (prompt + visible
    # answer), not only the call ids of a tool-call turn
    visible: bool = False
    summary: bool = False  # a tool-call turn's visible transcript keeps its reasoning (the client saw it)
    missing: str = "continuation state is not available"  # the 409 when `requires_live` finds no state


@dataclass
class Job:
    """One generation request, already rendered and validated."""

    prompt_text: str
    prompt_ids: list[int] | None = None  # tokenization of prompt_text (if done for the ctx check)
    api: str = "chat"  # the front end's name for its API: logs and its own use; the engine never reads it
    raw: bool = False  # the raw text is the output (no reasoning/DSML split)
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
    # Live tool-output continuation (docs/kv-cache.md §2 steps 2–4): the rendered live
    # tail (docs/chat-template.md §4.5, starts with ⟨EOS⟩) and the id set of the trailing
    # tool outputs; `requires_live` = the request cannot be served without that live
    # state (its tool outputs answer calls it does not replay).
    continuation_tail: str | None = None
    continuation_ids: frozenset = frozenset()
    requires_live: bool = False
    binding: LiveBinding | None = None  # the front end's live tool state for this turn, if it keeps one
    preserves_reasoning: bool = False  # the prompt renders old reasoning (tool context)
    label: str = ""  # for logs / trace
    family: str | None = None  # chat protocol family (chat/protocol.py); None = the engine's
    tool_schemas: Sequence[str] = ()  # active tool schema lines (typed arguments for tag-based calls)
    single_tool_call: bool = False  # parallel_tool_calls false: stop after the first call (chat/protocol.py)
    # logprobs: None = not asked; k = the chosen token's log-prob plus the k most likely (0..20)
    logprobs: int | None = None
    # legacy completions `echo`: the caller's prompt text, printed before the output (and, with
    # logprobs, its tokens' log-probs from a full forward of the prompt); None = no echo
    echo: str | None = None
    grammar: Any = None  # structured output (structured.Grammar): the answer's tokens constrained
    # strict tools: the grammar of a forced call's rest (after force_text), its arguments held to their schemas
    tool_grammar: Any = None
    # image input (docs/vision.md): the image-token blocks in prompt_ids (vision.encoder.ImageSpan)
    # and their images (chat.images.ImageInput), in the same order
    images: Sequence = ()
    image_inputs: Sequence = ()


def job_kind(job: Job) -> str:
    return "completion" if job.raw else "chat"


class JobHandle:
    """A submitted job: its events go to `emit` (on the worker thread); `cancel()` from anywhere."""

    _ids = itertools.count(1)

    def __init__(self, job: Job, emit: Callable[[Any], None], stats=None):
        self.id = next(self._ids)
        self.job = job
        self._emit = emit
        self._stats = stats  # EngineStats: counts cancel requests
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
        if not self._cancel.is_set() and not self.done.is_set() and self._stats is not None:
            self._stats.cancel_requests += 1
        self._cancel.set()

    def emit(self, ev) -> None:
        try:
            self._emit(ev)
        except Exception:  # a dead consumer must never kill the worker
            log.exception("event consumer failed")

    def finish(self, result: Finish) -> None:
        """Record and send the job's terminal `Finish`."""
        self.result = result
        self.emit(result)

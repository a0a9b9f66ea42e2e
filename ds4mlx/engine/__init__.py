"""The engine (engine/core.py's module doc): jobs in, events out, over resident sessions.

    job.py          Job (API-neutral), LiveBinding, Failed, JobHandle
    core.py         Engine: the public face, the worker thread
    scheduler.py    queue, admission, routing to slots, the turns
    batch.py        one engine step: decode rows + prefill chunks under a token budget
    slots.py        Slot objects, the router's policy (reuse first, then an eviction victim)
    runner.py       SlotRunner: one slot's session, bindings and checkpoints; the hooks' context
    request.py      one request's state machine: reuse plan -> prefill -> decode -> finish
    reuse.py        the reuse ladder (docs/kv-cache.md §2)
    prefill.py      the chunked prefill
    decoding.py     the decode loop's consumer: sampling, stop strings, the output parser, Finish
    parser.py       the OutputParser protocol, raw output
    bindings.py     protocol bindings of a live session
    checkpoints.py  in-memory session checkpoints
    hooks.py        CacheHooks: where the disk KV cache plugs in
    stats.py        EngineStats

The engine names no HTTP API and imports nothing from serve/ or a model family
(tests/test_layout.py).
"""

from ..runtime.events import Finish
from .checkpoints import MemoryCheckpoints
from .core import BATCHED_DECODE_ENV, Engine
from .hooks import CacheHooks, SlotContext
from .job import Failed, Job, JobHandle, LiveBinding, job_kind
from .parser import OutputParser, ParsedOutput, RawOutput, default_parser_factory
from .stats import EngineStats

__all__ = [
    "BATCHED_DECODE_ENV",
    "CacheHooks",
    "Engine",
    "EngineStats",
    "Failed",
    "Finish",
    "Job",
    "JobHandle",
    "LiveBinding",
    "MemoryCheckpoints",
    "OutputParser",
    "ParsedOutput",
    "RawOutput",
    "SlotContext",
    "default_parser_factory",
    "job_kind",
]

"""The output parser the decode loop drives, as a typed interface.

A family's chat protocol makes one per job (`ChatProtocol.make_parser`,
chat/protocol.py); the engine feeds it the released text and reads three flags
each token.  Completions (`Job.raw`) get `RawOutput`: every piece is content.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from ..chat.protocol import FirstCallOnly, get_protocol
from ..runtime.events import TextDelta

if TYPE_CHECKING:
    from .job import Job


class ParsedOutput(Protocol):
    """The final parse of a generation (chat/families/deepseek_v4/dsml.py's ParsedOutput)."""

    content: str
    reasoning: str | None
    calls: list  # parsed tool calls, each with an `id`
    raw_dsml: str | None  # the tool-call block as sampled: tool memory keeps it
    error: str | None  # a tool-call block recovered as text: why


class OutputParser(Protocol):
    phase: str  # reasoning | text | tool | done
    stop_now: bool  # the tool-call block just closed: generation ends here

    @property
    def structural(self) -> bool:
        """The next token is inside tool-call structure: sample it greedily (docs/dsml.md §5.1)."""

    def feed(self, text: str) -> list:
        """Released text -> events."""

    def finish(self, truncated: bool = False) -> tuple[list, ParsedOutput | None]:
        """The closing events and the final parse (None: nothing parsed, raw output)."""


class RawOutput:
    """Completions: every released piece of raw text is content."""

    phase = "text"
    structural = False
    stop_now = False

    def feed(self, text: str) -> list:
        return [TextDelta(text)] if text else []

    def finish(self, truncated: bool = False) -> tuple[list, ParsedOutput | None]:
        return [], None


def default_parser_factory(job: Job, tool_memory=None) -> OutputParser:
    if job.raw:
        return RawOutput()
    parser = get_protocol(job.family).make_parser(
        job.thinking != "none", job.tools_active, job.tool_id_prefix, tool_memory, tool_schemas=job.tool_schemas
    )
    return FirstCallOnly(parser) if job.single_tool_call and job.tools_active else parser


def calls_of(parsed: ParsedOutput | None) -> list:
    return list(parsed.calls or []) if parsed is not None else []


def stop_ids(tokenizer, protocol) -> frozenset:
    """Token ids of the protocol's end-of-turn strings (they stop like EOS)."""
    lookup = getattr(tokenizer, "token_to_id", None)
    ids: Sequence[Any] = [lookup(s) for s in protocol.stop_strings] if lookup is not None else ()
    return frozenset(i for i in ids if i is not None)

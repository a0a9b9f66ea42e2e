"""The one engine event stream.

The engine turns sampled tokens into these events; every front end (OpenAI chat,
legacy completions, Anthropic, Responses, the CLI, eval) only decides how to print
them.  Events carry plain Python values, never MLX arrays.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class PrefillProgress:
    """`done` of `total` prompt tokens evaluated (cached tokens count as done)."""

    done: int
    total: int


@dataclass(frozen=True)
class Started:
    """Prefill finished; generation begins.  Token counts of the effective prompt."""

    prompt_tokens: int
    cached_tokens: int
    # the reuse-ladder rung the cached tokens came from (docs/kv-cache.md §2: "memory-token",
    # "memory-checkpoint", "disk-text", ...; "none")
    cache_source: str = "none"
    # legacy completions `echo`: the job's prompt text, and with logprobs its tokens'
    # TokenLogprobs (a stream prints them before the first generated token)
    echo: str | None = None
    prompt_logprobs: tuple | None = None


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A fragment of the OpenAI-style `arguments` JSON text of call `index`."""

    index: int
    arguments: str


@dataclass(frozen=True)
class ToolCallEnd:
    index: int
    id: str
    name: str
    arguments: str  # the complete arguments JSON text


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # reused prefix (live session or disk checkpoint)
    written_tokens: int = 0  # prompt_tokens - cached_tokens
    reasoning_tokens: int = 0  # of completion_tokens, those that were reasoning

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-prob: the model's log-softmax of the raw logits it was chosen
    from (before temperature, penalties, bias and grammar masks), and the `top` most likely
    (token id, text, log-prob), most likely first.  An echoed prompt's first token has
    no log-prob (None)."""

    token: int
    text: str
    logprob: float | None
    top: tuple = ()


@dataclass(frozen=True)
class Finish:
    """Last event of every job.  reason: stop | length | tool_calls | error | cancelled.

    `result` is the final parse of the whole output (content, reasoning, tool calls),
    which non-streaming responses print; `raw_text` is everything generated."""

    reason: str
    usage: Usage = field(default_factory=Usage)
    raw_text: str = ""
    result: Any | None = None
    error: str | None = None
    stop_sequence: str | None = None  # the stop sequence that ended the output (reason stop)
    # speculative decoding: this job's counters (SpecStats.as_dict(), the numbers the
    # engine adds to its totals), None when the job did not speculate
    speculation: dict | None = None
    # logprobs asked: one TokenLogprob per generated token, in order (None when not asked)
    logprobs: tuple | None = None
    # legacy completions `echo`: the job's prompt text, and with logprobs its tokens' TokenLogprobs
    echo: str | None = None
    prompt_logprobs: tuple | None = None


Event = PrefillProgress | Started | TextDelta | ReasoningDelta | ToolCallStart | ToolCallDelta | ToolCallEnd | Finish

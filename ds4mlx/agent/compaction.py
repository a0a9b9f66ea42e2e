"""Context compaction, as ds4-agent does it (antirez/ds4 ds4_agent.c,
"Context Compaction": agent_worker_should_compact, agent_compact_tail_start,
agent_worker_compact).

* the compaction reserve: room kept free so the summary can always be asked
  for: the request's tokens + the summary budget (ctx/8 clamped to 256..4096)
  + 64 (agent_compact_reserve_tokens in the ds4 of the service-layer tutorial,
  section 4; the ds4_agent.c mirrored here, 8d57664, still has a flat 4096);
  a reply is cut at the reserve ("generation reached compaction reserve"),
  compacted and continued;
* soft trigger, before a turn: the prompt uses >= 85 % of the context, or the
  free room is at most max(min(8192, ctx/8), reserve + 128) tokens (the fixed
  threshold is capped proportionally so tiny test contexts still compact);
* hard trigger, before a tool result: the prompt with the result plus a
  1024-token reserve would not fit -> compact once and retry, else the model
  gets a bounded tool error instead of the result;
* the live model writes a private task-state summary (prompts.COMPACT_REQUEST,
  greedy, at most the summary budget, never a tool call), then the conversation is
  rebuilt as system + tools + summary + a verbatim tail of up to ctx/10 tokens
  (at most 50 000), started at a user turn.

This module is the arithmetic and the rebuild; the worker runs the summary job.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..chat.messages import Message
from . import prompts

SOFT_PERCENT = 85
MIN_FREE_TOKENS = 8192
TAIL_DIVISOR = 10
TAIL_CAP_TOKENS = 50_000
SUMMARY_MAX_TOKENS = 4096
SUMMARY_MIN_TOKENS = 256
SUMMARY_MIN_ROOM = 256
RESERVE_SLACK = 64
TRIGGER_SLACK = 128
TOOL_RESULT_RESERVE_TOKENS = 1024


def summary_budget(ctx: int) -> int:
    return max(SUMMARY_MIN_TOKENS, min(ctx // 8, SUMMARY_MAX_TOKENS))


def reserve(ctx: int, request_tokens: int) -> int:
    """Tokens kept free so the compaction request and its summary always fit."""
    return request_tokens + summary_budget(ctx) + RESERVE_SLACK


def should_compact(used: int, ctx: int, reserve_tokens: int = 0) -> bool:
    if ctx <= 0 or used <= 0:
        return False
    if used >= ctx * SOFT_PERCENT // 100:
        return True
    return ctx - used <= max(min(MIN_FREE_TOKENS, ctx // 8), reserve_tokens + TRIGGER_SLACK)


def tool_result_fits(projected_prompt: int, ctx: int, reserve: int = TOOL_RESULT_RESERVE_TOKENS) -> bool:
    return projected_prompt + reserve <= ctx


def tail_budget(ctx: int) -> int:
    return max(1, min(ctx // TAIL_DIVISOR, TAIL_CAP_TOKENS))


def tail_start(
    messages: Sequence[Message],
    first: int,
    cost: Callable[[Message], int],
    budget: int,
    keep_from: int | None = None,
) -> int:
    """Index where the verbatim tail starts: the earliest message whose suffix
    fits `budget`, moved forward to the first user turn in that window (else
    to the first assistant turn: a tail never starts with an orphan tool result).
    `keep_from`: the tail starts there at the latest (the assistant turn whose
    calls are still being answered)."""
    total, start = 0, len(messages)
    for i in range(len(messages) - 1, first - 1, -1):
        total += cost(messages[i])
        if total > budget:
            break
        start = i
    if keep_from is not None and keep_from < start:
        return keep_from
    for role in ("user", "assistant"):
        for i in range(start, len(messages)):
            if messages[i].role == role:
                return i
    return len(messages)


def is_summary(m: Message) -> bool:
    return m.role == "system" and m.content.startswith(prompts.SUMMARY_OPEN)


def summary_message(summary: str, notes: Sequence[str] = ()) -> Message:
    """The summary as a system message (the V4 template puts every system
    message at the top: it stays part of the stable prefix)."""
    text = prompts.SUMMARY_OPEN + summary.strip() + "\n" + "".join(n + "\n" for n in notes) + prompts.SUMMARY_CLOSE
    return Message("system", text)


def rebuild(
    messages: Sequence[Message], n_system: int, summary: str, start: int, notes: Sequence[str] = ()
) -> list[Message]:
    """system messages + summary (+ notes) + messages[start:]; a tail that starts
    with an assistant turn gets a one-line user turn before it (the template needs one)."""
    tail = list(messages[start:])
    # an earlier summary is folded into the new one (the model saw it when it wrote it)
    head = [m for m in messages[:n_system] if not is_summary(m)] + [summary_message(summary, notes)]
    if tail and tail[0].role != "user":
        head.append(Message("user", prompts.CONTINUE_TASK))
    return head + tail


def compaction_request(reason: str) -> Message:
    text = prompts.COMPACT_REQUEST + (prompts.COMPACT_REASON.format(reason=reason) if reason else "")
    return Message("user", text)

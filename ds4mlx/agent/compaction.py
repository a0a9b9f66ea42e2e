"""Context compaction, as ds4-agent does it (antirez/ds4 ds4_agent.c,
"Context Compaction": agent_worker_should_compact, agent_compact_tail_start,
agent_worker_compact).

* soft trigger, before a turn: the prompt uses >= 85 % of the context, or the
  free room is at most min(8192, ctx/4) tokens (the fixed threshold is capped
  proportionally so tiny test contexts still compact instead of failing);
* hard trigger, before a tool result: the prompt with the result plus a
  1024-token reserve would not fit -> compact once and retry, else the model
  gets a bounded tool error instead of the result;
* the live model writes a private task-state summary (prompts.COMPACT_REQUEST,
  greedy, at most 4096 tokens, never a tool call), then the conversation is
  rebuilt as system + tools + summary + a verbatim tail of up to ctx/10 tokens
  (at most 50 000), started at a user turn.

This module is the arithmetic and the rebuild; the worker runs the summary job.
"""
from __future__ import annotations

from typing import Callable, Sequence

from ..chat.messages import Message
from . import prompts

SOFT_PERCENT = 85
MIN_FREE_TOKENS = 8192
TAIL_DIVISOR = 10
TAIL_CAP_TOKENS = 50_000
SUMMARY_MAX_TOKENS = 4096
SUMMARY_MIN_ROOM = 256
TOOL_RESULT_RESERVE_TOKENS = 1024


def should_compact(used: int, ctx: int) -> bool:
    if ctx <= 0 or used <= 0:
        return False
    if used >= ctx * SOFT_PERCENT // 100:
        return True
    return ctx - used <= min(MIN_FREE_TOKENS, ctx // 4)


def tool_result_fits(projected_prompt: int, ctx: int, reserve: int = TOOL_RESULT_RESERVE_TOKENS) -> bool:
    return projected_prompt + reserve <= ctx


def tail_budget(ctx: int) -> int:
    return max(1, min(ctx // TAIL_DIVISOR, TAIL_CAP_TOKENS))


def tail_start(messages: Sequence[Message], first: int, cost: Callable[[Message], int], budget: int) -> int:
    """Index where the verbatim tail starts: the earliest message whose suffix
    fits `budget`, moved forward to the first user turn in that window (else
    to the first assistant turn: a tail never starts with an orphan tool result)."""
    total, start = 0, len(messages)
    for i in range(len(messages) - 1, first - 1, -1):
        total += cost(messages[i])
        if total > budget:
            break
        start = i
    for role in ("user", "assistant"):
        for i in range(start, len(messages)):
            if messages[i].role == role:
                return i
    return len(messages)


def summary_message(summary: str) -> Message:
    text = prompts.SUMMARY_OPEN + summary.strip() + "\n" + prompts.SUMMARY_CLOSE
    return Message("system", text)


def rebuild(messages: Sequence[Message], n_system: int, summary: str, start: int) -> list[Message]:
    """system messages + summary + messages[start:]; a tail that starts with an
    assistant turn gets a one-line user turn before it (the template needs one)."""
    tail = list(messages[start:])
    head = list(messages[:n_system]) + [summary_message(summary)]
    if tail and tail[0].role != "user":
        head.append(Message("user", prompts.CONTINUE_TASK))
    return head + tail


def compaction_request(reason: str) -> Message:
    text = prompts.COMPACT_REQUEST + (prompts.COMPACT_REASON.format(reason=reason) if reason else "")
    return Message("user", text)

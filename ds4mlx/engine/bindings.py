"""Protocol bindings of a live session (docs/kv-cache.md §2 steps 1-3, 6).

After a turn the slot remembers how a later request may continue its live
session without matching its tokens: the front end's binding (`Job.binding`: the
visible transcript of the turn and / or the ids of the tool calls it made, under
the front end's opaque key) and the thinking binding (a thinking turn whose
reasoning the next prompt drops: its visible transcript).  A binding holds only
while the session has exactly `live_tokens` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from .job import Job
from .parser import ParsedOutput

KEEP_BINDING = "binding"  # a reuse rung keeps the front end's binding ...
KEEP_THINKING = "thinking"  # ... or the thinking binding


@dataclass
class Binding:
    live_tokens: int
    visible_text: str | None = None
    call_ids: frozenset = frozenset()
    key: str = ""  # the front end's LiveBinding.key ("" for the thinking binding)


def visible_prefix(b: Binding | None, pos: int, prompt: str) -> int | None:
    """Length of the binding's visible transcript when the live session is still the
    one it describes and the prompt extends it; else None."""
    if b is None or b.live_tokens != pos or not b.visible_text:
        return None
    if len(b.visible_text) < len(prompt) and prompt.startswith(b.visible_text):
        return len(b.visible_text)
    return None


def inside_think(text: str, think_open: str, think_close: str) -> bool:
    return text.rfind(think_open) > text.rfind(think_close)


def after_turn(job: Job, parsed: ParsedOutput, calls: list, ok: bool, raw_text: str, protocol, pos: int):
    """(front-end binding, thinking binding) a finished turn leaves on a session of
    `pos` tokens; `ok` = the turn ended normally (not an error, length or cancel)."""
    thinking = job.thinking != "none"
    content = parsed.content or ""
    call_ids = frozenset(c.id for c in calls)
    front = think = None
    # the family's own strings: its thinking markers and the text that closes an assistant turn
    think_open, think_close, turn_end = protocol.think_open, protocol.think_close, protocol.turn_end
    b = job.binding
    if b is not None and b.visible and ok:
        v = ""
        if thinking:
            if b.summary and calls:
                v += parsed.reasoning or ""
            v += think_close
        v += content + ((parsed.raw_dsml or "") if calls else "") + turn_end
        front = Binding(pos, job.prompt_text + v, call_ids, b.key)
    elif b is not None and ok and calls:
        front = Binding(pos, None, call_ids, b.key)
    if (
        not calls
        and ok
        and thinking
        and not job.tools_active
        and not job.preserves_reasoning
        and job.prompt_text.endswith(think_open)
        and not inside_think(job.prompt_text + raw_text, think_open, think_close)
    ):
        think = Binding(pos, job.prompt_text[: -len(think_open)] + think_close + content + turn_end)
    return front, think

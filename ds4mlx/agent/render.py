"""Rendering shared by the front ends: rich renderables for tool cards,
approval requests and the status line (never raw tool-call text)."""

from __future__ import annotations

from rich.markdown import Markdown
from rich.panel import Panel
from rich.text import Text

from .approval import PendingApproval
from .events import AWAITING_APPROVAL, DENIED, DONE, FAILED, PARSING, RUNNING, STOPPED, Status, ToolCard

CARD_STYLE = {
    PARSING: "dim",
    AWAITING_APPROVAL: "yellow",
    RUNNING: "cyan",
    DONE: "green",
    FAILED: "red",
    STOPPED: "magenta",
    DENIED: "red",
}
CARD_MARK = {PARSING: "…", AWAITING_APPROVAL: "?", RUNNING: "▶", DONE: "✓", FAILED: "✗", STOPPED: "■", DENIED: "✗"}
FINAL_STATES = {DONE, FAILED, STOPPED, DENIED}


def card(c: ToolCard) -> Text:
    style = CARD_STYLE.get(c.state, "")
    t = Text()
    t.append(f" {CARD_MARK.get(c.state, '•')} {c.name} ", style=f"bold {style}")
    t.append(c.summary or "", style=style)
    t.append(f"  [{c.state}]", style="dim")
    if c.detail and c.state in FINAL_STATES:
        t.append(f"  {c.detail}", style="dim")
    return t


def approval(p: PendingApproval) -> Panel:
    r = p.request
    body = Text(r.action)
    return Panel(
        body, title=f"allow {r.tool}?  cwd {r.cwd}", subtitle=f"y/N — denied in {p.timeout:g} s", border_style="yellow"
    )


def answer(text: str) -> Markdown:
    return Markdown(text)


def status_line(s: Status) -> str:
    """ctx used/total, generation tokens and t/s, greedy marker, prefill progress."""
    parts = [f"ctx {s.ctx_used}/{s.ctx_total}"]
    if s.state == "prefill" and s.prefill_total:
        parts.append(f"prefill {s.prefill_done}/{s.prefill_total} {s.prefill_tps:.1f} t/s")
    parts.append(f"gen {s.generated} {s.gen_tps:.1f} t/s")
    if s.greedy:
        parts.append("greedy")
    if s.cached:
        parts.append(f"cached {s.cached}")
    parts.append(s.state)
    return " | ".join(parts)

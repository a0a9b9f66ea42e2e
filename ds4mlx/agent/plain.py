"""`ds4mlx agent -p PROMPT`: one task, no interactive UI.

The answer goes to stdout (Markdown rendered when stdout is a terminal),
tool cards, notices and approval questions to stderr.  Without `--yes`, an
approval is read from stdin when it is a terminal; otherwise nobody can answer
and the timeout denies it.  Ctrl+C stops the agent cooperatively (a second
Ctrl+C during the stop is ignored; the session is still saved).
"""

from __future__ import annotations

import queue
import select
import sys
import threading

from rich.console import Console

from . import render
from .approval import PendingApproval
from .events import Notice, ReasoningDelta, Status, TextDelta, ToolCard, TurnEnd


def _read_answer(p: PendingApproval, console: Console) -> None:
    """Answer from stdin within the timeout (a terminal only)."""
    console.print(render.approval(p))
    console.print("[yellow]allow? [y/N][/yellow] ", end="")
    try:
        ready, _, _ = select.select([sys.stdin], [], [], p.timeout)
    except (OSError, ValueError):
        return
    if ready:
        p.answer(sys.stdin.readline().strip().lower() in ("y", "yes"))


class PlainView:
    def __init__(self, out=None, err: Console | None = None):
        self.out = out or sys.stdout
        self.err = err or Console(stderr=True)
        self.answer: list[str] = []
        self.markdown = self.out.isatty() if hasattr(self.out, "isatty") else False
        self.events: queue.Queue = queue.Queue()

    def sink(self, ev) -> None:  # worker thread
        self.events.put(ev)

    def _flush_answer(self) -> None:
        text = "".join(self.answer)
        self.answer.clear()
        if not text.strip():
            return
        if self.markdown:
            Console(file=self.out).print(render.answer(text))
        else:
            self.out.write(text if text.endswith("\n") else text + "\n")
            self.out.flush()

    def handle(self, ev) -> bool:
        """Render one event; True at the end of the turn."""
        if isinstance(ev, TextDelta):
            self.answer.append(ev.text)
        elif isinstance(ev, ReasoningDelta):
            self.err.print(ev.text, style="dim", end="", markup=False, highlight=False)
        elif isinstance(ev, ToolCard):
            self._flush_answer()
            if ev.state in render.FINAL_STATES or ev.state == "running":
                self.err.print(render.card(ev))
        elif isinstance(ev, PendingApproval):
            if sys.stdin is not None and sys.stdin.isatty():
                threading.Thread(target=_read_answer, args=(ev, self.err), daemon=True).start()
            else:
                self.err.print(render.approval(ev))
                self.err.print(f"[yellow]no terminal to answer: denied after {ev.timeout:g} s[/yellow]")
        elif isinstance(ev, Notice):
            style = {"error": "red", "compaction": "magenta", "session": "cyan"}.get(ev.kind, "dim")
            self.err.print(ev.text, style=style, markup=False, highlight=False)
        elif isinstance(ev, TurnEnd):
            self._flush_answer()
            s = getattr(self, "last_status", None)
            tail = f" | {render.status_line(s)}" if s is not None else ""
            self.err.print(f"[dim]turn {ev.reason}{': ' + ev.error if ev.error else ''}{tail}[/dim]")
            return True
        elif isinstance(ev, Status):
            self.last_status = ev
        return False


def run_prompt(worker, prompt: str, session_path: str | None = None) -> int:
    view = PlainView()
    worker.sink = view.sink
    worker.start()
    worker.submit(prompt)
    end = None
    stopping = False
    while end is None:
        try:
            ev = view.events.get()
            if view.handle(ev):
                end = ev
        except KeyboardInterrupt:
            if not stopping:
                stopping = True
                view.err.print("[magenta]stopping at the next safe point...[/magenta]")
                worker.stop()
    if session_path:
        worker.call(lambda w: w.save_session(session_path))
        while not view.events.empty():
            view.handle(view.events.get())
    return 0 if end.reason in ("answered", "stopped", "max_steps") else 1

"""The interactive terminal UI of `ds4mlx agent`.

Two threads: the agent worker (worker.py, which drives the engine) and this UI
thread (prompt_toolkit's event loop).  The worker's events land in a queue;
the UI drains it and prints above the input line (patch_stdout): answers as
Markdown (rich), tool calls as one-line cards through their lifecycle, notices,
approval panels.  The bottom toolbar is the status bar: ctx used/total,
generated tokens and t/s, the greedy-structure marker, prefill progress and t/s.

Keys: Enter sends a prompt (queued if the agent is busy) or answers an open
approval (y / anything else = no); Ctrl+C stops the agent cooperatively (idle:
clears the line); Ctrl+D or /quit leaves (the session is saved first when one
is open).  Commands: /save [NAME], /list, /switch NAME, /new, /compact,
/del NAME|ID, /strip NAME|ID, /history [N], /think MODE, /hints on|off, /status,
/help (ds4-agent's runtime commands; those that change the session wait for an
idle agent).
"""

from __future__ import annotations

import asyncio
import os
import queue
import sys
import time

from rich.console import Console

from . import render
from .approval import PendingApproval
from .events import AWAITING_APPROVAL, Notice, ReasoningDelta, Status, TextDelta, ToolCard, TurnEnd
from .sessions import SessionDir

HELP = (
    "/save [NAME]  save the session (and its KV checkpoint)   /list  saved sessions (name, id)\n"
    "/switch NAME  open a saved session   /new  start over   /compact  compact the context now\n"
    "/del NAME|ID  delete a saved session   /strip NAME|ID  drop its KV checkpoints, keep its text\n"
    "/history [N]  the last N turns   /think MODE  none|high|max   /hints on|off  programming hints\n"
    "/status  where the agent stands   /quit  leave (Ctrl+D)\n"
    "Ctrl+C stops the agent at the next safe point."
)
IDLE_ONLY = ("/switch", "/new", "/del", "/strip", "/hints")  # they change the session: not while a turn runs
HISTORY_TURNS = 3  # ds4_agent.c AGENT_HISTORY_DEFAULT_TURNS


class TuiState:
    def __init__(self, worker, sessions: SessionDir):
        self.worker = worker
        self.sessions = sessions
        self.events: queue.Queue = queue.Queue()
        self.status = Status(ctx_total=worker.engine.ctx)
        self.pending: PendingApproval | None = None
        self.answer: list[str] = []
        self.app = None

    # worker thread
    def sink(self, ev) -> None:
        self.events.put(ev)
        app = self.app
        if app is not None:
            app.invalidate()

    # UI thread
    def console(self) -> Console:
        width = os.get_terminal_size(sys.__stdout__.fileno()).columns if sys.__stdout__.isatty() else 100
        return Console(file=sys.stdout, force_terminal=True, width=width, highlight=False)

    def toolbar(self):
        from prompt_toolkit.formatted_text import HTML

        line = render.status_line(self.status)
        if self.pending is not None:
            line += " | APPROVAL: y/N"
        return HTML("<b>{}</b>").format(line)

    def message(self):
        return "allow? [y/N] > " if self.pending is not None else "> "

    def flush_answer(self, c: Console) -> None:
        text = "".join(self.answer)
        self.answer.clear()
        if text.strip():
            c.print(render.answer(text))

    def show(self, ev) -> None:
        c = self.console()
        if isinstance(ev, Status):
            self.status = ev
        elif isinstance(ev, TextDelta):
            self.answer.append(ev.text)
        elif isinstance(ev, ReasoningDelta):
            c.print(ev.text, style="dim", end="", markup=False)
        elif isinstance(ev, ToolCard):
            self.flush_answer(c)
            if self.pending is not None and ev.state != AWAITING_APPROVAL:
                self.pending = None  # answered or timed out
            if ev.state != "parsing" or ev.summary:
                c.print(render.card(ev))
        elif isinstance(ev, PendingApproval):
            self.pending = ev
            c.print(render.approval(ev))
        elif isinstance(ev, Notice):
            style = {"error": "red", "compaction": "magenta", "session": "cyan"}.get(ev.kind, "dim")
            c.print(ev.text, style=style, markup=False)
        elif isinstance(ev, TurnEnd):
            self.flush_answer(c)
            if ev.reason != "answered":
                c.print(f"[dim]turn {ev.reason}{': ' + ev.error if ev.error else ''}[/dim]")

    async def pump(self) -> None:
        while True:
            try:
                while True:
                    self.show(self.events.get_nowait())
            except queue.Empty:
                pass
            await asyncio.sleep(0.03)

    # commands
    def command(self, line: str) -> bool:
        """Run a slash command; False = quit."""
        w = self.worker
        name, _, arg = line.strip().partition(" ")
        arg = arg.strip()
        c = self.console()

        def on_worker(fn):
            def run(worker):
                try:
                    fn(worker)
                except Exception as e:  # shown, never fatal
                    worker.emit(Notice(f"{name}: {e}", "error"))

            w.call(run, wait=False)

        if name in ("/quit", "/exit"):
            return False
        if name in IDLE_ONLY and w.busy:
            c.print(f"command requires the model to be idle: {name}", markup=False)
            return True
        if name == "/help":
            c.print(HELP, markup=False)
        elif name == "/save":
            path = (
                self.sessions.path(arg)
                if arg
                else (w.session_path or self.sessions.path(time.strftime("session-%Y%m%d-%H%M%S")))
            )
            on_worker(lambda wk: wk.save_session(path))
        elif name == "/list":
            rows = self.sessions.list()
            c.print(
                "\n".join(
                    f"{sha[:8]}  {n}  {time.strftime('%Y-%m-%d %H:%M', time.localtime(t))}  {k} messages"
                    for n, t, k, sha in rows
                )
                or "no saved sessions",
                markup=False,
            )
        elif name in ("/del", "/strip"):
            if not arg:
                c.print(f"usage: {name} <name or id prefix>", markup=False)
                return True
            try:
                path = self.sessions.find(arg)
            except ValueError as e:
                c.print(f"{name[1:]} failed: {e}", markup=False)
                return True
            sid = _id_of(path)
            if name == "/del":
                on_worker(
                    lambda wk: wk.emit(
                        Notice(f"deleted session {sid} ({wk.delete_session(path)} KV checkpoints)", "session")
                    )
                )
            else:

                def strip(wk):
                    n, tokens = wk.strip_session(path)
                    wk.emit(Notice(f"stripped session {sid} ({n} KV checkpoints, {tokens} tokens)", "session"))

                on_worker(strip)
        elif name == "/hints":
            if arg not in ("on", "off"):
                c.print(f"usage: /hints on|off (now {'on' if w.hints else 'off'})", markup=False)
            else:
                on_worker(lambda wk: (wk.set_hints(arg == "on"), wk.emit(Notice(f"hints {arg}", "info"))))
        elif name == "/status":
            c.print(w.status_report(), markup=False)
        elif name == "/switch":
            if not arg:
                c.print("usage: /switch NAME", markup=False)
            else:
                on_worker(lambda wk: wk.open_session(self.sessions.path(arg)))
        elif name == "/new":
            on_worker(lambda wk: (wk.new_conversation(), wk.emit(Notice("new conversation", "session"))))
        elif name == "/compact":
            on_worker(lambda wk: wk.compact("requested by the user"))
        elif name == "/history":
            n = int(arg) if arg.isdigit() else HISTORY_TURNS
            self.history(c, n)
        elif name == "/think":
            if arg:  # ds4's values, as the flags take them: none | high | max | a V4.1 level
                from ..cli.think_flags import ThinkError, resolve

                try:
                    choice = resolve(w.protocol, int(arg) if arg.isdigit() else arg, w.engine.ctx, flag="/think max")
                except ThinkError as e:
                    c.print(f"think: {e}", markup=False)
                    return True
                if choice.notice:
                    c.print(f"warning: {choice.notice}", markup=False)
                on_worker(lambda wk: wk.set_thinking(choice.mode))
            c.print(f"thinking: {arg or w.thinking}", markup=False)
        else:
            c.print(f"unknown command {name} (/help)", markup=False)
        return True

    def history(self, c: Console, turns: int) -> None:
        msgs = [m for m in self.worker.conv.messages if m.role != "system"]
        starts = [i for i, m in enumerate(msgs) if m.role == "user"]
        for m in msgs[starts[-turns] if len(starts) >= turns else 0 :]:
            if m.role == "tool":
                c.print(f"  [tool result] {m.content.splitlines()[0] if m.content else ''}", style="dim", markup=False)
            elif m.role == "assistant":
                for call in m.tool_calls:
                    c.print(f"  [{call.name}] {call.arguments[:100]}", style="cyan", markup=False)
                if m.content.strip():
                    c.print(render.answer(m.content))
            else:
                c.print(f"> {m.content}", style="bold green", markup=False)


def _id_of(path: str) -> str:
    from .sessions import session_id

    return session_id(path)[:8]


def run_tui(worker, args=None) -> int:
    from prompt_toolkit import PromptSession
    from prompt_toolkit.key_binding import KeyBindings
    from prompt_toolkit.patch_stdout import patch_stdout

    sessions = SessionDir(getattr(args, "sessions_dir", None))
    ui = TuiState(worker, sessions)
    worker.sink = ui.sink
    worker.start()
    kb = KeyBindings()

    @kb.add("c-c")
    def _stop(event):
        if worker.busy or ui.pending is not None:
            worker.stop()
            ui.events.put(Notice("stopping at the next safe point...", "info"))
        else:
            event.current_buffer.reset()

    @kb.add("c-d")
    def _quit(event):
        if not event.current_buffer.text:
            event.app.exit(exception=EOFError)

    session = PromptSession(key_bindings=kb, bottom_toolbar=ui.toolbar, refresh_interval=0.25)
    ui.app = session.app

    async def main() -> None:
        with patch_stdout(raw=True):
            pump = asyncio.ensure_future(ui.pump())
            ui.console().print(
                f"[bold]ds4mlx agent[/bold] in {worker.toolbox.root} — /help for commands, Ctrl+D to leave"
            )
            try:
                while True:
                    try:
                        line = await session.prompt_async(ui.message)
                    except EOFError:
                        break
                    except KeyboardInterrupt:
                        continue
                    if ui.pending is not None:
                        p, ui.pending = ui.pending, None
                        p.answer(line.strip().lower() in ("y", "yes"))
                        continue
                    if not line.strip():
                        continue
                    if line.startswith("/"):
                        if not ui.command(line):
                            break
                        continue
                    ui.console().print(f"> {line}", style="bold green", markup=False)
                    worker.busy = True
                    worker.submit(line)
            finally:
                worker.stop()
                if worker.session_path:
                    worker.call(lambda w: w.save_session(w.session_path))
                while not ui.events.empty():
                    ui.show(ui.events.get_nowait())
                pump.cancel()

    asyncio.run(main())
    return 0

"""Split-screen TUI (docs/eval.md §12), drawn with rich.

Left: title and keys, the score, the case list with live status.  Right: status
line, question preview, live tail of the selected (or running) case's output.
Keys: p pause, q quit (report printed), Up/Down select, Enter run the selected
case next.  The run itself happens on a worker thread; this module only reads its
state and turns keys into `Control` requests.
"""

from __future__ import annotations

import os
import queue
import re
import select
import signal
import sys
import termios
import threading
import time
import tty
from typing import Any

from rich.cells import get_character_cell_size
from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from ..chat.markers import THINK_OPEN
from .runner import CaseRun, NullUI, Runner
from .thinkclose import THINK_CLOSE

MIN_COLS, MIN_ROWS = 90, 18
STATUS_STYLE = {
    "PEND": "dim",
    "FILL": "cyan",
    "RUN": "yellow",
    "SKIP": "dim",
    "STOP": "bold yellow",
    "PASS": "bold green",
    "FAIL": "bold red",
    "ERR": "bold red",
}


def usable(out: Any = sys.stdout) -> bool:
    """TUI only on a TTY of at least 90x18."""
    try:
        if not out.isatty() or not sys.stdin.isatty():
            return False
        size = os.get_terminal_size(out.fileno())
        return size.columns >= MIN_COLS and size.lines >= MIN_ROWS
    except (OSError, ValueError, AttributeError):
        return False


def fit_cells(text: str, room: int) -> tuple[str, str]:
    """Split `text` into the longest head that fits `room` terminal cells and the
    rest (a double-width character counts two: cutting by len() lost characters)."""
    used = 0
    for i, ch in enumerate(text):
        w = get_character_cell_size(ch)
        if used + w > room:
            return text[:i], text[i:]
        used += w
    return text, ""


def _count(n: int) -> str:
    if n >= 1_000_000:
        return f"{n // 1_000_000}m"
    if n >= 10_000:
        return f"{n // 1000}k"
    return str(n)


# the bytes a key sends -> the key's name (cbreak mode: arrows as normal or application cursor keys)
_KEYS = {
    b"\x1b[A": "up",
    b"\x1bOA": "up",
    b"\x1b[B": "down",
    b"\x1bOB": "down",
    b"\r": "enter",
    b"\n": "enter",
    b"p": "p",
    b"P": "p",
    b"q": "q",
    b"Q": "q",
}


class KeyReader:
    """Background thread: stdin in cbreak mode, keys queued as names."""

    def __init__(self, fd: int):
        self.fd = fd
        self.keys: queue.Queue[str] = queue.Queue()
        self._stop = threading.Event()
        self._old = termios.tcgetattr(fd)
        tty.setcbreak(fd)
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()

    def _loop(self) -> None:
        buf = b""
        while not self._stop.is_set():
            r, _, _ = select.select([self.fd], [], [], 0.05)
            if not r:
                if buf == b"\x1b":
                    buf = b""
                continue
            try:
                chunk = os.read(self.fd, 64)
            except OSError:
                return
            if not chunk:
                return
            buf += chunk
            while buf:
                n = 3 if buf[:1] == b"\x1b" else 1  # an arrow key's escape sequence, or one byte
                if len(buf) < n:
                    break
                seq, buf = buf[:n], buf[n:]
                if seq in _KEYS:
                    self.keys.put(_KEYS[seq])

    def close(self) -> None:
        self._stop.set()
        self._t.join(timeout=0.5)
        termios.tcsetattr(self.fd, termios.TCSADRAIN, self._old)


class TUI(NullUI):
    def __init__(self, runner: Runner, console: Console | None = None):
        self.runner = runner
        self.console = console or Console()
        self.cursor: int | None = None
        self.t0 = time.monotonic()

    # -- input
    def handle(self, key: str) -> None:
        ctl = self.runner.control
        n = len(self.runner.runs)
        if key == "p":
            ctl.toggle_pause()
        elif key == "q":
            ctl.request_quit()
        elif key in ("up", "down"):
            if self.cursor is None:
                self.cursor = self.runner.active if self.runner.active is not None else 0
            else:
                self.cursor = max(0, min(n - 1, self.cursor + (1 if key == "down" else -1)))
        elif key == "enter" and self.cursor is not None:
            if self.cursor != self.runner.active:
                ctl.request(self.cursor)

    def case_started(self, cr: CaseRun) -> None:
        if self.cursor is not None and self.cursor == cr.pos:
            self.cursor = None  # the requested case is running: the cursor follows it again

    # -- drawing
    def _elapsed(self) -> str:
        r = self.runner
        secs = r.t_active
        if r.active is not None and r.case_t0:
            secs += time.monotonic() - r.case_t0 - (r.control.paused_seconds - r.case_p0)
        m = int(secs // 60)
        return f"{m // 60:02d}h:{m % 60:02d}m"

    def _left(self, width: int, height: int) -> list[Text]:
        r = self.runner
        head = Text("ds4-eval ")
        head.append("(p)", "bold").append("ause ").append("(q)", "bold").append("uit ").append(self._elapsed())
        if r.control.paused:
            head.append(" PAUSED", "bold red")
        score = Text("score ")
        score.append(f"{r.passed}/{len(r.runs)}", "green").append("  failed ")
        score.append(str(r.failed), "red" if r.failed else "dim")
        lines = [head, score, Text("")]
        rows = height - 3
        focus = self.cursor if self.cursor is not None else (r.active or 0)
        top = 0
        if len(r.runs) > rows:
            top = max(0, min(len(r.runs) - rows, focus - rows // 2))
        for cr in r.runs[top : top + rows]:
            t = Text(">" if self.cursor == cr.pos else " ")
            t.append(f"{cr.pos + 1:>2} ")
            style = STATUS_STYLE.get(cr.label, "")
            t.append(f"{cr.label:<4}", style)
            t.append(" ")
            desc = f"{cr.case['source']}: {cr.case['title']}"
            verdict = ""
            if cr.status in ("PASSED", "FAILED"):
                verdict = f"{cr.picked or '?'}/{cr.case['answer']}"[:18].rjust(18)
            room = width - len(t) - (len(verdict) + 1 if verdict else 0)
            if len(desc) > room:
                desc = desc[: max(0, room - 3)] + "..."
            t.append(desc.ljust(room), "bold" if cr.pos == r.active else "")
            if verdict:
                t.append(" " + verdict, style)
            lines.append(t)
        return lines

    def _shown(self) -> CaseRun | None:
        r = self.runner
        pos = self.cursor if self.cursor is not None else r.active
        if pos is None:
            pos = next((cr.pos for cr in reversed(r.runs) if cr.raw), 0) if r.runs else None
        return r.runs[pos] if pos is not None and r.runs else None

    def _status(self, cr: CaseRun) -> str:
        r = self.runner
        short = f"{cr.case['source']}/{cr.case['id'][:12]}"
        running = cr.pos == r.active
        # paused time is no generation time: 4.4 t/s must not sink while paused
        dt = max(1e-6, time.monotonic() - cr.t_phase - (r.control.paused_total() - cr.phase_paused0))
        if cr.status == "PREFILL":
            done, total = cr.prefill
            pct = 100 * done // total if total else 0
            speed = done / dt if running else 0.0
            return f"Speed {speed:.1f} t/s  FILL {_count(done)}/{_count(total)} {pct}%  {short}"
        if cr.status != "RUNNING":
            return f"{cr.label}  {_count(cr.generated)} tokens  {short}"
        speed = cr.phase_tokens / dt
        phase = "THINK" if cr.think_open and r.opts.thinking else "ANS"
        limit = cr.limit or cr.budget
        gen, cap = cr.generated, limit
        if phase == "THINK":
            if not getattr(r.backend, "forces_think_close", True):
                return f"Speed {speed:.1f} t/s  THINK {_count(gen)} (no forced </think>)  {short}"
            from .thinkclose import default_budgets

            cap = max(1, limit - default_budgets(limit, r.opts.soft_budget, r.opts.hard_budget)[1])
            gen = min(gen, cap)
        return f"Speed {speed:.1f} t/s  {phase} {_count(gen)}/{_count(cap)}  {short}"

    def _right(self, width: int, height: int) -> list[Text]:
        r = self.runner
        cr = self._shown()
        if cr is None:
            return []
        # the status line follows the running case even when the cursor is elsewhere
        head = r.runs[r.active] if r.active is not None else cr
        lines = [Text(self._status(head)[:width])]
        if head is not cr:
            lines.append(Text(f"viewing {cr.pos + 1} {cr.label} {cr.key}"[:width], "bold"))
        question = re.sub(r"\s+", " ", cr.prompt.user).strip()
        for k in range(3):
            piece = question[k * width : (k + 1) * width]
            if k == 2 and len(question) > 3 * width:
                piece = piece[: max(0, width - 3)] + "..."
            lines.append(Text(piece, "blue"))
        lines.append(Text(""))
        lines += self._tail(cr, width, height - len(lines))
        return lines

    def _tail(self, cr: CaseRun, width: int, rows: int) -> list[Text]:
        raw = "".join(cr.raw[-4000:])[-60000:]
        thinking = self.runner.opts.thinking
        i = raw.find(THINK_CLOSE)
        if not thinking:
            segments = [(raw, "")]
        elif i >= 0:
            segments = [(raw[:i], "grey50"), ("\n", ""), (raw[i + len(THINK_CLOSE) :], "")]
        else:
            think = raw
            for k in range(len(THINK_CLOSE) - 1, 0, -1):  # a tag split across tokens
                if think.endswith(THINK_CLOSE[:k]):
                    think = think[:-k]
                    break
            segments = [(think, "grey50")]
        lines = [Text()]
        for text, style in segments:
            for part in re.split(r"(\n)", text.replace(THINK_OPEN, "").replace("\t", " ")):
                if part == "\n":
                    lines.append(Text())
                    continue
                while part:
                    head, part = fit_cells(part, width - lines[-1].cell_len)
                    if head:
                        lines[-1].append(head, style)
                    if part:
                        lines.append(Text())
        return lines[-rows:] if rows > 0 else []

    def _size(self) -> tuple[int, int]:
        """The real terminal size (rich would trust $COLUMNS / $LINES)."""
        try:
            size = os.get_terminal_size(sys.stdout.fileno())
            cols, rows = size.columns, size.lines
            self.console.size = (cols, rows)
            return cols, rows
        except (OSError, ValueError):
            return self.console.size

    def render(self) -> Group:
        cols, rows = self._size()
        left_w = max(42, min(72, cols // 2))
        right_w = max(10, cols - left_w - 3 - 1)
        left = self._left(left_w, rows)
        right = self._right(right_w, rows)
        lines = []
        for y in range(rows):
            t = Text()
            lt = left[y] if y < len(left) else Text("")
            lt = lt.copy()
            lt.truncate(left_w, overflow="ellipsis", pad=True)
            t.append_text(lt)
            t.append(" |", "dim")
            t.append(" ")
            rt = right[y] if y < len(right) else Text("")
            rt = rt.copy()
            rt.truncate(right_w, overflow="crop")
            t.append_text(rt)
            t.no_wrap = True
            lines.append(t)
        return Group(*lines)

    # -- main loop
    def run(self) -> int:
        r = self.runner
        r.ui = self
        r.sleep_after_case = max(1, r.opts.pause_ms) / 1000.0
        result: dict[str, Any] = {}

        def work() -> None:
            try:
                result["rc"] = r.run()
            except BaseException as e:  # noqa: BLE001 - surfaced after the screen is restored
                result["exc"] = e

        keys = KeyReader(sys.stdin.fileno())
        old_handlers = {}
        interrupted = threading.Event()

        def on_signal(signum: int, _frame: Any) -> None:
            keys.close()
            self.console.show_cursor(True)
            self.console.set_alt_screen(False)
            signal.signal(signum, old_handlers.get(signum, signal.SIG_DFL))
            os.kill(os.getpid(), signum)

        def on_interrupt(_signum: int, _frame: Any) -> None:
            # Ctrl-C is a quit like `q`: the worker stops at its next step and is joined
            # before the process exits (exiting under a thread still inside MLX aborted
            # with "terminate called without an active exception", exit 134)
            interrupted.set()
            r.control.request_quit()

        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            old_handlers[sig] = signal.signal(sig, on_signal)
        old_int = signal.signal(signal.SIGINT, on_interrupt)
        worker = threading.Thread(target=work, name="ds4mlx-eval", daemon=True)
        try:
            with Live(
                self.render(),
                console=self.console,
                screen=True,
                auto_refresh=False,
                redirect_stdout=False,
                redirect_stderr=False,
            ) as live:
                worker.start()
                while worker.is_alive():
                    try:
                        while True:
                            self.handle(keys.keys.get_nowait())
                    except queue.Empty:
                        pass
                    live.update(self.render(), refresh=True)
                    worker.join(timeout=0.08)
        finally:
            if worker.is_alive():  # an exception in the drawing loop: still never exit under the worker
                r.control.request_quit()
                worker.join()
            keys.close()
            for sig, h in old_handlers.items():
                signal.signal(sig, h)
            signal.signal(signal.SIGINT, old_int)
        if interrupted.is_set():
            return 130
        if "exc" in result:
            raise result["exc"]
        return int(result.get("rc", 1))

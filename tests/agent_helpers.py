"""Helpers for the agent tests: DSML tool calls as a model would write them,
a worker on the scripted model, event collection."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from scripted_model import ScriptedModel, last_user_text  # noqa: E402,F401

from ds4mlx.agent.approval import Approvals  # noqa: E402
from ds4mlx.agent.events import ToolCard, TurnEnd  # noqa: E402
from ds4mlx.agent.tools import ToolBox  # noqa: E402
from ds4mlx.agent.worker import AgentWorker  # noqa: E402
from ds4mlx.engine import Engine  # noqa: E402

TOOL_RESULT = "<tool_result>"
COMPACT_MARK = "Internal ds4-agent context compaction request"


def dsml(name: str, **params) -> str:
    """One DSML tool-call block (string parameters), the separator first."""
    body = "".join(f'<｜DSML｜parameter name="{k}" string="true">{v}</｜DSML｜parameter>\n' for k, v in params.items())
    return f'\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="{name}">\n{body}</｜DSML｜invoke>\n</｜DSML｜tool_calls>'


def results_in_turn(prompt: str) -> int:
    """Tool results after the last real user message (the step of the turn)."""
    user = "<｜User｜>"
    parts = prompt.split(user)
    n = 0
    for p in reversed(parts[1:]):
        if p.startswith(TOOL_RESULT):
            n += 1
        else:
            break
    return n


def last_real_user(prompt: str) -> str:
    user = "<｜User｜>"
    for p in reversed(prompt.split(user)[1:]):
        if not p.startswith(TOOL_RESULT):
            return p.split("<｜Assistant｜>")[0]
    return ""


def steps(*items):
    """A script: step k of the current user turn says items[k] (then a last answer)."""

    def script(prompt: str):
        k = results_in_turn(prompt)
        return items[k] if k < len(items) else "Done."

    return script


class Collect:
    """Thread-safe event sink with waits on conditions (not on time)."""

    def __init__(self):
        self.events = []
        self._cv = threading.Condition()
        self.on_event = None

    def __call__(self, ev) -> None:
        with self._cv:
            self.events.append(ev)
            self._cv.notify_all()
        if self.on_event is not None:
            self.on_event(ev)

    def wait(self, pred, timeout: float = 60.0):
        end = time.monotonic() + timeout
        with self._cv:
            while True:
                for ev in self.events:
                    if pred(ev):
                        return ev
                left = end - time.monotonic()
                if left <= 0:
                    raise TimeoutError("event never came")
                self._cv.wait(left)

    def wait_ends(self, n: int, timeout: float = 60.0) -> list:
        """Block until n turns have ended; -> their TurnEnds."""
        end = time.monotonic() + timeout
        with self._cv:
            while len(self.ends()) < n:
                left = end - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"turn {n} never ended")
                self._cv.wait(left)
            return self.ends()

    def cards(self, state=None):
        return [e for e in self.events if isinstance(e, ToolCard) and (state is None or e.state == state)]

    def ends(self):
        return [e for e in self.events if isinstance(e, TurnEnd)]

    def of(self, kind):
        return [e for e in self.events if isinstance(e, kind)]


def make_worker(
    tok,
    script,
    root,
    *,
    ctx=4096,
    max_steps=8,
    trusted=True,
    timeout=10.0,
    cache=None,
    model=None,
    prefill_chunk=512,
    **kw,
):
    model = model or ScriptedModel(tok, script)
    engine = Engine(model, tok, ctx=ctx, cache=cache, prefill_chunk=prefill_chunk)
    sink = Collect()
    toolbox = ToolBox(str(root))
    worker = AgentWorker(
        engine, toolbox, Approvals(trusted=trusted, timeout=timeout), sink=sink, kv=cache, max_steps=max_steps, **kw
    )
    toolbox.bash.stop_requested = lambda: worker.stop_requested
    return model, engine, worker, sink

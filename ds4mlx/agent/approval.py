"""Approvals for tools with side effects (write, edit, bash).

The worker asks, a front end answers: `Approvals.decide` publishes a
`PendingApproval` (the exact command or change and the directory it runs in)
and waits for `answer(True/False)`.  No answer within the timeout (10 s by
default, `--approval-timeout`) is a deny; so is a stop request.  `--yes`
(trusted) approves everything without asking.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass

from .tools import SIDE_EFFECTS

DEFAULT_TIMEOUT_SEC = 10.0
POLL_SEC = 0.05
PREVIEW_CHARS = 400


@dataclass(frozen=True)
class ApprovalRequest:
    tool: str
    action: str  # the exact command, or what the file change is
    cwd: str

    def prompt(self) -> str:
        return f"allow {self.tool} in {self.cwd}?\n{self.action}"


class PendingApproval:
    """One open question; the front end calls `answer`."""

    def __init__(self, request: ApprovalRequest, timeout: float):
        self.request = request
        self.timeout = timeout
        self._done = threading.Event()
        self.approved: bool | None = None

    def answer(self, approved: bool) -> None:
        if not self._done.is_set():
            self.approved = bool(approved)
            self._done.set()

    def wait(self, stop_requested: Callable[[], bool]) -> str:
        """-> "yes" | "no" | "timeout" | "stopped"."""
        waited = 0.0
        while not self._done.wait(POLL_SEC):
            waited += POLL_SEC
            if stop_requested():
                return "stopped"
            if waited >= self.timeout:
                return "timeout"
        return "yes" if self.approved else "no"


def _preview(s: str) -> str:
    return s if len(s) <= PREVIEW_CHARS else s[:PREVIEW_CHARS] + f"... [{len(s) - PREVIEW_CHARS} more chars]"


def describe(tool: str, args: dict) -> str:
    """The exact action shown to the user."""
    if tool == "bash":
        return f"$ {args.get('command', '')}"
    if tool == "write":
        content = args.get("content") if isinstance(args.get("content"), str) else ""
        return f"write {args.get('path', '')} ({len(content.encode())} bytes)\n{_preview(content)}"
    if tool == "edit":
        return (
            f"edit {args.get('path', '')}\n--- old\n{_preview(str(args.get('old', '')))}\n"
            f"+++ new\n{_preview(str(args.get('new', '')))}"
        )
    return f"{tool} {json.dumps(args, ensure_ascii=False)}"


class Approvals:
    def __init__(self, *, trusted: bool = False, timeout: float = DEFAULT_TIMEOUT_SEC):
        self.trusted = trusted
        self.timeout = float(timeout)

    @staticmethod
    def needed(tool: str) -> bool:
        return tool in SIDE_EFFECTS

    def decide(
        self,
        tool: str,
        args: dict,
        cwd: str,
        publish: Callable[[PendingApproval], None],
        stop_requested: Callable[[], bool],
    ) -> str:
        """-> "trusted" | "yes" | "no" | "timeout" | "stopped" ("yes"/"trusted" run the tool)."""
        if self.trusted:
            return "trusted"
        pending = PendingApproval(ApprovalRequest(tool, describe(tool, args), cwd), self.timeout)
        publish(pending)
        return pending.wait(stop_requested)


def denial_text(tool: str, verdict: str, timeout: float) -> str:
    """What the model reads when a call was not approved."""
    if verdict == "timeout":
        return f"Tool error: {tool} was not run: no approval within {timeout:g} s (denied by default)."
    if verdict == "stopped":
        return f"Tool error: {tool} was not run: the user stopped the agent."
    return f"Tool error: {tool} was not run: the user denied it."

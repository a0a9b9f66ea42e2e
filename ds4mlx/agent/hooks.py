"""Response hooks: ds4-agent's `--before-response-hook CMD`, `--after-response-hook
CMD` and `--hook-timeout SEC` (antirez/ds4 ds4_hooks.c, ds4_agent_hooks.c).

CMD runs through `/bin/sh -c` in its own process group, once before and once
after each assistant response (every model call of a turn, tool rounds too),
with one JSON object and a newline on stdin:

    {"event": "before_response" | "after_response", "pid": <agent pid>,
     "model": ..., "user_text": ..., "response_text": null | ...,
     "response_index": N, "generated_tokens": N, "interrupted": bool,
     "tool_call": bool, "user_text_truncated": bool, "response_text_truncated": bool}

`response_text` is null before a response and the text sampled after it; texts
are cut at 1 MiB (the `*_truncated` flags say so).  A hook still running after
the timeout gets SIGTERM, then SIGKILL 200 ms later, on its whole process group.
A failing hook (non-zero exit, timeout, cannot start) is reported and never ends
the turn.  No hook command: no process is started.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from dataclasses import dataclass

DEFAULT_TIMEOUT_SEC = 10  # DS4_HOOK_DEFAULT_TIMEOUT_SECONDS
MAX_TIMEOUT_SEC = 3600
MAX_TEXT_BYTES = 1024 * 1024  # DS4_HOOK_MAX_TEXT_BYTES
TERM_GRACE_SEC = 0.2  # DS4_HOOK_TERM_GRACE_MILLISECONDS
BEFORE, AFTER = "before_response", "after_response"


def timeout_arg(v: str) -> int:
    """--hook-timeout: an integer from 1 to 3600 (ds4's hook_parse_positive_int)."""
    import argparse

    try:
        n = int(v)
    except ValueError:
        n = 0
    if not 1 <= n <= MAX_TIMEOUT_SEC:
        raise argparse.ArgumentTypeError(f"--hook-timeout must be an integer from 1 to {MAX_TIMEOUT_SEC}")
    return n


def add_arguments(p) -> None:
    g = p.add_argument_group("response hooks (a JSON event on the command's stdin)")
    g.add_argument("--before-response-hook", metavar="CMD", help="run CMD before each assistant response")
    g.add_argument("--after-response-hook", metavar="CMD", help="run CMD after each assistant response")
    g.add_argument(
        "--hook-timeout",
        type=timeout_arg,
        default=DEFAULT_TIMEOUT_SEC,
        metavar="SEC",
        help=f"kill a hook after SEC seconds (default {DEFAULT_TIMEOUT_SEC})",
    )


def _cut(text: str | None) -> tuple[str | None, bool]:
    if text is None:
        return None, False
    raw = text.encode("utf-8")
    if len(raw) <= MAX_TEXT_BYTES:
        return text, False
    return raw[:MAX_TEXT_BYTES].decode("utf-8", "ignore"), True


def payload(
    event: str,
    *,
    model: str | None,
    user_text: str | None,
    response_text: str | None,
    response_index: int,
    generated_tokens: int,
    interrupted: bool = False,
    tool_call: bool = False,
) -> str:
    """The event's JSON line, ds4's keys in ds4's order."""
    user, user_cut = _cut(user_text)
    response, response_cut = _cut(response_text if event == AFTER else None)
    return (
        json.dumps(
            {
                "event": event,
                "pid": os.getpid(),
                "model": model,
                "user_text": user,
                "response_text": response,
                "response_index": response_index,
                "generated_tokens": generated_tokens,
                "interrupted": interrupted,
                "tool_call": tool_call,
                "user_text_truncated": user_cut,
                "response_text_truncated": response_cut,
            },
            ensure_ascii=False,
        )
        + "\n"
    )


@dataclass(frozen=True)
class HookResult:
    ok: bool
    error: str = ""
    timed_out: bool = False
    exit_code: int | None = None


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(TERM_GRACE_SEC)
        return
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_hook(command: str, event_json: str, timeout: float, cwd: str | None = None) -> HookResult:
    """Run one hook with the event on stdin; kill its process group past `timeout`."""
    try:
        proc = subprocess.Popen(
            ["/bin/sh", "-c", command],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=None,  # the hook's own complaints reach the terminal, as in ds4
            cwd=cwd,
            start_new_session=True,  # its own process group: a timeout kills all of it
        )
    except OSError as e:
        return HookResult(False, f"cannot start hook: {e.strerror or e}")
    try:
        proc.communicate(event_json.encode("utf-8"), timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        return HookResult(False, f"hook timed out after {timeout:g} second{'s' if timeout != 1 else ''}", True)
    except BrokenPipeError:  # the hook did not read its stdin: not an error by itself
        proc.wait(timeout)
    rc = proc.returncode
    if rc == 0:
        return HookResult(True, exit_code=0)
    if rc < 0:
        return HookResult(False, f"hook terminated by signal {-rc}")
    return HookResult(False, f"hook exited with status {rc}", exit_code=rc)


class ResponseHooks:
    """The configured hooks of one agent; the worker calls `before` / `after` around
    every model call.  `report(text)` hears failures."""

    def __init__(
        self,
        before: str | None = None,
        after: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_SEC,
        *,
        model: str | None = None,
        cwd: str | None = None,
        report=lambda text: None,
    ):
        self.commands = {BEFORE: before or None, AFTER: after or None}
        self.timeout = timeout
        self.model = model
        self.cwd = cwd
        self.report = report
        self.response_index = 0
        self.user_text: str | None = None

    @classmethod
    def from_args(cls, args, **kw) -> ResponseHooks:
        return cls(
            getattr(args, "before_response_hook", None),
            getattr(args, "after_response_hook", None),
            getattr(args, "hook_timeout", DEFAULT_TIMEOUT_SEC),
            **kw,
        )

    @property
    def enabled(self) -> bool:
        return any(self.commands.values())

    def _fire(self, event: str, **fields) -> HookResult | None:
        command = self.commands[event]
        if not command:
            return None
        body = payload(event, model=self.model, user_text=self.user_text, response_index=self.response_index, **fields)
        result = run_hook(command, body, self.timeout, self.cwd)
        if not result.ok:
            self.report(f"{event} hook: {result.error}")
        return result

    def before(self, user_text: str | None) -> HookResult | None:
        self.response_index += 1
        self.user_text = user_text
        return self._fire(BEFORE, response_text=None, generated_tokens=0)

    def after(
        self, response_text: str, generated_tokens: int, *, interrupted: bool, tool_call: bool
    ) -> HookResult | None:
        return self._fire(
            AFTER,
            response_text=response_text,
            generated_tokens=generated_tokens,
            interrupted=interrupted,
            tool_call=tool_call,
        )

"""The agent loop: one conversation, the engine, the tools.

`AgentWorker.run_turn(text)` appends a user turn and loops: render the
conversation with the family's protocol, run an engine job (tools active),
show the answer, and for each parsed tool call ask for approval, run the tool
and append its result, until the model answers without a call.  Only a job
that finished with `tool_calls` runs tools: a call cut by the context end, a
stop or a parse error is rolled back (the visible text before it is kept) and
never executed.

The conversation is kept as `chat.messages` Messages; each assistant turn
keeps the exact sampled tool-call block (`Message.raw_dsml`), so the next
render starts with the live session's text and the engine reuses it
(memory-token / memory-text) instead of prefilling again.

Threads: `start()` runs the loop on its own thread, fed by `submit(text)` /
`call(fn)`; a front end renders the events it gets through `sink` and may call
`stop()` from any thread: the stop is cooperative, taken at the next safe
point (a prefill chunk or a token, through the engine's cancel; a tool, a bash
poll, an approval wait), and the conversation stays consistent, so a saved
session reopens.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from ..chat.images import conversation_images
from ..chat.messages import Conversation, Message, ToolCall
from ..engine import Failed, Job
from ..runtime.events import Finish, PrefillProgress, ReasoningDelta, Started, TextDelta, ToolCallEnd, ToolCallStart
from ..runtime.sampling import SamplingParams
from . import compaction, prompts, sessions
from .approval import Approvals, PendingApproval, denial_text
from .events import (
    AWAITING_APPROVAL,
    DENIED,
    DONE,
    FAILED,
    PARSING,
    RUNNING,
    STOPPED,
    Notice,
    Status,
    ToolCard,
    TurnEnd,
)
from .tools import ToolBox

log = logging.getLogger("ds4mlx.agent")

MIN_REPLY_ROOM = 64  # the least a reply may get when compaction cannot free more


def tool_schemas(toolbox: ToolBox) -> list[str]:
    from ..chat.requests import parse_tools

    schemas, _ = parse_tools(toolbox.schemas())
    return schemas


def _summary_of(name: str, arguments: str) -> str:
    import json

    try:
        args = json.loads(arguments)
    except ValueError:
        return arguments[:120]
    if not isinstance(args, dict):
        return arguments[:120]
    if name == "bash":
        return f"$ {args.get('command', '')}"
    for key in ("path", "query", "job", "count"):
        if key in args:
            return f"{key}={args[key]}"
    return arguments[:120]


class AgentWorker:
    def __init__(
        self,
        engine,
        toolbox: ToolBox,
        approvals: Approvals | None = None,
        *,
        sink: Callable[[Any], None] = lambda ev: None,
        thinking: str = "none",
        params: SamplingParams | None = None,
        max_tokens: int | None = None,
        max_steps: int | None = None,
        system_extra: str = "",
        kv=None,
        hooks=None,
        hints: bool = False,
    ):
        self.engine = engine
        self.protocol = engine.protocol
        self.toolbox = toolbox
        self.approvals = approvals or Approvals()
        self.sink = sink
        self.params = params or SamplingParams()
        self.max_tokens = max_tokens
        self.max_steps = max_steps  # None: no cap on tool rounds (ds4: completion, stop, or an error ends it)
        self.kv = kv  # kv.cache.DiskKVCache or None: session checkpoints
        self.status = Status(ctx_total=engine.ctx)
        self.system_extra = system_extra
        self.hooks = hooks  # hooks.ResponseHooks or None
        self.hints = hints  # ds4's /hints: brief programming hints in the system prompt
        self.conv = self._fresh(thinking)
        self._stop = threading.Event()
        self._handle = None
        self._inbox: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self.busy = False
        self.session_path: str | None = None
        self._parsing: dict[int, tuple[str, str]] = {}
        self._request_tokens: int | None = None  # tokens a compaction request adds
        # the text that opens the family's tool-call block (its forced opening's first line)
        self._call_opener = self.protocol.force_text(None).strip().split("\n")[0]
        self._report_restore = False  # tell the user how much a reopened session reused

    # ------------------------------------------------------------------ state
    def _system_text(self) -> str:
        system = prompts.SYSTEM.format(cwd=self.toolbox.root)
        if "view_image" in self.toolbox.names():
            system += "\n" + prompts.VIEW_IMAGE
        if self.hints:
            system += "\n" + prompts.HINTS
        if self.system_extra:
            system += "\n\n" + self.system_extra
        return system

    def set_hints(self, on: bool) -> None:
        """/hints on|off: the system prompt gains or loses the programming hints (the
        next reply prefills from there: the cached prefix ends at the system prompt)."""
        self.hints = on
        if self.conv.messages and self.conv.messages[0].role == "system":
            self.conv.messages[0] = Message("system", self._system_text())

    def _fresh(self, thinking: str) -> Conversation:
        return Conversation(
            messages=[Message("system", self._system_text())],
            tool_schemas=tool_schemas(self.toolbox),
            tools_active=True,
            thinking=thinking,
            model=self.protocol.model_id,
        )

    @property
    def thinking(self) -> str:
        return self.conv.thinking

    def set_thinking(self, mode: str) -> None:
        self.conv.thinking = mode

    def new_conversation(self) -> None:
        """/new: a fresh session from the system prompt; the one that was open stays as
        saved (it is no longer the file the session is saved to)."""
        self.conv = self._fresh(self.conv.thinking)
        self.status = Status(ctx_total=self.engine.ctx)
        self.session_path = None

    def load_conversation(self, conv: Conversation) -> None:
        conv.tool_schemas = tool_schemas(self.toolbox)
        conv.tools_active = True
        self.conv = conv

    def _n_system(self) -> int:
        n = 0
        while n < len(self.conv.messages) and self.conv.messages[n].role == "system":
            n += 1
        return n

    def emit(self, ev) -> None:
        try:
            self.sink(ev)
        except Exception:  # a broken front end must not kill the loop
            log.exception("agent sink failed")

    def _status(self, **kw) -> None:
        self.status = replace(self.status, **kw)
        self.emit(self.status)

    # ------------------------------------------------------------------ stop
    def stop(self) -> None:
        """Cooperative stop (Ctrl+C): the engine job is cancelled, a running
        bash job killed, an approval denied; the turn ends at the next safe point."""
        self._stop.set()
        h = self._handle
        if h is not None:
            h.cancel()

    @property
    def stop_requested(self) -> bool:
        return self._stop.is_set()

    # ------------------------------------------------------------------ threads
    def start(self) -> AgentWorker:
        self._thread = threading.Thread(target=self._serve, name="ds4mlx-agent", daemon=True)
        self._thread.start()
        return self

    def submit(self, text: str) -> None:
        self._inbox.put(("turn", text, None))

    def call(self, fn: Callable[[AgentWorker], Any], wait: bool = True) -> Any:
        """Run `fn(worker)` on the worker thread (slash commands)."""
        done: queue.Queue = queue.Queue()
        self._inbox.put(("call", fn, done))
        if not wait:
            return None
        ok, value = done.get()
        if not ok:
            raise value
        return value

    def _take_queued_prompts(self) -> list[str]:
        """Take the prompts waiting in the inbox (commands stay queued, in order)."""
        with self._inbox.mutex:
            items = list(self._inbox.queue)
            texts = [it[1] for it in items if it is not None and it[0] == "turn"]
            if texts:
                self._inbox.queue.clear()
                self._inbox.queue.extend(it for it in items if it is None or it[0] != "turn")
        return texts

    def close(self) -> None:
        if self._thread is not None:
            self.stop()
            self._inbox.put(None)
            self._thread.join(30)
            self._thread = None
        self.toolbox.close()

    def _serve(self) -> None:
        while True:
            item = self._inbox.get()
            if item is None:
                return
            kind, arg, done = item
            self.busy = True
            try:
                if kind == "turn":
                    self.run_turn(arg)
                else:
                    try:
                        done.put((True, arg(self)))
                    except Exception as e:  # handed back to the caller
                        done.put((False, e))
            except Exception as e:
                log.exception("agent turn failed")
                self.emit(TurnEnd("error", str(e) or type(e).__name__))
            finally:
                self.busy = self._inbox.qsize() > 0

    # ------------------------------------------------------------------ rendering
    def render(self, conv: Conversation | None = None) -> str:
        return self.protocol.render(conv or self.conv)

    def prompt_tokens(self, conv: Conversation | None = None) -> int:
        conv = conv or self.conv
        return len(self._ids(self.render(conv), conv.messages))

    def _ids(self, prompt: str, messages) -> list[int]:
        """The prompt's token ids; an image marker counts as the image's token block."""
        images = conversation_images(messages)
        vision = getattr(self.engine, "vision", None)
        if images and vision is not None:
            from ..vision.encoder import tokenize

            return tokenize(self.engine.tokenizer, prompt, images, vision)[0]
        return self.engine.tokenize(prompt)

    def _with(self, *extra: Message) -> Conversation:
        c = self.conv
        return Conversation(
            messages=list(c.messages) + list(extra),
            tool_schemas=c.tool_schemas,
            tools_active=c.tools_active,
            thinking=c.thinking,
            model=c.model,
        )

    def _message_cost(self, m: Message) -> int:
        tk = self.engine.tokenize
        n = len(tk(m.content)) + (len(tk(m.reasoning)) if m.reasoning else 0)
        n += len(tk(m.raw_dsml)) if m.raw_dsml else sum(len(tk(c.arguments)) + 8 for c in m.tool_calls)
        return n + 4  # role markers

    # ------------------------------------------------------------------ engine jobs
    def _run_job(
        self,
        prompt: str,
        *,
        tools: bool,
        thinking: str,
        max_tokens: int | None,
        params: SamplingParams | None = None,
        show: bool = True,
        label: str = "agent",
    ):
        """One engine job; engine events become agent events.  -> Finish | Failed."""
        ids = self._ids(prompt, self.conv.messages)
        room = self.engine.ctx - len(ids) - 1
        limit = room if max_tokens is None else max(1, min(max_tokens, room))
        job = Job(
            prompt_text=prompt,
            prompt_ids=ids,
            thinking=thinking,
            tools_active=tools,
            params=params or self.params,
            max_tokens=limit,
            family=self.protocol.family,
            tool_schemas=tuple(self.conv.tool_schemas) if tools else (),
            label=label,
        )
        images = conversation_images(self.conv.messages)
        if images:  # view_image results: the job carries their pixels (the ids already have their blocks)
            from ..vision.prompt import attach

            attach(job, self.engine, images)
        events: queue.Queue = queue.Queue()
        self._parsing: dict[int, tuple[str, str]] = {}  # cards of this job's calls: index -> (name, summary)
        self._handle = self.engine.submit(job, events.put)
        if self._stop.is_set():
            self._handle.cancel()
        t_pre = time.monotonic()
        t_gen = None
        generated = 0
        self._status(
            state="prefill",
            ctx_used=len(ids),
            prefill_done=0,
            prefill_total=len(ids),
            generated=0,
            gen_tps=0.0,
            greedy=False,
        )
        try:
            while True:
                ev = events.get()
                if isinstance(ev, PrefillProgress):
                    dt = time.monotonic() - t_pre
                    self._status(
                        prefill_done=ev.done, prefill_total=ev.total, prefill_tps=(ev.done / dt) if dt > 0 else 0.0
                    )
                elif isinstance(ev, Started):
                    t_gen = time.monotonic()
                    self._status(state="generating", cached=ev.cached_tokens, prefill_done=ev.prompt_tokens)
                    if self._report_restore:
                        self._report_restore = False
                        src = self.engine.stats.last_cache_source
                        self.emit(
                            Notice(
                                f"reopened session: {ev.cached_tokens} of {ev.prompt_tokens} prompt tokens "
                                f"cached ({src})",
                                "session",
                            )
                        )
                elif isinstance(ev, (TextDelta, ReasoningDelta)):
                    generated += 1
                    if show:
                        self.emit(ev)  # the front end's answer / reasoning text as is
                elif isinstance(ev, ToolCallStart):
                    self._status(greedy=True)  # the engine samples tool-call structure greedily
                    self._parsing[ev.index] = (ev.name, "")
                    self.emit(ToolCard(ev.index, ev.name, PARSING))
                elif isinstance(ev, ToolCallEnd):
                    self._parsing[ev.index] = (ev.name, _summary_of(ev.name, ev.arguments))
                    self.emit(ToolCard(ev.index, ev.name, PARSING, self._parsing[ev.index][1]))
                elif isinstance(ev, (Finish, Failed)):
                    if isinstance(ev, Finish):
                        n = ev.usage.completion_tokens
                        dt = time.monotonic() - (t_gen or time.monotonic())
                        self._status(
                            state="idle",
                            ctx_used=len(ids) + n,
                            generated=n,
                            gen_tps=(n / dt) if dt > 0 else 0.0,
                            greedy=False,
                        )
                    else:
                        self._status(state="idle")
                    return ev
                if generated and t_gen is not None and generated % 8 == 0:
                    dt = time.monotonic() - t_gen
                    self._status(
                        generated=generated, ctx_used=len(ids) + generated, gen_tps=(generated / dt) if dt > 0 else 0.0
                    )
        finally:
            self._handle = None

    # ------------------------------------------------------------------ the loop
    def run_turn(self, text: str) -> TurnEnd:
        self._stop.clear()
        self.conv.messages.append(Message("user", text))
        end = self._loop()
        self.emit(end)
        return end

    def _reserve(self) -> int:
        if self._request_tokens is None:
            self._request_tokens = (
                self.prompt_tokens(self._with(compaction.compaction_request("x" * 40))) - self.prompt_tokens()
            )
        return compaction.reserve(self.engine.ctx, self._request_tokens)

    def _loop(self) -> TurnEnd:
        continuing = ""  # visible text of an assistant reply cut at the compaction reserve
        notes: list[str] = []  # said in the next compaction summary
        steps = itertools.count(1)
        ctx = self.engine.ctx
        while self.max_steps is None or next(steps) <= self.max_steps:
            if self._stop.is_set():
                return TurnEnd("stopped")
            reserve = self._reserve()
            if not continuing and compaction.should_compact(self.prompt_tokens(), ctx, reserve):
                self.compact("context nearly full")
                if self._stop.is_set():
                    return TurnEnd("stopped")
            thinking = self.conv.thinking
            prompt = self.render()
            if continuing:
                # the same assistant message goes on: the rendered generation prompt,
                # the thinking closed, the text written so far
                if self.protocol.thinking_enabled(thinking):
                    prompt += self.protocol.think_close
                prompt += continuing
                thinking = "none"
            # the reply stops where the compaction request would no longer fit
            room = ctx - len(self.engine.tokenize(prompt)) - reserve
            if room < MIN_REPLY_ROOM:
                room = MIN_REPLY_ROOM  # the compaction could not free more: use what is left
            limit = room if self.max_tokens is None else min(self.max_tokens, room)
            fin = self._reply(prompt, thinking, limit)
            if isinstance(fin, Failed):
                self.emit(Notice(f"engine: {fin.message}", "error"))
                return TurnEnd("error", fin.message)
            parsed = fin.result
            content = continuing + (getattr(parsed, "content", None) or "")
            reasoning = getattr(parsed, "reasoning", None) or ""
            if fin.reason == "cancelled":
                self._drop_cards(STOPPED, "stopped while being written: not run")
                self._keep_partial(content, reasoning)
                return TurnEnd("stopped")
            # the engine closes a block cut by max_tokens (`repaired`) and reports its calls:
            # the agent never runs a call whose arguments may be cut short
            repaired = bool(getattr(parsed, "repaired", False))
            at_reserve = fin.usage.completion_tokens >= room
            if repaired and not at_reserve:
                self._drop_cards(FAILED, "cut by --max-tokens: not run")
                self._keep_partial(content, reasoning)
                self.emit(Notice("a tool call was cut by --max-tokens: not run", "error"))
                return TurnEnd("error", "tool call cut by the reply token limit")
            if at_reserve and (fin.reason == "length" or repaired):
                # generation reached the compaction reserve: compact mid-reply, then go on.
                if self._call_started(parsed, fin.raw_text):
                    # a half-written tool call is rolled back with its whole reply and never run
                    self.emit(
                        Notice("a tool call was cut by the compaction reserve: rolled back, not run", "compaction")
                    )
                    self._drop_cards(FAILED, "cut by the compaction reserve: not run")
                    partial, continuing = "", ""
                    notes = [prompts.INTERRUPTED_CALL]
                else:
                    partial = content
                self.emit(Notice("generation reached compaction reserve: compacting, then continuing", "compaction"))
                if not self.compact("generation reached compaction reserve", partial=partial, notes=notes):
                    self._keep_partial(partial, reasoning)
                    return TurnEnd("error", "context full and compaction failed")
                notes = []
                continuing = self._partial_tail(partial) if partial else ""
                continue
            if fin.reason == "error" and not getattr(parsed, "calls", None):
                self._drop_cards(FAILED, str(fin.error))
                self._keep_partial(content, reasoning)
                self.emit(Notice(f"generation failed: {fin.error}", "error"))
                return TurnEnd("error", fin.error)
            calls = list(getattr(parsed, "calls", None) or []) if fin.reason == "tool_calls" else []
            if not calls:
                self.conv.messages.append(Message("assistant", content, reasoning=reasoning))
                return TurnEnd("answered")
            continuing = ""
            self.conv.messages.append(
                Message(
                    "assistant",
                    content,
                    reasoning=reasoning,
                    tool_calls=[ToolCall(c.id, c.name, c.arguments_json) for c in calls],
                    raw_dsml=getattr(parsed, "raw_dsml", None) or "",
                )
            )
            for i, c in enumerate(calls):
                result = self._run_tool(i, c.name, c.arguments_json)
                self._append_tool_result(c.id, result)
            if self._stop.is_set():
                return TurnEnd("stopped")
            # prompts typed while the tools ran join now, before the model goes on (ds4)
            for text in self._take_queued_prompts():
                self.conv.messages.append(Message("user", text))
                self.emit(Notice(f"queued prompt added after the tool results: {text[:60]}", "info"))
        return TurnEnd("max_steps")

    def _last_user_text(self) -> str | None:
        for m in reversed(self.conv.messages):
            if m.role == "user":
                return m.content
        return None

    def _reply(self, prompt: str, thinking: str, limit: int):
        """One assistant response (a model call with the tools), between the response hooks."""
        hooks = self.hooks
        if hooks is not None and hooks.enabled:
            hooks.before(self._last_user_text())
        fin = self._run_job(prompt, tools=True, thinking=thinking, max_tokens=limit)
        if hooks is not None and hooks.enabled:
            done = isinstance(fin, Finish)
            raw = fin.raw_text if done else ""
            hooks.after(
                raw or "",
                fin.usage.completion_tokens if done else 0,
                interrupted=not done or fin.reason == "cancelled",
                tool_call=done and (fin.reason == "tool_calls" or bool(self._call_opener and self._call_opener in raw)),
            )
        return fin

    def _partial_tail(self, text: str) -> str:
        """What of an unfinished reply stays verbatim after a compaction: all of
        it when it fits half the tail budget, else its last tokens (the summary
        has the rest; ds4 cuts its token tail the same way)."""
        return self._tail_tokens(text, compaction.tail_budget(self.engine.ctx) // 2)

    def _tail_tokens(self, text: str, n: int) -> str:
        ids = self.engine.tokenize(text)
        if len(ids) <= n:
            return text
        tail = self.engine.tokenizer.decode(ids[-n:])
        return tail.lstrip("\ufffd")  # a cut inside a character

    def _drop_cards(self, state: str, why: str) -> None:
        """The calls of the last job will not run: close their cards."""
        for index, (name, summary) in sorted(self._parsing.items()):
            self.emit(ToolCard(index, name, state, summary, why))
        self._parsing = {}

    def _call_started(self, parsed, raw: str) -> bool:
        if getattr(parsed, "calls", None) or getattr(parsed, "error", None):
            return True
        return bool(self._call_opener) and self._call_opener in raw

    def _keep_partial(self, content: str, reasoning: str) -> None:
        """A stopped / failed reply: keep what was shown as an assistant turn (no calls)."""
        if content.strip():
            self.conv.messages.append(Message("assistant", content, reasoning=reasoning))

    # ------------------------------------------------------------------ tools
    def _run_tool(self, index: int, name: str, arguments: str) -> str:
        import json

        summary = _summary_of(name, arguments)
        if self._stop.is_set():
            self.emit(ToolCard(index, name, STOPPED, summary))
            return prompts.STOPPED_TOOL.format(tool=name)
        try:
            args = json.loads(arguments)
        except ValueError:
            args = None
        if not isinstance(args, dict):
            self.emit(ToolCard(index, name, FAILED, summary, "arguments are not a JSON object"))
            return "Tool error: arguments must be a JSON object"
        if self.approvals.needed(name):
            self.emit(ToolCard(index, name, AWAITING_APPROVAL, summary))

            def publish(p: PendingApproval) -> None:
                self.emit(p)

            verdict = self.approvals.decide(name, args, self.toolbox.root, publish, lambda: self._stop.is_set())
            if verdict not in ("yes", "trusted"):
                self.emit(ToolCard(index, name, STOPPED if verdict == "stopped" else DENIED, summary, verdict))
                return denial_text(name, verdict, self.approvals.timeout)
        self.emit(ToolCard(index, name, RUNNING, summary))
        self._status(state="tool")
        result = self.toolbox.call(name, args)
        self._status(state="idle")
        state = FAILED if result.startswith("Tool error:") else DONE
        if self._stop.is_set() and name == "bash":
            state = STOPPED
        head = result.splitlines()[-1] if result else ""
        self.emit(ToolCard(index, name, state, summary, head[:200]))
        return result

    def _append_tool_result(self, call_id: str, result: str) -> None:
        """The hard compaction trigger: a result that would not fit compacts once,
        then is replaced by a bounded tool error if it still does not fit."""
        msg = Message("tool", result, tool_call_ids=[call_id], images=self.toolbox.take_images())
        ctx = self.engine.ctx
        projected = self.prompt_tokens(self._with(msg))
        if not compaction.tool_result_fits(projected, ctx):
            self.compact("tool result would exceed context", keep_last_call=True)
            projected = self.prompt_tokens(self._with(msg))
            if not compaction.tool_result_fits(projected, ctx):
                msg.images = []
                msg.content = prompts.TOOL_RESULT_TOO_BIG.format(
                    projected=projected, ctx=ctx, reserve=compaction.TOOL_RESULT_RESERVE_TOKENS
                )
                self.emit(Notice("tool result does not fit even after compaction: the model gets an error", "error"))
        self.conv.messages.append(msg)

    # ------------------------------------------------------------------ sessions
    def save_session(self, path: str) -> str:
        """Write the conversation and, with a disk KV cache, checkpoint the live
        session ("agent-session") so the reopened session skips the prefill."""
        path = sessions.save(path, self.conv, cwd=self.toolbox.root, model=self.protocol.model_id)
        self.session_path = path
        stored = self._checkpoint("agent-session")
        self.emit(Notice(f"session saved to {path}" + (" with its KV checkpoint" if stored else ""), "session"))
        return path

    def open_session(self, path: str) -> None:
        data = sessions.load(path)
        conv = Conversation(
            messages=data["messages"], thinking=data.get("thinking", self.conv.thinking), model=self.protocol.model_id
        )
        self.load_conversation(conv)
        self.session_path = path
        self._report_restore = True
        self.emit(Notice(f"session {path}: {len(conv.messages)} messages", "session"))

    def _session_checkpoints(self, path: str) -> list:
        """The disk KV checkpoints of a saved session: those whose key is a prefix of its
        rendered conversation, past the system prompt (which every session shares)."""
        import hashlib

        kv = self.kv
        if kv is None:
            return []
        data = sessions.load(path)
        conv = Conversation(
            messages=data["messages"],
            tool_schemas=self.conv.tool_schemas,
            tools_active=True,
            thinking=data.get("thinking", self.conv.thinking),
            model=self.protocol.model_id,
        )
        text = self.render(conv).encode("utf-8")
        n_sys = 0
        while n_sys < len(conv.messages) and conv.messages[n_sys].role == "system":
            n_sys += 1
        head = len(self.render(replace(conv, messages=conv.messages[:n_sys])).encode("utf-8"))
        return [
            e
            for e in kv.store.entries()
            if head < e.key_bytes <= len(text) and hashlib.sha1(text[: e.key_bytes]).hexdigest() == e.sha
        ]

    def strip_session(self, path: str) -> tuple[int, int]:
        """/strip: drop a saved session's KV checkpoints, keep its text (reopening it
        prefills again).  -> (checkpoints removed, tokens they held)."""
        found = self._session_checkpoints(path)
        for e in found:
            self.kv.store.discard(e)
        return len(found), sum(e.tokens for e in found)

    def delete_session(self, path: str) -> int:
        """/del: a saved session's file and its KV checkpoints.  -> checkpoints removed."""
        if self.session_path and os.path.abspath(path) == os.path.abspath(self.session_path):
            raise ValueError("that session is open: /new or /switch first")
        n, _ = self.strip_session(path)
        os.unlink(path)
        return n

    def status_report(self) -> str:
        """/status: where the agent stands (one line per fact)."""
        from ..experts import cli as experts_cli
        from .render import status_line

        st = self.status
        rows = [
            status_line(st),
            f"model: {self.protocol.model_id} ({self.protocol.family}); thinking: {self.conv.thinking}",
            f"conversation: {len(self.conv.messages)} messages; session: {self.session_path or '(not saved)'}",
            f"project: {self.toolbox.root}; hints: {'on' if self.hints else 'off'}; "
            f"approvals: {'trusted (--yes)' if self.approvals.trusted else f'asked, {self.approvals.timeout:g} s'}",
        ]
        if self.kv is not None:
            rows.append(f"disk KV cache: {self.kv.store.dir} ({len(self.kv.store.entries())} checkpoints)")
        store = experts_cli.store_of(self.engine.model)
        if store is not None:
            rows.append(store.summary_line())
        hooks = self.hooks
        if hooks is not None and hooks.enabled:
            on = [k for k, v in hooks.commands.items() if v]
            rows.append(f"hooks: {', '.join(on)} (timeout {hooks.timeout:g} s)")
        return "\n".join(rows)

    def _checkpoint(self, reason: str) -> bool:
        kv = self.kv
        if kv is None:
            return False
        try:
            return bool(self.engine.run_on_worker(lambda e: kv.save_live(e, reason)))
        except Exception:  # a checkpoint is an optimisation
            log.exception("agent %s checkpoint failed", reason)
            return False

    def checkpoint_system(self) -> bool:
        """Prefill the system prompt + tools once and store it ("agent-system"):
        every new session starts from it.  Only on an empty live session."""
        kv = self.kv
        if kv is None:
            return False
        text = self.render(
            Conversation(
                messages=self.conv.messages[: self._n_system()],
                tool_schemas=self.conv.tool_schemas,
                tools_active=True,
                thinking=self.conv.thinking,
                model=self.conv.model,
            )
        )
        ids = self.engine.tokenize(text)

        def prefill_and_save(engine) -> bool:
            if len(engine.session) or kv.store.has(text.encode("utf-8")):
                return False
            engine.session.prefill(ids)
            return kv.save_live(engine, "agent-system")

        try:
            return bool(self.engine.run_on_worker(prefill_and_save))
        except Exception:
            log.exception("agent-system checkpoint failed")
            return False

    # ------------------------------------------------------------------ compaction
    def compact(
        self, reason: str = "requested", partial: str = "", notes: Sequence[str] = (), keep_last_call: bool = False
    ) -> bool:
        """Ask the live model for a task-state summary and rebuild the
        conversation as system + summary + a verbatim tail.  `partial`: the text
        of an unfinished reply (kept out of the request; it continues afterwards).
        False (conversation unchanged) when the summary could not be made."""
        n_sys = self._n_system()
        if len(self.conv.messages) <= n_sys:
            return True
        self.emit(Notice(f"COMPACTING {reason}: summarizing durable task state", "compaction"))
        self._status(state="compacting")
        ask = compaction.compaction_request(reason)
        unfinished = []
        if partial:  # the model sees as much of its unfinished reply as leaves room for the summary
            room = self.engine.ctx - self.prompt_tokens(self._with(ask)) - 2 * compaction.SUMMARY_MIN_ROOM
            if room > 0:
                unfinished = [Message("assistant", self._tail_tokens(partial, room))]
        request = self._with(*unfinished, ask)
        request.tools_active = self.conv.tools_active
        prompt = self.render(request)
        room = self.engine.ctx - len(self.engine.tokenize(prompt)) - 1
        if room < compaction.SUMMARY_MIN_ROOM:
            self.emit(Notice("not enough context left to request a compaction summary", "error"))
            return False
        fin = self._run_job(
            prompt,
            tools=False,
            thinking="none",
            show=False,
            label="agent-compact",
            max_tokens=min(compaction.summary_budget(self.engine.ctx), room),
            params=SamplingParams(temperature=0.0),
        )
        if isinstance(fin, Failed) or fin.reason in ("cancelled", "error"):
            self.emit(Notice("compaction interrupted" if not isinstance(fin, Failed) else fin.message, "error"))
            return False
        summary = (getattr(fin.result, "content", None) or fin.raw_text or "").strip()
        if not summary:
            self.emit(Notice("compaction summary was empty", "error"))
            return False
        msgs = self.conv.messages
        keep = None
        if keep_last_call:  # a tool result is about to be appended: its call stays
            keep = max(i for i, m in enumerate(msgs) if m.role == "assistant")
        start = compaction.tail_start(msgs, n_sys, self._message_cost, compaction.tail_budget(self.engine.ctx), keep)
        old = self.prompt_tokens()
        running = self.toolbox.bash.running()
        if running:  # ds4: the model learns which bash jobs still run
            summary += f"\n[bash jobs still running: {', '.join(map(str, running))}]"
        self.conv.messages = compaction.rebuild(msgs, n_sys, summary, start, notes)
        new = self.prompt_tokens()
        self.emit(
            Notice(
                f"COMPACTING rebuilt context: old={old} summary+tail={new} tail={len(msgs) - start} messages",
                "compaction",
            )
        )
        return True

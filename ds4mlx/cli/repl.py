"""`ds4mlx chat`: the interactive REPL, with ds4's commands (ds4_cli.c `run_repl`).

    /help              the commands
    /think             normal thinking          /think N   V4.1 reasoning effort 0..100
    /think-max         Think Max (only with a context of at least 393216 tokens)
    /nothink           no thinking
    /ctx N             a new context of N tokens (the conversation is kept)
    /read FILE         send the file's text as the next message
                       (a .png/.jpg/.jpeg with --vision: attached to the next message)
    /steer [FILE|off|F]  show, load, drop the steering direction, or set its FFN scale
    /reset             forget the conversation (system prompt and prefix stay)
    /quit, /exit       leave (Ctrl+D too)

Line editing and history come from Python's `readline` (history in
$DS4MLX_HISTORY, default ~/.ds4mlx_history).  Answers are rendered as Markdown
with `rich` on a terminal; reasoning is dimmed.  After each answer a status line
shows the context used / total and the speeds.  Ctrl+C during a turn cancels the
engine job (checked at each token, `JobHandle.cancel`): the partial answer stays
in the conversation and the live session keeps what was evaluated, so the next
prompt continues from it.  Ctrl+C at the prompt clears the line.

Like ds4's REPL the conversation is a transcript: each turn's prompt is the
previous prompt, the text sampled for it and the family's text up to the next
generation prompt, so the engine always extends the live session (old
reasoning stays in the context, as in ds4).  The first turn, and a turn whose
thinking mode changes the start of the prompt (Think Max, a V4.1 level), are
rendered whole with the family's template.  Steering and /ctx changes drop the
live session (`Engine.reset_live`): its state was computed under the old
settings.
"""

from __future__ import annotations

import os
import queue
import signal
import time
from dataclasses import dataclass

from rich.console import Console
from rich.live import Live
from rich.markdown import Markdown

from ..chat.markers import THINK_CLOSE, THINK_OPEN
from ..runtime.events import Finish, PrefillProgress, ReasoningDelta, Started, TextDelta, ToolCallEnd
from .think_flags import THINK_MAX_MIN_CONTEXT, ThinkError, describe, parse_level, resolve

HELP = __doc__.split("\n\n")[1]
ASSISTANT_MARK = "ds4mlx:"  # printed when the answer starts (ds4 prints its assistant prompt)
HISTORY_ENV = "DS4MLX_HISTORY"
HISTORY_LEN = 512  # linenoiseHistorySetMaxLen(512) in ds4
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")  # /read attaches these as images (--vision)
_RL_START, _RL_END = "\001", "\002"  # readline: invisible prompt bytes


def _history_path() -> str:
    return os.environ.get(HISTORY_ENV) or os.path.join(os.path.expanduser("~"), ".ds4mlx_history")


class LineReader:
    """input() with readline editing and a persistent history (when available)."""

    def __init__(self, color: bool):
        self.path = _history_path()
        self.prompt = f"{_RL_START}\x1b[1;32m{_RL_END}> {_RL_START}\x1b[0m{_RL_END}" if color else "> "
        try:
            import readline
        except ImportError:  # no line editing on this platform
            self.readline = None
            return
        self.readline = readline
        readline.set_history_length(HISTORY_LEN)
        try:
            readline.read_history_file(self.path)
        except OSError:
            pass

    def read(self) -> str:
        return input(self.prompt if self.readline is not None else "> ")

    def remember(self, line: str) -> None:
        if self.readline is None:
            return
        self.readline.add_history(line)
        try:
            self.readline.write_history_file(self.path)
        except OSError:
            pass


@dataclass
class TurnResult:
    finish: Finish | None
    interrupted: bool
    generated: int
    prefill_tps: float
    gen_tps: float


class Repl:
    def __init__(self, engine, args, console: Console, prefix: list, out: Console | None = None):
        from .options import conversation_head

        self.engine = engine
        self.args = args
        self.console = console  # stderr: notices, progress, status
        self.out = out or Console()  # stdout: the answers
        self.protocol = engine.protocol
        self.think = args.think
        self.head = conversation_head(args.system, prefix)
        self.history: list = []
        # live Markdown needs cursor movement: a real terminal, not TERM=dumb
        self.markdown = (
            not getattr(args, "no_markdown", False) and self.out.is_terminal and not self.out.is_dumb_terminal
        )
        from ..runtime.steering import installed

        self.steering = installed(engine.model)  # the last direction loaded: `/steer off`, then `/steer F`
        self.transcript: tuple | None = None  # (prompt + sampled text, head signature)
        self.pending_images: list = []  # /read IMAGE: sent with the next message (--vision)

    # ------------------------------------------------------------------ thinking
    def mode(self) -> str:
        return resolve(self.protocol, self.think, self.engine.ctx).mode

    def notice(self, what: str, text: str) -> None:
        self.console.print(f"[cyan]{what}:[/cyan] {text}", highlight=False)

    def warn(self, text: str) -> None:
        self.console.print(text, style="red", highlight=False, markup=False)

    # ------------------------------------------------------------------ loop
    def run(self, first: str | None = None) -> int:
        """The loop; `first` (-p / --prompt-file) is sent before the first read."""
        reader = LineReader(self.out.is_terminal and not self.out.no_color)
        if any(m.role != "system" for m in self.head):
            self._prefill_head()
        self.console.print("[dim]ds4mlx chat: /help lists the commands, Ctrl+C stops an answer, Ctrl+D quits[/dim]")
        if first:
            self.turn(first)
        while True:
            try:
                line = reader.read()
            except EOFError:
                self.out.print()
                return 0
            except KeyboardInterrupt:  # ds4: Ctrl+C at the prompt clears the line
                self.out.print()
                continue
            cmd = line.strip()
            if not cmd:
                continue
            reader.remember(cmd)
            if cmd.startswith("/"):
                if self.command(cmd) == "quit":
                    return 0
                continue
            self.turn(cmd)

    def command(self, cmd: str) -> str | None:
        name, _, arg = cmd.partition(" ")
        arg = arg.strip()
        if name == "/help":
            self.out.print(HELP, markup=False, highlight=False)
        elif name in ("/quit", "/exit"):
            return "quit"
        elif name == "/think":
            if not arg:
                self._set_think("high")
            else:
                try:
                    level = parse_level(arg)
                    if not self.protocol.numeric_effort:
                        raise ValueError
                except Exception:
                    self.warn("/think N requires V4.1 and a level from 0 to 100")
                    return None
                self._set_think(level)
        elif name == "/think-max":
            self._set_think("max")
        elif name == "/nothink":
            self._set_think("none")
        elif name == "/ctx":
            self._set_ctx(arg)
        elif name == "/read":
            self._read(arg)
        elif name == "/steer":
            self._steer(arg)
        elif name == "/reset":
            self.history, self.transcript = [], None
            self.notice("conversation", "cleared")
        else:
            self.warn(f"unknown command: {cmd}")
            self.warn("type /help for commands")
        return None

    def _set_think(self, think) -> None:
        try:
            choice = resolve(self.protocol, think, self.engine.ctx, flag="/think-max")
        except ThinkError as e:
            self.warn(str(e))
            return
        self.think = think
        if think == "max" and choice.notice:
            self.notice("thinking", f"high (context below {THINK_MAX_MIN_CONTEXT:,})")
        else:
            self.notice("thinking", describe(think))

    def _set_ctx(self, arg: str) -> None:
        try:
            n = int(arg)
            if n <= 0:
                raise ValueError
        except ValueError:
            self.warn("/ctx needs a positive integer")
            return
        self.engine.reset_live(ctx=n)
        self.notice("context", f"{n} tokens")
        if self.think == "max":
            choice = resolve(self.protocol, "max", n, flag="/ctx")
            if choice.notice:
                self.warn(f"warning: {choice.notice}")

    def _read(self, path: str) -> None:
        if not path:
            self.warn("/read needs a file path")
            return
        from .options import UsageError, read_image_file, read_text_file

        if os.path.splitext(path)[1].lower() in IMAGE_SUFFIXES:
            if self.engine.vision is None:
                self.warn("/read IMAGE needs --vision")
                return
            try:
                image = read_image_file(os.path.expanduser(path))
            except UsageError as e:
                self.warn(str(e))
                return
            self.pending_images.append(image)
            tokens = self.engine.vision.n_tokens(image)
            self.notice("image", f"{path} {image.width}x{image.height} ({tokens} tokens), sent with the next message")
            return
        try:
            text = read_text_file(os.path.expanduser(path))
        except UsageError as e:
            self.warn(str(e))
            return
        self.turn(text)

    def _steer(self, arg: str) -> None:
        from ..runtime import steering

        model = self.engine.model
        if not arg:
            current = steering.installed(model)
            self.notice("steering", current.describe() if current is not None and current.active else "off")
            return
        try:
            if arg == "off":
                new = None
            else:
                try:
                    scale = float(arg)
                except ValueError:
                    scale = None
                if scale is not None:  # ds4's `/steer F`: the FFN scale of the loaded direction
                    base = steering.installed(model) or self.steering
                    if base is None:
                        self.warn("/steer F needs a direction: /steer FILE first (or --dir-steering-file)")
                        return
                    new = steering.Steering(
                        base.directions, ffn=steering.check_scale("/steer", scale), attn=base.attn, path=base.path
                    )
                else:
                    keep = steering.installed(model)
                    ffn = keep.ffn if keep is not None else None
                    attn = keep.attn if keep is not None else None
                    new = steering.load(model, os.path.expanduser(arg), ffn, attn)
            steering.install(model, new)
        except steering.SteeringError as e:
            self.warn(str(e))
            return
        if new is not None:
            self.steering = new
        self.engine.reset_live()  # the live state was computed under the old steering
        self.notice("steering", new.describe() if new is not None and new.active else "off")

    # ------------------------------------------------------------------ turns
    def _conversation(self, messages, thinking: str | None = None):
        from ..chat.messages import Conversation

        return Conversation(list(messages), thinking=self.mode() if thinking is None else thinking)

    def _prefill_head(self) -> None:
        """ds4 prefills --prefix-file at startup: the history form of the head."""
        from ..engine import Job

        conv = self._conversation(self.head)
        try:
            text = self.protocol.render_history(conv)
        except NotImplementedError:  # DeepSeek V4: a conversation ending in an assistant turn
            text = self.protocol.render(conv)
        job = Job(prompt_text=text, thinking=conv.thinking, max_tokens=0, family=self.protocol.family)
        self._run_job(job, show=False)

    def turn(self, text: str) -> TurnResult:
        from ..chat.messages import Message
        from ..engine import Job
        from .options import sampling_params

        args = self.args
        thinking = self.mode()
        user = Message("user", "".join(im.marker for im in self.pending_images) + text, images=self.pending_images)
        self.pending_images = []
        prompt = self._continuation(user, thinking)
        if prompt is None:  # first turn, or the thinking mode changed the prompt's head
            prompt = self.protocol.render(self._conversation(self.head + self.history + [user]))
        job = Job(
            prompt_text=prompt,
            thinking=thinking,
            params=sampling_params(args),
            max_tokens=args.max_tokens,
            stop=tuple(args.stop),
            family=self.protocol.family,
        )
        if not self._attach_images(job, self.head + self.history + [user]):
            return TurnResult(None, False, 0, 0.0, 0.0)
        res = self._run_job(job, show=True)
        fin = res.finish
        if fin is None or fin.reason == "error" or (res.interrupted and res.generated == 0):
            return res  # ds4 rolls the transcript back when nothing was generated
        parsed = fin.result
        content = getattr(parsed, "content", None)
        self.history += [
            user,
            Message(
                "assistant",
                content if content is not None else fin.raw_text,
                reasoning=getattr(parsed, "reasoning", None) or "",
            ),
        ]
        # ds4's transcript: the prompt and the sampled text stay as they are, so the
        # next turn extends the live session even after Ctrl+C in the reasoning
        self.transcript = (prompt + fin.raw_text, self._head_signature(thinking))
        return res

    def _attach_images(self, job, messages) -> bool:
        from ..chat.images import conversation_images
        from ..vision.prompt import ImagePromptError, attach

        try:
            attach(job, self.engine, conversation_images(messages))
        except (ImagePromptError, ValueError) as e:
            self.warn(getattr(e, "message", str(e)))
            return False
        return True

    _SENTINEL = "\x01"

    def _head_signature(self, thinking: str) -> str:
        """The prompt text before the first user message for this thinking mode
        (Think Max prefix, V4.1's effort line ...): a transcript made under
        another one cannot be extended."""
        from ..chat.messages import Message

        text = self.protocol.render(self._conversation(self.head + [Message("user", self._SENTINEL)], thinking))
        return text.split(self._SENTINEL, 1)[0]

    def _continuation(self, user, thinking: str):
        """The transcript + the family's text from the end of an assistant answer
        to the generation prompt of `user`; None when there is no transcript."""
        from ..chat.messages import Message

        if self.transcript is None:
            return None
        text, sig = self.transcript
        if sig != self._head_signature(thinking):
            return None
        probe = self.head + [Message("user", "a"), Message("assistant", self._SENTINEL), user]
        full = self.protocol.render(self._conversation(probe, thinking))
        if full.count(self._SENTINEL) != 1:
            return None
        return text + full.split(self._SENTINEL, 1)[1]

    def _run_job(self, job, show: bool) -> TurnResult:
        from ..engine import Failed

        q: queue.Queue = queue.Queue()
        h = self.engine.submit(job, q.put)
        interrupted = {"hit": False}

        def on_sigint(signum, frame):  # stop at the next token; the REPL stays
            interrupted["hit"] = True
            h.cancel()

        old = signal.signal(signal.SIGINT, on_sigint)
        printer = _AnswerPrinter(self.out, self.markdown) if show else None
        progress = None
        t0 = time.perf_counter()
        t_gen = None
        finish = None
        try:
            while True:
                try:
                    ev = q.get(timeout=0.1)
                except queue.Empty:
                    continue
                if isinstance(ev, PrefillProgress):
                    progress = self._progress(progress, ev)
                elif isinstance(ev, Started):
                    progress = self._progress(progress, None)
                    t_gen = time.perf_counter()
                    if printer is not None:
                        self.out.print(ASSISTANT_MARK, style="bold cyan", markup=False, highlight=False)
                elif printer is not None and isinstance(ev, (ReasoningDelta, TextDelta, ToolCallEnd)):
                    printer.feed(ev)
                elif isinstance(ev, Finish):
                    finish = ev
                    break
                elif isinstance(ev, Failed):
                    self.warn(f"error: {ev.message}")
                    break
        finally:
            self._progress(progress, None)
            if printer is not None:
                printer.close()
            signal.signal(signal.SIGINT, old)
        t_end = time.perf_counter()
        generated = finish.usage.completion_tokens if finish is not None else 0
        new = (finish.usage.prompt_tokens - finish.usage.cached_tokens) if finish is not None else 0
        pre_s = (t_gen or t_end) - t0
        gen_s = t_end - (t_gen or t_end)
        res = TurnResult(
            finish,
            interrupted["hit"],
            generated,
            new / pre_s if pre_s > 0 else 0.0,
            generated / gen_s if gen_s > 0 else 0.0,
        )
        if show and finish is not None:
            self._status(res)
        return res

    def _progress(self, progress, ev):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        if ev is None:
            if progress is not None:
                progress[0].stop()
            return None
        if progress is None and ev.total > ev.done:
            p = Progress(
                TextColumn("prefill"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                console=self.console,
                transient=True,
            )
            p.start()
            progress = (p, p.add_task("prefill", total=ev.total))
        if progress is not None:
            progress[0].update(progress[1], completed=ev.done)
        return progress

    def _status(self, res: TurnResult) -> None:
        """ds4's timing line plus the context in use."""
        u = res.finish.usage
        used = u.prompt_tokens + u.completion_tokens
        stopped = " | interrupted" if res.interrupted else ""
        self.console.print(
            f"[dim]ctx {used}/{self.engine.ctx} | prompt {u.prompt_tokens} ({u.cached_tokens} cached), "
            f"prefill {res.prefill_tps:.1f} t/s | generation {res.generated} tokens, {res.gen_tps:.1f} t/s"
            f" | thinking {describe(self.think)}{stopped}[/dim]",
            highlight=False,
            soft_wrap=True,
        )
        from ..speculative.cost import summary_lines

        for line in summary_lines(res.finish.speculation):  # speculative decoding: what it did, what it cost
            self.console.print(f"[dim]{line}[/dim]", highlight=False, soft_wrap=True)


class _AnswerPrinter:
    """Reasoning streamed dimmed, then the answer: live Markdown on a terminal,
    plain streamed text otherwise."""

    def __init__(self, out: Console, markdown: bool):
        self.out, self.markdown = out, markdown
        self.in_reasoning = False
        self.text = ""
        self.live: Live | None = None
        self.wrote_plain = False

    def feed(self, ev) -> None:
        if isinstance(ev, ReasoningDelta):
            if not self.in_reasoning:
                self.out.print(THINK_OPEN, style="dim", end="", markup=False, highlight=False)
                self.in_reasoning = True
            self.out.print(ev.text, style="dim", end="", markup=False, highlight=False)
            return
        self._end_reasoning()
        if isinstance(ev, ToolCallEnd):
            self._flush_live()
            self.out.print(f"\ntool call {ev.name}({ev.arguments})", style="cyan", markup=False, highlight=False)
            return
        self.text += ev.text
        if self.markdown:
            if self.live is None:
                self.live = Live(
                    Markdown(self.text), console=self.out, refresh_per_second=8, vertical_overflow="visible"
                )
                self.live.start()
            else:
                self.live.update(Markdown(self.text))
        else:
            self.out.file.write(ev.text)
            self.out.file.flush()
            self.wrote_plain = True

    def _end_reasoning(self) -> None:
        if self.in_reasoning:
            self.out.print(THINK_CLOSE, style="dim", markup=False, highlight=False)
            self.in_reasoning = False

    def _flush_live(self) -> None:
        if self.live is not None:
            self.live.update(Markdown(self.text))
            self.live.stop()
            self.live = None
            self.text = ""

    def close(self) -> None:
        self._end_reasoning()
        self._flush_live()
        if self.wrote_plain:
            self.out.file.write("\n")
            self.out.file.flush()

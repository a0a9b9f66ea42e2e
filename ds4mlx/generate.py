"""`ds4mlx generate` and `ds4mlx chat`: the engine from the terminal.

Both build engine `Job`s and print the engine's event stream (the same stream the
server turns into SSE): reasoning dimmed, the answer plain, a rich progress bar
while the prompt is prefilled, and a last line with token counts and speeds.
"""
from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from . import dtype_policy
from .events import Finish, PrefillProgress, ReasoningDelta, Started, TextDelta, ToolCallEnd


def _common(p) -> None:
    p.add_argument("-m", "--model", help="GGUF file or HF folder (default: the random-weight demo model)")
    dtype_policy.add_argument(p)
    p.add_argument("--mtp", default=None, help="ds4's MTP support GGUF (kept, loaded but unused for now)")
    p.add_argument("--ctx", type=int, default=32768, help="context size in tokens")
    p.add_argument("-n", "--max-tokens", type=int, default=256)
    p.add_argument("--temp", type=float, default=None, help="temperature (default 1.0; 0 = greedy)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0, help="0 = time based")
    p.add_argument("--think", default="none",
                   help="thinking mode: none (default), high, max (needs --ctx >= 393216), or the family's own "
                        "levels (V4.1: 1..100; GLM: low/high/max; Qwen: low/medium/xhigh)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def add_arguments(p) -> None:
    p.add_argument("-p", "--prompt", required=True, help="the user message (or raw text with --raw)")
    p.add_argument("-s", "--system", default="", help="system prompt")
    p.add_argument("--raw", action="store_true", help="feed the prompt text as is, no chat template")
    _common(p)


def add_chat_arguments(p) -> None:
    p.add_argument("-s", "--system", default="", help="system prompt")
    _common(p)


def _sampling(args):
    from .sampling import SamplingParams

    temp = 1.0 if args.temp is None else args.temp
    return SamplingParams(temperature=temp, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.seed)


def _thinking(args, protocol) -> str:
    """The family's thinking mode for --think (numbers are V4.1 effort levels)."""
    if args.think.isdigit():
        return protocol.render_think_level(int(args.think))
    if args.think in ("none", "high", "max"):
        return protocol.resolve_thinking(args.think, None, explicit=True, ctx=args.ctx)
    return protocol.resolve_thinking("high", args.think, explicit=True, ctx=args.ctx)


def _load(args, console):
    from .engine import Engine
    from .loader import load

    t0 = time.perf_counter()
    model, tok = load(args.model, dtype=getattr(args, "dtype", "auto"), mtp=getattr(args, "mtp", None))
    if getattr(model, "is_demo", False):
        from .demo import DEMO_NOTICE

        console.print(f"[yellow]{DEMO_NOTICE}[/yellow]")
    console.print(f"[dim]loaded {getattr(model, 'path', args.model)} in {time.perf_counter() - t0:.1f} s[/dim]")
    return Engine(model, tok, ctx=args.ctx, default_max_tokens=args.max_tokens), tok


def stream_job(engine, job, console: Console, out=sys.stdout) -> Finish | None:
    """Run one job, printing its events; returns the Finish (None if it failed to start)."""
    from .engine import Failed

    t_start = time.perf_counter()
    t_gen = None
    finish = None
    progress = None
    task = None
    in_reasoning = False
    for ev in engine.generate(job):
        if isinstance(ev, PrefillProgress):
            if progress is None and ev.total > 0:
                progress = Progress(TextColumn("prefill"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                    console=console, transient=True)
                progress.start()
                task = progress.add_task("prefill", total=ev.total)
            if progress is not None:
                progress.update(task, completed=ev.done)
        elif isinstance(ev, Started):
            if progress is not None:
                progress.stop()
            t_gen = time.perf_counter()
        elif isinstance(ev, ReasoningDelta):
            if not in_reasoning:
                console.print("[dim]<think>[/dim]", end="")
                in_reasoning = True
            console.print(ev.text, style="dim", end="", markup=False, highlight=False)
        elif isinstance(ev, TextDelta):
            if in_reasoning:
                console.print("[dim]</think>[/dim]")
                in_reasoning = False
            out.write(ev.text)
            out.flush()
        elif isinstance(ev, ToolCallEnd):
            console.print(f"\n[cyan]tool call {ev.name}({ev.arguments})[/cyan]")
        elif isinstance(ev, Finish):
            finish = ev
        elif isinstance(ev, Failed):
            if progress is not None:
                progress.stop()
            console.print(f"[red]error: {ev.message}[/red]")
            return None
    t_end = time.perf_counter()
    out.write("\n")
    if finish is not None:
        u = finish.usage
        pre_s = (t_gen or t_end) - t_start
        gen_s = t_end - (t_gen or t_end)
        new = u.prompt_tokens - u.cached_tokens
        console.print(
            f"[dim]prompt {u.prompt_tokens} tokens ({u.cached_tokens} cached), {new / pre_s if pre_s > 0 else 0:.1f} t/s"
            f" | generated {u.completion_tokens} tokens, {u.completion_tokens / gen_s if gen_s > 0 else 0:.1f} t/s"
            f" | finish {finish.reason}[/dim]")
    return finish


def run(args) -> int:
    from .chat.messages import Conversation, Message
    from .engine import Job

    console = Console(stderr=True)
    engine, tok = _load(args, console)
    protocol = engine.protocol  # the loaded family's template and output syntax
    try:
        try:
            thinking = _thinking(args, protocol)
        except ValueError as e:
            console.print(f"[red]error: {e}[/red]")
            return 2
        if args.command == "chat":
            return _chat_loop(args, engine, console, thinking)
        if args.raw:
            prompt = args.prompt
        else:
            msgs = ([Message("system", args.system)] if args.system else []) + [Message("user", args.prompt)]
            prompt = protocol.render(Conversation(msgs, thinking=thinking))
        job = Job(prompt_text=prompt, api="completions" if args.raw else "chat", raw=args.raw, thinking=thinking,
                  params=_sampling(args), max_tokens=args.max_tokens, stop=tuple(args.stop),
                  family=protocol.family)
        fin = stream_job(engine, job, console)
        return 0 if fin is not None and fin.reason != "error" else 1
    finally:
        engine.close()


def _chat_loop(args, engine, console: Console, thinking: str) -> int:
    from .chat.messages import Conversation, Message
    from .engine import Job

    protocol = engine.protocol
    history = [Message("system", args.system)] if args.system else []
    console.print("[dim]ds4mlx chat: empty line or Ctrl-D quits, /reset clears the history[/dim]")
    while True:
        try:
            line = console.input("[bold green]> [/bold green]")
        except (EOFError, KeyboardInterrupt):
            console.print()
            return 0
        if not line.strip():
            return 0
        if line.strip() == "/reset":
            history = history[:1] if args.system else []
            continue
        history.append(Message("user", line))
        job = Job(prompt_text=protocol.render(Conversation(list(history), thinking=thinking)), thinking=thinking,
                  params=_sampling(args), max_tokens=args.max_tokens, stop=tuple(args.stop), family=protocol.family)
        fin = stream_job(engine, job, console)
        if fin is None:
            history.pop()
            continue
        parsed = fin.result
        history.append(Message("assistant", getattr(parsed, "content", None) or fin.raw_text,
                               reasoning=getattr(parsed, "reasoning", None) or ""))

"""`ds4mlx generate` and `ds4mlx chat`: the engine from the terminal.

The flags are ds4's (ds4_cli.c): `-p` / `--prompt-file`, `-sys`, `--prefix-file`,
`--think` / `--think-max` / `--nothink` / `--think-level N` (think_flags.py), the
`--dir-steering-*` trio (steering.py).  `generate` builds one engine `Job` and
prints the engine's event stream (the same stream the server turns into SSE):
reasoning dimmed, the answer plain, a rich progress bar while the prompt is
prefilled, and a last line with token counts and speeds.  `chat` is the REPL
(repl.py).
"""

from __future__ import annotations

import signal
import sys
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from ..io import dtype_policy
from ..runtime.events import Finish, PrefillProgress, ReasoningDelta, Started, TextDelta, ToolCallEnd
from ..speculative import cli as spec_cli
from .options import (
    UsageError,
    add_chat_template_argument,
    add_prefix_argument,
    add_steering_arguments,
    add_vision_arguments,
    chat_protocol,
    conversation_head,
    install_steering,
    install_vision,
    load_prefix,
    read_image_file,
    read_text_file,
    sampling_params,
)
from .think_flags import add_think_arguments


def _common(p) -> None:
    p.add_argument("-m", "--model", help="GGUF file or HF folder (default: the random-weight demo model)")
    dtype_policy.add_argument(p)
    spec_cli.add_arguments(p)
    p.add_argument("-c", "--ctx", type=int, default=32768, help="context size in tokens")
    p.add_argument("-n", "--max-tokens", "--tokens", dest="max_tokens", type=int, default=256)
    p.add_argument("--temp", type=float, default=None, help="temperature (default 1.0; 0 = greedy)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=None, help="sampler seed (default: time based)")
    add_think_arguments(p)
    add_chat_template_argument(p)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("-s", "-sys", "--system", default="", help="system prompt")
    add_prefix_argument(p)
    add_steering_arguments(p)
    from ..experts import cli as experts_cli

    experts_cli.add_arguments(p)
    add_vision_arguments(p)


def add_arguments(p) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("-p", "--prompt", help="the user message (or raw text with --raw)")
    src.add_argument("--prompt-file", metavar="FILE", help="read the prompt from FILE, as written")
    p.add_argument("--raw", action="store_true", help="feed the prompt text as is, no chat template")
    _common(p)


def add_chat_arguments(p) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("-p", "--prompt", help="send this message first, then go on interactively")
    src.add_argument("--prompt-file", metavar="FILE", help="send FILE's text first, then go on interactively")
    _common(p)
    p.add_argument("--no-markdown", action="store_true", help="print answers as plain text (no rich Markdown)")


def load_model(args, console):
    """The model and tokenizer of the flags (`-m`, `--dtype`, `--mtp FILE`, the expert
    streaming flags), steered by `--dir-steering-*`.  Shared with `ds4mlx agent`."""
    from ..io.loader import load

    t0 = time.perf_counter()
    from ..experts import cli as experts_cli

    model, tok = load(
        args.model,
        dtype=getattr(args, "dtype", "auto"),
        mtp=spec_cli.mtp_file(args),
        stream=experts_cli.config_from_args(args),
        ctx=args.ctx,  # the memory verdict at --ctx (memory_fit.py)
    )
    if getattr(model, "is_demo", False):
        from ..io.demo import notice

        console.print(f"[yellow]{notice(model)}[/yellow]")
    console.print(f"[dim]loaded {getattr(model, 'path', args.model)} in {time.perf_counter() - t0:.1f} s[/dim]")
    steered = install_steering(args, model)  # before the engine makes its session (fingerprint)
    if steered:
        console.print(f"[dim]directional steering: {steered}[/dim]")
    return model, tok


def make_engine(args, model, tok, console, **engine_options):
    """The engine for a loaded model: speculation (`--mtp` / `--draft-model`) and
    `--vision` from the flags; `engine_options` go to Engine (a disk KV cache, the
    default reply length).  Shared with `ds4mlx agent`."""
    from ..engine import Engine

    # The worker thread (and the threads MLX starts from it) inherit a blocked SIGINT,
    # so Ctrl+C always reaches the main thread: the REPL's line reader wakes up on it.
    # Unblocked on every way out (a usage error too): a blocked SIGINT left on the main thread
    # would be inherited by every process it starts later.
    masked = hasattr(signal, "pthread_sigmask")
    if masked:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        try:
            speculation = spec_cli.spec_config(args, model, ctx=args.ctx, dtype=getattr(args, "dtype", "auto"))
        except spec_cli.SpecUsageError as e:
            raise UsageError(str(e)) from None
        if speculation is not None:
            console.print(f"[dim]speculative decoding: {speculation.describe()}[/dim]")
        from ..chat.protocol import protocol_for_model

        protocol = chat_protocol(args, protocol_for_model(model))  # --chat-template (UsageError: not this family's)
        engine = Engine(model, tok, ctx=args.ctx, speculation=speculation, protocol=protocol, **engine_options)
    finally:
        if masked:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        described = install_vision(args, engine)
    except UsageError:
        engine.close()
        raise
    if described:
        console.print(f"[dim]{described}[/dim]")
    return engine


def _load(args, console):
    model, tok = load_model(args, console)
    return make_engine(args, model, tok, console, default_max_tokens=args.max_tokens), tok


def stream_job(engine, job, console: Console, out=None) -> Finish | None:
    """Run one job, printing its events (text to `out`, default the sys.stdout of the call);
    returns the Finish (None if it failed to start)."""
    out = out if out is not None else sys.stdout
    from ..engine import Failed

    t_start = time.perf_counter()
    t_gen = None
    finish = None
    progress = None
    task = None
    in_reasoning = False
    for ev in engine.generate(job):
        if isinstance(ev, PrefillProgress):
            if progress is None and ev.total > 0:
                progress = Progress(
                    TextColumn("prefill"),
                    BarColumn(),
                    MofNCompleteColumn(),
                    TimeRemainingColumn(),
                    console=console,
                    transient=True,
                )
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
            f" | finish {finish.reason}[/dim]"
        )
        from ..speculative.cost import summary_lines

        for line in summary_lines(finish.speculation):  # speculative decoding: what it did, what it cost
            console.print(f"[dim]{line}[/dim]", highlight=False)
    return finish


def run(args) -> int:
    from ..chat.messages import Conversation, Message
    from ..engine import Job
    from .think_flags import ThinkError, resolve

    console = Console(stderr=True)
    try:
        prefix = load_prefix(args)
        prompt_text = (
            args.prompt if args.prompt is not None else (read_text_file(args.prompt_file) if args.prompt_file else None)
        )
        if args.command == "generate" and args.raw and prefix:
            raise UsageError("--prefix-file cannot be combined with --raw")
        images = [read_image_file(p) for p in getattr(args, "image", [])]
        if images and args.command == "generate" and args.raw:
            raise UsageError("--image cannot be combined with --raw")
        engine, tok = _load(args, console)
    except UsageError as e:
        console.print(f"[red]error: {e}[/red]", markup=True, highlight=False)
        return 2
    protocol = engine.protocol  # the loaded family's template and output syntax
    try:
        try:
            choice = resolve(protocol, args.think, args.ctx)
        except ThinkError as e:
            console.print(f"[red]error: {e}[/red]")
            return 2
        if choice.notice:
            console.print(f"[yellow]warning: {choice.notice}[/yellow]")
        if args.command == "chat":
            from .repl import Repl

            repl = Repl(engine, args, console, prefix)
            repl.pending_images = images  # --image: sent with the first message
            return repl.run(first=prompt_text)
        thinking = choice.mode
        if args.raw:
            prompt = prompt_text
        else:
            user = Message("user", "".join(im.marker for im in images) + prompt_text, images=images)
            msgs = conversation_head(args.system, prefix) + [user]
            prompt = protocol.render(Conversation(msgs, thinking=thinking))
        job = Job(
            prompt_text=prompt,
            api="completions" if args.raw else "chat",
            raw=args.raw,
            thinking=thinking,
            params=sampling_params(args),
            max_tokens=args.max_tokens,
            stop=tuple(args.stop),
            family=protocol.family,
        )
        from ..vision.prompt import ImagePromptError, attach

        try:
            attach(job, engine, images)
        except (ImagePromptError, ValueError) as e:
            console.print(f"[red]error: {getattr(e, 'message', e)}[/red]", markup=True, highlight=False)
            return 2
        try:
            fin = stream_job(engine, job, console)
        except KeyboardInterrupt:  # Ctrl+C: closing the event stream cancels the job
            console.print("\n[yellow]interrupted[/yellow]")
            return 130
        return 0 if fin is not None and fin.reason != "error" else 1
    finally:
        engine.close()
        from ..experts import cli as experts_cli

        experts_cli.finish(engine.model)  # the expert cache's stats (with --stream-experts)

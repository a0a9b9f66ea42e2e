"""`ds4mlx agent`: arguments and start-up (the model, the engine with its disk
KV cache, the tools, the worker), then the `-p` loop or the terminal UI."""

from __future__ import annotations

import os

from ..cli.options import add_chat_template_argument
from ..kv.policy import add_kv_arguments
from .approval import DEFAULT_TIMEOUT_SEC

DEMO_MAX_TOKENS = 256


def add_arguments(p) -> None:
    from ..cli.options import add_steering_arguments, add_vision_arguments
    from ..cli.think_flags import add_think_arguments
    from ..experts import cli as experts_cli
    from ..io import dtype_policy
    from ..speculative import cli as spec_cli
    from . import hooks

    p.add_argument("-m", "--model", help="GGUF file or HF folder (default: the random-weight demo model)")
    p.add_argument("-p", "--prompt", help="run this one task non-interactively, then exit")
    p.add_argument(
        "--yes", action="store_true", help="trusted run: approve every write / edit / bash (and a -m org/repo download)"
    )
    p.add_argument("--cwd", default=".", help="the project directory the tools work in (default: .)")
    p.add_argument("--session", help="session file: opened if it exists, saved on exit")
    p.add_argument("--sessions-dir", help="where /save, /list, /switch keep named sessions")
    p.add_argument("-c", "--ctx", type=int, default=32768, help="context size in tokens")
    p.add_argument("-n", "--max-tokens", type=int, default=None, help="tokens per reply (default: the room left)")
    p.add_argument("--max-steps", type=int, default=None, help="model calls per user turn (default: no cap)")
    add_think_arguments(p, default="none")  # ds4's --think / --think-max / --nothink / --think-level N
    p.add_argument("--temp", type=float, default=None, help="temperature (default 1.0; 0 = greedy)")
    p.add_argument("--seed", type=int, default=None, help="sampler seed (default: time based)")
    p.add_argument(
        "--approval-timeout",
        type=float,
        default=DEFAULT_TIMEOUT_SEC,
        help="seconds an approval waits before it denies (default 10)",
    )
    p.add_argument("--edit-upto", action="store_true", help="let edit take anchored old='START[upto]END' spans")
    p.add_argument("--hints", action="store_true", help="start with /hints on (programming hints in the system prompt)")
    p.add_argument("-s", "-sys", "--system", default="", help="extra system prompt text")
    dtype_policy.add_argument(p)
    spec_cli.add_arguments(p)  # --mtp [FILE] / --draft-model and their knobs
    add_steering_arguments(p)
    add_vision_arguments(p, images=False)  # --vision: the view_image tool
    experts_cli.add_arguments(p)  # --stream-experts and its cache flags
    add_chat_template_argument(p)
    add_kv_arguments(p)
    hooks.add_arguments(p)


def thinking_of(args, protocol) -> tuple[str, str | None]:
    """The family's thinking mode of the flags and ds4's downgrade notice (or None)."""
    from ..cli.think_flags import resolve

    choice = resolve(protocol, getattr(args, "think", "none"), args.ctx)
    return choice.mode, choice.notice


def build(args, model, tokenizer, sink=None, console=None):
    """-> (engine, worker) for loaded model + tokenizer (tests call this too): the engine
    with the flags' speculation, vision and disk KV cache, the tools, the hooks."""
    from rich.console import Console

    from ..cli.generate import make_engine
    from ..kv.cache import DiskKVCache
    from ..kv.policy import KVCacheOptions
    from ..runtime.sampling import SamplingParams
    from .approval import Approvals
    from .events import Notice
    from .hooks import ResponseHooks
    from .tools import ToolBox
    from .worker import AgentWorker

    console = console or Console(stderr=True)
    kv = DiskKVCache.open(KVCacheOptions.from_args(args), model, args.ctx) if args.kv_disk_dir else None
    engine = make_engine(args, model, tokenizer, console, cache=kv)
    try:
        thinking, notice = thinking_of(args, engine.protocol)
    except ValueError:
        engine.close()
        raise
    if notice:
        console.print(f"[yellow]warning: {notice}[/yellow]")
    root = os.path.abspath(args.cwd)
    toolbox = ToolBox(root, edit_upto=args.edit_upto, vision=getattr(engine, "vision", None) is not None)
    params = SamplingParams(temperature=1.0 if args.temp is None else args.temp, seed=args.seed)
    worker = AgentWorker(
        engine,
        toolbox,
        Approvals(trusted=args.yes, timeout=args.approval_timeout),
        thinking=thinking,
        params=params,
        max_tokens=args.max_tokens,
        max_steps=args.max_steps,
        system_extra=args.system,
        kv=kv,
        hints=getattr(args, "hints", False),
        **({"sink": sink} if sink else {}),
    )
    worker.hooks = ResponseHooks.from_args(
        args, model=engine.protocol.model_id, cwd=toolbox.root, report=lambda t: worker.emit(Notice(t, "error"))
    )
    toolbox.bash.stop_requested = lambda: worker.stop_requested
    return engine, worker


def run(args) -> int:
    from rich.console import Console

    from ..cli.generate import load_model
    from ..cli.options import UsageError
    from ..experts import cli as experts_cli

    console = Console(stderr=True)
    if not os.path.isdir(args.cwd):
        console.print(f"[red]error: --cwd {args.cwd} is not a directory[/red]")
        return 2
    try:
        model, tok = load_model(args, console)
    except UsageError as e:
        console.print(f"[red]error: {e}[/red]", markup=True, highlight=False)
        return 2
    if getattr(model, "is_demo", False) and args.max_tokens is None:  # its gibberish rarely ends: keep a demo run short
        args.max_tokens = DEMO_MAX_TOKENS
        console.print(f"[dim]demo model: replies capped at {DEMO_MAX_TOKENS} tokens (-n to change)[/dim]")
    try:
        engine, worker = build(args, model, tok, console=console)
    except (ValueError, UsageError) as e:
        console.print(f"[red]error: {e}[/red]", markup=True, highlight=False)
        return 2
    try:
        if args.session and os.path.exists(args.session):
            worker.open_session(args.session)
        else:
            worker.session_path = args.session  # saved there on exit (None: only by /save)
            if worker.kv is not None:
                worker.checkpoint_system()
        if args.prompt is not None:
            from .plain import run_prompt

            return run_prompt(worker, args.prompt, args.session)
        from .tui import run_tui

        return run_tui(worker, args)
    finally:
        worker.close()
        engine.close()
        experts_cli.finish(engine.model)  # the expert cache's stats (with --stream-experts)

"""`ds4mlx agent`: arguments and start-up (the model, the engine with its disk
KV cache, the tools, the worker), then the `-p` loop or the terminal UI."""

from __future__ import annotations

import os

from ..kv.policy import add_kv_arguments
from .approval import DEFAULT_TIMEOUT_SEC

DEMO_MAX_TOKENS = 256


def add_arguments(p) -> None:
    p.add_argument("-m", "--model", help="GGUF file or HF folder (default: the random-weight demo model)")
    p.add_argument("-p", "--prompt", help="run this one task non-interactively, then exit")
    p.add_argument("--yes", action="store_true", help="trusted run: approve every write / edit / bash")
    p.add_argument("--cwd", default=".", help="the project directory the tools work in (default: .)")
    p.add_argument("--session", help="session file: opened if it exists, saved on exit")
    p.add_argument("--sessions-dir", help="where /save, /list, /switch keep named sessions")
    p.add_argument("--ctx", type=int, default=32768, help="context size in tokens")
    p.add_argument("-n", "--max-tokens", type=int, default=None, help="tokens per reply (default: the room left)")
    p.add_argument("--max-steps", type=int, default=None, help="model calls per user turn (default: no cap)")
    p.add_argument("--think", default="none", help="thinking mode: none (default), high, max, or the family's levels")
    p.add_argument("--temp", type=float, default=None, help="temperature (default 1.0; 0 = greedy)")
    p.add_argument("--seed", type=int, default=0, help="0 = time based")
    p.add_argument(
        "--approval-timeout",
        type=float,
        default=DEFAULT_TIMEOUT_SEC,
        help="seconds an approval waits before it denies (default 10)",
    )
    p.add_argument("--edit-upto", action="store_true", help="let edit take anchored old='START[upto]END' spans")
    p.add_argument("-s", "--system", default="", help="extra system prompt text")
    add_kv_arguments(p)


def _thinking(args, protocol) -> str:
    if args.think.isdigit():
        return protocol.render_think_level(int(args.think))
    if args.think in ("none", "high", "max"):
        return protocol.resolve_thinking(args.think, None, explicit=True, ctx=args.ctx)
    return protocol.resolve_thinking("high", args.think, explicit=True, ctx=args.ctx)


def build(args, model, tokenizer, sink=None):
    """-> (engine, worker) for loaded model + tokenizer (tests call this too)."""
    from ..engine import Engine
    from ..kv.cache import DiskKVCache
    from ..kv.policy import KVCacheOptions
    from ..sampling import SamplingParams
    from .approval import Approvals
    from .tools import ToolBox
    from .worker import AgentWorker

    kv = DiskKVCache.open(KVCacheOptions.from_args(args), model, args.ctx) if args.kv_disk_dir else None
    engine = Engine(model, tokenizer, ctx=args.ctx, cache=kv)
    toolbox = ToolBox(os.path.abspath(args.cwd), edit_upto=args.edit_upto)
    params = SamplingParams(temperature=1.0 if args.temp is None else args.temp, seed=args.seed)
    worker = AgentWorker(
        engine,
        toolbox,
        Approvals(trusted=args.yes, timeout=args.approval_timeout),
        thinking=_thinking(args, engine.protocol),
        params=params,
        max_tokens=args.max_tokens,
        max_steps=args.max_steps,
        system_extra=args.system,
        kv=kv,
        **({"sink": sink} if sink else {}),
    )
    toolbox.bash.stop_requested = lambda: worker.stop_requested
    return engine, worker


def run(args) -> int:
    from rich.console import Console

    from ..loader import load

    console = Console(stderr=True)
    if not os.path.isdir(args.cwd):
        console.print(f"[red]error: --cwd {args.cwd} is not a directory[/red]")
        return 2
    model, tok = load(args.model)
    if getattr(model, "is_demo", False):
        from ..demo import notice

        console.print(f"[yellow]{notice(model)}[/yellow]")
        if args.max_tokens is None:  # its gibberish rarely ends: keep a demo run short
            args.max_tokens = DEMO_MAX_TOKENS
            console.print(f"[dim]demo model: replies capped at {DEMO_MAX_TOKENS} tokens (-n to change)[/dim]")
    try:
        engine, worker = build(args, model, tok)
    except ValueError as e:
        console.print(f"[red]error: {e}[/red]")
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

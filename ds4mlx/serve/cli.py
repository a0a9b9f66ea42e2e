"""`ds4mlx serve`: the OpenAI / Anthropic / Responses HTTP server."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from ..io import dtype_policy
from ..speculative import cli as spec_cli

DEFAULT_TOKENS = 393216


def _positive(v: str) -> int:
    try:
        n = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v!r}")
    return n


def _port(v: str) -> int:
    n = _positive(v)
    if n > 65535:
        raise argparse.ArgumentTypeError(f"port out of range: {v}")
    return n


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default=None, help="GGUF file or Hugging Face folder (default: the demo model)")
    dtype_policy.add_argument(p)
    spec_cli.add_arguments(p)
    from ..experts import cli as experts_cli

    experts_cli.add_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=_port, default=8000, help="port (default 8000)")
    p.add_argument("-c", "--ctx", type=_positive, default=32768, help="context tokens (default 32768)")
    p.add_argument(
        "-n",
        "--tokens",
        type=_positive,
        default=None,
        help=f"default max output tokens (default {DEFAULT_TOKENS}; the demo model: 256)",
    )
    p.add_argument("--cors", action="store_true", help="add CORS headers to every response")
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="require this key (Authorization: Bearer KEY or x-api-key: KEY) on every route but /health; "
        "repeatable (any one key is accepted)",
    )
    p.add_argument(
        "--api-key-file",
        metavar="FILE",
        help="read API keys from FILE, one a line (# comments): keeps them out of the process list",
    )
    p.add_argument("--ssl-certfile", metavar="FILE", help="serve HTTPS with this certificate chain (PEM)")
    p.add_argument(
        "--ssl-keyfile", metavar="FILE", help="the certificate's private key (PEM; default: in the certfile)"
    )
    p.add_argument(
        "--root-path",
        default="",
        metavar="PATH",
        help="the path prefix a reverse proxy serves us under (e.g. /ds4): requests under it are "
        "routed as the path after it; unprefixed paths keep working",
    )
    p.add_argument("--chdir", metavar="DIR", help="change directory before loading anything")
    p.add_argument("--trace", metavar="FILE", help="append one JSON line per request/response")
    p.add_argument("--max-body-mb", type=_positive, default=64, help="largest request body in MiB (default 64)")
    p.add_argument(
        "--tool-memory-max-ids",
        type=_positive,
        default=100000,
        help="exact DSML tool replay memory size (default 100000)",
    )
    p.add_argument(
        "--disable-exact-dsml-tool-replay",
        action="store_true",
        help="render history tool calls canonically instead of replaying the sampled DSML",
    )
    p.add_argument(
        "--alias",
        action="append",
        default=[],
        metavar="NAME",
        help="accept this model name too (fnmatch pattern, e.g. 'claude-*'); repeatable",
    )
    p.add_argument(
        "--strict-model",
        action="store_true",
        help="answer 404 for a model name that is not the loaded model's id, alias or --alias "
        "(default: any name is served by the loaded model)",
    )
    p.add_argument(
        "--prefill-chunk",
        type=_positive,
        default=None,
        help="prefill chunk (cancellation granularity; default 2048 on a GPU, 512 on the CPU, DS4MLX_PREFILL_CHUNK)",
    )
    p.add_argument(
        "--batched-session",
        type=_positive,
        default=1,
        metavar="N",
        help="resident sessions: up to N requests run at once, each routed to the slot "
        "that reuses the most of its prompt (default 1: one live session)",
    )
    p.add_argument(
        "--mixed-prefill-quantum",
        type=_positive,
        default=None,
        metavar="T",
        help="with --batched-session: end prefill chunks every T tokens too, so a long "
        "prefill lets the other sessions decode in between (default: --prefill-chunk)",
    )
    # ds4's thinking defaults for requests that do not set thinking themselves
    from ..cli.think_flags import add_think_arguments

    add_think_arguments(p, level_dest="think_level")
    p.add_argument("-sys", "--system", default="", help="system prompt for requests that bring none")
    from ..cli.options import (
        add_chat_template_argument,
        add_prefix_argument,
        add_steering_arguments,
        add_vision_arguments,
    )

    add_prefix_argument(p)
    add_steering_arguments(p)
    add_vision_arguments(p, images=False)
    add_chat_template_argument(p)
    # --kv-disk-dir and friends (docs/kv-cache.md §8); the two tool-memory flags above are kept
    from ..kv.policy import add_kv_arguments

    add_kv_arguments(p)
    from ..distributed.serving import add_argument as add_distributed_argument

    add_distributed_argument(p)


def build(args, loaded=None):
    """(engine, app) for parsed arguments.  The model is loaded here, unless
    `loaded` = (model, tokenizer) is given (embedding, tests)."""
    from .. import load
    from ..kv.policy import KVCacheOptions

    log = logging.getLogger("ds4mlx.serve")
    spec_off = spec_cli.off_for_slots(args, getattr(args, "batched_session", 1))
    if spec_off:
        log.warning("%s", spec_off)
    kv = KVCacheOptions.from_args(args)
    if loaded is not None:
        model, tokenizer = loaded
    else:
        from ..experts import cli as experts_cli

        model, tokenizer = load(
            args.model,
            dtype=getattr(args, "dtype", "auto"),
            mtp=spec_cli.mtp_file(args),
            stream=experts_cli.config_from_args(args),
            ctx=args.ctx,  # the memory verdict at --ctx (memory_fit.py)
        )
        if getattr(model, "is_demo", False):
            from ..io.demo import notice

            log.warning("%s%s", notice(model), f" [{args.model}]" if args.model else "")
    if args.tokens is None:  # the demo's random weights never end a turn: a short default
        from ..io.demo import DEMO_MAX_TOKENS, limit_notice

        args.tokens = DEMO_MAX_TOKENS if getattr(model, "is_demo", False) else DEFAULT_TOKENS
        if getattr(model, "is_demo", False):
            log.warning("%s", limit_notice(args.tokens))
    # the engine and the HTTP app (aiohttp) once the model is in: a refused file exits without them
    from ..chat.protocol import protocol_for_model
    from ..chat.toolmemory import ToolMemory
    from ..cli.options import UsageError, chat_protocol, install_steering, install_vision, load_prefix
    from ..engine import Engine
    from .app import make_app
    from .prepare import ServeConfig

    try:
        prefix = load_prefix(args)
        protocol = chat_protocol(args, protocol_for_model(model))  # --chat-template
        steered = install_steering(args, model)  # before the disk cache takes the model's identity
    except UsageError as e:
        raise SystemExit(f"ds4mlx serve: {e}") from None
    if steered:
        log.info("directional steering: %s", steered)
    try:
        speculation = spec_cli.spec_config(args, model, ctx=args.ctx, dtype=getattr(args, "dtype", "auto"))
    except spec_cli.SpecUsageError as e:
        raise SystemExit(f"ds4mlx serve: {e}") from None
    if speculation is not None:
        log.info("speculative decoding: %s", speculation.describe())
    replay = not args.disable_exact_dsml_tool_replay
    memory = ToolMemory(max_ids=args.tool_memory_max_ids) if replay else None
    cache = None
    if kv.enabled:
        from ..kv.cache import DiskKVCache

        cache = DiskKVCache.open(kv, model, ctx=args.ctx)
        log.info("%s", kv.describe())
        cache.preload_tool_memory(memory)
    engine = Engine(
        model,
        tokenizer,
        ctx=args.ctx,
        default_max_tokens=args.tokens,
        tool_memory=memory,
        prefill_chunk=args.prefill_chunk,
        cache=cache,
        speculation=speculation,
        slots=getattr(args, "batched_session", 1),
        prefill_quantum=getattr(args, "mixed_prefill_quantum", None),
        protocol=protocol,
    )
    try:
        if getattr(args, "vision", None) and engine.slots > 1:
            # the image reuse state (live images, the image checkpoint) is the engine's, not a slot's
            raise UsageError("--vision with --batched-session > 1 is not supported yet (use one slot)")
        described = install_vision(args, engine)
    except UsageError as e:
        engine.close()
        raise SystemExit(f"ds4mlx serve: {e}") from None
    if described:
        log.info("%s", described)
    if engine.slots > 1:
        log.info("batched sessions: %d resident slots", engine.slots)
    if args.think_level is not None and not engine.protocol.numeric_effort:
        engine.close()
        raise SystemExit(
            f"ds4mlx serve: --think-level is only for numeric-effort families "
            f"(the loaded model is {engine.protocol.family})"
        )
    from ..cli.think_flags import ThinkError, resolve

    think = getattr(args, "think", "high")
    try:
        choice = resolve(engine.protocol, think, args.ctx)
    except ThinkError as e:
        engine.close()
        raise SystemExit(f"ds4mlx serve: {e}") from None
    if choice.notice:
        log.warning("%s", choice.notice)
    cfg = ServeConfig(
        ctx=args.ctx,
        tokens=args.tokens,
        cors=args.cors,
        trace=args.trace,
        max_body_mb=args.max_body_mb,
        replay=replay,
        aliases=tuple(args.alias),
        think_level=args.think_level,
        think=think,
        system=getattr(args, "system", "") or "",
        prefix=tuple(prefix),
        strict_model=getattr(args, "strict_model", False),
        api_keys=api_keys(args),
        root_path=getattr(args, "root_path", "") or "",
    )
    return engine, make_app(engine, cfg, memory)


def api_keys(args) -> tuple:
    """--api-key values and --api-key-file's keys (SystemExit on an unreadable file)."""
    from .auth import KeyFileError, read_key_file

    keys = list(getattr(args, "api_key", None) or [])
    path = getattr(args, "api_key_file", None)
    if path:
        try:
            keys += read_key_file(path)
        except KeyFileError as e:
            raise SystemExit(f"ds4mlx serve: {e}") from None
    if any(not k.strip() for k in keys):
        raise SystemExit("ds4mlx serve: --api-key must not be empty")
    return tuple(k.strip() for k in keys)


def server_ssl_context(certfile: str | None, keyfile: str | None):
    """The server's TLS context for --ssl-certfile / --ssl-keyfile (None: plain HTTP).
    Raises ValueError with a one-line reason."""
    if not certfile:
        if keyfile:
            raise ValueError("--ssl-keyfile needs --ssl-certfile")
        return None
    import ssl

    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(certfile, keyfile or None)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"--ssl-certfile {certfile}: {e}") from None
    return ctx


async def _serve(app, host: str, port: int, ssl_context=None) -> None:
    import asyncio

    from aiohttp import web

    from .transport import make_runner

    runner = make_runner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1" if host == "localhost" else host, port, ssl_context=ssl_context)
    await site.start()
    log = logging.getLogger("ds4mlx.serve")
    log.info("listening on %s://%s:%d", "https" if ssl_context is not None else "http", host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    hits = {"n": 0}

    def on_signal() -> None:
        hits["n"] += 1
        if hits["n"] > 1:
            os._exit(130)
        log.info("shutting down")
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, on_signal)
        except (NotImplementedError, RuntimeError):
            pass
    await stop.wait()
    await runner.cleanup()


SHUTDOWN_TIMEOUT_S = 600.0  # the engine's close waits this long for the shutdown KV save


def run(args, loaded=None) -> int:
    from ..kv.policy import KVCacheOptions

    try:
        KVCacheOptions.from_args(args)
    except ValueError as e:
        print(f"ds4mlx serve: {e}", file=sys.stderr)
        return 2
    if args.chdir:
        try:
            os.chdir(args.chdir)
        except OSError as e:
            print(f"ds4mlx serve: --chdir {args.chdir}: {e}", file=sys.stderr)
            return 2
    try:  # before the model loads: a bad certificate is found in a second, not minutes
        ssl_context = server_ssl_context(getattr(args, "ssl_certfile", None), getattr(args, "ssl_keyfile", None))
    except ValueError as e:
        print(f"ds4mlx serve: {e}", file=sys.stderr)
        return 2
    api_keys(args)  # an unreadable --api-key-file: one line and exit before the model loads
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    link = None
    if getattr(args, "distributed", None):  # every rank loads its shard; rank 0 goes on
        from ..distributed.serving import start

        started = start(args)
        if isinstance(started, int):  # a follower rank, done
            return started
        loaded, link = started
    engine, app = build(args, loaded)
    if link is not None:
        from ..distributed.serving import stop_followers_at_shutdown

        stop_followers_at_shutdown(engine, link)
    import asyncio

    try:
        asyncio.run(_serve(app, args.host, args.port, ssl_context))
    finally:
        # SIGINT / SIGTERM end _serve; closing the engine runs the shutdown KV save
        # (docs/kv-cache.md §5.4) on its worker after the running job was cancelled.
        engine.close(timeout=SHUTDOWN_TIMEOUT_S)
    return 1 if link is not None and link.failed else 0

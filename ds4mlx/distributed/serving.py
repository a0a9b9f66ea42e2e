"""`ds4mlx serve --distributed tp|ep|pipeline`, launched on every rank by `mlx.launch`
(or with MLX_HOSTFILE / MLX_RANK set).  Each rank loads only its shard.  Rank 0 owns
HTTP, sessions and sampling: its sessions are `LeaderSession`s (leader.py); the other
ranks never open a port and replay its step commands (follower.py) until it stops.

A rank that dies: the collective in flight on rank 0 fails, the request gets the error
("distributed: a rank left the group ..."), and the server shuts down (SIGTERM to itself,
the normal shutdown path) and exits 1.  Under `mlx.launch` the launcher also stops
the remaining ranks.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import sys
import threading

from .plan import KINDS

log = logging.getLogger("ds4mlx.distributed")
EXIT_DELAY_S = 0.5  # the failing request's error is written before the shutdown starts


def add_argument(p) -> None:
    p.add_argument(
        "--distributed",
        choices=KINDS,
        default=None,
        help="shard the model over the ranks mlx.launch started (rank 0 serves HTTP): "
        "tp (heads and expert columns), ep (routed experts), pipeline (layers)",
    )


def _stop_server(message: str) -> None:
    log.error("%s", message)
    threading.Timer(EXIT_DELAY_S, os.kill, (os.getpid(), signal.SIGTERM)).start()


def start(args):
    """Load this rank's shard.  Rank 0: ((model, tokenizer), link) for `serve.cli.build`;
    any other rank: serves the leader here and returns its exit code."""
    from ..io.loader import load
    from .follower import follow
    from .leader import LeaderSession, Link
    from .plan import init
    from .sharding import Sharding

    if getattr(args, "dir_steering_file", None):
        raise SystemExit("ds4mlx serve: directional steering is not supported with --distributed yet")
    plan, group = init(args.distributed)
    log.info("distributed: plan %s, rank %d of %d", plan.kind, plan.rank, plan.size)
    model, tokenizer = load(
        args.model, dtype=getattr(args, "dtype", "auto"), mtp=getattr(args, "mtp", None), shard=Sharding(plan, group)
    )
    if not plan.leader:
        disk = getattr(args, "kv_disk_dir", None)  # the leader's cache files name these snapshots
        folder = None if not disk else os.path.join(disk, f"rank{plan.rank}-of-{plan.size}-{plan.kind}")
        try:
            follow(model, group, folder)
        except RuntimeError as e:
            print(f"ds4mlx serve: rank {plan.rank}: lost rank 0 ({e})", file=sys.stderr)
            return 1
        return 0
    link = Link(group, on_lost=_stop_server)
    model.session_type = functools.partial(LeaderSession, link)
    return (model, tokenizer), link


def stop_followers_at_shutdown(engine, link) -> None:
    """STOP goes out on the engine's worker thread, after its shutdown hook (the disk KV
    cache's exit save, which still needs the followers)."""
    save = engine.cache.on_shutdown

    def on_shutdown(eng) -> None:
        try:
            save(eng)
        finally:
            link.stop()

    engine.cache.on_shutdown = on_shutdown

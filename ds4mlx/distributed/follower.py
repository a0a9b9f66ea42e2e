"""Ranks other than 0: replay the leader's step commands (commands.py) on a session of
this rank's shard until STOP.  Every model call here runs the same collectives, in the
same order, as the leader's; the follower's own logits are not used.

Snapshots of the shard are kept in memory (the last KEEP), keyed by the leader's id;
a restore of one that is gone fails on every rank (the leader then prefills again).
A lost leader (its process died) ends the loop with a RuntimeError from the backend.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import mlx.core as mx

from . import commands as cmd

KEEP = 64
log = logging.getLogger("ds4mlx.distributed")


def follow(lm, group) -> None:
    """Serve the leader; returns on STOP."""
    session = None
    blobs: OrderedDict[int, bytes] = OrderedDict()
    while True:
        op, a, b, _ = cmd.header(group)
        if op == cmd.STOP:
            return
        if op == cmd.NEW:
            session = lm.new_session(ctx=a, chunk=b)
        elif op == cmd.RESET:
            session.reset()
        elif op == cmd.PREFILL:
            ids = cmd.exchange([0] * a, group)
            session.prefill(ids, chunk=b or None)
        elif op == cmd.STEP:
            # the token first: a pipeline stage's recv has no inputs, so inside one graph it
            # could run before the token's all_sum, while rank 0 waits on that all_sum
            tok = cmd.token(None, group)[0]
            mx.eval(tok)
            mx.eval(session.step(tok, undoable=bool(a)))
        elif op == cmd.UNDO:
            session.undo_step()
        elif op == cmd.TRUNCATE:
            session.truncate(a)
        elif op == cmd.SNAPSHOT:
            blobs[cmd.join_id(a, b)] = session.snapshot()
            while len(blobs) > KEEP:
                blobs.popitem(last=False)
        elif op == cmd.RESTORE:
            ok = 1
            try:
                session.restore(blobs[cmd.join_id(a, b)])
            except (KeyError, ValueError):
                ok = 0
            if cmd.exchange([ok], group)[0] != group.size() and ok:
                session.reset()
        else:
            raise RuntimeError(f"distributed: unknown step command {op} from rank 0")

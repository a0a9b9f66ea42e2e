"""Ranks other than 0: replay the leader's step commands (commands.py) on a session of
this rank's shard until STOP.  Every model call here runs the same collectives, in the
same order, as the leader's; the follower's own logits are not used.

Snapshots of the shard are kept by `ShardSnapshots`, keyed by the leader's id: in
memory (the last KEEP), and with a directory (serve's --kv-disk-dir) also on disk, so
the leader's disk KV cache files still restore on every rank after a restart.  A
restore of one that is gone fails on every rank (the leader then prefills again).
A lost leader (its process died) ends the loop with a RuntimeError from the backend.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from pathlib import Path

import mlx.core as mx

from ..io.atomic_file import write_bytes_atomic
from . import commands as cmd

KEEP = 64  # snapshots kept in memory
KEEP_FILES = 1024  # snapshot files kept on disk (the oldest removed first)
log = logging.getLogger("ds4mlx.distributed")


class ShardSnapshots:
    """This rank's snapshots by id: memory, and `folder` (created) when given."""

    def __init__(self, folder: str | os.PathLike | None = None):
        self.memory: OrderedDict[int, bytes] = OrderedDict()
        self.folder = None if folder is None else Path(folder)
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)

    def _file(self, sid: int) -> Path:
        return self.folder / f"{sid:016x}.snap"

    def put(self, sid: int, blob: bytes) -> None:
        self.memory[sid] = blob
        while len(self.memory) > KEEP:
            self.memory.popitem(last=False)
        if self.folder is not None:
            write_bytes_atomic(self._file(sid), blob, temp_path=self._file(sid).with_suffix(".tmp"))
            files = sorted(self.folder.glob("*.snap"), key=lambda p: p.stat().st_mtime)
            for old in files[: max(0, len(files) - KEEP_FILES)]:
                old.unlink(missing_ok=True)

    def get(self, sid: int) -> bytes:
        """The snapshot, or KeyError."""
        if sid in self.memory:
            return self.memory[sid]
        if self.folder is not None and self._file(sid).exists():
            return self._file(sid).read_bytes()
        raise KeyError(sid)


def follow(lm, group, folder=None) -> None:
    """Serve the leader; returns on STOP.  `folder`: where this rank's snapshots persist."""
    session = None
    blobs = ShardSnapshots(folder)
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
            blobs.put(cmd.join_id(a, b), session.snapshot())
        elif op == cmd.RESTORE:
            ok = 1
            try:
                session.restore(blobs.get(cmd.join_id(a, b)))
            except (KeyError, OSError, ValueError):
                ok = 0
            if cmd.exchange([ok], group)[0] != group.size() and ok:
                session.reset()
        else:
            raise RuntimeError(f"distributed: unknown step command {op} from rank 0")

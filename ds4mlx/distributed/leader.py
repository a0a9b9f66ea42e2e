"""Rank 0's session: every command is broadcast before it runs here (commands.py).

`Link(group, on_lost)` is the leader's end of the group.  A collective that fails (a
rank died: the ring backend reports the lost peer) marks the link lost, calls
`on_lost(message)` once (the server fails the request with the message and exits) and
raises `RankLost`; every later command raises it at once, without touching the group.

`LeaderSession` is `session.Session` with the broadcast in front of each public
command; the commands one command runs inside another (truncate -> reset + prefill)
are not broadcast again: the followers' sessions run them themselves.  Snapshots get a
trailer naming the followers' own snapshots of the same state (each rank keeps its
shard); restoring succeeds on every rank or on none.
"""

from __future__ import annotations

import itertools
import os
import struct
from contextlib import contextmanager

import mlx.core as mx

from ..runtime.session import Session
from . import commands as cmd

TRAILER = b"DS4DIST\x00"  # + u64 snapshot id, after the Session snapshot's own CRC
LOST = "distributed: a rank left the group"


class RankLost(RuntimeError):
    pass


class Link:
    def __init__(self, group, on_lost=None):
        self.group, self.on_lost = group, on_lost
        self.lost: str | None = None  # why no command can run any more
        self.failed = False  # a rank was lost (not a normal stop): the server exits 1
        self.pending = None  # the last step's lazy logits: submitted before the next header
        self.ids = itertools.count(int.from_bytes(os.urandom(6), "little") << 8)

    @contextmanager
    def guard(self):
        """Run collectives; a failure means a rank is gone."""
        if self.lost:
            raise RankLost(self.lost)
        try:
            yield
        except RankLost:
            raise
        except RuntimeError as e:
            self.lost, self.failed = f"{LOST} ({e}); the server stops", True
            if self.on_lost is not None:
                self.on_lost(self.lost)
            raise RankLost(self.lost) from e

    def header(self, op: int, a: int = 0, b: int = 0, c: int = 0) -> None:
        with self.guard():
            if self.pending is not None:
                # a step the host has not read yet (decode lookahead, or never read at all)
                # runs its collectives before this header's, as on the followers
                mx.async_eval(self.pending)
                self.pending = None
            cmd.header(self.group, op, a, b, c)

    def stop(self) -> None:
        """Tell the followers to exit (once; nothing when the group is already lost).  Call
        it on the thread that ran the sessions (MLX streams are per thread: a header sent
        from another thread is not ordered after that thread's last step)."""
        if not self.lost:
            try:
                self.header(cmd.STOP)
            except RankLost:
                pass
            self.lost = self.lost or "distributed: the server stopped"


class LeaderSession(Session):
    def __init__(self, link: Link, model, ctx: int, chunk: int | None = None):
        from ..runtime.prefill_chunk import default_chunk

        chunk = int(chunk or default_chunk())  # the followers get the resolved chunk
        self.link = link
        self._inner = True  # Session.__init__'s reset is part of NEW
        link.header(cmd.NEW, int(ctx), int(chunk))
        try:
            super().__init__(model, ctx=ctx, chunk=chunk)
        finally:
            self._inner = False

    @contextmanager
    def _command(self, op: int, a: int = 0, b: int = 0, c: int = 0):
        """Broadcast `op` (unless inside another command) and run the body as one command."""
        if self._inner:
            yield False
            return
        self.link.header(op, a, b, c)
        self._inner = True
        try:
            with self.link.guard():
                yield True
        finally:
            self._inner = False

    def reset(self) -> None:
        if not self.link.lost:
            try:
                with self._command(cmd.RESET):
                    super().reset()
                return
            except RankLost:
                pass
        # the engine empties a failed session before it reports the error: never raise here
        self._inner = False
        super().reset()

    @property
    def tokens(self) -> list[int]:
        with self.link.guard():  # reading a sampled token runs the collectives of its step
            return super().tokens

    def prefill(self, ids, progress=None, chunk=None):
        ids = [int(t) for t in ids]
        if not ids or self._inner:
            return super().prefill(ids, progress, chunk)
        self._room(len(ids))  # refused here, before any rank starts on it
        with self._command(cmd.PREFILL, len(ids), int(chunk or 0)):
            with self.link.guard():
                cmd.exchange(ids, self.link.group)
            return super().prefill(ids, progress, chunk)

    def step(self, token, undoable: bool = False) -> mx.array:
        if self._inner:
            return super().step(token, undoable)
        self._room(1)
        with self._command(cmd.STEP, int(bool(undoable))):
            shared = cmd.token(token, self.link.group)[0]
            self.link.pending = super().step(shared, undoable)
            return self.link.pending

    def undo_step(self) -> None:
        if getattr(self, "_undo", None) is None:
            raise ValueError("no undoable step to take back")
        with self._command(cmd.UNDO):
            super().undo_step()

    def truncate(self, n: int) -> None:
        if n < 0 or n > len(self) or n == len(self):
            return super().truncate(n)  # the error, or nothing to do: no command
        with self._command(cmd.TRUNCATE, int(n)):
            super().truncate(n)

    def snapshot(self) -> bytes:
        sid = next(self.link.ids)
        with self._command(cmd.SNAPSHOT, *cmd.split_id(sid)):
            blob = super().snapshot()
        return blob + TRAILER + struct.pack("<Q", sid)

    def restore(self, data: bytes) -> None:
        data = bytes(data)
        tail = len(TRAILER) + 8
        if len(data) < tail or data[-tail:-8] != TRAILER:
            raise ValueError("not a distributed session snapshot (no rank trailer)")
        (sid,) = struct.unpack("<Q", data[-8:])
        with self._command(cmd.RESTORE, *cmd.split_id(sid)):
            ok = 1
            try:
                super().restore(data[:-tail])
            except ValueError as e:
                ok, why = 0, e
            with self.link.guard():
                restored = cmd.exchange([ok], self.link.group)[0]
            if restored != self.link.group.size():
                if ok:
                    super().reset()
                raise ValueError("a rank could not restore its shard of this snapshot") if ok else why

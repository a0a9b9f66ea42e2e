"""The step commands rank 0 broadcasts to the other ranks (follower.py replays them).

Every command starts with a header: int32 [op, a, b, c], an all_sum to which the other
ranks add zeros, read on the host.  Then, by op:

    NEW       a=ctx, b=chunk                a fresh session
    RESET                                   empty the session
    PREFILL   a=n, b=chunk                  payload: n int32 token ids (host)
    STEP      a=undoable                    payload: the token, summed lazily into the
                                            step's graph (it may not be sampled yet)
    UNDO                                    take the last undoable step back
    TRUNCATE  a=n                           keep the first n tokens
    SNAPSHOT  a, b = snapshot id (2x31 bits) each rank keeps its own shard's snapshot
    RESTORE   a, b = snapshot id            then an all_sum of "restored" flags: all or none
    STOP                                    the leader is done; followers exit 0
"""

from __future__ import annotations

import mlx.core as mx

NEW, RESET, PREFILL, STEP, UNDO, TRUNCATE, SNAPSHOT, RESTORE, STOP = range(1, 10)
NAMES = {v: k for k, v in dict(globals()).items() if k.isupper() and isinstance(v, int) and k != "HEADER"}
HEADER = 4


def exchange(values, group) -> list[int]:
    """all_sum of small int32 vectors, evaluated: the leader's values on every rank."""
    out = mx.distributed.all_sum(mx.array(values, mx.int32), group=group)
    mx.eval(out)
    return [int(v) for v in out.tolist()]


def header(group, op: int = 0, a: int = 0, b: int = 0, c: int = 0) -> list[int]:
    return exchange([op, a, b, c], group)


def token(tok, group) -> mx.array:
    """The leader's token (lazy or not) on every rank, as a lazy int32 [1] array."""
    if tok is None:
        tok = mx.zeros((1,), mx.int32)
    elif not isinstance(tok, mx.array):
        tok = mx.array([int(tok)], mx.int32)
    return mx.distributed.all_sum(tok.reshape(1).astype(mx.int32), group=group)


def split_id(sid: int) -> tuple[int, int]:
    return sid & 0x7FFFFFFF, (sid >> 31) & 0x7FFFFFFF


def join_id(a: int, b: int) -> int:
    return a | (b << 31)

"""One rank of a sharded tiny model (tests/test_distributed.py runs two of these).

    python distributed_worker.py PLAN ORACLE_DIR OUT.npz [commands]

The process group comes from MLX_HOSTFILE / MLX_RANK (ring backend).  By default every
rank runs the same calls; rank 0 writes its logits: the full forward of the oracle's
input ids, then a session's chunked prefill + token-by-token decode (the compiled static
step), then a snapshot of that session restored into a fresh one and decoded one token
further.  With `commands`, rank 0 drives a `LeaderSession` through `session_script` (the
server's path: lazy tokens, undo, snapshot, truncate, restore) while the other ranks
`follow`; the test runs the same script on a plain single-process session.
"""

from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np

from ds4mlx.distributed.follower import follow
from ds4mlx.distributed.leader import TRAILER, LeaderSession, Link
from ds4mlx.distributed.plan import init
from ds4mlx.distributed.sharding import Sharding
from ds4mlx.models.base import load_hf_dir


def session_script(s, ids: list[int], P: int, strip=lambda blob: blob) -> list:
    """Logits rows of a fixed sequence of session commands (`strip`: a snapshot as the
    plain Session takes it back)."""
    rows = [s.prefill(ids[:P])]
    lazy = mx.array(ids[P]) + 0  # a token the host has not read, as the decode loop feeds
    s.step(lazy, undoable=True)
    s.undo_step()
    rows.append(s.decode(lazy))
    snap = s.snapshot()
    rows += [s.decode(t) for t in ids[P + 1 : P + 4]]
    s.truncate(P + 2)
    rows.append(s.decode(ids[P + 2]))
    s.restore(strip(snap))
    rows.append(s.decode(ids[P + 1]))
    return rows


def commands(lm, plan, group, ids, P, out) -> None:
    if not plan.leader:
        return follow(lm, group)
    link = Link(group)
    lm.session_type = lambda model, ctx, chunk: LeaderSession(link, model, ctx, chunk)
    s = lm.new_session(ctx=len(ids) + 1, chunk=7)
    rows = session_script(s, ids, P)
    try:
        s.restore(snap_without_trailer(s))
        refused = ""
    except ValueError as e:
        refused = str(e)
    link.stop()
    np.savez(out, rows=np.stack(rows), refused=np.array(refused))


def snap_without_trailer(s) -> bytes:
    blob = s.snapshot()
    return blob[: -(len(TRAILER) + 8)]


def main(kind: str, folder: str, out: str, mode: str = "calls") -> None:
    plan, group = init(kind, backend="ring")
    lm = load_hf_dir(folder, shard=Sharding(plan, group))
    ref = dict(np.load(f"{folder}/reference.npz"))
    ids = ref["input_ids"][0].tolist()
    P = int(ref["stepwise_start"])
    if mode == "commands":
        return commands(lm, plan, group, ids, P, out)
    full = lm.logits(ids)
    s = lm.new_session(ctx=len(ids) + 1, chunk=7)
    rows = [s.prefill(ids[:P])] + [s.decode(t) for t in ids[P:-1]]
    snap = s.snapshot()
    again = lm.new_session(ctx=len(ids) + 1, chunk=7)
    again.restore(snap)
    restored = again.decode(ids[-1])
    if plan.leader:
        np.savez(out, full=full, session=np.stack(rows), restored=restored)


if __name__ == "__main__":
    main(*sys.argv[1:5])

"""One rank of a sharded tiny model (tests/test_distributed.py runs two of these).

    python distributed_worker.py PLAN ORACLE_DIR OUT.npz

The process group comes from MLX_HOSTFILE / MLX_RANK (ring backend).  Every rank runs the
same calls; rank 0 writes its logits: the full forward of the oracle's input ids, then a
session's chunked prefill + token-by-token decode (the compiled static step), then a
snapshot of that session restored into a fresh one and decoded one token further.
"""

from __future__ import annotations

import sys

import numpy as np

from ds4mlx.distributed.plan import init
from ds4mlx.distributed.sharding import Sharding
from ds4mlx.models.base import load_hf_dir


def main(kind: str, folder: str, out: str) -> None:
    plan, group = init(kind, backend="ring")
    lm = load_hf_dir(folder, shard=Sharding(plan, group))
    ref = dict(np.load(f"{folder}/reference.npz"))
    ids = ref["input_ids"][0].tolist()
    P = int(ref["stepwise_start"])
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
    main(*sys.argv[1:4])

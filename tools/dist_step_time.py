"""Decode step time of the sharded demo model, 2 local ranks on the ring backend, per plan.

    PYTHONPATH=$PWD python3 tools/dist_step_time.py [--steps 40] [--model PATH]

Starts one process (unsharded) and then two ranks per plan (tp, ep, pipeline) with a
generated hostfile; each prefills 16 tokens, warms up, then times `--steps` decode
steps (Session.decode: the compiled static step, evaluated per token).  Prints one
JSON line per run (ms per step on rank 0), then the computed per-token traffic for
V4 Flash shapes (ds4mlx/distributed/traffic.py).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def rank_main(kind: str, model: str | None, steps: int) -> None:
    from ds4mlx.io.loader import load

    shard = None
    if kind != "single":
        from ds4mlx.distributed.plan import init
        from ds4mlx.distributed.sharding import Sharding

        plan, group = init(kind, backend="ring")
        shard = Sharding(plan, group)
    lm, _ = load(model, verbose=False, shard=shard)
    s = lm.new_session(ctx=16 + steps + 16)
    s.prefill(list(range(100, 116)))
    for t in range(5):
        s.decode(200 + t)
    t0 = time.perf_counter()
    for t in range(steps):
        s.decode(300 + t)
    ms = (time.perf_counter() - t0) * 1000 / steps
    if shard is None or shard.plan.leader:
        print(json.dumps({"plan": kind, "ranks": 1 if shard is None else shard.plan.size, "ms_per_step": round(ms, 2)}))


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def launch(kind: str, n: int, args, tmp: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO), DS4MLX_STEP_RANK="1")
    cmd = [sys.executable, __file__, "--plan", kind, "--steps", str(args.steps)]
    cmd += ["--model", args.model] if args.model else []
    if n > 1:
        hostfile = tmp / f"hosts-{kind}.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(n)]))
        env["MLX_HOSTFILE"] = str(hostfile)
    procs = [subprocess.Popen(cmd, env=dict(env, MLX_RANK=str(r))) for r in range(n)]
    for p in procs:
        p.wait(timeout=900)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--model", default=None)
    ap.add_argument("--plan", default=None)
    args = ap.parse_args()
    if os.environ.get("DS4MLX_STEP_RANK"):
        return rank_main(args.plan, args.model, args.steps)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        launch("single", 1, args, Path(tmp))
        for kind in ("tp", "ep", "pipeline"):
            launch(kind, 2, args, Path(tmp))
    from ds4mlx.distributed.traffic import summary
    from ds4mlx.models.deepseek_v4 import ModelArgs

    for n in (2, 4, 8):
        for kind in ("tp", "ep", "pipeline"):
            print(json.dumps({"v4_flash_traffic": summary(ModelArgs(), kind, n)}))


if __name__ == "__main__":
    main()

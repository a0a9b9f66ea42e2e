"""Sharded tiny V4 models over two local processes on MLX's ring backend (issue #25).

Each plan (tp, ep, pipeline) must give the single-process logits within 1e-5 (relative
to the largest logit, when that exceeds 1: a split matmul adds its float32 partial sums
in another order, and the 150-token "long" model's logits reach ~10): the full forward,
a chunked prefill followed by compiled decode steps, and a snapshot restored on every
rank.  The two ranks run tests/distributed_worker.py with a generated hostfile;
a run that does not finish within TIMEOUT fails (a hang is a failure, not a wait).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from distributed_helpers import run_ranks  # noqa: E402
from distributed_worker import session_script  # noqa: E402
from parity_helpers import load_case, maxdiff  # noqa: E402

TOL = 1e-5
WORKER = Path(__file__).parent / "distributed_worker.py"


@pytest.fixture(scope="module", params=[None, "long"], ids=lambda c: c or "default")
def case(request, oracle):
    folder, lm, ref, _ = load_case(oracle, "make_tiny_deepseek_v4.py", request.param)
    ids = ref["input_ids"][0].tolist()
    P = int(ref["stepwise_start"])
    s = lm.new_session(ctx=len(ids) + 1, chunk=7)
    rows = [s.prefill(ids[:P])] + [s.decode(t) for t in ids[P:]]
    return folder, {"full": lm.logits(ids), "session": np.stack(rows[:-1]), "restored": rows[-1]}


@pytest.mark.parametrize("plan", ["tp", "ep", "pipeline"])
def test_sharded_logits_equal_single_process(case, plan, tmp_path):
    folder, single = case
    out = tmp_path / "rank0.npz"
    run_ranks([sys.executable, str(WORKER), plan, str(folder), str(out)], 2, tmp_path)
    got = dict(np.load(out))
    for key in ("full", "session", "restored"):
        assert got[key].shape == single[key].shape, key
        bound = TOL * max(1.0, float(np.abs(single[key]).max()))
        assert maxdiff(got[key], single[key]) <= bound, (plan, key, maxdiff(got[key], single[key]), bound)


@pytest.mark.parametrize("plan", ["tp", "ep", "pipeline"])
def test_leader_commands_replayed_by_follower(oracle, plan, tmp_path):
    """The server's path: rank 0's LeaderSession broadcasts prefill, lazy steps, an undo,
    a snapshot, a truncate and a restore; the follower replays them on its shard.  Equal
    to the same script on one process; a snapshot without its rank trailer is refused."""
    folder, lm, ref, _ = load_case(oracle, "make_tiny_deepseek_v4.py", None)
    ids, P = ref["input_ids"][0].tolist(), int(ref["stepwise_start"])
    single = np.stack(session_script(lm.new_session(ctx=len(ids) + 1, chunk=7), ids, P))
    out = tmp_path / "rank0.npz"
    run_ranks([sys.executable, str(WORKER), plan, str(folder), str(out), "commands"], 2, tmp_path)
    got = dict(np.load(out))
    assert got["rows"].shape == single.shape
    assert maxdiff(got["rows"], single) <= TOL * max(1.0, float(np.abs(single).max()))
    assert "rank trailer" in str(got["refused"])

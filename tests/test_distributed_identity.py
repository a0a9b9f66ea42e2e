"""A sharded model's state is its own: the session snapshot and the disk KV cache
identity record the plan (rank and group size), so another plan (or the unsharded
model) refuses them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from parity_helpers import load_case  # noqa: E402

from ds4mlx.distributed.plan import Plan  # noqa: E402
from ds4mlx.kv.cache import model_identity  # noqa: E402
from ds4mlx.runtime.session import Session  # noqa: E402


def test_plan_identity_is_rank_and_size():
    assert Plan("tp", 1, 2).identity == "tp:1/2"
    with pytest.raises(ValueError):
        Plan("zz", 0, 2)
    with pytest.raises(ValueError, match="divisible"):
        Plan("ep", 0, 3).block(8, "n_routed_experts")


def test_snapshot_and_disk_identity_refuse_another_plan(oracle):
    _, lm, ref, _ = load_case(oracle, "make_tiny_deepseek_v4.py", None)
    ids = ref["input_ids"][0].tolist()[:9]
    plain_id = model_identity(lm)
    s = Session(lm.model, ctx=32)
    s.prefill(ids)
    lm.model.distributed_plan = Plan("tp", 0, 2).identity
    try:
        tp_id = model_identity(lm)
        sharded = Session(lm.model, ctx=32)
        with pytest.raises(ValueError, match="different model"):
            sharded.restore(s.snapshot())  # an unsharded state into a rank's session
        sharded.prefill(ids)
        blob = sharded.snapshot()
        lm.model.distributed_plan = Plan("pipeline", 0, 2).identity
        assert model_identity(lm) not in (plain_id, tp_id)
        with pytest.raises(ValueError, match="different model"):
            Session(lm.model, ctx=32).restore(blob)
    finally:
        del lm.model.distributed_plan
    assert tp_id != plain_id and model_identity(lm) == plain_id


def test_follower_snapshots_survive_a_restart(tmp_path):
    from ds4mlx.distributed.follower import ShardSnapshots

    store = ShardSnapshots(tmp_path / "rank1")
    store.put(7, b"shard state")
    assert store.get(7) == b"shard state"
    again = ShardSnapshots(tmp_path / "rank1")  # a new process: only the files are left
    assert again.get(7) == b"shard state"
    with pytest.raises(KeyError):
        again.get(8)
    with pytest.raises(KeyError):
        ShardSnapshots().get(7)

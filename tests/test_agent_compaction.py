"""Compaction arithmetic (ds4's thresholds) and the tail selection."""

from __future__ import annotations

from ds4mlx.agent import compaction as C
from ds4mlx.chat.messages import Message


def test_reserve_and_soft_trigger_thresholds():
    assert C.summary_budget(2048) == 256 and C.summary_budget(16384) == 2048 and C.summary_budget(1 << 20) == 4096
    assert C.reserve(65536, 200) == 200 + 4096 + 64
    ctx, r = 65536, C.reserve(65536, 200)  # large contexts: the 85 % rule comes first
    assert not C.should_compact(ctx * 85 // 100 - 1, ctx, r) and C.should_compact(ctx * 85 // 100, ctx, r)
    assert not C.should_compact(0, ctx, r)
    small, rs = 3072, C.reserve(3072, 200)  # reserve + 128 wins over ctx/8 on a tiny context
    assert not C.should_compact(small - (rs + 128) - 1, small, rs) and C.should_compact(small - (rs + 128), small, rs)
    assert C.tail_budget(32768) == 3276 and C.tail_budget(1 << 20) == 50_000


def test_tail_starts_at_a_user_turn_and_keeps_a_pending_call():
    msgs = [
        Message("system", "s"),
        Message("user", "u1"),
        Message("assistant", "a1"),
        Message("user", "u2"),
        Message("assistant", "a2"),
        Message("tool", "r2"),
        Message("assistant", "a3"),
    ]

    def cost(m):
        return 10

    assert C.tail_start(msgs, 1, cost, 45) == 3  # window starts at a2's predecessor u2 (4 msgs fit)
    assert C.tail_start(msgs, 1, cost, 25) == 6  # no user in the window: the first assistant turn
    assert C.tail_start(msgs, 1, cost, 5) == 7  # nothing fits
    assert C.tail_start(msgs, 1, cost, 5, keep_from=4) == 4  # the call being answered stays
    rebuilt = C.rebuild(msgs, 1, "S1", 6)
    assert [m.role for m in rebuilt] == ["system", "system", "user", "assistant"]  # a user line before it
    again = C.rebuild(rebuilt, 2, "S2", 3, notes=["note"])
    assert [m.content for m in again if C.is_summary(m)] == [C.summary_message("S2", ["note"]).content]

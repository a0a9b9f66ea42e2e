"""Wall time per call of `mx.eval(fn())`, the device synchronised around the timed loop."""

from __future__ import annotations

import time


def synced_seconds(fn, n: int, warmup: int = 3) -> float:
    """Mean wall seconds of `mx.eval(fn())` over n calls, after `warmup` untimed calls."""
    import mlx.core as mx

    for _ in range(warmup):
        mx.eval(fn())
    mx.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        mx.eval(fn())
    mx.synchronize()
    return (time.perf_counter() - t0) / n

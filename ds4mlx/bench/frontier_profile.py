"""The per-frontier columns of `bench --profile` (frontier.PROFILE_COLUMNS).

GPU-busy ms per step (gpu_timer: CUDA with torch's profiler, else n/a), launches per token
(census.decode_census on a static-layout model: what the step launches on CUDA; the step's
own graph otherwise), the host's ms per token (the timed probe's wall time minus its time
blocked reading tokens: graph building, enqueueing, the sampler's host side) and % of the
roofline (roofline.py: weight bytes per token over the device's bandwidth).
"""

from __future__ import annotations

import sys

from ..runtime import stepper
from . import gpu_timer, roofline
from .census import decode_census
from .decode_profile import count_launches

NA = "n/a"
BUSY_STEPS = 16  # decode steps under the GPU profiler per frontier (a separate pass: the profiler slows the host)


class FrontierProfile:
    """The per-frontier profile columns of one model on this device."""

    def __init__(self, model, bandwidth: float | None, active_bytes: int | None):
        self.model, self.bandwidth, self.active_bytes = model, bandwidth, active_bytes

    @classmethod
    def for_model(cls, model, bandwidth_gbps: float | None = None) -> FrontierProfile:
        return cls(model, roofline.bandwidth(override_gbps=bandwidth_gbps), roofline.active_weight_bytes(model))

    def describe(self) -> str:
        bw = f"{self.bandwidth / 1e9:g} GB/s" if self.bandwidth else "n/a (no known bandwidth: --bandwidth-gbps)"
        act = f"{self.active_bytes / 1e9:.4g} GB" if self.active_bytes else "n/a"
        bound = roofline.roofline_tps(self.active_bytes, self.bandwidth)
        busy = gpu_timer.unavailable()
        return (
            f"device {roofline.device_name() or '?'}, bandwidth {bw}, weights read per token {act}"
            + (f", roofline {bound:.1f} t/s" if bound else "")
            + f"; GPU-busy: {busy or 'CUDA profiler'}; launches: {self.launch_source()}"
            + (
                "; host ms: the CPU runs part of each step inside the host's enqueue (an upper bound)"
                if roofline.on_cpu()
                else ""
            )
        )

    def launch_source(self) -> str:
        return "census (CUDA faces)" if stepper.supports_static(self.model.model) else "the step's graph"

    def launches(self, session, ctx: int) -> int | str:
        """Launches of one decode step at position ctx - 1 (n/a where the count fails, e.g. a
        model whose experts stream from disk: the bench's figures stand without it)."""
        import mlx.core as mx

        try:
            if stepper.supports_static(self.model.model):
                return decode_census(self.model, ctx)["total"]
            return count_launches(session, mx.array(5, mx.int32))["total"]
        except Exception as e:  # noqa: BLE001 - said on stderr, the column says n/a
            print(f"ds4mlx bench: launch count at {ctx}: {type(e).__name__}: {e}", file=sys.stderr)
            return NA

    def columns(self, session, ctx: int, tokens: int, secs: float, wait_s: float | None, probe) -> dict:
        """The row's profile columns.  `session` is at the frontier (the caller takes back what
        `probe(n)`, n more greedy tokens through the decode loop, adds); `secs` is the timed
        probe's wall time for `tokens` tokens and `wait_s` its time blocked reading them."""
        busy = None
        if gpu_timer.unavailable() is None:
            # one step first, unprofiled: the first step after a snapshot's restore copies the restored
            # cache arrays once (tools/frontier_probe.py saw it); the session ends one token deeper
            probe(1)
            n = min(tokens, BUSY_STEPS)
            busy = gpu_timer.busy_ms(lambda: probe(n), n)
        pct = roofline.roofline_pct(tokens / secs, self.active_bytes, self.bandwidth)
        return {
            "gpu_busy_ms": NA if busy is None else round(busy, 3),
            "launches_per_token": self.launches(session, ctx),
            "host_ms_per_token": NA if wait_s is None else round(1e3 * (secs - wait_s) / tokens, 3),
            "roofline_pct": NA if pct is None else round(pct, 2),
        }

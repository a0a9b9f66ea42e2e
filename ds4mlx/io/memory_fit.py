"""Does a model fit this machine at a given --ctx?  The weights' bytes plus the KV cache
at --ctx, against what a model can use here:

* Apple silicon (Metal): MLX's `max_recommended_working_set_size`, the system's GPU wired
  limit (macOS sets it to about three quarters of the RAM; `sudo sysctl
  iogpu.wired_limit_mb=N` raises it).  When the model fits, the wired limit is raised to
  it as mlx-lm does (`mx.set_wired_limit`), so the OS does not page the weights out;
* another GPU: 90% of its memory; the CPU: 90% of the RAM.

The verdict is one line either way; a refusal names the largest --ctx that fits (when the
weights alone fit) and `--stream-experts`.  `inspect` prints the same verdict the load
applies (`loader.load(ctx=...)`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

GB = 1e9
HEADROOM = 0.9  # of a GPU's memory or the RAM usable for one model (the OS and the server need the rest)
CTX_STEP = 1024  # the --ctx a refusal suggests is a multiple of this


@dataclass(frozen=True)
class Budget:
    bytes: int
    source: str  # what the figure is, for the messages
    metal: bool = False  # the figure is Metal's wired limit (set_wired_limit applies)


def machine_memory() -> int:
    """Bytes of memory a model can use here: the GPU's (MLX device info) or the RAM."""
    try:
        import mlx.core as mx

        info = device_info()
        if mx.default_device() != mx.cpu and info.get("memory_size"):
            return int(info["memory_size"])
    except Exception:  # noqa: BLE001 - no GPU info: fall back to the RAM
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device_info() -> dict:
    import mlx.core as mx

    return dict(mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info())


def metal_available() -> bool:
    try:
        import mlx.core as mx

        return bool(mx.metal.is_available())
    except Exception:  # noqa: BLE001 - an MLX without Metal
        return False


def budget() -> Budget:
    """What one model may use on this machine (see the module docstring)."""
    if metal_available():
        rec = int(device_info().get("max_recommended_working_set_size") or 0)
        if rec:
            return Budget(rec, "the Metal recommended working set", metal=True)
    mem = machine_memory()
    return Budget(int(HEADROOM * mem), f"{HEADROOM:.0%} of {mem / GB:.1f} GB")


@dataclass(frozen=True)
class Verdict:
    weights: int
    kv: int | None  # None: the family's KV size is not known
    ctx: int
    budget: Budget
    max_ctx: int | None  # the largest --ctx (a multiple of CTX_STEP) that fits; None: none does, or unknown

    @property
    def need(self) -> int:
        return self.weights + (self.kv or 0)

    @property
    def fits(self) -> bool:
        return self.need <= self.budget.bytes

    def line(self) -> str:
        kv = "KV unknown" if self.kv is None else f"KV {self.kv / GB:.2f} GB"
        return (
            f"weights {self.weights / GB:.2f} GB + {kv} at --ctx {self.ctx} = {self.need / GB:.2f} GB "
            f"of {self.budget.bytes / GB:.2f} GB ({self.budget.source}): {'fits' if self.fits else 'does not fit'}"
        )

    def refusal(self, what: str) -> str:
        """One line: why `what` is refused and the ways out."""
        ways = []
        if self.max_ctx and self.max_ctx < self.ctx:
            ways.append(f"--ctx {self.max_ctx} fits")
        ways.append("--stream-experts keeps the routed experts on disk")
        if self.budget.metal:
            ways.append("`sudo sysctl iogpu.wired_limit_mb=N` raises the limit")
        ways.append("or take a smaller quantization (`ds4mlx pull` lists them)")
        return (
            f"{what} needs {self.need / GB:.1f} GB at --ctx {self.ctx} but {self.budget.bytes / GB:.1f} GB is usable "
            f"here ({self.budget.source}): it cannot hold it; " + "; ".join(ways)
        )


def verdict(
    weights: int, kv_at: Callable[[int], int | None], ctx: int, where: Budget, ctx_cap: int = 1 << 20
) -> Verdict:
    """The verdict for `weights` bytes plus `kv_at(ctx)` bytes of KV cache."""
    kv = kv_at(ctx)
    max_ctx = None
    if kv is not None and weights + (kv_at(CTX_STEP) or 0) <= where.bytes:
        lo, hi = 1, max(1, ctx_cap // CTX_STEP)  # in units of CTX_STEP; lo fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if weights + kv_at(mid * CTX_STEP) <= where.bytes:
                lo = mid
            else:
                hi = mid - 1
        max_ctx = lo * CTX_STEP
    return Verdict(int(weights), kv, int(ctx), where, max_ctx)


def wire(v: Verdict) -> str | None:
    """On Metal, with a model that fits: raise MLX's wired limit to the recommended working
    set (mlx-lm's `wired_limit`), so the weights stay resident; what was done, for the banner."""
    if not (v.budget.metal and v.fits):
        return None
    import mlx.core as mx

    set_limit = getattr(mx, "set_wired_limit", None) or getattr(mx.metal, "set_wired_limit", None)
    if set_limit is None:
        return None
    try:
        set_limit(v.budget.bytes)
    except (RuntimeError, ValueError) as e:  # a limit past the system's: keep MLX's default
        return f"wired limit left as it was ({e})"
    return f"wired limit raised to {v.budget.bytes / GB:.1f} GB"


__all__ = ["Budget", "Verdict", "budget", "verdict", "wire", "machine_memory", "GB", "HEADROOM"]

"""How many experts the cache may hold: a count, GiB, or `auto`.

`auto` = free memory - resident weights - KV at the configured context - working space
(ds4's plan: size the cache from what is left).  `--simulate-used-memory G` (ds4's knob)
counts G GiB of this machine as taken by someone else: for tests of a model larger than
its memory, and the refusal of one without streaming.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

GIB = 2**30
WORKING_FRACTION = 0.10  # of the free memory: activations, graph scratch, allocator slack
WORKING_MIN = 64 * 2**20


@dataclass
class StreamConfig:
    """The --stream-experts flags (experts/cli.py), or what a test asks for."""

    enabled: bool = False
    count: int | None = None  # total experts over all layers
    gb: float | None = None  # or a size (count and gb None: auto)
    per_layer: int | None = None  # or slots per layer (tests, ds4's 1-2 expert runs)
    preload: int = 0  # experts per layer read at start (the profile's hottest first)
    profile: str | None = None  # --expert-profile: read at start if present, written at the end
    prefetch: bool = True
    pin_layers: bool = True  # whole layers resident where the budget allows
    full_layers: int | None = None  # ds4's --ssd-streaming-full-layers: exactly this many pinned
    ctx: int = 4096  # the KV the auto budget leaves room for
    simulate_used_gb: float = 0.0
    memory_gb: float | None = None  # --memory-limit: the memory model data may take here


def simulated_used_bytes(cfg: StreamConfig | None) -> int:
    if cfg is not None and cfg.simulate_used_gb:
        return int(cfg.simulate_used_gb * GIB)
    env = os.environ.get("DS4MLX_SIMULATE_USED_MEMORY_GB", "").strip()
    return int(float(env) * GIB) if env else 0


def free_memory(cfg: StreamConfig | None = None) -> int:
    """Bytes this process may still use: MemAvailable (Linux) or the machine's memory
    (elsewhere) on the CPU, the GPU's recommended working set otherwise; a cgroup limit
    caps it; minus the simulated use.  With a memory limit (`cfg.memory_gb`): the limit
    minus what MLX holds already (the weights loaded so far)."""
    if cfg is not None and cfg.memory_gb is not None:
        import mlx.core as mx

        return max(0, int(cfg.memory_gb * GIB) - int(mx.get_active_memory()) - simulated_used_bytes(cfg))
    free = None
    try:
        import mlx.core as mx

        if mx.default_device() != mx.cpu:
            info = mx.device_info()
            free = int(info.get("max_recommended_working_set_size") or info.get("memory_size") or 0) or None
            if free is not None:
                free -= int(mx.get_active_memory())
    except Exception:  # noqa: BLE001 - no device info: the host's numbers
        free = None
    if free is None:
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        free = int(line.split()[1]) * 1024
                        break
        except OSError:
            pass
    if free is None:
        free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for p in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            raw = open(p).read().strip()
        except OSError:
            continue
        if raw.isdigit() and int(raw) < 1 << 60:
            used = 0
            for q in ("/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory/memory.usage_in_bytes"):
                try:
                    used = int(open(q).read().strip())
                    break
                except (OSError, ValueError):
                    pass
            free = min(free, int(raw) - used)
        break
    return max(0, free - simulated_used_bytes(cfg))


def auto_budget_bytes(resident: int, kv: int, cfg: StreamConfig) -> tuple[int, str]:
    """(bytes for the expert cache, the line that explains them).  `resident`: the
    weights already loaded (they are in the free figure's past, so not subtracted again)."""
    free = free_memory(cfg)
    work = max(WORKING_MIN, int(free * WORKING_FRACTION))
    budget = max(0, free - kv - work)
    line = (
        f"auto = free {free / GIB:.2f} GiB (after {resident / GIB:.2f} GiB resident weights"
        + (f", {simulated_used_bytes(cfg) / GIB:.2f} GiB simulated used" if simulated_used_bytes(cfg) else "")
        + f") - KV {kv / GIB:.2f} GiB at ctx {cfg.ctx} - working {work / GIB:.2f} GiB"
    )
    return budget, line


def parse_cache_spec(text: str) -> tuple[int | None, float | None]:
    """ds4's `N|NGB` (and ours: `auto`) -> (count, gb)."""
    t = str(text).strip().lower()
    if t in ("", "auto"):
        return None, None
    for suffix in ("gib", "gb", "g"):
        if t.endswith(suffix):
            return None, float(t[: -len(suffix)])
    return int(t), None


__all__ = ["StreamConfig", "free_memory", "auto_budget_bytes", "parse_cache_spec", "simulated_used_bytes", "GIB"]

"""The GPU's busy time while some host code runs, kernel by kernel.

MLX has no public GPU timer.  On CUDA, PyTorch's profiler (CUPTI) records every kernel
the process runs, MLX's included, with its device time; the sum over the kernels is the
GPU's busy time (kernels of one stream never overlap).  Elsewhere (the CPU, Metal) or
without torch the answer is None and the reason, never a guess.
"""

from __future__ import annotations

from collections import defaultdict


def unavailable() -> str | None:
    """Why the GPU's busy time can not be measured here (None: it can)."""
    import mlx.core as mx

    if mx.default_device() == mx.cpu:
        return "the CPU has no GPU timer"
    if not mx.cuda.is_available():
        return "no GPU timer for this backend (MLX has none; CUPTI is CUDA's)"
    try:
        import torch  # noqa: F401
        from torch.profiler import profile  # noqa: F401
    except ImportError:
        return "needs torch (its profiler reads CUPTI)"
    return None


def kernel_times(fn) -> tuple[object, dict[str, list]]:
    """Run `fn()` under the CUDA profiler -> (its result, {kernel name: [count, device µs]})."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        result = fn()
    per = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        dt = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
        if ev.device_type.name != "CUDA" or dt <= 0:
            continue
        per[ev.name[:90]][0] += 1
        per[ev.name[:90]][1] += dt
    return result, dict(per)


def busy_ms(fn, steps: int) -> float | None:
    """GPU-busy ms per step of `fn()`, which runs `steps` steps (None where it can not be told)."""
    if unavailable() is not None:
        return None
    _, per = kernel_times(fn)
    return sum(t for _, t in per.values()) / 1e3 / steps

"""The default prefill chunk: tokens per forward of a prompt (docs: README, environment).

A bigger chunk runs each weight over more tokens per read (GEMMs, not mat-vecs), so
on a GPU the default is 2048; on the CPU, where a chunk's time is compute bound and
a cancellation waits for the chunk in flight, 512.  A chunk's extra memory grows with
its size (`ds4mlx bench --profile-prefill` reports it).  `DS4MLX_PREFILL_CHUNK`
overrides both; `--prefill-chunk` / `--chunk` override it per command.
"""

from __future__ import annotations

import os

ENV = "DS4MLX_PREFILL_CHUNK"
CPU_CHUNK = 512
GPU_CHUNK = 2048


def default_chunk() -> int:
    """DS4MLX_PREFILL_CHUNK if set, else GPU_CHUNK on a GPU default device, else CPU_CHUNK."""
    env = os.environ.get(ENV, "").strip()
    if env:
        n = int(env)
        if n <= 0:
            raise ValueError(f"{ENV} must be a positive integer, not {env!r}")
        return n
    import mlx.core as mx

    return GPU_CHUNK if mx.default_device().type == mx.DeviceType.gpu else CPU_CHUNK

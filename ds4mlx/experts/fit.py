"""Does a model fit the memory it is given?  Checked at load from the headers alone:
without --stream-experts a model whose weights exceed the free memory is refused in
one line that names the flag; with it, the resident part (everything but the routed
experts) plus one cache slot per MoE layer must fit."""

from __future__ import annotations

import numpy as np

from .budget import GIB, StreamConfig, free_memory
from .rows import split_expert_tensors


def resident_bytes(value, cast_dtype) -> int:
    """Bytes a loader value takes once loaded: packed bytes as they are, floats at the
    dtype they are cast to."""
    from .store import file_bytes

    n = file_bytes(value)
    dt = getattr(value, "dtype", None)
    if cast_dtype is not None and dt is not None and getattr(value, "raw", None) is None:
        try:
            if np.issubdtype(np.dtype(dt), np.floating):
                import mlx.core as mx

                n = n // np.dtype(dt).itemsize * mx.array(0, cast_dtype).itemsize
        except TypeError:
            pass
    return int(n)


def _given_memory(cfg) -> bool:
    """A memory figure was asked for (--memory-limit, --simulate-used-memory or its env
    variable): compare with the free memory.  Otherwise with the machine's total: the
    free figure of a shared machine moves, and a load that cannot fit at all is the one
    worth refusing up front."""
    from .budget import simulated_used_bytes

    return bool(cfg is not None and (cfg.memory_gb is not None or simulated_used_bytes(cfg)))


def total_memory() -> int:
    from ..io.memory_fit import machine_memory

    return machine_memory()


def check_fits(tensors: dict, n_layers: int, cast_dtype, cfg: StreamConfig | None) -> None:
    """ValueError (one line) when the weights cannot be held in the free memory."""
    rest, banks = split_expert_tensors(tensors, n_layers)
    other = sum(resident_bytes(v, cast_dtype) for v in rest.values())
    experts = sum(resident_bytes(v, cast_dtype) for layer in banks.values() for v in layer.values())
    free = free_memory(cfg) if _given_memory(cfg) else total_memory()
    streaming = cfg is not None and cfg.enabled
    if not streaming and other + experts > free:
        hint = f"; --stream-experts keeps the routed experts ({experts / GIB:.2f} GiB) in the file" if experts else ""
        raise ValueError(
            f"the weights need {(other + experts) / GIB:.2f} GiB but {free / GIB:.2f} GiB of memory is "
            f"{'free' if _given_memory(cfg) else 'here'}{hint}"
        )
    if streaming and banks:
        from .rows import expert_count

        slot = sum(
            sum(resident_bytes(v, cast_dtype) for v in layer.values()) // max(1, expert_count(layer))
            for layer in banks.values()
        )
        if other + slot > free:
            raise ValueError(
                f"with --stream-experts the resident weights and one expert per layer need "
                f"{(other + slot) / GIB:.2f} GiB but {free / GIB:.2f} GiB of memory is "
                f"{'free' if _given_memory(cfg) else 'here'}"
            )


__all__ = ["check_fits", "resident_bytes"]

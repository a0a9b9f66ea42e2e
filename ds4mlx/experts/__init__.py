"""SSD expert streaming (ds4's --ssd-streaming): the non-routed weights
resident, the routed experts read from the model file on demand into a bounded cache.

rows.py     which tensors are routed experts; reading a few experts of a bank
build.py    some experts of a layer, converted exactly as the resident load would
module.py   StreamedExperts: the family's SwitchGLU over a slab of cache slots
store.py    the per-layer caches, policy, faults, stats, profile, prefetch
budget.py   count / GiB / auto budgets, free memory, the simulated-used-memory knob
install.py  detaching the experts from a model being loaded, attaching the store
cli.py      the flags serve / generate / chat / eval / bench share
"""

from .budget import StreamConfig

__all__ = ["StreamConfig", "ExpertReadError", "ExpertStore"]


def __getattr__(name: str):
    # the store needs MLX; the flags (cli.py, budget.py) must not pull it in: `ds4mlx eval
    # --self-test-extractors` runs without MLX
    if name in ("ExpertReadError", "ExpertStore"):
        from . import store

        return getattr(store, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

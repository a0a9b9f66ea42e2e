"""Which plan this process runs, and its process group.

A plan is "tp" (attention heads, shared expert and each routed expert's
intermediate columns split over the ranks; two all_sum per layer), "ep" (each rank
owns a slice of the routed experts and the shared expert's columns; attention is
replicated; one all_sum per layer) or "pipeline" (contiguous layer ranges; the hidden
state is sent rank to rank, the last stage's output summed back to rank 0).
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("tp", "ep", "pipeline")


@dataclass(frozen=True)
class Plan:
    kind: str
    rank: int = 0
    size: int = 1

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown distributed plan {self.kind!r} (known: {', '.join(KINDS)})")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} outside a group of {self.size}")

    @property
    def identity(self) -> str:
        """What a snapshot / disk KV cache file records: a state is only valid for the same
        plan, group size and rank (each rank holds its own shard of the state)."""
        return f"{self.kind}:{self.rank}/{self.size}"

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def block(self, total: int, what: str) -> tuple[int, int]:
        """This rank's [start, stop) of `total` items split evenly (ValueError otherwise)."""
        if total % self.size:
            raise ValueError(f"{self.kind}: {what} ({total}) is not divisible by the {self.size} ranks")
        n = total // self.size
        return self.rank * n, (self.rank + 1) * n


def init(kind: str, backend: str = "any"):
    """(Plan, group) of this process; `mlx.launch` (or MLX_HOSTFILE + MLX_RANK) sets it up.
    A group of one is refused: a distributed plan with nobody to share with is a mistake."""
    import mlx.core as mx

    group = mx.distributed.init(strict=True, backend=backend)
    if group.size() < 2:
        raise RuntimeError("--distributed needs at least two ranks (launch with mlx.launch -n 2 ...)")
    return Plan(kind, group.rank(), group.size()), group

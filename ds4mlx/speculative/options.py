"""The speculative decoding settings a front end passes to the engine, and its counters."""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_DRAFT = 1  # ds4's --mtp-draft default
DEFAULT_MARGIN = 3.0  # ds4's --mtp-margin default
# Sampled speculation keeps the target distribution unless asked otherwise
# (opportunistic acceptance only when asked, `--no-mtp-exact-sampling`; ds4 itself defaults
# to opportunistic): acceptance.OpportunisticRule when off
DEFAULT_EXACT_SAMPLING = True


class SpecUsageError(ValueError):
    """A speculative-decoding flag that cannot be honoured (printed, exit status 2)."""


@dataclass
class SpecConfig:
    drafter: object  # drafter.ModelDrafter (or any object with `propose`)
    depth: int = DEFAULT_DRAFT  # draft tokens per round (--mtp-draft)
    margin: float = DEFAULT_MARGIN  # confidence pruning of the recursive draft (--mtp-margin)
    exact_sampling: bool = DEFAULT_EXACT_SAMPLING  # sampled jobs: the target distribution (--mtp-exact-sampling)
    timing: bool = False  # --mtp-timing: measure the verify cost per k at the end of each job (cost.py)

    def __post_init__(self):
        if int(self.depth) < 1:
            raise ValueError("--mtp-draft must be at least 1")
        self.depth = int(self.depth)
        self.margin = max(0.0, float(self.margin))
        self.exact_sampling = bool(self.exact_sampling)
        self.timing = bool(self.timing)

    def describe(self) -> str:
        name = getattr(self.drafter, "name", type(self.drafter).__name__)
        sampling = "exact" if self.exact_sampling else "opportunistic"
        return f"{name}, {self.depth} draft token(s), margin {self.margin:g}, {sampling} sampling"


@dataclass
class SpecStats:
    rounds: int = 0  # verify forwards
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens the target kept
    emitted: int = 0  # tokens that left the loop (accepted drafts + one target token per round)
    rollbacks: int = 0  # rounds with a rejected draft (checkpoint restored)
    draft_seconds: float = 0.0  # wall time proposing (the drafter's forwards, read once)
    verify_seconds: float = 0.0  # wall time verifying: the target forward, acceptance, rollback
    # --mtp-timing: the costs measured at the end of the job (cost.Costs.as_dict(): step_ms,
    # verify_ms_k<k>, breakeven_k<k>); not summed by `add` (a measurement, not a counter)
    costs: dict = field(default_factory=dict)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        return self.emitted / self.rounds if self.rounds else 0.0

    def add(self, other: SpecStats) -> None:
        for k in ("rounds", "drafted", "accepted", "emitted", "rollbacks", "draft_seconds", "verify_seconds"):
            setattr(self, k, getattr(self, k) + getattr(other, k))

    @property
    def draft_ms_per_token(self) -> float:
        """The drafter's wall time per proposed token, in milliseconds."""
        return 1000.0 * self.draft_seconds / self.drafted if self.drafted else 0.0

    @property
    def verify_ms_per_round(self) -> float:
        """The verify cost: wall time of one round's verify (target forward, acceptance,
        rollback), in milliseconds."""
        return 1000.0 * self.verify_seconds / self.rounds if self.rounds else 0.0

    def as_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "emitted": self.emitted,
            "rollbacks": self.rollbacks,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "tokens_per_round": round(self.tokens_per_round, 4),
            "draft_seconds": round(self.draft_seconds, 4),
            "verify_seconds": round(self.verify_seconds, 4),
            "verify_ms_per_round": round(self.verify_ms_per_round, 3),
            **({"costs": dict(self.costs)} if self.costs else {}),
        }

    @classmethod
    def from_dict(cls, d: dict) -> SpecStats:
        """The counters of an `as_dict()` (a Finish's `speculation`)."""
        keys = ("rounds", "drafted", "accepted", "emitted", "rollbacks", "draft_seconds", "verify_seconds")
        return cls(**{k: d[k] for k in keys if k in d}, costs=dict(d.get("costs") or {}))

    def summary(self) -> str:
        """The one-line end-of-run summary (generate / chat print it beside t/s)."""
        return (
            f"speculation: drafted {self.drafted}, accepted {self.accepted} "
            f"({100 * self.acceptance_rate:.1f}%), {self.tokens_per_round:.2f} tokens per verify, "
            f"verify {self.verify_ms_per_round:.2f} ms per round ({self.rounds} rounds), "
            f"draft {self.draft_ms_per_token:.2f} ms per token"
        )

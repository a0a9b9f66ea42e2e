"""The engine's counters (tests, logs, `GET /v1/ds4mlx/stats`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..speculative.options import SpecStats


@dataclass
class EngineStats:
    """Counters for tests and logs (monotonic, whole process)."""

    jobs: int = 0
    prefill_tokens: int = 0  # prompt tokens evaluated by prefill (reused ones excluded)
    reused_tokens: int = 0  # prompt tokens a job started from instead (its cached_tokens, any source)
    decode_tokens: int = 0  # sampled tokens evaluated into the session
    cancelled: int = 0
    cancel_requests: int = 0
    greedy_tokens: int = 0  # tokens sampled greedily because of DSML structure
    spec_rounds: int = 0  # speculative decoding: verify forwards
    spec_drafted: int = 0  # draft tokens proposed
    spec_accepted: int = 0  # draft tokens the target kept
    spec_acceptance_rate: float = 0.0
    spec_draft_seconds: float = 0.0  # wall time proposing drafts
    spec_verify_seconds: float = 0.0  # wall time verifying (target forward, acceptance, rollback)
    shared_steps: int = 0  # decode steps that ran in a forward shared with other slots
    mixed_steps: int = 0  # engine steps that ran decode rows and a prefill chunk (engine/batch.py)
    # seconds the decode loops sat blocked reading a sampled token (decode.py `wait_s`): a decode's
    # wall time minus this is the host's own work (bench/engine_host.py)
    decode_wait_seconds: float = 0.0
    last_cache_source: str = "none"

    def count_speculation(self, st: SpecStats) -> None:
        """Add one job's speculative-decoding counters."""
        self.spec_rounds += st.rounds
        self.spec_drafted += st.drafted
        self.spec_accepted += st.accepted
        self.spec_draft_seconds = round(self.spec_draft_seconds + st.draft_seconds, 4)
        self.spec_verify_seconds = round(self.spec_verify_seconds + st.verify_seconds, 4)
        self.spec_acceptance_rate = round(self.spec_accepted / self.spec_drafted, 4) if self.spec_drafted else 0.0

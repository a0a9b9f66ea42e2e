"""The MTP head as a drafter (`--mtp`).  Placeholder until the head's graph exists."""

from __future__ import annotations

from .options import SpecUsageError


def mtp_drafter(model, ctx: int):
    if not getattr(model, "mtp_weights", None):
        raise SpecUsageError("--mtp: this model file carries no MTP tensors (mtp.*); pass ds4's MTP GGUF: --mtp FILE")
    raise SpecUsageError("--mtp: the MTP head is not implemented yet; use --draft-model PATH")

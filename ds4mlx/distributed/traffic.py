"""What one decode token moves between the ranks, per plan (computed, not measured).

Payload bytes are the arrays handed to the collectives (a ring all_sum over N ranks
sends about 2(N-1)/N of its payload from each rank); the serve path adds its step
command (a 4 x int32 header and the 1 x int32 token, two small all_sums).
"""

from __future__ import annotations

COMMAND = [("all_sum", 16), ("all_sum", 4)]  # serve: header + token


def decode_traffic(args, kind: str, size: int, act_bytes: int = 4) -> list[tuple[str, int]]:
    """(collective, payload bytes) of one decode token of a V4 model `args` (the whole
    model's ModelArgs) under plan `kind` over `size` ranks, the step command excluded."""
    hidden = args.hidden_size * act_bytes  # one token's [1, 1, H] partial output
    stream = args.hc_mult * args.hidden_size * 4  # the [1, 1, hc, H] residual stream, sent as float32
    L = args.num_hidden_layers
    if kind == "tp":
        return [("all_sum", hidden)] * (2 * L)  # attention output + MoE output, every layer
    if kind == "ep":
        return [("all_sum", hidden)] * L  # the MoE output (routed + shared partials)
    if kind == "pipeline":
        return [("send", stream)] * (size - 1) + [("all_sum", stream)]  # hops + back to rank 0
    raise ValueError(kind)


def summary(args, kind: str, size: int, act_bytes: int = 4) -> dict:
    ops = decode_traffic(args, kind, size, act_bytes)
    return {"plan": kind, "ranks": size, "collectives": len(ops), "payload_bytes": sum(b for _, b in ops)}

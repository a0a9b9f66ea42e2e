"""The expert-streaming flags of serve, generate, chat, eval and bench (ds4's names as
aliases), and what the commands print / serve / write from the store."""

from __future__ import annotations

import argparse
import sys

from .budget import StreamConfig, parse_cache_spec

# the store's numbers as bench CSV columns (prefixed), in this order
CSV_FIELDS = (
    "resident_bytes",
    "capacity_experts",
    "hits",
    "misses",
    "hit_rate",
    "bytes_read",
    "read_ms_p50",
    "read_ms_p99",
)
CSV_PREFIX = "expert_"


def add_arguments(p) -> None:
    g = p.add_argument_group("SSD expert streaming (routed experts read from the model file on demand)")
    g.add_argument(
        "--stream-experts",
        "--ssd-streaming",
        dest="stream_experts",
        action="store_true",
        help="keep the routed experts in the model file behind a bounded cache",
    )
    g.add_argument(
        "--expert-cache-count",
        "--ssd-streaming-cache-experts",
        dest="expert_cache",
        default=None,
        metavar="N|auto",
        help="cache budget in experts over all layers (ds4's N or NGB also accepted); default auto",
    )
    g.add_argument(
        "--expert-cache-gb",
        dest="expert_cache_gb",
        default=None,
        metavar="G|auto",
        help="cache budget in GiB; auto = free memory - resident weights - KV at --ctx - working space",
    )
    g.add_argument(
        "--preload",
        "--ssd-streaming-preload-experts",
        dest="expert_preload",
        type=int,
        default=0,
        metavar="N",
        help="experts per layer read at start (the profile's hottest first)",
    )
    g.add_argument(
        "--expert-profile",
        dest="expert_profile",
        default=None,
        metavar="FILE",
        help="expert hit counts: read at start (preload order), written at the end",
    )
    g.add_argument(
        "--no-expert-prefetch", dest="expert_prefetch", action="store_false", help="no read-ahead of the next layer"
    )
    g.add_argument(
        "--expert-full-layers",
        "--ssd-streaming-full-layers",
        dest="expert_full_layers",
        type=int,
        default=None,
        metavar="N",
        help="pin exactly N whole layers (default: as many as the budget covers)",
    )
    g.add_argument(
        "--ssd-streaming-cold",
        dest="expert_cold",
        action="store_true",
        help="ds4's cold start: no preload, no pinned whole layers",
    )
    g.add_argument(
        "--simulate-used-memory",
        dest="simulate_used_memory",
        type=float,
        default=0.0,
        metavar="GB",
        help="count GB of memory as used by others (tests of a model larger than its memory)",
    )
    g.add_argument(
        "--memory-limit",
        dest="memory_limit",
        type=float,
        default=None,
        metavar="GB",
        help="the memory model data may take (default: what the machine has free)",
    )


def config_from_args(args: argparse.Namespace) -> StreamConfig:
    """The StreamConfig of parsed flags (enabled False without --stream-experts: then
    only the memory check at load reads it)."""
    count = gb = None
    spec = getattr(args, "expert_cache", None)
    if spec is not None:
        count, gb = parse_cache_spec(spec)
    gspec = getattr(args, "expert_cache_gb", None)
    if gspec is not None and str(gspec).strip().lower() != "auto":
        gb = float(gspec)
    cold = bool(getattr(args, "expert_cold", False))
    return StreamConfig(
        enabled=bool(getattr(args, "stream_experts", False)),
        count=count,
        gb=gb,
        preload=0 if cold else int(getattr(args, "expert_preload", 0) or 0),
        profile=getattr(args, "expert_profile", None),
        prefetch=bool(getattr(args, "expert_prefetch", True)),
        pin_layers=not cold,
        full_layers=getattr(args, "expert_full_layers", None),
        ctx=int(getattr(args, "ctx", None) or 4096),
        simulate_used_gb=float(getattr(args, "simulate_used_memory", 0.0) or 0.0),
        memory_gb=getattr(args, "memory_limit", None),
    )


def store_of(model):
    """The expert store of a loaded model (LanguageModel or family Model), or None."""
    inner = getattr(model, "model", model)
    return getattr(inner, "expert_store", None) or getattr(model, "expert_store", None)


def stats_of(model) -> dict | None:
    st = store_of(model)
    return st.snapshot() if st is not None else None


def csv_columns(model) -> dict:
    """{expert_<field>: value} for a bench row ({} without streaming)."""
    snap = stats_of(model)
    if snap is None:
        return {}
    return {CSV_PREFIX + k: snap[k] for k in CSV_FIELDS}


def finish(model, out=None) -> None:
    """End of a run: the prefetch thread stopped, the profile written, the stats printed
    (to `out`, default the sys.stderr of the moment: a default bound at import would keep a
    stream that was replaced since)."""
    out = sys.stderr if out is None else out
    st = store_of(model)
    if st is None:
        return
    st.close()
    print(st.summary_line(), file=out)


__all__ = ["add_arguments", "config_from_args", "store_of", "stats_of", "csv_columns", "finish", "CSV_FIELDS"]

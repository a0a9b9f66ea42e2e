"""ds4-bench's CSV and `ds4mlx bench`'s CSV of one run joined by frontier.

    python3 tools/ds4_side_by_side.py ds4.csv ds4mlx.csv --layers 20 [--csv side_by_side.csv]

Prints a Markdown table for BENCHMARKS.md: prefill and decode t/s of each engine at each
frontier and ours / ds4.  A frontier only one engine reached shows "–" for the other.
Both CSVs share ds4-bench's first columns (ctx_tokens, prefill_tokens, prefill_tps,
gen_tokens, gen_tps, kvcache_bytes).
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

COLUMNS = [
    "ctx_tokens",
    "ds4_prefill_tps",
    "ds4mlx_prefill_tps",
    "prefill_ratio",
    "ds4_gen_tps",
    "ds4mlx_gen_tps",
    "gen_ratio",
]


def read_rows(path) -> dict[int, dict]:
    p = Path(path)
    if not p.is_file():
        return {}
    with open(p, newline="") as f:
        return {int(r["ctx_tokens"]): r for r in csv.DictReader(f) if r.get("ctx_tokens")}


def _ratio(ours, theirs):
    return round(ours / theirs, 3) if ours is not None and theirs else None


def join(ds4: dict, ours: dict) -> list[dict]:
    rows = []
    for ctx in sorted(set(ds4) | set(ours)):
        a, b = ds4.get(ctx), ours.get(ctx)
        get = lambda r, k: float(r[k]) if r is not None else None  # noqa: E731
        row = {
            "ctx_tokens": ctx,
            "ds4_prefill_tps": get(a, "prefill_tps"),
            "ds4mlx_prefill_tps": get(b, "prefill_tps"),
            "ds4_gen_tps": get(a, "gen_tps"),
            "ds4mlx_gen_tps": get(b, "gen_tps"),
        }
        row["prefill_ratio"] = _ratio(row["ds4mlx_prefill_tps"], row["ds4_prefill_tps"])
        row["gen_ratio"] = _ratio(row["ds4mlx_gen_tps"], row["ds4_gen_tps"])
        rows.append(row)
    return rows


def markdown(rows: list[dict], layers: int | None) -> str:
    f = lambda v, d=1: "–" if v is None else f"{v:,.{d}f}"  # noqa: E731
    out = [
        f"Synthetic V4 Flash q2 GGUF, {layers if layers else '?'} layers, one device session",
        "",
        "| ctx | ds4 prefill t/s | ds4mlx prefill t/s | ours / ds4 | ds4 decode t/s | ds4mlx decode t/s | ours / ds4 |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['ctx_tokens']:,} | {f(r['ds4_prefill_tps'])} | {f(r['ds4mlx_prefill_tps'])} | "
            f"{f(r['prefill_ratio'], 3)} | {f(r['ds4_gen_tps'], 2)} | {f(r['ds4mlx_gen_tps'], 2)} | "
            f"{f(r['gen_ratio'], 3)} |"
        )
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tools/ds4_side_by_side.py")
    ap.add_argument("ds4_csv")
    ap.add_argument("ds4mlx_csv")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--csv", help="also write the joined rows here")
    a = ap.parse_args(argv)
    rows = join(read_rows(a.ds4_csv), read_rows(a.ds4mlx_csv))
    if not rows:
        print("ds4_side_by_side: neither CSV has a row", file=sys.stderr)
        return 1
    print(markdown(rows, a.layers))
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS)
            w.writeheader()
            w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Which launches one compiled decode step of the synthetic V4 Flash makes on CUDA, counted on
the CPU (`ds4mlx.bench.census`: GPU faces chosen as on CUDA, kernels replaced by placeholders,
MLX's own primitives read from the step's graph).

    python tools/launch_census.py --layers 4 --ctx 2048 [--full-width] [--chain T | --rows B | --mtp N]

`--chain T`: a speculative verify of T tokens (the compiled step's rows chained) instead of
one step; the step's count is printed beside it (the verify's cost in steps, in launches).
`--rows B`: one batched step of B sessions (session batching), likewise beside one step.
`--mtp N`: a (random) MTP head's step over N positions (1: a recursive draft, more: a round's
catch-up), likewise beside one step.
"""

from __future__ import annotations

import argparse

from ds4mlx.bench.census import decode_census, mtp_census
from ds4mlx.bench.synthetic import build_synthetic_v4_flash

# narrow V4 shapes that every kernel still takes (a few seconds on the CPU)
NARROW = dict(
    hidden_size=512, num_attention_heads=8, head_dim=128, partial_rotary_factor=0.5, q_lora_rank=128,
    o_groups=2, o_lora_rank=128, moe_intermediate_size=256, index_n_heads=8, index_head_dim=64,
    index_topk=64, vocab_size=4096,
)  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--full-width", action="store_true", help="V4 Flash's own shapes (GBs of host memory)")
    p.add_argument("--chain", type=int, default=0, help="count a verify of this many tokens (one session)")
    p.add_argument("--rows", type=int, default=1, help="count one batched step of this many sessions")
    p.add_argument("--mtp", type=int, default=0, help="count the MTP head's step over this many positions")
    a = p.parse_args()
    if a.chain and a.rows != 1:
        p.error("--chain and --rows count different steps: give one")
    model, _, _ = build_synthetic_v4_flash(
        layers=a.layers, experts=a.experts, overrides=None if a.full_width else NARROW
    )
    c = mtp_census(model, a.ctx, a.mtp) if a.mtp else decode_census(model, a.ctx, rows=a.rows, chain=a.chain)
    n = c["layers"]
    types = [x.layer_type for x in model.new_session(ctx=8).caches]
    print(f"layers {len(types)} ({', '.join(f'{t} x{types.count(t)}' for t in sorted(set(types)))}), ctx {a.ctx}")
    if a.chain or a.rows > 1 or a.mtp:
        step = decode_census(model, a.ctx)["total"]
        what = f"MTP step of {a.mtp} positions" if a.mtp else f"verify of {a.chain} tokens" if a.chain else f"batched step of {a.rows} sessions"  # fmt: skip
        print(f"launches per {what}: {c['total']} ({c['total'] / n:.2f} per layer)", end="")
        print(f" = {c['total'] / step:.2f} steps of {step}")
    else:
        print(f"launches per step: {c['total']} ({c['total'] / n:.2f} per layer)")
    for title, part in (("our kernels", "kernels"), ("fills of init_value outputs", "fills"), ("MLX's own", "mlx")):
        print(f"\n{title}:")
        for k, v in part_items(c[part]):
            print(f"  {v:5d}  {v / n:5.2f}/layer  {k}")
    return 0


def part_items(d: dict):
    return sorted(d.items(), key=lambda kv: -kv[1])


if __name__ == "__main__":
    raise SystemExit(main())

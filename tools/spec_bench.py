"""Speculative decoding on the GPU: verify cost, self-draft speed-up, break-even.

    python3 tools/spec_bench.py --ctx 2048 --gen 64 --csv $OUT/spec_bench.csv
    python3 tools/spec_bench.py --smoke            # CPU: a tiny synthetic model, seconds

One synthetic V4 Flash build (random full-size weights, ds4mlx.bench.synthetic), one
prompt of --ctx tokens, then:

1. `step`: the plain decode loop (compiled static step, lookahead), ms per token;
   `step_sync`: the same step waited for token by token (step, evaluate, read the token),
   as a verify is timed: `verify_vs_sync_k` is the verify's cost in such steps, which
   leaves out the host time the pipelined loop hides behind the device (a sync round pays it);
2. `verify_k`: `Session.verify` of k+1 tokens (one forward, k = 1..4), ms per call, and
   what a rejection at the first draft adds (`reject_k`: the loop's `keep_prefix`, the
   chained verify's row state where the model has it, else rollback + re-feed);
3. `oracle_k`: the speculative loop with a free draft that is always right (the plain
   run's own tokens): acceptance 1.0, the pure verification speed-up;
4. `self_k`: the speculative loop with draft = target (`--draft-model` = the model):
   acceptance 1.0 at the price of a full draft step per token (a lower bound);
5. `mtp_k`: the random MTP head, when the model has one (`speculative.mtp`);
6. break-even acceptance per k: the acceptance rate a at which
   E(a, k) * step = verify_k + k * draft, E = (1 - a^(k+1)) / (1 - a) tokens per round,
   for a free draft and for a draft costing one layer's share of a step (MTP ~ 1/layers).

Prints CSV (kind,k,ms,tps,tokens_per_round,acceptance,speedup,breakeven_free,breakeven_mtp);
`speedup` is plain step ms / ms for the loop rows, and verify ms / step ms (the cost ratio)
for the verify rows.
"""

from __future__ import annotations

import argparse
import sys
import time

import mlx.core as mx

from ds4mlx.bench.synthetic import build_synthetic_v4_flash
from ds4mlx.runtime.decode import decode_tokens, greedy
from ds4mlx.speculative.acceptance import GreedyRule
from ds4mlx.speculative.cost import break_even
from ds4mlx.speculative.drafter import ModelDrafter, ScriptedDrafter
from ds4mlx.speculative.loop import SpeculativeLoop, keep_prefix

SMOKE = dict(
    hidden_size=256,
    num_attention_heads=4,
    head_dim=64,
    partial_rotary_factor=0.5,
    q_lora_rank=64,
    o_groups=2,
    o_lora_rank=64,
    moe_intermediate_size=256,
    index_n_heads=4,
    index_head_dim=32,
    index_topk=8,
)


def prompt_session(model, ids, ctx):
    s = model.new_session(ctx=ctx)
    logits = s.prefill(ids)
    return s, logits


def plain(model, ids, ctx, n):
    s, logits = prompt_session(model, ids, ctx)
    loop = iter(decode_tokens(s, logits, greedy(model.vocab_size)))
    out = [next(loop) for _ in range(4)]  # warm-up (trace)
    t0 = time.perf_counter()
    out += [next(loop) for _ in range(n)]
    return (time.perf_counter() - t0) * 1e3 / n, out


def plain_sync(model, ids, ctx, n):
    """ms per plain step when each step is waited for (host and device time in series)."""
    s, logits = prompt_session(model, ids, ctx)
    tok = int(logits.argmax())
    times = []
    for i in range(n + 2):
        t0 = time.perf_counter()
        out = s.step(tok)
        mx.eval(out, s.cache_arrays())
        tok = int(out.argmax().item())
        if i >= 2:  # the first steps trace / warm up
            times.append(time.perf_counter() - t0)
    return 1e3 * sorted(times)[len(times) // 2]


def verify_cost(model, ids, ctx, k, reps):
    s, _ = prompt_session(model, ids, ctx)
    window = [int(t) % model.vocab_size for t in ids[-(k + 1) :]]
    times, rejects = [], []
    for r in range(reps + 1):
        cp = s.checkpoint()
        t0 = time.perf_counter()
        rows = s.verify(window)
        mx.eval(rows, s.cache_arrays())
        t1 = time.perf_counter()
        keep_prefix(s, cp, window, 1)  # a rejection at the first draft, as the loop takes it
        mx.eval(s.cache_arrays())
        t2 = time.perf_counter()
        s.rollback(cp)
        if r:  # the first call traces / warms up
            times.append(t1 - t0)
            rejects.append(t2 - t1)
    return 1e3 * sorted(times)[len(times) // 2], 1e3 * sorted(rejects)[len(rejects) // 2]


def spec_run(model, ids, ctx, n, drafter, k):
    s, logits = prompt_session(model, ids, ctx)
    loop = SpeculativeLoop(s, logits, drafter, GreedyRule(model.vocab_size), depth=k, margin=0.0, limit=n + 8)
    it = iter(loop)
    for _ in range(k + 1):  # warm-up round
        next(it)
    r0, e0 = loop.stats.rounds, loop.stats.emitted
    t0 = time.perf_counter()
    got = 0
    for _ in range(n):
        next(it)
        got += 1
    dt = time.perf_counter() - t0
    st = loop.stats
    rounds = st.rounds - r0
    return dt * 1e3 / got, (st.emitted - e0) / max(rounds, 1), st.acceptance_rate


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=43)
    p.add_argument("--expert-format", choices=["mlx", "gguf"], default="mlx")
    p.add_argument("--ctx", type=int, default=2048, help="prompt tokens before measuring")
    p.add_argument("--gen", type=int, default=64, help="tokens per decode measurement")
    p.add_argument("--reps", type=int, default=10, help="verify calls per k")
    p.add_argument("--max-k", type=int, default=4)
    p.add_argument("--no-self", action="store_true", help="skip the self-draft runs (each costs 2x decode)")
    p.add_argument(
        "--float-head",
        action="store_true",
        help="the random MTP head's routed experts in the model's float dtype (13 GB at V4 Flash size) "
        "instead of quantized as the target's",
    )
    p.add_argument("--smoke", action="store_true", help="tiny synthetic model (CPU check of the script)")
    p.add_argument("--csv", default="-")
    a = p.parse_args()
    if a.smoke:
        model, _, info = build_synthetic_v4_flash(layers=4, experts=16, overrides=SMOKE)
        a.ctx, a.gen, a.reps = min(a.ctx, 160), min(a.gen, 12), min(a.reps, 2)
    else:
        model, _, info = build_synthetic_v4_flash(layers=a.layers, expert_format=a.expert_format)
    print(f"# {info}", file=sys.stderr, flush=True)
    layers = int(info.get("layers", a.layers))
    ctx = a.ctx + 4 * a.gen + 64
    ids = [(7 * i + 3) % model.vocab_size for i in range(a.ctx)]
    rows = []

    def row(kind, k, ms, tpr="", acc="", speed="", be_free="", be_mtp=""):
        tps = 1e3 / ms if ms else 0.0
        rows.append(f"{kind},{k},{ms:.3f},{tps:.2f},{tpr},{acc},{speed},{be_free},{be_mtp}")
        print("# " + rows[-1], file=sys.stderr, flush=True)

    step_ms, out = plain(model, ids, ctx, a.gen)
    row("step", 0, step_ms)
    sync_ms = plain_sync(model, ids, ctx, a.gen)
    row("step_sync", 0, sync_ms, speed=f"{sync_ms / step_ms:.3f}")
    expected = ids + out

    def fmt(x):
        return "never" if x is None else f"{x:.3f}"

    for k in range(1, a.max_k + 1):
        v_ms, rej_ms = verify_cost(model, ids, ctx, k, a.reps)
        row(
            f"verify_{k}",
            k,
            v_ms,
            speed=f"{v_ms / step_ms:.3f}",
            be_free=fmt(break_even(step_ms, v_ms, 0.0, k)),
            be_mtp=fmt(break_even(step_ms, v_ms, step_ms / layers, k)),
        )
        row(f"verify_vs_sync_{k}", k, v_ms, speed=f"{v_ms / sync_ms:.3f}")
        row(f"reject_{k}", k, rej_ms)
    # a free, always-right draft (the plain run's own greedy tokens); plain output reused:
    # the loop must reproduce it, which it checks as it goes
    oracle = ScriptedDrafter(lambda ctx_ids, kk: expected[len(ctx_ids) : len(ctx_ids) + kk])
    for k in range(1, a.max_k + 1):
        ms, tpr, acc = spec_run(model, ids, ctx, min(a.gen, len(out) - k - 2), oracle, k)
        row(f"oracle_{k}", k, ms, f"{tpr:.2f}", f"{acc:.3f}", f"{step_ms / ms:.3f}")
    if not a.no_self:
        for k in range(1, a.max_k + 1):
            ms, tpr, acc = spec_run(model, ids, ctx, a.gen, ModelDrafter(model, ctx=ctx), k)
            row(f"self_{k}", k, ms, f"{tpr:.2f}", f"{acc:.3f}", f"{step_ms / ms:.3f}")
    try:
        from ds4mlx.speculative.mtp import random_mtp_drafter
    except ImportError:
        random_mtp_drafter = None
    if random_mtp_drafter is not None:
        drafter = random_mtp_drafter(model, ctx, quantized=not a.float_head)
        for k in range(1, a.max_k + 1):
            ms, tpr, acc = spec_run(model, ids, ctx, a.gen, drafter, k)
            row(f"mtp_{k}", k, ms, f"{tpr:.2f}", f"{acc:.3f}", f"{step_ms / ms:.3f}")
    text = "kind,k,ms,tps,tokens_per_round,acceptance,speedup,breakeven_free,breakeven_mtp\n" + "\n".join(rows) + "\n"
    if a.csv == "-":
        sys.stdout.write(text)
    else:
        with open(a.csv, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

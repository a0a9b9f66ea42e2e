"""`ds4mlx bench`: prefill and decode speed at growing context frontiers (as ds4-bench).

Load once; walk one fixed token sequence (the shipped CC0 text, cycled) to the
frontiers ctx_start, ..., ctx_max.  Each row prefills only the interval added
since the previous frontier, then snapshots the session, decodes a fixed greedy
probe that never picks EOS, restores the snapshot and goes on.  One CSV row per
frontier; `--compare` turns the run into a regression gate.
"""

from __future__ import annotations

import csv
import sys
import time
from pathlib import Path

from ..io import dtype_policy
from ..runtime.prefill_chunk import default_chunk
from ..speculative import cli as spec_cli

COLUMNS = ["ctx_tokens", "prefill_tokens", "prefill_tps", "gen_tokens", "gen_tps", "kvcache_bytes", "peak_memory_bytes"]
# with --mtp / --draft-model: the probe's counters, its verify cost per round, and the acceptance
# model (speculative/cost.py) from a plain step and a verify of k + 1 tokens measured at the frontier
SPEC_COLUMNS = [
    "spec_drafted",
    "spec_accepted",
    "spec_acceptance_rate",
    "spec_tokens_per_round",
    "spec_verify_ms",
    "spec_step_ms",
    *(f"spec_verify_ms_k{k}" for k in (1, 2, 3, 4)),
    *(f"spec_breakeven_k{k}" for k in (1, 2, 3, 4)),
]
# with --profile (frontier_profile.py): GPU-busy ms per step ("n/a" where the backend can not
# tell), launches per token (the census), the host's ms per token outside the token reads, % of the roofline
PROFILE_COLUMNS = ["gpu_busy_ms", "launches_per_token", "host_ms_per_token", "roofline_pct"]
GATED = ("prefill_tps", "gen_tps")  # higher is better


def frontiers(start: int, stop: int, step_incr: int | None, step_mul: float | None) -> list[int]:
    if start <= 0 or stop < start:
        raise ValueError("need 0 < --ctx-start <= --ctx-max")
    if step_incr is not None and step_incr <= 0 or step_mul is not None and step_mul <= 1:
        raise ValueError("--step-incr must be > 0 and --step-mul > 1")
    out, f = [], start
    while f < stop:
        out.append(f)
        nxt = f + step_incr if step_incr else int(f * (step_mul or 2.0))
        f = max(nxt, f + 1)
    out.append(stop)
    return out


def bench_tokens(tokenizer, n: int, text_path: str | None = None) -> list[int]:
    """The first n tokens of the benchmark text, cycled as often as needed."""
    path = Path(text_path) if text_path else Path(__file__).resolve().parents[1] / "data" / "bench_text.txt"
    ids = tokenizer.encode(path.read_text(encoding="utf-8"))
    if not ids:
        raise ValueError(f"{path} tokenizes to nothing")
    reps = -(-n // len(ids))
    return (ids * reps)[:n]


PROBE_WARMUP = 2  # untimed decode steps before each probe


def _greedy_probe(
    session,
    first_logits,
    n: int,
    eos_id: int | None,
    warmup: int = PROBE_WARMUP,
    speculation=None,
    stats=None,
    timing: dict | None = None,
) -> float:
    """Decode `warmup` untimed then n timed greedy tokens (EOS masked) through the decode
    loop (decode.py: sampled on the device, read one step behind; with `speculation`, the
    speculative loop, its counters in `stats`); return seconds.  `timing` gets "wait_s":
    the timed tokens' seconds blocked reading a token (the plain loop only)."""
    import mlx.core as mx

    from ..runtime.decode import decode_tokens, greedy

    first = mx.array(first_logits)
    banned = [] if eos_id is None else [eos_id]
    if speculation is not None:
        from ..speculative.acceptance import GreedyRule
        from ..speculative.loop import SpeculativeLoop

        rule = GreedyRule(first.shape[-1], banned)
        plain = None
        loop = iter(SpeculativeLoop(session, first, speculation.drafter, rule, depth=speculation.depth, margin=speculation.margin, stats=stats))  # fmt: skip
    else:
        plain = decode_tokens(session, first, greedy(first.shape[-1], banned))  # keeps `wait_s`
        loop = iter(plain)
    for _ in range(warmup):  # first-use kernel compilation and the bucket's trace stay out of the figure
        next(loop)
    mx.synchronize()
    wait0 = plain.wait_s if plain is not None else 0.0
    t0 = time.perf_counter()
    for _ in range(n):
        next(loop)
    mx.synchronize()
    secs = time.perf_counter() - t0
    if timing is not None and plain is not None:
        timing["wait_s"] = plain.wait_s - wait0
    return secs


def check_ids(model, tokens: list[int]) -> None:
    """Refuse token ids past the model's vocabulary (e.g. a synthetic model with a small
    vocab_size override): an out-of-range embedding row is no error on the CPU but a crash."""
    vocab = getattr(model, "vocab_size", None)
    if vocab is not None and tokens and max(tokens) >= vocab:
        raise ValueError(f"the benchmark text has token id {max(tokens)} >= the model's vocab_size {vocab}")


def warm_up(model, tokens: list[int], chunk: int) -> None:
    """An untimed prefill (a full chunk and a partial one) and a few decode steps on a
    scratch session: MLX's GPU backends compile kernels on first use (seconds each on
    CUDA), which would otherwise land in the first row."""
    import mlx.core as mx

    from ..runtime.decode import decode_tokens, greedy

    scratch = model.new_session(ctx=len(tokens) + 8, chunk=chunk)
    logits = mx.array(scratch.prefill(tokens[: chunk + chunk // 2]))
    loop = iter(decode_tokens(scratch, logits, greedy(logits.shape[-1])))
    for _ in range(3):
        next(loop)
    mx.synchronize()


def run_bench(
    model,
    tokenizer,
    ctx_points: list[int],
    gen_tokens: int,
    chunk: int | None = None,
    text_path: str | None = None,
    log=None,
    time_budget: float | None = None,
    speculation=None,
    profile=None,
) -> list[dict]:
    """One row per frontier.  With `time_budget` (seconds) the walk stops before a
    frontier whose prefill, extrapolated from the last row's speed, would overrun it.
    With `profile` (decode_profile.FrontierProfile) each row gets PROFILE_COLUMNS."""
    import mlx.core as mx

    chunk = chunk or default_chunk()
    tokens = bench_tokens(tokenizer, ctx_points[-1], text_path)
    check_ids(model, tokens)
    # speculation: room for the last round's drafts and the widest measured verify (cost.measure)
    room = 0 if speculation is None else speculation.depth + 2 * 4 + 2
    session = model.new_session(ctx=ctx_points[-1] + gen_tokens + PROBE_WARMUP + 1 + room, chunk=chunk)
    eos = getattr(tokenizer, "eos_id", None)
    warm_up(model, tokens[: 2 * chunk], chunk)  # first-use kernel compilation stays out of every row
    rows, done = [], 0
    mx.reset_peak_memory()
    started = time.perf_counter()
    for frontier in ctx_points:
        part = tokens[done:frontier]
        if time_budget is not None and rows and rows[-1]["prefill_tps"] > 0:
            eta = len(part) / rows[-1]["prefill_tps"] + gen_tokens / max(rows[-1]["gen_tps"], 1e-3)
            if time.perf_counter() - started + eta > time_budget:
                if log:
                    log({"stopped": f"time budget: frontier {frontier} would need ~{eta:.0f} s more"})
                break
        mx.synchronize()
        t0 = time.perf_counter()
        logits = session.prefill(part)
        mx.synchronize()
        pre_s = time.perf_counter() - t0
        done = frontier
        row = {
            "ctx_tokens": frontier,
            "prefill_tokens": len(part),
            "prefill_tps": round(len(part) / pre_s, 2) if pre_s > 0 else 0.0,
            "gen_tokens": gen_tokens,
            "gen_tps": 0.0,
            "kvcache_bytes": session.nbytes,
        }
        if gen_tokens > 0:
            snap = session.snapshot()
            stats, timing = None, {}
            if speculation is not None:
                from ..speculative.options import SpecStats

                stats = SpecStats()
            gen_s = _greedy_probe(session, logits, gen_tokens, eos, speculation=speculation, stats=stats, timing=timing)
            costs = None
            if stats is not None:
                from ..speculative.cost import measure

                costs = measure(session, session.tokens[-1], draft_ms=stats.draft_ms_per_token)
            session.restore(snap)
            row["gen_tps"] = round(gen_tokens / gen_s, 2)
            if profile is not None:

                def probe(n, logits=logits):
                    return _greedy_probe(session, logits, n, eos, warmup=0)

                row.update(profile.columns(session, frontier, gen_tokens, gen_s, timing.get("wait_s"), probe))
                session.restore(snap)
            if stats is not None:
                row.update(spec_drafted=stats.drafted, spec_accepted=stats.accepted)
                row["spec_acceptance_rate"] = round(stats.acceptance_rate, 4)
                row["spec_tokens_per_round"] = round(stats.tokens_per_round, 3)
                row["spec_verify_ms"] = round(stats.verify_ms_per_round, 3)
            if costs is not None:
                row["spec_step_ms"] = round(costs.step_ms, 3)
                for k in sorted(costs.verify_ms):
                    be = costs.break_even(k)
                    row[f"spec_verify_ms_k{k}"] = round(costs.verify_ms[k], 3)
                    row[f"spec_breakeven_k{k}"] = "never" if be is None else round(be, 3)
        row["peak_memory_bytes"] = int(mx.get_peak_memory())
        from ..experts.cli import csv_columns

        row.update(csv_columns(model))  # --stream-experts: the expert cache's counters so far
        rows.append(row)
        if log:
            log(row)
    return rows


def write_csv(rows: list[dict], path) -> None:
    out = open(path, "w", newline="") if path and path != "-" else sys.stdout
    try:
        extra = [k for k in (rows[0] if rows else {}) if k.startswith("expert_")]  # --stream-experts
        spec = any("spec_drafted" in r for r in rows)
        prof = any("roofline_pct" in r for r in rows)
        names = COLUMNS + (SPEC_COLUMNS if spec else []) + (PROFILE_COLUMNS if prof else []) + extra
        w = csv.DictWriter(out, fieldnames=names, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    finally:
        if out is not sys.stdout:
            out.close()


def read_csv(path) -> list[dict]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows or "ctx_tokens" not in rows[0]:
        raise ValueError(f"{path}: not a ds4mlx bench CSV")
    return rows


def compare(rows: list[dict], baseline: list[dict], max_regress_pct: float) -> list[str]:
    """Regressions (one message each) of `rows` against `baseline`, matched by ctx_tokens."""
    base = {int(r["ctx_tokens"]): r for r in baseline}
    problems = []
    for r in rows:
        b = base.get(int(r["ctx_tokens"]))
        if b is None:
            continue
        for col in GATED:
            old, new = float(b[col]), float(r[col])
            if old > 0 and new < old * (1 - max_regress_pct / 100.0):
                problems.append(
                    f"ctx {r['ctx_tokens']}: {col} {new:g} is {100 * (1 - new / old):.1f}% below "
                    f"the baseline {old:g} (allowed {max_regress_pct:g}%)"
                )
    if not any(int(r["ctx_tokens"]) in base for r in rows):
        problems.append("no frontier of this run appears in the baseline")
    return problems


def plot(rows: list[dict], path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ctx = [int(r["ctx_tokens"]) for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(ctx, [float(r["prefill_tps"]) for r in rows], "o-", label="prefill t/s")
    ax.plot(ctx, [float(r["gen_tps"]) for r in rows], "s-", label="decode t/s")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("tokens / second")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def add_arguments(p) -> None:
    p.add_argument("-m", "--model", help="GGUF file or HF folder (default: the demo model)")
    dtype_policy.add_argument(p)
    p.add_argument("--synthetic", choices=["v4-flash"], help="random full-size weights built on the device, no file")
    p.add_argument("--layers", type=int, default=None, help="--synthetic: number of layers (default 43)")
    p.add_argument("--experts", type=int, default=None, help="--synthetic: routed experts (default 256)")
    p.add_argument("--expert-bits", type=int, choices=[2, 4], default=2, help="--synthetic: routed expert bits")
    p.add_argument(
        "--expert-format",
        choices=["mlx", "gguf"],
        default="mlx",
        help="--synthetic: routed experts MLX affine (--expert-bits) or ds4's GGUF IQ2_XXS/Q2_K blocks",
    )
    p.add_argument(
        "--other-bits",
        type=int,
        choices=[4, 8, 16],
        default=8,
        help="--synthetic: bits of the other linears (16 = bf16)",
    )
    p.add_argument("--ctx-start", type=int, default=2048)
    p.add_argument("--ctx-max", type=int, default=8192)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--step-incr", type=int)
    g.add_argument("--step-mul", type=float)
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--chunk", type=int, default=None, help="prefill chunk size (default 2048 on a GPU, 512 on the CPU)")
    p.add_argument("--text", help="benchmark text file (default: the shipped CC0 text)")
    p.add_argument("--csv", default="-", help="CSV output path ('-' = stdout)")
    p.add_argument("--compare", metavar="BASELINE.csv", help="fail when a frontier regresses against this CSV")
    p.add_argument("--max-regress", type=float, default=10.0, metavar="PCT")
    p.add_argument("--plot", metavar="FILE.svg|png")
    p.add_argument("--time-budget", type=float, help="stop before a frontier that would overrun this many seconds")
    p.add_argument(
        "--profile",
        action="store_true",
        help="per frontier: GPU-busy ms per step, launches per token, host ms per token, %% of roofline "
        "(CSV columns); and one decode step timed by op family (at --ctx-start)",
    )
    p.add_argument(
        "--bandwidth-gbps",
        type=float,
        default=None,
        help="--profile: the device's memory bandwidth in GB/s for %% of roofline (default: a table of known cards)",
    )
    p.add_argument(
        "--profile-prefill",
        action="store_true",
        help="also time one prefill chunk by op family (at --ctx-start, for each --profile-chunks size)",
    )
    p.add_argument("--profile-chunks", default="512,2048", help="--profile-prefill: chunk sizes, comma-separated")
    p.add_argument(
        "--synthetic-override",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="--synthetic: one config field changed (e.g. hidden_size=256), repeatable; for CPU smoke runs",
    )
    from ..experts import cli as experts_cli

    experts_cli.add_arguments(p)
    spec_cli.add_arguments(p)  # speculative decoding in the generation probe (greedy)


def _overrides(items: list[str]) -> dict:
    """KEY=JSON pairs -> dict (a bare word that is not JSON stays a string)."""
    import json

    out = {}
    for item in items:
        key, sep, val = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--synthetic-override wants KEY=VALUE, not {item!r}")
        try:
            out[key] = json.loads(val)
        except json.JSONDecodeError:
            out[key] = val
    return out


def _sizes(text: str) -> list[int]:
    sizes = [int(t) for t in text.split(",") if t.strip()]
    if not sizes or min(sizes) <= 0:
        raise ValueError(f"--profile-chunks wants positive sizes, not {text!r}")
    return sizes


def run(args) -> int:
    try:
        points = frontiers(args.ctx_start, args.ctx_max, args.step_incr, args.step_mul)
        baseline = read_csv(args.compare) if args.compare else None
        overrides = _overrides(args.synthetic_override)
        profile_chunks = _sizes(args.profile_chunks)
        if args.bandwidth_gbps is not None and not args.profile:
            raise ValueError("--bandwidth-gbps is read by --profile only")
    except (ValueError, OSError) as e:
        print(f"ds4mlx bench: {e}", file=sys.stderr)
        return 2
    if args.synthetic:
        from .synthetic import build_synthetic_v4_flash

        model, tokenizer, info = build_synthetic_v4_flash(
            layers=args.layers,
            experts=args.experts,
            expert_bits=args.expert_bits,
            other_bits=args.other_bits,
            expert_format=args.expert_format,
            overrides=overrides,
        )
        label = f"synthetic V4 Flash ({info['layers']} layers, experts {info['expert_bits']})"
        model.random_weights = True  # --mtp: a random MTP head to match
        print(f"ds4mlx bench: {label}: {info}", file=sys.stderr)
    else:
        from ..experts import cli as experts_cli
        from ..io.loader import load

        stream = experts_cli.config_from_args(args)
        model, tokenizer = load(
            args.model,
            dtype=getattr(args, "dtype", "auto"),
            stream=stream,
            mtp=spec_cli.mtp_file(args),
            ctx=args.ctx_max + args.gen_tokens,  # the memory verdict (memory_fit.py)
        )
        label = Path(getattr(model, "path", args.model or "demo")).name
    try:
        speculation = spec_cli.spec_config(args, model, ctx=args.ctx_max + args.gen_tokens + 16)
    except spec_cli.SpecUsageError as e:
        print(f"ds4mlx bench: {e}", file=sys.stderr)
        return 2
    import mlx.core as mx

    print(f"ds4mlx bench: {label} on {mx.default_device()}, frontiers {points}", file=sys.stderr)
    profile = None
    if args.profile:
        from .frontier_profile import FrontierProfile

        try:
            profile = FrontierProfile.for_model(model, args.bandwidth_gbps)
        except ValueError as e:
            print(f"ds4mlx bench: {e}", file=sys.stderr)
            return 2
        print(f"ds4mlx bench: profile: {profile.describe()}", file=sys.stderr)
    try:
        check_ids(model, bench_tokens(tokenizer, points[-1], args.text))
    except ValueError as e:
        print(f"ds4mlx bench: {e}", file=sys.stderr)
        return 2
    if args.profile_prefill:  # first: a time-boxed run still gets the profile
        from .prefill_profile import format_prefill_profile, profile_prefill

        for c in profile_chunks:
            toks = bench_tokens(tokenizer, args.ctx_start + 4 * c, args.text)  # + 1 chunk: GPU-busy
            p = profile_prefill(model, toks, args.ctx_start, c, repeats=1)
            print(format_prefill_profile(p), file=sys.stderr, flush=True)
    rows = run_bench(
        model,
        tokenizer,
        points,
        args.gen_tokens,
        chunk=args.chunk,
        text_path=args.text,
        log=lambda r: print("  " + ", ".join(f"{k}={v}" for k, v in r.items()), file=sys.stderr),
        time_budget=args.time_budget,
        speculation=speculation,
        profile=profile,
    )
    write_csv(rows, args.csv)
    if args.profile:
        from .decode_profile import format_profile, profile_decode

        print(format_profile(profile_decode(model, ctx=args.ctx_start)), file=sys.stderr)
    if args.plot:
        plot(rows, args.plot, f"ds4mlx bench: {label} ({mx.default_device()})")
    if baseline is not None:
        problems = compare(rows, baseline, args.max_regress)
        for msg in problems:
            print(f"REGRESSION {msg}", file=sys.stderr)
        if problems:
            return 1
        print(f"ds4mlx bench: no regression beyond {args.max_regress:g}% against {args.compare}", file=sys.stderr)
    return 0

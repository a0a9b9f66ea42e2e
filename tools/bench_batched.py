#!/usr/bin/env python3
"""Session batching in process (no HTTP): an `Engine(slots=N)` over the demo model or
the random full-size V4 Flash (`--synthetic`, built on the device), N closed-loop
streams, the metrics of tools/bench_serve.py (TTFT, ITL, TPOT, E2E p50/p90/p99,
aggregate output t/s) from the engine's own events.  One row per N; a job that does
not end with its full `--output-len` tokens fails the run (exit 1).

    python3 tools/bench_batched.py --slots 1,2,4                       # demo model, CPU
    python3 tools/bench_batched.py --synthetic --slots 1,2,4,8,16 --input-len 512 --output-len 64 \\
        --requests-per-slot 2 --json $OUT/batched.json                 # the H200 table
    DS4MLX_BATCHED_DECODE=0 python3 tools/bench_batched.py ...          # one forward per slot, in turn
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serve import Result, make_prompt, print_table, summarize  # noqa: E402


def load_model(args):
    if args.synthetic:
        from ds4mlx.bench.synthetic import build_synthetic_v4_flash

        model, tokenizer, info = build_synthetic_v4_flash(layers=args.layers)
        print(f"synthetic V4 Flash: {info}", flush=True)
        return model, tokenizer
    from ds4mlx import load

    return load(args.model)


def one_job(engine, prompt: str, args) -> Result:
    from ds4mlx.engine import Job
    from ds4mlx.runtime.events import Finish, TextDelta
    from ds4mlx.runtime.sampling import SamplingParams

    job = Job(
        prompt_text=prompt,
        api="completions",
        raw=True,
        max_tokens=args.output_len,
        ignore_eos=True,
        params=SamplingParams(temperature=0.0),
    )
    res, last = Result(), None
    q: queue.Queue = queue.Queue()
    t0 = time.perf_counter()
    engine.submit(job, q.put)
    while True:
        ev = q.get()
        now = time.perf_counter()
        if isinstance(ev, TextDelta):
            if last is None:
                res.ttft = now - t0
            else:
                res.itl.append(now - last)
            last = now
        elif isinstance(ev, Finish) or type(ev).__name__ == "Failed":
            break
    res.e2e = time.perf_counter() - t0
    if not isinstance(ev, Finish) or ev.reason != "length" or ev.usage.completion_tokens != args.output_len:
        raise RuntimeError(f"incomplete job: {ev}")
    res.tokens, res.prompt_tokens = ev.usage.completion_tokens, ev.usage.prompt_tokens
    return res


def run(engine, slots: int, args) -> tuple[list[Result], float]:
    rng = random.Random(args.seed)
    prompts = [make_prompt(rng, args.input_len, i) for i in range(slots * args.requests_per_slot)]
    for w in range(args.warmup):  # compile the B-row traces outside the measurement
        warm = [make_prompt(rng, 8, 10_000 + w * slots + i) for i in range(slots)]
        _gather(engine, warm, slots, argparse.Namespace(**{**vars(args), "output_len": 4}))
    t0 = time.perf_counter()
    results = _gather(engine, prompts, slots, args)
    return results, time.perf_counter() - t0


def _gather(engine, prompts: list[str], clients: int, args) -> list[Result]:
    todo, out, errors, lock = list(prompts), [], [], threading.Lock()

    def client():
        while True:
            with lock:
                if not todo or errors:
                    return
                p = todo.pop(0)
            try:
                r = one_job(engine, p, args)
            except Exception as e:  # noqa: BLE001 - reported, fails the run
                with lock:
                    errors.append(e)
                return
            with lock:
                out.append(r)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def main(argv=None) -> int:
    from ds4mlx.engine import Engine

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: the demo model)")
    ap.add_argument("--synthetic", action="store_true", help="random full-size V4 Flash built on the device")
    ap.add_argument("--layers", type=int, default=None, help="--synthetic: layers (default 43)")
    ap.add_argument("--slots", default="1,2,4", help="--batched-session values, comma separated")
    ap.add_argument("--requests-per-slot", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=64, help="prompt words (about as many tokens)")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the summaries here")
    args = ap.parse_args(argv)
    model, tokenizer = load_model(args)
    rows = []
    mode = "batched" if os.environ.get("DS4MLX_BATCHED_DECODE", "1") != "0" else "per-slot"
    for slots in [int(x) for x in args.slots.split(",") if x]:
        engine = Engine(model, tokenizer, ctx=args.ctx, slots=slots)
        try:
            results, duration = run(engine, slots, args)
            s = summarize(results, duration)
            s["shared_steps"] = engine.stats.shared_steps
            rows.append((f"{mode} N={slots}", s))
            print_table(rows[-1:])
            sys.stdout.flush()
            if args.json:  # after every row: a time-boxed run keeps what it measured
                with open(args.json, "w") as f:
                    json.dump([{"run": n, **r} for n, r in rows], f, indent=1)
        except RuntimeError as e:
            print(f"N={slots}: {e}", file=sys.stderr)
            return 1
        finally:
            engine.close()
    print_table(rows)
    print_decode_scaling(rows)
    return 0


def print_decode_scaling(rows: list) -> None:
    """Aggregate decode t/s = N / ITL p50 per row and against the N = 1 row: the session-batching
    bar (N = 8 >= 4x N = 1) read without the prefills, which run one after another."""
    base = None
    print("\n| run | aggregate decode t/s | vs N = 1 |\n|---|---:|---:|")
    for name, s in rows:
        n, itl = int(name.rsplit("=", 1)[1]), s["itl_ms"]["p50"]
        tps = n * 1000.0 / itl if itl else 0.0
        base = tps if n == 1 and base is None else base
        print(f"| {name} | {tps:.1f} | {tps / base:.2f} |" if base else f"| {name} | {tps:.1f} | - |")


if __name__ == "__main__":
    sys.exit(main())

"""The per-token cost of structured output: decode tokens per second with and without a
JSON schema, one process, the engine in process (a `Job` as the HTTP adapters build it).

    python tools/structured_cost.py                      # the CPU demo model
    python tools/structured_cost.py --model PATH --jobs 8
    python tools/structured_cost.py --layers 20          # the synthetic V4 Flash (a GPU)

Each row sums several sampled jobs (temperature 1, a seed per job, the two kinds in turn)
over the same prompt: `free` (no grammar) and `json_schema` (a nested schema of about 45
answer tokens: the host computes llguidance's mask while the device runs the step and the
device applies it, docs/http-api.md §10.7); both run the lookahead decode loop.  t/s counts the tokens after
the first of each job over the time from its first text delta to its last.  The mask row
is the host's time in `Constraint.mask` per token (median, p90, and its share of a
constrained step).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

from serve_vs_bench import timed_job

from ds4mlx import load
from ds4mlx.engine import Engine, Job
from ds4mlx.runtime.sampling import SamplingParams
from ds4mlx.runtime.structured import Constraint, Grammar

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from test_structured_output import SCHEMA  # noqa: E402  the acceptance test's nested schema


def run_job(engine, prompt: str, seed: int, gen: int, grammar) -> tuple[float, int]:
    """(seconds from the first to the last text delta, tokens generated)."""
    job = Job(
        prompt_text=prompt,
        api="completions",
        raw=True,
        max_tokens=gen,
        params=SamplingParams(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=seed),
        grammar=grammar,
    )
    return timed_job(engine, job)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="demo", help="a model path or `demo` (the random-weight CPU demo)")
    p.add_argument("--jobs", type=int, default=6, help="sampled jobs per row")
    p.add_argument("--gen", type=int, default=64, help="max tokens per job")
    p.add_argument("--layers", type=int, default=0, help="the synthetic V4 Flash at this depth instead of --model")
    a = p.parse_args()
    if a.layers:
        from ds4mlx.bench.synthetic import build_synthetic_v4_flash

        model, tok, info = build_synthetic_v4_flash(layers=a.layers, expert_format="mlx")
        print(f"# {info}", flush=True)
        a.model = f"v4-flash-{a.layers}L"
    else:
        model, tok = load(a.model)
    engine = Engine(model, tok, ctx=1024, default_max_tokens=a.gen)
    prompt = "Describe a pet as JSON: "
    mask_s: list[float] = []
    real_mask = Constraint.mask

    def timed_mask(self):
        t = time.perf_counter()
        out = real_mask(self)
        mask_s.append(time.perf_counter() - t)
        return out

    try:
        run_job(engine, prompt, 0, 4, None)  # untimed: the session's traces
        run_job(engine, prompt, 0, 4, Grammar("json_schema", SCHEMA))  # and llguidance's tokenizer
        kinds = {"free": None, "json_schema": Grammar("json_schema", SCHEMA)}
        secs, tokens = dict.fromkeys(kinds, 0.0), dict.fromkeys(kinds, 0)
        with mock.patch.object(Constraint, "mask", timed_mask):
            for seed in range(1, a.jobs + 1):  # the two kinds in turn: a load that drifts hits both
                for name, grammar in kinds.items():
                    s, n = run_job(engine, prompt, seed, a.gen, grammar)
                    secs[name], tokens[name] = secs[name] + s, tokens[name] + max(n - 1, 0)
        rows = {name: tokens[name] / secs[name] if secs[name] else 0.0 for name in kinds}
        for name in kinds:
            print(f"{name},{a.model},tps={rows[name]:.2f},tokens={tokens[name]},jobs={a.jobs}", flush=True)
        step_ms = 1e3 / rows["json_schema"] if rows["json_schema"] else 0.0
        ms = sorted(1e3 * s for s in mask_s[1:])  # the first mask of the first job builds llguidance's caches
        med, p90 = statistics.median(ms), ms[int(0.9 * (len(ms) - 1))]
        print(
            f"mask,{a.model},median_ms={med:.3f},p90_ms={p90:.3f},masks={len(ms)},"
            f"share_of_step={med / step_ms:.1%},slowdown={1 - rows['json_schema'] / rows['free']:.1%}",
            flush=True,
        )
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

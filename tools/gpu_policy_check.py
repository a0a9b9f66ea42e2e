"""The GPU weight policy at V4 Flash shapes (docs/numerics.md): the compiled decode step against
the model's own full forward on a synthetic V4 Flash, float32 activations, the tokens crossing the
window and the compression boundaries.  Prints max / mean |dlogit| and greedy agreement.

The reference forward runs every prefill product in float32 (`DS4MLX_PREFILL_EXPERTS=gather_qmm`,
`DS4MLX_PREFILL_LINEARS=quantized_matmul`): a GPU's fast prefill rounds the routed experts' and the
dense linears' operands to float16 for the tensor cores (docs/numerics.md §5), which is a prefill
figure, printed on its own line, not the decode step's error.

    python3 tools/gpu_policy_check.py --layers 4 --tokens 300      # tools/device.sh numerics
"""

from __future__ import annotations

import argparse
import os
import time

import mlx.core as mx
import numpy as np

from ds4mlx.bench.synthetic import build_synthetic_v4_flash
from ds4mlx.models import prefill_experts
from ds4mlx.models.layers import set_activation_dtype

FLOAT32_PREFILL = {prefill_experts.ENV: "gather_qmm", prefill_experts.LINEARS_ENV: "quantized_matmul"}


def full_forward(model, ids, env: dict) -> np.ndarray:
    """The model's one-shot logits with `env` set for the call (the prefill paths read it per call)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return np.asarray(model.logits(ids), np.float32)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def compare(name: str, got: np.ndarray, ref: np.ndarray) -> float:
    d = np.abs(got - ref)
    agree = float((got.argmax(-1) == ref.argmax(-1)).mean())
    print(f"{name}: max |dlogit| {d.max():.3g}, mean {d.mean():.3g}, |logit| max {np.abs(ref).max():.3g}, "
          f"greedy agreement {agree:.4f}", flush=True)
    return float(d.max())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=300)
    p.add_argument("--prefill", type=int, default=8, help="tokens prefilled before the decode steps")
    a = p.parse_args()
    t0 = time.time()
    model, _, info = build_synthetic_v4_flash(layers=a.layers)
    set_activation_dtype(model.model, mx.float32)  # the --dtype auto policy (the loader's cast point)
    print(f"# built in {time.time() - t0:.0f} s: {info}", flush=True)
    ids = np.random.default_rng(0).integers(0, model.vocab_size, a.tokens).tolist()
    ref = full_forward(model, ids, FLOAT32_PREFILL)
    fast = full_forward(model, ids, {})
    s = model.new_session(ctx=a.tokens + 8)
    s.prefill(ids[: a.prefill])
    dec = np.stack([s.decode(t) for t in ids[a.prefill :]])
    worst = compare(f"layers={a.layers} tokens={a.tokens}: decode vs float32 full forward", dec, ref[a.prefill :])
    compare("  (prefill) default full forward vs float32 full forward", fast, ref)
    return 0 if worst <= 1e-3 else 1


if __name__ == "__main__":
    raise SystemExit(main())

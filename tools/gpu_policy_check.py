"""The GPU weight policy at V4 Flash shapes (docs/numerics.md): the compiled decode step against
the model's own full forward on a synthetic V4 Flash, float32 activations, the tokens crossing the
window and the compression boundaries.  Prints max / mean |dlogit| and greedy agreement.

    python3 tools/gpu_policy_check.py --layers 4 --tokens 300      # tools/device.sh numerics
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
import numpy as np

from ds4mlx.bench.synthetic import build_synthetic_v4_flash
from ds4mlx.models.layers import set_activation_dtype


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
    full = np.asarray(model.logits(ids), np.float32)
    s = model.new_session(ctx=a.tokens + 8)
    s.prefill(ids[: a.prefill])
    dec = np.stack([s.decode(t) for t in ids[a.prefill :]])
    d = np.abs(dec - full[a.prefill :])
    agree = float((dec.argmax(-1) == full[a.prefill :].argmax(-1)).mean())
    print(
        f"layers={a.layers} tokens={a.tokens}: decode vs full forward max |dlogit| {d.max():.3g}, "
        f"mean {d.mean():.3g}, |logit| max {np.abs(full).max():.3g}, greedy agreement {agree:.4f}"
    )
    return 0 if d.max() <= 1e-3 else 1


if __name__ == "__main__":
    raise SystemExit(main())

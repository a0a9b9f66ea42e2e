"""Time the Qwen3-VL vision tower at full size (random weights) per image size.

    python3 tools/vision_bench.py [--dtype float32|bfloat16] [--repeat 5] [--out FILE.json]

The tower is the Qwen3-VL-8B vision config (27 blocks, hidden 1152, 16 heads, patch 16,
2x2 merge, deepstack at 8/16/24) projecting to 4096.  For 64, 256 and 1024 image tokens
(256, 1024 and 4096 patches) it prints the first call and the median of the next ones
(ms), and the patch rate; preprocessing (Pillow resize + patching) is timed apart.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx
import numpy as np
from PIL import Image

from ds4mlx.models import vision_preprocess as vp
from ds4mlx.models.vision_qwen3vl import Qwen3VLVision, VisionArgs

FULL = VisionArgs(
    depth=27,
    hidden_size=1152,
    intermediate_size=4304,
    num_heads=16,
    out_hidden_size=4096,
    num_position_embeddings=2304,
    deepstack_visual_indexes=[8, 16, 24],
)
SIZES = {64: (256, 256), 256: (512, 512), 1024: (1024, 1024)}  # tokens -> image (w, h) px


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--depth", type=int, default=FULL.depth, help="fewer blocks for a smoke run")
    ap.add_argument("--out")
    args = ap.parse_args()
    dtype = getattr(mx, args.dtype)
    mx.random.seed(0)
    cfg = VisionArgs(**{**FULL.__dict__, "depth": args.depth})
    cfg.deepstack_visual_indexes = [i for i in FULL.deepstack_visual_indexes if i < args.depth]
    tower = Qwen3VLVision(cfg)
    tower.set_dtype(dtype)
    mx.eval(tower.parameters())
    rng = np.random.default_rng(0)
    rows = []
    for tokens, (w, h) in SIZES.items():
        im = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        t0 = time.perf_counter()
        p = vp.preprocess(im)
        pre_ms = (time.perf_counter() - t0) * 1e3
        x = mx.array(p.pixels)
        times = []
        for _ in range(args.repeat + 1):
            t0 = time.perf_counter()
            mx.eval(tower(x, [p.grid]).embeddings)
            times.append((time.perf_counter() - t0) * 1e3)
        n = p.pixels.shape[0]
        med = statistics.median(times[1:])
        row = {
            "tokens": tower.tokens_for(p.grid),
            "patches": n,
            "image": f"{w}x{h}",
            "preprocess_ms": round(pre_ms, 2),
            "first_ms": round(times[0], 2),
            "median_ms": round(med, 2),
            "patches_per_s": round(n / med * 1e3),
        }
        assert row["tokens"] == tokens, row
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": str(mx.default_device()), "dtype": args.dtype, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

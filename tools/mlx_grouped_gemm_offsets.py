"""Does MLX's own sorted gather_mm read the right expert of a bank past 2^31 bytes? (CUDA)

MLX CUDA runs `mx.gather_mm(x, w, rhs_indices=ids, sorted_indices=True)` with one row per
pair as a grouped GEMM whose per-expert pointers are `expert * itemsize * rows * cols` in
32-bit int (mlx/backend/cuda/gemms/grouped_gemm_unaligned.cu, prepare_grouped_mm_data).
This script calls MLX directly (not ds4mlx's split, models/layers.SwitchLinear) on a bank of
V4 Flash's MTP gate_up shape and compares every pair with the unsorted call (gather_mv,
64-bit offsets), per range of experts.  Expected while the bug stands: experts below 64
equal, the rest wrong or an illegal memory access.  Exit 0 when every expert matches (MLX
fixed: the split in SwitchLinear can go), 1 otherwise.

    python tools/mlx_grouped_gemm_offsets.py [--experts 256 --rows 4096 --cols 4096 --pairs 768]
"""

from __future__ import annotations

import argparse

import mlx.core as mx
import numpy as np

from ds4mlx.io.quant import expert_spans


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--rows", type=int, default=4096, help="output rows per expert")
    p.add_argument("--cols", type=int, default=4096, help="input columns (K)")
    p.add_argument("--pairs", type=int, default=768, help="(token, expert) pairs, sorted by expert")
    p.add_argument("--dtype", default="bfloat16", help="the bank's dtype (float32 on the CPU: its only one)")
    a = p.parse_args()
    e, n, k, dt = a.experts, a.rows, a.cols, getattr(mx, a.dtype)
    parts = []  # drawn a span at a time (a whole-bank draw fails to launch)
    for i, (_, c) in enumerate(expert_spans(e)):
        parts.append((0.02 * mx.random.normal((c, n, k), key=mx.random.key(i))).astype(dt))
        mx.eval(parts[-1])
    w = mx.concatenate(parts).swapaxes(-1, -2)  # [E, K, N], as SwitchLinear passes it
    ids = mx.array(np.sort(np.arange(a.pairs) % e).astype(np.uint32))
    x = mx.random.normal((a.pairs, 1, k), key=mx.random.key(99)).astype(dt)
    gib = e * n * k * dt.size / 2**30
    print(f"bank {e} x {n} x {k} {a.dtype} = {gib:.1f} GiB; {a.pairs} sorted pairs; mlx {mx.__version__}")
    want = np.array(mx.gather_mm(x, w, rhs_indices=ids).astype(mx.float32))[:, 0]  # gather_mv: 64-bit offsets
    got = np.array(mx.gather_mm(x, w, rhs_indices=ids, sorted_indices=True).astype(mx.float32))[:, 0]
    err = np.abs(got - want).max(axis=-1) / (np.abs(want).max(axis=-1) + 1e-6)
    ids_np = np.array(ids)
    bad = False
    for lo in range(0, e, 32):
        sel = (ids_np >= lo) & (ids_np < lo + 32)
        worst = float(err[sel].max()) if sel.any() else 0.0
        bad |= worst > 3e-2
        print(f"experts {lo:3d}..{lo + 31:3d}: max relative error {worst:.2e}{'  WRONG' if worst > 3e-2 else ''}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())

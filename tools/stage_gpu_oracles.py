"""Build the tiny oracle models the GPU tests load and pack them for the device calls.

    .venv/bin/python tools/stage_gpu_oracles.py      # ~1.5 min on the 2-core box

The device image has torch and transformers, but building there costs device minutes; so they are
built here (tests/conftest.build_oracle, the cache the tests use, under .gpu/tc) and the first ones
that fit TAR_MIB are packed as .gpu/tcA/tc.tar, which call 1 carries beside the first wheel half
(64 MiB a call, with the tree and a carried .ptxcache/ptx.txz: the second half leaves no room for more);
the tests build the rest on the device.  `tools/device.sh gpu-tests` unpacks it into /root/tc (docs/device.md).  The
list, most used first: every (script, config) that a `gpu`-marked test passes to `oracle` /
`load_case` (grep them in tests/test_kernel_*.py, test_grouped_experts.py, test_quant*.py when a
GPU test adds one).
"""

from __future__ import annotations

import os
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TAR_MIB = 5.5  # .gpu/a (44 MiB) + the tree (~8 MiB) + a carried .ptxcache (~4.5 MiB) + this <= 64 MiB
GPU_TEST_ORACLES = [
    ("make_tiny_deepseek_v4.py", None),
    ("make_tiny_deepseek_v4.py", "long"),
    ("make_tiny_deepseek_v4.py", "odd"),
    ("probe_mlx_deepseek_v41.py", "mixed"),
    ("make_tiny_glm_moe_dsa.py", None),
    ("make_tiny_glm_moe_dsa.py", "alt"),
    ("make_tiny_glm5_next.py", None),
    ("make_tiny_glm5_next.py", "long"),
    ("make_tiny_qwen4_exp.py", "long"),
]


def main() -> int:
    cache = ROOT / ".gpu" / "tc"
    os.environ["DS4MLX_TEST_CACHE"] = str(cache)
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import build_oracle

    folders = [build_oracle(script, config) for script, config in GPU_TEST_ORACLES]
    out = ROOT / ".gpu" / "tcA" / "tc.tar"
    out.parent.mkdir(parents=True, exist_ok=True)
    packed, size = [], 0
    for folder in folders:
        folder_bytes = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        if size + folder_bytes > TAR_MIB * 2**20:
            break
        packed.append(folder)
        size += folder_bytes
    with tarfile.open(out, "w") as tar:
        for folder in packed:
            tar.add(folder, arcname=f"oracle/{folder.name}")
    print(f"{out.relative_to(ROOT)}: {len(packed)} of {len(folders)} models, {out.stat().st_size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Build the tiny oracle models the GPU tests load and pack them for the device calls.

    .venv/bin/python tools/stage_gpu_oracles.py      # ~1.5 min on the 2-core box

The device image has torch and transformers, but building there costs device minutes; so they are
built here (tests/conftest.build_oracle, the cache the tests use, under .gpu/tc) and packed as two
tars, .gpu/tcA/tc.tar and .gpu/tcB/tc.tar (~15 MB in all), small enough that call 1 carries tcA
beside the first wheel half and call 2 carries tcB beside the second (64 MiB a call).
tools/h200_gpu_tests.sh unpacks both into /root/tc.  The list: every (script, config) that a
`gpu`-marked test passes to `oracle` / `load_case` (grep them in tests/test_kernel_*.py,
test_grouped_experts.py, test_quant*.py when a GPU test adds one).
"""

from __future__ import annotations

import os
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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
    half = (len(folders) + 1) // 2
    for name, part in (("tcA", folders[:half]), ("tcB", folders[half:])):
        out = ROOT / ".gpu" / name / "tc.tar"
        out.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(out, "w") as tar:
            for folder in part:
                tar.add(folder, arcname=f"oracle/{folder.name}")
        print(f"{out.relative_to(ROOT)}: {len(part)} models, {out.stat().st_size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A folder written by transformers' own `save_pretrained` loads and matches
the oracle's logits, for each family with a transformers oracle.

`save_pretrained` (transformers 5.23) writes its checkpoint names, not the
in-memory state-dict names the oracle's model.safetensors holds: DeepSeek V4
hub-style names under `model.` (`model.layers.N.attn.norm.weight`,
`ffn.experts.N.w1.weight`), per-expert tensors for GLM 5.3 and Qwen4-Exp,
GLM 5.3's split conv1d and un-nested forget gate, Qwen4-Exp's sharded n-gram
embedding."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from lazy_modules import requires

needs = requires("torch", "transformers")

TESTS = Path(__file__).parent

CASES = [  # (oracle script, config, a tensor name only the checkpoint form has)
    ("make_tiny_deepseek_v4.py", None, "model.layers.0.ffn.experts.0.w1.weight"),
    ("make_tiny_deepseek_v4.py", "odd", "model.layers.0.attn.norm.weight"),
    ("make_tiny_glm_moe_dsa.py", None, "model.layers.1.mlp.experts.0.gate_proj.weight"),
    ("make_tiny_glm5_next.py", None, "model.layers.0.self_attn.q_conv1d.weight"),
    ("make_tiny_qwen4_exp.py", None, "model.layers.0.mlp.experts.0.up_proj.weight"),
]


# end to end (servers, several processes or models, whole files): the slow tier, which CI runs second
pytestmark = pytest.mark.slow


def save_pretrained_copy(script: str, oracle_dir: Path, out: Path) -> Path:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(TESTS / "save_pretrained_copy.py"), script, str(oracle_dir), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.parametrize("script,config,checkpoint_name", CASES)
def test_save_pretrained_folder_matches_the_oracle(oracle, tmp_path, script, config, checkpoint_name):
    from safetensors import safe_open

    import ds4mlx

    folder = oracle(script, config)
    saved = save_pretrained_copy(script, folder, tmp_path / "saved")
    names = set()
    for f in saved.glob("*.safetensors"):
        with safe_open(str(f), "np") as st:
            names.update(st.keys())
    assert checkpoint_name in names, sorted(names)[:20]  # really the checkpoint form, not the in-memory one
    ref = np.load(folder / "reference.npz")
    lm, _ = ds4mlx.load(saved)
    got = lm.logits(ref["input_ids"][0].tolist())
    assert np.abs(got - ref["logits_full"][0]).max() < 1e-4

"""Write an oracle's model the way a user of transformers has it on disk:
`python save_pretrained_copy.py SCRIPT ORACLE_DIR OUT_DIR` rebuilds the oracle's
model class from its config.json + model.safetensors (transformers' in-memory
names) and calls `save_pretrained(OUT_DIR)`, which writes transformers' own
checkpoint names (its reverse weight conversion: hub-style names, per-expert
tensors).  Kept out of tests/oracle/ so that it does not enter the oracle cache keys."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

ORACLE = Path(__file__).parent / "oracle"
# oracle script -> (module, class) of its causal LM
CLASSES = {
    "make_tiny_deepseek_v4.py": ("transformers", "DeepseekV4ForCausalLM"),
    "make_tiny_glm_moe_dsa.py": ("transformers", "GlmMoeDsaForCausalLM"),
    "make_tiny_qwen4_exp.py": ("transformers", "Qwen4ExpForCausalLM"),
    "make_tiny_glm5_next.py": ("make_tiny_glm5_next", "Glm5NextTextForCausalLM"),
}


def main(script: str, oracle_dir: str, out_dir: str) -> None:
    sys.path.insert(0, str(ORACLE))
    module, name = CLASSES[script]
    cls = getattr(importlib.import_module(module), name)
    config = cls.config_class.from_pretrained(oracle_dir)
    torch.manual_seed(0)
    model = cls(config)
    state = load_file(str(Path(oracle_dir) / "model.safetensors"))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise SystemExit(f"state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.save_pretrained(out_dir)


if __name__ == "__main__":
    main(*sys.argv[1:4])

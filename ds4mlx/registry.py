"""The model families ds4mlx serves, in one table that every stage picking by family reads:
the model graph (models/base.py), the chat protocol (chat/protocol.py), the GGUF names
(gguf_families/: one `Family` table per family keyed like this one, DeepSeek V4's included),
the demo models (demo.py), the MTP heads (speculative/mtp.py), the distributed plans
(distributed/sharding.py) and the checkpoint renames (checkpoint_names.py).

Modules are named, not imported: this table imports nothing of ds4mlx, so any stage can read
it without pulling in the others.  A new family is one row here plus its modules.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelFamily:
    key: str
    # config `model_type` values this family serves (the first is its own; `*_text` is the
    # text model of a multimodal config, built by models/<model_type>.py too)
    model_types: tuple[str, ...]
    # the module that registers the family's ChatProtocol
    chat_module: str
    # the demo model's format: "gguf" (written with ds4's names) or "hf" (a Hugging Face folder
    # built from the model module's DEMO_CONFIG)
    demo_format: str
    # the module of the family's MTP head (`--mtp`) and its name in messages; "" = none
    mtp_head: str = ""
    mtp_label: str = ""
    # the module with the family's `--distributed` plans (shard_args, shard_weights, install); "" = none
    distributed_plan: str = ""
    # transformers' `save_pretrained` names -> its in-memory names (checkpoint_names.py):
    # (regex, replacement) renames, and concatenations (regex with `base` and `part` groups,
    # the parts in order or None for numeric order, the target name, the axis)
    checkpoint_renames: tuple = ()
    checkpoint_concats: tuple = ()

    def model_module(self, model_type: str | None = None) -> str:
        """The module of `model_type` (default: the family's own) that defines ModelArgs and Model."""
        return f"ds4mlx.models.{model_type or self.model_types[0]}"


_HC = ((r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),)
_FORGET_GATE = (
    (r"\.self_attn\.(f_a_proj|f_b_proj)\.", r".self_attn.forget_gate.\1."),
    (r"\.self_attn\.(dt_bias|A_log)$", r".self_attn.forget_gate.\1"),
)

FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily(
        "deepseek_v4",
        ("deepseek_v4",),
        "ds4mlx.chat.families.deepseek_v4.protocol",
        "gguf",
        mtp_head="ds4mlx.models.deepseek_v4_mtp",
        mtp_label="V4",
        distributed_plan="ds4mlx.distributed.deepseek_v4",
    ),
    ModelFamily("deepseek_v41", ("deepseek_v41",), "ds4mlx.chat.families.deepseek_v41", "hf"),
    ModelFamily(
        "glm_moe_dsa",
        ("glm_moe_dsa",),
        "ds4mlx.chat.families.glm",
        "hf",
        mtp_head="ds4mlx.models.glm_moe_dsa_mtp",
        mtp_label="GLM 5.x",
    ),
    ModelFamily(
        "glm5_next",
        ("glm5_next", "glm5_next_text"),
        "ds4mlx.chat.families.glm",
        "hf",
        checkpoint_renames=_FORGET_GATE + _HC,
        checkpoint_concats=(
            (r"^(?P<base>.+\.self_attn)\.(?P<part>[qkv])_conv1d\.weight$", ("q", "k", "v"), "{base}.conv1d.weight", 0),
        ),
    ),
    ModelFamily(
        "qwen4_exp",
        ("qwen4_exp", "qwen4_exp_text"),
        "ds4mlx.chat.families.qwen",
        "hf",
        mtp_head="ds4mlx.models.qwen4_exp_mtp",
        mtp_label="Qwen4Exp",
        checkpoint_concats=(
            (r"^(?P<base>.+\.ngram_embedding)\.shard_(?P<part>\d+)\.weight$", None, "{base}.weight", 0),
        ),
    ),
)
DEFAULT_FAMILY = "deepseek_v4"

BY_KEY = {f.key: f for f in FAMILIES}
BY_MODEL_TYPE = {t: f for f in FAMILIES for t in f.model_types}


def family(key: str) -> ModelFamily:
    """The family of a registry key (ValueError naming the known ones otherwise)."""
    fam = BY_KEY.get(key)
    if fam is None:
        raise ValueError(f"unknown model family {key!r} (known: {', '.join(BY_KEY)})")
    return fam


def family_of(model_type: str | None) -> ModelFamily | None:
    """The family serving a config `model_type` (None: not one of ours)."""
    return BY_MODEL_TYPE.get(model_type) if model_type else None


def family_module(model_type: str):
    """The module `ds4mlx.models.<model_type>` that defines ModelArgs and Model, for a
    `model_type` of the family registry (ValueError naming the known ones otherwise).
    Imported by name at run time, so the registry depends on no model module."""
    import importlib

    fam = family_of(model_type)
    if fam is None:
        raise ValueError(f"unknown model_type {model_type!r} (known: {', '.join(BY_MODEL_TYPE)})")
    return importlib.import_module(fam.model_module(model_type))

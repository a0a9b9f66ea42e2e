"""`model_type: qwen4_exp_text` (the text config of Qwen3.8 Flash Next): see qwen4_exp."""

from .qwen4_exp import DEMO_CONFIG, AttentionCache, LinearCache, Model, ModelArgs  # noqa: F401

"""`model_type: glm5_next_text` (transformers' Glm5NextTextConfig) is GLM 5.3 Flash's text
model: the same graph as models/glm5_next.py, re-exported so `family_module` finds it."""

from .glm5_next import DEMO_CONFIG, Model, ModelArgs  # noqa: F401

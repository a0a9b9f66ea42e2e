"""Oracle for the Qwen3-VL vision tower: a tiny random transformers `Qwen3VLVisionModel`.

Writes to OUTDIR:
  config.json        the vision config
  model.safetensors  `model.state_dict()` float32 (constant parameters perturbed)
  reference.npz      image_<i>        uint8 [H, W, 3]  the source images (odd sizes)
                     pixel_values     float32 [N, C*T*P*P]  transformers' PIL image processor
                     grid_thw         int64 [n, 3]
                     pooler_output    float32 [tokens, out]  the merged, projected tokens
                     last_hidden      float32 [N, hidden]
                     deepstack_<j>    float32 [tokens, out]
                     single_pooler    float32  image 0 alone (no cross-image mask involved)
  summary.json       shapes and a float64 rerun difference

Float32, CPU, eager attention, torch.manual_seed(0).
"""

import json
import os
import sys

import numpy as np
import torch
from safetensors.torch import save_file
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel
from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpVisionConfig
from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpVisionModel

sys.path.insert(0, os.path.dirname(__file__))
from oracle_common import perturb_constant_params  # noqa: E402

CONFIG = dict(
    depth=3,
    hidden_size=32,
    hidden_act="gelu_pytorch_tanh",
    intermediate_size=48,
    num_heads=2,
    in_channels=3,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    out_hidden_size=24,
    num_position_embeddings=36,  # a 6 x 6 learned grid, resampled to every image's grid
    deepstack_visual_indexes=[0, 2],
    initializer_range=0.2,
)
# token budget of the oracle's processor: small, so the images stay tiny (64..1024 in use)
MIN_TOKENS, MAX_TOKENS = 4, 40
# `--config qwen4_exp`: the Qwen3.8 family's tower (no deepstack), exact-gelu MLP, another rope theta
CONFIGS = {"qwen4_exp": dict(hidden_act="gelu", rope_parameters={"rope_type": "axial", "rope_theta": 500.0})}
IMAGE_SIZES = [(70, 100), (150, 47), (64, 64)]  # (H, W): downscaled, upscaled, exact


def processor() -> Qwen2VLImageProcessorPil:
    f = CONFIG["patch_size"] * CONFIG["spatial_merge_size"]
    return Qwen2VLImageProcessorPil(
        patch_size=CONFIG["patch_size"],
        merge_size=CONFIG["spatial_merge_size"],
        temporal_patch_size=CONFIG["temporal_patch_size"],
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        min_pixels=MIN_TOKENS * f * f,
        max_pixels=MAX_TOKENS * f * f,
    )


def main(outdir: str, name: str | None = None) -> None:
    os.makedirs(outdir, exist_ok=True)
    torch.manual_seed(0)
    if name is None:
        config = Qwen3VLVisionConfig(**CONFIG)
        build = Qwen3VLVisionModel
    else:
        cfg = {k: v for k, v in CONFIG.items() if k != "deepstack_visual_indexes"}
        config = Qwen4ExpVisionConfig(**{**cfg, **CONFIGS[name]})
        build = Qwen4ExpVisionModel
    config._attn_implementation = "eager"
    model = build(config).eval()
    perturb_constant_params(model)
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in IMAGE_SIZES]
    feats = processor()(images=images, return_tensors="np")
    pixels = torch.from_numpy(np.asarray(feats["pixel_values"], np.float32))
    grid = torch.from_numpy(np.asarray(feats["image_grid_thw"], np.int64))
    with torch.no_grad():
        out = model(pixels, grid_thw=grid)
        n0 = int(grid[0].prod())
        single = model(pixels[:n0], grid_thw=grid[:1])
        out64 = model.double()(pixels.double(), grid_thw=grid)
    ref = {f"image_{i}": im for i, im in enumerate(images)}
    ref.update(
        pixel_values=pixels.numpy(),
        grid_thw=grid.numpy(),
        pooler_output=out.pooler_output.numpy(),
        last_hidden=out.last_hidden_state.numpy(),
        single_pooler=single.pooler_output.numpy(),
    )
    for j, d in enumerate(getattr(out, "deepstack_features", None) or []):
        ref[f"deepstack_{j}"] = d.numpy()
    np.savez(os.path.join(outdir, "reference.npz"), **ref)
    model.float()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, os.path.join(outdir, "model.safetensors"))
    with open(os.path.join(outdir, "config.json"), "w") as f:
        json.dump(config.to_dict(), f, indent=1, default=str)
    summary = {
        "grid_thw": grid.tolist(),
        "tokens": int(out.pooler_output.shape[0]),
        "float64_diff": float((out64.pooler_output - out.pooler_output.double()).abs().max()),
        "min_tokens": MIN_TOKENS,
        "max_tokens": MAX_TOKENS,
    }
    with open(os.path.join(outdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0], args[args.index("--config") + 1] if "--config" in args else None)

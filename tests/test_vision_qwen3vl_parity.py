"""The Qwen3-VL vision tower (ds4mlx/models/vision_qwen3vl.py) and its preprocessing
(vision_preprocess.py) against transformers (tests/oracle/make_tiny_qwen3vl_vision.py):
three odd-sized images through transformers' PIL image processor and a tiny random
`Qwen3VLVisionModel` (3 blocks, deepstack on two of them, a 6x6 learned position grid
resampled to 4x6, 10x2 and 4x4 patch grids), and the Qwen3.8 family's
`Qwen4ExpVisionModel` (no deepstack, exact gelu, rope theta 500), float32."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

from ds4mlx.models import vision_preprocess as vp
from ds4mlx.models.vision_qwen3vl import Qwen3VLVision, VisionArgs, load_hf_dir

TOL = 1e-4
SCRIPT = "make_tiny_qwen3vl_vision.py"


@pytest.fixture(scope="module", params=[None, "qwen4_exp"], ids=lambda c: c or "qwen3_vl")
def case(request, oracle):
    folder = oracle(SCRIPT, request.param)
    ref = dict(np.load(folder / "reference.npz"))
    return folder, load_hf_dir(folder), ref, json.loads((folder / "summary.json").read_text())


def _maxdiff(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max())


def _grids(ref) -> list[tuple]:
    return [tuple(g) for g in ref["grid_thw"].tolist()]


def test_oracle_is_float32_stable(case):
    *_, summary = case
    assert summary["float64_diff"] < TOL / 10


def test_preprocessing_matches_transformers(case):
    _, model, ref, summary = case
    a = model.args
    pieces, grids = [], []
    for i in range(len(ref["grid_thw"])):
        p = vp.preprocess(
            Image.fromarray(ref[f"image_{i}"]),
            patch_size=a.patch_size,
            merge_size=a.spatial_merge_size,
            temporal_patch_size=a.temporal_patch_size,
            min_tokens=summary["min_tokens"],
            max_tokens_=summary["max_tokens"],
        )
        pieces.append(p.pixels)
        grids.append(p.grid)
    assert grids == _grids(ref)
    # same Pillow bicubic resize, same normalisation and patch order: bit-for-bit up to float rounding
    assert _maxdiff(np.concatenate(pieces), ref["pixel_values"]) < 1e-6


@pytest.mark.parametrize("hw", [(70, 100), (150, 47), (3000, 20), (1, 1), (4000, 3000), (512, 512), (33, 4096)])
def test_smart_resize_matches_transformers(hw):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

    h, w = hw
    f = 32
    lo, hi = vp.MIN_TOKENS * f * f, vp.MAX_TOKENS * f * f
    if max(h, w) / min(h, w) > vp.MAX_ASPECT:
        with pytest.raises(vp.ImageGeometryError):
            vp.smart_resize(h, w, f, lo, hi)
        return
    got = vp.smart_resize(h, w, f, lo, hi)
    assert got == hf_smart_resize(h, w, factor=f, min_pixels=lo, max_pixels=hi)
    assert got[0] % f == 0 and got[1] % f == 0
    assert vp.MIN_TOKENS <= got[0] * got[1] // (f * f) <= vp.MAX_TOKENS


def test_merged_tokens_match_transformers(case):
    _, model, ref, summary = case
    out = model(mx.array(ref["pixel_values"]), _grids(ref))
    assert out.embeddings.shape == ref["pooler_output"].shape
    assert sum(model.tokens_for(g) for g in _grids(ref)) == summary["tokens"]
    assert _maxdiff(out.hidden, ref["last_hidden"]) <= TOL
    assert _maxdiff(out.embeddings, ref["pooler_output"]) <= TOL


def test_deepstack_features_match_transformers(case):
    _, model, ref, _ = case
    out = model(mx.array(ref["pixel_values"]), _grids(ref))
    expected = sorted(k for k in ref if k.startswith("deepstack_"))
    assert len(out.deepstack) == len(model.args.deepstack_visual_indexes) == len(expected)
    assert len(expected) == (0 if model.args.hidden_act == "gelu" else 2)  # qwen4_exp: none
    for j, d in enumerate(out.deepstack):
        assert _maxdiff(d, ref[f"deepstack_{j}"]) <= TOL


def test_images_do_not_attend_to_each_other(case):
    _, model, ref, _ = case
    g0 = _grids(ref)[0]
    n0 = int(np.prod(g0))
    alone = model(mx.array(ref["pixel_values"][:n0]), [g0])
    assert _maxdiff(alone.embeddings, ref["single_pooler"]) <= TOL
    batched = model(mx.array(ref["pixel_values"]), _grids(ref))
    assert _maxdiff(batched.embeddings[: model.tokens_for(g0)], alone.embeddings) <= TOL


def test_loads_under_the_full_model_prefix(case):
    folder, model, ref, _ = case
    from safetensors.numpy import load_file

    weights = {"model.visual." + k: v for k, v in load_file(str(folder / "model.safetensors")).items()}
    from ds4mlx.models.vision_qwen3vl import load_weights

    cfg = json.loads((folder / "config.json").read_text())
    again = load_weights(Qwen3VLVision(VisionArgs.from_dict({"vision_config": cfg})), weights)
    out = again(mx.array(ref["pixel_values"]), _grids(ref))
    assert _maxdiff(out.embeddings, ref["pooler_output"]) <= TOL


# --- llama.cpp's mmproj GGUF layout (ds4mlx/vision/mmproj.py) --------------------------------

LLAMA_CPP_NAMES = [  # convert_hf_to_gguf.py Qwen3VLVisionModel, for a 3-block tower
    "v.patch_embd.weight",
    "v.patch_embd.weight.1",
    "v.patch_embd.bias",
    "v.position_embd.weight",
    "v.blk.0.attn_qkv.weight",
    "v.blk.2.attn_out.bias",
    "v.blk.1.ln1.weight",
    "v.blk.1.ln2.bias",
    "v.blk.0.ffn_up.weight",
    "v.blk.2.ffn_down.weight",
    "v.post_ln.weight",
    "mm.0.weight",
    "mm.2.bias",
]


def _mmproj(case, tmp_path, qtype):
    import gguf
    from safetensors.numpy import load_file

    from ds4mlx.vision.mmproj import write_mmproj

    folder, model, _, _ = case
    if model.args.hidden_act != "gelu_pytorch_tanh" or model.args.rope_theta != 10000.0:
        pytest.skip("llama.cpp's mmproj keeps no activation or rope theta: the qwen3_vl config only")
    path = tmp_path / f"mmproj-{qtype.name}.gguf"
    write_mmproj(path, model.args, load_file(str(folder / "model.safetensors")), qtype)
    return path, gguf.GGUFReader(str(path))


def test_mmproj_layout_is_llama_cpps(case, tmp_path):
    import gguf

    _, model, _, _ = case
    _, reader = _mmproj(case, tmp_path, gguf.GGMLQuantizationType.F32)
    names = {t.name for t in reader.tensors}
    assert set(LLAMA_CPP_NAMES) <= names
    f = reader.fields[gguf.Keys.Clip.PROJECTOR_TYPE]
    assert bytes(f.parts[f.data[0]]).decode() == "qwen3vl_merger"
    ds = {f"v.deepstack.{i}.fc1.weight" for i in model.args.deepstack_visual_indexes}
    assert ds <= names and (not ds or "v.deepstack.2.norm.weight" in names)  # absolute block indexes
    patch = next(t for t in reader.tensors if t.name == "v.patch_embd.weight")
    assert tuple(reversed([int(d) for d in patch.shape])) == (model.args.hidden_size, 3, 16, 16)  # one time slice


def test_mmproj_f32_matches_transformers(case, tmp_path):
    import gguf

    from ds4mlx.vision.mmproj import load_mmproj

    _, _, ref, _ = case
    path, _ = _mmproj(case, tmp_path, gguf.GGMLQuantizationType.F32)
    out = load_mmproj(path)(mx.array(ref["pixel_values"]), _grids(ref))
    assert _maxdiff(out.embeddings, ref["pooler_output"]) <= TOL


def test_mmproj_q8_0_reads_the_dequantized_weights(case, tmp_path):
    import gguf
    from safetensors.numpy import load_file

    from ds4mlx.vision.mmproj import read_mmproj

    folder, model, _, _ = case
    q8 = gguf.GGMLQuantizationType.Q8_0
    path, reader = _mmproj(case, tmp_path, q8)
    assert any(t.tensor_type == q8 for t in reader.tensors)
    args, weights = read_mmproj(path)
    assert args == model.args.__class__(**{**model.args.__dict__, "rope_parameters": None})
    assert args.rope_theta == model.args.rope_theta
    src = Qwen3VLVision.sanitize(load_file(str(folder / "model.safetensors")))
    qkv = src["blocks.0.attn.qkv.weight"]
    want = gguf.quants.dequantize(gguf.quants.quantize(qkv, q8), q8).reshape(qkv.shape)
    np.testing.assert_array_equal(weights["blocks.0.attn.qkv.weight"], want)
    patch = src["patch_embed.proj.weight"]
    np.testing.assert_array_equal(weights["patch_embed.proj.weight"].reshape(patch.shape), patch)

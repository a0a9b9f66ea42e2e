"""llama.cpp's mmproj GGUF layout of the Qwen3-VL / Qwen3.8 vision tower (clip,
projector type `qwen3vl_merger`), read into transformers' names, and written from them.

The layout is llama.cpp's converter (convert_hf_to_gguf.py, Qwen3VLVisionModel); the
tensor names come from the `gguf` package's constants:

* `patch_embed.proj.weight` [D, C, 2, P, P] is split along time into `v.patch_embd.weight`
  and `v.patch_embd.weight.1` (each [D, C, P, P]); its bias is `v.patch_embd.bias`;
* `merger.linear_fc1` / `linear_fc2` -> `mm.0` / `mm.2`, `merger.norm` -> `v.post_ln`;
* `deepstack_merger_list.j.{norm,linear_fc1,linear_fc2}` -> `v.deepstack.L.{norm,fc1,fc2}`,
  L the absolute block index (`clip.vision.is_deepstack_layers`);
* the blocks and the position table by gguf's tensor map (`v.blk.N.attn_qkv`, `ln1`, ...).

Quantized tensors (the Q8_0 files llama.cpp publishes) are dequantized with gguf's
reference code: the tower is small and runs in float.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from ..models.vision_qwen3vl import Qwen3VLVision, VisionArgs, load_weights

K = gguf.Keys.ClipVision
T = gguf.MODEL_TENSOR
NAMES = gguf.TENSOR_NAMES
PROJECTOR = gguf.VisionProjectorType.QWEN3VL  # "qwen3vl_merger"

_BLOCK = {  # transformers block tensor -> gguf tensor kind
    "attn.qkv": T.V_ENC_ATTN_QKV,
    "attn.proj": T.V_ENC_ATTN_O,
    "norm1": T.V_ENC_INPUT_NORM,
    "norm2": T.V_ENC_POST_ATTN_NORM,
    "mlp.linear_fc1": T.V_ENC_FFN_UP,
    "mlp.linear_fc2": T.V_ENC_FFN_DOWN,
}
_DEEPSTACK = {"norm": T.V_DS_NORM, "linear_fc1": T.V_DS_FC1, "linear_fc2": T.V_DS_FC2}
_MERGER = {"linear_fc1": NAMES[T.V_MMPROJ].format(bid=0), "linear_fc2": NAMES[T.V_MMPROJ].format(bid=2)}


class MmprojError(ValueError):
    pass


def gguf_names(args: VisionArgs) -> dict[str, str]:
    """transformers name (without the `visual.` prefix) -> mmproj name, patch weight aside."""
    out = {
        "patch_embed.proj.bias": NAMES[T.V_ENC_EMBD_PATCH] + ".bias",
        "pos_embed.weight": NAMES[T.V_ENC_EMBD_POS] + ".weight",
        "merger.norm.weight": NAMES[T.V_POST_NORM] + ".weight",
        "merger.norm.bias": NAMES[T.V_POST_NORM] + ".bias",
    }
    for sfx in ("weight", "bias"):
        for hf, gg in _MERGER.items():
            out[f"merger.{hf}.{sfx}"] = f"{gg}.{sfx}"
        for i in range(args.depth):
            for hf, kind in _BLOCK.items():
                out[f"blocks.{i}.{hf}.{sfx}"] = NAMES[kind].format(bid=i) + f".{sfx}"
        for j, layer in enumerate(args.deepstack_visual_indexes):
            for hf, kind in _DEEPSTACK.items():
                out[f"deepstack_merger_list.{j}.{hf}.{sfx}"] = NAMES[kind].format(bid=layer) + f".{sfx}"
    return out


PATCH = NAMES[T.V_ENC_EMBD_PATCH] + ".weight"


def _field(reader: gguf.GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    vals = [f.parts[i] for i in f.data]
    if f.types and f.types[0] == gguf.GGUFValueType.STRING:
        return bytes(vals[0]).decode()
    if f.types and f.types[0] == gguf.GGUFValueType.ARRAY:
        return [v.tolist()[0] for v in vals]
    return vals[0].tolist()[0]


def read_args(reader: gguf.GGUFReader) -> VisionArgs:
    kind = _field(reader, gguf.Keys.Clip.PROJECTOR_TYPE) or _field(reader, K.PROJECTOR_TYPE)
    if kind != PROJECTOR:
        raise MmprojError(f"projector type {kind!r}: only {PROJECTOR!r} (Qwen3-VL / Qwen3.8) mmproj files are read")
    patch = int(_field(reader, K.PATCH_SIZE))
    depth = int(_field(reader, K.BLOCK_COUNT))
    side = int(_field(reader, K.IMAGE_SIZE)) // patch
    flags = _field(reader, K.IS_DEEPSTACK_LAYERS) or []
    return VisionArgs(
        depth=depth,
        hidden_size=int(_field(reader, K.EMBEDDING_LENGTH)),
        intermediate_size=int(_field(reader, K.FEED_FORWARD_LENGTH)),
        num_heads=int(_field(reader, K.Attention.HEAD_COUNT)),
        patch_size=patch,
        spatial_merge_size=int(_field(reader, K.SPATIAL_MERGE_SIZE, 2)),
        temporal_patch_size=2,
        out_hidden_size=int(_field(reader, K.PROJECTION_DIM)),
        num_position_embeddings=side * side,
        deepstack_visual_indexes=[i for i, on in enumerate(flags) if on],
        hidden_act="gelu_pytorch_tanh",  # ggml_gelu: the tanh approximation
    )


def _array(t) -> np.ndarray:
    shape = tuple(int(d) for d in reversed(t.shape))
    return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32).reshape(shape)


def read_mmproj(path: str | Path) -> tuple[VisionArgs, dict]:
    """(args, transformers-named float32 weights) of an mmproj GGUF."""
    reader = gguf.GGUFReader(str(path))
    args = read_args(reader)
    tensors = {t.name: t for t in reader.tensors}
    weights = {}
    for hf, gg in gguf_names(args).items():
        if gg not in tensors:
            raise MmprojError(f"{path}: tensor {gg} missing")
        weights[hf] = _array(tensors[gg])
    if PATCH not in tensors or PATCH + ".1" not in tensors:
        raise MmprojError(f"{path}: {PATCH} / {PATCH}.1 missing")
    weights["patch_embed.proj.weight"] = np.stack([_array(tensors[PATCH]), _array(tensors[PATCH + ".1"])], axis=2)
    return args, weights


def load_mmproj(path: str | Path) -> Qwen3VLVision:
    args, weights = read_mmproj(path)
    return load_weights(Qwen3VLVision(args), weights)


def write_mmproj(path: str | Path, args: VisionArgs, weights: dict, qtype=gguf.GGMLQuantizationType.F32) -> None:
    """transformers-named weights (numpy) -> an mmproj GGUF in llama.cpp's layout;
    2-D weights whose rows fit `qtype`'s blocks in `qtype` (F32, F16, Q8_0), the rest float32."""
    weights = Qwen3VLVision.sanitize(dict(weights))
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_bool(gguf.Keys.Clip.HAS_VISION_ENCODER, True)
    w.add_string(gguf.Keys.Clip.PROJECTOR_TYPE, PROJECTOR)
    w.add_uint32(K.PATCH_SIZE, args.patch_size)
    w.add_uint32(K.IMAGE_SIZE, args.grid_side * args.patch_size)
    w.add_uint32(K.EMBEDDING_LENGTH, args.hidden_size)
    w.add_uint32(K.FEED_FORWARD_LENGTH, args.intermediate_size)
    w.add_uint32(K.PROJECTION_DIM, args.out_hidden_size)
    w.add_uint32(K.BLOCK_COUNT, args.depth)
    w.add_uint32(K.Attention.HEAD_COUNT, args.num_heads)
    w.add_uint32(K.SPATIAL_MERGE_SIZE, args.spatial_merge_size)
    w.add_float32(K.Attention.LAYERNORM_EPS, 1e-6)
    w.add_bool(K.USE_GELU, True)
    if args.deepstack_visual_indexes:
        w.add_array(K.IS_DEEPSTACK_LAYERS, [i in args.deepstack_visual_indexes for i in range(args.depth)])
    patch = np.asarray(weights["patch_embed.proj.weight"], np.float32).reshape(
        args.hidden_size, args.in_channels, args.temporal_patch_size, args.patch_size, args.patch_size
    )
    w.add_tensor(PATCH, np.ascontiguousarray(patch[:, :, 0]))
    w.add_tensor(PATCH + ".1", np.ascontiguousarray(patch[:, :, 1]))
    for hf, gg in gguf_names(args).items():
        a = np.ascontiguousarray(np.asarray(weights[hf], np.float32))
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        if a.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32 and a.shape[-1] % block == 0:
            w.add_tensor(gg, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gg, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

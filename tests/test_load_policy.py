"""Loading real-format files: ds4's q2 / q4 GGUF layouts against transformers, the
float32 activation policy on 16-bit weights, MTP tensors (main file and ds4's
separate MTP support GGUF), and that a load releases the file's mapped pages.

Reference: transformers' deepseek_v4 run in float32 on exactly the weights the
file decodes to (GGUF blocks dequantized by gguf-py's reference, F16 rounded).
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from lazy_modules import lazy

import ds4mlx
from ds4mlx.cli.commands import main
from ds4mlx.io.convert import write_gguf
from ds4mlx.io.quant import QT, QuantizedTensor
from ds4mlx.io.weights import GGUFFile, read_weights

torch = lazy("torch")
TOL = 1e-4
WIDE = dict(hidden_size=256, moe_intermediate_size=256)  # K-quant / IQ2_XXS rows: multiples of 256


def _transformers(cfg: dict, weights: dict | None = None, seed: int = 0):
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**cfg))
    model.set_attn_implementation("eager")
    if weights is not None:
        missing, unexpected = model.load_state_dict(
            {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in weights.items()}, strict=False
        )
        assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return model.eval()


def _tf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float().numpy()


def _decoded(path) -> dict:
    """The float32 weights a GGUF decodes to, under transformers' names."""
    _, tensors, _ = read_weights(path)
    w = {k: (v.dequantize() if isinstance(v, QuantizedTensor) else np.asarray(v)) for k, v in tensors.items()}
    for key in [k for k in w if k.endswith("mlp.experts.gate_proj")]:
        prefix = key[: -len("gate_proj")]
        w[prefix + "gate_up_proj"] = np.concatenate([w.pop(key), w.pop(prefix + "up_proj")], axis=1)
    return {k: v.astype(np.float32) if np.issubdtype(v.dtype, np.floating) else v for k, v in w.items()}


@pytest.fixture(scope="module")
def wide_folder(oracle, tmp_path_factory):
    """A 256-wide transformers deepseek_v4 (the oracle's config, random weights) as an HF folder."""
    from safetensors.torch import save_file

    cfg = json.loads((oracle("make_tiny_deepseek_v4.py", None) / "config.json").read_text())
    cfg.update(WIDE)
    model = _transformers(cfg, seed=3)
    out = tmp_path_factory.mktemp("wide")
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items() if "rotary" not in k}, str(out / "model.safetensors")
    )
    (out / "config.json").write_text(json.dumps(cfg))
    return out, cfg


# ds4's published layouts (README of antirez/ds4): q2 = IQ2_XXS gate/up + Q2_K down
# experts, q4 = Q4_K experts; attention / shared expert Q8_0, the rest F16 / F32
LAYOUTS = {"q2": ("iq2_xxs", {QT.IQ2_XXS, QT.Q2_K}), "q4": ("q4_k", {QT.Q4_K})}
BANNER = {  # the load banner's line for each quantized type (models/quantized.py WeightPath)
    "experts Q4_K": "GGUF blocks, quant_moe kernels (exact)",
    "experts IQ2_XXS": "GGUF blocks, quant_moe kernels (exact)",
    "experts Q2_K": "GGUF blocks, quant_moe kernels (exact)",
}


def _routes(tf_model, lm, ids) -> tuple[list, list]:
    """The experts each top-k router picks, per call, sorted: transformers' and ds4mlx's
    (hash-routed layers have no scores to flip and are left out on both sides)."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4TopKRouter

    from ds4mlx.models.deepseek_v4 import Router

    theirs, ours = [], []
    hooks = [
        m.register_forward_hook(lambda _m, _i, out: theirs.append(np.sort(out[2].numpy(), axis=-1)))
        for m in tf_model.modules()
        if isinstance(m, DeepseekV4TopKRouter)
    ]
    _tf_logits(tf_model, ids)
    for h in hooks:
        h.remove()
    real = Router.__call__

    def recording(self, x, tok):
        idx, w = real(self, x, tok)
        if not self._hashed:
            ours.append(np.sort(np.array(idx).reshape(-1, idx.shape[-1]), axis=-1))
        return idx, w

    Router.__call__ = recording
    try:
        lm.logits(ids)
    finally:
        Router.__call__ = real
    return theirs, ours


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def ds4_file(request, wide_folder, tmp_path_factory):
    """A tiny replica of one of ds4's GGUF layouts and transformers' float32 model of the
    weights it decodes to, with its logits on 40 tokens."""
    folder, cfg = wide_folder
    recipe, expert_types = LAYOUTS[request.param]
    out = tmp_path_factory.mktemp("ds4") / f"{request.param}.gguf"
    assert main(["quantize", str(folder), str(out), "--experts", recipe, "--dense", "q8_0", "-q"]) == 0
    g = GGUFFile(out)
    assert {g.tensors[f"blk.3.ffn_{p}_exps.weight"].ggml_type for p in ("gate", "up", "down")} == expert_types
    assert g.tensors["blk.0.attn_q_a.weight"].ggml_type == QT.Q8_0
    assert g.tensors["token_embd.weight"].ggml_type == QT.F16  # what dtype=None keeps as stored
    tf = _transformers(cfg, _decoded(out))
    ids = np.random.default_rng(1).integers(0, cfg["vocab_size"], 40).tolist()
    return dict(path=out, tf=tf, ids=ids, want=_tf_logits(tf, ids), expert_types=expert_types)


@pytest.mark.parametrize("dtype", ["auto", None], ids=["default", "gpu-policy"])
def test_ds4_layouts_match_transformers(ds4_file, dtype, capsys):
    """ds4's q2 / q4 layouts give transformers' float32 logits of the decoded weights
    (1e-4) with the same greedy tokens and expert choices, under the CPU default (float
    weights widened) and the GPU weight policy (F16 weights as stored, float32
    activations, `dtype=None`): on the full forward, a chunked prefill and decode steps.
    Before the exact-scales policy the q4 file under dtype=None was 1e-2 off (Q4_K scales
    and biases rounded to float16 in an MLX 4-bit repack) with flipped expert choices."""
    ids, want = ds4_file["ids"], ds4_file["want"]
    lm, _ = ds4mlx.load(ds4_file["path"], dtype=dtype)
    banner = capsys.readouterr().err
    for qtype in ds4_file["expert_types"]:
        assert f"ds4mlx: weights: experts {qtype.name}: {BANNER['experts ' + qtype.name]}" in banner
    assert "rounded" not in banner
    assert "ds4mlx: weights: dense Q8_0: MLX 8-bit affine, " in banner
    if dtype is None:
        assert lm.model.model.embed_tokens.weight.dtype == mx.float16
        assert "dense Q8_0: MLX 8-bit affine, float16 scales (exact repack)" in banner
    got = lm.logits(ids)
    assert float(np.abs(got - want).max()) < TOL
    assert (got.argmax(-1) == want.argmax(-1)).all()
    theirs, ours = _routes(ds4_file["tf"], lm, ids)
    assert len(theirs) == len(ours) > 0
    for t, o in zip(theirs, ours):
        assert np.array_equal(t, o)
    s = lm.new_session(ctx=64, chunk=16)
    last = np.asarray(s.prefill(ids[:24]))
    steps = np.stack([np.asarray(s.decode(t)) for t in ids[24:]])
    assert float(np.abs(last.reshape(-1) - want[23]).max()) < TOL
    assert float(np.abs(steps.reshape(len(ids) - 24, -1) - want[24:]).max()) < TOL
    assert (steps.reshape(len(ids) - 24, -1).argmax(-1) == want[24:].argmax(-1)).all()


def test_inspect_names_each_types_path(ds4_file, capsys):
    """`ds4mlx inspect` says how a `--dtype auto` load on this machine keeps each
    quantized type (the CPU widens float weights: Q8_0 scales in float32)."""
    assert main(["inspect", str(ds4_file["path"]), "--ctx", "1024"]) == 0
    out = capsys.readouterr().out
    for qtype in ds4_file["expert_types"]:
        assert f"  experts {qtype.name}: {BANNER['experts ' + qtype.name]}" in out
    assert "  dense Q8_0: MLX 8-bit affine, float32 scales (exact repack)" in out
    assert "rounded" not in out


def test_f16_weights_compute_in_float32(oracle, tmp_path):
    """ds4's policy: 16-bit weights, float32 activations.  Loading an F16 GGUF with
    the weights kept in float16 gives transformers' float32 logits on the
    F16-rounded weights; a float16 residual stream does not."""
    d = oracle("make_tiny_deepseek_v4.py", None)
    cfg = json.loads((d / "config.json").read_text())
    from safetensors.numpy import load_file

    sd = load_file(str(d / "model.safetensors"))
    p = tmp_path / "f16.gguf"
    write_gguf(p, cfg, sd, tokenizer=False, dtype="f16")
    lm, _ = ds4mlx.load(p, dtype=None, verbose=False)  # weights as stored (as on a GPU)
    assert lm.model.model.embed_tokens.weight.dtype == mx.float16
    assert lm.dtype_policy.activations == mx.float32
    ids = np.random.default_rng(2).integers(0, lm.vocab_size, 40).tolist()
    want = _tf_logits(_transformers(cfg, _decoded(p)), ids)
    assert float(np.abs(lm.logits(ids) - want).max()) < TOL
    lm16, _ = ds4mlx.load(p, dtype="float16", verbose=False)
    assert float(np.abs(lm16.logits(ids) - want).max()) > 10 * TOL


def _mtp_tensors(sd: dict) -> dict:
    """ds4's MTP block (ds4.c mtp_weights_bind) made from layer 3's tensors."""
    out = {}
    for k, v in sd.items():
        if k.startswith("model.layers.3."):
            out["mtp.0." + k[len("model.layers.3.") :]] = v
    return out


def test_mtp_in_main_gguf_and_support_gguf(oracle, tmp_path, monkeypatch):
    import gguf

    from ds4mlx.gguf_families import deepseek_v4 as names

    d = oracle("make_tiny_deepseek_v4.py", None)
    cfg = json.loads((d / "config.json").read_text())
    from safetensors.numpy import load_file

    sd = load_file(str(d / "model.safetensors"))
    mtp = {
        "mtp.0.attn_q_a.weight": sd["model.layers.3.self_attn.q_a_proj.weight"],
        "mtp.0.enorm.weight": np.ones(cfg["hidden_size"], np.float32),
    }
    # ds4's MTP support GGUF: the mtp.* tensors alone
    support = tmp_path / "mtp.gguf"
    w = gguf.GGUFWriter(str(support), names.ARCH)
    for k, v in mtp.items():
        w.add_tensor(k, np.ascontiguousarray(v, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    from ds4mlx.models import tensor_load

    made = []
    real = tensor_load.packed_to_mlx
    monkeypatch.setattr(tensor_load, "packed_to_mlx", lambda v: made.append(1) or real(v))
    lm, _ = ds4mlx.load(d, mtp=support, verbose=False)
    assert set(lm.mtp_weights) == {"mtp.0.self_attn.q_a_proj.weight", "mtp.0.enorm.weight"}
    assert not made  # kept unread until `--mtp` builds its head
    assert np.array_equal(
        np.array(lm.mtp_weights["mtp.0.self_attn.q_a_proj.weight"]), sd["model.layers.3.self_attn.q_a_proj.weight"]
    )
    # the same tensors inside a main GGUF are kept too (and do not disturb the model)
    main_file = tmp_path / "main.gguf"
    write_gguf(main_file, cfg, sd, tokenizer=False)
    g_rows = [(k, v) for k, v in mtp.items()]
    both = tmp_path / "both.gguf"
    r = GGUFFile(main_file)
    w = gguf.GGUFWriter(str(both), names.ARCH)
    for key, value, kind in names.config_to_gguf_kv(cfg):
        if key != "general.architecture":
            from ds4mlx.io.convert import _add_kv

            _add_kv(w, key, value, kind)
    for t in r.tensors.values():
        w.add_tensor(t.name, np.ascontiguousarray(t.data))
    for k, v in g_rows:
        w.add_tensor(k, np.ascontiguousarray(v, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    lm2, _ = ds4mlx.load(both, verbose=False)
    assert set(lm2.mtp_weights) == set(lm.mtp_weights)
    ids = [1, 5, 9, 2]
    assert np.array_equal(lm2.logits(ids), ds4mlx.load(main_file, verbose=False)[0].logits(ids))


def test_load_releases_mapped_pages(oracle, tmp_path, monkeypatch):
    """Every mapped tensor the loader reads is released once converted."""
    from ds4mlx.io import mapped

    d = oracle("make_tiny_deepseek_v4.py", None)
    cfg = json.loads((d / "config.json").read_text())
    from safetensors.numpy import load_file

    p = tmp_path / "m.gguf"
    write_gguf(p, cfg, load_file(str(d / "model.safetensors")), tokenizer=False, dtype="f16")
    released = []
    real = mapped.release_array

    def spy(arr):
        if mapped.memmap_of(arr) is not None:
            released.append(arr.nbytes)
        real(arr)

    monkeypatch.setattr(mapped, "release_array", spy)
    ds4mlx.load(p, verbose=False)
    g = GGUFFile(p)
    assert sum(released) >= sum(t.nbytes for t in g.tensors.values())


def test_row_block_copy_equals_whole_copy(oracle, tmp_path, monkeypatch):
    """Big mapped tensors are copied in row blocks (tensor_load.CHUNK_BYTES); with a
    tiny block size every tensor goes that way and the model is the same bit for bit."""
    from mlx.utils import tree_flatten
    from safetensors.numpy import load_file

    from ds4mlx.models import tensor_load

    d = oracle("make_tiny_deepseek_v4.py", None)
    cfg = json.loads((d / "config.json").read_text())
    p = tmp_path / "q.gguf"
    write_gguf(p, cfg, load_file(str(d / "model.safetensors")), tokenizer=False, dtype="f16")
    whole, _ = ds4mlx.load(p, verbose=False)
    monkeypatch.setattr(tensor_load, "CHUNK_BYTES", 1024)
    blocks, _ = ds4mlx.load(p, verbose=False)
    a, b = dict(tree_flatten(whole.model.parameters())), dict(tree_flatten(blocks.model.parameters()))
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(np.array(a[k]), np.array(b[k])), k


def test_row_block_copy_of_gguf_expert_blocks(wide_folder, tmp_path, monkeypatch):
    """The same for IQ2_XXS / Q2_K expert banks kept as GGUF blocks."""
    from mlx.utils import tree_flatten

    from ds4mlx.models import tensor_load

    folder, _ = wide_folder
    out = tmp_path / "q2.gguf"
    assert main(["quantize", str(folder), str(out), "--experts", "iq2_xxs", "-q"]) == 0
    whole, _ = ds4mlx.load(out, verbose=False)
    monkeypatch.setattr(tensor_load, "CHUNK_BYTES", 1024)
    blocks, _ = ds4mlx.load(out, verbose=False)
    a, b = dict(tree_flatten(whole.model.parameters())), dict(tree_flatten(blocks.model.parameters()))
    assert any(v.dtype == mx.uint8 for v in a.values())  # the GGUF blocks are there
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(np.array(a[k]), np.array(b[k])), k

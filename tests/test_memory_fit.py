"""The memory verdict (memory_fit.py) at the Macs' and cards' sizes, with the real DeepSeek V4
Flash files.  ds4's q2 and q4 GGUFs are written header-only at the real 43-layer shapes (ds4's
tensor names, types and metadata; the data region a sparse hole, ~100 KB on disk) and sized
by `inspect` as any file is; the official FP4 / FP8 release (safetensors, which cannot be
written without its data) is summed tensor by tensor at its stored types.  The KV cache is
`inspect.kv_bytes` of the real config.  Then the load applies the verdict: a refusal in one
line, or on Metal the wired limit raised."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import gguf
import numpy as np
import pytest

from ds4mlx import gguf_families
from ds4mlx.bench.load_memory import model_shapes
from ds4mlx.io import convert, memory_fit
from ds4mlx.io.inspect_model import kv_bytes, summarize
from ds4mlx.io.mapped import LazyTensor
from ds4mlx.io.modelfile import ModelFileError
from ds4mlx.io.quant import QT, QuantizedTensor, byte_shape

GIB = 1 << 30
ROOT = Path(__file__).resolve().parents[1]


def _synthetic_tool():
    spec = importlib.util.spec_from_file_location("ds4_synthetic_gguf", ROOT / "tools" / "ds4_synthetic_gguf.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SYNTH = _synthetic_tool()
CONFIG = SYNTH.synthetic_config(43)  # the real V4 Flash shape


def header_only_gguf(path: Path, config: dict, tensors: dict) -> Path:
    """What `convert.write_gguf` writes, header only: metadata and tensor infos, then a hole
    as long as the tensors' data (nothing is generated or written)."""
    family = gguf_families.for_config(config)
    w = gguf.GGUFWriter(str(path), family.arch)
    for key, value, kind in family.config_to_kv(config):
        if key != "general.architecture":
            convert._add_kv(w, key, value, kind)
    data = 0
    for gname, val in family.to_gguf(config, tensors):
        shape, dt, nbytes, raw, _ = convert._plan(gname, val, "f16", family.keep_f32)
        w.add_tensor_info(gname, shape, np.dtype(dt), nbytes, raw_dtype=raw)
        data += gguf.GGUFWriter.ggml_pad(nbytes, w.data_alignment)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    start = gguf.GGUFWriter.ggml_pad(w.fout[0].tell(), w.data_alignment)
    w.close()
    os.truncate(path, start + data)
    if os.stat(path).st_blocks * 512 > 1 << 30:  # a filesystem without holes: do not fill the disk
        path.unlink()
        pytest.skip("this filesystem has no sparse files")
    return path


def _as_q4(tensors: dict) -> dict:
    """ds4's q4 recipe: the q2 file with Q4_K routed experts."""
    out = dict(tensors)
    for k, v in tensors.items():
        if isinstance(v, QuantizedTensor) and ".mlp.experts." in k:
            bs = byte_shape(QT.Q4_K, v.shape)
            out[k] = QuantizedTensor(raw=LazyTensor(lambda: None, bs, np.uint8), qtype=QT.Q4_K, shape=v.shape)
    return out


def _n(shape) -> int:
    return int(np.prod(shape, dtype=np.int64))


def _fp8(shape) -> int:  # E4M3 bytes + one UE8M0 scale per 128x128 block
    return _n(shape) + -(-shape[0] // 128) * -(-shape[1] // 128)


def official_bytes(config: dict) -> int:
    """The official release's bytes (bench/load_memory.py's write_hf layout): FP4 experts with a
    UE8M0 scale per 32, FP8 matrices with 128x128 block scales, BF16 embedding / head /
    hyper-connection / router / vectors, int32 hash routes."""
    total = 0
    for name, s in model_shapes(config).items():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            total += _n(s) // 2 + _n(s) // 32
        elif name.endswith("tid2eid"):
            total += 4 * _n(s)
        elif len(s) == 2 and not any(k in name for k in ("embed", "lm_head", "hc", "gate.weight")):
            total += _fp8(s)
        else:
            total += 2 * _n(s)
    return total


@pytest.fixture(scope="module")
def sizes(tmp_path_factory) -> dict:
    """Bytes of V4 Flash as ds4's q2 and q4 GGUFs (inspect on header-only files) and as the
    official safetensors."""
    d = tmp_path_factory.mktemp("headers")
    q2 = SYNTH.synthetic_tensors(CONFIG)
    out = {}
    for name, tensors in (("q2", q2), ("q4", _as_q4(q2))):
        path = header_only_gguf(d / f"{name}.gguf", CONFIG, tensors)
        s = summarize(path, 32768)
        assert s["family"] == "deepseek4" and s["kv_bytes"] == kv_bytes(CONFIG, 32768)
        out[name] = s["weight_bytes"]
        path.unlink()
    out["official"] = official_bytes(CONFIG)
    return out


def test_sizes_are_ds4s(sizes):
    # download_model.sh: "q2 ... about 81 GB on disk", "q4 ... about 153 GB" (GiB); the whole
    # 43-layer q2 file measured 86.8 GB (BENCHMARKS.md)
    assert round(sizes["q2"] / GIB) == 81 and round(sizes["q2"] / 1e9, 1) == 86.7
    assert round(sizes["q4"] / GIB) == 153
    assert 140 * GIB < sizes["official"] < 150 * GIB


def mac(ram_gib: int, wired_gib: float | None = None) -> memory_fit.Budget:
    """A Mac's recommended working set: macOS's default GPU wired limit is 3/4 of the RAM
    (`sudo sysctl iogpu.wired_limit_mb` sets another)."""
    return memory_fit.Budget(int((wired_gib or 0.75 * ram_gib) * GIB), f"{ram_gib} GB Mac", metal=True)


def card(mem_gb: float) -> memory_fit.Budget:
    return memory_fit.Budget(int(memory_fit.HEADROOM * mem_gb * 1e9), f"{mem_gb} GB card")


def verdict(size: int, where, ctx: int = 32768):
    return memory_fit.verdict(size, lambda c: kv_bytes(CONFIG, c), ctx, where, CONFIG["max_position_embeddings"])


@pytest.mark.parametrize(
    "ram, fits",
    [
        (64, {"q2": False, "q4": False, "official": False}),
        (96, {"q2": False, "q4": False, "official": False}),
        (128, {"q2": True, "q4": False, "official": False}),
        (192, {"q2": True, "q4": False, "official": False}),
    ],
)
def test_macs_at_default_wired_limit(sizes, ram, fits):
    for name, size in sizes.items():
        v = verdict(size, mac(ram))
        assert v.fits == fits[name], (ram, name, v.line())
        if not v.fits:
            line = v.refusal(name)
            assert "\n" not in line and "--stream-experts" in line and "iogpu.wired_limit_mb" in line
            assert v.max_ctx is None  # the weights alone exceed it: no --ctx helps
            assert "--ctx" not in line.split("cannot hold it")[1]


def test_q2_on_a_128gb_mac_fits_its_whole_context(sizes):
    v = verdict(sizes["q2"], mac(128), ctx=CONFIG["max_position_embeddings"])
    assert v.fits and v.max_ctx == CONFIG["max_position_embeddings"]


def test_raised_wired_limit(sizes):
    # 96 GB Mac, iogpu.wired_limit_mb raised to 90 GiB: q2 fits (ds4 recommends it there)
    assert verdict(sizes["q2"], mac(96, wired_gib=90)).fits
    # 192 GB Mac raised to 180 GiB: q4 and the official release fit too
    assert verdict(sizes["q4"], mac(192, wired_gib=180)).fits
    assert verdict(sizes["official"], mac(192, wired_gib=180)).fits


def test_refusal_names_the_ctx_that_fits(sizes):
    where = memory_fit.Budget(sizes["q2"] + kv_bytes(CONFIG, 65536), "a machine")
    v = verdict(sizes["q2"], where, ctx=262144)
    assert not v.fits and v.max_ctx == 65536
    line = v.refusal("q2")
    assert "--ctx 65536 fits" in line and "--stream-experts" in line and "iogpu" not in line


def test_nvidia_cards(sizes):
    assert not verdict(sizes["q2"], card(80)).fits  # H100 80 GB
    assert verdict(sizes["q2"], card(141)).fits  # H200 141 GB
    assert not verdict(sizes["q4"], card(141)).fits and not verdict(sizes["official"], card(141)).fits


# ----------------------------------------------------------------------------- at load
def test_load_refuses_in_one_line(monkeypatch):
    from ds4mlx.io.loader import load

    monkeypatch.setattr(memory_fit, "budget", lambda: memory_fit.Budget(1 << 20, "a tiny machine"))
    with pytest.raises(ModelFileError) as e:
        load(None, verbose=False, ctx=4096)
    assert "\n" not in str(e.value) and "--stream-experts" in str(e.value) and "cannot hold it" in str(e.value)


def test_load_raises_the_wired_limit_on_metal(monkeypatch, capsys):
    import mlx.core as mx

    from ds4mlx.io.loader import load

    limits = []
    monkeypatch.setattr(memory_fit, "metal_available", lambda: True)
    monkeypatch.setattr(memory_fit, "device_info", lambda: {"max_recommended_working_set_size": 8 * 10**9})
    monkeypatch.setattr(mx, "set_wired_limit", limits.append, raising=False)
    load(None, ctx=4096)
    assert limits == [8 * 10**9]
    err = capsys.readouterr().err
    assert (
        "ds4mlx: memory: weights" in err and "Metal recommended working set): fits; wired limit raised to 8.0 GB" in err
    )

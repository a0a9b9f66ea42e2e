"""A corpus of broken model files and folders (the reliability audit's list),
built from a valid tiny GGUF; `make_bad_models(good_gguf, dir) -> {case: path}`."""

from __future__ import annotations

import json
import struct
from pathlib import Path

GGUF_MAGIC = b"GGUF"


def _gguf_header(version: int = 3, n_tensors: int = 0, n_kv: int = 0) -> bytes:
    return GGUF_MAGIC + struct.pack("<IQQ", version, n_tensors, n_kv)


def make_bad_models(good_gguf: Path, root: Path) -> dict[str, Path]:
    root.mkdir(parents=True, exist_ok=True)
    good = good_gguf.read_bytes()
    out: dict[str, Path] = {}

    def put(case: str, data: bytes, name: str | None = None) -> None:
        p = root / (name or f"{case}.gguf")
        p.write_bytes(data)
        out[case] = p

    out["nonexistent"] = root / "no-such-model.gguf"
    put("empty", b"")
    put("cut_in_half", good[: len(good) // 2])
    put("cut_in_header", good[:200])
    put("magic_only", GGUF_MAGIC)
    put("version_99", GGUF_MAGIC + struct.pack("<I", 99) + good[8:])
    put("text_named_gguf", b"this is not a model, just some text\n" * 20)
    put("2e60_tensors", _gguf_header(3, 1 << 60, 0) + b"\0" * 64)
    put("2e60_metadata", _gguf_header(3, 0, 1 << 60) + b"\0" * 64)
    # one metadata string that claims 2^60 bytes
    put("huge_string", _gguf_header(3, 0, 1) + struct.pack("<Q", 3) + b"abc" + struct.pack("<IQ", 8, 1 << 60))
    # one array that claims 2^60 elements
    put("huge_array", _gguf_header(3, 0, 1) + struct.pack("<Q", 3) + b"abc" + struct.pack("<IIQ", 9, 4, 1 << 60))
    empty_dir = root / "empty_dir"
    empty_dir.mkdir(exist_ok=True)
    out["empty_dir"] = empty_dir
    broken = root / "broken_config"
    broken.mkdir(exist_ok=True)
    (broken / "config.json").write_text('{"model_type": "deepseek_v4", "hidden_size": ')
    out["broken_config_json"] = broken
    wrong = root / "config_wrong_types"
    wrong.mkdir(exist_ok=True)
    (wrong / "config.json").write_text(json.dumps({"model_type": "deepseek_v4", "hidden_size": "big"}))
    (wrong / "model.safetensors").write_bytes(struct.pack("<Q", 2) + b"{}")
    out["config_wrong_types"] = wrong
    bad_st = root / "bad_safetensors"
    bad_st.mkdir(exist_ok=True)
    (bad_st / "config.json").write_text(json.dumps({"model_type": "deepseek_v4"}))
    (bad_st / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 60) + b"{}")
    out["safetensors_huge_header"] = bad_st
    return out

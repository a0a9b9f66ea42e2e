"""The default prefill chunk (prefill_chunk.py): 512 on the CPU, the environment's value
when set (a bad value is an error, not a silent default), and a Session, the engine and
`ds4mlx serve` all take it when no chunk is given."""

from __future__ import annotations

import mlx.core as mx
import pytest

from ds4mlx.runtime import prefill_chunk


def test_cpu_default_and_env(monkeypatch):
    monkeypatch.delenv(prefill_chunk.ENV, raising=False)
    assert mx.default_device().type == mx.DeviceType.cpu
    assert prefill_chunk.default_chunk() == prefill_chunk.CPU_CHUNK == 512
    monkeypatch.setenv(prefill_chunk.ENV, "4096")
    assert prefill_chunk.default_chunk() == 4096
    for bad in ("0", "-3", "big"):
        monkeypatch.setenv(prefill_chunk.ENV, bad)
        with pytest.raises(ValueError):
            prefill_chunk.default_chunk()


def test_gpu_default(monkeypatch):
    monkeypatch.delenv(prefill_chunk.ENV, raising=False)
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.DeviceType.gpu, 0))
    assert prefill_chunk.default_chunk() == prefill_chunk.GPU_CHUNK == 2048


def test_session_and_engine_take_the_default(monkeypatch):
    from ds4mlx import load
    from ds4mlx.engine import Engine

    monkeypatch.setenv(prefill_chunk.ENV, "96")
    model, tok = load(None)
    assert model.new_session(64).chunk == 96
    assert model.new_session(64, chunk=7).chunk == 7
    assert Engine(model, tok, ctx=64).prefill_chunk == 96
    assert Engine(model, tok, ctx=64, prefill_chunk=5).prefill_chunk == 5

"""`dispatch.use_face`: a scoped face choice that the environment never sees (the kernel
bench compares whole models with kernels on and off this way)."""

from __future__ import annotations

import os

import mlx.core as mx
import pytest

from ds4mlx.kernels import dispatch


def test_use_face_overrides_the_environment_inside_the_block_only(monkeypatch):
    monkeypatch.setenv("DS4MLX_KERNELS", "cuda")
    assert dispatch.backend() == "cuda"
    with dispatch.use_face("reference"):
        assert dispatch.backend() == "reference"
        assert os.environ["DS4MLX_KERNELS"] == "cuda"  # untouched
        with dispatch.use_face("metal"):
            assert dispatch.backend() == "metal"
        assert dispatch.backend() == "reference"
    assert dispatch.backend() == "cuda"


def test_use_face_none_picks_by_device_and_ignores_the_environment(monkeypatch):
    monkeypatch.setenv("DS4MLX_KERNELS", "cuda")
    with dispatch.use_face(None):
        assert dispatch.backend(mx.cpu) == "reference"  # the CPU has no GPU face


def test_use_face_restores_after_an_error_and_rejects_unknown_faces(monkeypatch):
    monkeypatch.delenv("DS4MLX_KERNELS", raising=False)
    with pytest.raises(RuntimeError), dispatch.use_face("cuda"):
        raise RuntimeError("boom")
    assert dispatch.backend(mx.cpu) == "reference"
    with pytest.raises(ValueError, match="face must be one of"), dispatch.use_face("tpu"):
        pass

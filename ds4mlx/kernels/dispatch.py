"""Run-time choice between a kernel's three faces: pure-MLX reference, Metal, CUDA.

Every custom kernel in `ds4mlx.kernels` has the same three implementations with the
same grid, tiling, inputs and outputs.  `backend()` names the one to use for a
device; `Kernel` builds (once, lazily) and launches the Metal or CUDA face through
``mx.fast.metal_kernel`` / ``mx.fast.cuda_kernel``; `sections()` reads the
``// @@ name`` sections of a kernel source file under ``metal/`` so one file can
hold the code shared by both GPU faces.

``DS4MLX_KERNELS=reference`` forces the reference face everywhere (debugging,
bisecting a kernel); ``DS4MLX_KERNELS=metal|cuda`` insists on that face.
"""
from __future__ import annotations

import os
import re
from functools import lru_cache
from pathlib import Path

import mlx.core as mx

BACKENDS = ("reference", "metal", "cuda")
METAL_DIR = Path(__file__).resolve().parents[2] / "metal"


def gpu_backend() -> str | None:
    """'metal' or 'cuda' when this MLX build has that GPU backend and a device."""
    try:
        if mx.metal.is_available():
            return "metal"
    except Exception:  # pragma: no cover - builds without the metal module
        pass
    cuda = getattr(mx, "cuda", None)
    try:
        if cuda is not None and cuda.is_available():
            return "cuda"
    except Exception:  # pragma: no cover
        pass
    return None


def backend(device=None) -> str:
    """The face to run on `device` (an ``mx.Device`` or ``mx.cpu`` / ``mx.gpu``;
    default: MLX's default device)."""
    forced = os.environ.get("DS4MLX_KERNELS", "").strip().lower()
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"DS4MLX_KERNELS must be one of {BACKENDS}, got {forced!r}")
        return forced
    device = mx.default_device() if device is None else device
    kind = device if isinstance(device, mx.DeviceType) else device.type
    if kind != mx.DeviceType.gpu:
        return "reference"
    return gpu_backend() or "reference"


@lru_cache(maxsize=None)
def sections(path: str | Path) -> dict[str, str]:
    """``// @@ name`` delimited sections of a source file -> {name: text}."""
    text = Path(path).read_text()
    out: dict[str, str] = {}
    name = None
    for line in text.splitlines(keepends=True):
        m = re.match(r"^\s*//\s*@@\s*([A-Za-z0-9_]+)\s*$", line)
        if m:
            name = m.group(1)
            out.setdefault(name, "")
        elif name is not None:
            out[name] += line
    return out


class Kernel:
    """One custom kernel, two GPU faces built from (header, source) pairs.

    `metal` and `cuda` are ``(header, source)``; the source is the kernel body as
    ``mx.fast.metal_kernel`` / ``mx.fast.cuda_kernel`` expect.  Calling the kernel
    passes through ``inputs``, ``template``, ``grid`` (total threads, the Metal
    convention, which MLX's CUDA backend follows too), ``threadgroup``,
    ``output_shapes`` and ``output_dtypes``.
    """

    def __init__(self, name, input_names, output_names, *, metal, cuda):
        self.name = name
        self.input_names = list(input_names)
        self.output_names = list(output_names)
        self.faces = {"metal": metal, "cuda": cuda}
        self._built: dict[str, object] = {}

    def source(self, face: str) -> tuple[str, str]:
        return self.faces[face]

    def _build(self, face: str):
        if face not in self._built:
            header, source = self.faces[face]
            if face == "metal":
                fn = mx.fast.metal_kernel(name=self.name, input_names=self.input_names,
                                          output_names=self.output_names, source=source,
                                          header=header)
            elif face == "cuda":
                fn = mx.fast.cuda_kernel(name=self.name, input_names=self.input_names,
                                         output_names=self.output_names, source=source,
                                         header=header)
            else:
                raise ValueError(f"no GPU face {face!r}")
            self._built[face] = fn
        return self._built[face]

    def __call__(self, face: str, **kwargs) -> list[mx.array]:
        return self._build(face)(**kwargs)

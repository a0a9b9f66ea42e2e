"""GGUF block-quantized tensors as MLX modules, without dequantizing the model.

`weights.read_weights` hands a GGUF's quantized tensors out as `QuantizedTensor`
(the file's bytes, a view of the memory mapping).  `install_quantized(model,
weights)` runs after `Model.sanitize` and, per tensor, swaps the module that owns
it for one that computes on the quantized form:

* Q2_K, IQ2_XXS, Q4_K routed experts: `GGUFSwitchLinear`, the file's blocks as a
  uint8 `mx.array`, computed by `kernels.quant_moe` (mat-vec for decode, per-expert
  dequantize + matmul for prefill; decoding in float32, exact); with
  DS4MLX_GGUF_EXPERTS=blocks Q8_0 experts are kept this way too, with =repack Q4_K
  experts are repacked instead (float32 scales);
* Q8_0, Q4_0, Q4_1 (experts and dense), Q4_K (dense): the exact MLX affine repack
  (`repack`): `nn.QuantizedLinear`, `QuantizedGroupedLinear` (o_a_proj),
  `nn.QuantizedEmbedding`, `QuantizedSwitchLinear` (routed experts); group 32, 8 /
  4 bits (2 bits for the `ds4mlx quantize --experts mlx2` container);
* anything else (Q2_K dense projections, a quantized router or hyper-connection
  matrix, Q5_0 / Q6_K / ...): dequantized at load into the float module, one
  tensor at a time, with a warning in the `ds4mlx.quantized` log.

Exactness (the policy, `expert_path` / `dense_path`; tests/test_quantized_load.py
checks every type bit for bit): the repack is exact with float32 scales and biases
(see `ds4mlx.io.quant`): the MLX dequantization equals the reference `quant.dequantize`
bit for bit, so a model loaded this way computes what the float model built from
the dequantized weights computes, up to float32 summation order.  Under the float32
activation policy (`--dtype auto`, `dtype=None` or float32) nothing is rounded:
scales and biases are stored in the weights' 16-bit type only where that type holds
them exactly (Q8_0 / Q4_0 / Q4_1 in float16: d and m are float16 values, -128 d and
-8 d too unless they overflow, which `repack` refuses), else in float32 (Q4_K's
d * sc has 17 significant bits; bfloat16 holds none of them); a type kept as blocks
costs no more than the file (Q4_K: 4.5 bits per value, against 6 for its float32
repack); a dequantized fallback is float32.  Only an explicit 16-bit policy
(`--dtype float16 / bfloat16`, which rounds the activations anyway) stores scales
and dequantized weights in that type, rounded, and `describe` says so.  `repack` is
`quant.repack_for_mlx` (the numpy reference, tested equal bit for bit) redone with
MLX ops, so on a GPU it runs on the device.  Which path each weight type takes is
printed in the load banner (`paths_of`) and by `ds4mlx inspect` (`file_paths`);
docs/quantized-weights.md.

Routed experts that ds4 stores split (`mlp.experts.gate_proj` / `up_proj`, each
[E, I, H]) become the fused `gate_up_proj` the graph expects: concatenated when
both sides repack to the same MLX layout (a copy of packed arrays), otherwise a
`SplitSwitchLinear` that calls both and concatenates their outputs (gate first),
so `SwitchGLU` runs unchanged.  At decode size on a GPU face, GGUF gate / up / down banks
take `SwitchGLU.fused_weighted`'s two-launch path instead (`SplitSwitchLinear.fused_glu_weighted`).

Memory: tensors are converted one at a time, `REPACK_CHUNK_VALUES` values per
step, so the peak beyond the loaded model is about one tensor's converted size
(twice, during the final concatenation); nothing holds the whole model
dequantized.  A `GGUFSwitchLinear` costs exactly the file's bytes; a repacked
tensor costs (bits + 2) bits per value (float32 scale and bias per 32 values).
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from gguf import GGML_QUANT_SIZES

from ..io.mapped import release
from ..io.quant import MLX_EXACT_TYPES, MX_GROUP, QT, MXTensor, QuantizedTensor, as_qtype
from ..kernels import quant_moe
from .grouped_experts import gguf_per_expert
from .layers import QuantizedSwitchLinear, SwitchLinear
from .tensor_load import to_mlx

log = logging.getLogger("ds4mlx.quantized")

# Types kept as GGUF blocks and computed by `kernels.quant_moe` (routed experts):
# Q2_K / IQ2_XXS have no MLX affine form, Q4_K's exact one needs float32 scales (6 bits
# per value against the file's 4.5).  Q8_0 is supported there too, but its exact MLX
# repack (float16 scales: 9 bits per value) runs through the tuned affine kernels, so it
# is repacked.  DS4MLX_GGUF_EXPERTS (a measurement switch, both ways exact): "blocks"
# keeps every expert type quant_moe supports in the file's blocks; "repack" repacks Q4_K
# experts too (float32 scales unless the weights are float32 anyway).
KERNEL_TYPES = (QT.Q2_K, QT.IQ2_XXS, QT.Q4_K)
_EXPERT_MODES = {"auto": KERNEL_TYPES, "blocks": tuple(quant_moe.SUPPORTED), "repack": (QT.Q2_K, QT.IQ2_XXS)}
# 16-bit types that hold a type's affine scales and biases exactly (beyond float32):
# Q8_0 / Q4_0 (d, -128 d or -8 d: d is a float16), Q4_1 (d, m: float16s); not Q4_K
# (d * sc: 17 significant bits), and bfloat16 (8 significant bits) holds none
EXACT_16BIT_SCALES = {QT.Q8_0: (mx.float16,), QT.Q4_0: (mx.float16,), QT.Q4_1: (mx.float16,)}
MLX_BITS = {QT.Q8_0: 8, QT.Q4_0: 4, QT.Q4_1: 4, QT.Q4_K: 4}


def _kernel_types() -> tuple:
    mode = os.environ.get("DS4MLX_GGUF_EXPERTS", "auto").lower()
    if mode not in _EXPERT_MODES:
        raise ValueError(f"DS4MLX_GGUF_EXPERTS must be one of {', '.join(_EXPERT_MODES)}, not {mode!r}")
    return _EXPERT_MODES[mode]


# --------------------------------------------------------------------------- the policy


def exact_policy(dtype) -> bool:
    """Scales must stay exact: the float32 activation policy (`dtype` None: weights as
    stored, as on a GPU; or float32).  An explicit 16-bit dtype rounds activations anyway."""
    return dtype is None or dtype == mx.float32


def _name(dt) -> str:
    return str(dt).rsplit(".", 1)[-1]


@dataclass(frozen=True)
class WeightPath:
    """How the loader keeps a GGUF type in one role: `form` "blocks" (the file's bytes,
    quant_moe), "mlx" (the affine repack; `dtype` its scales and biases) or "dequantized"
    (`dtype` the float weights); `exact`: the dequantized values are the reference's."""

    form: str
    dtype: object = None
    exact: bool = True
    bits: int = 0

    def describe(self) -> str:
        tail = "exact" if self.exact else f"rounded to {_name(self.dtype)}"
        if self.form == "blocks":
            return f"GGUF blocks, quant_moe kernels ({tail})"
        if self.form == "mlx":
            return f"MLX {self.bits}-bit affine, {_name(self.dtype)} scales ({tail} repack)"
        return f"dequantized at load to {_name(self.dtype)} ({tail})"


def scale_dtype_for(qtype, compute, exact: bool):
    """The type of `qtype`'s MLX affine scales and biases in a model computing in `compute`."""
    if compute == mx.float32 or not exact:
        return compute
    return compute if compute in EXACT_16BIT_SCALES.get(as_qtype(qtype), ()) else mx.float32


def _scales_exact(qtype, dtype) -> bool:
    return dtype == mx.float32 or dtype in EXACT_16BIT_SCALES.get(as_qtype(qtype), ())


def expert_path(qtype, compute, exact: bool) -> WeightPath:
    """Routed experts [E, out, in] of `qtype` in a model computing in `compute`."""
    qtype = as_qtype(qtype)
    if qtype in _kernel_types():
        return WeightPath("blocks")
    return dense_path(qtype, compute, exact)


def dense_path(qtype, compute, exact: bool) -> WeightPath:
    """A weight of `qtype` owned by a quantizable module (linear, embedding, grouped linear)."""
    qtype = as_qtype(qtype)
    if qtype in MLX_EXACT_TYPES:
        dt = scale_dtype_for(qtype, compute, exact)
        return WeightPath("mlx", dt, _scales_exact(qtype, dt), MLX_BITS[qtype])
    dt = mx.float32 if exact else compute
    return WeightPath("dequantized", dt, dt == mx.float32)


class QuantizedPaths:
    """{"<role> <type>": description} of a loaded model (a plain attribute of its root
    module, not a parameter): what the load banner prints."""

    def __init__(self):
        self.paths: dict[str, set] = {}

    def add(self, role: str, kind: str, description: str) -> None:
        self.paths.setdefault(f"{role} {kind}", set()).add(description)

    def lines(self) -> list[str]:
        return [f"{k}: {' / '.join(sorted(v))}" for k, v in sorted(self.paths.items())]


def paths_of(model: nn.Module) -> list[str]:
    """The load banner's lines: how each quantized weight type of `model` is kept."""
    got = model.__dict__.get("quantized_paths")
    return got.lines() if got is not None else []


def _paths(model: nn.Module) -> QuantizedPaths:
    got = model.__dict__.get("quantized_paths")
    if got is None:
        got = QuantizedPaths()
        model.quantized_paths = got
    return got


def record_expert_paths(model: nn.Module, banks, dtype, compute) -> None:
    """Streamed routed experts (built later, per read): their path, for the banner."""
    for v in banks:
        if isinstance(v, QuantizedTensor):
            _paths(model).add(
                "experts", as_qtype(v.qtype).name, expert_path(v.qtype, compute, exact_policy(dtype)).describe()
            )
        elif isinstance(v, MXTensor):
            _paths(model).add("experts", v.mode, f"MLX {v.mode} (the file's bytes, exact)")


def file_paths(tensors, compute, exact: bool = True) -> list[str]:
    """`ds4mlx inspect`'s lines: [(name, GGUF type name, ndim)] -> how a load computing in
    `compute` keeps each quantized type (routed expert banks: 3-D tensors under an
    experts name; the rest as a quantizable module's weight: a router or other plain
    matrix is dequantized instead, and logged)."""
    out = QuantizedPaths()
    for name, tname, ndim in tensors:
        try:
            qtype = as_qtype(tname)
        except (ValueError, TypeError):
            continue
        if GGML_QUANT_SIZES[qtype][0] == 1:  # F32, F16, BF16, I32 ...: not block-quantized
            continue
        expert = ndim == 3 and ("_exps." in name or ".experts." in name)
        fn = expert_path if expert else dense_path
        out.add("experts" if expert else "dense", qtype.name, fn(qtype, compute, exact).describe())
    return out.lines()


REPACK_CHUNK_VALUES = 1 << 24  # values converted per step (bounds the load-time peak)

_GATE, _UP = "mlp.experts.gate_proj", "mlp.experts.up_proj"
_FUSED = "mlp.experts.gate_up_proj"


# --------------------------------------------------------------------------- modules


class GGUFSwitchLinear(nn.Module):
    """Per-expert linear over GGUF blocks: weight uint8 [E, out, row_bytes] (the
    file's bytes), computed by `kernels.quant_moe.gather_qmatmul` (mat-vec for few
    (token, expert) pairs, i.e. decode; per-expert dequantize + matmul for many,
    i.e. prefill).  Called like `SwitchLinear`: x [..., 1, in], indices [...]
    broadcasting against x's leading axes -> [..., 1, out] in x.dtype."""

    def __init__(self, blocks: mx.array, qtype, input_dims: int):
        super().__init__()
        if blocks.dtype != mx.uint8 or blocks.ndim != 3:
            raise ValueError("GGUFSwitchLinear wants uint8 [E, out, row_bytes] blocks")
        self.weight = blocks
        self.qtype = as_qtype(qtype)
        self.input_dims = int(input_dims)
        self.freeze()

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]

    @property
    def output_dims(self) -> int:
        return self.weight.shape[1]

    def _extra_repr(self) -> str:
        return (
            f"{self.qtype.name}, experts={self.num_experts}, input_dims={self.input_dims}, "
            f"output_dims={self.output_dims}"
        )

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        if x.shape[-2] != 1:
            raise ValueError("GGUFSwitchLinear takes one row per (token, expert): x [..., 1, in]")
        K = x.shape[-1]
        xb = tuple(x.shape[:-2])
        batch = tuple(np.broadcast_shapes(xb, tuple(indices.shape))) or (1,)
        lead, k = batch[:-1], batch[-1]
        n = int(np.prod(lead, dtype=np.int64)) if lead else 1
        if len(xb) == len(batch) and xb[-1] == 1 and xb[:-1] == lead:
            x2 = x.reshape(n, K)  # one vector per token, shared by its k experts
        else:
            x2 = mx.broadcast_to(x.reshape(*xb, K), (*batch, K)).reshape(n, k, K)
        ids = mx.broadcast_to(indices, batch).reshape(n, k)
        # sorted_indices: SwitchGLU's pairs come in expert order (one per row of x)
        y = quant_moe.gather_qmatmul(x2, self.weight, self.qtype, ids, sorted_indices=sorted_indices)  # [n, k, out]
        return y.reshape(*batch, 1, self.output_dims)

    def per_expert(self, x: mx.array, experts: mx.array, lengths: mx.array | None = None) -> mx.array:
        """x [B, M, in], experts [B] -> [B, M, out]: prefill's grouped path
        (models/grouped_experts.py; `lengths` [B]: live rows per batch, the rest zero padding)."""
        return gguf_per_expert(x, self.weight, self.qtype, experts, lengths)


class SplitSwitchLinear(nn.Module):
    """Separate gate and up expert projections answering as the fused
    `gate_up_proj`: the outputs concatenated, gate first."""

    def __init__(self, gate_proj: nn.Module, up_proj: nn.Module):
        super().__init__()
        self.gate_proj = gate_proj
        self.up_proj = up_proj

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        g = self.gate_proj(x, indices, sorted_indices=sorted_indices)
        u = self.up_proj(x, indices, sorted_indices=sorted_indices)
        return mx.concatenate([g, u.astype(g.dtype)], axis=-1)

    def fused_glu_weighted(
        self, down: nn.Module, x: mx.array, indices: mx.array, weights: mx.array, limit: float | None
    ) -> mx.array | None:
        """`SwitchGLU.fused_weighted` for GGUF experts: gate and up banks of one type and
        shape and a GGUF down bank, at decode size on a GPU face, in two launches
        (`quant_moe.gather_swiglu_blocks`, `gather_down_sum_blocks`) instead of seven (two
        mat-vecs, a concatenation, the SwiGLU, the down mat-vec, the weighting, the sum).
        None otherwise: the caller runs the unfused expression."""
        g, u = self.gate_proj, self.up_proj
        if not (
            isinstance(g, GGUFSwitchLinear) and isinstance(u, GGUFSwitchLinear) and isinstance(down, GGUFSwitchLinear)
        ):
            return None
        if g.qtype != u.qtype or g.weight.shape != u.weight.shape or x.shape[-1] != g.input_dims:
            return None
        k = indices.shape[-1]
        n = indices.size // k
        if n * k > quant_moe.QMV_MAX_PAIRS_AUTO or x.size != n * x.shape[-1]:
            return None  # prefill, or not one vector per token: the unfused path
        if quant_moe.moe_face(g.qtype) is None or quant_moe.moe_face(down.qtype) is None:
            return None
        ids = indices.reshape(n, k).astype(mx.int32)
        h = quant_moe.gather_swiglu_blocks(x.reshape(n, -1), g.weight, u.weight, g.qtype, ids, limit=limit)
        y = quant_moe.gather_down_sum_blocks(h, down.weight, down.qtype, ids, weights.reshape(n, k))
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @property
    def per_expert(self):
        """Both halves' `per_expert`, concatenated (gate first); absent (AttributeError,
        so `hasattr` is False) when either half has none."""
        gate, up = self.gate_proj.per_expert, self.up_proj.per_expert

        def both(x: mx.array, experts: mx.array, lengths: mx.array | None = None) -> mx.array:
            g = gate(x, experts, lengths)
            return mx.concatenate([g, up(x, experts, lengths).astype(g.dtype)], axis=-1)

        return both


# --------------------------------------------------------------------------- conversions


def _chunks(n: int, per_row: int):
    step = max(1, REPACK_CHUNK_VALUES // max(per_row, 1))
    for a in range(0, n, step):
        yield a, min(n, a + step)


def _f16(b: mx.array, i: int) -> mx.array:
    """Little-endian float16 at bytes i, i+1 of the last axis -> float32."""
    bits = b[..., i].astype(mx.uint16) | (b[..., i + 1].astype(mx.uint16) << 8)
    return bits.view(mx.float16).astype(mx.float32)


def _pack(levels: mx.array, bits: int) -> mx.array:
    """[..., K] uint8 levels < 2**bits -> [..., K*bits/32] uint32, MLX's packing
    (element j of a word at bits [j*bits, (j+1)*bits): little-endian bytes)."""
    per = 8 // bits
    lv = levels.reshape(*levels.shape[:-1], -1, per)
    byte = lv[..., 0]
    for j in range(1, per):
        byte = byte | (lv[..., j] << (bits * j))
    return byte.view(mx.uint32)


def _affine_mx(b: mx.array, qtype: QT):
    """GGUF blocks [R, nb, block_bytes] uint8 -> (levels [R, nb*elems] uint8,
    scales, biases [R, nb*elems/32] float32, bits): `quant._affine_params` in MLX
    ops (the same float32 operations, so the same bits)."""
    R = b.shape[0]
    if qtype == QT.Q8_0:
        d = _f16(b, 0)
        return (b[..., 2:] ^ 128).reshape(R, -1), d, d * -128.0, 8
    if qtype in (QT.Q4_0, QT.Q4_1):
        qs = b[..., -16:]
        lv = mx.concatenate([qs & 15, qs >> 4], axis=-1).reshape(R, -1)
        d = _f16(b, 0)
        return lv, d, (d * -8.0 if qtype == QT.Q4_0 else _f16(b, 2)), 4
    if qtype == QT.Q4_K:
        d, dmin = _f16(b, 0)[..., None], _f16(b, 2)[..., None]
        sc, m = quant_moe.q4k_scale_min(b[..., 4:16])
        qs = b[..., 16:144].reshape(R, -1, 4, 1, 32)
        lv = mx.concatenate([qs & 15, qs >> 4], axis=-2).reshape(R, -1)
        return lv, (d * sc.astype(mx.float32)).reshape(R, -1), (-(dmin * m.astype(mx.float32))).reshape(R, -1), 4
    raise AssertionError(qtype)


def _narrow(w_q: mx.array) -> mx.array:
    """4-bit packed words whose levels are all < 4 -> the same levels packed in 2 bits."""
    by = w_q.view(mx.uint8)
    lv = mx.stack([by & 3, (by >> 4) & 3], axis=-1).reshape(*by.shape[:-1], -1)
    return _pack(lv, 2)


def repack(qt: QuantizedTensor, scale_dtype=mx.float32, exact: bool = True):
    """Exact MLX affine form of `qt`: (w_q, scales, biases, group_size=32, bits),
    evaluated, or None (a type with no exact form).  What
    `quant.repack_for_mlx(raw, qtype, shape)` returns (the reference, numpy),
    computed with MLX ops on the default device, `REPACK_CHUNK_VALUES` values at
    a time; a Q4_1 / Q4_K tensor whose levels all fit in 2 bits (the mlx2
    container) comes back as bits = 2.  Scales and biases are float32 unless
    `scale_dtype` says otherwise: with `exact`, a ValueError when a value does not
    convert to it exactly (a Q8_0 / Q4_0 block scale past float16's range);
    without, rounded (an explicit 16-bit policy)."""
    qtype, shape = as_qtype(qt.qtype), tuple(int(s) for s in qt.shape)
    if qtype not in MLX_EXACT_TYPES or len(shape) < 1:
        return None
    K = shape[-1]
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    raw = np.asarray(qt.raw).reshape(-1, K // elems * nbytes)
    parts, top = [], 0
    for a, b in _chunks(raw.shape[0], K):
        blocks = mx.array(raw[a:b]).reshape(b - a, K // elems, nbytes)
        lv, s, z, bits = _affine_mx(blocks, qtype)
        w = _pack(lv, bits)
        hi = lv.max() if bits == 4 and qtype in (QT.Q4_1, QT.Q4_K) else mx.array(255, mx.uint8)
        mx.eval(w, s, z, hi)
        top = max(top, hi.item())
        parts.append((w, s, z))
    if top < 4:
        parts = [(_narrow(w), s, z) for w, s, z in parts]
        bits = 2
    lead = shape[:-1]
    out = [mx.concatenate([p[i] for p in parts], axis=0) if len(parts) > 1 else parts[0][i] for i in range(3)]
    del parts
    out = [a.reshape(*lead, -1) for a in out]
    if scale_dtype != mx.float32:
        narrow = [a.astype(scale_dtype) for a in out[1:]]
        if exact and not all(
            mx.array_equal(n.astype(mx.float32), a, equal_nan=True).item() for n, a in zip(narrow, out[1:])
        ):
            raise ValueError(
                f"a {qtype.name} tensor {shape}: its scales do not fit {_name(scale_dtype)} exactly "
                "(block scales past its range): load it with --dtype float32"
            )
        out[1:] = narrow
    mx.eval(out)
    return (*out, 32, bits)


def dequantize_chunked(qt: QuantizedTensor, dtype=mx.float32) -> mx.array:
    """Reference dequantization of `qt` into an MLX array of `dtype`, a chunk of the
    first axis at a time (no float32 copy of the whole tensor)."""
    shape = tuple(int(s) for s in qt.shape)
    if len(shape) < 2:
        return mx.array(qt.dequantize()).astype(dtype)
    per_row = int(np.prod(shape[1:], dtype=np.int64))
    from ..io.quant import dequantize

    parts = []
    for a, b in _chunks(shape[0], per_row):
        p = mx.array(dequantize(qt.raw[a:b], qt.qtype, (b - a, *shape[1:]))).astype(dtype)
        mx.eval(p)
        parts.append(p)
    out = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
    mx.eval(out)
    return out


def _bare(cls, **attrs):
    """An instance of an MLX quantized layer with the given attributes, built without
    its constructor (which would draw random placeholder weights)."""
    m = cls.__new__(cls)
    nn.Module.__init__(m)
    for k, v in attrs.items():
        setattr(m, k, v)
    m.freeze()
    return m


def _quantizable(mod) -> bool:
    return type(mod) in (nn.Linear, nn.Embedding) or (isinstance(mod, nn.Module) and hasattr(mod, "to_quantized"))


def _mx_arrays(val: MXTensor):
    """MXTensor -> (w_q uint32 [..., out, in*bits/32], scales uint8, None, 32, bits),
    the file's bytes reinterpreted (MLX's mxfp8 / mxfp4 layouts are the same bytes)."""
    w = _mlx_of(val.weight).view(mx.uint8).view(mx.uint32)
    s = _mlx_of(val.scales).view(mx.uint8)
    mx.eval(w, s)
    release(val)
    return w, s, None, MX_GROUP, val.bits


def _mlx_of(v) -> mx.array:
    return v.to_mlx() if hasattr(v, "to_mlx") else mx.array(np.asarray(v))


def _affine_module(mod: nn.Module, rep, mode: str = "affine"):
    """The quantized counterpart of float module `mod` holding the repacked arrays
    `rep` = (w_q, scales, biases or None, group_size, bits); None when `mod` has none."""
    w, s, b, gs, bits = rep
    extra = {} if b is None else {"biases": b}
    if type(mod) is nn.Linear:
        q = _bare(nn.QuantizedLinear, group_size=gs, bits=bits, mode=mode, weight=w, scales=s, **extra)
        if "bias" in mod:
            q.bias = mod.bias
        return q
    if type(mod) is nn.Embedding:
        n, dims = mod.weight.shape
        return _bare(
            nn.QuantizedEmbedding,
            group_size=gs,
            bits=bits,
            mode=mode,
            weight=w,
            scales=s,
            num_embeddings=n,
            dims=dims,
            **extra,
        )
    if not hasattr(mod, "to_quantized"):
        return None
    # Family modules (SwitchLinear, GroupedLinear, ...): their own to_quantized gives
    # the right class and array shapes (lazily, from zero placeholders that are
    # never evaluated); the repacked arrays replace those placeholders.
    q = mod.to_quantized(group_size=gs, bits=bits, mode=mode)
    if getattr(q, "bits", bits) != bits or getattr(q, "group_size", gs) != gs:
        return None
    for name, arr in (("weight", w), ("scales", s), ("biases", b)):
        have = q.get(name) if hasattr(q, "get") else None
        if arr is None and have is None:
            continue
        if have is None or arr is None or have.size != arr.size:
            return None
        setattr(q, name, arr.reshape(have.shape))
    return q


def _expert_module(val, compute_dtype, exact: bool, name: str, stats: Counter, paths: QuantizedPaths) -> nn.Module:
    """One [E, out, in] routed-expert projection as a module."""
    if isinstance(val, MXTensor):
        E, out, K = (int(s) for s in val.shape)
        w, s, _, gs, bits = _mx_arrays(val)
        stats[f"{val.mode}->mlx-{val.mode}"] += 1
        paths.add("experts", val.mode, f"MLX {val.mode} (the file's bytes, exact)")
        return _bare(QuantizedSwitchLinear, group_size=gs, bits=bits, mode=val.mode, weight=w, scales=s, biases=None)
    if isinstance(val, QuantizedTensor):
        E, out, K = (int(s) for s in val.shape)
        qtype = as_qtype(val.qtype)
        how = expert_path(qtype, compute_dtype, exact)
        if how.form == "mlx":
            rep = repack(val, how.dtype, exact)
            release(val)
            q = _affine_module(SwitchLinear(K, out, E), rep)
            stats[f"{qtype.name}->mlx{rep[4]}"] += 1
            paths.add("experts", qtype.name, WeightPath("mlx", how.dtype, how.exact, rep[4]).describe())
            return q
        paths.add("experts", qtype.name, how.describe())
        if how.form == "blocks":
            stats[f"{qtype.name}->gguf"] += 1
            blocks = to_mlx(val.raw)  # copied a block of rows at a time, pages released
            release(val)
            return GGUFSwitchLinear(blocks, qtype, K)
        log.warning(
            "%s: %s routed experts have no MLX or kernel path: dequantized at load to %s",
            name,
            qtype.name,
            _name(how.dtype),
        )
        stats[f"{qtype.name}->dequantized"] += 1
        arr = dequantize_chunked(val, how.dtype)
        release(val)
    else:
        arr = val if isinstance(val, mx.array) else mx.array(val)
        arr = arr.astype(compute_dtype) if mx.issubdtype(arr.dtype, mx.floating) else arr
    E, out, K = arr.shape
    m = SwitchLinear(K, out, E)
    m.weight = arr
    return m


def _fuse_pair(gate: nn.Module, up: nn.Module) -> nn.Module:
    """gate/up expert modules -> one `gate_up_proj` module."""
    if type(gate) is SwitchLinear and type(up) is SwitchLinear:
        m = SwitchLinear(gate.weight.shape[2], gate.weight.shape[1] + up.weight.shape[1], gate.weight.shape[0])
        dt = gate.weight.dtype if gate.weight.dtype == up.weight.dtype else mx.float32  # never a rounding cast
        m.weight = mx.concatenate([gate.weight.astype(dt), up.weight.astype(dt)], axis=1)
        mx.eval(m.weight)
        return m
    if (
        type(gate) is QuantizedSwitchLinear
        and type(up) is QuantizedSwitchLinear
        and (gate.bits, gate.group_size, gate.mode) == (up.bits, up.group_size, up.mode)
        and gate.scales.dtype == up.scales.dtype
    ):
        m = _bare(
            QuantizedSwitchLinear,
            group_size=gate.group_size,
            bits=gate.bits,
            mode=gate.mode,
            weight=mx.concatenate([gate.weight, up.weight], axis=1),
            scales=mx.concatenate([gate.scales, up.scales], axis=1),
            biases=None if gate.biases is None else mx.concatenate([gate.biases, up.biases], axis=1),
        )
        mx.eval(m.parameters())
        return m
    return SplitSwitchLinear(gate, up)


def _set_module(root: nn.Module, path: str, new: nn.Module) -> None:
    obj = root
    parts = path.split(".")
    for p in parts[:-1]:
        obj = obj[int(p)] if isinstance(obj, (list, tuple)) else obj[p]
    last = parts[-1]
    if isinstance(obj, list):
        obj[int(last)] = new
    else:
        setattr(obj, last, new)


def _module_params(prefix: str, mod: nn.Module) -> dict:
    from mlx.utils import tree_flatten

    return {f"{prefix}.{k}": v for k, v in tree_flatten(mod.parameters())}


def _infer_compute_dtype(weights: dict):
    """The dtype most of the file's float matrices have (the model's compute dtype
    when the loader does not cast), float32 if none."""
    counts = Counter(
        v.dtype
        for v in weights.values()
        if isinstance(v, mx.array) and v.ndim >= 2 and mx.issubdtype(v.dtype, mx.floating)
    )
    return counts.most_common(1)[0][0] if counts else mx.float32


def compute_dtype_of(weights: dict):
    """The compute dtype `install_quantized` infers for `weights` when the caller gives
    none (the expert store builds experts apart from the rest: it asks the rest)."""
    return _infer_compute_dtype(weights)


# --------------------------------------------------------------------------- entry point


def needs_install(weights: dict) -> bool:
    return any(isinstance(v, (QuantizedTensor, MXTensor)) or k.endswith((_GATE, _UP)) for k, v in weights.items())


def install_quantized(model: nn.Module, weights: dict, dtype=None, stored=None) -> tuple[dict, dict]:
    """Swap `model`'s modules for the quantized forms of `weights`' QuantizedTensors.

    `weights`: sanitized parameter names -> mx.array or QuantizedTensor (split
    routed experts under `...mlp.experts.gate_proj` / `up_proj`).  `dtype`: the
    model's compute dtype if the caller casts float weights to one; None: weights as
    stored, float32 activations (their type `stored`, else inferred from the float
    matrices); see `exact_policy`.  Returns (float_weights, module_weights): the first
    still to be cast to `dtype` by the caller, the second the installed modules'
    arrays (packed weights, float32 or 16-bit scales), to be loaded as they are.
    Records each type's path in `model.quantized_paths` (`paths_of`).
    """
    exact = exact_policy(dtype)
    compute = dtype if dtype is not None else stored if stored is not None else _infer_compute_dtype(weights)
    paths = _paths(model)
    modules = dict(model.named_modules())
    floats, owned, stats = {}, {}, Counter()
    todo = dict(weights)

    # split routed experts -> gate_up_proj
    for key in [k for k in todo if k.endswith(_GATE)]:
        prefix = key[: -len(_GATE)]
        ukey = prefix + _UP
        if ukey not in todo:
            raise ValueError(f"{key} has no matching {ukey}")
        gate = _expert_module(todo.pop(key), compute, exact, key, stats, paths)
        up = _expert_module(todo.pop(ukey), compute, exact, ukey, stats, paths)
        path = prefix + _FUSED
        if path not in modules:
            raise ValueError(f"the model has no module {path} for {key}")
        mod = _fuse_pair(gate, up)
        _set_module(model, path, mod)
        owned.update(_module_params(path, mod))
    stray = [k for k in todo if k.endswith(_UP)]
    if stray:
        raise ValueError(f"{stray[0]} has no matching {_GATE}")

    for key, val in todo.items():
        if isinstance(val, MXTensor):
            path, _, attr = key.rpartition(".")
            mod = modules.get(path)
            new = None
            if attr == "weight" and isinstance(mod, SwitchLinear) and len(val.shape) == 3:
                new = _expert_module(val, compute, exact, key, stats, paths)
            elif attr == "weight" and _quantizable(mod):
                new = _affine_module(mod, _mx_arrays(val), mode=val.mode)
            if new is not None:
                if not isinstance(mod, SwitchLinear):
                    stats[f"{val.mode}->mlx-{val.mode}"] += 1
                    paths.add("dense", val.mode, f"MLX {val.mode} (the file's bytes, exact)")
                _set_module(model, path, new)
                owned.update(_module_params(path, new))
                continue
            log.warning("%s: %s %s has no quantized module here: dequantized at load", key, val.mode, tuple(val.shape))
            stats[f"{val.mode}->dequantized"] += 1
            paths.add("dense", val.mode, WeightPath("dequantized", mx.float32 if exact else compute, exact).describe())
            floats[key] = mx.array(val.dequantize()).astype(mx.float32 if exact else compute)
            mx.eval(floats[key])
            continue
        if not isinstance(val, QuantizedTensor):
            floats[key] = val
            continue
        path, _, attr = key.rpartition(".")
        mod = modules.get(path)
        qtype = as_qtype(val.qtype)
        new = None
        if attr == "weight" and isinstance(mod, SwitchLinear) and len(val.shape) == 3:
            new = _expert_module(val, compute, exact, key, stats, paths)
        elif attr == "weight" and _quantizable(mod) and qtype in MLX_EXACT_TYPES:
            how = dense_path(qtype, compute, exact)
            new = _affine_module(mod, repack(val, how.dtype, exact))
            if new is not None:
                stats[f"{qtype.name}->mlx{new.bits}"] += 1
                paths.add("dense", qtype.name, WeightPath("mlx", how.dtype, how.exact, new.bits).describe())
        if new is not None:
            release(val)
            _set_module(model, path, new)
            owned.update(_module_params(path, new))
            continue
        log.warning("%s: %s %s has no quantized module here: dequantized at load", key, qtype.name, tuple(val.shape))
        stats[f"{qtype.name}->dequantized"] += 1
        # float32 under the float32 activation policy: a 16-bit copy would round the decoded values
        dt = mx.float32 if exact or len(val.shape) < 2 else compute
        how = WeightPath("dequantized", dt, dt == mx.float32)
        paths.add("dense", qtype.name, how.describe())
        floats[key] = dequantize_chunked(val, how.dtype)
        release(val)
    if stats:
        log.info("quantized tensors: %s", ", ".join(f"{k} x{n}" for k, n in sorted(stats.items())))
    return floats, owned


def quantized_summary(model: nn.Module) -> dict:
    """{module class name (+ qtype / bits): count} over the model's quantized modules."""
    out = Counter()
    for _, m in model.named_modules():
        if isinstance(m, GGUFSwitchLinear):
            out[f"GGUFSwitchLinear[{m.qtype.name}]"] += 1
        elif type(m).__name__.startswith("Quantized"):
            out[f"{type(m).__name__}[{m.bits}bit]"] += 1
    return dict(out)


__all__ = [
    "GGUFSwitchLinear",
    "SplitSwitchLinear",
    "install_quantized",
    "needs_install",
    "repack",
    "dequantize_chunked",
    "quantized_summary",
    "compute_dtype_of",
    "KERNEL_TYPES",
    "WeightPath",
    "expert_path",
    "dense_path",
    "exact_policy",
    "paths_of",
    "file_paths",
    "record_expert_paths",
]

"""Building blocks shared by the model families (DeepSeek V4, GLM 5.x, Qwen3.8).

Everything here is plain MLX and family-agnostic:

* RMS norms (`rms_norm`, weighted or not) on top of `mx.fast.rms_norm`;
* rotary embeddings: default and YaRN inverse frequencies (`default_inv_freq`,
  `yarn_inv_freq`) and `RoPE`, an interleaved ("traditional") rope applied to the
  *trailing* `dims` channels of each head via `mx.fast.rope`;
* manifold-constrained hyper-connections (mHC): the `HyperConnection` / `HyperHead`
  parameter holders; the functions (`hc_pre`, `hc_mix`, `hc_post`, `hc_head`) live in
  kernels/hyper_connection.py (fused on a GPU, the reference graph of
  kernels/hyper_connection_reference.py elsewhere);
* mixture of experts: `SwitchLinear` / `QuantizedSwitchLinear` (`mx.gather_mm` /
  `mx.gather_qmm`, quantizable with `nn.quantize`), `SwitchGLU` (fused gate/up,
  clamped SwiGLU), `GLUMLP` (the dense/shared expert), router helpers.

Dtype policy: matmuls run in the weights' dtype; softmax, Sinkhorn and router
scores are computed in float32.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..io.quant import expert_spans, grouped_gemm_spans
from ..kernels import affine_qmv, qmv_hc
from ..kernels import hyper_connection as hc_kernels
from ..kernels.activations import clamped_swiglu  # re-exported: the families import it from here
from . import grouped_experts, prefill_experts

# --------------------------------------------------------------------------- embedding


class ActivationDtype:
    """Mixin for a family's backbone (the module holding `embed_tokens`): `embed(ids)` gives the
    token rows in the residual stream's dtype.  The loader sets `activation_dtype` from the dtype
    policy (float32 as ds4, whatever the weights' type); None = the embedding's own dtype.  Every
    path (forward, decode step, batched rows, verify chain, MTP heads) enters through `embed`, so
    a 16-bit embedding never sets the stream's dtype: MLX promotes each 16-bit weight to the
    stream's float32 from there on."""

    activation_dtype = None

    def embed(self, ids: mx.array) -> mx.array:
        h = self.embed_tokens(ids)
        return h if self.activation_dtype is None else h.astype(self.activation_dtype)


def set_activation_dtype(model: nn.Module, dtype) -> int:
    """Set `dtype` on every `ActivationDtype` module of `model` (the backbone, an MTP head's own
    embedding); returns how many were set."""
    n = 0
    for _, m in model.named_modules():
        if isinstance(m, ActivationDtype):
            m.activation_dtype = dtype
            n += 1
    return n


# --------------------------------------------------------------------------- norms


def rms_norm(x: mx.array, weight: mx.array | None, eps: float) -> mx.array:
    """RMSNorm over the last axis (`weight=None`: unweighted)."""
    return mx.fast.rms_norm(x, weight, eps)


class RMSNorm(nn.Module):
    def __init__(self, dims: int, eps: float = 1e-6):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, self.weight.astype(x.dtype), self.eps)


# --------------------------------------------------------------------------- rope


def default_inv_freq(dim: int, base: float) -> mx.array:
    """1 / base^(2i/dim), i < dim/2 (float32, computed as transformers does)."""
    exps = mx.arange(0, dim, 2, dtype=mx.float32) / dim
    return 1.0 / (base**exps)


def yarn_inv_freq(
    dim: int,
    base: float,
    factor: float,
    original_max_position_embeddings: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    truncate: bool = True,
) -> mx.array:
    """YaRN ("NTK-by-parts") inverse frequencies, as transformers' `_compute_yarn_parameters`.

    Only the frequencies: the attention factor (mscale) is the caller's business
    (DeepSeek V4 forces it to 1.0).
    """

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (mx.arange(0, dim, 2, dtype=mx.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    ramp = mx.clip((mx.arange(dim // 2, dtype=mx.float32) - low) / (high - low), 0.0, 1.0)
    extra_factor = 1.0 - ramp
    return interpolation * (1.0 - extra_factor) + extrapolation * extra_factor


def inv_freq_from_params(dim: int, params: dict, max_position_embeddings: int) -> mx.array:
    """Inverse frequencies from a transformers-style rope parameter dict."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    base = float(params["rope_theta"])
    if rope_type == "default":
        return default_inv_freq(dim, base)
    if rope_type == "yarn":
        factor = params.get("factor")
        orig = params.get("original_max_position_embeddings", max_position_embeddings)
        if factor is None:
            factor = max_position_embeddings / orig
        return yarn_inv_freq(
            dim,
            base,
            float(factor),
            int(orig),
            float(params.get("beta_fast") or 32),
            float(params.get("beta_slow") or 1),
            # transformers reads `truncate` from the *top-level* rope dict, which for
            # DeepSeek V4's nested {"main", "compress"} layout never has it: always True.
            True,
        )
    raise ValueError(f"unsupported rope_type {rope_type!r}")


def attention_factor_from_params(params: dict, max_position_embeddings: int) -> float:
    """The cos/sin scale transformers applies (YaRN's mscale; 1.0 for default rope)."""
    if params.get("rope_type", params.get("type", "default")) != "yarn":
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = params.get("factor") or max_position_embeddings / params["original_max_position_embeddings"]

    def get_mscale(scale, mscale=1.0):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all:
        return float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all))
    return float(get_mscale(factor))


class RoPE(nn.Module):
    """Interleaved rope (pairs (2i, 2i+1)) on the trailing `dims` channels: `[nope | rope]`.

    `__call__(x, offset, scale)` rotates row `j` of axis -2 by angle
    `scale * (offset + j) * inv_freq`; `scale=-1` gives the inverse rotation at
    positions `offset + j`, and `scale=m` positions `m*offset, m*(offset+1), ...`.
    """

    def __init__(self, dims: int, inv_freq: mx.array, attention_factor: float = 1.0):
        super().__init__()
        self.dims = dims
        self._freqs = (1.0 / inv_freq).astype(mx.float32)  # mx.fast.rope wants periods
        # a constant: left lazy, a compiled decode step would recompute it (3 launches) per token
        mx.eval(self._freqs)
        self._mscale = attention_factor  # transformers multiplies cos and sin by it
        self._wide: dict[int, mx.array] = {}  # full width -> periods with inf on the nope pairs

    @property
    def periods(self) -> mx.array:
        """[dims / 2] float32 periods (1 / inv_freq) of the rotated pairs, as mx.fast.rope takes
        them: the fused kernels (kernels/attn_prep.py) rotate with the same numbers."""
        return self._freqs

    @property
    def attention_factor(self) -> float:
        """The scale of the rotated channels (YaRN's mscale; 1.0 for default rope)."""
        return self._mscale

    def _full_width(self, d: int) -> mx.array:
        """Periods for rotating all d channels in one launch: the nope pairs get an infinite
        period (angle 0: cos 1, sin 0, the channels come back unchanged bit for bit), which
        saves the slice + concatenate of a partial rope (two launches per call at decode)."""
        f = self._wide.get(d)
        if f is None:
            f = mx.concatenate([mx.full(((d - self.dims) // 2,), mx.inf, mx.float32), self._freqs])
            mx.eval(f)
            self._wide[d] = f
        return f

    def __call__(self, x: mx.array, offset: int | mx.array = 0, scale: float = 1.0) -> mx.array:
        if self.dims == 0:
            return x
        d = x.shape[-1]
        if self.dims < d and self._mscale == 1.0 and (d - self.dims) % 2 == 0:
            return mx.fast.rope(
                x, d, traditional=True, base=None, scale=scale, offset=offset, freqs=self._full_width(d)
            )
        rope = x if self.dims == d else x[..., d - self.dims :]
        rope = mx.fast.rope(rope, self.dims, traditional=True, base=None, scale=scale, offset=offset, freqs=self._freqs)
        if self._mscale != 1.0:
            rope = rope * self._mscale
        if self.dims == d:
            return rope
        return mx.concatenate([x[..., : d - self.dims], rope], axis=-1)


# --------------------------------------------------------------------------- mHC


def _norm_pair(norm: RMSNorm | None):
    """An RMSNorm as the hyper-connection kernels take it: (weight, eps), or None."""
    return None if norm is None else (norm.weight, norm.eps)


class HyperConnection(nn.Module):
    """Parameters of one mHC site (names as transformers: fn, base, scale)."""

    def __init__(self, hc_mult: int, hidden_size: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
        super().__init__()
        k = (2 + hc_mult) * hc_mult
        self.fn = mx.zeros((k, hc_mult * hidden_size))
        self.base = mx.zeros((k,))
        self.scale = mx.ones((3,))
        self._iters, self._hc_eps, self._norm_eps = sinkhorn_iters, hc_eps, norm_eps

    def __call__(self, x: mx.array, norm: RMSNorm | None = None):
        """(post, comb, collapsed); with `norm` the collapsed vector comes out through that
        RMSNorm (folded into the same launch on a GPU: the decode step)."""
        # one fused launch on a GPU, `hc_pre` (the reference) on the CPU
        return hc_kernels.hc_pre(x, self.fn, self.base, self.scale, norm=_norm_pair(norm), **self._settings())

    def after_post(
        self,
        x: mx.array,
        out: mx.array,
        post: mx.array,
        comb: mx.array,
        norm: RMSNorm | None = None,
        out2: mx.array | None = None,
    ):
        """``hc_post(x, out [+ out2], post, comb)`` of the previous site, then this site on the
        result: (new streams, post, comb, collapsed [through `norm`]); at decode on a GPU
        two launches instead of three (`kernels.hyper_connection.hc_post_pre`).  `out` may be an
        MoE's output not launched yet (`kernels.qmv_hc.DownSumShared`): on CUDA its launch is
        this one."""
        if isinstance(out, qmv_hc.DownSumShared):
            if out2 is not None:
                raise ValueError("a deferred MoE output is the whole output: no out2")
            return out.hc_post_pre(
                x, post, comb, self.fn, self.base, self.scale, norm=_norm_pair(norm), **self._settings()
            )
        return hc_kernels.hc_post_pre(
            x, out, post, comb, self.fn, self.base, self.scale, norm=_norm_pair(norm), out2=out2, **self._settings()
        )

    def after_linear_post(
        self,
        x: mx.array,
        linear: nn.Module,
        inp: mx.array,
        post: mx.array,
        comb: mx.array,
        norm: RMSNorm | None = None,
        router=None,
    ):
        """``after_post(x, linear(inp), post, comb, norm)``; with an affine-quantized `linear`
        (no bias) at decode on CUDA, the mat-vec and both sites in one launch
        (`kernels.qmv_hc`): a V4 attention's output projection.  `router`
        (`kernels.qmv_hc_route.SiteRouter`, the MoE router of the collapsed output): the result
        gets a fifth item, (idx, weights) where the router ran inside the launch, else None."""
        biases = linear.get("biases") if isinstance(linear, nn.QuantizedLinear) else None
        if biases is not None and linear.mode == "affine" and "bias" not in linear:
            q = dict(group_size=linear.group_size, bits=linear.bits)
            site = (linear["weight"], linear["scales"], biases, x, post, comb, self.fn, self.base, self.scale)
            kw = dict(**q, **self._settings(), norm=_norm_pair(norm))
            face = router.fused_face(inp, site[0], biases, x, self.fn, kw["norm"], **q) if router is not None else None
            if face is not None:
                *out, idx, w = router.post_pre_route(inp, *site, **kw, backend=face)
                return (*out, (idx, w))
            face = qmv_hc.fused_face(inp, linear["weight"], biases, x, self.fn, **q)
            if face is not None:
                out = qmv_hc.qmv_hc_post_pre(inp, *site, **kw, backend=face)
                return out if router is None else (*out, None)
        out = self.after_post(x, linear(inp), post, comb, norm=norm)
        return out if router is None else (*out, None)

    def mix(self, x: mx.array):
        """(pre, post, comb) without the collapse (see `hc_mix`); one fused launch on a GPU."""
        return hc_kernels.hc_mix(x, self.fn, self.base, self.scale, **self._settings())

    def _settings(self) -> dict:
        return {"sinkhorn_iters": self._iters, "hc_eps": self._hc_eps, "norm_eps": self._norm_eps}


class HyperHead(nn.Module):
    def __init__(self, hc_mult: int, hidden_size: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.hc_fn = mx.zeros((hc_mult, hc_mult * hidden_size))
        self.hc_base = mx.zeros((hc_mult,))
        self.hc_scale = mx.ones((1,))
        self._hc_eps, self._norm_eps = hc_eps, norm_eps

    def __call__(self, x: mx.array) -> mx.array:
        return hc_kernels.hc_head(
            x, self.hc_fn, self.hc_base, self.hc_scale, hc_eps=self._hc_eps, norm_eps=self._norm_eps
        )


# --------------------------------------------------------------------------- MoE


class SwitchLinear(nn.Module):
    """Per-expert linear, weight [E, out, in]; `x @ W[idx].T` through `mx.gather_mm`."""

    def __init__(self, input_dims: int, output_dims: int, num_experts: int):
        super().__init__()
        self.weight = mx.zeros((num_experts, output_dims, input_dims))

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        if sorted_indices:
            e, out_dims, in_dims = self.weight.shape
            itemsize = max(x.dtype.size, self.weight.dtype.size)  # gather_mm computes in the wider type
            spans = grouped_gemm_spans(e, out_dims * in_dims * itemsize)
            if len(spans) > 1:
                return self._sorted_by_spans(x, indices, spans)
        return _gather_mm(x, self.weight, indices, sorted_indices)

    def _sorted_by_spans(self, x: mx.array, indices: mx.array, spans) -> mx.array:
        """The grouped GEMM of a bank past its 32-bit offsets (`quant.GROUPED_GEMM_MAX_BYTES`),
        one span of experts at a time: every span sees every pair with its expert clipped into
        the span (still sorted) and keeps the rows of its own pairs; a pair's row is computed
        as in one call over the whole bank."""
        ids = indices.astype(mx.int32)
        y = None
        for e0, n in spans:
            part = _gather_mm(x, self.weight[e0 : e0 + n], mx.clip(ids - e0, 0, n - 1), True)
            # spans ascend: the last span starting at or below a pair's expert is its own
            y = part if y is None else mx.where((ids >= e0)[..., None, None], part, y)
        return y

    def per_expert(self, x: mx.array, experts: mx.array, lengths: mx.array | None = None) -> mx.array:
        """x [B, M, in], experts [B] -> [B, M, out]: batch b through expert experts[b]
        (prefill's grouped path, models/grouped_experts.py; its padding rows are zeros in
        and out, so `lengths`, the live rows per batch, is not needed here)."""
        w = self.weight.swapaxes(-1, -2)
        if mx.default_device().type == mx.DeviceType.cpu:
            if x.dtype != mx.float32 or w.dtype != mx.float32:
                return mx.gather_mm(x.astype(mx.float32), w.astype(mx.float32), rhs_indices=experts).astype(x.dtype)
            return mx.gather_mm(x, w, rhs_indices=experts)
        # the float bank's grouped GPU test failed on a CUDA GPU with gather_mm (the
        # cause was cut from the log): slices of experts as batched matmuls, the GGUF banks' path
        weight = self.weight
        return grouped_experts.sliced_per_expert(
            x, experts, weight.shape[1] * weight.shape[2], lambda ids, dt: weight[ids].astype(dt)
        ).astype(x.dtype)

    def to_quantized(self, group_size: int | None = None, bits: int | None = None, mode: str = "affine", **_):
        num_experts, output_dims, input_dims = self.weight.shape
        q = QuantizedSwitchLinear(input_dims, output_dims, num_experts, group_size, bits, mode)
        q.weight, q.scales, *biases = mx.quantize(self.weight, group_size, bits, mode=mode)
        q.biases = biases[0] if biases else None
        return q


class QuantizedSwitchLinear(nn.Module):
    """Quantized `SwitchLinear` (`mx.gather_qmm`)."""

    def __init__(self, input_dims, output_dims, num_experts, group_size=None, bits=None, mode="affine"):
        super().__init__()
        self.group_size, self.bits, self.mode = group_size, bits, mode
        self.weight, self.scales, *biases = mx.quantize(
            mx.zeros((num_experts, output_dims, input_dims)), group_size, bits, mode=mode
        )
        self.biases = biases[0] if biases else None
        self.freeze()

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        fast = self._decode(x, indices)
        if fast is not None:
            return fast
        return mx.gather_qmm(
            x,
            self.weight,
            self.scales,
            self.biases,
            rhs_indices=indices,
            transpose=True,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
            sorted_indices=sorted_indices,
        )

    def per_expert(self, x: mx.array, experts: mx.array, lengths: mx.array | None = None) -> mx.array:
        """x [B, M, in], experts [B] -> [B, M, out]: batch b through expert experts[b],
        one `gather_qmm` with M rows per batch, `lengths` unused (prefill's grouped path,
        models/grouped_experts.py). MLX CUDA runs it as qmm_sm80 (4 / 8 bits) or
        qmm_naive (2 bits), tensor cores in both for 16-bit operands: on a GPU x, scales
        and biases are cast to one 16-bit type (`grouped_experts.compute_dtype`)."""
        scales, biases = self.scales, self.biases
        if grouped_experts.AFFINE_VIA_DEQUANT:
            return grouped_experts.affine_per_expert_dequantized(
                x, experts, self.weight, scales, biases, group_size=self.group_size, bits=self.bits, mode=self.mode
            )
        if grouped_experts.on_gpu():
            dt = grouped_experts.compute_dtype(x.dtype, scales.dtype if self.mode == "affine" else None)
            x = x.astype(dt)
            if self.mode == "affine":
                scales = scales.astype(dt)
                biases = None if biases is None else biases.astype(dt)
        return mx.gather_qmm(
            x,
            self.weight,
            scales,
            biases,
            rhs_indices=experts,
            transpose=True,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
        )

    def _decode(self, x: mx.array, indices: mx.array) -> mx.array | None:
        """`kernels.affine_qmv.gather_qmv` for one row per (token, expert) at decode size
        on a GPU face (x [..., 1, K], indices broadcasting against x's leading axes); None
        where MLX's gather_qmm runs."""
        if self.mode != "affine" or self.biases is None or x.shape[-2] != 1:
            return None
        if affine_qmv.kernel_face(x.shape[-1], self.group_size, self.bits) is None:
            return None
        xb = tuple(x.shape[:-2])
        batch = tuple(np.broadcast_shapes(xb, tuple(indices.shape))) or (1,)
        lead, k = batch[:-1], batch[-1]
        n = int(np.prod(lead, dtype=np.int64)) if lead else 1
        if n * k > affine_qmv.MAX_PAIRS:
            return None
        if len(xb) == len(batch) and xb[-1] == 1 and xb[:-1] == lead:
            x2 = x.reshape(n, x.shape[-1])  # one vector per token, shared by its k experts
        else:
            x2 = mx.broadcast_to(x.reshape(*xb, x.shape[-1]), (*batch, x.shape[-1])).reshape(n, k, x.shape[-1])
        ids = mx.broadcast_to(indices, batch).reshape(n, k).astype(mx.int32)
        y = affine_qmv.gather_qmv(
            x2, self.weight, self.scales, self.biases, ids, group_size=self.group_size, bits=self.bits
        )
        return y.reshape(*batch, 1, y.shape[-1])


def _gather_mm(x: mx.array, weight: mx.array, indices: mx.array, sorted_indices: bool) -> mx.array:
    """`x @ weight[indices].T` for a float bank [E, out, in] through `mx.gather_mm`."""
    w = weight.swapaxes(-1, -2)
    if x.dtype != mx.float32 and mx.default_device().type == mx.DeviceType.cpu:
        # the CPU GatherMM kernel is float32-only
        y = mx.gather_mm(x.astype(mx.float32), w.astype(mx.float32), rhs_indices=indices, sorted_indices=sorted_indices)
        return y.astype(x.dtype)
    return mx.gather_mm(x, w, rhs_indices=indices, sorted_indices=sorted_indices)


def quantize_switch(switch: SwitchLinear, bits: int, group_size: int = 64) -> QuantizedSwitchLinear:
    """A float expert bank as a `QuantizedSwitchLinear`, quantized a `quant.expert_spans` slice at
    a time (the whole [256, 4096, 4096] bank in one mx.quantize call overflows a CUDA launch)."""
    e, out_dims, in_dims = switch.weight.shape
    parts = []
    for i, n in expert_spans(e):
        parts.append(mx.quantize(switch.weight[i : i + n], group_size, bits))
        mx.eval(parts[-1])
    q = QuantizedSwitchLinear(in_dims, out_dims, 1, group_size, bits)
    q.weight, q.scales, q.biases = (mx.concatenate([p[j] for p in parts]) for j in range(3))
    return q


def _gather_sort(x: mx.array, indices: mx.array):
    """Sort the (token, slot) pairs by expert so gather_mm reads each expert once."""
    *_, k = indices.shape
    flat = indices.flatten()
    order = mx.argsort(flat)
    inv_order = mx.argsort(order)
    return x.flatten(0, -3)[order // k], flat[order], inv_order


def _scatter_unsort(x: mx.array, inv_order: mx.array, shape) -> mx.array:
    return x[inv_order].reshape(*shape, *x.shape[1:])


class SwitchGLU(nn.Module):
    """Routed experts with a fused gate/up projection (gate rows first), as transformers' layout.

    gate_up_proj: SwitchLinear [E, 2I, H], down_proj: SwitchLinear [E, H, I].
    `__call__(x [..., H], indices [..., k]) -> [..., k, H]` (unweighted per-slot outputs).
    """

    def __init__(self, hidden: int, intermediate: int, num_experts: int, limit: float | None):
        super().__init__()
        self.gate_up_proj = SwitchLinear(hidden, 2 * intermediate, num_experts)
        self.down_proj = SwitchLinear(intermediate, hidden, num_experts)
        self._intermediate = intermediate
        self._limit = limit

    @property
    def intermediate(self) -> int:
        """Each expert's intermediate size (a copy of the layer is built from it: experts/)."""
        return self._intermediate

    @property
    def limit(self) -> float | None:
        """The SwiGLU clamp (None: none)."""
        return self._limit

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        if prefill_experts.grouped_wanted(indices.size):  # prefill: per-expert batched GEMMs
            y = grouped_experts.switch_glu(
                self.gate_up_proj, self.down_proj, x, indices, self._intermediate, self._limit
            )
            if y is not None:
                return y
        x = mx.expand_dims(x, (-2, -3))  # [..., 1, 1, H]
        do_sort = indices.size >= 64
        idx, inv_order = indices, None
        if do_sort:
            x, idx, inv_order = _gather_sort(x, indices)
        gu = self.gate_up_proj(x, idx, sorted_indices=do_sort)
        h = clamped_swiglu(gu[..., : self._intermediate], gu[..., self._intermediate :], self._limit)
        y = self.down_proj(h, idx, sorted_indices=do_sort)
        if do_sort:
            y = _scatter_unsort(y, inv_order, indices.shape)
        return y.squeeze(-2)

    def fused_weighted(self, x: mx.array, indices: mx.array, weights: mx.array) -> mx.array | None:
        """``sum_j weights[..., j] * expert_j(x)`` -> [..., H] in x.dtype, in two kernel
        launches (gate_up + SwiGLU, down + weighted sum) when a GPU face runs them at this
        size (decode): `kernels.affine_qmv` for MLX-affine experts, `kernels.quant_moe` for
        GGUF blocks (the gate_up module's `fused_glu_weighted`, models/quantized.py); else
        None, and the caller runs its own unfused expression."""
        gu, dn = self.gate_up_proj, self.down_proj
        if not (isinstance(gu, QuantizedSwitchLinear) and isinstance(dn, QuantizedSwitchLinear)):
            glu = getattr(gu, "fused_glu_weighted", None)
            return None if glu is None else glu(dn, x, indices, weights, self._limit)
        if gu.mode != "affine" or dn.mode != "affine" or gu.biases is None or dn.biases is None:
            return None
        k = indices.shape[-1]
        n = indices.size // k
        if n * k > affine_qmv.MAX_PAIRS or x.shape[-1] != gu.weight.shape[-1] * 32 // gu.bits:
            return None
        if (
            affine_qmv.kernel_face(x.shape[-1], gu.group_size, gu.bits, moe=True) is None
            or affine_qmv.kernel_face(self._intermediate, dn.group_size, dn.bits, moe=True) is None
        ):
            return None
        ids = indices.reshape(n, k).astype(mx.int32)
        h = affine_qmv.gather_swiglu(
            x.reshape(n, -1),
            gu.weight,
            gu.scales,
            gu.biases,
            ids,
            limit=self._limit,
            group_size=gu.group_size,
            bits=gu.bits,
        )
        y = affine_qmv.gather_down_sum(
            h, dn.weight, dn.scales, dn.biases, ids, weights.reshape(n, k), group_size=dn.group_size, bits=dn.bits
        )
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def fused_weighted_shared(
        self, x: mx.array, indices: mx.array, weights: mx.array, shared_gate_up, shared_down, shared_limit, defer=False
    ):
        """``sum_j weights[..., j] * expert_j(x) + shared(x)`` -> [..., H] in x.dtype, where the
        shared expert is `shared_gate_up` (a `FusedLinear` of its gate and up projections) and
        `shared_down` (a quantized linear): two launches for both (affine_qmv MODE 3: the routed
        and shared gate_up + SwiGLU; MODE 4: the routed down + weighted sum + the shared down)
        when every weight is MLX-affine quantized and a GPU face runs them at this size (decode);
        else None (float or GGUF weights, the CPU, more tokens), and the caller runs today's
        launches.  `defer`: the second launch not made, its arguments returned as a
        `kernels.qmv_hc.DownSumShared` (the next mHC site runs it inside its own launch)."""
        gu, dn = self.gate_up_proj, self.down_proj
        if not (isinstance(gu, QuantizedSwitchLinear) and isinstance(dn, QuantizedSwitchLinear)):
            return None
        if gu.mode != "affine" or dn.mode != "affine" or gu.biases is None or dn.biases is None:
            return None
        sq = getattr(shared_gate_up, "quant", None)
        sa = getattr(shared_gate_up, "arrays", {})
        if sq is None or sq[2] != "affine" or "biases" not in sa or len(shared_gate_up.splits) != 1:
            return None
        i2 = shared_gate_up.splits[0]
        if 2 * i2 != sa["weight"].shape[0]:
            return None
        if not isinstance(shared_down, nn.QuantizedLinear) or shared_down.mode != "affine" or "bias" in shared_down:
            return None
        if shared_down.get("biases") is None or shared_down.weight.shape[0] != dn.weight.shape[1]:
            return None
        k = indices.shape[-1]
        n = indices.size // k
        hid = x.shape[-1]
        if n * k > affine_qmv.MAX_PAIRS or hid != gu.weight.shape[-1] * 32 // gu.bits:
            return None
        if hid != sa["weight"].shape[-1] * 32 // sq[1] or i2 != shared_down.weight.shape[-1] * 32 // shared_down.bits:
            return None
        banks = (
            (hid, gu.group_size, gu.bits),
            (self._intermediate, dn.group_size, dn.bits),
            (hid, sq[0], sq[1]),
            (i2, shared_down.group_size, shared_down.bits),
        )
        if any(affine_qmv.kernel_face(*b, moe=True, twobank=True) is None for b in banks):
            return None
        ids = indices.reshape(n, k).astype(mx.int32)
        h, hs = affine_qmv.gather_swiglu_shared(
            x.reshape(n, hid),
            gu.weight,
            gu.scales,
            gu.biases,
            ids,
            (sa["weight"], sa["scales"], sa["biases"]),
            limit=self._limit,
            group_size=gu.group_size,
            bits=gu.bits,
            shared_limit=shared_limit,
            shared_group_size=sq[0],
            shared_bits=sq[1],
        )
        shared = (shared_down.weight, shared_down.scales, shared_down["biases"])
        quant = dict(
            group_size=dn.group_size,
            bits=dn.bits,
            shared_group_size=shared_down.group_size,
            shared_bits=shared_down.bits,
        )
        down = qmv_hc.DownSumShared(
            (h, dn.weight, dn.scales, dn.biases, ids, weights.reshape(n, k), hs, shared),
            quant,
            (*x.shape[:-1], dn.weight.shape[1]),
        )
        return down if defer else down.value()


class GLUMLP(nn.Module):
    """Dense SwiGLU MLP (gate_proj / up_proj / down_proj) with an optional clamp."""

    def __init__(self, hidden: int, intermediate: int, limit: float | None = None, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.limit = limit  # SwiGLU clamp (None: none); the static decode step reads it

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


def score_fn(logits: mx.array, kind: str) -> mx.array:
    """Router scoring in float32: sqrtsoftplus (DeepSeek V4), sigmoid or softmax."""
    logits = logits.astype(mx.float32)
    if kind == "sqrtsoftplus":
        return mx.sqrt(nn.softplus(logits))
    if kind == "sigmoid":
        return mx.sigmoid(logits)
    if kind == "softmax":
        return mx.softmax(logits, axis=-1, precise=True)
    raise ValueError(f"unknown scoring_func {kind!r}")


def topk_indices(scores: mx.array, k: int) -> mx.array:
    """Indices of the k largest entries of the last axis (unsorted), via argpartition."""
    if k >= scores.shape[-1]:
        return mx.broadcast_to(mx.arange(scores.shape[-1]), scores.shape)
    return mx.argpartition(-scores, kth=k - 1, axis=-1)[..., :k]


def route_weights(scores: mx.array, indices: mx.array, normalize: bool, scaling: float) -> mx.array:
    """Gather the chosen experts' scores, optionally renormalise (+1e-20), then scale."""
    w = mx.take_along_axis(scores, indices, axis=-1)
    if normalize:
        w = w / (w.sum(axis=-1, keepdims=True) + 1e-20)
    return w * scaling

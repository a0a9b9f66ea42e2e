"""The decode roofline: weight bytes one token reads over the device's memory bandwidth.

A decode step at one row reads every active weight once (the dense part, the embedding's
one row, and top-k of the routed experts), so tokens / s can not exceed
bandwidth / active bytes; `% of roofline` is the measured t/s over that bound.  KV-cache
and activation reads are left out (small at one row beside the weights), so the bound is
an upper one.  The bandwidth comes from a small table of known cards by the device's name
(`mx.device_info()["device_name"]`), else from `--bandwidth-gbps`; the CPU has none.
"""

from __future__ import annotations

# (substring of the device name, bytes / s): vendor peak figures, most specific first
KNOWN_BANDWIDTH = (
    ("H100 PCIe", 2.0e12),
    ("H100 NVL", 3.9e12),
    ("H100", 3.35e12),  # SXM5, HBM3 ("NVIDIA H100 80GB HBM3")
    ("H200", 4.8e12),
    ("GH200", 4.0e12),
    ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB PCIe", 1.935e12),
    ("A100", 1.555e12),  # 40 GB
    ("L40S", 0.864e12),
    ("M1 Ultra", 0.8e12),
    ("M2 Ultra", 0.8e12),
    ("M3 Ultra", 0.819e12),
)


def device_name() -> str:
    import mlx.core as mx

    try:
        return str(mx.device_info().get("device_name", ""))
    except Exception:  # noqa: BLE001 - an older MLX or a backend without device info
        return ""


def on_cpu() -> bool:
    import mlx.core as mx

    return mx.default_device() == mx.cpu


def bandwidth(name: str | None = None, override_gbps: float | None = None) -> float | None:
    """Bytes / s of the device (None: unknown, or the CPU, whose figure would mean little).
    `override_gbps` (GB/s) wins over the table."""
    if override_gbps is not None:
        if override_gbps <= 0:
            raise ValueError("--bandwidth-gbps must be > 0")
        return override_gbps * 1e9
    if name is None:
        if on_cpu():
            return None
        name = device_name()
    if "GH200" in name:  # before "H200"
        return dict(KNOWN_BANDWIDTH)["GH200"]
    for key, bw in KNOWN_BANDWIDTH:
        if key in name:
            return bw
    return None


def active_weight_bytes(model, args=None) -> int | None:
    """Weight bytes one decode token reads (`model`: a LanguageModel or the family's module):
    every parameter, the routed experts at top-k / n_experts, the embedding at one row.
    None when the model does not say how many experts a token uses or has no parameter tree."""
    from mlx.utils import tree_flatten

    module = model if hasattr(model, "parameters") else getattr(model, "model", None)
    args = args or getattr(model, "args", None) or getattr(module, "args", None)
    try:
        params = tree_flatten(module.parameters())
    except Exception:  # noqa: BLE001 - not an mlx Module
        return None
    total = sum(p.nbytes for _, p in params)
    experts = sum(p.nbytes for n, p in params if ".experts." in n)  # routed only: not `shared_experts.`
    embed = sum(p.nbytes for n, p in params if "embed_tokens" in n)
    routed = 0.0
    if experts:
        k, n = getattr(args, "num_experts_per_tok", None), getattr(args, "n_routed_experts", None)
        if not k or not n:
            return None
        routed = experts * k / n
    vocab = getattr(args, "vocab_size", None)
    return int(total - experts - embed + routed + (embed / vocab if vocab else embed))


def roofline_tps(active_bytes: int | None, bw: float | None) -> float | None:
    return bw / active_bytes if active_bytes and bw else None


def roofline_pct(tps: float, active_bytes: int | None, bw: float | None) -> float | None:
    """Measured t/s as a percentage of bandwidth / active bytes (None: n/a)."""
    bound = roofline_tps(active_bytes, bw)
    return 100.0 * tps / bound if bound else None

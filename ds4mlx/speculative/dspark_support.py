"""ds4's DSpark support file for DeepSeek V4 Flash (`--dspark --mtp-model FILE`).

ds4 (antirez/ds4; its speculative decoding guide, "DeepSeek Flash: DSpark") ships V4 Flash's
DSpark drafter as a separate GGUF: a block drafter of `layer_count` stages (V4 decoder
blocks with window-only attention) over the mean hc streams entering `target_layers` of
the target, proposing up to `block_size` tokens, with a low-rank Markov bias and a
confidence head; it shares the target's embedding and output head.  Its layout, as ds4's
loader binds it:

* metadata `deepseek4.dspark.{layer_count, block_size, markov_rank, noise_token_id,
  target_layers, expert_count}` (older files: `dspark.{n_layers | stage_count,
  block_size, markov_rank, noise_token_id, target_layer_ids}`);
* the shared head `dspark.{main_proj, main_norm, norm, hc_head_fn, hc_head_base,
  hc_head_scale, markov_w1, markov_w2, conf_proj}.weight`;
* per stage s `dspark.<s>.<block tensor>` with V4's GGUF block names (`attn_q_a.weight`,
  ..., `ffn_down_exps.weight`; no compressor, no indexer).  Older files name the stages
  `mtp.<s>.*` and keep the head parts under the last stage (`mtp.<s>.main_proj.weight`,
  `mtp.<last>.markov_head.markov_w1.weight`, `mtp.<last>.confidence_head.proj.weight`).

`read_support` reads and checks that layout (every tensor present, the metadata complete),
`check_target` against the loaded model.  The V4 Flash drafter's forward is not in ds4mlx
yet: `check_dspark_target` validates the file and then refuses `--dspark` on V4 in one
line that says so (DeepSeek V4.1's built-in DSpark drafter, dspark.py, is).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .options import SpecUsageError

PER_STAGE = (
    "attn_q_a.weight",
    "attn_q_b.weight",
    "attn_kv.weight",
    "attn_output_a.weight",
    "attn_output_b.weight",
    "attn_q_a_norm.weight",
    "attn_kv_a_norm.weight",
    "attn_sinks.weight",
    "attn_norm.weight",
    "ffn_norm.weight",
    "hc_attn_fn.weight",
    "hc_attn_base.weight",
    "hc_attn_scale.weight",
    "hc_ffn_fn.weight",
    "hc_ffn_base.weight",
    "hc_ffn_scale.weight",
    "ffn_gate_inp.weight",
    "exp_probs_b.bias",
    "ffn_gate_shexp.weight",
    "ffn_up_shexp.weight",
    "ffn_down_shexp.weight",
    "ffn_gate_exps.weight",
    "ffn_up_exps.weight",
    "ffn_down_exps.weight",
)
SHARED = (
    "main_proj.weight",
    "main_norm.weight",
    "norm.weight",
    "hc_head_fn.weight",
    "hc_head_base.weight",
    "hc_head_scale.weight",
    "markov_w1.weight",
    "markov_w2.weight",
    "conf_proj.weight",
)
# an older file's head parts (after `mtp.<stage>.`) -> the shared names
LEGACY_SHARED = {
    **{name: name for name in SHARED if name not in ("markov_w1.weight", "markov_w2.weight", "conf_proj.weight")},
    "markov_head.markov_w1.weight": "markov_w1.weight",
    "markov_head.markov_w2.weight": "markov_w2.weight",
    "confidence_head.proj.weight": "conf_proj.weight",
}
KV = "deepseek4.dspark."
LEGACY_KV = {
    "layer_count": ("dspark.n_layers", "dspark.stage_count"),
    "block_size": ("dspark.block_size",),
    "markov_rank": ("dspark.markov_rank",),
    "noise_token_id": ("dspark.noise_token_id",),
    "target_layers": ("dspark.target_layer_ids",),
    "expert_count": (),
}
REQUIRED_KV = ("layer_count", "block_size", "markov_rank", "noise_token_id", "target_layers")


def is_support_file(metadata: dict, names) -> bool:
    """Whether a GGUF's metadata / tensor names are a DSpark support file's."""
    if any(k.startswith(KV) or k.startswith("dspark.") for k in metadata):
        return True
    return any(n.startswith("dspark.") for n in names)


def canonical_name(name: str) -> str | None:
    """A tensor's name in the `dspark.*` layout (an older file's `mtp.<s>.*` renamed);
    None for a name of neither layout."""
    if name.startswith("dspark."):
        return name
    if not name.startswith("mtp."):
        return None
    _, stage, rest = name.split(".", 2)
    if not stage.isdigit():
        return None
    shared = LEGACY_SHARED.get(rest)
    return f"dspark.{shared}" if shared is not None else f"dspark.{int(stage)}.{rest}"


@dataclass
class DSparkSupport:
    path: str
    layer_count: int
    block_size: int
    markov_rank: int
    noise_token_id: int
    target_layers: tuple
    expert_count: int = 0  # 0: the target's
    tensors: dict = field(default_factory=dict)  # dspark.* name -> weights.GGUFTensorInfo

    def describe(self) -> str:
        layers = ",".join(str(i) for i in self.target_layers)
        return (
            f"{self.layer_count} stages, block {self.block_size}, Markov rank {self.markov_rank}, "
            f"target layers {layers}"
        )

    def expected_names(self) -> set:
        out = {f"dspark.{s}" for s in SHARED}
        for i in range(self.layer_count):
            out |= {f"dspark.{i}.{s}" for s in PER_STAGE}
        return out

    def shape(self, name: str) -> tuple:
        return tuple(self.tensors[name].shape)


def _kv(meta: dict, key: str):
    if KV + key in meta:
        return meta[KV + key]
    for old in LEGACY_KV[key]:
        if old in meta:
            return meta[old]
    return None


def read_support(path) -> DSparkSupport:
    """The support file's layout, checked complete (SpecUsageError naming what is missing)."""
    from ..io.weights import GGUFFile

    try:
        g = GGUFFile(path)
    except (OSError, ValueError) as e:
        raise SpecUsageError(f"--mtp-model: {e}") from None
    meta = g.metadata
    if not is_support_file(meta, g.tensors):
        raise SpecUsageError(f"--dspark: {path} is not a DSpark support file (no dspark.* metadata or tensors)")
    values = {k: _kv(meta, k) for k in LEGACY_KV}
    missing = [KV + k for k in REQUIRED_KV if values[k] is None]
    if missing:
        raise SpecUsageError(f"--dspark: {path}: DSpark metadata missing: {', '.join(missing)}")
    targets = values["target_layers"]
    targets = tuple(int(t) for t in (targets if isinstance(targets, (list, tuple)) else [targets]))
    tensors = {}
    for name, info in g.tensors.items():
        canon = canonical_name(name)
        if canon is not None:
            tensors[canon] = info
    try:
        sup = DSparkSupport(
            str(path),
            int(values["layer_count"]),
            int(values["block_size"]),
            int(values["markov_rank"]),
            int(values["noise_token_id"]),
            targets,
            int(values["expert_count"] or 0),
            tensors,
        )
    except (TypeError, ValueError) as e:
        raise SpecUsageError(f"--dspark: {path}: bad DSpark metadata ({e})") from None
    if sup.layer_count < 1 or sup.block_size < 1 or sup.markov_rank < 1 or not targets:
        raise SpecUsageError(f"--dspark: {path}: DSpark metadata out of range ({sup.describe()})")
    absent = sorted(sup.expected_names() - set(tensors))
    if absent:
        more = f" and {len(absent) - 3} more" if len(absent) > 3 else ""
        raise SpecUsageError(f"--dspark: {path}: DSpark tensors missing: {', '.join(absent[:3])}{more}")
    return sup


def check_target(sup: DSparkSupport, args) -> None:
    """Refuse a support file that does not fit the target (V4 ModelArgs)."""
    n, hidden, vocab = args.num_hidden_layers, args.hidden_size, args.vocab_size
    bad = [i for i in sup.target_layers if not 0 <= i < n]
    if bad:
        raise SpecUsageError(f"--dspark: {sup.path}: target layers {bad} are not layers of the model (0..{n - 1})")
    if not 0 <= sup.noise_token_id < vocab:
        raise SpecUsageError(f"--dspark: {sup.path}: noise token {sup.noise_token_id} is outside the vocabulary")
    want = {
        "dspark.main_proj.weight": (hidden, hidden * len(sup.target_layers)),
        "dspark.markov_w1.weight": (vocab, sup.markov_rank),
        "dspark.markov_w2.weight": (vocab, sup.markov_rank),
    }
    for name, shape in want.items():
        if sup.shape(name) != shape:
            raise SpecUsageError(
                f"--dspark: {sup.path}: {name} is {list(sup.shape(name))}, this model needs {list(shape)} "
                "(a support file of another checkpoint?)"
            )


def check_dspark_target(model, path) -> None:
    """`--dspark` on `model`: V4.1 drafts with its own DSpark tensors (dspark.py); V4 Flash
    needs ds4's support file, which is read and checked here, then refused: its drafter's
    forward is not implemented yet; other families have no DSpark drafter."""
    kind = getattr(getattr(model, "model", model), "model_type", None)
    if kind == "deepseek_v41":
        if path:
            raise SpecUsageError(
                "--dspark on DeepSeek V4.1 drafts with the model's own DSpark tensors (mtp.*); "
                "a separate support file (--mtp-model) is not read for V4.1"
            )
        return
    if kind != "deepseek_v4":
        raise SpecUsageError(f"--dspark: DSpark drafters exist for DeepSeek V4 Flash and V4.1, not {kind} models")
    if not path:
        raise SpecUsageError("--dspark on DeepSeek V4 Flash needs ds4's DSpark support file: --mtp-model FILE")
    sup = read_support(path)
    check_target(sup, model.model.args)
    raise SpecUsageError(
        f"--dspark: {path} is a DSpark support file that fits this model ({sup.describe()}), "
        "but the V4 Flash DSpark drafter is not implemented yet (V4.1's built-in one is; "
        "for V4 Flash use --mtp FILE with ds4's MTP support file)"
    )

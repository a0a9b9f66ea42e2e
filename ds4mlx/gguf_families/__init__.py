"""GGUF tensor names and metadata keys, one `Family` table per model family.

Each table is written the way ds4 writes that family's GGUFs where ds4's own converter
or loader could be read, and says so where it could not.  DeepSeek V4 (`deepseek_v4.py`,
ds4's `deepseek4` GGUFs: its sources are in that module) is a table like the others,
with its own metadata keys and lazy expert handling (`DeepseekV4Family`):

==============  ==============  ===================================================
family          architecture    source of the tensor names and metadata keys
==============  ==============  ===================================================
deepseek_v41    `deepseek41`    ds4: antirez/ds4 gguf-tools/deepseek41_quantize.py
                                (`build_plan`, commit 30ac654) for the tensor names;
                                gguf-tools/deepseek41_metadata.py (`metadata`, read in
                                the zzyu17/ds4 fork, 1c45969: the antirez copy imports
                                it) for the keys: `deepseek41.<HF field>` per field and
                                the whole HF config as JSON in `deepseek41.config`.
glm5_next       `glm5-next`     ds4: gguf-tools/glm53_quantize.py (imported by antirez/ds4's
                                deepseek41 tools; read in the zzyu17/ds4 fork, 04de2c0:
                                `add_mhc`, `add_linear_attention`, `add_dsa_attention`,
                                `add_ffn`, `build_plan`, `model_metadata`).
qwen4_exp       `qwen38-next`   ds4: antirez/ds4 gguf-tools/qwen38_quantize.py
                                (9558ece: `add_hc`, `add_gdn`, `add_qsa`, `add_ffn`,
                                `add_ple_projections`, `build_plan`, `model_metadata`,
                                `transform_regular`).  ds4 writes the PLE n-gram table
                                to a sidecar GGUF as `per_layer_token_embd.weight`
                                (one PLE layer); here it stays in the main file as
                                `blk.N.ple_token_embd.weight` (ds4mlx extension: the
                                demo has two PLE layers).
glm_moe_dsa     `glm-dsa`       ds4 serves GLM 5.2 through its `glm-dsa` provider
                                (antirez/ds4 models/glm/provider.c, acdcaf8), i.e.
                                llama.cpp's GLM-DSA GGUFs.  ds4's binder source was not
                                readable here, only a description of its
                                `weights_bind_glm_dsa_layer` (attn_kv_a_mqa, attn_k_b,
                                attn_v_b, indexer attn_q_b / attn_k / k_norm (+bias) /
                                proj), which matches llama.cpp's MODEL_TENSORS[GLM_DSA]
                                in the gguf package (gguf-py 0.19 constants.py): the
                                names and `glm-dsa.*` keys (gguf.Keys) follow that.
                                ds4's GLM 5.3 table uses the same DSA names.  (An early
                                ds4 glm-5.2 branch, gguf-tools/glm-quantize.c, used
                                `attn_kv` / `attn_kv_b` and deepseek4.* keys: not
                                followed.)
==============  ==============  ===================================================

Every family's GGUF but V4's (whose `deepseek4.*` keys express its config, the rest in
`ds4mlx.hf_config_overrides`) also carries the full Hugging Face config as JSON (V4.1 in ds4's
own `deepseek41.config`, the others in `ds4mlx.hf_config`, a key ds4 ignores), so a
GGUF written here reads back to exactly the config it was written from.  Without that
key (a GGUF from ds4 itself) the config is derived from the family's keys and tensor
names (`Family.config_from_kv(meta, tensor_names)`; each module's `_*_derive` says what
it assumes: every GLM layer runs its own indexer unless `*.attention.indexer.types`
says otherwise, Qwen's PLE hash tables must follow from the default seed).  Reading a
ds4-quantized GGUF, a tensor rebuilt from several GGUF tensors (kv_b_proj from Q8_0
attn_k_b / attn_v_b, ...) is dequantized, with a warning; ds4's Qwen PLE sidecar file
is not read.

Keys a family needs that ds4 does not write are ds4mlx extensions under the family's
prefix (`*.attention.indexer.types`, `qwen38-next.ple.layers`, ...).

Tensors: GGUF stores ggml `ne` reversed w.r.t. numpy, so a numpy [out, in] matrix is
written as is.  Rearrangements follow ds4's converters exactly (all lossless):

* fused `mlp.experts.gate_up_proj` [E, 2I, H] -> `ffn_gate_exps` / `ffn_up_exps`;
* GLM `kv_b_proj` [H*(nope+v), r] -> `attn_k_b` [H, r, nope] (transposed per head) and
  `attn_v_b` [H, v, r] (glm53_quantize.py `transform_regular` kv_b_k / kv_b_v);
* GLM 5.3 KDA `conv1d` [3C, 1, K] -> `kda_{q,k,v}_conv` [C, 1, K];
* Qwen `in_proj_qkv` -> `kda_q/k/v` rows, its `conv1d` -> `kda_{q,k,v}_conv`,
  `q_proj` (per head [query | gate]) -> `attn_q` / `attn_gate`, indexer
  `index_qk_proj` -> `indexer.q_proj` / `indexer.k_proj`, `shared_expert_gate`
  [1, H] -> `ffn_gate_inp_shexp` [H];
* Qwen's (1 + w) RMSNorm weights are stored as 1 + w (ds4's `norm_plus_one`) and read
  back as (1 + w) - 1, which gives the model the same float32 1 + w bit for bit
  (fl(1 + fl(fl(1 + w) - 1)) == fl(1 + w) for every float32 w; see `_plus_one_split`);
* V4.1 `o_a_proj` [G, out, in] (mlx-lm) -> `attn_output_a` [G*out, in].

Names of bias vectors follow their weights (`X.bias` -> `gguf(X).bias`, llama.cpp's
convention).  GGUF tensor names must stay under 64 bytes (ggml GGML_MAX_NAME); every
name here does, and `to_gguf` checks.
"""

from __future__ import annotations

from .. import registry
from .base import CONFIG_KEY, GGML_MAX_NAME, Family, Rule
from .deepseek_v4 import DEEPSEEK_V4
from .deepseek_v41 import DEEPSEEK_V41
from .glm import GLM5_NEXT, GLM_MOE_DSA
from .qwen import QWEN4_EXP

# ----------------------------------------------------------------------------- dispatch
FAMILIES = (DEEPSEEK_V4, DEEPSEEK_V41, GLM_MOE_DSA, GLM5_NEXT, QWEN4_EXP)
# registry key (ds4mlx/registry.py) -> table
_BY_KEY = {f.model_types[0]: f for f in FAMILIES}
_BY_ARCH = {f.arch: f for f in FAMILIES}


def for_config(config: dict) -> Family:
    """The family table of a HF config (no model_type: the registry's default family)."""
    mt = config.get("model_type", registry.DEFAULT_FAMILY)
    fam = registry.family_of(mt)
    table = _BY_KEY.get(fam.key) if fam is not None else None
    if table is None:
        raise ValueError(f"no GGUF scheme for model_type {mt!r} (known: {', '.join(sorted(registry.BY_MODEL_TYPE))})")
    return table


def for_arch(arch: str) -> Family | None:
    """The family of a GGUF general.architecture (None: not one of these)."""
    return _BY_ARCH.get(arch)


def default() -> Family:
    """The registry's default family's table (a GGUF of an unknown architecture is read as it)."""
    return _BY_KEY[registry.DEFAULT_FAMILY]


__all__ = [
    "GGML_MAX_NAME",
    "Family",
    "Rule",
    "FAMILIES",
    "CONFIG_KEY",
    "for_config",
    "for_arch",
    "default",
    "DEEPSEEK_V4",
    "DEEPSEEK_V41",
    "GLM_MOE_DSA",
    "GLM5_NEXT",
    "QWEN4_EXP",
]

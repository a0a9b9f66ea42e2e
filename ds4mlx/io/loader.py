"""Path -> (model, tokenizer).  The one place that joins weights I/O, the model
family and the tokenizer; `ds4mlx.load` is its public face."""

from __future__ import annotations

import os
import sys

import mlx.core as mx

from ..gguf_families.deepseek_v4 import MTP_PREFIX
from ..models.base import LanguageModel
from ..models.layers import set_activation_dtype
from ..models.quantized import paths_of
from ..models.tensor_load import KeptTensors
from ..registry import DEFAULT_FAMILY, family_module
from ..runtime.tokenizer import Tokenizer
from . import dtype_policy
from .modelfile import reading
from .weights import read_mtp_gguf, read_weights


def default_dtype():
    """The float weights' dtype under `--dtype auto` (dtype_policy): float32 on the
    CPU (MLX's CPU bf16 matmul is ~10x slower), the file's own type on a GPU."""
    return dtype_policy.resolve("auto").weights


def materialize(module) -> None:
    """Evaluate every array a model holds: parameters and cached constants (rope
    tables, ...) alike.  MLX binds a lazy array to the stream of the thread that
    made it, so the engine's worker thread could not evaluate one left lazy here."""
    found, seen, todo = [], set(), [module]
    while todo:
        obj = todo.pop()
        if isinstance(obj, mx.array):
            found.append(obj)
            continue
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):  # nn.Module is a dict of parameters and submodules ...
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            todo.extend(obj)
        # ... and keeps its other attributes (rope tables, ...) in __dict__
        if hasattr(obj, "__dict__") and type(obj).__module__.startswith(("ds4mlx", "mlx")):
            todo.extend(vars(obj).values())
    mx.eval(found)


def mtp_tensor_rule(config: dict):
    """`name -> bool`: whether a tensor of this checkpoint belongs to its MTP head: `mtp.*`,
    or what the family's `is_mtp_tensor(name, config)` says (GLM 5.x keeps its next-n
    layer as `model.layers.{num_hidden_layers}.*`, models/glm_moe_dsa.py)."""
    try:
        family = family_module(config.get("model_type", DEFAULT_FAMILY))
    except ValueError:  # an unknown family: from_config names it below
        family = None
    own = getattr(family, "is_mtp_tensor", None)
    if own is None:
        return lambda name: name.startswith(MTP_PREFIX)
    return lambda name: name.startswith(MTP_PREFIX) or own(name, config)


def _local_path(path: str) -> str:
    """A hub name -> its copy in the local hub cache (no download here: `ds4mlx pull`, or the
    commands' `-m org/repo`, fetch it)."""
    from ..hub.spec import is_hub_name

    if not is_hub_name(path):
        return path
    from ..hub.download import cached
    from ..hub.spec import parse

    local = cached(parse(path))
    if local is None:
        raise FileNotFoundError(f"{path}: not in the local hub cache (`ds4mlx pull {path}` downloads it)")
    return str(local)


def _fit(tensors: dict, config: dict, ctx: int, cast_dtype):
    """The memory verdict for these weights at `ctx` (memory_fit.py); ValueError when it is no."""
    from ..experts.fit import resident_bytes
    from .inspect_model import kv_bytes
    from .memory_fit import budget, verdict

    weights = sum(resident_bytes(v, cast_dtype) for v in tensors.values())
    cap = int(config.get("max_position_embeddings") or 1 << 20)
    v = verdict(weights, lambda c: kv_bytes(config, c), ctx, budget(), cap)
    if not v.fits:
        raise ValueError(v.refusal("the model"))
    return v


def load(path=None, dtype="auto", mtp=None, verbose=True, stream=None, shard=None, ctx=None):
    """Load a GGUF file or a Hugging Face folder; `None` (or "demo") is the built-in
    demo model, "demo:<family>" the demo model of another family.

    `dtype`: "auto" (float32 activations as ds4, float weights as stored; see
    dtype_policy), "float32" / "bfloat16" / "float16", or an mx.Dtype.  `mtp`: ds4's
    separate MTP support GGUF.  MTP tensors (the file's own, see `mtp_tensor_rule`, and
    `mtp`'s) are kept in `model.mtp_weights`: `--mtp` builds the MTP head from them
    (speculative/mtp.py).  The dtype choice is printed to stderr unless `verbose=False`.  `stream`: an
    `experts.StreamConfig` (--stream-experts): routed experts read from the file on
    demand into a bounded cache (ds4mlx/experts/).  `shard`: this rank's part of the
    model (`distributed.sharding.Sharding`), the only part read.  `ctx`: the context the
    caller will serve; the weights plus the KV cache at `ctx` are checked against this
    machine (memory_fit.py: refused in one line when they do not fit; on Metal the wired
    limit raised when they do).  A hub name (`org/repo[:file]`, a catalogue name) loads its
    copy in the local hub cache (hub/)."""
    is_demo = path is None or str(path) == "demo" or str(path).startswith("demo:")
    if is_demo:
        from .demo import demo_model_path

        path = demo_model_path(str(path).split(":", 1)[1] if path and ":" in str(path) else DEFAULT_FAMILY)
    path = os.fspath(path)
    fit = None
    with reading(path):  # a broken file is one ModelFileError line, not a traceback
        path = _local_path(path)
        config, tensors, tokenizer = read_weights(path)
        policy = dtype_policy.resolve(dtype)
        is_mtp = mtp_tensor_rule(config)
        mtp_tensors = {k: tensors.pop(k) for k in [k for k in tensors if is_mtp(k)]}
        from ..experts.fit import check_fits

        # refused in one line before anything is read (--stream-experts: only what stays resident)
        check_fits(tensors, int(config.get("num_hidden_layers") or 0), policy.weights, stream)
        if ctx and not (stream is not None and (stream.enabled or stream.memory_gb is not None)) and shard is None:
            fit = _fit(tensors, config, ctx, policy.weights)
        if mtp is not None:
            mtp_tensors.update(read_mtp_gguf(mtp))
        model = LanguageModel.from_config(config, tensors, dtype=policy.weights, stream=stream, path=path, shard=shard)
        del tensors
    set_activation_dtype(model.model, policy.activations)  # every family's cast point (models/layers.py)
    model.dtype_policy = policy
    model.mtp_weights = KeptTensors(mtp_tensors)  # read when `--mtp` builds its head
    if verbose:
        print(f"ds4mlx: dtype: {policy.describe()}", file=sys.stderr)
        for line in paths_of(model.model):  # how each quantized weight type is kept (exact or not)
            print(f"ds4mlx: weights: {line}", file=sys.stderr)
    if fit is not None:
        from .memory_fit import wire

        wired = wire(fit)
        if verbose:
            print(f"ds4mlx: memory: {fit.line()}{f'; {wired}' if wired else ''}", file=sys.stderr)
    model.path = path
    model.config = config
    model.is_demo = is_demo
    materialize(model.model)
    if tokenizer is None:
        tokenizer = Tokenizer.default()
    return model, tokenizer

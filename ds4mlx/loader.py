"""Path -> (model, tokenizer).  The one place that joins weights I/O, the model
family and the tokenizer; `ds4mlx.load` is its public face."""
from __future__ import annotations

import os

import mlx.core as mx

from .modelfile import reading
from .models.base import LanguageModel
from .tokenizer import Tokenizer
from .weights import read_weights


def default_dtype():
    """float32 on the CPU (MLX's CPU bf16 matmul is ~10x slower), the file's own
    16-bit type on a GPU."""
    return mx.float32 if mx.default_device() == mx.cpu else None


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


def load(path=None, dtype="auto"):
    """Load a GGUF file or a Hugging Face folder; `None` (or "demo") is the built-in
    demo model, "demo:<family>" the demo model of another family."""
    is_demo = path is None or str(path) == "demo" or str(path).startswith("demo:")
    if is_demo:
        from .demo import demo_model_path

        path = demo_model_path(str(path).split(":", 1)[1] if path and ":" in str(path) else "deepseek_v4")
    path = os.fspath(path)
    with reading(path):  # a broken file is one ModelFileError line, not a traceback
        config, tensors, tokenizer = read_weights(path)
        if dtype == "auto":
            dtype = default_dtype()
        model = LanguageModel.from_config(config, tensors, dtype=dtype)
    model.path = path
    model.config = config
    model.is_demo = is_demo
    materialize(model.model)
    if tokenizer is None:
        tokenizer = Tokenizer.default()
    return model, tokenizer

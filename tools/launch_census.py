"""Which GPU launches one compiled decode step of the synthetic V4 Flash makes, counted on the CPU.

    python tools/launch_census.py --layers 4 --ctx 2048 [--full-width]

The GPU profile (tools/gpu_time_probe.py, CUPTI) names kernels, not the ops that launched
them; this names the ops.  The kernels' GPU faces are chosen as on a CUDA device
(`dispatch.backend` -> "cuda", no self-tests), every custom-kernel launch is replaced by
placeholder outputs that depend on its inputs (`mx.depends`), and the compiled step's lazy
outputs are written as a DOT graph (`mx.export_to_dot`), whose nodes are what MLX would
launch: our kernels, MLX's own (gathers, copies, fused elementwise chains as one
`Compiled` node, ...), plus the fills of a launch with `init_value` (one per output).
Views (reshape, slice, broadcast, ...) launch nothing and are listed apart.  The counts are
per step and per layer; nothing runs on a GPU, nothing is evaluated.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import tempfile
from pathlib import Path

os.environ["DS4MLX_KERNEL_SELFTEST"] = "0"  # placeholders would fail every self-test

import mlx.core as mx  # noqa: E402

from ds4mlx import stepper  # noqa: E402
from ds4mlx.bench.synthetic import build_synthetic_v4_flash  # noqa: E402
from ds4mlx.kernels import dispatch, sparse_attention  # noqa: E402

# primitives that make no GPU launch of their own (views, metadata, graph plumbing)
VIEWS = {
    "Reshape",
    "Slice",
    "Broadcast",
    "BroadcastAxes",
    "ExpandDims",
    "Squeeze",
    "AsStrided",
    "StopGradient",
    "Depends",
    "Transpose",
    "Split",
    "Flatten",
    "Unflatten",
    "AsType?",
}

launches: collections.Counter = collections.Counter()
fills: collections.Counter = collections.Counter()


def _placeholder_call(self, face, **kw):
    """A custom-kernel launch, recorded; zeros in its outputs' shapes, depending on its inputs."""
    name = self.name
    for k, v in kw.get("template") or []:
        if k in ("MODE",):
            name += f"[{k}={v}]"
    launches[name] += 1
    if kw.get("init_value") is not None:
        fills[name] += len(kw["output_shapes"])
    outs = [mx.zeros(s, t) for s, t in zip(kw["output_shapes"], kw["output_dtypes"])]
    deps = [a for a in kw["inputs"] if isinstance(a, mx.array)]
    return mx.depends(outs, deps)


def as_cuda():
    dispatch.Kernel.__call__ = _placeholder_call
    dispatch.backend = lambda device=None: "cuda"
    sparse_attention._backend = dispatch.backend


def dot_census(arrays) -> collections.Counter:
    with tempfile.NamedTemporaryFile("w+", suffix=".dot") as f:
        mx.export_to_dot(f, *arrays)
        f.flush()
        text = Path(f.name).read_text()
    ops: collections.Counter = collections.Counter()
    for label in re.findall(r'label\s*=\s*"([^"]*)"', text):
        if label and label[0].isupper() and not label.startswith(("Dtype", "Shape")):
            ops[label.split()[0]] += 1
    return ops


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--full-width", action="store_true", help="V4 Flash's own shapes (several GB of host memory)")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument(
        "--sites",
        default="",
        help="comma-separated mlx.core functions / array methods to list by call site (take,array.__getitem__)",
    )
    a = p.parse_args()
    as_cuda()
    tiny = None
    if not a.full_width:
        tiny = dict(hidden_size=512, num_attention_heads=8, head_dim=128, partial_rotary_factor=0.5, q_lora_rank=128)
        tiny.update(o_groups=2, o_lora_rank=128, moe_intermediate_size=256, index_n_heads=8, index_head_dim=64)
        tiny.update(index_topk=64, vocab_size=4096)
    model, _, _ = build_synthetic_v4_flash(layers=a.layers, experts=a.experts, overrides=tiny)
    types = [c.layer_type for c in model.new_session(ctx=8).caches]
    s = model.new_session(ctx=a.ctx + 64)
    os.environ[stepper.MODE_ENV] = "compiled"
    s._tokens = [11] * (a.ctx - 1)  # the caches at the context: buffers grow (zeros, lazily) to it
    for c in s.caches:
        c.offset = a.ctx - 1
    mx.eval(s.model.static_state(s._cache))  # buffers at their bucket: not part of the step
    launches.clear()
    fills.clear()
    stepper._checked.add(id(s.model))  # no eager first run: one trace, its outputs left lazy
    sites: collections.Counter = collections.Counter()

    wanted = [n for n in a.sites.split(",") if n] if a.sites else []

    def home(name):  # "take" -> (mx, "take"); "array.astype" -> (mx.array, "astype")
        return (mx.array, name[6:]) if name.startswith("array.") else (mx, name)

    originals = {n: getattr(*home(n)) for n in wanted if hasattr(*home(n))}

    def wrap(name, fn):
        def call(*args, **kw):  # an MLX function the trace calls, by its caller's line in ds4mlx
            f = sys._getframe(1)
            while f is not None and "ds4mlx" not in f.f_code.co_filename:
                f = f.f_back
            sites[(name, "?" if f is None else f"{Path(f.f_code.co_filename).name}:{f.f_lineno}")] += 1
            return fn(*args, **kw)

        return call

    for n, fn in originals.items():
        setattr(*home(n), wrap(n, fn))
    try:
        logits = s.step(mx.array(5, mx.int32))
    finally:
        for n, fn in originals.items():
            setattr(*home(n), fn)
    ops = dot_census([logits, *s.cache_arrays()])
    n = a.layers
    print(f"layers {n} ({', '.join(f'{t} x{types.count(t)}' for t in sorted(set(types)))}), ctx {a.ctx}")
    print("\nour kernels (launches per step):")
    for k, v in sorted(launches.items(), key=lambda kv: -kv[1]):
        print(f"  {v:5d}  {v / n:5.2f}/layer  {k}")
    print("\nfills of init_value outputs:")
    for k, v in sorted(fills.items(), key=lambda kv: -kv[1]):
        print(f"  {v:5d}  {v / n:5.2f}/layer  {k}")
    # `Full`: the kernels' placeholder outputs (and any constant the trace folded): not counted
    mlx_ops = {k: v for k, v in ops.items() if k not in VIEWS and k != "Full"}
    total = sum(launches.values()) + sum(fills.values()) + sum(mlx_ops.values())
    print(f"\nlaunches per step: {total} ({total / n:.2f} per layer; CPU graph: MLX picks some ops by device)")
    print("\nMLX primitives in the step's graph (custom kernels appear as CustomKernel-like nodes):")
    for k, v in sorted(mlx_ops.items(), key=lambda kv: -kv[1]):
        print(f"  {v:5d}  {v / n:5.2f}/layer  {k}")
    if a.sites:
        print("\nMLX calls made while tracing, by call site (views and constants included):")
        for (fn, where), v in sorted(sites.items(), key=lambda kv: (-kv[1], kv[0])):
            print(f"  {v:5d}  {fn:24s} {where}")
    print("\nviews (no launch):", dict(sorted((k, v) for k, v in ops.items() if k in VIEWS or k == "Full")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

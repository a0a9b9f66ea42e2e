"""The launches of one compiled decode step as a CUDA device would run it, counted on the CPU.

A GPU profile (tools/gpu_time_probe.py) names kernels, not the code that launched them;
`bench --profile` counts the graph of the machine it runs on (on the CPU: the reference
faces).  Here the kernels' GPU faces are chosen as on a CUDA device (`dispatch.backend`
-> "cuda", no self-tests), each custom-kernel launch is recorded by name and replaced by
placeholder outputs that depend on its inputs (`mx.depends`), and the compiled step's lazy
outputs are read back as a DOT graph (`mx.export_to_dot`): its primitive nodes that are not
views are MLX's own launches (a `Compiled` node is one fused elementwise kernel).  Nothing
is evaluated on a GPU.  Caveats: MLX picks a few ops by device (an RMSNorm is one
`rms_norm` kernel on CUDA, four nodes here), a launch with `init_value` fills each output
first (counted apart, `fills`), and a custom kernel's non-contiguous input is copied first
(not visible here).
"""

from __future__ import annotations

import os
from collections import Counter
from contextlib import contextmanager

import mlx.core as mx

from ..kernels import dispatch
from ..runtime import stepper
from .decode_profile import NO_LAUNCH, graph_primitives

SELFTEST_ENV = "DS4MLX_KERNEL_SELFTEST"


@contextmanager
def cuda_placeholders():
    """Inside: GPU faces chosen as on CUDA, every custom-kernel launch recorded
    (yields {"kernels": Counter of names, "fills": Counter of filled outputs})."""
    seen = {"kernels": Counter(), "fills": Counter()}

    def launch(self, face, **kw):
        name = self.name
        mode = dict(kw.get("template") or []).get("MODE")
        if mode is not None:
            name += f"[MODE={mode}]"
        seen["kernels"][name] += 1
        if kw.get("init_value") is not None:
            seen["fills"][name] += len(kw["output_shapes"])
        outs = [mx.zeros(s, t) for s, t in zip(kw["output_shapes"], kw["output_dtypes"])]
        return mx.depends(outs, [a for a in kw["inputs"] if isinstance(a, mx.array)])

    saved = (dispatch.Kernel.__call__, dispatch.backend, os.environ.get(SELFTEST_ENV))
    dispatch.Kernel.__call__ = launch
    dispatch.backend = lambda device=None: "cuda"
    os.environ[SELFTEST_ENV] = "0"  # placeholders would fail every self-test
    try:
        yield seen
    finally:
        dispatch.Kernel.__call__, dispatch.backend = saved[:2]
        if saved[2] is None:
            os.environ.pop(SELFTEST_ENV, None)
        else:
            os.environ[SELFTEST_ENV] = saved[2]


def decode_census(model, ctx: int, rows: int = 1, chain: int = 0) -> dict:
    """One compiled decode step of a static-layout `model` (LanguageModel) at position ctx - 1:
    {"kernels", "fills", "mlx" (primitive -> count, views left out), "total", "layers"}.
    `rows` > 1: one batched step of that many sessions (`stepper.step_rows`, session
    batching), row b at position ctx - 1 - b.  `chain` > 0: one session's verify of that many
    tokens instead (`Session.verify`: the static step's rows chained, `stepper.step_chain`),
    every row's state counted as the verify leaves it (`Session.keep_verified` reads them)."""
    if chain and rows != 1:
        raise ValueError("a census counts session batching (rows) or a verify chain, not both")
    with cuda_placeholders() as seen:
        sessions = []
        for b in range(rows):
            s = model.new_session(ctx=ctx + 64)
            s._tokens = [11] * (ctx - 1 - b)  # a census shortcut: the session's length is its position
            for c in s.caches:
                c.offset = ctx - 1 - b
            # buffers at their bucket: not part of the step
            mx.eval(s.model.static_state(s.caches, **({"ahead": chain} if chain else {})))
            sessions.append(s)
        stepper.forget(s.model)  # a step traced before (bench's probe) holds this machine's faces, not CUDA's
        seen["kernels"].clear()
        seen["fills"].clear()
        stepper.assume_checked(s.model)  # no eager first run: one trace, its outputs left lazy
        try:
            if chain:
                logits, states = stepper.step_chain(s.model, s.caches, mx.array([[5] * chain], mx.int32), len(s))
                out = [logits, *[a for st in states for a in st]]
            elif rows == 1:
                out = [s.step(mx.array(5, mx.int32))]
            else:
                ids = mx.array([[5] * rows], mx.int32)
                out = stepper.step_rows(s.model, [t.caches for t in sessions], ids, [len(t) for t in sessions])
            ops = graph_primitives([*out, *[a for t in sessions for a in t.cache_arrays()]])
        finally:
            stepper.forget(s.model)
    return _counts(seen, ops, len(s.caches))


def mtp_census(model, ctx: int, positions: int = 1) -> dict:
    """One recursive draft position of a random MTP head of `model` (speculative/mtp.py: the
    head's compiled `step` at position ctx - 1, then the output head), or a round's catch-up
    over `positions` (the step's chain, the output head on the last), counted as
    `decode_census` counts a step ("layers": 1, the head's block)."""
    from ..runtime.forward_context import ForwardContext
    from ..speculative.mtp import random_mtp_drafter

    drafter = random_mtp_drafter(model)
    head, embed = drafter.head, drafter.backbone.embed_tokens
    cache = head.make_cache()
    cache.offset = ctx - positions  # a census shortcut, as decode_census's: the ring's contents do not count
    streams = mx.zeros((1, positions, head.args.hc_mult, head.args.hidden_size), drafter.model.static_dtype())
    at = ForwardContext.decode([cache.offset]) if positions == 1 else ForwardContext.chain(cache.offset, positions)
    with cuda_placeholders() as seen:
        state = cache.static_state(streams.dtype, positions)
        step = mx.compile(lambda *a: head.static_step(embed, *a))  # `step`'s trace, its outputs left lazy
        x, hid, *new = step(streams, mx.array([[5] * positions], mx.int32), at.pos_array(), *state)
        ops = graph_primitives([x, drafter.lm_head(hid[:, -1:]), *new])
    return _counts(seen, ops, 1)


def _counts(seen: dict, ops, layers: int) -> dict:
    mlx_ops = {k: v for k, v in ops.items() if k not in NO_LAUNCH and k != "Full"}
    total = sum(seen["kernels"].values()) + sum(seen["fills"].values()) + sum(mlx_ops.values())
    return {
        "kernels": dict(seen["kernels"].most_common()),
        "fills": dict(seen["fills"].most_common()),
        "mlx": dict(sorted(mlx_ops.items(), key=lambda kv: -kv[1])),
        "total": total,
        "layers": layers,
    }

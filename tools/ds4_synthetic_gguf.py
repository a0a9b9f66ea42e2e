"""A synthetic DeepSeek V4 Flash GGUF in ds4's exact q2 layout, for ds4 and ds4mlx alike.

    python3 tools/ds4_synthetic_gguf.py --layers 20 /tmp/ds4_q2_20.gguf     # real shapes
    python3 tools/ds4_synthetic_gguf.py --tiny --layers 4 /tmp/tiny.gguf     # CPU tests

ds4's tensor names and metadata keys (`ds4mlx.io.convert.write_gguf` with the deepseek4
tables) and the tensor types ds4.c `weights_validate_layout()` requires of a q2 file:
routed gate / up experts IQ2_XXS, routed down experts Q2_K, the attention projections,
shared expert and output head Q8_0 (`quantize.DS4_Q8_0_SUFFIXES`), every other matrix
F16 (embedding, hyper-connection, compressor, indexer, router), vectors F32, the hash
layers' tid2eid I32, and the DeepSeek V4 tokenizer (ds4 tokenizes its prompt file).

Values are random, not a model: quantized blocks are random bytes (every bit pattern
of these three formats is a valid block) with each block's float16 scale fixed so a
dequantized weight is about 1/sqrt(fan-in) (activations stay finite through the
layers in both engines); float matrices N(0, 1/fan-in), norms 1, other vectors small.
What is measured is speed: the bytes each token reads and the routing (the router is
random too, so tokens spread over the experts as on a real model).

Every tensor is generated when the writer reaches it and released after (memory stays
at one expert bank, ~0.7 GB); random bytes are drawn on `--threads` threads.
`--tiny` uses small shapes (hidden 256, 4 heads, 16 experts) that only ds4mlx loads:
ds4 accepts nothing but the real V4 Flash shape (its constants, fixed at build time;
the layer count is the one constant tools/ds4_vs_ds4mlx.sh patches).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ds4mlx.bench.load_memory import model_shapes
from ds4mlx.bench.synthetic import v4_flash_config
from ds4mlx.io.convert import write_gguf
from ds4mlx.io.mapped import LazyTensor
from ds4mlx.io.quant import QT, QuantizedTensor, block_size, byte_shape
from ds4mlx.io.quantize import DS4_Q8_0_SUFFIXES

# Small shapes for CPU tests (the same as tests/test_synthetic.py's): 256-wide rows, the
# smallest the 256-value IQ2_XXS / Q2_K blocks allow.
TINY_SHAPES = dict(
    hidden_size=256,
    num_attention_heads=4,
    head_dim=64,
    partial_rotary_factor=0.5,
    q_lora_rank=64,
    o_groups=2,
    o_lora_rank=64,
    moe_intermediate_size=256,
    index_n_heads=4,
    index_head_dim=32,
    index_topk=8,
)
TINY_EXPERTS = 16

# Byte offset of each float16 scale inside one block, and the value written there:
# |w| averages ~50 d (IQ2_XXS: d * (0.5 + 4-bit scale) / 4 * grid 8..43), ~10 d (Q2_K),
# ~64 d (Q8_0), so d ~ 1 / (50 sqrt(K)) keeps a row's dot product O(1) at K = 2048-4096.
BLOCK_SCALES = {
    QT.IQ2_XXS: ((0, 2.0**-12),),
    QT.Q2_K: ((80, 2.0**-9), (82, 2.0**-10)),  # d, dmin
    QT.Q8_0: ((0, 2.0**-12),),
}
CHUNK_BYTES = 64 << 20  # one thread's share of a bank


def _fill_parallel(out: np.ndarray, draw, seed: int, threads: int, align: int = 1) -> None:
    """out (flat) filled by `draw(rng, n)` over chunks on `threads` threads (numpy's
    generators release the GIL while they fill); one generator per chunk, keyed by
    (seed, chunk), so the values do not depend on the thread count."""
    step = max(CHUNK_BYTES // out.itemsize // align * align, align)
    starts = range(0, out.size, step)

    def fill(i_start):
        i, start = i_start
        rng = np.random.Generator(np.random.SFC64([seed, i]))
        stop = min(start + step, out.size)
        out[start:stop] = draw(rng, stop - start)

    with ThreadPoolExecutor(max(threads, 1)) as ex:
        list(ex.map(fill, enumerate(starts)))


def random_blocks(qtype, shape, seed: int, threads: int) -> np.ndarray:
    """uint8 [..., row_bytes] blocks of `qtype` for logical `shape`: random bytes, the
    float16 scales of every block set from BLOCK_SCALES."""
    qt = QT(qtype)
    raw = np.empty(int(np.prod(byte_shape(qt, shape), dtype=np.int64)), np.uint8)
    _fill_parallel(raw, lambda rng, n: rng.integers(0, 256, n, dtype=np.uint8), seed, threads)
    blocks = raw.reshape(-1, block_size(qt)[1])
    for off, value in BLOCK_SCALES[qt]:
        blocks[:, off : off + 2] = np.frombuffer(np.float16(value).tobytes(), np.uint8)
    return raw.reshape(byte_shape(qt, shape))


def random_normal(shape, std: float, seed: int, threads: int) -> np.ndarray:
    out = np.empty(int(np.prod(shape, dtype=np.int64)), np.float32)
    _fill_parallel(out, lambda rng, n: rng.standard_normal(n, dtype=np.float32) * np.float32(std), seed, threads)
    return out.reshape(shape)


def hash_routes(shape, n_experts: int, seed: int) -> np.ndarray:
    """tid2eid [vocab, k]: k distinct experts per token (start + j * odd stride, mod E)."""
    rows, k = shape
    rng = np.random.Generator(np.random.SFC64(seed))
    start = rng.integers(0, n_experts, (rows, 1))
    stride = 2 * rng.integers(0, max(n_experts // 2, 1), (rows, 1)) + 1
    return ((start + stride * np.arange(k)[None]) % n_experts).astype(np.int32)


def _quantized(qtype, shape, seed: int, threads: int) -> QuantizedTensor:
    bs = byte_shape(qtype, shape)
    raw = LazyTensor(lambda: random_blocks(qtype, shape, seed, threads), bs, np.uint8)
    return QuantizedTensor(raw=raw, qtype=QT(qtype), shape=tuple(shape))


def synthetic_tensors(cfg: dict, seed: int = 0, threads: int = 8) -> dict:
    """HF in-memory name -> lazy value, in ds4's q2 types (see the module docstring)."""
    out = {}
    n_experts = int(cfg["n_routed_experts"])
    for i, (name, shape) in enumerate(model_shapes(cfg).items()):
        s = seed * 100_003 + i
        if name.endswith("mlp.experts.gate_up_proj"):
            e, i2, h = shape
            for j, part in enumerate(("gate_proj", "up_proj")):
                out[name.replace("gate_up_proj", part)] = _quantized(QT.IQ2_XXS, (e, i2 // 2, h), 2 * s + j, threads)
        elif name.endswith("mlp.experts.down_proj"):
            out[name] = _quantized(QT.Q2_K, shape, s, threads)
        elif name.endswith(DS4_Q8_0_SUFFIXES):
            out[name] = _quantized(QT.Q8_0, shape, s, threads)
        elif name.endswith("tid2eid"):
            out[name] = LazyTensor(lambda sh=shape, s=s: hash_routes(sh, n_experts, s), shape, np.int32)
        elif len(shape) >= 2:
            std = shape[-1] ** -0.5
            out[name] = LazyTensor(lambda sh=shape, st=std, s=s: random_normal(sh, st, s, threads), shape, np.float32)
        elif "norm" in name:
            out[name] = LazyTensor(lambda sh=shape: np.ones(sh, np.float32), shape, np.float32)
        else:  # hyper-connection scales / bases, attention sinks, router bias
            out[name] = LazyTensor(lambda sh=shape, s=s: random_normal(sh, 0.1, s, 1), shape, np.float32)
    return out


def synthetic_config(layers: int, tiny: bool = False) -> dict:
    cfg = v4_flash_config(layers=layers, experts=TINY_EXPERTS if tiny else 256)
    if tiny:
        cfg.update(TINY_SHAPES)
    return cfg


def write(path, layers: int, tiny: bool = False, seed: int = 0, threads: int = 8) -> dict:
    cfg = synthetic_config(layers, tiny)
    t0 = time.perf_counter()
    write_gguf(
        path,
        cfg,
        synthetic_tensors(cfg, seed, threads),
        tokenizer=None,
        dtype="f16",
        name=f"DeepSeek-V4-Flash synthetic q2 ({layers} layers)",
    )
    return {
        "path": str(path),
        "layers": layers,
        "tiny": tiny,
        "bytes": Path(path).stat().st_size,
        "write_s": round(time.perf_counter() - t0, 1),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tools/ds4_synthetic_gguf.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="GGUF file to write")
    ap.add_argument("--layers", type=int, default=20, help="layers (ds4's own count is 43; default 20)")
    ap.add_argument("--tiny", action="store_true", help="small shapes (ds4mlx tests only; ds4 rejects them)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=8, help="threads drawing random values")
    a = ap.parse_args(argv)
    if a.layers < 1:
        ap.error("--layers must be >= 1")
    print(json.dumps(write(a.out, a.layers, a.tiny, a.seed, a.threads)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

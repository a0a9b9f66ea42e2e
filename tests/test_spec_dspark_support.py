"""ds4's DSpark support file for DeepSeek V4 Flash (`--dspark --mtp-model FILE`).

The test writes a tiny random support file in ds4's layout (the `deepseek4.dspark.*`
metadata, the nine shared head tensors and V4's GGUF block names per stage, as ds4's
loader binds them; speculative/dspark_support.py) for the tiny V4 oracle, and an older
file with the `mtp.<s>.*` names.  `--dspark --mtp-model` reads and checks it against the
model (target layers, hidden size, vocabulary, completeness) and, the V4 Flash drafter's
forward not being implemented, refuses in one line naming the file's layout; `--mtp FILE`
on a DSpark file says which flags take it; V4.1 takes `--dspark` as its built-in drafter.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from parity_helpers import load_case  # noqa: E402

from ds4mlx.speculative import cli as spec_cli  # noqa: E402
from ds4mlx.speculative.dspark_support import PER_STAGE, SHARED, canonical_name, read_support  # noqa: E402

RANK = 8


@pytest.fixture(scope="module")
def tiny_v4(oracle):
    return load_case(oracle, "make_tiny_deepseek_v4.py", "long")[1]


def _shape(name: str, hidden: int, vocab: int, targets: int) -> tuple:
    """numpy shapes of the checked tensors; every other one a small random vector."""
    return {
        "main_proj.weight": (hidden, hidden * targets),
        "markov_w1.weight": (vocab, RANK),
        "markov_w2.weight": (vocab, RANK),
        "conf_proj.weight": (1, hidden + RANK),
    }.get(name, (4,))


def write_support(path, args, *, stages=3, targets=(1, 2, 3), legacy=False, drop=(), kv=None) -> Path:
    """A random support file for the model `args` (ds4's layout, or the older `mtp.*` one)."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "deepseek4")
    prefix = "dspark." if legacy else "deepseek4.dspark."
    values = {
        "n_layers" if legacy else "layer_count": stages,
        "block_size": 5,
        "markov_rank": RANK,
        "noise_token_id": args.vocab_size - 1,
        "target_layer_ids" if legacy else "target_layers": list(targets),
        **(kv or {}),
    }
    for key, value in values.items():
        if isinstance(value, list):
            w.add_array(prefix + key, value)
        else:
            w.add_uint32(prefix + key, value)
    legacy_shared = {"markov_w1.weight": "markov_head.markov_w1.weight", "markov_w2.weight": "markov_head.markov_w2.weight", "conf_proj.weight": "confidence_head.proj.weight"}  # fmt: skip
    names = {}
    for s in SHARED:
        names[f"mtp.{stages - 1}.{legacy_shared.get(s, s)}" if legacy else f"dspark.{s}"] = s
    for i in range(stages):
        for s in PER_STAGE:
            names[f"mtp.{i}.{s}" if legacy else f"dspark.{i}.{s}"] = s
    for name, part in names.items():
        if name in drop:
            continue
        shape = _shape(part, args.hidden_size, args.vocab_size, len(targets))
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def _config(argv, model):
    p = argparse.ArgumentParser()
    spec_cli.add_arguments(p)
    return spec_cli.spec_config(p.parse_args(argv), model, ctx=64)


@pytest.mark.parametrize("legacy", [False, True])
def test_a_support_file_is_read_checked_and_the_missing_drafter_refused_in_one_line(tiny_v4, tmp_path, legacy):
    args = tiny_v4.model.args
    path = write_support(tmp_path / "dspark.gguf", args, legacy=legacy)
    sup = read_support(path)
    assert (sup.layer_count, sup.block_size, sup.markov_rank, sup.target_layers) == (3, 5, RANK, (1, 2, 3))
    assert set(sup.tensors) == sup.expected_names()
    with pytest.raises(spec_cli.SpecUsageError) as e:
        _config(["--dspark", "--mtp-model", str(path)], tiny_v4)
    msg = str(e.value)
    assert "\n" not in msg and "fits this model (3 stages, block 5, Markov rank 8, target layers 1,2,3)" in msg
    assert "not implemented yet" in msg


def test_support_files_that_do_not_fit_are_refused_with_what_is_wrong(tiny_v4, tmp_path):
    args = tiny_v4.model.args
    cases = [
        (dict(targets=(2, 3, 4)), r"target layers \[4\] are not layers of the model \(0..3\)"),
        (dict(drop=("dspark.1.attn_kv.weight",)), "DSpark tensors missing: dspark.1.attn_kv.weight"),
        (dict(stages=2, drop=()), None),  # fewer stages: complete, fits
    ]
    for i, (kw, msg) in enumerate(cases):
        path = write_support(tmp_path / f"bad{i}.gguf", args, **kw)
        with pytest.raises(spec_cli.SpecUsageError, match=msg or "not implemented yet"):
            _config(["--dspark", "--mtp-model", str(path)], tiny_v4)
    wide = tmp_path / "wide.gguf"
    write_support(wide, type("A", (), {"hidden_size": 32, "vocab_size": args.vocab_size})())
    with pytest.raises(spec_cli.SpecUsageError, match=r"main_proj.weight is \[32, 96\], this model needs \[64, 192\]"):
        _config(["--dspark", "--mtp-model", str(wide)], tiny_v4)
    with pytest.raises(spec_cli.SpecUsageError, match="needs ds4's DSpark support file: --mtp-model FILE"):
        _config(["--dspark"], tiny_v4)
    with pytest.raises(spec_cli.SpecUsageError, match="not a DSpark support file"):
        gguf_mtp = tmp_path / "mtp.gguf"
        w = gguf.GGUFWriter(str(gguf_mtp), "deepseek4")
        w.add_tensor("mtp.0.e_proj.weight", np.zeros((4, 4), np.float32))
        w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
        _config(["--dspark", "--mtp-model", str(gguf_mtp)], tiny_v4)


def test_mtp_file_that_is_a_dspark_file_says_which_flags_take_it(tiny_v4, tmp_path):
    from ds4mlx.io.weights import read_mtp_gguf

    path = write_support(tmp_path / "dspark.gguf", tiny_v4.model.args)
    with pytest.raises(
        ValueError, match=r"DSpark support file, not an MTP one \(pass it as --dspark --mtp-model FILE\)"
    ):
        read_mtp_gguf(path)


def test_legacy_names_map_onto_ds4s():
    assert canonical_name("mtp.2.markov_head.markov_w1.weight") == "dspark.markov_w1.weight"
    assert canonical_name("mtp.0.main_proj.weight") == "dspark.main_proj.weight"
    assert canonical_name("mtp.2.confidence_head.proj.weight") == "dspark.conf_proj.weight"
    assert canonical_name("mtp.1.attn_norm.weight") == "dspark.1.attn_norm.weight"  # not the shared norm
    assert canonical_name("mtp.2.norm.weight") == "dspark.norm.weight"
    assert canonical_name("dspark.0.ffn_up_exps.weight") == "dspark.0.ffn_up_exps.weight"
    assert canonical_name("blk.0.attn_kv.weight") is None


def test_dspark_is_v41s_builtin_drafter_and_other_families_are_refused(tmp_path):
    from ds4mlx.speculative.dspark_support import check_dspark_target

    v41 = type("M", (), {"model": type("I", (), {"model_type": "deepseek_v41"})()})()
    check_dspark_target(v41, None)  # V4.1: the model's own mtp.* (speculative/dspark.py)
    with pytest.raises(spec_cli.SpecUsageError, match="not read for V4.1"):
        check_dspark_target(v41, str(tmp_path / "x.gguf"))
    glm = type("M", (), {"model": type("I", (), {"model_type": "glm_moe_dsa"})()})()
    with pytest.raises(spec_cli.SpecUsageError, match="not glm_moe_dsa models"):
        check_dspark_target(glm, None)

"""A split GGUF (llama.cpp's gguf-split layout, written here by gguf-py's own GGUFWriter with
`split_max_tensors`) loads as one model: its first part names it, the other parts are found
beside it, and a part given alone or a missing part is one line."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from ds4mlx.cli.commands import main
from ds4mlx.io.demo import demo_model_path
from ds4mlx.io.weights import GGUFFile, read_weights

PARTS = 3


def write_split(src, out, parts: int) -> list:
    """`src` rewritten as `parts` files by GGUFWriter (the metadata in the first), without
    its tokenizer (the default one is the same: the test stays fast)."""
    r = GGUFFile(src).reader  # the fast reader (gguf.GGUFReader parses the vocabulary slowly)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(out), arch, split_max_tensors=-(-len(r.tensors) // parts))
    for name, field in r.fields.items():
        if name.startswith(("GGUF.", "tokenizer.")) or name == "general.architecture":
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, field.contents(), kind, sub_type=sub)
    for t in r.tensors:
        w.add_tensor(t.name, t.data, raw_shape=list(reversed([int(x) for x in t.shape])), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sorted(out.parent.glob(f"{out.stem}-*-of-*.gguf"))


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    files = write_split(demo_model_path(quiet=True), tmp_path_factory.mktemp("split") / "demo.gguf", PARTS)
    assert [f.name for f in files] == [f"demo-{i:05d}-of-{PARTS:05d}.gguf" for i in range(1, PARTS + 1)]
    return files


def test_split_reads_as_the_whole_file(split):
    whole = GGUFFile(demo_model_path(quiet=True))
    g = GGUFFile(split[0])
    assert g.parts == split and set(g.tensors) == set(whole.tensors)
    for name, t in g.tensors.items():
        w = whole.tensors[name]
        assert (t.ggml_type, t.shape) == (w.ggml_type, w.shape) and np.array_equal(t.data, w.data), name
    config, tensors, _ = read_weights(split[0], with_tokenizer=False)
    config0, tensors0, _ = read_weights(demo_model_path(quiet=True), with_tokenizer=False)
    assert config == config0 and tensors.keys() == tensors0.keys()


def test_split_loads_and_runs_as_one_model(split):
    import ds4mlx

    model, tok = ds4mlx.load(str(split[0]), verbose=False)
    ref, _ = ds4mlx.load(None, verbose=False)
    ids = tok.encode("hello split")
    assert np.array_equal(model.logits(ids), ref.logits(ids))


def test_a_part_alone_or_a_missing_part_is_one_line(split, tmp_path, capsys):
    assert main(["inspect", str(split[1])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"part 2 of {PARTS}" in err[0] and split[0].name in err[0]
    for f in split[:2]:
        (tmp_path / f.name).symlink_to(f)
    assert main(["inspect", str(tmp_path / split[0].name)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and split[2].name in err[0]

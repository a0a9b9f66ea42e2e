"""`ds4mlx inspect FILE`: header-only summary, and a refusal when the machine is too small."""

from __future__ import annotations

import json

from ds4mlx.cli.commands import main
from ds4mlx.io import inspect_model, memory_fit
from ds4mlx.io.demo import demo_model_path
from ds4mlx.io.weights import GGUFFile


def test_inspect_demo_gguf(capsys):
    path = demo_model_path(quiet=True)
    assert main(["inspect", path, "--json", "--ctx", "4096"]) == 0
    s = json.loads(capsys.readouterr().out)
    g = GGUFFile(path)
    assert s["family"] == "deepseek4" and s["tensors"] == len(g.tensors)
    assert s["weight_bytes"] == sum(t.nbytes for t in g.tensors.values())
    assert sum(h["tensors"] for h in s["types"].values()) == len(g.tensors)
    assert 0 < s["bytes_per_token"] < s["weight_bytes"]  # k of E experts, one embedding row
    assert s["kv_bytes"] > 0 and s["serve_bytes"] == s["weight_bytes"] + s["kv_bytes"]
    assert main(["inspect", path, "--ctx", "65536"]) == 0
    assert "bytes read per decoded token" in capsys.readouterr().out


def test_inspect_kv_grows_with_ctx():
    path = demo_model_path(quiet=True)
    small, big = inspect_model.summarize(path, 1024), inspect_model.summarize(path, 1 << 20)
    assert big["kv_bytes"] > small["kv_bytes"]


def test_inspect_refuses_when_machine_too_small(monkeypatch, capsys):
    path = demo_model_path(quiet=True)
    s = inspect_model.summarize(path, 65536)
    # room for the weights and the KV of 16384 tokens, not 65536: the refusal names the --ctx that fits
    room = s["weight_bytes"] + inspect_model.kv_bytes(_config(path), 16384)
    monkeypatch.setattr(inspect_model, "budget", lambda: memory_fit.Budget(room, "a test machine"))
    assert main(["inspect", path, "--ctx", "65536"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot hold it" in err[0] and "--stream-experts" in err[0]
    assert "--ctx 16384 fits" in err[0]
    monkeypatch.setattr(inspect_model, "budget", lambda: memory_fit.Budget(1 << 20, "a test machine"))
    assert main(["inspect", path]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--stream-experts" in err[0] and "--ctx" not in err[0].split("cannot hold it")[1]


def _config(path):
    from ds4mlx.io.weights import read_gguf_file

    return read_gguf_file(GGUFFile(path), with_tokenizer=False)[0]


def test_inspect_bad_file_one_line(tmp_path, capsys):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"nope")
    assert main(["inspect", str(p)]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1

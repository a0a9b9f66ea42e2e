"""`ds4mlx inspect FILE`: header-only summary, and a refusal when the machine is too small."""

from __future__ import annotations

import json

from ds4mlx import inspect_model
from ds4mlx.cli import main
from ds4mlx.demo import demo_model_path
from ds4mlx.weights import GGUFFile


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
    monkeypatch.setattr(inspect_model, "machine_memory", lambda: 1 << 20)
    assert main(["inspect", demo_model_path(quiet=True)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot hold it" in err[0] and "SSD streaming" in err[0]


def test_inspect_bad_file_one_line(tmp_path, capsys):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"nope")
    assert main(["inspect", str(p)]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1

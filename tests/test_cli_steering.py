"""Directional steering (ds4mlx/runtime/steering.py) on every family's tiny demo model:
scale 0 is the unsteered graph bit for bit; a nonzero direction changes the
logits exactly as the projection y - s * v * dot(v, y), applied here by
independent numpy wrappers around each layer's attention and FFN modules; the
steering identity enters the session fingerprint and the disk-cache model id;
the file format and `steer build` match ds4's dir-steering tool."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

import ds4mlx
from ds4mlx.chat.protocol import families
from ds4mlx.runtime import steering

TEXT = "Steering a tiny model: one direction per layer."


@pytest.fixture(scope="module", params=families())
def demo(request):
    model, tok = ds4mlx.load(f"demo:{request.param}")
    yield request.param, model, tok
    steering.install(model, None)


def _dirs(model, seed=0):
    a = model.args
    rng = np.random.default_rng(seed)
    d = rng.standard_normal((a.num_hidden_layers, a.hidden_size)).astype(np.float32)
    return d / np.linalg.norm(d, axis=1, keepdims=True)


def _attn_name(layer) -> str:
    return "linear_attn" if "linear_attn" in layer else "self_attn"


class _Projected:
    """The wrapped module's output projected in numpy: y - s * v * (y . v)."""

    def __init__(self, inner, v: np.ndarray, scale: float):
        self.inner, self.v, self.scale = inner, v.astype(np.float64), scale

    def __call__(self, *args, **kwargs):
        return self._edited(self.inner(*args, **kwargs))

    def forward(self, *args, **kwargs):  # a module of a family's one forward (GLM's attention)
        return self._edited(self.inner.forward(*args, **kwargs))

    def _edited(self, out):
        first = out[0] if isinstance(out, tuple) else out  # GLM MLA returns (h, selection)
        y = np.array(first.astype(mx.float32)).astype(np.float64)
        y = y - self.scale * (y @ self.v)[..., None] * self.v
        edited = mx.array(y.astype(np.float32)).astype(first.dtype)
        return (edited,) + tuple(out[1:]) if isinstance(out, tuple) else edited


def test_scale_zero_is_bit_exact(demo):
    family, model, tok = demo
    ids = tok.encode(TEXT)
    base = model.logits(ids)
    steering.install(model, steering.Steering(_dirs(model), ffn=0.0, attn=0.0))
    try:
        assert np.array_equal(model.logits(ids), base)
        assert steering.identity(model) is None
        # a file given with both scales set to 0: still nothing installed
        assert all("steering" not in vars(layer) for layer in steering.layers_of(model))
    finally:
        steering.install(model, None)


@pytest.mark.parametrize("ffn,attn", [(0.8, 0.0), (0.0, -0.6), (1.5, 0.5)])
def test_nonzero_direction_changes_logits_as_projection(demo, ffn, attn):
    family, model, tok = demo
    ids = tok.encode(TEXT)
    base = model.logits(ids)
    dirs = _dirs(model, seed=1)
    layers = steering.layers_of(model)
    # expected: the plain model with each site's module wrapped by the numpy projection
    originals = []
    for i, layer in enumerate(layers):
        name = _attn_name(layer)
        originals.append((layer, name, layer[name], layer["mlp"]))
        if ffn:
            layer.mlp = _Projected(layer["mlp"], dirs[i], ffn)
        if attn:
            setattr(layer, name, _Projected(layer[name], dirs[i], attn))
    try:
        expected = model.logits(ids)
    finally:
        for layer, name, attn_mod, mlp_mod in originals:
            setattr(layer, name, attn_mod)
            layer.mlp = mlp_mod
    assert np.array_equal(model.logits(ids), base)  # the wrappers are gone
    steering.install(model, steering.Steering(dirs, ffn=ffn, attn=attn))
    try:
        got = model.logits(ids)
    finally:
        steering.install(model, None)
    moved = np.abs(expected - base).max()
    assert moved > 1e-2, f"{family}: the direction should move the logits"
    np.testing.assert_allclose(got, expected, atol=2e-4 * max(1.0, np.abs(expected).max()), rtol=0)
    assert np.array_equal(model.logits(ids), base)  # uninstalled: unsteered again


def test_identity_enters_fingerprints(demo):
    family, model, tok = demo
    from ds4mlx.kv.cache import model_identity
    from ds4mlx.runtime.session import model_fingerprint

    plain_fp, plain_id = model_fingerprint(model.model), model_identity(model)
    s1 = steering.Steering(_dirs(model, 2), ffn=1.0)
    s2 = steering.Steering(_dirs(model, 2), ffn=2.0)
    seen = set()
    for s in (s1, s2):
        steering.install(model, s)
        seen.add((model_fingerprint(model.model), model_identity(model)))
    steering.install(model, None)
    assert len(seen) == 2 and all(fp != plain_fp and mid != plain_id for fp, mid in seen)
    assert (model_fingerprint(model.model), model_identity(model)) == (plain_fp, plain_id)


def test_snapshot_made_with_steering_is_refused_without_it(demo):
    family, model, tok = demo
    ids = tok.encode(TEXT)
    steering.install(model, steering.Steering(_dirs(model, 3), ffn=1.0))
    try:
        s = model.new_session(64)
        s.prefill(ids)
        blob = s.snapshot()
    finally:
        steering.install(model, None)
    plain = model.new_session(64)
    with pytest.raises(ValueError):
        plain.restore(blob)


def test_file_format_and_defaults(demo, tmp_path):
    family, model, tok = demo
    dirs = _dirs(model, 4)
    path = tmp_path / "dir.f32"
    dirs.astype("<f4").tofile(path)
    s = steering.load(model, str(path))
    assert (s.ffn, s.attn) == (1.0, 0.0)  # ds4: FFN 1 when only a file is given
    assert np.array_equal(s.directions, dirs)
    assert (steering.load(model, str(path), attn=0.5).ffn, steering.load(model, str(path), attn=0.5).attn) == (0.0, 0.5)
    (tmp_path / "short.f32").write_bytes(dirs.astype("<f4").tobytes()[:-4])
    with pytest.raises(steering.SteeringError, match="expected"):
        steering.load(model, str(tmp_path / "short.f32"))
    with pytest.raises(steering.SteeringError):
        steering.load(model, str(path), ffn=101)


def test_steer_build_mean_difference(tmp_path):
    """`ds4mlx steer build` on the V4 demo: the direction of each layer is the
    normalized mean difference of the captured FFN rows, orthogonalized against
    the contrast mean -- recomputed here from captures taken by wrapping `mlp`."""
    from ds4mlx.cli.commands import main

    model, tok = ds4mlx.load(None)
    good, bad = ["Answer in one word.", "Be brief."], ["Explain at length, please.", "Write a long essay."]
    (tmp_path / "good.txt").write_text("# target\n" + "\n".join(good) + "\n\n")
    (tmp_path / "bad.txt").write_text("\n".join(bad) + "\n")
    out = tmp_path / "out" / "dir.json"
    rc = main(
        [
            "steer",
            "build",
            "--good-file",
            str(tmp_path / "good.txt"),
            "--bad-file",
            str(tmp_path / "bad.txt"),
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    meta = json.loads(out.read_text())
    assert meta["format"] == steering.FORMAT and meta["component"] == "ffn_out"
    got = np.fromfile(out.with_suffix(".f32"), dtype="<f4").reshape(meta["shape"])

    from ds4mlx.chat.messages import Conversation, Message
    from ds4mlx.chat.protocol import protocol_for_model

    proto = protocol_for_model(model)
    layers = steering.layers_of(model)

    def rows(prompt):
        text = proto.render(Conversation([Message("system", meta["system"]), Message("user", prompt)], thinking="none"))
        caught = {}
        saved = [layer["mlp"] for layer in layers]

        class Catch:
            def __init__(self, i, inner):
                self.i, self.inner = i, inner

            def __call__(self, *a):
                y = self.inner(*a)
                caught[self.i] = np.array(y[0, -1].astype(mx.float32)).astype(np.float64)
                return y

        for i, layer in enumerate(layers):
            layer.mlp = Catch(i, saved[i])
        try:
            model.logits(tok.encode(text))
        finally:
            for layer, m in zip(layers, saved):
                layer.mlp = m
        return np.stack([caught[i] for i in range(len(layers))])

    g = np.mean([rows(p) for p in good], axis=0)
    b = np.mean([rows(p) for p in bad], axis=0)
    for layer in range(len(layers)):
        d = (g[layer] - b[layer]) / np.linalg.norm(g[layer] - b[layer])
        base = b[layer] / np.linalg.norm(b[layer])
        d = d - d.dot(base) * base
        d /= np.linalg.norm(d)
        np.testing.assert_allclose(got[layer], d, atol=1e-4)
        assert abs(float(got[layer].astype(np.float64) @ base)) < 1e-4


def test_cli_flags_install_steering(tmp_path):
    """--dir-steering-* on generate / chat / serve: ds4's defaults, zero scales
    install nothing, scales without a file are refused; `serve` installs it before
    the disk KV cache takes the model's identity."""
    import argparse

    from ds4mlx.cli import generate
    from ds4mlx.cli.options import UsageError, install_steering
    from ds4mlx.kv.cache import model_identity

    model, tok = ds4mlx.load(None)
    path = tmp_path / "d.f32"
    _dirs(model, 5).astype("<f4").tofile(path)
    p = argparse.ArgumentParser()
    generate.add_chat_arguments(p)
    plain_id = model_identity(model)
    try:
        assert install_steering(p.parse_args(["--dir-steering-file", str(path)]), model) == "d.f32 ffn=1 attn=0"
        assert steering.installed(model).ffn == 1.0 and model_identity(model) != plain_id
        args = p.parse_args(["--dir-steering-file", str(path), "--dir-steering-ffn", "0", "--dir-steering-attn", "0"])
        install_steering(args, model)
        assert steering.installed(model) is None and model_identity(model) == plain_id
        with pytest.raises(UsageError, match="needs --dir-steering-file"):
            install_steering(p.parse_args(["--dir-steering-ffn", "2"]), model)
        from ds4mlx.serve import cli

        sp = argparse.ArgumentParser()
        cli.add_arguments(sp)
        engine, app = cli.build(
            sp.parse_args(
                ["--dir-steering-file", str(path), "--dir-steering-attn", "0.5", "--kv-disk-dir", str(tmp_path / "kv")]
            ),
            loaded=(model, tok),
        )
        try:
            s = steering.installed(model)
            assert (s.ffn, s.attn) == (0.0, 0.5)
            assert engine.cache.store.model_id == model_identity(model) != plain_id
        finally:
            engine.close()
    finally:
        steering.install(model, None)


@pytest.mark.parametrize("family", ["deepseek_v4", "deepseek_v41", "glm_moe_dsa", "glm5_next", "qwen4_exp"])
def test_a_steered_decode_runs_the_static_forward_and_equals_the_prefill(family, monkeypatch):
    """A family whose static forward steers (`static_steers`) decodes a steered model on it,
    eagerly (no trace), with the logits of the steered prefill forward of the same tokens;
    the step can be undone (the static layout)."""
    from ds4mlx.runtime import stepper

    monkeypatch.setenv(stepper.MODE_ENV, "compiled")
    model, tok = ds4mlx.load(f"demo:{family}")
    ids = tok.encode(TEXT)
    unsteered = model.logits(ids)[-6:]  # the plain graph (scale 0 is bit exact: no second load)
    steering.install(model, steering.Steering(_dirs(model, seed=2), ffn=1.2, attn=0.4))
    try:
        want = model.logits(ids)[-6:]
        s = model.new_session(ctx=len(ids) + 4)
        s.prefill(ids[:-6])
        assert s.can_undo
        got = []
        for t in ids[-6:]:
            got.append(np.array(s.step(t).astype(mx.float32)))
    finally:
        steering.install(model, None)
    assert stepper.trace_counts(model.model) == {}  # eager: nothing traced
    assert np.abs(want - unsteered).max() > 1e-2  # the steering moves these logits
    np.testing.assert_allclose(np.stack(got), want, atol=1e-4 * max(1.0, np.abs(want).max()), rtol=0)

"""`ds4mlx bench` on the demo model in CI-sized settings, and its regression gate."""

import csv

import pytest

from ds4mlx.bench import frontier as bench
from ds4mlx.cli.commands import main


def test_frontiers():
    assert bench.frontiers(64, 512, None, 2.0) == [64, 128, 256, 512]
    assert bench.frontiers(100, 350, 100, None) == [100, 200, 300, 350]
    assert bench.frontiers(64, 64, None, None) == [64]
    with pytest.raises(ValueError):
        bench.frontiers(0, 10, None, None)
    with pytest.raises(ValueError):
        bench.frontiers(10, 20, None, 1.0)


def test_compare_rules():
    base = [{"ctx_tokens": "64", "prefill_tps": "100", "gen_tps": "10"}]
    ok = [{"ctx_tokens": 64, "prefill_tps": 95.0, "gen_tps": 9.5}]
    bad = [{"ctx_tokens": 64, "prefill_tps": 80.0, "gen_tps": 10.0}]
    assert bench.compare(ok, base, 10) == []
    msgs = bench.compare(bad, base, 10)
    assert len(msgs) == 1 and "prefill_tps" in msgs[0] and "20.0%" in msgs[0]
    assert bench.compare([{"ctx_tokens": 128, "prefill_tps": 1, "gen_tps": 1}], base, 10)  # nothing to compare


def _scaled(rows, factor, path):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=bench.COLUMNS)
        w.writeheader()
        for r in rows:
            r = dict(r)
            for col in bench.GATED:
                r[col] = float(r[col]) * factor
            w.writerow(r)


def test_bench_demo_csv_plot_and_gate(tmp_path):
    out, png = tmp_path / "run.csv", tmp_path / "run.png"
    argv = ["bench", "--ctx-start", "32", "--ctx-max", "128", "--step-mul", "2", "--gen-tokens", "4"]
    assert main(argv + ["--csv", str(out), "--plot", str(png)]) == 0
    rows = bench.read_csv(out)
    assert [int(r["ctx_tokens"]) for r in rows] == [32, 64, 128]
    assert [int(r["prefill_tokens"]) for r in rows] == [32, 32, 64]  # incremental prefill
    assert all(float(r["prefill_tps"]) > 0 and float(r["gen_tps"]) > 0 for r in rows)
    assert all(int(r["kvcache_bytes"]) > 0 and int(r["peak_memory_bytes"]) > 0 for r in rows)
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"

    # A baseline 3x faster than this machine's first run: the gate must fail (wide margins: a
    # loaded 2-core machine's runs differ by tens of percent)
    faster = tmp_path / "faster.csv"
    _scaled(rows, 3.0, faster)
    assert main(argv + ["--csv", str(tmp_path / "b.csv"), "--compare", str(faster), "--max-regress", "10"]) == 1
    # A baseline at a third of our speed passes.
    slower = tmp_path / "slower.csv"
    _scaled(rows, 1 / 3, slower)
    assert main(argv + ["--csv", str(tmp_path / "c.csv"), "--compare", str(slower), "--max-regress", "10"]) == 0


@pytest.fixture(scope="module")
def demo(shared_demo):
    return shared_demo()


def test_profile_columns_on_demo(tmp_path, demo):
    """`bench --profile`: the per-frontier columns, launches equal to the census, % of the roofline
    from the weights read per token and the given bandwidth; the CPU has no GPU timer (n/a)."""
    from mlx.utils import tree_flatten

    from ds4mlx.bench import roofline
    from ds4mlx.bench.census import decode_census
    from ds4mlx.bench.frontier_profile import FrontierProfile

    out = tmp_path / "p.csv"
    argv = ["bench", "--ctx-start", "32", "--ctx-max", "48", "--step-incr", "16", "--gen-tokens", "4", "--profile"]
    assert main(argv + ["--bandwidth-gbps", "50", "--csv", str(out)]) == 0
    rows = bench.read_csv(out)
    assert [int(r["ctx_tokens"]) for r in rows] == [32, 48]
    model, _ = demo
    active = roofline.active_weight_bytes(model)
    assert 0 < active < sum(p.nbytes for _, p in tree_flatten(model.model.parameters()))
    for r in rows:
        assert set(bench.PROFILE_COLUMNS) <= set(r)
        assert r["gpu_busy_ms"] == "n/a"
        assert int(r["launches_per_token"]) == decode_census(model, int(r["ctx_tokens"]))["total"]
        tps = float(r["gen_tps"])
        assert 0 < float(r["host_ms_per_token"]) <= 1000 / tps * 1.01  # the host's share of the wall time
        assert float(r["roofline_pct"]) == pytest.approx(100 * tps * active / 50e9, rel=0.01)
    # no bandwidth known for the CPU: % of roofline n/a, never a guess
    profile = FrontierProfile.for_model(model)
    assert profile.bandwidth is None and profile.active_bytes == active
    assert main(["bench", "--bandwidth-gbps", "50"]) == 2  # read by --profile only


def test_roofline_table_and_arithmetic():
    import mlx.core as mx
    import mlx.nn as nn

    from ds4mlx.bench import roofline

    assert roofline.bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert roofline.bandwidth("NVIDIA H100 PCIe") == 2.0e12
    assert roofline.bandwidth("NVIDIA H200") == 4.8e12
    assert roofline.bandwidth("NVIDIA GH200 480GB") == 4.0e12
    assert roofline.bandwidth("Some Card") is None
    assert roofline.bandwidth("Some Card", override_gbps=800) == 800e9
    with pytest.raises(ValueError):
        roofline.bandwidth(override_gbps=0)
    assert roofline.roofline_tps(1e9, 4e12) == 4000
    assert roofline.roofline_pct(100, 1e9, 4e12) == pytest.approx(2.5)
    assert roofline.roofline_pct(100, 1e9, None) is None

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = {"w": mx.zeros((8, 16))}  # 512 B routed: 2 of 8 experts -> 128 B
            self.shared_experts = mx.zeros((16,))  # 64 B, always read
            self.o_proj = mx.zeros((8,))  # 32 B

    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = mx.zeros((10, 4))  # 160 B: one row (16 B) read per token
            self.layers = [Layer()]

    args = type("Args", (), {"vocab_size": 10, "num_experts_per_tok": 2, "n_routed_experts": 8})()
    toy = Toy()
    assert roofline.active_weight_bytes(toy, args) == 16 + 128 + 64 + 32
    args.num_experts_per_tok = None  # experts, but no top-k known: n/a
    assert roofline.active_weight_bytes(toy, args) is None


def test_engine_vs_bench_tool_runs_a_job(demo):
    """tools/serve_vs_bench.py --engine: the same prompt ids through the engine as a Job (no HTTP),
    timed from its first to its last text delta, every asked token generated."""
    import sys
    from pathlib import Path

    from ds4mlx.engine import Engine

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    from serve_vs_bench import engine_job

    model, tok = demo
    ids = bench.bench_tokens(tok, 24)
    engine = Engine(model, tok, ctx=64)
    try:
        secs, tokens = engine_job(engine, tok.decode(ids), ids, 5, ignore_eos=True)
    finally:
        engine.close()
    assert tokens == 5 and secs > 0


def test_profile_columns_arithmetic(monkeypatch):
    """The columns from their parts: GPU-busy = the profiled kernels' device time over the profiled
    steps (one unprofiled step first), host = (wall - token reads) / tokens, % of roofline."""
    from ds4mlx.bench import gpu_timer
    from ds4mlx.bench.frontier_profile import FrontierProfile

    monkeypatch.setattr(gpu_timer, "unavailable", lambda: None)
    monkeypatch.setattr(gpu_timer, "kernel_times", lambda fn: (fn(), {"a": [16, 800.0], "b": [16, 1600.0]}))  # µs
    profile = FrontierProfile(None, bandwidth=4e12, active_bytes=10**9)  # roofline 4,000 t/s
    monkeypatch.setattr(profile, "launches", lambda session, ctx: 57)
    probed = []
    cols = profile.columns(None, 2048, tokens=64, secs=0.5, wait_s=0.3, probe=probed.append)
    assert probed == [1, 16]
    assert cols == {"gpu_busy_ms": 0.15, "launches_per_token": 57, "host_ms_per_token": 3.125, "roofline_pct": 3.2}


def test_token_ids_past_the_vocab_are_refused():
    """A synthetic model with a small vocab_size override and the shipped text: a clear error, not
    the CPU's crash on an out-of-range embedding row."""
    small = type("M", (), {"vocab_size": 4096})()
    with pytest.raises(ValueError, match="vocab_size 4096"):
        bench.check_ids(small, [5, 127028])
    bench.check_ids(small, [0, 4095])

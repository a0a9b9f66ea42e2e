"""`ds4mlx bench` on the demo model in CI-sized settings, and its regression gate."""

import csv

import pytest

from ds4mlx.bench import frontier as bench
from ds4mlx.cli import main


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

    # A baseline 25% faster than this machine means we are 20% slower: the gate must fail.
    faster = tmp_path / "faster.csv"
    _scaled(rows, 1.25, faster)
    assert main(argv + ["--csv", str(tmp_path / "b.csv"), "--compare", str(faster), "--max-regress", "10"]) == 1
    # A baseline at half our speed passes.
    slower = tmp_path / "slower.csv"
    _scaled(rows, 0.5, slower)
    assert main(argv + ["--csv", str(tmp_path / "c.csv"), "--compare", str(slower), "--max-regress", "10"]) == 0

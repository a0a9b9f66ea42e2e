"""Crash safety of the disk KV store: a writer process is SIGKILLed at random
moments (and at every step of the write protocol); afterwards no partial file
is ever loaded, leftovers are cleaned, and the directory stays within budget.

Real I/O (os.fsync, os.replace) with small payloads, so it stays CPU-cheap."""

from __future__ import annotations

import importlib.util
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from ds4mlx.kv import store as ks

BUDGET = 24 * 1024
MODEL = "crash-test-model"

CHILD = r'''
import hashlib, os, signal, sys

from ds4mlx.kv.store import KVStore

BUDGET = %(budget)d
MODEL = %(model)r
CONVS = ["alpha ", "beta ", "gamma ", "delta ", "epsilon "]


def key_for(i):
    """Growing conversations: later keys extend earlier ones (strict prefixes)."""
    c = CONVS[i %% len(CONVS)]
    return c + "".join(f"turn{j} " for j in range(1 + (i // len(CONVS)) %% 7))


def payload_for(key, n):
    """Deterministic payload, so a loaded checkpoint can be checked byte for byte."""
    seed = hashlib.sha256(f"{key}|{n}".encode()).digest()
    size = 300 + int.from_bytes(seed[:2], "little") %% 3500
    return (seed * (size // 32 + 1))[:size]


def trailer_for(key, n):
    return f"KTM:{key}:{n}".encode() if n %% 3 == 0 else None


def open_store(crash_point=None, crash_at=-1):
    class Store(KVStore):
        saves = 0

        def _hook(self, point):
            if point == crash_point and 0 <= crash_at <= Store.saves:
                os.kill(os.getpid(), signal.SIGKILL)

    return Store, Store(sys.argv[1], BUDGET, MODEL, 4, 1 << 20, 1)


if __name__ == "__main__":
    seed = int(sys.argv[2])
    crash_point = sys.argv[3] if len(sys.argv) > 3 else None
    crash_at = int(sys.argv[4]) if len(sys.argv) > 4 else -1
    import random
    rnd = random.Random(seed)
    Store, store = open_store(crash_point, crash_at)
    print("ready", flush=True)
    for i in range(50):
        Store.saves = i
        key = key_for(rnd.randrange(35))
        n = len(key) + rnd.randrange(3)
        store.store(key, n, payload_for(key, n), rnd.choice(["cold", "continued", "evict"]),
                    trailer=trailer_for(key, n))
        if rnd.random() < 0.3:
            store.lookup(key + "next turn")
    print("done", flush=True)
'''


@pytest.fixture()
def child(tmp_path):
    path = tmp_path / "kv_child.py"
    path.write_text(CHILD % {"budget": BUDGET, "model": MODEL})
    spec = importlib.util.spec_from_file_location("kv_child", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.path = str(path)
    return mod


def kv_files(d):
    return [n for n in os.listdir(d) if n.endswith(".kv")]


def check_directory(d, child):
    """Invariants after a crash, checked *before* the store reopens it (open
    cleans up), then through a fresh store."""
    names = kv_files(d)
    total = sum(os.path.getsize(os.path.join(d, n)) for n in names)
    assert total <= BUDGET, f"{total} bytes of checkpoints > budget {BUDGET}"
    store = ks.KVStore(str(d), BUDGET, MODEL, 4, 1 << 20, 1)
    assert sorted(e.sha + ".kv" for e in store.entries()) == sorted(names), (
        "a final-name file failed its structural checks"
    )
    assert store.verify_all() == 0, "a final-name file failed its checksum"
    leftovers = [n for n in os.listdir(d) if ".tmp." in n]
    assert leftovers == [], f"temporaries left after open: {leftovers}"
    for e in store.entries():
        with open(e.path, "rb") as f:
            key = f.read(52 + e.key_bytes)[52:]
        cp = store.lookup(key + b"!")
        assert cp is not None and cp.sha == e.sha
        assert cp.payload == child.payload_for(cp.key_text, cp.n_tokens)
        assert cp.trailer == child.trailer_for(cp.key_text, cp.n_tokens)
    assert store.total_bytes() <= BUDGET
    return len(names)


def run_child(child, d, seed, *extra, kill_after=None):
    proc = subprocess.Popen(
        [sys.executable, child.path, str(d), str(seed), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        if kill_after is not None:
            time.sleep(kill_after)
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err


def test_random_sigkill_rounds(tmp_path, child):
    d = tmp_path / "cache"
    rnd = random.Random(1234)
    killed = 0
    for round_ in range(6):
        rc, err = run_child(child, d, 100 + round_, kill_after=rnd.uniform(0.0, 0.6))
        assert rc in (0, -signal.SIGKILL), err
        killed += rc == -signal.SIGKILL
        check_directory(d, child)
    assert killed >= 1, "no round was actually killed mid-run"


POINTS = ["key-written", "payload-written", "before-fsync", "before-rename", "renamed", "evicted", "meta-before-rename"]


@pytest.mark.parametrize("point", POINTS)
def test_sigkill_at_each_write_step(tmp_path, child, point):
    d = tmp_path / "cache"
    rc, err = run_child(child, d, 7, point, "20")
    assert rc == -signal.SIGKILL, f"never reached {point}: {err}"
    if point in ("key-written", "payload-written", "before-fsync", "before-rename", "meta-before-rename"):
        assert any(".tmp." in n for n in os.listdir(d)), "expected a leftover temporary"
    assert check_directory(d, child) > 0

"""The on-disk compile cache (runtime/disk_cache.py): hits across processes with the same outputs and stats,
bad entries are misses that are rewritten, racing threads and processes leave one valid entry, a writer killed
mid-write leaves a valid cache, failures are not cached, the size bound evicts least recently used entries, and
``off`` writes nothing."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from lowering_harness import trace

import neuron_compile
from neuron_compile.config import Config
from neuron_compile.pipeline import compile_region
from neuron_compile.runtime import disk_cache
from neuron_compile.runtime.disk_cache import DiskCache

CHILD = Path(__file__).with_name("disk_cache_child.py")
ROOT = Path(__file__).resolve().parent.parent
PARTS = {"what": "test", "graph": ["%0 = placeholder"]}


def child_env(cache_dir: Path) -> dict:
    return {**os.environ, "NEURON_COMPILE_CACHE": str(cache_dir), "PYTHONPATH": str(ROOT)}


def run_child(cache_dir: Path, *args: str) -> dict:
    done = subprocess.run([sys.executable, str(CHILD), *args], env=child_env(cache_dir), capture_output=True,
                          text=True, timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def entry_of(cache: DiskCache) -> Path:
    return cache.entry_path(disk_cache.key_of(PARTS))


# ---------------------------------------------------------------- one cache, in this process


def test_miss_then_hit_creates_once(tmp_path):
    cache = DiskCache(tmp_path)
    calls = []
    first = cache.get_or_create(PARTS, lambda: calls.append(1) or {"value": [1, 2]})
    second = cache.get_or_create(PARTS, lambda: calls.append(1) or {"value": "other"})
    assert first == ({"value": [1, 2]}, True) and second == ({"value": [1, 2]}, False) and calls == [1]
    key = disk_cache.key_of(PARTS)
    record = entry_of(cache).with_name(key + disk_cache.KEY_RECORD_SUFFIX).read_text()
    assert record.startswith(f"key: {key}\n") and "  %0 = placeholder" in record


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "wrong format", "edited payload", "other key"])
def test_a_bad_entry_is_a_miss_that_is_rewritten(tmp_path, damage):
    cache = DiskCache(tmp_path)
    cache.get_or_create(PARTS, lambda: {"value": 1})
    path = entry_of(cache)
    text = path.read_text()
    entry = json.loads(text)
    damaged = {
        "truncated": text[: len(text) // 2],
        "garbage": "\x00\xff not json at all",
        "empty": "",
        "wrong format": json.dumps({**entry, "format": disk_cache.FORMAT_VERSION + 1}),
        "edited payload": json.dumps({**entry, "payload": {"value": 2}}),
        "other key": json.dumps({**entry, "key": "0" * 40}),
    }[damage]
    path.write_bytes(damaged.encode("utf-8", "surrogateescape"))
    neuron_compile.reset_stats()
    assert cache.lookup(disk_cache.key_of(PARTS)) is None
    assert [key for key, _ in cache.verify()] == [disk_cache.key_of(PARTS)]
    payload, created = cache.get_or_create(PARTS, lambda: {"value": 3})
    assert (payload, created) == ({"value": 3}, True)
    assert cache.verify() == [] and cache.get_or_create(PARTS, lambda: {"value": 4}) == ({"value": 3}, False)
    # seen by the lookup above, then by get_or_create's lookup and its double-checked one under the lock
    assert neuron_compile.stats()["disk_cache_corrupt"] == 3


def test_a_failed_compile_is_not_cached(tmp_path):
    cache = DiskCache(tmp_path)

    def fail():
        raise RuntimeError("lowering failed")

    with pytest.raises(RuntimeError, match="lowering failed"):
        cache.get_or_create(PARTS, fail)
    assert cache.entries() == []
    assert cache.get_or_create(PARTS, lambda: {"value": 1}) == ({"value": 1}, True)


def test_racing_threads_compile_once(tmp_path):
    cache = DiskCache(tmp_path)
    calls, results = [], []

    def create():
        calls.append(1)
        time.sleep(0.2)  # long enough that every thread arrives while the first one compiles
        return {"value": "compiled"}

    def worker():
        results.append(DiskCache(tmp_path).get_or_create(PARTS, create)[0])  # its own instance, like a process

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert calls == [1] and results == [{"value": "compiled"}] * 8 and cache.verify() == []


def test_a_lock_held_past_the_timeout_does_not_block_the_compile(tmp_path):
    cache = DiskCache(tmp_path, lock_timeout_s=0.1)
    key = disk_cache.key_of(PARTS)
    lock_path = entry_of(cache).with_name(key + disk_cache.LOCK_SUFFIX)
    lock_path.parent.mkdir(parents=True)
    with open(lock_path, "a+b") as holder:
        fcntl.flock(holder.fileno(), fcntl.LOCK_EX)  # a process that hangs while compiling this key
        started = time.monotonic()
        assert cache.get_or_create(PARTS, lambda: {"value": 1}) == ({"value": 1}, True)
        assert time.monotonic() - started < 5
    assert cache.verify() == []


def test_size_bound_evicts_least_recently_used(tmp_path):
    cache = DiskCache(tmp_path)
    payload = {"source": "x" * 10_000}
    for index in range(4):
        cache.get_or_create({"what": index}, lambda: payload)
    entry_size = max(info.size for info in cache.entries())
    old = time.time() - 100
    for index, info in enumerate(sorted(cache.entries(), key=lambda info: info.key)):
        os.utime(info.path, (old + index, old + index))
    oldest_two = [info.key for info in sorted(cache.entries(), key=lambda info: info.last_used)[:2]]
    cache.lookup(oldest_two[0])  # a hit makes it recently used
    bounded = DiskCache(tmp_path, max_bytes=int(entry_size * 4.5))
    neuron_compile.reset_stats()
    bounded.get_or_create({"what": "new"}, lambda: payload)  # 5 entries > 4.5: evict down to 90 % (4.05)
    keys = {info.key for info in bounded.entries()}
    assert oldest_two[0] in keys and oldest_two[1] not in keys and len(keys) == 4
    assert neuron_compile.stats()["disk_cache_evictions"] == 1


def test_cache_root_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert disk_cache.cache_root("") == tmp_path / "neuron_compile"
    assert disk_cache.cache_root("OFF") is None and disk_cache.open_cache(Config(cache_dir="off")) is None
    assert disk_cache.cache_root(str(tmp_path / "c")) == tmp_path / "c"
    assert disk_cache.open_cache(None) is None  # no config: a direct compile_region call never touches the disk
    with pytest.raises(ValueError, match="NEURON_COMPILE_CACHE_SIZE must be a size"):
        Config.from_env({"NEURON_COMPILE_CACHE_SIZE": "lots"})
    assert Config.from_env({"NEURON_COMPILE_CACHE_SIZE": "512M"}).cache_size == 512 << 20


# ---------------------------------------------------------------- keys


def test_key_ignores_names_and_follows_what_changes_kernels(tmp_path):
    x = torch.randn(8, 16)
    first, renamed = trace(lambda t: torch.relu(t) * 2.0, x), trace(lambda t: torch.relu(t) * 2.0, x)
    for node in renamed.graph.nodes:
        node.name = f"{node.name}_layer1" if node.op != "output" else node.name
    renamed.recompile()
    assert first.code != renamed.code

    def key(gm, inputs=(x,), config=None, target="trn2"):
        return disk_cache.key_of(disk_cache.region_key_parts(gm, list(inputs), config or Config(), target))

    assert key(first) == key(renamed)
    assert key(first) == key(first, config=Config(cache_dir=str(tmp_path), fallback="raise", dump_dir="d"))
    assert key(first) != key(first, target="trn1")
    assert key(first) != key(first, config=Config(bucket=128))
    assert key(first) != key(trace(lambda t: torch.relu(t) * 3.0, x))
    assert key(first) != key(first, inputs=(x.t().contiguous().t(),))  # same shape, other strides


def test_compile_region_hit_skips_lowering_and_gives_the_same_kernels(tmp_path, monkeypatch):
    x = torch.randn(130, 70)
    gm = trace(lambda t: torch.softmax(t * 2.0, dim=-1), x)
    config = Config(cache_dir=str(tmp_path))
    neuron_compile.reset_stats()
    cold = compile_region(gm, [x], config)
    monkeypatch.setattr("neuron_compile.pipeline.lower_graph", lambda *args: pytest.fail("a hit must not lower"))
    warm = compile_region(gm, [x], config)
    assert [k.source for k in warm.kernels] == [k.source for k in cold.kernels]
    assert (warm.nki_nodes, warm.fusion_decisions) == (cold.nki_nodes, cold.fusion_decisions)
    torch.testing.assert_close(warm(x)[0], cold(x)[0], rtol=0, atol=0)
    torch.testing.assert_close(warm(x)[0], torch.softmax(x * 2.0, dim=-1))
    stats = neuron_compile.stats()
    assert (stats["disk_cache_misses"], stats["disk_cache_hits"]) == (1, 1)


def test_off_writes_nothing(tmp_path):
    x = torch.randn(8, 16)
    gm = trace(lambda t: t + 1.0, x)
    with neuron_compile.config.patch(cache_dir="off"):
        compile_region(gm, [x], neuron_compile.config.get())
    neuron_compile.reset_stats()
    torch._dynamo.reset()
    with neuron_compile.config.patch(cache_dir="off"):
        torch.compile(lambda t: t * 3.0, backend="neuron")(x)
    assert list(tmp_path.iterdir()) == [] and neuron_compile.stats()["disk_cache_misses"] == 0


# ---------------------------------------------------------------- separate processes


def test_second_process_compiles_nothing_and_matches_the_first(tmp_path):
    cold = run_child(tmp_path, "compile")
    warm = run_child(tmp_path, "compile")
    assert cold["stats"]["disk_cache_misses"] >= 1 and cold["stats"]["disk_cache_hits"] == 0
    assert warm["stats"]["disk_cache_misses"] == 0
    assert warm["stats"]["disk_cache_hits"] == cold["stats"]["disk_cache_misses"]
    assert warm["output"] == cold["output"] and warm["kernels"] == cold["kernels"]
    same = ("regions_compiled", "kernels_launched", "nki_nodes", "fallback_nodes", "hbm_bytes", "flops", "est_time_s")
    assert {name: warm["stats"][name] for name in same} == {name: cold["stats"][name] for name in same}


def test_four_processes_on_an_empty_cache(tmp_path):
    children = [
        subprocess.Popen([sys.executable, str(CHILD), "compile"], env=child_env(tmp_path), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    reports = []
    for child in children:
        out, err = child.communicate(timeout=300)
        assert child.returncode == 0, err
        reports.append(json.loads(out.strip().splitlines()[-1]))
    assert len({report["output"] for report in reports}) == 1
    assert len({json.dumps(report["kernels"]) for report in reports}) == 1
    cache = DiskCache(tmp_path)
    kinds = [cache.read(info.key)["parts"]["what"] for info in cache.entries()]
    assert cache.verify() == [] and kinds.count("nki region") == reports[0]["stats"]["regions_compiled"]
    assert kinds.count("cost report") == reports[0]["stats"]["kernels_launched"]  # each launch's first report
    assert sum(report["stats"]["disk_cache_misses"] for report in reports) >= kinds.count("nki region")


@pytest.mark.parametrize("mode", ["mid-write", "before-rename"])
def test_a_writer_killed_mid_write_leaves_a_valid_cache(tmp_path, mode):
    done = subprocess.run([sys.executable, str(CHILD), "killed-write", str(tmp_path), mode], env=child_env(tmp_path),
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == -9 and "not killed" not in done.stdout
    cache = DiskCache(tmp_path)
    leftovers = list(cache.directory.glob(f"*/{disk_cache.TEMP_PREFIX}*"))
    assert leftovers  # the dead writer's temporary file, never an entry
    assert cache.entries() == [] and cache.verify() == [] and cache.lookup("ab" * 20) is None
    assert cache.clear() == 0 and not list(cache.directory.glob(f"*/{disk_cache.TEMP_PREFIX}*"))


# ---------------------------------------------------------------- neuron-compile cache


def test_cache_cli(tmp_path, capsys):
    from neuron_compile import cli

    x = torch.randn(130, 70)
    compile_region(trace(lambda t: torch.softmax(t * 2.0, dim=-1), x), [x], Config(cache_dir=str(tmp_path)))
    cache = DiskCache(tmp_path)
    whats = {info.key: cache.read(info.key)["parts"]["what"] for info in cache.entries()}
    assert sorted(whats.values()) == ["kernel code", "nki region"]  # the region, and its kernel's signed code
    (key,) = [key for key, what in whats.items() if what == "nki region"]
    capsys.readouterr()
    assert cli.main(["cache", "--dir", str(tmp_path), "ls"]) == 0
    listing = capsys.readouterr().out
    assert key[:16] in listing and "trn2" in listing and "_softmax" in listing and "2 entries" in listing
    assert "compiled code of <nki-kernel" in listing and "signed by" in listing
    assert cli.main(["cache", "--dir", str(tmp_path), "show", key[:6]]) == 0
    shown = capsys.readouterr().out
    assert f"key: {key}" in shown and "aten._softmax.default" in shown and "@nki.jit" in shown and "== kernel" in shown
    assert cli.main(["cache", "--dir", str(tmp_path), "show", "zz"]) == 2
    assert "no entry with a key starting 'zz'" in capsys.readouterr().err
    assert cli.main(["cache", "--dir", str(tmp_path), "verify"]) == 0
    assert "2 entries checked, 0 unusable" in capsys.readouterr().out
    cache.entry_path(key).write_text("{truncated")
    assert cli.main(["cache", "--dir", str(tmp_path), "verify", "--delete"]) == 1
    assert f"{key}: not JSON" in capsys.readouterr().out and len(cache.entries()) == 1
    cache.get_or_create(PARTS, lambda: {"value": 1})
    assert cli.main(["cache", "--dir", str(tmp_path), "stats"]) == 0
    assert "entries: 2" in capsys.readouterr().out
    assert cli.main(["cache", "--dir", str(tmp_path), "clear"]) == 0
    assert "deleted 2 entries" in capsys.readouterr().out and cache.entries() == []
    assert cli.main(["cache", "ls"]) == 2  # the test run has NEURON_COMPILE_CACHE=off (conftest.py)
    assert "the cache is off" in capsys.readouterr().err

"""A shared on-disk cache is not a way to run code (issue 11): an entry planted with a valid checksum whose kernel
text would run code when loaded (importing os, ``__import__``, the ``__subclasses__`` escape, ``open``, ``eval`` /
``exec``, reaching Python's builtins through the simulator's modules, a class or a statement with a side effect at
the top level) is a miss, logged once with the rule and the line it breaks, compiled again to eager's result and
rewritten. Each payload would create a marker file if it ran, as a control load without the check shows; the
marker is never created through the cache."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import pytest
import torch
from lowering_harness import trace

import neuron_compile
from neuron_compile import cli, rendered_region
from neuron_compile.config import Config
from neuron_compile.pipeline import compile_region
from neuron_compile.runtime import disk_cache, simulator
from neuron_compile.runtime.disk_cache import DiskCache

OS_GLOBALS = ('[c for c in ().__class__.__base__.__subclasses__() if c.__name__ == "_wrap_close"][0]'
              '.__init__.__globals__')
# name: (where the payload goes, the payload with MARK for the marker file's path, the rule that refuses it). A
# "default" payload is the kernel function's last parameter's default value: it runs when the text is loaded.
PAYLOADS = {
    "imports os": ("top", "import os\nos.close(os.open(MARK, os.O_CREAT | os.O_WRONLY))", "import"),
    "calls __import__": ("default", '__import__("os").close(__import__("os").open(MARK, 65))', "underscore"),
    "subclasses escape": ("default", f'{OS_GLOBALS}["close"]({OS_GLOBALS}["open"](MARK, 65))', "underscore"),
    "calls open": ("default", 'open(MARK, "w").close()', "builtin"),
    "calls eval": ("default", """eval("open(%r, 'w').close()" % MARK)""", "builtin"),
    "calls exec": ("default", """exec("open(%r, 'w').close()" % MARK)""", "builtin"),
    "builtins through nl": ("default", 'nl.builtins.open(MARK, "w").close()', "nki attribute"),
    "defines a class": ("top", 'class Planted:\n    handle = open(MARK, "w").close()', "top level"),
    "top-level side effect": ("top", 'handle = open(MARK, "w").close()', "top level"),
}


def two_kernels(t):
    return torch.softmax(t, -1).sum(0)  # a row-normalize and a reduction kernel: one region kernel launches both


def launched_field(payload: dict) -> dict:
    """The kernel text a load executes: the region kernel's, or the only kernel's."""
    return payload["launch"] if payload["launch"] is not None else payload["kernels"][0]


def with_payload(text: str, name: str, case: str, marker) -> str:
    where, payload, _ = PAYLOADS[case]
    payload = payload.replace("MARK", repr(str(marker)))
    if where == "top":
        return text.replace("import nki.language as nl\n", "import nki.language as nl\n" + payload + "\n", 1)
    head, rest = text.split(f"\ndef {name}(", 1)
    parameters, body = rest.split("):\n", 1)
    return f"{head}\ndef {name}({parameters}, planted={payload}):\n{body}"


def write_signed(path: Path, entry: dict) -> None:
    """Write ``entry`` with a valid checksum, as anyone who can write into a shared folder can."""
    entry["checksum"] = hashlib.sha256(disk_cache.canonical_json(entry["payload"]).encode()).hexdigest()
    path.write_text(json.dumps(entry))


def plant(cache: DiskCache, key: str, case: str, marker) -> tuple[str, int]:
    """Rewrite the entry's executed kernel text with ``case``'s payload (validly signed); returns the kernel's name
    and the payload's first line."""
    path = cache.entry_path(key)
    entry = json.loads(path.read_text())
    field = launched_field(entry["payload"])
    field["source"] = with_payload(field["source"], field["name"], case, marker)
    write_signed(path, entry)
    line = next(number for number, text in enumerate(field["source"].splitlines(), 1)
                if "planted" in text or "Planted" in text or text.startswith(("import os", "handle")))
    return field["name"], line


def check_regions(entry: dict) -> None:
    """What ``neuron-compile cache verify`` checks of a region's entry."""
    if entry["parts"]["what"] == disk_cache.REGION_WHAT:
        rendered_region.check_stored(entry["payload"])


def region_key(cache: DiskCache) -> str:
    (key,) = [info.key for info in cache.entries() if cache.read(info.key)["parts"]["what"] == disk_cache.REGION_WHAT]
    return key


@pytest.mark.parametrize("case", sorted(PAYLOADS))
def test_a_planted_kernel_is_a_miss_compiled_again_and_never_run(tmp_path, case, caplog):
    x = torch.randn(130, 70)
    gm, config, cache = trace(two_kernels, x), Config(cache_dir=str(tmp_path / "cache")), DiskCache(tmp_path / "cache")
    cold = compile_region(gm, [x], config)
    key = region_key(cache)
    control = tmp_path / "control-marker"
    text = launched_field(cache.read(key)["payload"])
    simulator.load_module(with_payload(text["source"], text["name"], case, control), "control")
    assert control.exists()  # the payload is live: loaded without the check, it runs

    marker = tmp_path / "marker"
    name, line = plant(cache, key, case, marker)
    rule = PAYLOADS[case][2]
    [(_, problem)] = cache.verify(check_regions)
    assert f"kernel {name} line {line}: rule '{rule}'" in problem
    neuron_compile.reset_stats()
    with caplog.at_level(logging.WARNING, logger=disk_cache.__name__):
        warm = compile_region(gm, [x], config)
    assert not marker.exists()
    torch.testing.assert_close(warm(x)[0], two_kernels(x))
    stats = neuron_compile.stats()
    assert (stats["disk_cache_misses"], stats["disk_cache_hits"], stats["disk_cache_corrupt"]) == (1, 0, 2)
    warnings = [record.getMessage() for record in caplog.records if record.name == disk_cache.__name__]
    assert len(warnings) == 1 and f"rule '{rule}'" in warnings[0] and f"line {line}" in warnings[0], warnings
    # rewritten: the entry holds the compiler's own text again, and the next process hits it
    assert cache.verify(check_regions) == []
    assert [loaded.source.source for loaded in warm.launched] == [loaded.source.source for loaded in cold.launched]
    assert compile_region(gm, [x], config).launched[0].source.source == cold.launched[0].source.source
    assert neuron_compile.stats()["disk_cache_hits"] == 1 and not marker.exists()


def test_a_planted_single_kernel_region_is_a_miss_too(tmp_path):
    x = torch.randn(130, 70)
    gm, config = trace(lambda t: torch.softmax(t * 2.0, -1), x), Config(cache_dir=str(tmp_path))
    cache = DiskCache(tmp_path)
    compile_region(gm, [x], config)
    key = region_key(cache)
    assert cache.read(key)["payload"]["launch"] is None
    marker = tmp_path / "marker"
    plant(cache, key, "calls open", marker)
    neuron_compile.reset_stats()
    torch.testing.assert_close(compile_region(gm, [x], config)(x)[0], torch.softmax(x * 2.0, -1))
    assert not marker.exists() and neuron_compile.stats()["disk_cache_misses"] == 1


def test_cache_verify_reports_a_planted_text_even_one_a_load_does_not_execute(tmp_path, capsys):
    x = torch.randn(130, 70)
    gm, config, cache = trace(two_kernels, x), Config(cache_dir=str(tmp_path)), DiskCache(tmp_path)
    compile_region(gm, [x], config)
    key = region_key(cache)
    path = cache.entry_path(key)
    entry = json.loads(path.read_text())
    standalone = entry["payload"]["kernels"][0]  # with a region kernel, the kernels' own texts are records only
    standalone["source"] = with_payload(standalone["source"], standalone["name"], "calls eval", tmp_path / "marker")
    write_signed(path, entry)
    capsys.readouterr()
    assert cli.main(["cache", "--dir", str(tmp_path), "verify"]) == 1
    out = capsys.readouterr().out
    assert f"{key}: kernel {standalone['name']} line" in out and "rule 'builtin': `eval`" in out
    assert "2 entries checked, 1 unusable" in out  # the region, and its region kernel's signed code
    # a lookup executes the region kernel alone, so it hits (the text it would refuse is never run or parsed)
    neuron_compile.reset_stats()
    torch.testing.assert_close(compile_region(gm, [x], config)(x)[0], two_kernels(x))
    assert neuron_compile.stats()["disk_cache_hits"] == 1 and not (tmp_path / "marker").exists()

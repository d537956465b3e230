"""First-launch cost reports in the on-disk cache (runtime/report_cache.py, simulator/report.py's data form): a
report comes back from JSON exactly; a new process's (here: a new region's) first launch reads it and records no
trace, with the same figures; a changed cost model, a damaged entry or another argument signature traces again; a
report with collective calls is not stored."""

from __future__ import annotations

import json

import pytest
import torch

import neuron_compile
from neuron_compile import pipeline
from neuron_compile.config import Config
from neuron_compile.runtime import disk_cache, report_cache
from neuron_compile.runtime.disk_cache import DiskCache
from neuron_compile.runtime.simulator.report import report_data, report_from_data

from launch_spy import spy_traces

aten = torch.ops.aten
LAUNCH_FIGURES = ("kernels_launched", "hbm_bytes", "flops", "est_time_s", "est_lower_bound_s", "launch_s",
                  "roofline_s")


def _softmax_of_matmul(x, w):
    return aten._softmax.default(aten.mm.default(x, w), -1, False),


def _inputs(rows=130):
    generator = torch.Generator().manual_seed(0)
    return torch.randn(rows, 64, generator=generator), torch.randn(64, 96, generator=generator)


def _run_new_region(cache_dir, *inputs) -> tuple[dict, torch.Tensor]:
    """A region compiled anew (its kernels loaded anew, as in a new process) and run once: its stats and output."""
    config = Config(cache_dir=str(cache_dir), launcher="simulator")
    region = pipeline.compile_region(torch.fx.symbolic_trace(_softmax_of_matmul), list(inputs), config)
    neuron_compile.reset_stats()
    (output,) = region(*inputs)
    return neuron_compile.stats(), output


def _report_entries(cache_dir) -> list[dict]:
    cache = DiskCache(cache_dir)
    entries = [cache.read(info.key) for info in cache.entries()]
    return [entry for entry in entries if entry["parts"]["what"] == "cost report"]


def test_a_report_survives_json_exactly():
    x, w = _inputs()
    region = pipeline.compile_region(torch.fx.symbolic_trace(_softmax_of_matmul), [x, w], Config(cache_dir="off"))
    with neuron_compile.record_launches() as launches:
        region(x, w)
    (launch,) = launches
    data = json.loads(json.dumps(report_data(launch.report)))
    assert report_from_data(data) == launch.report and len(launch.report.sections) == 2


@pytest.mark.parametrize("damage", ["a figure that is text", "a field missing"])
def test_data_that_is_not_a_report_is_refused(damage):
    x, w = _inputs(8)
    region = pipeline.compile_region(torch.fx.symbolic_trace(_softmax_of_matmul), [x, w], Config(cache_dir="off"))
    with neuron_compile.record_launches() as launches:
        region(x, w)
    data = report_data(launches[0].report)
    if damage == "a figure that is text":
        data["busy_s_per_engine"]["tensor"] = "1e-6"
    else:
        del data["flops"]
    with pytest.raises(ValueError, match="cost_report_data"):
        report_from_data(data)


def test_a_new_region_reads_the_stored_report_and_records_no_trace(tmp_path, monkeypatch):
    x, w = _inputs()
    traced = spy_traces(monkeypatch)
    cold_stats, cold_output = _run_new_region(tmp_path, x, w)
    assert traced == [True] and len(_report_entries(tmp_path)) == 1
    warm_stats, warm_output = _run_new_region(tmp_path, x, w)
    assert traced == [True, False]  # every instruction ran again, none was recorded or scheduled
    assert {name: warm_stats[name] for name in LAUNCH_FIGURES} == {name: cold_stats[name] for name in LAUNCH_FIGURES}
    assert torch.equal(warm_output, cold_output)
    torch.testing.assert_close(warm_output, torch.softmax(x @ w, dim=-1))


def test_another_signature_or_cost_model_traces_again(tmp_path, monkeypatch):
    x, w = _inputs()
    traced = spy_traces(monkeypatch)
    _run_new_region(tmp_path, x, w)
    _run_new_region(tmp_path, *_inputs(rows=1))  # other shapes: their own kernels and report
    assert traced == [True, True]
    report_cache.cost_model_fingerprint.cache_clear()
    monkeypatch.setattr(report_cache, "cost_model_fingerprint", lambda: "a changed cost model")
    _run_new_region(tmp_path, x, w)
    assert traced == [True, True, True] and len(_report_entries(tmp_path)) == 3


@pytest.mark.parametrize("damage", ["garbage", "a valid entry whose report is not one"])
def test_a_damaged_report_entry_is_a_miss_that_is_rewritten(tmp_path, monkeypatch, damage):
    x, w = _inputs()
    cold_stats, _ = _run_new_region(tmp_path, x, w)
    (entry,) = _report_entries(tmp_path)
    key = entry["key"]
    cache = DiskCache(tmp_path)
    if damage == "garbage":
        cache.entry_path(key).write_bytes(b"\x00 not json")
    else:
        cache.store(key, entry["parts"], {"report": {"flops": "many"}})
    traced = spy_traces(monkeypatch)
    warm_stats, _ = _run_new_region(tmp_path, x, w)
    assert traced == [True] and cache.read(key)["payload"] == entry["payload"]
    assert {name: warm_stats[name] for name in LAUNCH_FIGURES} == {name: cold_stats[name] for name in LAUNCH_FIGURES}


def test_a_report_with_collective_calls_is_not_stored(tmp_path):
    x, w = _inputs(8)
    region = pipeline.compile_region(torch.fx.symbolic_trace(_softmax_of_matmul), [x, w], Config(cache_dir="off"))
    with neuron_compile.record_launches() as launches:
        region(x, w)
    report = launches[0].report
    with_collectives = type(report)(**{**report.__dict__, "collectives": ("an all_reduce",)})
    store = report_cache.ReportCache(DiskCache(tmp_path))
    store.store("kernel", "text", ("trn2", ((8, 64), "float32")), with_collectives)
    assert DiskCache(tmp_path).entries() == []
    with pytest.raises(ValueError, match="cost_report_collectives"):
        report_data(with_collectives)


def test_report_keys_follow_the_text_the_signature_and_the_cost_model():
    signature = ("trn2", ((8, 64), "float32"))

    def key(text="kernel text", arguments=signature):
        return disk_cache.key_of(report_cache.report_key_parts("k", text, arguments))

    assert key() == key() and key() != key(text="other text")
    assert key() != key(arguments=("trn1", ((8, 64), "float32"))) != key(arguments=("trn2", ((8, 65), "float32")))
    assert len(report_cache.cost_model_fingerprint()) == 16


def test_cache_cli_lists_and_shows_report_entries(tmp_path, capsys):
    from neuron_compile import cli

    _run_new_region(tmp_path, *_inputs())
    (entry,) = _report_entries(tmp_path)
    capsys.readouterr()
    assert cli.main(["cache", "--dir", str(tmp_path), "ls"]) == 0
    listing = capsys.readouterr().out
    # the region, its region kernel's signed code (runtime/signed_code.py) and the launch's report
    assert f"cost report of {entry['parts']['kernel']} (" in listing and "3 entries" in listing
    assert cli.main(["cache", "--dir", str(tmp_path), "show", entry["key"][:12]]) == 0
    shown = capsys.readouterr().out
    assert "what: cost report" in shown and "cost report (trn2): " in shown and "2 kernels in this launch" in shown

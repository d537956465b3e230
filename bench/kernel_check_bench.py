"""Benchmark: what checking kernel text costs a warm start (issue 11, the on-disk cache's safety).

A warm start loads each cached region's launched kernel text (the region kernel, or each kernel); the launcher now
parses it, checks it against the subset our templates emit (codegen/kernel_check.py) and compiles the checked tree,
where it compiled the text directly before. Per model: compile it once with the on-disk cache in a new temp folder
(in this process, so the heap a warm start checks in is there: torch, Dynamo, the model), then time, over the
cached regions' launched texts, interleaved and repeated (median of ``--repeats``, process CPU, torch on one thread):

* unchecked: ``simulator.load_module(text)``, the load before the check (compile from text, every builtin);
* checked: ``SimulatorLauncher().load(source)``, the load now (check, compile the tree, restricted builtins);
* check alone: ``check_kernel_text``, and the same over every kernel text of the entries (what ``neuron-compile
  cache verify`` parses; a load parses only the launched ones).

Models: the 2-layer Llama and the Flux block of bench/compile_time_bench.py (random weights from tiny configs, fp32,
inference). Needs the ``models`` extra. The table (markdown) goes to stdout.

    python bench/kernel_check_bench.py --repeats 9
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

from compile_time_bench import build_flux, build_llama


def cpu_ms(function) -> float:
    start = time.process_time()
    function()
    return (time.process_time() - start) * 1e3


def cached_regions(folder: str) -> list:
    from neuron_compile.rendered_region import RenderedRegion
    from neuron_compile.runtime import disk_cache

    cache = disk_cache.DiskCache(folder)
    entries = [cache.read(info.key) for info in cache.entries()]
    return [RenderedRegion.from_data(entry["payload"]) for entry in entries
            if entry["parts"]["what"] == disk_cache.REGION_WHAT]


def measure(model_name: str, repeats: int) -> dict:
    import torch

    import neuron_compile
    from neuron_compile.codegen.kernel_check import check_kernel_text
    from neuron_compile.runtime import simulator
    from neuron_compile.runtime.launcher import SimulatorLauncher

    model, inputs = {"llama": build_llama, "flux": build_flux}[model_name]()
    with tempfile.TemporaryDirectory(prefix="kernel-check-bench-") as folder:
        with neuron_compile.config.patch(cache_dir=folder), torch.no_grad():
            torch.compile(model, backend="neuron")(*inputs)
        regions = cached_regions(folder)
    launched = [source for region in regions
                for source in ([region.launch] if region.launch is not None else region.sources)]
    every_text = [source for region in regions
                  for source in [*region.sources, *([region.launch] if region.launch is not None else [])]]
    launcher = SimulatorLauncher()
    times: dict[str, list[float]] = {"unchecked": [], "checked": [], "check": [], "check every text": []}
    for _ in range(repeats):
        times["unchecked"].append(cpu_ms(lambda: [simulator.load_module(s.source, s.name) for s in launched]))
        times["checked"].append(cpu_ms(lambda: [launcher.load(source) for source in launched]))
        times["check"].append(cpu_ms(lambda: [check_kernel_text(s.source, s.name) for s in launched]))
        times["check every text"].append(cpu_ms(lambda: [check_kernel_text(s.source, s.name) for s in every_text]))
    return {"regions": len(regions), "texts": len(launched), "kilobytes": sum(len(s.source) for s in launched) / 1e3,
            **{name: statistics.median(values) for name, values in times.items()}}


def format_table(rows: dict) -> str:
    lines = ["| model | regions | launched texts | KB | unchecked load ms | checked load ms | added ms "
             "| check alone ms | every text checked ms |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for model_name, row in rows.items():
        lines.append(f"| {model_name} | {row['regions']} | {row['texts']} | {row['kilobytes']:.0f} | "
                     f"{row['unchecked']:.1f} | {row['checked']:.1f} | {row['checked'] - row['unchecked']:.1f} | "
                     f"{row['check']:.1f} | {row['check every text']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="llama,flux", help="comma-separated models: llama, flux")
    parser.add_argument("--repeats", type=int, default=9, help="timed repetitions per figure (median)")
    args = parser.parse_args(argv)
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(1)
    rows = {name: measure(name, args.repeats) for name in args.only.split(",")}
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

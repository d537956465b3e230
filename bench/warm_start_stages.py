"""Benchmark: where our part of a warm start goes, stage by stage (issue 11).

A warm start is a new process over a filled ``NEURON_COMPILE_CACHE``: its first call's CPU seconds minus a hit's
(bench/compile_time_bench.py, same models). Per model this script fills a cache in a temp folder (one process), then
runs ``--runs`` new processes over it, and prints per stage the median CPU seconds that stage took in the first call:
our decomposition table, aot_autograd (its trace, with our ``CompiledGraph`` made inside it), each pass of
``pipeline.PASSES`` (graph passes once per graph, region passes on a disk hit: ``load`` only), the region's disk-cache
key, the weights' column-major copies and the first launch (a hit replays it). "ours" is what the backend adds to
Dynamo + aot_autograd: the table, and ``CompiledGraph``'s making and its first call minus a hit's; on a warm start
from a warm-start record (runtime/warm_start.py, aot_autograd skipped), the key, the record's load and the warm
graph's first call minus a hit's.

Run it with ``PYTHONPATH`` at the tree to measure (a checkout of another commit measures that commit; the stage
names are those of ``pipeline.PASSES``). Torch on one thread; CPU seconds of this process only.

    PYTHONPATH=. python bench/warm_start_stages.py --only llama,flux --runs 3

Progress goes to stderr; the table (markdown) to stdout.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compile_time_bench  # noqa: E402 -- the same models as the compile-time table

# (label, "module:attribute" whose callable is timed); pipeline passes are added by name
STAGES = (
    ("decomposition table", "neuron_compile.backend:decomposition_table"),  # trees before trace_compile.py
    ("decomposition table", "neuron_compile.trace_compile:decomposition_table"),
    ("aot_autograd (with CompiledGraph made)", "torch._dynamo.backends.common:aot_module_simplified"),
    ("CompiledGraph made", "neuron_compile.runtime.compiled_graph:CompiledGraph.__init__"),
    ("CompiledGraph first call", "neuron_compile.runtime.compiled_graph:CompiledGraph.__call__"),
    ("region disk-cache key", "neuron_compile.runtime.disk_cache:region_key_parts"),
    ("weight copies", "neuron_compile.runtime.weight_layouts:COPIES.apply"),
    ("first launch", "neuron_compile.runtime.launcher:SimulatorLauncher.launch"),
    # the warm start without aot_autograd (runtime/warm_start.py): absent from trees before it, then skipped
    ("warm-start key", "neuron_compile.backend:warm_key_parts"),
    ("warm graph loaded (record and region)", "neuron_compile.backend:load_warm_graph"),
    # the load pass on a warm start's region (pipeline.PASSES' "load" holds its own reference, so a cold compile's
    # load shows as "pass load" only); trees before region_load.py counted it as "pass load"
    ("pass load", "neuron_compile.runtime.region_load:load_region"),
    ("WarmGraph first call", "neuron_compile.runtime.warm_start:WarmGraph.__call__"),
)
# the stages that make up "ours": what the backend adds to Dynamo (and to aot_autograd, when it runs)
OURS = ("decomposition table", "CompiledGraph made", "CompiledGraph first call", "warm-start key",
        "warm graph loaded (record and region)", "WarmGraph first call")


def timed(function, label: str, totals: collections.Counter):
    def wrapper(*args, **kwargs):
        start = time.process_time()
        try:
            return function(*args, **kwargs)
        finally:
            totals[label] += time.process_time() - start
    return wrapper


def install_timers(totals: collections.Counter) -> None:
    """Wrap each stage of ``STAGES`` and each pass of ``pipeline.PASSES`` with a CPU timer into ``totals``."""
    import importlib

    from neuron_compile import pipeline

    for label, where in STAGES:
        module_name, path = where.split(":")
        try:
            owner = importlib.import_module(module_name)
        except ImportError:  # a tree without that stage
            continue
        *parents, name = path.split(".")
        for parent in parents:
            owner = getattr(owner, parent)
        if hasattr(owner, name):
            setattr(owner, name, timed(getattr(owner, name), label, totals))
    pipeline.PASSES = tuple(dataclasses.replace(step, run=timed(step.run, f"pass {step.name}", totals))
                            for step in pipeline.PASSES)


def child(model_name: str) -> dict:
    """One process: compile, first call, hits; CPU seconds per stage of the first call."""
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model, inputs = {"llama": compile_time_bench.build_llama, "flux": compile_time_bench.build_flux}[model_name]()
    compiled = torch.compile(model, backend="neuron")  # imports neuron_compile (its entry point)
    totals: collections.Counter = collections.Counter()
    install_timers(totals)
    with torch.no_grad():
        start = time.process_time()
        compiled(*inputs)
        first_s = time.process_time() - start
        stages = dict(totals)
        hits = []
        for _ in range(3):
            start = time.process_time()
            compiled(*inputs)
            hits.append(time.process_time() - start)
    hit_s = min(hits)
    stages["ours"] = sum(stages.get(label, 0.0) for label in OURS) - hit_s
    stats = neuron_compile_stats()
    stages["aot_autograd skipped (graphs)"] = stats.get("aot_autograd_skipped", 0)
    return {"first - hit": first_s - hit_s, "hit": hit_s, **stages}


def neuron_compile_stats() -> dict:
    import neuron_compile

    return neuron_compile.stats()


def run_child(model_name: str, env: dict) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--child", model_name]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{model_name} child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(model_name: str, runs: int) -> dict:
    """The median of ``runs`` warm processes, per stage, over a cache one process filled."""
    with tempfile.TemporaryDirectory(prefix="warm-start-stages-") as folder:
        env = dict(os.environ, NEURON_COMPILE_CACHE=folder, OMP_NUM_THREADS="1")
        for name in ("NEURON_COMPILE_DUMP", "TORCH_TRACE"):
            env.pop(name, None)
        print(f"{model_name}: filling the cache ...", file=sys.stderr, flush=True)
        run_child(model_name, env)
        warm = []
        for run in range(runs):
            print(f"{model_name}: warm {run + 1}/{runs} ...", file=sys.stderr, flush=True)
            warm.append(run_child(model_name, env))
    labels = list(dict.fromkeys(label for figures in warm for label in figures))
    return {label: statistics.median(figures.get(label, 0.0) for figures in warm) for label in labels}


def format_table(rows: dict) -> str:
    models = list(rows)
    labels = list(dict.fromkeys(label for figures in rows.values() for label in figures))
    lines = ["| stage (CPU s, first call of a warm process) | " + " | ".join(models) + " |",
             "|---|" + "---:|" * len(models)]
    for label in labels:
        lines.append(f"| {label} | " + " | ".join(f"{rows[model].get(label, 0.0):.3f}" for model in models) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="llama,flux", help="comma-separated: llama, flux")
    parser.add_argument("--runs", type=int, default=3, help="warm processes per model (the median counts)")
    parser.add_argument("--child", metavar="MODEL", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child)))
        return 0
    rows = {model: measure(model, args.runs) for model in args.only.split(",")}
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Probe (issue 11, stop 34): torch 2.13's caching precompile, Dynamo's trace saved and loaded, with a custom backend.

Not a product path: it measures what skipping Dynamo's trace would save a warm start, and checks what torch's
machinery does when the inputs or the model change; why no opt-in was built from it is in bench/RESULTS.md ("Issue 11:
a warm start without Dynamo's trace, opt-in (stop 34)").

The machinery: with ``torch._dynamo.config.caching_precompile`` on, ``torch.compile(model)`` looks for a package in
``$TORCHINDUCTOR_CACHE_DIR/dynamo/<sha256 of the forward's qualified name and first line>`` and, when there is one,
installs its guards and Dynamo's bytecode, so the first call runs without Dynamo's trace. A backend takes part by
recording a ``BackendCacheArtifact`` under its graph's ``backend_id`` (``gm.meta["backend_id"]``), which a loading
process turns back into the compiled callable (``after_deserialization``, inside ``torch.compile()``); the package
(one pickle: guards, bytecode, artifacts) is written by ``torch.compiler.save_cache_artifacts()``. The backend here
passes Dynamo's graph through and records it, so a row with the package loaded is Dynamo's part of a warm start alone.

Rows: the warm start (``torch.compile()`` plus the first call, minus a hit; CPU seconds; the median of ``--runs`` new
processes) with the package off and loaded. Checks, each in new processes over a package an earlier one wrote: a
Flux block called with other shapes after a load (its guards fail: Dynamo must trace again), and a module whose
activation is a plain function attribute, saved with relu and loaded with sigmoid.

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python bench/dynamo_precompile_probe.py --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import compile_time_bench
import torch
from torch._dynamo.precompile_context import BackendCacheArtifact, PrecompileContext


class RecordedGraph(BackendCacheArtifact):
    """A package's artifact: Dynamo's graph (pickled with the package), run as it is after a load."""

    def after_deserialization(self):
        return self.content.forward


def recording_backend(gm: torch.fx.GraphModule, example_inputs: list):
    """A pass-through Dynamo backend that records its graph as the package's artifact."""
    PrecompileContext.record_artifact(RecordedGraph(key=gm.meta["backend_id"], content=gm))
    return gm.forward


def one_line(error: Exception) -> str:
    lines = str(error).strip().splitlines() or [""]
    return f"{type(error).__name__}: {lines[0][:200]}"


def first_output(result):
    """The tensor to compare: a model output's logits, a block's first output, or the tensor itself."""
    result = getattr(result, "logits", result)
    return result[0] if isinstance(result, tuple) else result


def warm_child(model_name: str, precompile: bool, save: bool) -> dict:
    """One process: compile, first call, a hit (CPU seconds); with ``save``, the package written after them."""
    from torch._dynamo.utils import counters

    torch._dynamo.config.caching_precompile = precompile
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model, inputs = {"llama": compile_time_bench.build_llama, "flux": compile_time_bench.build_flux}[model_name]()
    start = compile_time_bench.cpu_seconds()  # a package is loaded, and its artifacts made, inside torch.compile()
    try:
        compiled = torch.compile(model, backend=recording_backend)
    except Exception as error:  # noqa: BLE001 -- the probe reports what torch raised
        return {"outcome": f"torch.compile raised {one_line(error)}"}
    with torch.no_grad():
        first = compiled(*inputs)
        first_s = compile_time_bench.cpu_seconds() - start
        start = compile_time_bench.cpu_seconds()
        compiled(*inputs)
        hit_s = compile_time_bench.cpu_seconds() - start
        expected = model(*inputs)
    if save:
        torch.compiler.save_cache_artifacts()
    return {"warm_s": first_s - hit_s, "equal": torch.equal(first_output(first), first_output(expected)),
            "packages_loaded": counters["dynamo_cache"]["dynamo_cache_hit"]}


def other_shapes_child() -> dict:
    """A Flux block called with its saved shapes, then with 32 image tokens instead of 64 (its guards fail)."""
    torch._dynamo.config.caching_precompile = True
    torch.manual_seed(0)
    model, (hidden, text, temb, rotary) = compile_time_bench.build_flux()
    compiled = torch.compile(model, backend=recording_backend)
    results = {}
    with torch.no_grad():
        for name, inputs in (("saved shapes", (hidden, text, temb, rotary)),
                             ("32 image tokens", (hidden[:, :32], text, temb, tuple(r[:48] for r in rotary)))):
            try:
                same = torch.equal(first_output(compiled(*inputs)), first_output(model(*inputs)))
                results[name] = f"equal to eager: {same}"
            except Exception as error:  # noqa: BLE001 -- the probe reports what torch raised
                results[name] = f"raised {one_line(error)}"
    return results


class Activated(torch.nn.Linear):
    """A linear layer whose activation is a plain function held as an attribute (as some models hold theirs)."""

    def __init__(self, activation):
        super().__init__(8, 8)
        self.activation = activation

    def forward(self, x):
        return self.activation(super().forward(x))


def swapped_function_child(activation: str, save: bool) -> dict:
    """``Activated`` with relu or sigmoid: does the compiled call give eager's answer?"""
    torch._dynamo.config.caching_precompile = True
    torch.manual_seed(0)
    model = Activated({"relu": torch.relu, "sigmoid": torch.sigmoid}[activation])
    compiled = torch.compile(model, backend=recording_backend)
    x = torch.randn(4, 8)
    with torch.no_grad():
        same = torch.equal(compiled(x), model(x))
    if save:
        torch.compiler.save_cache_artifacts()
    return {"equal to eager": same}


# ---------------------------------------------------------------- parent


def run(arguments: list[str], folder: str) -> dict:
    """A child process over the caches in ``folder``; its JSON line, or how it failed."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(folder, "torch"),
               NEURON_COMPILE_CACHE=os.path.join(folder, "neuron"))
    command = [sys.executable, os.path.abspath(__file__), "--child", *arguments]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {"outcome": f"child failed: {done.stderr.strip().splitlines()[-1][:200]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def warm_row(model_name: str, precompile: bool, runs: int) -> dict:
    """The cold process (writing the package when ``precompile``), then ``runs`` warm ones over its caches."""
    with tempfile.TemporaryDirectory(prefix="dynamo-precompile-probe-") as folder:
        run(["warm", model_name, str(int(precompile)), str(int(precompile))], folder)
        warm = [run(["warm", model_name, str(int(precompile)), "0"], folder) for _ in range(runs)]
    timed = [figures for figures in warm if "warm_s" in figures]
    if not timed:
        return warm[0]
    return {**timed[-1], "warm_s": statistics.median(figures["warm_s"] for figures in timed)}


def checks() -> dict:
    found = {}
    with tempfile.TemporaryDirectory(prefix="dynamo-precompile-probe-") as folder:
        run(["warm", "flux", "1", "1"], folder)
        found["Flux block, after a load"] = run(["other-shapes"], folder)
    with tempfile.TemporaryDirectory(prefix="dynamo-precompile-probe-") as folder:
        found["relu, saved"] = run(["swapped", "relu", "1"], folder)
        found["sigmoid, loaded over relu's package"] = run(["swapped", "sigmoid", "0"], folder)
    return found


def child(kind: str, rest: list[str]) -> dict:
    if kind == "warm":
        return warm_child(rest[0], rest[1] == "1", rest[2] == "1")
    if kind == "other-shapes":
        return other_shapes_child()
    return swapped_function_child(rest[0], rest[1] == "1")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="warm processes per row (median)")
    parser.add_argument("--only", default="llama,flux", help="models, comma-separated")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1:])))
        return 0
    print("| model | Dynamo's package | warm start s (pass-through backend) | equal to eager | packages loaded |")
    print("|---|---|---:|---|---:|")
    for model_name in args.only.split(","):
        for precompile in (False, True):
            compile_time_bench.log(f"{model_name}, package {'loaded' if precompile else 'off'} ...")
            row = warm_row(model_name, precompile, args.runs)
            figures = (f"{row['warm_s']:.3f} | {row['equal']} | {row['packages_loaded']}" if "warm_s" in row
                       else f"{row['outcome']} | |")
            print(f"| {model_name} | {'loaded' if precompile else 'off'} | {figures} |", flush=True)
    for name, found in checks().items():
        print(f"- {name}: {json.dumps(found)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

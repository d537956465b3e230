"""Diffusers regional compile: every tiny model of bench/diffusers_models.py through ``compile_repeated_blocks``.

Per model class, each backend in a fresh process (Dynamo's caches and recompile limits start clean):
``model.compile_repeated_blocks(backend=..., fullgraph=True, dynamic=False)`` on a tiny random-weight model, one
call against eager. Columns: the largest difference from eager (and relative to eager's largest value), the ATen
nodes placed in NKI kernels vs run eagerly (share), kernels launched per call, Dynamo graphs compiled (against a
pass-through backend: ``eager``), the first call's CPU seconds beyond a warm call (compile time) for ours and
for Inductor, and the top fallback reason. A backend that fails says so in the row. By default both sides may hit
their on-disk caches from earlier runs; ``--cold`` turns them off for cold compile times.

    PYTHONPATH=. python bench/diffusers_bench.py
    PYTHONPATH=. python bench/diffusers_bench.py --only FluxTransformer2DModel,WanTransformer3DModel --cold
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time
import warnings

import torch

BACKENDS = ("neuron", "inductor", "eager")  # "eager": Dynamo's pass-through backend, the graph count reference


def cpu_seconds() -> float:
    """This process's CPU time plus its finished children's (Inductor's C++ builds)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def child(class_name: str, backend: str) -> dict:
    """One process: build, eager reference, regional compile, a first (compiling) and a second (warm) call."""
    import diffusers_models

    import neuron_compile

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    model, kwargs = diffusers_models.builder(class_name)()
    with torch.no_grad():
        expected = diffusers_models.first_output(model(**kwargs))
        torch._dynamo.reset()
        neuron_compile.reset_stats()
        torch._dynamo.utils.counters.clear()
        model.compile_repeated_blocks(backend=backend, fullgraph=True, dynamic=False)
        start = cpu_seconds()
        actual = diffusers_models.first_output(model(**kwargs))
        first = cpu_seconds() - start
        stats = neuron_compile.stats()
        start = cpu_seconds()
        model(**kwargs)
        warm = cpu_seconds() - start
    error = (actual.float() - expected.float()).abs().max().item()
    reasons = stats["fallback_reasons"].most_common(1)
    return dict(error=error, scale=expected.abs().max().item(), compile_s=first - warm, warm_s=warm,
                graphs=torch._dynamo.utils.counters["stats"]["unique_graphs"], nki_nodes=stats["nki_nodes"],
                fallback_nodes=stats["fallback_nodes"], kernels=stats["kernels_launched"],
                regions=stats["regions_compiled"], region_failures=stats["region_compile_failures"],
                top_reason=f"{reasons[0][0]} (x{reasons[0][1]})" if reasons else "")


# Cold compiles: our on-disk kernel cache and Inductor's caches off, so neither side reuses an earlier run's work.
COLD_ENVIRONMENT = {"NEURON_COMPILE_CACHE": "off", "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}


def run_child(class_name: str, backend: str, timeout: float, cold: bool = False) -> dict:
    command = [sys.executable, __file__, "--child", class_name, "--backend", backend]
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__),
                                                                 os.environ.get("PYTHONPATH", "")]))
    if cold:
        environment.update(COLD_ENVIRONMENT)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=environment)
    except subprocess.TimeoutExpired:
        return dict(failure=f"timeout after {timeout:.0f} s")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return dict(failure=error_line(done.stderr)[:160])
    return json.loads(lines[-1])


def error_line(stderr: str) -> str:
    """The last ``SomeError: message`` line of a traceback (torch appends hints after it), else the last line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[\w.]*(Error|Exception)\b", line)]
    return (errors or lines or ["no output"])[-1]


def row(class_name: str, results: dict) -> str:
    neuron, inductor, passthrough = (results[backend] for backend in BACKENDS)
    if "failure" in passthrough and passthrough["failure"] != "not run":
        return f"| {class_name} | fails with a pass-through backend too: {passthrough['failure']} |||||||||"
    if "failure" in neuron:
        return f"| {class_name} | neuron failed: {neuron['failure']} |||||||||"
    nodes = neuron["nki_nodes"] + neuron["fallback_nodes"]
    share = 100.0 * neuron["nki_nodes"] / nodes if nodes else 0.0
    inductor_s = f"{inductor['compile_s']:.1f}" if "failure" not in inductor else inductor["failure"][:40]
    return (f"| {class_name} | {neuron['error']:.1e} ({neuron['error'] / max(neuron['scale'], 1e-30):.0e}) | "
            f"{neuron['nki_nodes']}/{neuron['fallback_nodes']} | {share:.1f}% | {neuron['kernels']} | "
            f"{neuron['graphs']}/{passthrough.get('graphs', '-')} | {neuron['compile_s']:.1f} | {inductor_s} | "
            f"{neuron['region_failures']} | {neuron['top_reason']} |")


HEADER = ("| model | max error (relative) | NKI / eager nodes | NKI share | kernels per call "
          "| graphs ours/pass-through | compile s ours | compile s Inductor | failed regions | top fallback |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated class names (default: all in diffusers_models)")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="neuron,inductor,eager")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per child process")
    parser.add_argument("--cold", action="store_true", help="caches off on both sides (NEURON_COMPILE_CACHE=off, "
                        "TORCHINDUCTOR_FORCE_DISABLE_CACHES=1): cold compile times")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--backend", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.child:
        print(json.dumps(child(arguments.child, arguments.backend)))
        return
    sys.path.insert(0, os.path.dirname(__file__))
    import diffusers_models

    names = arguments.only.split(",") if arguments.only else list(diffusers_models.MODELS)
    wanted = arguments.backends.split(",")
    print(HEADER, flush=True)
    for name in names:
        results = {backend: run_child(name, backend, arguments.timeout, arguments.cold) if backend in wanted
                   else dict(failure="not run") for backend in BACKENDS}
        print(row(name, results), flush=True)


if __name__ == "__main__":
    main()

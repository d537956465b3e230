"""Benchmark: compile time and dispatch overhead, ours against Inductor in the same run (issue 11).

Per model, each figure from its own fresh process (so nothing in memory carries over). Times are CPU seconds
(the process's, plus its finished children's: Inductor's C++ builds), with torch on one thread: on a machine shared
with other jobs, wall time measures the neighbours as much as the compiler.

* cold: the first call's time minus a hit call's time (what compiling adds), with empty caches: ours with
  ``NEURON_COMPILE_CACHE`` in a new temp dir, Inductor with ``TORCHINDUCTOR_CACHE_DIR`` in another (its FX graph
  cache, AOTAutograd cache and C++ build cache all live there);
* warm: the same in a second new process over the caches the cold process filled (our on-disk kernel cache vs
  Inductor's FX graph and AOTAutograd caches); with ``--warm-runs N``, the median of N such processes; "with
  torch.compile()" adds the ``torch.compile()`` call before the first call, where Dynamo looks the backend up: our
  backend's imports (neuron_compile, its simulator's ml_dtypes) happen there, Inductor's inside its first call, so
  only this column counts both backends' imports. Our package is byte-compiled before the first process, as pip
  does at install for torch's modules: where ``PYTHONDONTWRITEBYTECODE`` is set (this project's machines), nothing
  else writes our ``.pyc`` files, and every process would compile our modules from source (~0.5 s of CPU) while
  torch's load compiled;
* hit: in the cold process, after the first call, per call (median): the whole call (Dynamo's guards and
  aot_autograd's wrapper included), the time our launcher spent running kernels on the simulator ("in kernels"),
  what our dispatch adds around them ("dispatch": the time inside ``CompiledGraph.__call__`` minus the launcher's:
  the lookup, the FX graph, each region's argument and output handling and stats, per kernel), and of that the
  lookup alone ("lookup": ``CompiledGraph.lookup``, the config read and the call's signature looked up).
  Inductor's row shows its whole call (its kernels included) for scale.

Models (random weights from tiny configs built in code, nothing downloaded, fp32, inference under no_grad):
a 2-layer ``LlamaForCausalLM`` (hidden 256, 4 heads, seq 128) and one diffusers ``FluxTransformerBlock``
(2 heads x 64, 64 image + 16 text tokens). Needs the ``models`` extra (transformers, diffusers).

    python bench/compile_time_bench.py              # both models, both backends (~2 min on 2 shared cores)
    python bench/compile_time_bench.py --only llama --hits 20
    python bench/compile_time_bench.py --hits 9 --warm-runs 5   # warm starts: the median of 5 processes each
    python bench/compile_time_bench.py --hot                    # the hit path alone, in a hot loop (below)

``--hot`` times a cache hit in a hot loop instead (one process per model and backend; thread CPU per call, the best
of ``--batches`` batches of ``--calls`` calls, after warm-up calls): the launcher's simulation is replaced by
replaying each kernel's last real launch (its outputs and report), so what is left is dispatch. Columns: "ours"
calls the ``CompiledGraph`` objects directly with the arguments aot_autograd handed them (our part alone: the key,
the weight copies, the FX graph, each region's inputs, launches and outputs, stats); "whole call" is
``compiled(*inputs)`` (Dynamo's guards, aot_autograd's wrappers and the model's Python outside the graph too);
"pass-through" is the same call through aot_autograd with a compiler that replays the graph's first outputs (what
Dynamo and aot_autograd cost around a graph that costs nothing); "aot_eager" runs the graph's ATen ops eagerly.
``--only flux2`` (hot loop only): two Flux blocks of one class called in turn, as diffusers' regional compile does.
The hot loop's calls alternate between two sets of input tensors with the same values, so no input is the same
object on two calls in a row, as a model's activations in a loop.

Progress goes to stderr; the table (markdown) to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

MODELS = ("llama", "flux")
BACKENDS = ("neuron", "inductor")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- models (child process)


def build_llama():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, config.vocab_size, (1, 128), generator=torch.Generator().manual_seed(0))
    return model, (ids,)


def build_flux():
    import torch
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed, FluxTransformerBlock

    heads, head_dim, image_tokens, text_tokens = 2, 64, 64, 16
    dim = heads * head_dim
    block = FluxTransformerBlock(dim=dim, num_attention_heads=heads, attention_head_dim=head_dim).eval()
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, image_tokens, dim, generator=generator)
    text = torch.randn(1, text_tokens, dim, generator=generator)
    temb = torch.randn(1, dim, generator=generator)
    positions = torch.zeros(image_tokens + text_tokens, 3)
    positions[text_tokens:, 1] = torch.arange(image_tokens) // 8
    positions[text_tokens:, 2] = torch.arange(image_tokens) % 8
    rotary = FluxPosEmbed(theta=10000, axes_dim=[16, 24, 24])(positions)
    return block, (hidden, text, temb, rotary)


def cpu_seconds() -> float:
    """CPU time of this process and of its finished children (Inductor's compiler runs): on 2 cores shared with
    other jobs, wall time measures the neighbours as much as the compiler."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def timed_dispatch() -> dict:
    """Wrap our dispatch (``CompiledGraph.__call__`` and its ``lookup``) and the simulator launcher's ``launch``
    with per-thread CPU timers (this process only)."""
    from neuron_compile.runtime import compiled_graph, launcher

    totals = {"call_s": 0.0, "lookup_s": 0.0, "launch_s": 0.0}

    def timing(function, name):
        def wrapper(*args, **kwargs):
            start = time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                totals[name] += time.thread_time() - start
        return wrapper

    graph = compiled_graph.CompiledGraph
    graph.__call__ = timing(graph.__call__, "call_s")
    key_step = "lookup" if hasattr(graph, "lookup") else "key_for"  # key_for: its name before the fast path
    setattr(graph, key_step, timing(getattr(graph, key_step), "lookup_s"))
    launcher.SimulatorLauncher.launch = timing(launcher.SimulatorLauncher.launch, "launch_s")
    return totals


def child(model_name: str, backend: str, hits: int) -> dict:
    """One process: build, compile, first call, ``hits`` further calls; CPU seconds as a dict."""
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(1)  # CPU time then equals the work done, whatever the machine's load
    model, inputs = {"llama": build_llama, "flux": build_flux}[model_name]()
    start = cpu_seconds()
    compiled = torch.compile(model, backend=backend)  # looks the backend up: imports neuron_compile
    compile_s = cpu_seconds() - start
    totals = timed_dispatch() if backend == "neuron" else None
    with torch.no_grad():
        start = cpu_seconds()
        compiled(*inputs)
        first_s = cpu_seconds() - start
        per_call: dict[str, list[float]] = {"call_s": [], "ours_s": [], "lookup_s": [], "launch_s": []}
        for _ in range(hits):
            before = dict(totals or {})
            start = cpu_seconds()
            compiled(*inputs)
            per_call["call_s"].append(cpu_seconds() - start)
            if totals:
                spent = {name: totals[name] - before[name] for name in totals}
                per_call["ours_s"].append(spent["call_s"] - spent["launch_s"])
                per_call["lookup_s"].append(spent["lookup_s"])
                per_call["launch_s"].append(spent["launch_s"])
    return {"first_s": first_s, "compile_s": compile_s,
            **{name: statistics.median(values) for name, values in per_call.items() if values}}


# ---------------------------------------------------------------- hot loop (child process)


def best_per_call(function, batches: int, calls: int) -> float:
    """Thread CPU seconds per call of ``function``: the best batch's mean (the garbage collector off while timing:
    its pauses belong to whichever call triggers them)."""
    best = math.inf
    gc.collect()
    gc.disable()
    try:
        for _ in range(batches):
            start = time.thread_time()
            for _ in range(calls):
                function()
            best = min(best, (time.thread_time() - start) / calls)
    finally:
        gc.enable()
    return best


def record_then_replay_launches():
    """Record each kernel's launches on the simulator; the returned function switches to replaying the last one
    (its outputs and report) without simulating, so a hot loop times our dispatch and not the kernels."""
    from neuron_compile.runtime import launcher

    recorded: dict[int, tuple] = {}
    simulate = launcher.SimulatorLauncher.launch

    def recording(self, kernel, tensors):
        recorded[id(kernel)] = result = simulate(self, kernel, tensors)
        return result

    def replaying(self, kernel, tensors):
        return recorded[id(kernel)]

    launcher.SimulatorLauncher.launch = recording
    return lambda: setattr(launcher.SimulatorLauncher, "launch", replaying)


@contextlib.contextmanager
def captured_graph_calls():
    """Yields a list that collects each ``CompiledGraph`` call inside the block as (graph, its arguments)."""
    from neuron_compile.runtime import compiled_graph

    calls: list = []
    dispatch = compiled_graph.CompiledGraph.__call__

    def capturing(self, args):
        calls.append((self, list(args)))
        return dispatch(self, args)

    compiled_graph.CompiledGraph.__call__ = capturing
    try:
        yield calls
    finally:
        compiled_graph.CompiledGraph.__call__ = dispatch


def replayed_pass_through():
    """A pass-through backend (aot_autograd as aot_eager sets it up) whose compiled graph runs its ATen ops once
    and then returns those outputs on every call: Dynamo's and aot_autograd's cost around a graph costing nothing."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def replaying_compiler(graph, example_inputs):
        first: list = []

        def run(args):
            if not first:
                first.append(graph(*args))
            return first[0]

        run._boxed_call = True
        return run

    return aot_autograd(fw_compiler=replaying_compiler, inference_compiler=replaying_compiler,
                        partition_fn=min_cut_rematerialization_partition, keep_inference_input_mutations=True)


def hot_calls(model_name: str, backend):
    """The calls one hot-loop step makes: ``[(callable, args)]``. ``flux2``: two Flux blocks of one class called in
    turn through one compiled function, as diffusers' regional compile calls each block (figures per call)."""
    import torch

    if model_name != "flux2":
        model, inputs = {"llama": build_llama, "flux": build_flux}[model_name]()
        return [(torch.compile(model, backend=backend), inputs)]
    (first, inputs), (second, _) = build_flux(), build_flux()
    compiled = torch.compile(lambda block, *arguments: block(*arguments), backend=backend)
    return [(compiled, (first, *inputs)), (compiled, (second, *inputs))]


def fresh_inputs(steps: list) -> list:
    """``steps`` with each input tensor cloned: a model called in a loop gets new activations on every call."""
    import torch

    return [(compiled, tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in inputs))
            for compiled, inputs in steps]


def hot_child(model_name: str, backend: str, batches: int, calls: int) -> dict:
    """One process: compile, warm up, then per-call thread CPU of a hit in a hot loop (see the module docstring).
    Calls alternate between two sets of input tensors (the same values, other objects), as a loop's new
    activations do: nothing may be kept by the identity of an input."""
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(1)
    replay = record_then_replay_launches() if backend == "neuron" else None
    steps = hot_calls(model_name, replayed_pass_through() if backend == "pass-through" else backend)
    rounds = [steps, fresh_inputs(steps)]
    figures = {}
    with torch.no_grad():
        for compiled, inputs in steps:
            compiled(*inputs)  # compiles
        with captured_graph_calls() as graph_calls:
            for round_steps in rounds:
                for compiled, inputs in round_steps:
                    compiled(*inputs)  # a hit, simulated: its launches are the ones replayed below
        if replay is not None:
            replay()
            figures["ours_s"] = best_per_call(
                lambda: [graph(list(args)) for graph, args in graph_calls], batches, calls) / len(graph_calls)
        figures["call_s"] = best_per_call(
            lambda: [compiled(*inputs) for round_steps in rounds for compiled, inputs in round_steps],
            batches, calls) / (len(steps) * len(rounds))
    return figures


# ---------------------------------------------------------------- driver


def byte_compile_package() -> None:
    """Write the ``.pyc`` files of the neuron_compile the children import (see the module docstring)."""
    import compileall
    import importlib.util

    folder = importlib.util.find_spec("neuron_compile").submodule_search_locations[0]
    if not compileall.compile_dir(folder, quiet=1):
        raise RuntimeError(f"byte-compiling {folder} failed")


def run_child(model_name: str, backend: str, hits: int, env: dict) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--child", model_name, backend, "--hits", str(hits)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{model_name}/{backend} child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(model_name: str, backend: str, hits: int, warm_runs: int = 1) -> dict:
    with tempfile.TemporaryDirectory(prefix="compile-time-bench-") as folder:
        env = dict(os.environ, NEURON_COMPILE_CACHE=os.path.join(folder, "neuron"),
                   TORCHINDUCTOR_CACHE_DIR=os.path.join(folder, "inductor"), TORCHINDUCTOR_FX_GRAPH_CACHE="1",
                   TORCHINDUCTOR_AUTOGRAD_CACHE="1")
        env.pop("NEURON_COMPILE_DUMP", None)
        env.pop("TORCH_TRACE", None)
        log(f"{model_name} / {backend}: cold ...")
        cold = run_child(model_name, backend, hits, env)
        warm_s, with_imports_s = [], []
        for run in range(warm_runs):
            log(f"{model_name} / {backend}: warm {run + 1}/{warm_runs} ...")
            warm = run_child(model_name, backend, 2, env)
            warm_s.append(warm["first_s"] - warm["call_s"])
            with_imports_s.append(warm["compile_s"] + warm["first_s"] - warm["call_s"])
    return {
        "cold_s": cold["first_s"] - cold["call_s"],
        "warm_s": statistics.median(warm_s),
        "warm_with_imports_s": statistics.median(with_imports_s),
        "call_s": cold["call_s"],
        "launch_s": cold.get("launch_s"),
        "ours_s": cold.get("ours_s"),
        "lookup_s": cold.get("lookup_s"),
    }


HOT_BACKENDS = ("neuron", "pass-through", "aot_eager")


def measure_hot(model_name: str, batches: int, calls: int, backends=HOT_BACKENDS) -> dict:
    """Per backend of ``backends``, a hot-loop child's figures (each its own process, caches off)."""
    env = dict(os.environ, NEURON_COMPILE_CACHE="off")
    figures = {}
    for backend in backends:
        log(f"{model_name} / {backend}: hot loop ...")
        command = [sys.executable, os.path.abspath(__file__), "--hot-child", model_name, backend,
                   "--batches", str(batches), "--calls", str(calls)]
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{model_name}/{backend} hot child failed:\n{done.stderr[-3000:]}")
        figures[backend] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


def format_hot_table(rows: dict) -> str:
    lines = ["| model | ours us | neuron whole call us | pass-through whole call us | neuron - pass-through us | "
             "aot_eager whole call us |", "|---|---:|---:|---:|---:|---:|"]

    def shown(figures: dict, backend: str, name: str) -> str:
        return f"{figures[backend][name] * 1e6:.1f}" if backend in figures else "-"

    for model_name, figures in rows.items():
        difference = "-"
        if {"neuron", "pass-through"} <= set(figures):
            difference = f"{(figures['neuron']['call_s'] - figures['pass-through']['call_s']) * 1e6:.1f}"
        lines.append(f"| {model_name} | {shown(figures, 'neuron', 'ours_s')} | {shown(figures, 'neuron', 'call_s')} | "
                     f"{shown(figures, 'pass-through', 'call_s')} | {difference} | "
                     f"{shown(figures, 'aot_eager', 'call_s')} |")
    return "\n".join(lines)


def format_table(rows: dict) -> str:
    lines = ["| model | backend | cold compile s | warm start s | with torch.compile() s | per call ms | in kernels ms | "
             "dispatch us | lookup us |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for model_name, by_backend in rows.items():
        for backend, row in by_backend.items():
            ours = [f"{row[name] * scale:.{digits}f}" if row[name] is not None else "-"
                    for name, scale, digits in (("launch_s", 1e3, 1), ("ours_s", 1e6, 0), ("lookup_s", 1e6, 0))]
            lines.append(f"| {model_name} | {backend} | {row['cold_s']:.2f} | {row['warm_s']:.2f} | "
                         f"{row['warm_with_imports_s']:.2f} | {row['call_s'] * 1e3:.1f} | {' | '.join(ours)} |")
        if set(BACKENDS) <= set(by_backend):
            ours, theirs = by_backend["neuron"], by_backend["inductor"]
            lines.append(f"| {model_name} | ratio ours/Inductor | {ours['cold_s'] / theirs['cold_s']:.2f}x | "
                         f"{ours['warm_s'] / theirs['warm_s']:.2f}x | "
                         f"{ours['warm_with_imports_s'] / theirs['warm_with_imports_s']:.2f}x | | | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(MODELS),
                        help="comma-separated models: llama, flux (with --hot also flux2: two blocks in turn)")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated: neuron, inductor")
    parser.add_argument("--hits", type=int, default=5, help="hit calls timed per model (median)")
    parser.add_argument("--warm-runs", type=int, default=1,
                        help="warm starts per model and backend, each a new process (median): one is noisy on a "
                             "shared machine")
    parser.add_argument("--hot", action="store_true", help="time a hit in a hot loop, the simulation replayed")
    parser.add_argument("--batches", type=int, default=15, help="--hot: batches timed (the best one counts)")
    parser.add_argument("--calls", type=int, default=200, help="--hot: calls per batch")
    parser.add_argument("--hot-backends", default=",".join(HOT_BACKENDS), help="--hot: comma-separated, of "
                        + ", ".join(HOT_BACKENDS))
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "BACKEND"), help=argparse.SUPPRESS)
    parser.add_argument("--hot-child", nargs=2, metavar=("MODEL", "BACKEND"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child, args.hits)))
        return 0
    if args.hot_child:
        print(json.dumps(hot_child(*args.hot_child, args.batches, args.calls)))
        return 0
    if args.hot:
        backends = args.hot_backends.split(",")
        print(format_hot_table({name: measure_hot(name, args.batches, args.calls, backends)
                                for name in args.only.split(",")}))
        return 0
    rows: dict[str, dict] = {}
    byte_compile_package()
    for model_name in args.only.split(","):
        for backend in args.backends.split(","):
            rows.setdefault(model_name, {})[backend] = measure(model_name, backend, args.hits, args.warm_runs)
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

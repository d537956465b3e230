"""Backend stage: the Dynamo backend ``neuron`` — wiring only.

Input: a torch-level FX graph from Dynamo and its (fake) example inputs, plus ``torch.compile``'s ``mode`` and
``options``. Output: a callable that runs the graph. aot_autograd turns the graph into ATen forward / backward
(min-cut partitioned, for training) or inference graphs with our decomposition table, keeping input mutations
in the graph; each ATen graph goes to ``compile_aten_graph`` (runtime/compiled_graph.py), which specializes,
partitions and compiles it per call signature (trace_compile.py, imported at the first graph that compiles: a warm
start imports none of the compiler). A graph with a warm-start key (runtime/warm_key.py) whose record is in
the on-disk cache skips aot_autograd: it runs from the record (runtime/warm_start.py); without a record, the first
call writes one when aot_autograd's facts and the compile allow it (runtime/warm_candidate.py).

Every Dynamo graph is noted in runtime/compile_events.py (why it ended: a graph break and its source line); with a
dump folder, its FX graph is written there (runtime/dump.py).

Registration: the ``torch_dynamo_backends`` entry points make ``backend="neuron"`` and ``"neuron_compile"``
work without importing this package; importing it also registers them, unless another package (AWS
``torch_neuronx``) already owns ``"neuron"`` — then only ``"neuron_compile"`` is ours, and the log says so.
"""

from __future__ import annotations

import logging

import torch

from neuron_compile import config, logs, untraced_fsdp
from neuron_compile.runtime import compile_events, dump
from neuron_compile.runtime.graph_records import refresh_dump_index
from neuron_compile.runtime.warm_key import Refusal, warm_key_parts
from neuron_compile.runtime.warm_start import load_warm_graph

log = logging.getLogger(__name__)

# torch.compile's documented modes: none changes what we compile today (there are no CUDA graphs or autotuning).
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
BACKEND_NAME = "neuron"
ALIAS_NAME = "neuron_compile"


def neuron_backend(
    gm: torch.fx.GraphModule, example_inputs: list, *, mode: str | None = None, options: dict | None = None
):
    """The Dynamo backend: ``torch.compile(model, backend="neuron", options={"fallback": "raise"})``."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"torch.compile mode {mode!r} is not one of {list(COMPILE_MODES)}")
    options = dict(options or {})
    effective = config.get().replace(options)  # reject unknown keys and bad values now, at compile time
    untraced_fsdp.install()  # again after a torch._dynamo.reset(), which clears Dynamo's callbacks
    logs.apply(effective.logs)
    event = compile_events.record_dynamo_graph(gm, keep_graph=bool(effective.dump_dir))
    log.debug("Dynamo graph %d: %d nodes, %d inputs", event.index, len(gm.graph.nodes), len(example_inputs))
    if effective.dump_dir:
        dump.write_dynamo_graph(effective.dump_dir, event)
        refresh_dump_index(effective.dump_dir)
    parts = warm_key_parts(gm, example_inputs, effective)
    if isinstance(parts, Refusal):
        log.debug("Dynamo graph %d takes no warm-start fast path: %s", event.index, parts)
        parts = None
    else:
        def compile_slowly(args: list):  # the call's own arguments: holding ``example_inputs`` would hold the model
            return _trace_and_compile(gm, args, effective, options, event.index)

        warm = load_warm_graph(parts, gm, effective, options, compile_slowly, event.index)
        if warm is not None:
            log.debug("Dynamo graph %d: a warm start from its record, aot_autograd skipped", event.index)
            return warm
    return _trace_and_compile(gm, example_inputs, effective, options, event.index, parts)


def _trace_and_compile(gm: torch.fx.GraphModule, example_inputs: list, effective: config.Config, options: dict,
                       dynamo_graph: int, warm_parts: dict | None = None):
    """aot_autograd and the compiler on ``gm`` (trace_compile.py); ``warm_parts``: the graph's warm-start key, whose
    record its first call writes when it can. Imported at the first graph that needs them: a warm start runs stored
    kernels only and never imports the compiler (lowering, fusion, tiling, codegen) or aot_autograd."""
    from neuron_compile.trace_compile import trace_and_compile

    return trace_and_compile(gm, example_inputs, effective, options, dynamo_graph, warm_parts)


def _owner_of(name: str) -> str | None:
    """The module that serves backend ``name`` if it is registered or declared by an entry point, else None."""
    from torch._dynamo.backends import registry

    registry._lazy_import()  # discovers entry points (ours and other packages')
    if name in registry._COMPILER_FNS:
        return getattr(registry._COMPILER_FNS[name], "__module__", "?")
    entry_point = registry._BACKENDS.get(name)
    return entry_point.value.split(":")[0] if entry_point is not None else None


def register() -> str:
    """Register our backend names with Dynamo (idempotent); returns the name that is certainly ours."""
    untraced_fsdp.install()  # a whole fully_shard-ed model compiles nothing: say so
    served_by = {}
    for name in (BACKEND_NAME, ALIAS_NAME):
        owner = _owner_of(name)
        if owner is None:  # no entry point (e.g. not pip-installed): register directly
            torch._dynamo.register_backend(neuron_backend, name=name)
            owner = __name__
        # A name declared by our own entry point is left to Dynamo to load on first use: registering it here
        # too would make that load fail with "duplicate name".
        served_by[name] = owner
    if served_by[BACKEND_NAME] != __name__:
        log.warning(
            "neuron_compile: backend %r is served by %s; use backend=%r for neuron_compile",
            BACKEND_NAME,
            served_by[BACKEND_NAME],
            ALIAS_NAME,
        )
        return ALIAS_NAME
    return BACKEND_NAME

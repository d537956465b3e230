"""Backend stage: the Dynamo backend ``neuron`` — wiring only.

Input: a torch-level FX graph from Dynamo and its (fake) example inputs, plus ``torch.compile``'s ``mode`` and
``options``. Output: a callable that runs the graph. aot_autograd turns the graph into ATen forward / backward
(min-cut partitioned, for training) or inference graphs with our decomposition table, keeping input mutations
in the graph; each ATen graph goes to ``compile_aten_graph`` (runtime/compiled_graph.py), which specializes,
partitions and compiles it per call signature. A graph with a warm-start key (runtime/warm_key.py) whose record is in
the on-disk cache skips aot_autograd: it runs from the record (runtime/warm_start.py); without a record, the first
call writes one when aot_autograd's facts and the compile allow it (runtime/warm_record.py).

Every Dynamo graph is noted in runtime/compile_events.py (why it ended: a graph break and its source line); with a
dump folder, its FX graph is written there (runtime/dump.py).

Registration: the ``torch_dynamo_backends`` entry points make ``backend="neuron"`` and ``"neuron_compile"``
work without importing this package; importing it also registers them, unless another package (AWS
``torch_neuronx``) already owns ``"neuron"`` — then only ``"neuron_compile"`` is ours, and the log says so.
"""

from __future__ import annotations

import functools
import logging
import warnings

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition

from neuron_compile import config, logs, untraced_fsdp
from neuron_compile.errors import NeuronCompileError, NeuronCompileWarning
from neuron_compile.passes.decompose import decomposition_table
from neuron_compile.passes.partition import op_name
from neuron_compile.runtime import compile_events, dump, stats
from neuron_compile.runtime.compiled_graph import compile_aten_graph, refresh_dump_index
from neuron_compile.runtime.warm_key import Refusal, warm_key_parts
from neuron_compile.runtime.warm_record import WarmCandidate
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
        candidate = None
    else:
        def compile_slowly(args: list):  # the call's own arguments: holding ``example_inputs`` would hold the model
            return _trace_and_compile(gm, args, effective, options, event.index)

        warm = load_warm_graph(parts, gm, effective, options, compile_slowly, event.index)
        if warm is not None:
            log.debug("Dynamo graph %d: a warm start from its record, aot_autograd skipped", event.index)
            return warm
        candidate = WarmCandidate(parts, len(example_inputs))
    return _trace_and_compile(gm, example_inputs, effective, options, event.index, candidate)


def _trace_and_compile(gm: torch.fx.GraphModule, example_inputs: list, effective: config.Config, options: dict,
                       dynamo_graph: int, candidate: WarmCandidate | None = None):
    """aot_autograd with our compilers on Dynamo graph ``gm``; ``candidate`` (a graph with a warm-start key) learns
    aot_autograd's facts and writes the graph's record after its first call (runtime/warm_record.py)."""
    compilers = {
        kind: functools.partial(compile_aten_graph, kind=kind, options=options, dynamo_graph=dynamo_graph)
        for kind in ("forward", "backward", "inference")
    }
    inference_compiler = candidate.wrap(compilers["inference"]) if candidate is not None else compilers["inference"]
    aot_backend = aot_autograd(
        fw_compiler=compilers["forward"],
        bw_compiler=compilers["backward"],
        inference_compiler=inference_compiler,
        partition_fn=min_cut_rematerialization_partition,
        decompositions=decomposition_table(),
        keep_inference_input_mutations=True,
    )
    try:
        return aot_backend(gm, example_inputs)
    except NeuronCompileError:  # a region failed under fallback=raise: already explained
        raise
    except torch._dynamo.exc.RestartAnalysis:
        # Dynamo's control flow, not a failure: aot_autograd's pass that turns float inputs into tensors asks
        # Dynamo to trace the frame again with those floats specialized; the retraced graph compiles normally.
        raise
    except Exception as error:  # noqa: BLE001 -- tracing to ATen failed (data-dependent ops): run the graph eagerly
        return _run_eagerly(gm, effective, error)


def _run_eagerly(gm: torch.fx.GraphModule, effective: config.Config, error: Exception):
    """aot_autograd could not trace ``gm`` (e.g. ``.item()`` feeding a shape): Config.fallback decides, and every
    call of the Dynamo graph runs eagerly; its nodes are counted once as fallbacks, with the reason."""
    first_line = (str(error).strip().splitlines() or [""])[0][:200]
    message = f"aot_autograd could not trace the graph: {type(error).__name__}: {first_line}"
    if effective.fallback == "raise":
        raise NeuronCompileError(f"{message} (NEURON_COMPILE_FALLBACK=raise)") from error
    if effective.fallback == "warn":
        warnings.warn(f"{message}; running it eagerly", NeuronCompileWarning, stacklevel=2)
    log.debug("%s", message)
    reason = f"its graph could not be traced to ATen ({type(error).__name__})"
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method", "call_module"):
            stats.add_fallback(op_name(node) if node.op == "call_function" else str(node.target), reason)
    return gm.forward


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

"""Backend stage, the compiling path: aot_autograd with our compilers on a Dynamo graph that no warm-start record
serves (backend.py decides).

Input: a torch-level FX graph from Dynamo, its example inputs, the effective Config and ``torch.compile``'s
options. Output: aot_autograd's callable, whose forward / backward / inference ATen graphs (min-cut partitioned for
training, our decomposition table, input mutations kept in the graph) each go to ``compile_aten_graph``
(runtime/compiled_graph.py); or, when aot_autograd cannot trace the graph, the graph itself, run eagerly as
``Config.fallback`` says. This module imports the whole compiler; backend.py imports it at the first graph that
needs it, so a warm start never does.
"""

from __future__ import annotations

import functools
import logging
import warnings

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition

from neuron_compile import config
from neuron_compile.errors import NeuronCompileError, NeuronCompileWarning
from neuron_compile.passes.decompose import decomposition_table
from neuron_compile.passes.partition import op_name
from neuron_compile.runtime import stats
from neuron_compile.runtime.compiled_graph import compile_aten_graph
from neuron_compile.runtime.warm_candidate import WarmCandidate

log = logging.getLogger(__name__)


def trace_and_compile(gm: torch.fx.GraphModule, example_inputs: list, effective: config.Config, options: dict,
                      dynamo_graph: int, warm_parts: dict | None = None):
    """aot_autograd with our compilers on Dynamo graph ``gm``. A graph with a warm-start key (``warm_parts``) learns
    aot_autograd's facts and writes its record after its first call (runtime/warm_candidate.py)."""
    candidate = WarmCandidate(warm_parts, len(example_inputs)) if warm_parts is not None else None
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
        return run_eagerly(gm, effective, error)


def run_eagerly(gm: torch.fx.GraphModule, effective: config.Config, error: Exception):
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

"""Runtime stage, the compiling path: whether a Dynamo graph's first call leaves a warm-start record, and writing it.

Input: a Dynamo graph's warm-start key (runtime/warm_key.py), aot_autograd's runtime facts for its inference graph
(``ViewAndMutationMeta``, read from the ``TracingContext`` while our inference compiler runs) and the graph's first
call. Output: a ``WarmRecord`` (runtime/warm_record.py) stored in the on-disk cache under the key, which a later
process reads to run the graph without aot_autograd (runtime/warm_start.py). Only the compiling path
(trace_compile.py) imports this module: a warm start needs none of aot_autograd.

A record is written only when skipping aot_autograd leaves nothing undone, which is when its inference runtime
wrapper does nothing but call our compiled graph with Dynamo's arguments under ``no_grad``:

* aot_autograd's facts (``aot_refusal``): no input's metadata or storage mutated, and a data mutation only where
  aot_autograd keeps it in its graph (``mutation_refusal``: a static cache's write), where its wrapper does nothing
  for it but bump the input's version counter when autograd may see the write (the record keeps which); every output
  a non-alias (none is an input or a view of one; no intermediate bases), no effect tokens, no subclass inputs or
  outputs, no graph-safe RNG state, and one ATen input per Dynamo input (nothing deduplicated, lifted or made a
  synthetic base);
* our compile of the first call (``entry_refusal``): one NKI region that reads every graph argument (and maybe small
  constants of aot_autograd's graph, kept by value) and whose outputs are the graph's outputs, none viewing an input
  or sharing a buffer with another (aot_autograd calls a view of an intermediate a non-alias in an inference graph;
  refused here too), loaded from or stored in the on-disk cache, and that ran without failing. The region writes the
  mutated inputs itself.
"""

from __future__ import annotations

import logging

import torch
import torch.fx
from torch._functorch._aot_autograd.schemas import MutationType, OutputType, PlainTensorMeta

from neuron_compile.config import Config
from neuron_compile.runtime import disk_cache, stats
from neuron_compile.runtime.cache import signature_of
from neuron_compile.runtime.direct_hit import DirectHit
from neuron_compile.runtime.warm_record import CONSTANT_DTYPES, MAX_CONSTANT_ELEMENTS, WarmRecord

log = logging.getLogger(__name__)


def aot_refusal(meta, aten_gm: torch.fx.GraphModule, dynamo_inputs: int) -> str | None:
    """Why aot_autograd's runtime wrapper would do more than call the graph for these facts (``meta``: its
    ``ViewAndMutationMeta``), if it would; None when it would not."""
    if meta is None:
        return "aot_autograd's runtime metadata is not available"
    refusal = mutation_refusal(meta)
    if refusal is not None:
        return refusal
    if any(info.output_type != OutputType.non_alias for info in meta.output_info) or meta.num_intermediate_bases:
        return "an output aliases an input or an intermediate"
    if meta.tokens or getattr(meta, "num_graphsafe_rng_states", 0):
        return "the graph has effect tokens or graph-safe RNG state"
    if not all(isinstance(item, PlainTensorMeta) for item in [*meta.subclass_inp_meta,
                                                              *meta.subclass_fw_graph_out_meta]):
        return "an input or output is a tensor subclass"
    placeholders = sum(1 for node in aten_gm.graph.nodes if node.op == "placeholder")
    if not (len(meta.input_info) == placeholders == dynamo_inputs):
        return f"aot_autograd's graph has {placeholders} inputs for Dynamo's {dynamo_inputs}"
    return None


def mutation_refusal(meta) -> str | None:
    """Why an input mutation needs more of aot_autograd's wrapper than a version bump, if one does. A data mutation
    aot_autograd keeps in its graph (``keep_inference_input_mutations``: a static cache's ``index_copy_``) leaves the
    wrapper no epilogue (it is not a runtime-mutated input); where autograd may see it, the wrapper bumps the input's
    version counter before the call (``version_bumps``, which the record keeps); our region writes the input itself,
    once its kernels ran, as on every call of the graph compiled the usual way."""
    for info in meta.input_info:
        if info.mutates_metadata or info.mutates_storage_metadata or info.mutation_inductor_storage_resize:
            return "an input's metadata or storage is mutated"
        if info.mutates_data and info.mutation_type != MutationType.MUTATED_IN_GRAPH:
            return "an input mutation is outside aot_autograd's graph"
    if meta.num_mutated_inp_runtime_indices:
        return "aot_autograd's wrapper applies an input mutation"
    return None


def version_bumps(meta) -> tuple[int, ...]:
    """The inputs whose version counter aot_autograd's wrapper bumps before each call: the mutations it keeps in its
    graph that autograd may see (not all under ``no_grad`` or inference mode)."""
    return tuple(meta.mutated_graph_handled_indices_seen_by_autograd)


def entry_refusal(direct: DirectHit | None, given: list) -> str | None:
    """Why the entry a first call compiled cannot be run from a record (``direct``: its direct hit, None when it is
    more than one region), if it cannot."""
    if direct is None:
        return "the graph is not one NKI region"
    region = direct.region
    if direct.module.compiled is not region or region is None:
        return "its region failed"
    if getattr(region, "disk_key", None) is None or not hasattr(region, "plan"):
        return "its region is not in the on-disk cache"
    positions = [source for source in direct.sources if isinstance(source, int)]
    if sorted(set(positions)) != list(range(len(given))):
        return "the region does not read every argument"
    constants = [source for source in direct.sources if not isinstance(source, int)]
    if not all(type(constant) is torch.Tensor and constant.is_contiguous() and constant.device.type == "cpu"
               and str(constant.dtype).removeprefix("torch.") in CONSTANT_DTYPES
               and constant.numel() <= MAX_CONSTANT_ELEMENTS for constant in constants):
        return "a constant of the region is not a small CPU tensor"
    slots = region.plan.outputs
    if not all(from_region for from_region, _ in direct.outputs) or sorted(
            index for _, index in direct.outputs) != list(range(len(slots))):
        return "the graph's outputs are not the region's outputs, one each"
    if any(slot.input_index >= 0 for slot in slots) or len({slot.buffer for slot in slots}) != len(slots):
        # aot_autograd calls an output that views an intermediate a non-alias in an inference graph; refused here
        # too, so that every output of a warm start owns its storage
        return "an output views an input or shares its buffer with another output"
    return None


class WarmCandidate:
    """A Dynamo graph with a warm-start key: wraps the inference compiler to learn aot_autograd's facts, and writes
    the record after the graph's first call if everything allows it (module docstring)."""

    def __init__(self, parts: dict, dynamo_inputs: int):
        self.parts, self.dynamo_inputs = parts, dynamo_inputs

    def wrap(self, inference_compiler):
        """``inference_compiler`` (compile_aten_graph for inference graphs), noting aot_autograd's facts."""

        def compile_inference(gm: torch.fx.GraphModule, example_inputs: list):
            compiled = inference_compiler(gm, example_inputs)
            context = torch._guards.TracingContext.try_get()
            meta = getattr(context, "fw_metadata", None)
            refusal = aot_refusal(meta, gm, self.dynamo_inputs)
            if refusal is not None:
                log.debug("no warm-start record: %s", refusal)
            elif hasattr(compiled, "after_first_call"):
                bumps = version_bumps(meta)
                compiled.after_first_call = lambda *call: self.write(compiled, bumps, *call)
            return compiled

        return compile_inference

    def write(self, graph, bumps: tuple[int, ...], config: Config, given: list, swapped: list, entry) -> None:
        """After ``graph``'s first call (``entry`` ran it): store the record, unless ``entry_refusal`` says no;
        ``bumps``: the inputs whose version aot_autograd's wrapper bumps."""
        direct = DirectHit.of(entry, given) if isinstance(entry, torch.fx.GraphModule) else None
        refusal = entry_refusal(direct, given)
        store = disk_cache.open_cache(config)
        if refusal is not None or store is None:
            log.debug("no warm-start record: %s", refusal or "the on-disk cache is off")
            return
        try:
            self.store_record(store, graph, bumps, config, given, swapped, direct)
        except Exception as error:  # noqa: BLE001 -- a record only saves a later process work: never fail this call
            log.warning("neuron_compile: no warm-start record written: %s: %s", type(error).__name__, error)

    def store_record(self, store, graph, bumps: tuple[int, ...], config: Config, given: list, swapped: list,
                     direct: DirectHit) -> None:
        """Write the record of ``direct``'s region under this graph's key."""
        module = direct.module
        record = WarmRecord(
            region_key=direct.region.disk_key, region_name=module.region_name, inputs=len(given),
            sources=direct.sources, outputs=tuple(index for _, index in direct.outputs),
            column_major=tuple(graph.column_major) if config.transposed_weights else (),
            float_guarded=tuple(sorted(graph.float_guarded)),
            signature=repr(signature_of(swapped, graph.float_guarded)), version_bumps=bumps,
            placements=module.record.report.regions[module.region_name],
        )
        store.store(disk_cache.key_of(self.parts), self.parts, record.to_data())
        stats.add(warm_records_written=1)

"""Runtime stage: the warm-start record of a Dynamo graph, and when one is written.

Input: a Dynamo graph's warm-start key (runtime/warm_key.py), aot_autograd's runtime facts for its inference graph
(``ViewAndMutationMeta``, read from the ``TracingContext`` while our inference compiler runs) and the graph's first
call. Output: ``WarmRecord``, plain data stored in the on-disk cache under the key (JSON through
runtime/disk_cache.py, never pickle), which a later process reads to run the graph without aot_autograd
(runtime/warm_start.py).

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

The record holds which argument or constant each region input is and which region output each graph output is, the
region's entry key (the kernels stay in the region's own entry, loaded as any disk hit is: the launcher checks every
kernel text, codegen/kernel_check.py), the column-major weight inputs, the value-guarded float inputs, the dispatch
signature of the first call (as text), the inputs whose version aot_autograd bumps, and the region's ATen node
placements (for stats and messages). ``from_data`` refuses anything that is not what ``to_data`` writes (a
``ValueError``: a miss).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re

import torch
import torch.fx
from torch._functorch._aot_autograd.schemas import MutationType, OutputType, PlainTensorMeta

from neuron_compile.config import Config
from neuron_compile.passes.partition import REGION_PREFIX, NodePlacement
from neuron_compile.runtime import disk_cache, stats
from neuron_compile.runtime.cache import signature_of
from neuron_compile.runtime.direct_hit import DirectHit

log = logging.getLogger(__name__)

KEY_PATTERN = re.compile(r"[0-9a-f]{40}")
REGION_NAME_PATTERN = re.compile(re.escape(REGION_PREFIX) + r"[0-9]+")
# aot_autograd's graph constants a record may hold (an empty cache's ``tensor([])``): small, by value
CONSTANT_DTYPES = ("float32", "bfloat16", "float16", "int64", "int32", "bool")
MAX_CONSTANT_ELEMENTS = 1024


@dataclasses.dataclass(frozen=True)
class WarmRecord:
    """What a warm start needs besides the region's entry (module docstring)."""

    region_key: str  # the region's on-disk cache entry
    region_name: str  # its submodule's name (``nki_region_<i>``)
    inputs: int  # the graph's arguments: each one an input of the region
    # per region input: the graph argument it is (a position), or a constant of aot_autograd's graph (a small tensor)
    sources: tuple[int | torch.Tensor, ...]
    outputs: tuple[int, ...]  # per graph output, the region output it is
    column_major: tuple[int, ...]  # the arguments read through column-major weight copies
    float_guarded: tuple[int, ...]  # the float arguments whose value bound is part of the dispatch key
    signature: str  # the first call's dispatch signature (``runtime/cache.signature_of``), as text
    version_bumps: tuple[int, ...]  # the arguments whose version aot_autograd's wrapper bumps (``version_bumps``)
    placements: tuple[NodePlacement, ...]  # the region's ATen nodes

    def to_data(self) -> dict:
        return {
            "region_key": self.region_key, "region_name": self.region_name, "inputs": self.inputs,
            "sources": [source if isinstance(source, int) else constant_data(source) for source in self.sources],
            "outputs": list(self.outputs),
            "column_major": list(self.column_major), "float_guarded": list(self.float_guarded),
            "signature": self.signature, "version_bumps": list(self.version_bumps),
            "placements": [[placement.node, placement.op, placement.flops] for placement in self.placements],
        }

    @classmethod
    def from_data(cls, data: dict) -> WarmRecord:
        try:
            inputs = _count(data["inputs"])
            region_name = _matching(data["region_name"], REGION_NAME_PATTERN)
            record = cls(
                region_key=_matching(data["region_key"], KEY_PATTERN),
                region_name=region_name,
                inputs=inputs,
                sources=_sources(data["sources"], inputs),
                outputs=_outputs(data["outputs"]),
                column_major=_positions(data["column_major"], inputs),
                float_guarded=_positions(data["float_guarded"], inputs),
                signature=_text(data["signature"]),
                version_bumps=_positions(data["version_bumps"], inputs),
                placements=tuple(_placement(item, region_name) for item in data["placements"]),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"not a warm-start record: {type(error).__name__}: {error}") from error
        if len(data) != len(record.to_data()):
            raise ValueError("not a warm-start record: unknown fields")
        return record


def _text(value) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__}")
    return value


def _matching(value, pattern: re.Pattern) -> str:
    if pattern.fullmatch(_text(value)) is None:
        raise ValueError(f"{value!r} is not of the form {pattern.pattern}")
    return value


def _count(value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TypeError(f"expected a count, got {value!r}")
    return value


def constant_data(tensor: torch.Tensor) -> dict:
    return {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape),
            "values": tensor.reshape(-1).tolist()}


def _constant(data: dict) -> torch.Tensor:
    dtype_name, shape, values = _text(data["dtype"]), [_count(size) for size in data["shape"]], data["values"]
    if dtype_name not in CONSTANT_DTYPES or not isinstance(values, list) or len(values) != math.prod(shape):
        raise ValueError(f"not a constant: {dtype_name} {shape} with {len(values)} values")
    if len(values) > MAX_CONSTANT_ELEMENTS or not all(type(value) in (int, float, bool) for value in values):
        raise ValueError("a constant's values are not numbers, or too many")
    return torch.tensor(values, dtype=getattr(torch, dtype_name)).reshape(shape)


def _sources(items, inputs: int) -> tuple[int | torch.Tensor, ...]:
    sources = tuple(item if isinstance(item, int) and not isinstance(item, bool) else _constant(item)
                    for item in items)
    positions = [source for source in sources if isinstance(source, int)]
    if sorted(set(positions)) != list(range(inputs)):
        raise ValueError(f"the region's inputs {positions} are not every graph argument")
    return sources


def _outputs(items) -> tuple[int, ...]:
    outputs = tuple(_count(item) for item in items)
    if sorted(outputs) != list(range(len(outputs))):
        raise ValueError(f"the graph's outputs {list(outputs)} are not the region's, one each")
    return outputs


def _placement(item, region: str) -> NodePlacement:
    node, op, flops = item
    return NodePlacement(_text(node), _text(op), region, None, _count(flops))


def _positions(values, length: int) -> tuple[int, ...]:
    positions = tuple(_count(value) for value in values)
    if any(position >= length for position in positions) or len(set(positions)) != len(positions):
        raise ValueError(f"positions {list(positions)} are not distinct arguments of {length}")
    return positions


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

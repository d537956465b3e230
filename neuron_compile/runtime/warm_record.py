"""Runtime stage: the warm-start record of a Dynamo graph, and when one is written.

Input: a Dynamo graph's warm-start key (runtime/warm_key.py), aot_autograd's runtime facts for its inference graph
(``ViewAndMutationMeta``, read from the ``TracingContext`` while our inference compiler runs) and the graph's first
call. Output: ``WarmRecord``, plain data stored in the on-disk cache under the key (JSON through
runtime/disk_cache.py, never pickle), which a later process reads to run the graph without aot_autograd
(runtime/warm_start.py).

A record is written only when skipping aot_autograd leaves nothing undone, which is when its inference runtime
wrapper does nothing but call our compiled graph with Dynamo's arguments under ``no_grad``:

* aot_autograd's facts (``aot_refusal``): no input mutated (data, metadata or storage), every output a non-alias
  (none is an input, a view of one or a view of an intermediate; no intermediate bases), no effect tokens, no
  subclass inputs or outputs, no graph-safe RNG state, and one ATen input per Dynamo input (nothing deduplicated,
  lifted or made a synthetic base);
* our compile of the first call (``entry_refusal``): one NKI region whose inputs are the graph's arguments in
  order and whose outputs are the graph's outputs in order, loaded from or stored in the on-disk cache, and that
  ran without failing.

The record holds the region's entry key (the kernels stay in the region's own entry, loaded as any disk hit is: the
launcher checks every kernel text, codegen/kernel_check.py), the column-major weight inputs, the value-guarded float
inputs, the dispatch signature of the first call (as text), and the region's ATen node placements (for stats and
messages). ``from_data`` refuses anything that is not what ``to_data`` writes (a ``ValueError``: a miss).
"""

from __future__ import annotations

import dataclasses
import logging
import re

import torch
import torch.fx

from neuron_compile.config import Config
from neuron_compile.passes.partition import REGION_PREFIX, NodePlacement
from neuron_compile.runtime import disk_cache, stats
from neuron_compile.runtime.cache import signature_of
from neuron_compile.runtime.direct_hit import DirectHit

log = logging.getLogger("neuron_compile.runtime.disk_cache")  # the cache topic (logs.py)

KEY_PATTERN = re.compile(r"[0-9a-f]{40}")
REGION_NAME_PATTERN = re.compile(re.escape(REGION_PREFIX) + r"[0-9]+")


@dataclasses.dataclass(frozen=True)
class WarmRecord:
    """What a warm start needs besides the region's entry (module docstring)."""

    region_key: str  # the region's on-disk cache entry
    region_name: str  # its submodule's name (``nki_region_<i>``)
    inputs: int  # the graph's arguments, which are the region's inputs in order
    column_major: tuple[int, ...]  # the arguments read through column-major weight copies
    float_guarded: tuple[int, ...]  # the float arguments whose value bound is part of the dispatch key
    signature: str  # the first call's dispatch signature (``runtime/cache.signature_of``), as text
    placements: tuple[NodePlacement, ...]  # the region's ATen nodes

    def to_data(self) -> dict:
        return {
            "region_key": self.region_key, "region_name": self.region_name, "inputs": self.inputs,
            "column_major": list(self.column_major), "float_guarded": list(self.float_guarded),
            "signature": self.signature,
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
                column_major=_positions(data["column_major"], inputs),
                float_guarded=_positions(data["float_guarded"], inputs),
                signature=_text(data["signature"]),
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
    from torch._functorch._aot_autograd.schemas import OutputType, PlainTensorMeta  # torch's, read on a compile

    if meta is None:
        return "aot_autograd's runtime metadata is not available"
    if any(info.mutates_data or info.mutates_metadata or info.mutates_storage_metadata for info in meta.input_info):
        return "an input is mutated"
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
    if direct.sources != tuple(range(len(given))):
        return "the region does not read every argument, in order"
    if direct.outputs != tuple((True, index) for index in range(len(direct.outputs))):
        return "the graph's outputs are not the region's, in order"
    slots = region.plan.outputs
    if len(direct.outputs) != len(slots):
        return "the region has outputs the graph does not return"
    if any(slot.input_index >= 0 for slot in slots) or len({slot.buffer for slot in slots}) != len(slots):
        # aot_autograd calls an output that views an intermediate a non-alias in an inference graph; refused here
        # too, so that every output of a warm start owns its storage
        return "an output views an input or shares its buffer with another output"
    if region.mutations:
        return "the region writes an input"
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
            refusal = aot_refusal(getattr(context, "fw_metadata", None), gm, self.dynamo_inputs)
            if refusal is not None:
                log.debug("no warm-start record: %s", refusal)
            elif hasattr(compiled, "after_first_call"):
                compiled.after_first_call = lambda *call: self.write(compiled, *call)
            return compiled

        return compile_inference

    def write(self, graph, config: Config, given: list, swapped: list, entry) -> None:
        """After ``graph``'s first call (``entry`` ran it): store the record, unless ``entry_refusal`` says no."""
        direct = DirectHit.of(entry, given) if isinstance(entry, torch.fx.GraphModule) else None
        refusal = entry_refusal(direct, given)
        store = disk_cache.open_cache(config)
        if refusal is not None or store is None:
            log.debug("no warm-start record: %s", refusal or "the on-disk cache is off")
            return
        module = direct.module
        record = WarmRecord(
            region_key=direct.region.disk_key, region_name=module.region_name, inputs=len(given),
            column_major=tuple(graph.column_major) if config.transposed_weights else (),
            float_guarded=tuple(sorted(graph.float_guarded)),
            signature=repr(signature_of(swapped, graph.float_guarded)),
            placements=module.record.report.regions[module.region_name],
        )
        store.store(disk_cache.key_of(self.parts), self.parts, record.to_data())
        stats.add(warm_records_written=1)

"""Runtime stage: a warm start without aot_autograd's trace, for a Dynamo graph that compiled to one NKI region.

Input: a Dynamo graph, its warm-start key (runtime/warm_key.py), the effective config, and a function that compiles
the graph the usual way (aot_autograd, then our compiler: the backend's). Output: ``load_warm_graph``: a
``WarmGraph``, the callable the backend hands Dynamo instead of aot_autograd's, or None when there is no usable record
(a miss: the backend runs aot_autograd as always, and a record is written after the first call if it may be:
runtime/warm_record.py).

What a warm graph does on a call is what aot_autograd's inference wrapper and our ``CompiledGraph`` do for such a
graph: the inputs whose version aot_autograd bumps are bumped, grad is off around the call (the outputs require no
grad), the weights the region reads column-major are swapped for their copies (runtime/weight_layouts.py), and the
call's dispatch key (runtime/cache.py) must be the record's. On the first call the key's text must equal the record's,
the metadata (dtype, shape, strides, offset) of every region input (an argument or a constant) must equal the region
entry's recorded inputs, a float input with a value bound in the region entry must be guarded by the record, and the
region checks every input against its buffers; later calls must have that first call's key (the hit plan,
runtime/hit_plan.py, checks it without building it). The region runs through the same ``RegionModule`` (its fallback,
on a failure, is Dynamo's graph run eagerly, which computes what the region does) and ``DirectHit`` as a compiled
graph's.

A record whose outputs' shapes or dtypes are not those of Dynamo's graph is not used. Any call outside the record
(another key, another config) compiles the graph the usual way, once, under Dynamo's compile lock, and every later
call goes there: the answer is the one aot_autograd gives, never one from a record that does not fit.
"""

from __future__ import annotations

import logging
import operator
import threading
from collections.abc import Callable

import torch
import torch.fx
from torch.autograd.graph import increment_version

from neuron_compile import config as config_module
from neuron_compile.config import Config
from neuron_compile.passes.input_ranges import guard_bound
from neuron_compile.passes.partition import PartitionReport
from neuron_compile.runtime import disk_cache, stats, weight_layouts
from neuron_compile.runtime.cache import GraphKey, dispatch_signature, signature_of
from neuron_compile.runtime.graph_records import CompiledGraphRecord, keep_record, kernel_records
from neuron_compile.runtime.hit_plan import HitPlan, planned_outputs
from neuron_compile.runtime.launch_plan import INT32_RANGE
from neuron_compile.runtime.region_load import load_stored_region
from neuron_compile.runtime.region_module import RegionModule, read_attributes_directly
from neuron_compile.runtime.warm_record import WarmRecord

log = logging.getLogger(__name__)

NOT_TRACED = "(not traced: a warm start ran this graph from its warm-start record, without aot_autograd)"


class DynamoGraphAsRegion:
    """The region's eager fallback: Dynamo's graph run eagerly on the graph arguments among the region's inputs
    (weights maybe as their column-major copies: the same values), its outputs put in the region's order."""

    def __init__(self, gm: torch.fx.GraphModule, record: WarmRecord):
        self.gm, self.record = gm, record

    def __call__(self, *tensors):
        arguments = [None] * self.record.inputs
        for tensor, source in zip(tensors, self.record.sources, strict=True):
            if isinstance(source, int):
                arguments[source] = tensor
        results = [None] * len(self.record.outputs)
        for output, index in zip(self.gm(*arguments), self.record.outputs, strict=True):
            results[index] = output
        return tuple(results)


def region_graph(record: WarmRecord, module: RegionModule) -> torch.fx.GraphModule:
    """The partitioned graph of a one-region graph: the arguments and constants to the region, its outputs returned
    in the graph's order."""
    graph, root = torch.fx.Graph(), torch.nn.Module()
    arguments = [graph.placeholder(f"arg{position}_1") for position in range(record.inputs)]
    region_inputs = []
    for index, source in enumerate(record.sources):
        if isinstance(source, int):
            region_inputs.append(arguments[source])
        else:
            root.register_buffer(f"_tensor_constant{index}", source)
            region_inputs.append(graph.get_attr(f"_tensor_constant{index}"))
    region = graph.call_module(record.region_name, tuple(region_inputs))
    graph.output(tuple(graph.call_function(operator.getitem, (region, index)) for index in record.outputs))
    setattr(root, record.region_name, module)
    top = torch.fx.GraphModule(root, graph)
    read_attributes_directly(top)
    return top


def expected_outputs(region) -> list[torch.Tensor]:
    """The region's outputs as meta tensors (eager's shapes, strides and dtypes): what ``RegionModule`` checks."""
    return [torch.empty_strided(value.layout.shape, value.layout.strides, dtype=dtype, device="meta")
            for value, dtype in zip(region.outputs, region.output_dtypes, strict=True)]


def load_region(store, record: WarmRecord, config: Config):
    """The record's region from its entry (the load pass, kernel texts checked) and the entry's key parts; a
    ``ValueError`` when the entry does not fit the record."""

    def accept(parts: dict, payload: dict):
        region = load_stored_region(payload, config)
        count = len(record.sources)
        if parts.get("what") != disk_cache.REGION_WHAT or len(parts.get("inputs", ())) != count:
            raise ValueError("the warm-start record's region entry is not a region of its inputs")
        if len(region.inputs) != count or len(region.outputs) != len(record.outputs):
            raise ValueError(f"the region has {len(region.inputs)} inputs and {len(region.outputs)} outputs, the "
                             f"record {count} and {len(record.outputs)}")
        ranges = parts.get("input ranges", ["None"] * count)
        unguarded = [source for source, buffer, bound in zip(record.sources, region.inputs, ranges, strict=True)
                     if bound != "None" and buffer.dtype in ("float32", "bfloat16")
                     and not (isinstance(source, int) and source in record.float_guarded)]
        if unguarded:
            raise ValueError(f"float inputs {unguarded} have a value bound the record does not guard")
        return parts, region

    return store.lookup(record.region_key, accept=accept, with_parts=True)


class WarmGraph:
    """Dynamo's compiled function for a graph run from its warm-start record (module docstring)."""

    def __init__(self, record: WarmRecord, region, region_parts: dict, config: Config, options: dict,
                 gm: torch.fx.GraphModule, compile_slowly: Callable[[list], Callable], dynamo_graph: int):
        self.record, self.config, self.compile_slowly = record, config, compile_slowly
        self.option_items = tuple(options.items())
        self.column_major = record.column_major
        self.float_guarded = frozenset(record.float_guarded)
        self.region_inputs = list(region_parts["inputs"])
        self.region = region
        key = GraphKey(disk_cache.key_of(region_parts)[:16], (), config)
        self.graph_record = CompiledGraphRecord(
            kind="inference", key=key, aten_graph=NOT_TRACED, partitioned_graph="",
            report=PartitionReport(record.placements), dynamo_graph=dynamo_graph)
        self.graph_record.kernels += kernel_records(record.region_name, region)
        self.graph_record.region_kernels += kernel_records(record.region_name, region, launched=True)
        module = RegionModule(record.region_name, region, DynamoGraphAsRegion(gm, record), expected_outputs(region),
                              self.graph_record)
        self.entry = region_graph(record, module)
        self.graph_record.partitioned_graph = str(self.entry.graph)
        self.key: tuple | None = None  # the first call's dispatch signature, once it matched the record
        self.hit_plan: HitPlan | None = None
        self.slow: Callable | None = None  # the usual compile, once a call left the record
        self.slow_lock = threading.Lock()

    def __call__(self, *args):
        if self.slow is None:
            grad = torch.is_grad_enabled()
            if grad:  # as aot_autograd's inference wrapper: the graph runs without autograd
                torch._C._set_grad_enabled(False)
            try:
                outputs = self.run(list(args))
            finally:
                if grad:
                    torch._C._set_grad_enabled(True)
            if outputs is not None:
                return outputs
        return self.compiled_slowly(args)(*args)

    def run(self, args: list) -> tuple | None:
        """The graph's outputs, or None when the call is outside the record."""
        config = config_module.get(self.option_items)
        if config is not self.config and config != self.config:
            return None
        outputs = planned_outputs(self.hit_plan, config, args, self.bump_versions)
        if outputs is not None:
            return outputs
        swapped = weight_layouts.COPIES.apply(args, self.column_major) if self.column_major else args
        key = dispatch_signature(swapped, self.float_guarded)
        if self.key is None:
            if not self.first_call_fits(swapped):
                return None
            self.key = key
            stats.add(cache_misses=1)
        elif key != self.key:
            return None
        else:
            stats.count_hit()
        if self.hit_plan is None:  # made once, as CompiledGraph keeps one per key (this graph has one key)
            self.hit_plan = HitPlan.of(config, args, swapped, self.entry, self.float_guarded)
        self.bump_versions(args)
        return self.entry.forward(*swapped)

    def bump_versions(self, args: list) -> None:
        """As aot_autograd's wrapper does before each call: bump the version of the inputs the graph writes where
        autograd may see it (runtime/warm_record.version_bumps)."""
        if self.record.version_bumps:
            increment_version(tuple(args[position] for position in self.record.version_bumps))

    def first_call_fits(self, swapped: list) -> bool:
        """Whether the first call is the one the record and the region entry were made for (module docstring); the
        region then trusts what the dispatch key fixes on later calls."""
        if len(swapped) != self.record.inputs or not all(isinstance(arg, torch.Tensor) for arg in swapped):
            return False
        if repr(signature_of(swapped, self.float_guarded)) != self.record.signature:
            log.info("neuron_compile: a call outside its warm-start record: compiling the graph the usual way")
            return False
        tensors = [swapped[source] if isinstance(source, int) else source for source in self.record.sources]
        if [disk_cache.meta_text(tensor) for tensor in tensors] != self.region_inputs:
            return False
        self.region.trust_inputs(range(len(tensors)))  # graph arguments (the key holds them) and constants
        self.region.trust_values([index for index, (tensor, source) in enumerate(zip(tensors, self.record.sources))
                                  if isinstance(source, int) and (bound := guard_bound(tensor)) is not None
                                  and bound.within(INT32_RANGE[1])])
        return True

    def compiled_slowly(self, args: tuple) -> Callable:
        """The graph compiled the usual way (aot_autograd), once, under Dynamo's compile lock, with the arguments of
        the call that needs it as the example inputs: Dynamo's guards held for them, and keeping Dynamo's own example
        inputs for this would keep the first model's weights alive as long as the graph."""
        from torch._dynamo.convert_frame import compile_lock  # torch's own lock, loaded when a compile needs it

        with self.slow_lock:
            if self.slow is None:
                with compile_lock:
                    self.slow = self.compile_slowly(list(args))
        return self.slow


def outputs_fit(gm: torch.fx.GraphModule, record: WarmRecord, region) -> bool:
    """Whether each of Dynamo's graph outputs (its traced example value) has the shape and dtype of the region output
    the record says it is."""
    output_node = next(node for node in reversed(gm.graph.nodes) if node.op == "output")
    returned = output_node.args[0] if isinstance(output_node.args[0], tuple | list) else (output_node.args[0],)
    values = [node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None for node in returned]
    return len(values) == len(record.outputs) and all(
        isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(region.outputs[index].layout.shape)
        and value.dtype == region.output_dtypes[index] for value, index in zip(values, record.outputs, strict=True))


def load_warm_graph(parts: dict, gm: torch.fx.GraphModule, config: Config, options: dict,
                    compile_slowly: Callable[[list], Callable], dynamo_graph: int) -> WarmGraph | None:
    """The warm graph of the record stored under ``parts``' key, or None (no record, or one that does not fit)."""
    store = disk_cache.open_cache(config)
    if store is None:
        return None
    record = store.lookup(disk_cache.key_of(parts), accept=WarmRecord.from_data)
    if record is None:
        return None
    loaded = load_region(store, record, config)
    if loaded is None:
        return None
    region_parts, region = loaded
    if not outputs_fit(gm, record, region):
        log.warning("neuron_compile: a warm-start record's outputs do not fit its graph; compiling it the usual way")
        return None
    warm = WarmGraph(record, region, region_parts, config, options, gm, compile_slowly, dynamo_graph)
    keep_record(warm.graph_record)
    stats.add(graphs_compiled=1, aot_autograd_skipped=1, regions_compiled=1, disk_cache_hits=1,
              nki_nodes=int(getattr(region, "nki_nodes", 0)))
    return warm

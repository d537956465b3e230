"""Runtime stage: the boxed callable the backend returns for one ATen graph, and its per-signature compile.

Input: an ATen GraphModule from aot_autograd (forward, backward or inference; static or with SymInts) and the
compile options. Output: ``CompiledGraph``, a boxed callable (``fn(args: list) -> outputs``) that, per call,
looks up the call's ``GraphKey`` (graph hash, argument shapes / strides / dtypes, config) and on a miss
specializes the graph to the call's shapes, partitions it into NKI regions and eager nodes, compiles each
region with ``pipeline.compile_region`` (the passes are ``pipeline.PASSES``) and keeps the result; later calls
with the same signature reuse it, and a call with the key of the previous one does not even build it (the hit
plan, runtime/hit_plan.py, checks the same parts without it). A region that cannot be compiled (or fails when it
runs) follows ``Config.fallback``: ``warn`` runs it eagerly with a ``NeuronCompileWarning``, ``silent`` runs it
eagerly, ``raise`` raises ``NeuronCompileError``.

Every compile leaves a ``CompiledGraphRecord`` (ATen graph, partition report, kernel sources) that
``neuron_compile.last_compiled()`` returns. With a dump folder (``NEURON_COMPILE_DUMP``), the record is written
there (runtime/dump.py) with the IR after every pass, each region's first launch adds its kernels' cost reports,
and the folder's index is refreshed. With ``TORCH_TRACE`` set, the same texts go to torch's structured trace
(runtime/trace_artifacts.py) for tlparse.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.fx

from neuron_compile import config as config_module
from neuron_compile.config import Config
from neuron_compile.errors import NeuronCompileError
from neuron_compile.hardware import configured_target
from neuron_compile.passes.bucket import BucketPlan, plan_buckets
from neuron_compile.passes.flex_attention import inline_flex_attention
from neuron_compile.passes.input_ranges import proved_output_bounds, range_guarded_floats
from neuron_compile.passes.layouts import column_major_inputs
from neuron_compile.passes.partition import PartitionReport, op_name
from neuron_compile.passes.specialize import is_dynamic
from neuron_compile.passes.value_range import RANGE_KEY, Interval
from neuron_compile.pipeline import PassContext, compile_region, run_passes
from neuron_compile.runtime import compile_events, stats, trace_artifacts, weight_layouts
from neuron_compile.runtime.cache import (
    DispatchCache,
    GraphKey,
    TensorSignature,
    dispatch_signature,
    graph_hash,
    signature_of,
)
from neuron_compile.runtime.hit_plan import HitPlan, planned_outputs
from neuron_compile.runtime.kept import Kept
from neuron_compile.runtime.launch_plan import INT32_RANGE
from neuron_compile.runtime.graph_records import CompiledGraphRecord, dump_record, keep_record, kernel_records
from neuron_compile.runtime.proved_bounds import tag_outputs
from neuron_compile.runtime.region_module import (RegionModule, apply_fallback, count_region_fallback, describe_region,
                                                   read_attributes_directly)

log = logging.getLogger(__name__)
bucket_log = logging.getLogger("neuron_compile.passes.bucket")  # the bucket topic (logs.py)

NO_PLAN = object()  # a dispatch key whose plan is not made yet (None: no plan can hold)


def dispatch_keyed_inputs(top: torch.fx.GraphModule, region_node: torch.fx.Node) -> list[int]:
    """The positions of a region's inputs whose shape, strides, storage offset and dtype are the same on every call
    of a graph compiled for one key: graph inputs (the dispatch key holds them: ``dispatch_signature``) and the
    graph's own constants (``get_attr``: one tensor object, ours, on every call). An input an eager node made is
    not fixed (an eager op's output shape may depend on values), and none is when an eager op of the graph may
    change a tensor's metadata in place (``resize_``; ``copy_`` writes data only)."""
    if _writes_in_place(top, except_copies=True):
        return []
    return [index for index, arg in enumerate(region_node.args)
            if isinstance(arg, torch.fx.Node) and arg.op in ("placeholder", "get_attr")]


def int32_bounded_inputs(top: torch.fx.GraphModule, region_node: torch.fx.Node) -> list[int]:
    """The positions of a region's inputs that are graph inputs whose values the graph's dispatch key bounds within
    int32 (``passes/input_ranges.guard_bound``, kept on the placeholder as its value range). None when any op of the
    graph writes in place (an eager ``copy_`` into the input could change its values after the key was taken)."""
    if _writes_in_place(top, except_copies=False):
        return []
    return [index for index, arg in enumerate(region_node.args)
            if isinstance(arg, torch.fx.Node) and arg.op == "placeholder"
            and isinstance(bound := arg.meta.get(RANGE_KEY), Interval) and bound.within(INT32_RANGE[1])]


def _writes_in_place(top: torch.fx.GraphModule, except_copies: bool) -> bool:
    """Whether an op of ``top`` mutates a tensor (``copy_``, which writes data only, left out if ``except_copies``)."""
    return any(node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
               and node.target._schema.is_mutable
               and not (except_copies and node.target is torch.ops.aten.copy_.default) for node in top.graph.nodes)


def _meta_value(arg):
    return arg.meta.get("val") if isinstance(arg, torch.fx.Node) else arg


def _count_eager_nodes(report: PartitionReport) -> None:
    for placement in report.eager:
        count_region_fallback([placement.op], placement.reason or "unknown")


def _compile_partitioned(gm: torch.fx.GraphModule, args: list, key: GraphKey, kind: str,
                         dynamo_graph: int = -1, bucketing: str = "") -> torch.fx.GraphModule:
    """Specialize, partition and compile every region of ``gm`` for one signature; leave a record."""
    config = key.config
    keep_passes = bool(config.dump_dir) or trace_artifacts.enabled()  # every pass's output, for dumps and traces
    dumps: list[tuple[str, str, str]] = []

    def on_graph_pass(name: str, text: str) -> None:
        dumps.append((name, "", text))

    # Each pass's output as text only for dumps and traces; the record keeps the specialized graph's in any case.
    on_pass = on_graph_pass if keep_passes else None
    context = PassContext(config, configured_target(config), args, trace_flex_attention=False)  # call time
    specialized = run_passes("graph", gm, context, on_pass, through="specialize")
    aten_graph = dumps[0][2] if keep_passes else str(specialized.graph)
    bounded = run_passes("graph", specialized, context, on_pass, after="specialize", through="bound inputs")
    # a forward's outputs carry what it proved of their values to the backward that reads them (proved_bounds.py)
    output_bounds = proved_output_bounds(bounded) if kind == "forward" else ()
    partitioned = run_passes("graph", bounded, context, on_pass, after="bound inputs")
    top = partitioned.graph_module
    top.proved_output_bounds = output_bounds
    record = CompiledGraphRecord(
        kind=kind,
        key=key,
        aten_graph=aten_graph,
        partitioned_graph=str(top.graph),
        report=partitioned.report,
        pass_dumps=dumps,
        dynamo_graph=dynamo_graph,
        bucketing=bucketing,
    )
    _count_eager_nodes(partitioned.report)
    for node in list(top.graph.nodes):
        if node.op != "call_module":
            continue
        name = node.target
        submodule = getattr(top, name)
        example_inputs = [_meta_value(arg) for arg in node.args]
        expected = [_meta_value(output) for output in submodule.graph.output_node().args[0]]
        try:
            if keep_passes:
                region = compile_region(submodule, example_inputs, config,
                                        on_pass=lambda step, text, region=name: dumps.append((step, region, text)))
            else:
                region = compile_region(submodule, example_inputs, config)
        except Exception as error:  # noqa: BLE001 -- compile_region may raise anything; Config.fallback decides
            message = (
                f"{describe_region(name, partitioned.report.region_ops(name))} of the {kind} graph could not be "
                f"compiled: {type(error).__name__}: {error}"
            )
            stats.add(region_compile_failures=1)
            apply_fallback(config, message, error)
            record.failures.append(message)
            node_ops = [placement.op for placement in partitioned.report.regions[name]]
            count_region_fallback(node_ops, f"its region failed to compile ({type(error).__name__})")
            region = None
        else:
            stats.add(regions_compiled=1, nki_nodes=int(getattr(region, "nki_nodes", 0)))
            if hasattr(region, "trust_inputs"):  # optional in the CompiledRegion interface
                region.trust_inputs(dispatch_keyed_inputs(top, node))
                region.trust_values(int32_bounded_inputs(top, node))
            record.kernels += kernel_records(name, region)
            record.region_kernels += kernel_records(name, region, launched=True)
            decisions = getattr(region, "fusion_decisions", None)  # optional in the CompiledRegion interface
            if decisions:
                record.fusion_decisions[name] = [str(decision) for decision in decisions]
        setattr(top, name, RegionModule(name, region, submodule, expected, record))
    # No recompile: the partition pass compiled ``top``'s code, which reads each region by its unchanged name.
    read_attributes_directly(top)
    keep_record(record)
    if config.dump_dir:
        log.info("neuron_compile: dumped the %s graph to %s", kind, dump_record(record, config.dump_dir))
    trace_artifacts.emit_record(record, compile_events.compile_id_of(dynamo_graph))
    return top


def _compile_orapply_fallback(gm: torch.fx.GraphModule, args: list, key: GraphKey, kind: str,
                          dynamo_graph: int = -1, bucketing: str = "") -> torch.fx.GraphModule:
    """``_compile_partitioned``, or, if specialization or partitioning itself fails, the whole ATen graph eagerly.

    Held under Dynamo's compile lock: this runs at call time, and torch.fx's node creation (the partitioner's
    fuser) reads FX's process-wide ``current_meta``, which another thread's aot_autograd trace sets."""
    from torch._dynamo.convert_frame import compile_lock  # torch's own lock, loaded when a compile needs it

    try:
        with compile_lock:
            return _compile_partitioned(gm, args, key, kind, dynamo_graph, bucketing)
    except NeuronCompileError:  # a region failed under fallback=raise: already explained
        raise
    except Exception as error:  # noqa: BLE001 -- a front-end bug must not stop the model: run the graph eagerly
        message = (
            f"the {kind} graph {key.graph_hash} could not be specialized or partitioned: "
            f"{type(error).__name__}: {error}"
        )
        apply_fallback(key.config, message, error)
        for node in gm.graph.nodes:
            if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
                stats.add_fallback(op_name(node), f"its graph failed to compile ({type(error).__name__})")
        return gm


class CompiledGraph:
    """Boxed callable for one aot_autograd graph; dispatches each call on its signature (see module docstring)."""

    def __init__(self, gm: torch.fx.GraphModule, kind: str, options: dict | None = None, dynamo_graph: int = -1):
        # aot_autograd passes the arguments as one list. An instance attribute, not a class one: Dynamo's
        # disable() wrapper around backward callables copies only the instance __dict__ (functools.wraps).
        self._boxed_call = True
        # Flex attention is inlined here, while Dynamo compiles (make_fx sets FX's process-wide "tracing now" flag,
        # which must never be set at call time: passes/specialize.py); the per-signature pass then finds none.
        gm = inline_flex_attention(gm)
        self.gm, self.kind, self.options = gm, kind, dict(options or {})
        self.option_items = tuple(self.options.items())  # config.get's memo key for our options, built once
        self.dynamo_graph = dynamo_graph  # its Dynamo graph's index (compile_events), for the dump folder
        self.graph_hash = graph_hash(gm)
        # Float inputs whose value bound decides code (a rotary embedding's frequencies): part of the dispatch key.
        self.float_guarded = range_guarded_floats(gm)
        # Weights the matmuls read transposed: inference graphs get them column-major (runtime/weight_layouts.py).
        self.column_major = column_major_inputs(gm) if kind == "inference" else ()
        self.cache: DispatchCache[torch.fx.GraphModule] = DispatchCache()
        self._warned_recompiles = False
        self._bucket_plans: dict[int, BucketPlan] = {}
        # What the last call through the key proved (runtime/hit_plan.py): the next call like it skips the key.
        self.hit_plan: HitPlan | None = None
        self._plans: Kept = Kept()  # per dispatch key: its plan (None: no plan can hold)
        # Called once, after the first call that was not padded returned: (config, arguments as given, with the
        # weight copies, the entry that ran); the backend's warm-start candidate writes its record there.
        self.after_first_call: Callable[[Config, list, list, torch.fx.GraphModule], None] | None = None

    def lookup(self, config: Config, args: list) -> tuple[tuple, torch.fx.GraphModule | None]:
        """The hit path: this call's dispatch key (the config and ``dispatch_signature``) and the graph compiled
        for it, None on a miss."""
        key = (config, dispatch_signature(args, self.float_guarded))
        return key, self.cache.lookup(key)

    def __call__(self, args: list):
        config = config_module.get(self.option_items)  # once per call
        hit = self.hit_plan
        outputs = planned_outputs(hit, config, args)  # None unless the call has the key of the plan's call
        if outputs is not None:
            tag_outputs(outputs, getattr(hit.entry, "proved_output_bounds", ()))
            return outputs
        given = args
        if self.column_major and config.transposed_weights:
            args = weight_layouts.COPIES.apply(args, self.column_major)
        bucket = self.bucket_plan(config.bucket)
        if bucket is None or not bucket.active:  # a declined plan: its reasons go to the record
            key, compiled = self._entry(config, args, bucket)
            self.hit_plan = self._plan_for(key, config, given, args, compiled)
            outputs = compiled.forward(*args)
            tag_outputs(outputs, getattr(compiled, "proved_output_bounds", ()))
            if self.after_first_call is None:
                return outputs
            after, self.after_first_call = self.after_first_call, None
            after(config, given, args, compiled)
            return outputs
        sizes = bucket.sizes(args)
        padded = bucket.pad(args, sizes)
        outputs = self._entry(config, padded, bucket)[1].forward(*padded)
        return type(outputs)(bucket.unpad(outputs, sizes))

    def _plan_for(self, key: tuple, config: Config, given: list, args: list, compiled) -> HitPlan | None:
        """The hit plan of ``key``'s calls: made on its first call (``given``: the arguments as given, ``args``: with
        the weight copies), then kept, so that a graph called with several signatures in turn makes none again."""
        plan = self._plans.get(key, NO_PLAN)
        if plan is NO_PLAN:
            plan = HitPlan.of(config, given, args, compiled, self.float_guarded)
            self._plans.keep(key, plan)
        return plan

    def bucket_plan(self, multiple: int) -> BucketPlan | None:
        """With Config.bucket, which sizes of this graph are padded (inference graphs with SymInts only: a
        training graph's padded rows would reach the gradients); worked out once per multiple."""
        if not multiple or self.kind != "inference" or not is_dynamic(self.gm):
            return None
        if multiple not in self._bucket_plans:
            plan = self._bucket_plans[multiple] = plan_buckets(self.gm, multiple)
            bucket_log.info("the %s graph %s: %s", self.kind, self.graph_hash, plan.describe())
        return self._bucket_plans[multiple]

    def _entry(self, config: Config, args: list, plan: BucketPlan | None = None) -> tuple[tuple, torch.fx.GraphModule]:
        """This call's key and the graph compiled for it, compiled now on a miss. The caller calls its ``forward``, not
        ``__call__``: GraphModule's call wrapper and nn.Module's hook dispatch cost every hit, and no hook is ever
        registered on this graph of ours."""
        key, compiled = self.lookup(config, args)
        if compiled is None:
            return key, self._compile(key, args, plan.describe() if plan is not None else "")
        stats.count_hit()
        return key, compiled

    def _compile(self, key: tuple, args: list, bucketing: str = "") -> torch.fx.GraphModule:
        """A miss: compile for this signature (once, when threads race), with the readable GraphKey recorded."""
        config = key[0]
        graph_key = GraphKey(self.graph_hash, signature_of(args, self.float_guarded), config)
        first = len(self.cache) == 0
        compiled, compiled_now = self.cache.get_or_compile(
            key, lambda: _compile_orapply_fallback(self.gm, args, graph_key, self.kind, self.dynamo_graph, bucketing)
        )
        if compiled_now:
            stats.add(cache_misses=1, recompiles=0 if first else 1)
            log.debug("compiled the %s graph %s for signature %d: %s", self.kind, self.graph_hash, len(self.cache),
                      _describe_signature(graph_key))
            self._warn_on_recompile_storm(config)
        else:
            stats.count_hit()
        return compiled

    def _warn_on_recompile_storm(self, config: Config) -> None:
        if len(self.cache) >= config.recompile_warn and not self._warned_recompiles:
            self._warned_recompiles = True
            log.warning(
                "neuron_compile: the %s graph %s has been compiled for %d shape signatures (recompile_warn=%d); "
                "every new shape compiles new kernels: pad inputs to a few sizes to bound this",
                self.kind,
                self.graph_hash,
                len(self.cache),
                config.recompile_warn,
            )


def _describe_signature(key: GraphKey) -> str:
    """The call's tensor shapes and dtypes, for the log: ``2x128 int64, 1024x256 float32, ...``."""
    shown = [f"{'x'.join(map(str, item.shape)) or 'scalar'} {item.dtype.removeprefix('torch.')}"
             if isinstance(item, TensorSignature) else repr(item.value) for item in key.inputs[:6]]
    return ", ".join(shown) + (", ..." if len(key.inputs) > 6 else "")


def compile_aten_graph(
    gm: torch.fx.GraphModule, example_inputs: list, *, kind: str, options: dict | None = None, dynamo_graph: int = -1
) -> CompiledGraph:
    """The aot_autograd compiler for one ATen graph: counts it and returns its (lazily compiling) callable."""
    del example_inputs  # fake tensors; each real call's signature decides what is compiled
    stats.add(graphs_compiled=1)
    return CompiledGraph(gm, kind, options, dynamo_graph)

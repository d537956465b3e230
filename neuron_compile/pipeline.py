"""The compiler as one list of named passes, from an ATen graph to launched kernels.

Input: an aot_autograd ATen graph (already decomposed by our table, backend.py) and, per call signature, its
arguments. Output: for each NKI region, a ``CompiledRegion`` ready to launch.

``PASSES`` is the order, as data: graph passes (``specialize``, ``bound inputs``, ``complex pairs``,
``flex attention``, ``attention pattern``, ``split projections``, ``partition``) run once per graph and call signature
(runtime/compiled_graph.py drives them; ``bound inputs`` applies the integer-input guard that the dispatch key
checks on every call, passes/input_ranges.py; ``complex pairs`` carries complex64 values as fp32 pairs,
passes/complex_pairs.py; ``flex attention`` inlines the ATen ops of flex attention's reference,
passes/flex_attention.py, where tracing is allowed: a compiled graph inlines it while Dynamo compiles, and its
per-signature pass, at call time, does not trace; ``attention pattern`` makes hand-written attention one SDPA node,
passes/attention_pattern.py; ``split projections`` makes a product read in column ranges one product per range,
passes/split_projections.py); region passes (``lower`` ... ``load``) run per NKI region (``compile_region``).
Every pass is a function of the previous pass's output and a ``PassContext``, and has a ``describe`` that prints
its output: with ``NEURON_COMPILE_DUMP`` set, the IR after every pass is written to the dump (``on_pass`` receives
each pass's name and text). Every failure in a region pass is a ``LoweringError`` that names the op or the kernel.
The on-disk cache (runtime/disk_cache.py) keeps the output of ``render`` (a ``RenderedRegion``, plain data) keyed
by the input of ``lower``: a hit runs ``load`` alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from neuron_compile import ir, kinds
from neuron_compile.codegen.kernel_source import KernelSource
from neuron_compile.codegen.region_text import PlannedKernelText, render_region_kernel
from neuron_compile.codegen.render import render_kernel
from neuron_compile.hardware import configured_target
from neuron_compile.lowering import LoweredRegion, LoweringError, lower_graph
from neuron_compile.passes.activation_ranges import guard_activation_ranges
from neuron_compile.passes.attention_pattern import fuse_attention
from neuron_compile.passes.complex_pairs import rewrite_complex_pairs
from neuron_compile.passes.flex_attention import inline_flex_attention
from neuron_compile.passes.fusion import FusionResult, fuse
from neuron_compile.passes.input_ranges import bound_integer_inputs, describe_bounds
from neuron_compile.passes.partition import partition_graph
from neuron_compile.passes.specialize import specialize
from neuron_compile.passes.split_projections import split_projections
from neuron_compile.passes.tiling import TilingError, plan_kernel
from neuron_compile.rendered_region import RenderedRegion
from neuron_compile.runtime import disk_cache, stats
from neuron_compile.runtime.launcher import select_launcher
from neuron_compile.runtime.region import CompiledRegion
from neuron_compile.runtime.region_load import load_region
from neuron_compile.runtime.user_region import UserKernelRegion, user_kernel_node
from neuron_compile.tiles import TilePlan


@dataclasses.dataclass(frozen=True)
class Pass:
    name: str
    level: str  # "graph": once per graph and signature; "region": once per NKI region
    run: Callable  # (value, PassContext) -> value
    describe: Callable[[object], str]  # the pass's output as text, for dumps


@dataclasses.dataclass
class PassContext:
    config: object = None
    target: object = None
    example_inputs: list = dataclasses.field(default_factory=list)  # the graph's (or region's) arguments
    region_ops: list = dataclasses.field(default_factory=list)  # region passes: its distinct ATen ops, in order
    # Whether the flex attention pass may trace (make_fx): not at call time, in a compiled graph's per-signature
    # passes (CompiledGraph inlines flex attention while Dynamo compiles; what is left stays eager).
    trace_flex_attention: bool = True


@dataclasses.dataclass(frozen=True)
class FusedRegion:
    lowered: LoweredRegion
    kernels: list[ir.Node]
    decisions: list[str]


@dataclasses.dataclass(frozen=True)
class PlannedKernel:
    name: str
    node: ir.Node
    plan: TilePlan


@dataclasses.dataclass(frozen=True)
class PlannedRegion:
    fused: FusedRegion
    kernels: list[PlannedKernel]


# ---------------------------------------------------------------- graph passes


def _specialize(gm: torch.fx.GraphModule, context: PassContext) -> torch.fx.GraphModule:
    return specialize(gm, context.example_inputs)


def _bound_inputs(gm: torch.fx.GraphModule, context: PassContext) -> torch.fx.GraphModule:
    return bound_integer_inputs(gm, context.example_inputs)


def _complex_pairs(gm: torch.fx.GraphModule, context: PassContext) -> torch.fx.GraphModule:
    return rewrite_complex_pairs(gm)


def _flex_attention(gm: torch.fx.GraphModule, context: PassContext) -> torch.fx.GraphModule:
    return inline_flex_attention(gm) if context.trace_flex_attention else gm


def _attention_pattern(gm: torch.fx.GraphModule, context: PassContext) -> torch.fx.GraphModule:
    return fuse_attention(gm) if context.config is None or context.config.flash_attention else gm


def _split_projections(gm: torch.fx.GraphModule, context: PassContext) -> torch.fx.GraphModule:
    return split_projections(gm)


def _partition(gm: torch.fx.GraphModule, context: PassContext):
    return partition_graph(gm, context.target)


def _describe_partition(partitioned) -> str:
    return f"{partitioned.report}\n{partitioned.graph_module.graph}"


# ---------------------------------------------------------------- region passes


def _propagate_meta(gm: torch.fx.GraphModule, example_inputs) -> None:
    """Fill meta['val'] with FakeTensors where tracing did not (FakeTensorProp over the example inputs)."""
    computing = [node for node in gm.graph.nodes if node.op in ("placeholder", "call_function")]
    if all("val" in node.meta for node in computing):
        return
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode  # torch's own, loaded when needed
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    fakes = [value for value in example_inputs if isinstance(value, FakeTensor)]
    if fakes:
        FakeTensorProp(gm, mode=fakes[0].fake_mode).propagate_dont_convert_inputs(*example_inputs)
    else:
        FakeTensorProp(gm, mode=FakeTensorMode(allow_non_fake_inputs=True)).propagate(*example_inputs)


def _lower(gm: torch.fx.GraphModule, context: PassContext) -> LoweredRegion:
    _propagate_meta(gm, list(context.example_inputs))
    return lower_graph(gm, context.target, flash_attention=getattr(context.config, "flash_attention", True),
                       flash_decode=getattr(context.config, "flash_decode", True))


def _guard_ranges(lowered: LoweredRegion, context: PassContext) -> LoweredRegion:
    return dataclasses.replace(lowered, nodes=guard_activation_ranges(lowered.nodes))


def check_single_writer(kernels: list[ir.Node], assembled: frozenset = frozenset()) -> None:
    """Every buffer is written by one kernel. A launch returns each output buffer whole (the simulator's outputs
    are fresh arrays; on the device each kernel owns its outputs), so a second writer would replace the first's
    elements: a lowering that writes one buffer in pieces must emit one node (ir.Concat), never several. The
    exception, ``assembled``: a concat's output its inputs' writers store into, disjoint slices each, inside one
    region kernel, which allocates it and hands it to each of them (passes/concat_in_place.py)."""
    writers: dict[str, str] = {}
    for node in kernels:
        for buffer in {store.buffer.name for store in kinds.stores(node)} - assembled:
            if buffer in writers:
                raise LoweringError(f"buffer {buffer} is written by two kernels ({writers[buffer]} and {node.name})")
            writers[buffer] = node.name


def _fuse(lowered: LoweredRegion, context: PassContext) -> FusedRegion:
    region_outputs = {value.buffer for value in lowered.outputs} | {value.buffer for _, value in lowered.mutations}
    one_launch = getattr(context.config, "launch_unit", "region") == "region"
    fused: FusionResult = fuse(lowered.nodes, region_outputs, enabled=getattr(context.config, "fusion", True),
                               target=context.target, in_place=one_launch)
    check_single_writer(fused.kernels, fused.assembled)
    return FusedRegion(lowered, fused.kernels, fused.decisions)


def kernel_name(node: ir.Node, index: int) -> str:
    return f"{kinds.kind_of(node).name}_kernel_{index}"


def _plan_tiles(fused: FusedRegion, context: PassContext) -> PlannedRegion:
    planned = []
    for index, node in enumerate(fused.kernels):
        name = kernel_name(node, index)
        try:
            planned.append(PlannedKernel(name, node, plan_kernel(node, context.target)))
        except TilingError as error:
            raise LoweringError(f"kernel {name}: shape beyond tiling: {error}") from error
    return PlannedRegion(fused, planned)


def _render(planned: PlannedRegion, context: PassContext) -> RenderedRegion:
    sources = []
    for kernel in planned.kernels:
        parameters = sorted({load.buffer for load in kinds.loads(kernel.node)})
        try:
            sources.append(render_kernel(kernel.node, kernel.plan, kernel.name, parameters))
        except Exception as error:  # noqa: BLE001 -- a renderer bug becomes this region's named failure
            raise LoweringError(f"kernel {kernel.name} ({kernel.node.name}) could not be rendered: {error}") from error
    lowered = planned.fused.lowered
    return RenderedRegion(
        tuple(lowered.inputs), tuple(lowered.outputs), dict(lowered.buffers), tuple(lowered.mutations),
        tuple(lowered.output_dtypes), lowered.aten_nodes, tuple(str(d) for d in planned.fused.decisions),
        tuple(sources), tuple(kernel.plan.describe() for kernel in planned.kernels), tuple(context.region_ops),
        _region_launch(planned, sources, context),
    )


REGION_KERNEL_NAME = "region_kernel"


def _region_launch(planned: PlannedRegion, sources: list[KernelSource], context: PassContext) -> KernelSource | None:
    """The region's kernels as one region kernel (one launch per call), with ``launch_unit`` "region" and two
    kernels or more; None: each kernel is launched."""
    if getattr(context.config, "launch_unit", "region") != "region" or len(sources) < 2:
        return None
    lowered = planned.fused.lowered
    wanted = [value.buffer for value in lowered.outputs] + [value.buffer for _, value in lowered.mutations]
    kernels = [PlannedKernelText(kernel.node, kernel.plan, kernel.name, source.parameters)
               for kernel, source in zip(planned.kernels, sources, strict=True)]
    written = {store.buffer.name for kernel in planned.kernels for store in kinds.stores(kernel.node)}
    if not written & set(wanted):
        return None  # every output is empty (a batch of 0): no kernel writes one, a region kernel would return none
    try:
        return render_region_kernel(REGION_KERNEL_NAME, kernels, wanted)
    except Exception as error:  # noqa: BLE001 -- a renderer bug becomes this region's named failure
        raise LoweringError(f"the region kernel could not be rendered: {error}") from error


def _load(rendered: RenderedRegion, context: PassContext) -> CompiledRegion:
    return load_region(rendered, context.config, context.target)


# ---------------------------------------------------------------- descriptions


def _describe_lowered(lowered: LoweredRegion) -> str:
    inputs = ", ".join(f"{buffer.name}: {buffer.dtype} {buffer.layout}" for buffer in lowered.inputs)
    outputs = ", ".join(f"{value.buffer} {value.layout}" for value in lowered.outputs)
    return "\n".join([f"inputs: {inputs}", *(kinds.describe(node) for node in lowered.nodes), f"outputs: {outputs}"])


def _describe_fused(fused: FusedRegion) -> str:
    return "\n".join([*fused.decisions, *(kinds.describe(node) for node in fused.kernels)])


def _describe_planned(planned: PlannedRegion) -> str:
    return "\n".join(f"{kernel.name}: {kernel.plan.describe()}" for kernel in planned.kernels)


def _describe_rendered(rendered: RenderedRegion) -> str:
    launch = [rendered.launch] if rendered.launch is not None else []
    return "\n".join(f"# ---- {source.name}\n{source.source}" for source in [*rendered.sources, *launch])


def _describe_loaded(region: CompiledRegion) -> str:
    return (f"{len(region.kernels)} kernels in {len(region.launched)} launch(es), loaded by "
            f"{type(region.launcher).__name__}")


PASSES: tuple[Pass, ...] = (
    Pass("specialize", "graph", _specialize, lambda gm: str(gm.graph)),
    Pass("bound inputs", "graph", _bound_inputs, describe_bounds),
    Pass("complex pairs", "graph", _complex_pairs, lambda gm: str(gm.graph)),
    Pass("flex attention", "graph", _flex_attention, lambda gm: str(gm.graph)),
    Pass("attention pattern", "graph", _attention_pattern, lambda gm: str(gm.graph)),
    Pass("split projections", "graph", _split_projections, lambda gm: str(gm.graph)),
    Pass("partition", "graph", _partition, _describe_partition),
    Pass("lower", "region", _lower, _describe_lowered),
    Pass("guard ranges", "region", _guard_ranges, _describe_lowered),
    Pass("fuse", "region", _fuse, _describe_fused),
    Pass("plan tiles", "region", _plan_tiles, _describe_planned),
    Pass("render", "region", _render, _describe_rendered),
    Pass("load", "region", _load, _describe_loaded),
)

OnPass = Callable[[str, str], None]  # (pass name, its output as text)


def run_passes(level: str, value, context: PassContext, on_pass: OnPass | None = None, *,
               after: str | None = None, through: str | None = None):
    """Run the passes of ``level`` in order on ``value`` (only those after pass ``after`` and up to pass
    ``through``, when given); ``on_pass`` sees each one's output as text."""
    steps = [step for step in PASSES if step.level == level]
    names = [step.name for step in steps]
    first = names.index(after) + 1 if after is not None else 0
    last = names.index(through) + 1 if through is not None else len(steps)
    for step in steps[first:last]:
        value = step.run(value, context)
        if on_pass is not None:
            on_pass(step.name, step.describe(value))
    return value


CACHED_THROUGH = "render"  # the on-disk cache keeps this pass's output, keyed by the first region pass's input


def region_ops(gm: torch.fx.GraphModule) -> list[str]:
    ops = [str(node.target) for node in gm.graph.nodes if isinstance(node.target, torch._ops.OpOverload)]
    return list(dict.fromkeys(ops))


def compile_region(gm: torch.fx.GraphModule, example_inputs, config=None, on_pass: OnPass | None = None):
    """The region passes on one NKI region: lower, guard ranges, fuse, plan tiles, render, load.

    With the on-disk cache on (``NEURON_COMPILE_CACHE`` not ``off``), the passes through ``render`` run only on
    a miss; a hit loads the stored ``RenderedRegion``. With a dump folder set every pass runs (the dump shows each
    one's output), and the result is still stored. A region holding one user kernel (``neuron_compile.nki_op``)
    skips the passes: it launches that kernel (runtime/user_region.py)."""
    context = PassContext(config, configured_target(config), list(example_inputs), region_ops(gm))
    user_call = user_kernel_node(gm)
    if user_call is not None:  # a user kernel's region of its own: nothing to lower, launched as written
        return UserKernelRegion(gm, user_call, select_launcher(config, context.target), context.example_inputs)
    store = disk_cache.open_cache(config)
    if store is None:
        return run_passes("region", gm, context, on_pass)
    parts = disk_cache.region_key_parts(gm, context.example_inputs, config, context.target.name)

    def render() -> dict:
        return run_passes("region", gm, context, on_pass, through=CACHED_THROUGH).to_data()

    def load(payload: dict) -> CompiledRegion:  # a ValueError: a stored payload is refused (a miss)
        return run_passes("region", RenderedRegion.from_data(payload), context, on_pass, after=CACHED_THROUGH)

    if config.dump_dir:
        payload = render()
        region, created = load(payload), True
        store.store(disk_cache.key_of(parts), parts, payload)
    else:
        region, created = store.get_or_create(parts, render, accept=load)
    stats.add(**{"disk_cache_misses" if created else "disk_cache_hits": 1})
    region.disk_key = disk_cache.key_of(parts)  # a warm-start record names its region's entry (runtime/warm_start.py)
    return region

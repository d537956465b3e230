"""Partition stage: split an ATen graph into NKI regions and eager nodes.

Input: an ATen ``torch.fx.GraphModule`` with concrete shapes in ``node.meta["val"]`` (after specialization).
Output: a ``PartitionResult``: a new GraphModule (the input is not modified) in which every NKI region is a
submodule ``nki_region_<i>`` returning a tuple, topologically sorted, and a ``PartitionReport`` that says for
every node which region holds it, or why it runs eagerly. The report prints as a table (the dump CLI shows it).

Which nodes may go in a region is decided by ``neuron_compile.lowering.unsupported_reason`` for the hardware
target (a ``Target``, a target name, or None for the default target); the partitioner (torch's ``CapabilityBasedPartitioner``) then groups supported nodes into the largest regions that
do not create cycles. A user kernel's call (``neuron_compile.nki_op``, or an ATen op a user kernel was chosen for
with ``NkiOp.choose_for``) gets a region of its own.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import operator
from collections.abc import Callable

import torch
import torch.fx
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner, Partition
from torch.fx.passes.operator_support import OperatorSupportBase
from torch.fx.passes.utils.fuser_utils import fuse_by_partitions
from torch.utils.flop_counter import flop_registry

from neuron_compile.hardware import Target
from neuron_compile.passes.graph_copies import compile_now, lazy_copy
from neuron_compile.user_kernels import user_call

log = logging.getLogger(__name__)

REGION_PREFIX = "nki_region_"
UnsupportedReason = Callable[[torch.fx.Node], "str | None"]
# Mutating ops a region may hold; the registry's check decides each node (copy_ into a graph input it owns).
LOWERED_MUTATIONS = (torch.ops.aten.copy_.default,)
USER_KERNEL_REASON = "a user NKI kernel: placed in a region of its own"


@dataclasses.dataclass(frozen=True)
class NodePlacement:
    """Where one ATen node runs: ``region`` names its NKI region, else ``reason`` says why it is eager."""

    node: str
    op: str
    region: str | None
    reason: str | None = None
    flops: int = 0  # matmul / convolution / attention FLOPs (torch's flop_counter formulas), 0 for other ops


@dataclasses.dataclass(frozen=True)
class PartitionReport:
    """One ``NodePlacement`` per call_function node, in graph order; ``str()`` is the table the dump shows."""

    placements: tuple[NodePlacement, ...]

    @property
    def regions(self) -> dict[str, tuple[NodePlacement, ...]]:
        grouped: dict[str, list[NodePlacement]] = {}
        for placement in self.placements:
            if placement.region is not None:
                grouped.setdefault(placement.region, []).append(placement)
        return {name: tuple(members) for name, members in grouped.items()}

    @property
    def eager(self) -> tuple[NodePlacement, ...]:
        return tuple(placement for placement in self.placements if placement.region is None)

    def region_ops(self, region: str) -> list[str]:
        """The distinct ops of a region, in graph order (for messages that name a region)."""
        return list(dict.fromkeys(placement.op for placement in self.regions.get(region, ())))

    def __str__(self) -> str:
        if not self.placements:
            return "(no compute nodes)"
        name_width = max(len(placement.node) for placement in self.placements)
        op_width = max(len(placement.op) for placement in self.placements)
        lines = [f"{len(self.regions)} NKI region(s), {len(self.eager)} eager node(s)"]
        for placement in self.placements:
            where = placement.region if placement.region is not None else f"eager: {placement.reason}"
            lines.append(f"  {placement.node:<{name_width}}  {placement.op:<{op_width}}  {where}")
        return "\n".join(lines)


@dataclasses.dataclass
class PartitionResult:
    graph_module: torch.fx.GraphModule
    report: PartitionReport


def op_name(node: torch.fx.Node) -> str:
    """``aten.mm.default`` style name of a call_function target (``higher_order.flex_attention`` for a
    higher-order op)."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"higher_order.{target.name()}"
    return getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or str(target)


def node_flops(node: torch.fx.Node) -> int:
    """The FLOPs torch's flop counter gives ``node`` (mm, bmm, addmm, convolution, attention and their backwards;
    0 for every other op, or when a node lacks its traced values)."""
    packet = getattr(node.target, "overloadpacket", None)
    formula = flop_registry.get(packet)
    if formula is None or "val" not in node.meta:
        return 0
    missing = []

    def value(argument: torch.fx.Node):
        if "val" not in argument.meta:
            missing.append(argument)
        return argument.meta.get("val")

    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), value)
    return 0 if missing else int(formula(*args, **kwargs, out_val=node.meta["val"]))


@functools.cache
def registry_unsupported_reason(target: Target | str | None = None) -> UnsupportedReason:
    """The lowering registry's predicate for ``target`` (None: the default target); without a registry every op is
    eager (the backend still works)."""
    try:
        from neuron_compile.lowering import unsupported_reason
    except ImportError as error:
        log.warning("neuron_compile: lowering registry not importable (%s); every op runs eagerly", error)
        missing = isinstance(error, ModuleNotFoundError) and error.name == "neuron_compile.lowering"
        reason = "no lowerings yet" if missing else f"the lowering registry failed to import: {error}"
        return lambda node: reason
    return functools.partial(unsupported_reason, target=target)


def _placement_reason(node: torch.fx.Node, unsupported_reason: UnsupportedReason) -> str | None:
    """None if ``node`` may join an NKI region, else why not."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable and target not in LOWERED_MUTATIONS:
        # In-place writes into graph inputs (keep_inference_input_mutations) must hit the real input tensor.
        return f"{op_name(node)} mutates its input in place; mutations stay eager"
    try:
        return unsupported_reason(node)
    except Exception as error:  # noqa: BLE001 -- a lowering bug must not break the graph: the node runs eagerly
        return f"unsupported_reason raised {type(error).__name__}: {error}"


class _RegistrySupport(OperatorSupportBase):
    """OperatorSupport over precomputed reasons (so each node is asked once, and getitem follows its producer)."""

    def __init__(self, reasons: dict[torch.fx.Node, str | None]):
        self.reasons = reasons

    def is_node_supported(self, submodules, node: torch.fx.Node) -> bool:
        return node.op == "call_function" and self.reasons.get(node, "not an ATen call") is None


def _compute_reasons(gm: torch.fx.GraphModule, unsupported_reason: UnsupportedReason) -> dict:
    reasons: dict[torch.fx.Node, str | None] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
            producer_reason = reasons.get(node.args[0], "its producer is not an ATen call")
            reasons[node] = None if producer_reason is None else "its producer runs eagerly"
        elif user_call(node) is not None:
            reasons[node] = USER_KERNEL_REASON  # placed in a region of its own by _user_kernel_partitions
        else:
            reasons[node] = _placement_reason(node, unsupported_reason)
    return reasons


def _keep_input_writes_after_their_readers(partitions: list, reasons: dict) -> list:
    """A region writes a graph input (copy_) after all its kernels ran; an eager reader of that input could be
    scheduled after the region and see the new value. So the copy_ joins a region only with every other reader
    of its input; otherwise it runs eagerly, in graph order."""
    for partition in partitions:
        for node in [node for node in partition.nodes if node.target in LOWERED_MUTATIONS]:
            readers = [user for user in node.args[0].users if user is not node]
            if any(reader not in partition.nodes for reader in readers):
                partition.remove_node(node)
                reasons[node] = f"{op_name(node)}: its input is also read outside the region that would write it"
    return [partition for partition in partitions if partition.nodes]


def _user_kernel_partitions(gm: torch.fx.GraphModule, reasons: dict) -> list[Partition]:
    """A single-node region (with its getitems) for each user-kernel call. Such a node is left out of the
    proposed regions (``USER_KERNEL_REASON``), which the partitioner cuts around it as around an eager node; a
    region of one node cannot create a cycle (runtime/user_region.py says why it is alone)."""
    partitions = []
    for node in gm.graph.nodes:
        if user_call(node) is not None:
            members = [node, *(user for user in node.users if user.target is operator.getitem)]
            for member in members:
                reasons[member] = None
            partitions.append(Partition(nodes=members))
    return partitions


def partition_graph(gm: torch.fx.GraphModule, target: Target | str | None = None, *,
                    unsupported_reason: UnsupportedReason | None = None) -> PartitionResult:
    """Split ``gm`` into NKI regions and eager nodes for ``target`` (a ``Target``, a target name, or None for the
    default target, ``hardware.get_target()``). ``unsupported_reason(node)`` defaults to the lowering registry's
    answer for ``target``."""
    if unsupported_reason is None:
        # The default target's predicate is asked for without an argument, so a stand-in factory that takes none
        # (tests install one) keeps working.
        unsupported_reason = registry_unsupported_reason() if target is None else registry_unsupported_reason(target)
    # Work on a copy of the graph: the caller's GraphModule (held by the dispatch cache) stays intact.
    work = lazy_copy(gm, copy.deepcopy(gm.graph))
    reasons = _compute_reasons(work, unsupported_reason)
    partitioner = CapabilityBasedPartitioner(work, _RegistrySupport(reasons), allows_single_node_partition=True)
    order = {node: index for index, node in enumerate(work.graph.nodes)}
    proposed = _keep_input_writes_after_their_readers(partitioner.propose_partitions(), reasons)
    proposed += _user_kernel_partitions(work, reasons)
    partitions = sorted(proposed, key=lambda part: min(order[node] for node in part.nodes))

    region_of: dict[str, str] = {}
    for index, partition in enumerate(partitions):
        for node in partition.nodes:
            region_of[node.name] = f"{REGION_PREFIX}{index}"
    placements = tuple(
        NodePlacement(
            node=node.name,
            op=op_name(node),
            region=region_of.get(node.name),
            reason=None if node.name in region_of else (reasons[node] or "left out by the partitioner"),
            flops=node_flops(node),
        )
        for node in work.graph.nodes
        if node.op == "call_function"
    )
    if partitions:
        # always_return_tuple: a region's callable returns one tuple entry per output, as CompiledRegion does.
        work = fuse_by_partitions(
            work, [part.nodes for part in partitions], prefix=REGION_PREFIX, always_return_tuple=True
        )
    work.recompile()
    compile_now(work)  # the module the runtime calls: its code made here, once, not by whichever call is first
    return PartitionResult(graph_module=work, report=PartitionReport(placements))

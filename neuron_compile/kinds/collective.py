"""Kernel kind ``collective``: one ``nki.collectives`` call across ranks (``ir.Collective``: all_reduce,
all_gather, reduce_scatter, all_to_all).

Fusion: none (a collective takes no epilogue or prologue: its result exists only once every rank made the call).
Tiling: none (the collective moves whole flat HBM tensors; the plan is a single synthetic dim for the dumps).
Codegen (collective.py.j2): the kernel module imports ``nki.collectives as ncc``; the kernel copies its source into
private HBM, makes one call into a private HBM tensor (with LNC 1 a collective's sources must be private HBM, and
shared HBM destinations need NKI_LNC1_SHARED_HBM=1), with the replica group listing the process group's ranks,
``collective_dim=0`` and the reduction operator, and copies the result into its output. On the simulator the call
runs through torch.distributed (runtime/simulator/collectives.py); on a device, through the Neuron collectives:
the same text.
"""

from __future__ import annotations

import math

from neuron_compile import ir
from neuron_compile.codegen.expressions import NL_DTYPES
from neuron_compile.codegen.kernel_text import kernel_context, render_template
from neuron_compile.dims import LoopDim
from neuron_compile.kind_registry import KernelKind, register_kind
from neuron_compile.tiles import TilePlan

REDUCTION_OPERATORS = {"add": "nl.add", "maximum": "nl.maximum", "minimum": "nl.minimum"}
REDUCING = ("all_reduce", "reduce_scatter")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def collective_call(node: ir.Collective, source: str, destination: str) -> str:
    """The ``ncc.<collective>(...)`` line of ``node`` reading ``source`` and writing ``destination``."""
    if node.collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {node.collective!r} (known: {COLLECTIVES})")
    arguments = [f"srcs=[{source}]", f"dsts=[{destination}]",
                 f"replica_group=ncc.ReplicaGroup({[list(ranks) for ranks in node.ranks]})"]
    if node.collective != "all_reduce":
        arguments.append("collective_dim=0")
    if node.collective in REDUCING:
        arguments.append(f"op={REDUCTION_OPERATORS[node.reduce]}")
    return f"ncc.{node.collective}({', '.join(arguments)})"


def spread(tensor: str, size: int) -> str:
    """``tensor`` (a flat HBM tensor of ``size`` elements) viewed as up to 128 rows, so a copy of it runs on many
    DMA engines at once (a transfer uses one engine per 8 partition rows) instead of one."""
    rows = math.gcd(size, 128)
    return f"{tensor}.reshape(({rows}, {size // rows}))" if rows > 1 else tensor


class CollectiveKind(KernelKind):
    node_type = ir.Collective
    name = "collective"
    refusal = "a collective kernel takes no epilogue (its result exists once every rank made the call)"
    uses_collectives = True

    def exprs(self, node):
        return []

    def operand_loads(self, node):
        return [node.source]

    def map_exprs(self, node, fn):
        return node

    def describe_head(self, node):
        reduction = f" op={node.reduce}" if node.collective in REDUCING else ""
        return f" {node.collective}{reduction} ranks={[list(ranks) for ranks in node.ranks]}"

    def describe(self, node):
        lines = [f"Collective {node.name} domain={list(node.domain)}{self.describe_head(node)}"]
        return "\n".join(lines + [f"  {store.buffer.name} = {node.collective}({node.source})" for store in node.stores])

    def prune(self, node, needed):
        return node if any(store.buffer.name in needed for store in node.stores) else None

    def plan(self, node, target):
        whole = LoopDim(1, None)
        return TilePlan("collective", (), whole, (whole,), 0)

    def render(self, node, plan, name, parameters):
        (store,) = node.stores
        dtype = NL_DTYPES[store.buffer.dtype]
        sent_size, received_size = math.prod(node.source.layout.shape), math.prod(node.domain)
        staging = [f"sent = nl.ndarray(({sent_size},), dtype={dtype}, buffer=nl.private_hbm)",
                   f"received = nl.ndarray(({received_size},), dtype={dtype}, buffer=nl.private_hbm)",
                   f"nisa.dma_copy(dst={spread('sent', sent_size)}, src={spread(node.source.buffer, sent_size)})"]
        result = f"nisa.dma_copy(dst={spread(store.buffer.name, received_size)}, src={spread('received', received_size)})"
        context = kernel_context(node, plan, name, parameters, allocations=[], collectives=True,
                                 collective=node.collective, staging=staging, result=result,
                                 call=collective_call(node, "sent", "received"))
        return render_template("collective.py.j2", **context)


register_kind(CollectiveKind())

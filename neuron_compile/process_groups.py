"""The torch.distributed process groups a graph's collectives name, as the compiler needs them.

Input: the group name a ``_c10d_functional`` op carries (its last string argument, "0" for the world) in a
process where torch.distributed is initialized. Output: the group's global ranks (what a kernel's replica group
lists), and, for the on-disk cache key, every group a graph names with its ranks: a kernel compiled for one group
layout must not be loaded for another (the graph text alone says "0" for a world of any size).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

FUNCTIONAL_NAMESPACE = "_c10d_functional"


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def group_ranks(group_name: str) -> tuple[int, ...]:
    """The global ranks of the process group named ``group_name``, in group-rank order."""
    # torch resolves the names its functional collectives carry with this helper (there is no public one)
    group = dist.distributed_c10d._resolve_process_group(group_name)
    return tuple(dist.get_process_group_ranks(group))


def is_collective(node: torch.fx.Node) -> bool:
    target = getattr(node, "target", None)
    return isinstance(target, torch._ops.OpOverload) and target.namespace == FUNCTIONAL_NAMESPACE


def group_name_of(node: torch.fx.Node) -> str | None:
    """The process group a functional collective runs on: its last argument (``group_name``); None for
    ``wait_tensor`` and other nodes."""
    if not is_collective(node):
        return None
    name = node.kwargs.get("group_name", node.args[-1] if node.args else None)
    return name if isinstance(name, str) else None


def graph_groups(gm: torch.fx.GraphModule) -> list[str]:
    """``name: ranks`` for every process group the graph's collectives name (empty without collectives)."""
    names = {name for node in gm.graph.nodes if (name := group_name_of(node)) is not None}
    if not names or not initialized():
        return []
    return [f"{name}: {list(group_ranks(name))}" for name in sorted(names)]

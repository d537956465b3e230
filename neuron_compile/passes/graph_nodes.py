"""Graph passes' shared step: a new ATen node with its meta value, as the specialization stage's passes add them.

Input: an FX graph whose nodes carry FakeTensor values in ``node.meta["val"]``, a target and its arguments.
Output: the new node, its ``meta["val"]`` computed from the arguments' values in the graph's fake mode, so the
passes after it (partition, lowering) read its shape, strides and dtype as they read a traced node's; and, after a
pass gave readers new inputs, their values (and their readers') computed again: a view's strides follow its
input's.
"""

from __future__ import annotations

import contextlib

import torch
import torch.fx
from torch._guards import detect_fake_mode


def emit(graph: torch.fx.Graph, target, *args, **kwargs) -> torch.fx.Node:
    """A new node computing ``target(*args, **kwargs)``, its meta value computed on the arguments' values, in the
    graph's fake mode (an op making a tensor of its own, ``scalar_tensor``, makes a fake one there)."""
    node = graph.call_function(target, args, kwargs)
    node.meta["val"] = fake_value(graph, node)
    return node


def fake_value(graph: torch.fx.Graph, node: torch.fx.Node):
    """``node``'s value computed on its arguments' meta values, in the graph's fake mode."""
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda arg: arg.meta["val"])
    fake_mode = detect_fake_mode(list(args)) or graph_fake_mode(graph)
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        return node.target(*args, **kwargs)


def recompute_values(graph: torch.fx.Graph, changed: set[torch.fx.Node]) -> None:
    """The meta values of every node that reads one of ``changed``, directly or not, computed again in order."""
    changed = set(changed)
    for node in graph.nodes:
        if node.op == "call_function" and any(arg in changed for arg in node.all_input_nodes):
            node.meta["val"] = fake_value(graph, node)
            changed.add(node)


def graph_fake_mode(graph: torch.fx.Graph):
    """The fake mode of the graph's node values (for ops without tensor arguments), or None."""
    for node in graph.nodes:
        mode = detect_fake_mode([node.meta.get("val")])
        if mode is not None:
            return mode
    return None

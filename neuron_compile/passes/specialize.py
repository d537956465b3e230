"""Specialization stage: give a dynamic ATen graph the concrete shapes of one call.

Input: an ATen GraphModule from aot_autograd (placeholders may be SymInts and tensors with symbolic sizes,
when Dynamo compiled with ``dynamic=True``, ``mark_dynamic`` or automatic dynamic shapes) and the concrete
arguments of one call. Output: a GraphModule with the same placeholders (so it takes the same arguments)
whose every ``node.meta["val"]`` has concrete sizes and strides; SymInt arithmetic is folded into constants.
A graph that is already static is returned as is.

The graph is re-traced with ``make_fx`` under fake tensors with static shapes: each ATen op is recorded again
as itself, so the result is the same graph with the symbols replaced by this call's numbers.
"""

from __future__ import annotations

import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx


def _is_symbolic(value) -> bool:
    if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        return True
    if isinstance(value, torch.Tensor):
        return any(isinstance(dim, torch.SymInt) for dim in (*value.shape, *value.stride()))
    if isinstance(value, list | tuple):
        return any(_is_symbolic(item) for item in value)
    return False


def is_dynamic(gm: torch.fx.GraphModule) -> bool:
    """True if any node of ``gm`` carries a symbolic size, stride or scalar."""
    return any(_is_symbolic(node.meta.get("val")) for node in gm.graph.nodes)


def specialize(gm: torch.fx.GraphModule, args: list) -> torch.fx.GraphModule:
    """``gm`` with the concrete shapes of ``args`` (real tensors and ints of one call); static graphs unchanged."""
    if not is_dynamic(gm):
        return gm
    # aot_autograd's graphs are already differentiated: trace them without autograd, on detached inputs (a
    # parameter that requires grad would otherwise add detach nodes). Fake tracing runs no real compute, and
    # "fake" mode (not "symbolic") makes every size a plain int.
    detached = [arg.detach() if isinstance(arg, torch.Tensor) else arg for arg in args]
    with torch.no_grad():
        specialized = make_fx(gm, tracing_mode="fake", _allow_non_fake_inputs=True)(*detached)
    return specialized

"""Graph pass helper: the copy of an ATen GraphModule that a pass rewrites, its Python code generated when used.

Input: a GraphModule and the graph copied from it. Output: a GraphModule over that graph whose code is generated on
its first call or read of ``.code``, not when it is made. The graph passes copy the graph they change (the dispatch
cache shares the original between call signatures), and most copies are only read as graphs by the next pass: a
``torch.fx.GraphModule`` generates and compiles its code when made (8 ms for the 200 nodes of the tiny Llama's
graph, each time). torch's ``_LazyGraphModule`` (what aot_autograd hands the backend) defers it.
"""

from __future__ import annotations

import torch.fx
from torch.fx._lazy_graph_module import _LazyGraphModule


def lazy_copy(gm: torch.fx.GraphModule, graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """A GraphModule over ``graph`` with ``gm``'s attributes (as ``torch.fx.GraphModule(gm, graph)``), compiled when
    first called or when its code is read."""
    return _LazyGraphModule(gm, graph)


def compile_now(gm: torch.fx.GraphModule) -> None:
    """Generate ``gm``'s code now if it is pending (a module about to be called from several threads)."""
    _LazyGraphModule.force_recompile(gm)

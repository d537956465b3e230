"""Lowering stage: ATen FX nodes -> kernel IR (``neuron_compile.ir``).

Input: a torch.fx graph of ATen ops whose nodes carry ``meta["val"]``. Output: IR nodes and buffers
(``LoweredRegion``). ``LoweringError`` names the op and the rule it broke; the front end then runs eagerly.
"""

from neuron_compile.lowering.registry import LoweringError, lower_graph, unsupported_reason

__all__ = ["LoweringError", "lower_graph", "unsupported_reason"]

"""Lowering stage: ATen FX nodes -> kernel IR (``neuron_compile.ir``).

Input: a torch.fx graph of ATen ops whose nodes carry ``meta["val"]``. Output: IR nodes and buffers
(``LoweredRegion``). ``LoweringError`` names the op and the rule it broke; the front end then runs eagerly.

``registry`` holds the one table of lowerings and the driver; each family module registers its ops there when
it is imported. This package imports every family, so ``import neuron_compile.lowering`` has every lowering
registered; code outside the lowering stage imports its API from here.
"""

# Importing a family registers its lowerings (@register_lowering at import time); no two families register the
# same op, so the order does not matter.
from neuron_compile.lowering import (  # noqa: F401
    arg_reduction,
    attention,
    attention_backward,
    collectives,
    convolution,
    creation,
    dropout,
    indexing,
    integer_division,
    loss,
    matmul,
    max_pooling,
    movement,
    normalization,
    pointwise,
    pointwise_math,
    pooling,
    reduction,
    scan,
    scatter,
    special,
    trigonometry,
)
from neuron_compile.lowering.registry import (
    INTEGER_DTYPES,
    MAX_RANK,
    SUPPORTED_DTYPES,
    LoweredRegion,
    LoweringError,
    TensorValue,
    lower_graph,
    registered_ops,
    resolve_target,
    unsupported_reason,
)

__all__ = [
    "INTEGER_DTYPES",
    "MAX_RANK",
    "SUPPORTED_DTYPES",
    "LoweredRegion",
    "LoweringError",
    "TensorValue",
    "lower_graph",
    "registered_ops",
    "resolve_target",
    "unsupported_reason",
]

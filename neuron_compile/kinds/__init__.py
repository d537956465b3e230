"""Kernel kinds: one module per kind of kernel, each registering itself (``neuron_compile.kind_registry``).

Importing this package registers every kind; the passes then ask ``kind_of(node)`` (fusion rules, tile planner,
renderer) instead of branching on node types. A new kind (an attention kernel, a collective) is one new module
here, with its IR node in ``neuron_compile.ir`` and its template in ``codegen/templates``.
"""

from neuron_compile.kind_registry import (
    KernelKind,
    UnknownKernelKind,
    describe,
    kind_of,
    loads,
    map_exprs,
    map_loads,
    random_reason,
    read_buffers,
    registered_kinds,
    registered_node_types,
    stores,
    written_buffers,
)
from neuron_compile.kinds import (
    attention,
    attention_backward,
    collective,
    concat,
    gather,
    matmul,
    matmul_norm_epilogue,
    matmul_rotary,
    normed_matmul,
    pointwise,
    reduction,
    row_normalize,
    scan,
    scatter,
)

KINDS = (pointwise, reduction, row_normalize, scan, matmul, normed_matmul, matmul_norm_epilogue, matmul_rotary,
         attention, attention_backward, concat, gather, scatter, collective)

__all__ = ["KINDS", "KernelKind", "UnknownKernelKind", "describe", "kind_of", "loads", "map_exprs", "map_loads",
           "random_reason", "read_buffers", "registered_kinds", "registered_node_types", "stores", "written_buffers"]

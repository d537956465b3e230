"""Decomposition stage: the table aot_autograd uses to turn Dynamo's torch-level graph into ATen.

Input: nothing (a constant). Output: ``decomposition_table()``, a dict ``OpOverload -> decomposition``: the core
ATen decompositions, minus the ops that have (or will have) a whole-op NKI lowering — softmax, log_softmax,
layer norm and scaled-dot-product attention. Decomposing those would scatter one fused row-reduction or
attention kernel into a dozen pointwise and reduction nodes that the fusion pass then has to re-discover.
Layer norm's backward is kept whole too: its decomposition sums in a different order than ATen's kernel, so
a graph that falls back entirely would no longer be bit-identical to eager. The other backward ops (softmax,
log_softmax, activations) decompose exactly, into pointwise and reduction ops that lowerings cover.
"""

from __future__ import annotations

import functools

import torch
from torch._decomp import core_aten_decompositions

aten = torch.ops.aten

# Kept whole in the ATen graph. The ``.int`` / ``layer_norm`` entry points still decompose to the
# ``_softmax`` / ``native_layer_norm`` forms, which are the ones lowered.
KEPT_WHOLE = (
    aten._safe_softmax.default,
    aten.scaled_dot_product_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_attention_math.default,
    aten.native_layer_norm_backward.default,
)


@functools.cache
def _table() -> dict:
    table = dict(core_aten_decompositions())
    for op in KEPT_WHOLE:
        table.pop(op, None)
    return table


def decomposition_table() -> dict:
    """A fresh copy of the table (callers may extend it without changing ours)."""
    return dict(_table())

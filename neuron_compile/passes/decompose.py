"""Decomposition stage: the table aot_autograd uses to turn Dynamo's torch-level graph into ATen.

Input: nothing (a constant). Output: ``decomposition_table()``, a dict ``OpOverload -> decomposition``: the core
ATen decompositions plus the ``_foreach_*`` ops as per-tensor ops (passes/decompose_foreach.py: compiled
optimizers) and the eval fast path of ``nn.TransformerEncoderLayer`` / ``_native_multi_head_attention``
(passes/decompose_transformer.py), minus ``KEPT_WHOLE``, the ops that stay whole in the ATen graph:

- softmax, log_softmax, layer norm, batch norm, the NLL loss (cross-entropy's second half) and scaled-dot-product
  attention, and their backward ops: each is one fused row-reduction or attention kernel; decomposing it
  would scatter it into a dozen pointwise and reduction nodes that the fusion pass would have to re-discover;
- index_copy and index_add: their index_put decomposition wraps negative indices that eager rejects, and
  index_fill (which wraps them) decomposes into index_copy; lowering/scatter.py lowers the three whole;
- silu, softplus, mish and the gelu / silu derivatives: each is a single ``nisa.activation`` function
  (silu, silu_dx, gelu_dx, softplus, mish in nki-spec.md §1.5).

A second reason for both groups: their decompositions round differently from ATen's kernels (by an ulp or
so), so with them decomposed a graph whose ops all fall back would no longer be bit-identical to eager.
Ops still decomposed can differ from eager at that level (e.g. ``std``, ``lerp``, ``addcmul``).

The core table is torch's ``core_aten_decompositions()``, built as torch builds it (``core_aten_table``) but in a
third of its time: torch finds the CompositeImplicitAutograd (CIA) ops by making every overload of every operator
of every namespace and asking each, and asks the C++ dispatcher's list of CIA ops again for each of 27 namespaces
(0.11 s of each process's first compile); here the dispatcher's list is read once and only the overloads made so far
are asked for a CIA kernel registered in Python (making an overload is the only way to register one). A test
compares the two tables entry by entry.
"""

from __future__ import annotations

import functools

import torch
from torch._decomp import _core_aten_decompositions_post_autograd
from torch._export.utils import _get_decomp_for_cia, _is_preservable_cia_op
from torch.export.decomp_utils import PRESERVED_ATEN_CIA_OPS

from neuron_compile.passes.decompose_foreach import foreach_decompositions
from neuron_compile.passes.decompose_transformer import transformer_decompositions

aten = torch.ops.aten

# The ``softmax.int`` / ``layer_norm`` entry points still decompose to ``_softmax`` / ``native_layer_norm``.
KEPT_WHOLE = (
    aten._safe_softmax.default,
    aten._softmax_backward_data.default,
    aten._log_softmax_backward_data.default,
    aten.native_layer_norm_backward.default,
    aten.native_batch_norm_backward.default,
    aten.nll_loss_forward.default,
    aten.nll_loss_backward.default,
    aten.scaled_dot_product_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_attention_math.default,
    aten.silu.default,
    aten.silu_backward.default,
    aten.gelu_backward.default,
    aten.softplus.default,
    aten.mish.default,
    aten.index_copy.default,
    aten.index_add.default,
    aten.index_fill.int_Scalar,
    aten.index_fill.int_Tensor,
)


# Not in the core table, added from torch._decomp: batch norm in eval mode becomes the pointwise
# (x - running_mean) * rsqrt-style scaling with the affine (every node lowered), its statistic outputs empty fulls.
ADDED = (
    aten._native_batch_norm_legit_no_training.default,
    aten._native_batch_norm_legit.default,
)


CIA = torch._C.DispatchKey.CompositeImplicitAutograd


def _overload(qualified_name: str) -> torch._ops.OpOverload:
    """``aten::add.Tensor`` as ``torch.ops.aten.add.Tensor`` (no overload name: ``default``)."""
    namespace, _, name = qualified_name.partition("::")
    packet, _, overload = name.partition(".")
    return getattr(getattr(getattr(torch.ops, namespace), packet), overload or "default")


def _overloads_with_python_cia() -> list[torch._ops.OpOverload]:
    """The overloads made so far whose CIA kernel is registered in Python (``py_impl``), in every namespace."""
    found = []
    for namespace_name in list(torch.ops._dir):
        namespace = getattr(torch.ops, namespace_name)
        if not isinstance(namespace, torch._ops._OpNamespace):
            continue
        for packet_name in list(namespace._dir):
            packet = getattr(namespace, packet_name)
            found += [overload for name in list(packet._dir) if CIA in (overload := getattr(packet, name)).py_kernels]
    return found


def core_aten_table() -> dict:
    """What ``dict(torch._decomp.core_aten_decompositions())`` holds: the core ATen decompositions, and each
    functional CIA op (but those torch preserves) decomposed through its CIA kernel."""
    table = _core_aten_decompositions_post_autograd()
    registered = torch._C._dispatch_get_registrations_for_dispatch_key("CompositeImplicitAutograd")
    for op in [*map(_overload, registered), *_overloads_with_python_cia()]:
        if op not in table and op not in PRESERVED_ATEN_CIA_OPS and _is_preservable_cia_op(op):
            table[op] = _get_decomp_for_cia(op)
    return table


@functools.cache
def _table() -> dict:
    table = core_aten_table()
    table.update({op: torch._decomp.decomposition_table[op] for op in ADDED})
    table.update(foreach_decompositions())
    table.update(transformer_decompositions())
    for op in KEPT_WHOLE:
        table.pop(op, None)
    return table


def decomposition_table() -> dict:
    """A fresh copy of the table (callers may extend it without changing ours)."""
    return dict(_table())

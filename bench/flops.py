"""Benchmark helper: a FLOP counter that counts attention on the CPU.

Our benches take a graph's FLOPs from ``torch.utils.flop_counter.FlopCounterMode``. On the CPU,
``F.scaled_dot_product_attention`` runs ``aten._scaled_dot_product_flash_attention_for_cpu`` (and its backward), for
which torch 2.13's counter has no formula: every attention counted 0 FLOPs, so a roofline built on it left attention's
matmuls out (a Flux block's self-attention is a fifth of its FLOPs). ``flop_counter()`` gives the counter formulas
for those two ops, by torch's own convention for the GPU kernels: two matmuls forward (Q K^T and P V) and four
backward, over the whole score square (causal included). Nothing about what runs changes.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

aten = torch.ops.aten


def attention_flops(query_shape, key_shape, value_shape, *args, **kwargs) -> int:
    """Forward: Q K^T and P V over every query head (key / value heads may be fewer: grouped query attention)."""
    *batch, heads, queries, head_dim = query_shape
    keys, value_dim = key_shape[-2], value_shape[-1]
    rows = heads * queries * int(torch.Size(batch).numel())
    return 2 * rows * keys * head_dim + 2 * rows * keys * value_dim


def attention_backward_flops(grad_shape, query_shape, key_shape, value_shape, *args, **kwargs) -> int:
    """Backward: dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q: twice the forward's matmuls."""
    return 2 * attention_flops(query_shape, key_shape, value_shape)


def flop_counter() -> FlopCounterMode:
    """A quiet FlopCounterMode that also counts the CPU's attention kernels (module docstring)."""
    return FlopCounterMode(display=False, custom_mapping={
        aten._scaled_dot_product_flash_attention_for_cpu: attention_flops,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: attention_backward_flops,
    })

"""Loads the same for every row of a row kernel (a norm's weight and bias) are loaded once per kernel and spread
to the partitions on TensorE (codegen/row_broadcast.py), not repeated to every partition by DMA per row block:
results equal eager's, and the HBM traffic is exactly the inputs and the output."""

from __future__ import annotations

import pytest
import torch

import neuron_compile
from lowering_harness import check_against_eager, random_tensor


def rms_norm(x, weight):
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return weight * (x.float() * torch.rsqrt(variance + 1e-6)).to(x.dtype)


def layer_norm(x, weight, bias):
    return torch.nn.functional.layer_norm(x, x.shape[-1:], weight, bias, 1e-5)


@pytest.mark.parametrize("rows, width, dtype", [(1, 64, torch.float32), (130, 64, torch.float32),
                                                (129, 600, torch.bfloat16), (256, 2048, torch.bfloat16)])
def test_norms_with_a_spread_weight_match_eager(rows, width, dtype):
    x = random_tensor((rows, width), dtype, seed=0)
    weight, bias = random_tensor((width,), dtype, seed=1), random_tensor((width,), dtype, seed=2)
    check_against_eager(rms_norm, x, weight)
    check_against_eager(layer_norm, x, weight, bias)


def test_the_weight_crosses_hbm_once():
    x = random_tensor((256, 2048), torch.bfloat16, seed=0)
    weight = random_tensor((2048,), torch.bfloat16, seed=1)
    neuron_compile.reset_stats()
    check_against_eager(rms_norm, x, weight)
    stats = neuron_compile.stats()
    assert stats["fallback_nodes"] == 0
    # x in, out back, the weight once: a broadcast DMA per row block would add 128 x its bytes per block
    assert stats["hbm_bytes"] == 2 * x.numel() * x.element_size() + weight.numel() * weight.element_size()

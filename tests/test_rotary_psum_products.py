"""A q / k projection with a bias whose products a norm and rotary read in its epilogue (Flux's, kinds/matmul_rotary.py
``reads_results_once``): the bias add reads each product straight from its PSUM accumulator (no copy out of PSUM
first) and writes the rounded bf16 product itself (no rounding copy after it). Against eager over rows 1, 127, 128,
129, 300, fp32 and bf16; a projection that also stores its product, or has no bias, keeps the copy out of PSUM."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from lowering_harness import check_against_eager, random_tensor
from test_rotary_joint import TOLERANCES, cos_sin, head_norm, interleaved_rotary

HEAD_DIM, HEADS, HIDDEN = 64, 2, 32


def biased_single_block(x, wq, bq, wk, bk, q_weight, k_weight, cos, sin):
    """The single block's q and k: one paired projection with biases (``nn.Linear``'s: eager's addmm adds the bias
    before it rounds, as the kernel does), per-head RMSNorms, the interleaved rotary."""
    q = interleaved_rotary(head_norm(F.linear(x, wq, bq), q_weight, HEAD_DIM), cos, sin)
    k = interleaved_rotary(head_norm(F.linear(x, wk, bk), k_weight, HEAD_DIM), cos, sin)
    return q.transpose(1, 2), k.transpose(1, 2)


def also_returning_q(x, wq, bq, wk, bk, q_weight, k_weight, cos, sin):
    """The same, the biased q projection read elsewhere too: it is stored, so the product leaves PSUM first."""
    projected = F.linear(x, wq, bq)
    q = interleaved_rotary(head_norm(projected, q_weight, HEAD_DIM), cos, sin)
    k = interleaved_rotary(head_norm(F.linear(x, wk, bk), k_weight, HEAD_DIM), cos, sin)
    return q.transpose(1, 2), k.transpose(1, 2), projected


def unbiased_single_block(x, wq, bq, wk, bk, q_weight, k_weight, cos, sin):
    """No bias: the rotary's source is the product itself, which leaves PSUM by ScalarE's copy as before."""
    q = interleaved_rotary(head_norm(F.linear(x, wq), q_weight, HEAD_DIM), cos, sin)
    k = interleaved_rotary(head_norm(F.linear(x, wk), k_weight, HEAD_DIM), cos, sin)
    return q.transpose(1, 2), k.transpose(1, 2)


def block_inputs(rows: int, dtype: torch.dtype, heads: int = HEADS, head_dim: int = HEAD_DIM) -> list[torch.Tensor]:
    width = heads * head_dim
    cos, sin = cos_sin(rows, head_dim)
    return [random_tensor((1, rows, HIDDEN), dtype, seed=0),
            random_tensor((width, HIDDEN), dtype, seed=1) / HIDDEN ** 0.5, random_tensor((width,), dtype, seed=2),
            random_tensor((width, HIDDEN), dtype, seed=3) / HIDDEN ** 0.5, random_tensor((width,), dtype, seed=4),
            random_tensor((head_dim,), dtype, seed=5), random_tensor((head_dim,), dtype, seed=6), cos, sin]


def rotary_kernel_lines(region) -> list[str]:
    """The instructions of the region's one fused projection kernel."""
    (source,) = [kernel.source for kernel in region.kernels if kernel.name.startswith("matmul_rotary")]
    return [line.strip() for line in source.splitlines() if line.strip().startswith("nisa.")]


def evacuations(lines: list[str]) -> list[str]:
    return [line for line in lines if "data=accumulator" in line or "data=second_accumulator" in line]


def check_products_read_from_psum(rows: int, dtype: torch.dtype) -> None:
    region = check_against_eager(biased_single_block, *block_inputs(rows, dtype), tolerances=TOLERANCES)
    lines = rotary_kernel_lines(region)
    assert not evacuations(lines), evacuations(lines)
    adds = [line for line in lines if line.startswith("nisa.tensor_tensor(") and "op=nl.add" in line
            and "accumulator[0:rows, 0:cols]" in line]
    assert len(adds) == 2, adds  # q's and k's bias adds, each reading its own accumulator
    assert any("data1=accumulator" in add or "data2=accumulator" in add for add in adds)
    assert any("second_accumulator" in add for add in adds)
    assert not any("engine=nisa.engine.gpsimd" in add for add in adds)  # GpSimd cannot read PSUM
    if dtype == torch.bfloat16:  # each add writes the rounded product: no tensor_copy rounds it after
        assert all(add.startswith("nisa.tensor_tensor(dst=add_bfloat16") for add in adds), adds


@pytest.mark.slow  # a few seconds an example; the smoke tests below are the fast ones
@settings(max_examples=8, deadline=None)
@given(rows=st.sampled_from([1, 127, 128, 129, 300]), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_the_bias_adds_read_the_products_from_psum_and_match_eager(rows, dtype):
    check_products_read_from_psum(rows, dtype)


@pytest.mark.parametrize("rows, dtype", [(129, torch.bfloat16), (1, torch.float32)])
def test_the_bias_adds_read_the_products_from_psum_smoke(rows, dtype):
    check_products_read_from_psum(rows, dtype)


@pytest.mark.parametrize("fn", [also_returning_q, unbiased_single_block])
def test_a_stored_or_unbiased_product_still_leaves_psum_first(fn):
    region = check_against_eager(fn, *block_inputs(129, torch.bfloat16), tolerances=TOLERANCES)
    assert len(evacuations(rotary_kernel_lines(region))) == 2  # ScalarE's copy of each product

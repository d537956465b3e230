"""Where a q / k projection's rotary epilogue (kinds/matmul_rotary.py) spends its engines: each rotary part's last
instruction writes its columns of the assembled heads itself (no ScalarE copy into them after it,
``TileScope.destinations``), and a per-head norm over heads of at least ``SUMMED_GROUP_ELEMENTS`` columns sums each
head's squares on ScalarE as it squares them (one activation per head with ``reduce_res``; no VectorE tensor_reduce).
Against eager over rows 1, 127, 128, 129, 300, fp32 and bf16, Flux's single block form (biased paired projection,
per-head RMSNorm, interleaved rotary) at heads of 64 and 128, and Llama's rotate_half."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from lowering_harness import check_against_eager
from test_rotary_epilogue import rotary_inputs, rotated_projections
from test_rotary_joint import TOLERANCES, head_norm, interleaved_rotary
from test_rotary_psum_products import block_inputs, rotary_kernel_lines

from neuron_compile.kinds.reduction import SUMMED_GROUP_ELEMENTS


def single_block(head_dim: int):
    """Flux's single block up to the scores: one paired q / k projection with biases, per-head RMSNorms, the
    interleaved rotary."""
    def fn(x, wq, bq, wk, bk, q_weight, k_weight, cos, sin):
        q = interleaved_rotary(head_norm(F.linear(x, wq, bq), q_weight, head_dim), cos, sin)
        k = interleaved_rotary(head_norm(F.linear(x, wk, bk), k_weight, head_dim), cos, sin)
        return q.transpose(1, 2), k.transpose(1, 2)

    return fn


def assembled_heads(lines: list[str]) -> set[str]:
    """The tiles the rotated heads are assembled in: what the last DMAs store."""
    return {match for line in lines for match in re.findall(r"src=(\w+_heads_\d+)\[", line)}


def check_parts_write_the_assembled_heads(lines: list[str]) -> None:
    heads = assembled_heads(lines)
    assert heads, lines
    writers = [line for line in lines if any(f"dst={tile}.ap(" in line for tile in heads)]
    # each part's rotation (an add of its two products with cos and sin) is what writes its columns
    assert writers and all(line.startswith("nisa.tensor_tensor(") for line in writers), writers
    assert not any(line.startswith("nisa.activation(") and "op=nl.copy" in line for line in writers), writers


def check_single_block(rows: int, heads: int, head_dim: int, dtype: torch.dtype) -> None:
    region = check_against_eager(single_block(head_dim), *block_inputs(rows, dtype, heads, head_dim),
                                 tolerances=TOLERANCES)
    lines = rotary_kernel_lines(region)
    check_parts_write_the_assembled_heads(lines)
    sums = [line for line in lines if "reduce_res=" in line]
    reduces = [line for line in lines if line.startswith("nisa.tensor_reduce(")]
    if head_dim >= SUMMED_GROUP_ELEMENTS and heads > 1:
        # one ScalarE square-and-sum per head of the N tile, q's and k's; no VectorE reduce of the squares
        assert len(sums) == 2 * heads and not reduces, sums + reduces
        assert all(line.startswith("nisa.activation(") and "op=nl.square" in line for line in sums), sums
    else:
        # shorter heads: the squares summed by one tensor_reduce of the tile (the overhead per head would dominate)
        assert len(reduces) == 2 and not sums, reduces + sums


@pytest.mark.slow  # a few seconds an example; the smoke tests below are the fast ones
@settings(max_examples=12, deadline=None)
@given(rows=st.sampled_from([1, 127, 128, 129, 300]), head_dim=st.sampled_from([64, 128]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_the_single_blocks_epilogue_engines_match_eager(rows, head_dim, dtype):
    check_single_block(rows, 512 // head_dim, head_dim, dtype)


def test_heads_of_128_sum_their_squares_on_scalar_and_match_eager():
    check_single_block(129, 4, 128, torch.bfloat16)


def test_heads_of_64_keep_the_vector_reduce_and_match_eager():
    check_single_block(127, 2, 64, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotate_half_parts_write_the_assembled_heads_and_match_eager(dtype):
    """Llama's rotary (rotate_half, no norm): the same direct writes, fp32 (an add writes fp32 heads) and bf16."""
    region = check_against_eager(rotated_projections(4, 2, 64), *rotary_inputs(129, 4, 2, 64, dtype),
                                 tolerances=TOLERANCES)
    kernels = [kernel for kernel in region.kernels if kernel.name.startswith("matmul_rotary")]
    assert kernels
    for kernel in kernels:
        check_parts_write_the_assembled_heads([line.strip() for line in kernel.source.splitlines()
                                               if line.strip().startswith("nisa.")])

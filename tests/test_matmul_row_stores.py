"""A bf16 / fp16 product stored as it is leaves each row block in one DMA per column group
(kinds/matmul_row_stores.py): the backward's weight gradients ``dy.t() @ x`` and plain projections.

Against eager over M 1, 127, 128, 129, 300, K 1, 129, 256 and N 1024, 1100, 2049 (ragged row blocks and N tiles),
bf16 (fp16 has no lowering), with a batch dim; bit for bit against the per-N-tile stores; the kernel text's one store per row block;
and the cases that keep the per-tile stores: fp32, an epilogue, rows under 2 KiB."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lowering_harness import check_against_eager, compile_and_run, random_tensor

ROW_STORE = re.compile(r"nisa\.dma_copy\(dst=\w+\.ap\(.*src=product_rows\[block\]")


def weight_gradient(dy, x):
    return dy.t() @ x


def _sources(region) -> str:
    return "\n".join(kernel.source for kernel in region.kernels)


def _inputs(m, k, n, dtype):
    return random_tensor((k, m), dtype, seed=0), random_tensor((k, n), dtype, seed=1) / k ** 0.5


@settings(max_examples=10, deadline=None)
@given(m=st.sampled_from([1, 127, 128, 129, 300]), k=st.sampled_from([1, 129, 256]),
       n=st.sampled_from([1024, 1100, 2049]))
def test_row_stores_equal_eager_and_the_per_tile_stores_bit_for_bit(m, k, n):
    inputs = _inputs(m, k, n, torch.bfloat16)
    region = check_against_eager(weight_gradient, *inputs, fp32_reference=True)
    source = _sources(region)
    assert ROW_STORE.search(source) and "product_1" not in source
    _, (row_stored,) = compile_and_run(weight_gradient, *inputs)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("neuron_compile.kinds.matmul.stores_rows", lambda node: False)
        tiled_region, (tile_stored,) = compile_and_run(weight_gradient, *inputs)
    assert not ROW_STORE.search(_sources(tiled_region))
    assert torch.equal(row_stored.view(torch.int16), tile_stored.view(torch.int16))


def test_one_store_per_row_block_and_column_group():
    region = check_against_eager(weight_gradient, *_inputs(300, 256, 2049, torch.bfloat16), fp32_reference=True)
    source = _sources(region)
    assert len(ROW_STORE.findall(source)) == 1  # in the loop over the row group's blocks, after the N tiles
    assert source.count("nisa.dma_copy(dst=matmul") == 1  # no per-tile store left


def test_a_batched_product_stores_rows_per_batch_index():
    a, b = random_tensor((2, 129, 64), torch.bfloat16, seed=0), random_tensor((2, 64, 1100), torch.bfloat16, seed=1)
    region = check_against_eager(torch.bmm, a, b, fp32_reference=True)
    assert ROW_STORE.search(_sources(region))


@pytest.mark.parametrize("fn, dtype, n, reason", [
    (weight_gradient, torch.float32, 2048, "an fp32 product: the store's fixed cost is a smaller share"),
    (lambda dy, x: torch.relu(dy.t() @ x), torch.bfloat16, 2048, "an epilogue"),
    (weight_gradient, torch.bfloat16, 1023, "a row under 2 KiB"),
])
def test_the_per_tile_stores_stay(fn, dtype, n, reason):
    region = check_against_eager(fn, *_inputs(129, 64, n, dtype), fp32_reference=dtype != torch.float32)
    assert not ROW_STORE.search(_sources(region)), reason

"""Embedding backward in kernels: aten.embedding_dense_backward decomposes to an accumulating index_put (the
scatter kind), so the gradient of repeated tokens sums every occurrence, as eager's does."""

import pytest
import torch

import neuron_compile
from neuron_compile.runtime import graph_records


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    neuron_compile.reset_stats()
    graph_records.clear_records()
    yield
    torch._dynamo.reset()


def _gradient(weight, tokens, compiled: bool, padding_idx=None):
    weight = weight.detach().clone().requires_grad_()

    def fn(w, t):
        return (torch.nn.functional.embedding(t, w, padding_idx=padding_idx) * 1.5).square().sum()

    run = torch.compile(fn, backend="neuron", options={"fallback": "raise"}) if compiled else fn
    run(weight, tokens).backward()
    return weight.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padding_idx", [None, 3])
def test_duplicate_tokens_accumulate_in_kernels(dtype, padding_idx):
    torch.manual_seed(0)
    weight = torch.randn(40, 24).to(dtype)
    tokens = torch.tensor([[3, 7, 7, 1, 3, 3], [0, 7, 39, 39, 2, 3]])  # 7 three times, 3 four times
    expected = _gradient(weight, tokens, compiled=False, padding_idx=padding_idx)
    actual = _gradient(weight, tokens, compiled=True, padding_idx=padding_idx)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(actual, expected, **tolerance)
    backward = [record for record in neuron_compile.compiled_records() if record.kind == "backward"]
    assert len(backward) == 1
    report = backward[0].report
    assert [placement.op for placement in report.eager] == []
    region_ops = {placement.op for placement in report.placements if placement.region is not None}
    assert region_ops & {"aten.index_put.default", "aten._unsafe_index_put.default"}, region_ops

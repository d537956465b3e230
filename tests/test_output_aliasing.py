"""Graph outputs alias exactly what eager's alias: kernel-written outputs are ordinary tensors that own a
resizable storage (in-place ops, backward, FSDP2's storage().resize_(0) work on them); views stay views."""

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


def _compiled(fn):
    return torch.compile(fn, backend="neuron", options={"fallback": "raise"})


def test_kernel_output_is_not_a_view_and_takes_in_place_ops():
    def fn(x):
        return (x * 2).sum()

    x = torch.randn(8, 4, requires_grad=True)
    loss = _compiled(fn)(x)
    assert not loss._is_view()
    loss *= 0.5  # the Trainer's ``loss *= loss_scale``: raised "Output 0 of CompiledFunction is a view"
    loss.backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 1.0))
    assert neuron_compile.stats()["kernels_launched"] > 0


def test_in_place_on_outputs_then_backward_matches_eager():
    def fn(x, w):
        y = x @ w + 1  # nothing saved for backward is an output, so eager allows in-place ops on both
        return y, y.sum(-1)

    x, w = torch.randn(6, 5), torch.randn(5, 3)
    results = []
    for run in (fn, _compiled(fn)):
        wg = w.clone().requires_grad_()
        y, s = run(x, wg)
        y.mul_(3)
        s.add_(1)
        (y.sum() + s.sum()).backward()
        results.append((y.detach(), s.detach(), wg.grad))
    for eager, ours in zip(*results):
        torch.testing.assert_close(ours, eager, rtol=1e-4, atol=1e-5)


def test_storage_resize_to_zero_on_an_output():
    out = _compiled(lambda x: torch.exp(x) + 1)(torch.randn(4, 4))
    storage = out.untyped_storage()
    storage.resize_(0)  # what FSDP2 does to free a buffer
    assert storage.nbytes() == 0
    storage.resize_(16 * 4)
    assert storage.nbytes() == 64


def test_outputs_that_alias_each_other_share_storage_as_in_eager():
    def fn(x):
        y = x + 1
        return y, y.t(), y[1:]

    x = torch.randn(4, 3)
    y, yt, tail = _compiled(fn)(x)
    ey, eyt, etail = fn(x)
    for ours, eager in ((y, ey), (yt, eyt), (tail, etail)):
        torch.testing.assert_close(ours, eager, rtol=0, atol=0)
        assert ours.stride() == eager.stride() and ours.storage_offset() == eager.storage_offset()
    assert yt.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()
    y.mul_(2)  # eager's aliases see the write
    torch.testing.assert_close(yt, (ey * 2).t(), rtol=0, atol=0)


def test_view_of_an_input_aliases_the_input():
    def fn(x, b):
        return x.t(), x * b

    x, b = torch.randn(3, 5), torch.randn(5)
    view, product = _compiled(fn)(x, b)
    assert view.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert product.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    view.mul_(0)
    assert bool((x == 0).all())

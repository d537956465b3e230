"""aten.native_dropout in kernels: the keep rate, eager's scaling of the kept values by the returned mask, the
backward reading the forward's mask, the p = 0 / p = 1 / eval cases, fresh masks per call and repeats under
torch.manual_seed. Eager's random stream cannot be matched, so the statistics are checked, not the values."""

from __future__ import annotations

import pytest
import torch

from lowering_harness import check_against_eager, compile_and_run, compile_with_backend, random_tensor

aten = torch.ops.aten
SHAPE = (129, 300)  # ragged: two partition tiles, the second one row


def _dropout(p, train=True):
    return lambda x: aten.native_dropout(x, p, train)


def _within(kept: float, p: float, n: int) -> bool:
    """A keep fraction within 5 standard errors of 1 - p."""
    return abs(kept - (1 - p)) < 5 * (p * (1 - p) / n) ** 0.5


@pytest.mark.parametrize("p,dtype", [(0.1, torch.float32), (0.5, torch.float32), (0.8, torch.bfloat16)])
def test_keep_rate_and_output_is_input_times_mask_over_keep_probability(p, dtype):
    x = random_tensor(SHAPE, dtype)
    region, (out, mask) = compile_and_run(_dropout(p), x)
    assert mask.dtype == torch.bool and out.dtype == dtype and mask.shape == out.shape == x.shape
    assert _within(mask.float().mean().item(), p, mask.numel())
    # eager's formula, x.mul(mask).mul_(scale), with the mask the kernel returned: equal, not close
    assert torch.equal(out, x.mul(mask).mul_(1 / (1 - p)))
    # every row and column draws: no tile repeats another's mask
    assert len({bytes(row.numpy()) for row in mask[:128]}) == 128
    rows = mask[:128].float().mean(dim=1)
    assert _within(rows.mean().item(), p, 128 * SHAPE[1]) and rows.std() < 5 * (p * (1 - p) / SHAPE[1]) ** 0.5


def test_every_call_draws_a_new_mask_and_manual_seed_repeats_it():
    x = random_tensor((64, 96))
    region, _ = compile_and_run(_dropout(0.5), x)
    torch.manual_seed(1234)
    first = region(x)[1]
    second = region(x)[1]
    torch.manual_seed(1234)
    again = region(x)[1]
    assert torch.equal(first, again)
    assert (first != second).float().mean() > 0.3  # independent masks differ in half the places


@pytest.mark.parametrize("p,train", [(0.0, True), (1.0, True), (0.3, False)])
def test_p_zero_p_one_and_eval_equal_eager(p, train):
    x = random_tensor((33, 70))
    x[0, :3] = torch.tensor([float("inf"), float("nan"), -0.0])  # p = 1 gives eager's nan for inf * 0
    region = check_against_eager(_dropout(p, train), x)
    assert "random_seeds" not in region.buffers  # nothing is drawn


def test_random_draw_is_not_fused_into_a_kernel_that_could_recompute_it():
    x = random_tensor((16, 256))
    region, (out,) = compile_and_run(lambda t: (torch.softmax(aten.native_dropout(t, 0.5, True)[0], -1),), x)
    assert any("draws random numbers" in decision for decision in region.fusion_decisions)
    torch.testing.assert_close(out.sum(-1), torch.ones(16))


class _DropoutBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(48, 48)
        self.drop = torch.nn.Dropout(0.25)

    def forward(self, x):
        return self.drop(self.linear(x))


def test_backward_uses_the_forward_mask_through_the_backend():
    torch.manual_seed(0)
    model = _DropoutBlock().train()
    x = torch.randn(40, 48, requires_grad=True)
    out, stats = compile_with_backend(model, x)
    assert stats["fallback_nodes"] == 0, stats["fallback_reasons"]
    hidden = model.linear(x).detach()
    mask = out.detach() != 0
    assert _within(mask.float().mean().item(), 0.25, mask.numel())
    torch.testing.assert_close(out.detach(), hidden * mask / 0.75, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected = (grad * mask / 0.75) @ model.linear.weight.detach()
    torch.testing.assert_close(x.grad, expected, rtol=1e-5, atol=1e-5)


def _attention_with_mask(q, k, v, keep, p):
    """Eager's math form of causal SDPA with dropout, given the keep mask."""
    scores = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
    causal = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
    probabilities = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1)
    return (probabilities * keep / (1 - p)) @ v


def test_attention_dropout_forward_and_backward_share_one_mask():
    """SDPA with dropout_p > 0 decomposes to scores, softmax, dropout and the product, all in kernels. With v the
    identity the output is the dropped, rescaled probabilities, which reveals the mask the forward drew; eager's
    math with that mask then gives the same output and the same gradients of q, k and v."""
    p, n = 0.3, 32
    generator = torch.Generator().manual_seed(3)
    q, k = (torch.randn(1, 2, n, n, generator=generator, requires_grad=True) for _ in range(2))
    v = torch.eye(n).expand(1, 2, n, n).clone().requires_grad_(True)
    attention = torch.nn.functional.scaled_dot_product_attention
    out, stats = compile_with_backend(lambda *t: attention(*t, dropout_p=p, is_causal=True), q, k, v)
    assert stats["fallback_nodes"] == 0, stats["fallback_reasons"]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    keep = out.detach() != 0
    assert not keep[..., ~causal].any()
    assert _within(keep[..., causal].float().mean().item(), p, keep[..., causal].numel())
    grad = torch.randn(out.shape, generator=generator)
    out.backward(grad)
    compiled_grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    expected = _attention_with_mask(q, k, v, keep, p)
    torch.testing.assert_close(out.detach(), expected.detach(), rtol=1e-5, atol=1e-5)
    expected.backward(grad)
    for got, t in zip(compiled_grads, (q, k, v)):
        torch.testing.assert_close(got, t.grad, rtol=1e-5, atol=1e-5)

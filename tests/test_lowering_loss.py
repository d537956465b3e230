"""nll_loss forward and backward (and so cross_entropy) vs eager: reductions, weights, ignore_index, bf16, one
sample, a training step's gradients, and out-of-range targets raising as eager does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from lowering_harness import check_through_backend, compile_with_backend, random_tensor

import neuron_compile


def _targets(rows, classes, seed=0):
    targets = torch.randint(0, classes, (rows,), generator=torch.Generator().manual_seed(seed))
    targets[::5] = -100  # ignored
    return targets


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_and_weighted_nll_loss(reduction, dtype):
    x = random_tensor((130, 600), dtype=dtype, seed=1, low=-4, high=4)
    targets, weight = _targets(130, 600), torch.rand(600).to(dtype)
    check_through_backend(lambda a, t: F.cross_entropy(a, t, reduction=reduction), x, targets)
    check_through_backend(lambda a, t, w: F.nll_loss(a, t, weight=w, reduction=reduction), x, targets, weight)
    check_through_backend(lambda a, t: F.nll_loss(a, t, reduction=reduction, ignore_index=3), x, targets.clamp(0))


def test_one_sample_and_every_target_ignored():
    x = random_tensor((9,), seed=2)
    check_through_backend(lambda a, t: F.cross_entropy(a, t), x, torch.tensor(4))
    check_through_backend(lambda a, t: F.cross_entropy(a, t, reduction="none"), x, torch.tensor(8))
    # mean over no counted sample is 0 / 0 = nan, as eager gives
    check_through_backend(lambda a, t: F.cross_entropy(a, t), random_tensor((4, 3)), torch.full((4,), -100))


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_training_step_gradients_match_eager(reduction):
    x = random_tensor((130, 50), seed=3, low=-3, high=3)
    targets, weight = _targets(130, 50, seed=4), torch.rand(50)

    def step(logits, t, w):
        loss = F.cross_entropy(logits, t, weight=w, reduction=reduction)
        return loss.sum() if reduction == "none" else loss

    compiled_input, eager_input = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch._dynamo.reset()
    neuron_compile.reset_stats()
    with neuron_compile.config.patch(fallback="raise"):
        loss = torch.compile(step, backend="neuron")(compiled_input, targets, weight)
        loss.backward()
    assert neuron_compile.stats()["fallback_nodes"] == 0, neuron_compile.stats()["fallback_reasons"]
    expected = step(eager_input, targets, weight)
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(compiled_input.grad, eager_input.grad, rtol=1e-5, atol=1e-6)


def test_out_of_range_targets_raise_like_eager():
    x = random_tensor((6, 4), seed=5)
    for bad in (4, -1, 2**31 - 1):
        targets = torch.tensor([0, 1, bad, 3, 2, 1])
        with pytest.raises(Exception) as eager_error:
            F.cross_entropy(x, targets)
        torch._dynamo.reset()
        with pytest.raises(type(eager_error.value)):
            torch.compile(lambda a, t: F.cross_entropy(a, t), backend="neuron",
                          options={"fallback": "silent"})(x, targets)


def test_declined_shapes_keep_a_reason():
    images = random_tensor((2, 3, 4, 4))  # [N, C, H, W]: nll_loss2d, not this lowering
    _, stats = compile_with_backend(lambda a, t: F.nll_loss(a.flatten(2)[..., 0], t), images, torch.tensor([0, 2]))
    assert stats["fallback_nodes"] == 0
    _, stats = compile_with_backend(lambda a, t: F.nll_loss(a, t), images.double()[:, :, 0, 0], torch.tensor([0, 2]))
    assert any("dtype" in reason for reason in stats["fallback_reasons"]), stats["fallback_reasons"]


def test_the_picked_log_probabilities_are_gathered_128_rows_per_tile():
    """nll_loss picks one element per row of a [rows, 1] domain: the rows go on partitions (one indirect DMA per
    128 rows), not one element per tile and loop iteration (173 us of a tiny Llama's 301 us forward estimate)."""
    x, targets = random_tensor((300, 10), seed=5, low=-4, high=4), _targets(300, 10, seed=5)
    check_through_backend(lambda a, t: F.cross_entropy(a, t, reduction="none"), x, targets)
    record = neuron_compile.last_compiled()
    (gather,) = [kernel.source for kernel in record.kernels if kernel.name.startswith("gather_kernel")]
    assert "outer [1/1] partition 300/128 free [1/1]" in gather

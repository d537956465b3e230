"""A backward that recomputes cos and sin from the angles its forward saved (aot_autograd's partitioner saves a
rotary embedding's angles, [seq, head_dim], and recomputes cos and sin from them): the angles' call-time float
guard (passes/input_ranges.py, up to ``GUARDED_FLOAT_NUMEL`` elements) bounds them, so the backward takes a
Cody-Waite reduction (lowering/trigonometry.py ``bounded_form``: piece by piece up to ``CODY_WAITE_LIMIT``, with a
summed tail up to ``POSITION_LIMIT``): gradients match eager with angles within each limit, at it and just past the
first, and with angles no guard bounds (where the full reduction is kept)."""

from __future__ import annotations

import pytest
import torch

import neuron_compile
from lowering_harness import TOLERANCES
from neuron_compile.lowering import trigonometry
from neuron_compile.passes.input_ranges import FLOAT_GUARD_MAX, GUARDED_FLOAT_NUMEL, guard_float_bound

# The full reduction scales |x| by 2**-64 first (lowering/trigonometry.py ``quarter_turns``); Cody-Waite does not.
PAYNE_HANEK_SCALE = repr(2.0**-trigonometry.SCALE_EXPONENT)
HEAD_DIM = 64


def rotary_loss(x, inv_freq, positions):
    angles = positions[:, None].float() * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return (x * angles.cos() + x.flip(-1) * angles.sin()).square().sum()


def _backward_sources(top: int, seq: int = 128) -> list[str]:
    """The backward's kernel texts for positions 0 .. ``top`` (``seq`` of them); its gradient checked against eager's."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    positions = (torch.arange(seq, dtype=torch.float64) * (top / (seq - 1))).round().long()
    x = torch.randn(seq, HEAD_DIM, generator=torch.Generator().manual_seed(0), requires_grad=True)
    eager_x = x.detach().clone().requires_grad_(True)
    rotary_loss(eager_x, inv_freq, positions).backward()
    loss = torch.compile(rotary_loss, backend="neuron")(x, inv_freq, positions)
    with neuron_compile.record_launches() as launches:
        loss.backward()
    rtol, atol = TOLERANCES[torch.float32]
    torch.testing.assert_close(x.grad, eager_x.grad, rtol=rtol, atol=atol)
    sources = [launch.source.source for launch in launches if launch.source is not None]
    assert sources and any("nl.sin" in source for source in sources)
    return sources


@pytest.mark.parametrize("top", [127, int(trigonometry.CODY_WAITE_LIMIT), int(trigonometry.CODY_WAITE_LIMIT) + 1,
                                 int(trigonometry.POSITION_LIMIT)])
def test_saved_angles_within_the_limit_take_the_cheap_reduction(top):
    # 4097 is in the guard's class 2**13, past CODY_WAITE_LIMIT = 2**12: the summed tail's; 2**20 its limit
    assert HEAD_DIM * 128 > 4096  # more than the integer guard's limit: the float guard's own limit applies
    assert not any(PAYNE_HANEK_SCALE in source for source in _backward_sources(top))


def test_unbounded_angles_keep_the_full_reduction():
    # past FLOAT_GUARD_MAX no class holds the angles (the positions leave the integer guard too)
    assert any(PAYNE_HANEK_SCALE in source for source in _backward_sources(int(FLOAT_GUARD_MAX) * 2))


def test_the_float_guard_checks_up_to_its_own_limit():
    assert guard_float_bound(torch.full((GUARDED_FLOAT_NUMEL,), 255.0)).high == 256.0
    assert guard_float_bound(torch.zeros(GUARDED_FLOAT_NUMEL + 1)) is None  # too large to check per call

"""A forward's proved bounds carried to its backward (runtime/proved_bounds.py, passes/input_ranges.py
``proved_output_bounds``): the rotary angles a forward saves, positions from an ``arange`` times guarded
frequencies, reach the backward tagged with their class, so its float guard reads no values and its cos and sin
take the cheap reduction, with gradients equal to eager's; a tag holds only on the same tensor at the same version
(an in-place edit drops it, and the guard reads the values again); a proof looser than the values (positions that
are an integer input) tags nothing, and the values are read as before."""

from __future__ import annotations

import pytest
import torch

import neuron_compile
from lowering_harness import TOLERANCES
from neuron_compile.lowering import trigonometry
from neuron_compile.passes import input_ranges
from neuron_compile.runtime import proved_bounds

HEAD_DIM = 64
PAYNE_HANEK_SCALE = repr(2.0**-trigonometry.SCALE_EXPONENT)  # only the full argument reduction writes it
INV_FREQ = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))


def rotary_loss(x, inv_freq):
    positions = torch.arange(x.shape[0], device=x.device)
    angles = positions[:, None].float() * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return (x * angles.cos() + x.flip(-1) * angles.sin()).square().sum()


def rotary_loss_of_positions(x, inv_freq, positions):
    angles = torch.cat([positions[:, None].float() * inv_freq[None, :]] * 2, dim=-1)
    return (x * angles.cos() + x.flip(-1) * angles.sin()).square().sum()


@pytest.fixture
def value_reads(monkeypatch) -> list[tuple[int, ...]]:
    """The shapes of the tensors the float and integer guards read values of (their aminmax), in order."""
    reads, aminmax = [], torch.aminmax

    def spied(tensor, *args, **kwargs):
        reads.append(tuple(tensor.shape))
        return aminmax(tensor, *args, **kwargs)

    monkeypatch.setattr(input_ranges.torch, "aminmax", spied)
    return reads


def _steps(fn, seq: int, reads: list, *extra) -> list[list[tuple[int, ...]]]:
    """The value reads of each of three backward calls of ``fn`` compiled, gradients checked against eager's; the
    backward's cos and sin take the cheap argument reduction."""
    compiled, per_backward = torch.compile(fn, backend="neuron"), []
    for seed in range(3):
        x = torch.randn(seq, HEAD_DIM, generator=torch.Generator().manual_seed(seed), requires_grad=True)
        eager_x = x.detach().clone().requires_grad_(True)
        fn(eager_x, INV_FREQ, *extra).backward()
        loss = compiled(x, INV_FREQ, *extra)
        reads.clear()
        with neuron_compile.record_launches() as launches:
            loss.backward()
        per_backward.append(list(reads))
        assert not any(PAYNE_HANEK_SCALE in launch.source.source for launch in launches if launch.source is not None)
        rtol, atol = TOLERANCES[torch.float32]
        torch.testing.assert_close(x.grad, eager_x.grad, rtol=rtol, atol=atol)
    return per_backward


@pytest.mark.parametrize("seq", [1, 127, 129, 256])
def test_the_saved_angles_reach_the_backward_with_their_bound(seq, value_reads):
    assert _steps(rotary_loss, seq, value_reads) == [[], [], []]


def test_without_tags_the_backward_reads_the_angles(value_reads, monkeypatch):
    monkeypatch.setattr(proved_bounds, "bound_of", lambda tensor: None)
    assert all((256, HEAD_DIM) in reads for reads in _steps(rotary_loss, 256, value_reads))


def test_a_proof_looser_than_the_values_tags_nothing(value_reads):
    # positions that are an input are proved within the integer guard's +-2**20 only: the values are read
    positions = torch.arange(128)
    steps = _steps(rotary_loss_of_positions, 128, value_reads, positions)
    assert all((128, HEAD_DIM) in reads for reads in steps)


def test_a_tag_holds_on_the_same_tensor_at_the_same_version(value_reads):
    angles = torch.arange(256.0)
    bound = input_ranges.FLOAT_BOUNDS[8]
    proved_bounds.tag(angles, bound)
    assert input_ranges.float_values_bound(angles) is bound and value_reads == []
    assert proved_bounds.bound_of(angles.clone()) is None  # another tensor with the same values
    angles.mul_(100.0)  # an in-place edit: a new version, the bound dropped, the values read again
    assert proved_bounds.bound_of(angles) is None
    assert input_ranges.float_values_bound(angles) is input_ranges.FLOAT_BOUNDS[15] and value_reads == [(256,)]
    before = proved_bounds.tagged()
    del angles
    assert proved_bounds.tagged() == before - 1  # the tag dies with its tensor


def test_only_classes_the_lowering_does_not_tell_apart_are_tagged():
    assert input_ranges.TAGGED_BOUND_MAX == trigonometry.CODY_WAITE_LIMIT

"""Rotary epilogues of heads whose width does not divide 512 (Phi-3's heads of 96, heads of 80): the projection's
planner takes N tiles of whole heads (kinds/matmul.py ``moving_tile_widths``: 480 columns of heads of 96, where a
512-column tile would cut one), so the rotary runs in its epilogue (kinds/matmul_rotary.py). Against eager, bit for
bit against the concat kernels it replaces, and the tiles the plan takes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowering_harness import compile_and_run, trace
from neuron_compile import ir, kinds
from neuron_compile.hardware import get_target
from neuron_compile.kinds.matmul import moving_tile_widths
from neuron_compile.lowering import lower_graph
from neuron_compile.passes import fusion
from neuron_compile.passes.fusion import fuse
from test_rotary_epilogue import check_rotated_in_projections, rotary_inputs, rotated_projections

TRN2 = get_target("trn2")


def test_the_moving_tiles_narrow_to_whole_units():
    assert moving_tile_widths(3072, TRN2) == [512, 256, 128]
    assert moving_tile_widths(3072, TRN2, 64) == [512, 256, 128]  # a unit dividing 128 changes nothing
    assert moving_tile_widths(3072, TRN2, 96) == [480, 192, 96]
    assert moving_tile_widths(560, TRN2, 80) == [480, 240, 80]
    assert moving_tile_widths(192, TRN2, 96) == [192, 96]
    assert moving_tile_widths(1024, TRN2, 256) == [512, 256]
    assert moving_tile_widths(1280, TRN2, 640) == []  # no tile holds one


def rotary_tiles(fn, inputs) -> list[int]:
    """The N tile of each projection rotating its heads."""
    lowered = lower_graph(trace(fn, *inputs))
    kernels = fuse(lowered.nodes, {value.buffer for value in lowered.outputs}, target=TRN2).kernels
    rotating = [kernel for kernel in kernels if isinstance(kernel, ir.MatMulRotary)]
    return [kinds.kind_of(kernel).plan(kernel, TRN2).free[0].tile for kernel in rotating]


@pytest.mark.slow  # ~3 s an example; the Phi-3-mini and bit-for-bit tests below are the fast smoke tests
@settings(max_examples=8, deadline=None)
@given(seq=st.sampled_from([1, 127, 128, 129, 300]), head_dim=st.sampled_from([96, 80]),
       heads=st.sampled_from([1, 5, 7, 12]), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_heads_that_512_would_cut_rotate_in_the_projections_and_match_eager(seq, head_dim, heads, dtype):
    """Heads of 96 and 80 in N tiles of 480 (a ragged last tile of whole heads past 6 of 80 or 5 of 96)."""
    check_rotated_in_projections(seq, heads, 2, head_dim, dtype, first_position=11)


def test_phi3_minis_projection_rotates_in_tiles_of_five_heads():
    """32 heads of 96 for q and k (Phi-3-mini's 3072 columns each): tiles of 480 columns, the rotaries in the
    projections, against eager."""
    check_rotated_in_projections(129, 32, 32, 96, torch.bfloat16)
    tiles = rotary_tiles(rotated_projections(32, 32, 96), rotary_inputs(129, 32, 32, 96, torch.bfloat16))
    assert tiles and all(tile == 480 for tile in tiles), tiles


@pytest.mark.parametrize("seq, heads, kv_heads, head_dim, dtype", [
    (129, 8, 2, 96, torch.float32), (300, 7, 3, 80, torch.bfloat16)])
def test_whole_head_tiles_give_the_separate_rotary(monkeypatch, seq, heads, kv_heads, head_dim, dtype):
    """Bit for bit: the same instructions on the same values as the concat kernels."""
    fn, inputs = rotated_projections(heads, kv_heads, head_dim), rotary_inputs(seq, heads, kv_heads, head_dim, dtype)
    region, fused = compile_and_run(fn, *inputs)
    assert sum(decision.endswith("(a rotary): fused") for decision in region.fusion_decisions) == 2
    monkeypatch.setattr(fusion, "fold_rotary_epilogues", lambda kernels, *args: (kernels, args[-1]))
    region, apart = compile_and_run(fn, *inputs)
    assert not any("(a rotary): " in decision for decision in region.fusion_decisions)
    assert all(torch.equal(one, other) for one, other in zip(fused, apart, strict=True))

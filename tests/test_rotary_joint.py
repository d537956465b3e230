"""Flux's q / k norms and rotaries in the projections' epilogue: an interleaved rotary (``apply_rotary_emb(...,
use_real_unbind_dim=-1)``: pairs (x[2i], x[2i+1]) rotate, cos and sin [seq, head_dim] repeat-interleaved) after a
per-head RMSNorm, on both products of a paired q / k projection (the single block), and on joint rows ``cat([text,
image], 1)`` assembled in place, one slice per projection with cos and sin at its row offset (the double block;
passes/rotary_rows.py). Against eager; layouts the epilogue refuses keep their kernels and say why."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowering_harness import check_against_eager, random_tensor, trace
from neuron_compile import ir
from neuron_compile.hardware import get_target
from neuron_compile.lowering import lower_graph
from neuron_compile.passes.concat_in_place import MIN_RUN_BYTES
from neuron_compile.passes.fusion import fuse

TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2)}


def interleaved_rotary(x, cos, sin):
    """diffusers' ``apply_rotary_emb(x, (cos, sin), sequence_dim=1)`` (x [batch, seq, heads, head_dim])."""
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    real, imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(3)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def head_norm(x, weight, head_dim):
    """Flux's q / k RMSNorm over each head of ``x`` [batch, seq, heads * head_dim]."""
    x = x.unflatten(-1, (-1, head_dim))
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(variance + 1e-6) * weight.float()).to(x.dtype)


def cos_sin(rows: int, head_dim: int):
    """Flux's rotary angles for ``rows`` positions, fp32, each frequency repeated for its pair's two columns."""
    positions = torch.arange(rows, dtype=torch.float32)[:, None] * 0.37 + 3.0
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = (positions * inv_freq).repeat_interleave(2, dim=-1)
    return angles.cos(), angles.sin()


def single_block(head_dim: int):
    """The single block's attention up to the scores: q and k of one paired projection, normed, rotated."""
    def fn(x, wq, wk, q_weight, k_weight, cos, sin):
        q = interleaved_rotary(head_norm(x @ wq, q_weight, head_dim), cos, sin)
        k = interleaved_rotary(head_norm(x @ wk, k_weight, head_dim), cos, sin)
        return q.transpose(1, 2), k.transpose(1, 2)

    return fn


def double_block(head_dim: int):
    """The double block's: text and image q and k projected apart, normed, joined (text rows first), rotated."""
    def fn(text, image, wq, wk, wq_text, wk_text, q_weight, k_weight, cos, sin):
        def joint(w_text, w_image, weight):
            return torch.cat([head_norm(text @ w_text, weight, head_dim), head_norm(image @ w_image, weight, head_dim)],
                             dim=1)

        q = interleaved_rotary(joint(wq_text, wq, q_weight), cos, sin)
        k = interleaved_rotary(joint(wk_text, wk, k_weight), cos, sin)
        return q.transpose(1, 2), k.transpose(1, 2)

    return fn


def _weights(hidden, width, dtype, seed):
    return random_tensor((hidden, width), dtype, seed=seed) / hidden ** 0.5


def _rotary_decisions(region) -> list[str]:
    return [decision for decision in region.fusion_decisions
            if "(a rotary): " in decision and "concat, not" not in decision]


def _split_decisions(region) -> list[str]:
    return [decision for decision in region.fusion_decisions if "split by its joint rows" in decision]


def _fused_kernels(fn, *inputs, in_place=True) -> list:
    """The region's kernels as IR (the compiled region keeps their sources only), fused as one launch does."""
    lowered = lower_graph(trace(fn, *inputs))
    return fuse(lowered.nodes, {value.buffer for value in lowered.outputs}, target=get_target("trn2"),
                in_place=in_place).kernels


def _kernel_names(region) -> list[str]:
    return [kernel.name for kernel in region.kernels]


def _rotary_counts(kernels) -> list[int]:
    """How many rotaries each projection rotating its heads computes; no concat or reduction kernel is left."""
    assert not any(isinstance(kernel, (ir.Concat, ir.Reduction)) for kernel in kernels)
    return [len(kernel.rotaries) for kernel in kernels if isinstance(kernel, ir.MatMulRotary)]


def check_single_block(rows, head_dim, heads, dtype):
    hidden, width = 32, heads * head_dim
    cos, sin = cos_sin(rows, head_dim)
    inputs = [random_tensor((1, rows, hidden), dtype, seed=0), _weights(hidden, width, dtype, 1),
              _weights(hidden, width, dtype, 2), random_tensor((head_dim,), dtype, seed=3),
              random_tensor((head_dim,), dtype, seed=4), cos, sin]
    region = check_against_eager(single_block(head_dim), *inputs, tolerances=TOLERANCES)
    decisions = _rotary_decisions(region)
    assert len(decisions) == 2 and all(decision.endswith(": fused") for decision in decisions), decisions
    assert _rotary_counts(_fused_kernels(single_block(head_dim), *inputs)) == [2]  # q's and k's, paired


@pytest.mark.slow  # ~20 s an example; the smoke tests below are the fast ones
@settings(max_examples=6, deadline=None)
@given(rows=st.sampled_from([1, 127, 128, 129, 300]), head_dim=st.sampled_from([64, 128]),
       heads=st.sampled_from([1, 2, 4]), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_the_single_blocks_norms_and_rotaries_in_the_projection_match_eager(rows, head_dim, heads, dtype):
    check_single_block(rows, head_dim, heads, dtype)


def test_the_single_blocks_norms_and_rotaries_in_the_projection_smoke():
    check_single_block(129, 64, 2, torch.bfloat16)


def check_double_block(rows, head_dim, dtype):
    """Ragged text / image splits: each projection rotates its rows of the joint buffer, with cos and sin at its
    row offset."""
    text_rows, image_rows = rows
    hidden, width = 32, 2 * head_dim
    cos, sin = cos_sin(text_rows + image_rows, head_dim)
    inputs = [random_tensor((1, text_rows, hidden), dtype, seed=0), random_tensor((1, image_rows, hidden), dtype,
                                                                                 seed=1),
              *(_weights(hidden, width, dtype, seed) for seed in (2, 3, 4, 5)),
              random_tensor((head_dim,), dtype, seed=6), random_tensor((head_dim,), dtype, seed=7), cos, sin]
    region = check_against_eager(double_block(head_dim), *inputs, tolerances=TOLERANCES)
    if min(rows) * width * dtype.itemsize < MIN_RUN_BYTES:
        # a side whose rows are one run under MIN_RUN_BYTES keeps the joint rows a concat kernel (stop 34's rule):
        # nothing is assembled in place, so nothing is split; the result is eager's all the same
        assert not _split_decisions(region) and any(name.startswith("concat") for name in _kernel_names(region))
        return
    assert len(_split_decisions(region)) == 2 and all(": yes" in decision for decision in _split_decisions(region))
    decisions = _rotary_decisions(region)
    assert len(decisions) == 4 and all(decision.endswith(": fused") for decision in decisions), decisions
    assert _rotary_counts(_fused_kernels(double_block(head_dim), *inputs)) == [2, 2]  # text's, image's


@pytest.mark.slow  # ~20 s an example
@settings(max_examples=6, deadline=None)
@given(rows=st.sampled_from([(1, 128), (127, 129), (129, 300), (128, 1), (64, 127)]),
       head_dim=st.sampled_from([64, 128]), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_the_double_blocks_joint_rotaries_in_both_projections_match_eager(rows, head_dim, dtype):
    check_double_block(rows, head_dim, dtype)


def test_the_double_blocks_joint_rotaries_smoke():
    check_double_block((3, 130), 64, torch.float32)


def test_a_single_bf16_text_row_keeps_the_joint_rows_a_concat():
    """One text row of 128 bf16 columns is a 256-byte run: the joint rows stay a concat kernel, not split."""
    check_double_block((1, 128), 64, torch.bfloat16)


def test_heads_of_96_keep_their_norm_and_rotary_kernels_and_say_why():
    """16 heads of 96: the projections' 1536 columns are no whole number of N tiles of whole heads (480 columns),
    which the per-head norm needs: the joint rotary is split, its slices refused with the reason, and the rotary
    stays one kernel (against eager all the same)."""
    head_dim, text_rows, image_rows = 96, 5, 12
    cos, sin = cos_sin(text_rows + image_rows, head_dim)
    inputs = [random_tensor((1, text_rows, 32), seed=0), random_tensor((1, image_rows, 32), seed=1),
              *(_weights(32, 16 * head_dim, torch.float32, seed) for seed in (2, 3, 4, 5)),
              random_tensor((head_dim,), seed=6), random_tensor((head_dim,), seed=7), cos, sin]
    region = check_against_eager(double_block(head_dim), *inputs, tolerances=TOLERANCES)
    assert _split_decisions(region) and all(": no, " in decision for decision in _split_decisions(region))
    assert any("N=1536 is not a whole number of 480-column tiles" in decision for decision in _rotary_decisions(region))
    assert sum(name.startswith("concat") for name in _kernel_names(region)) == 2
    assert not any(name.startswith("matmul_rotary") for name in _kernel_names(region))


def test_joint_rows_of_a_graph_input_are_not_split():
    """The text rows come in as they are (not a kernel's output): the joint buffer is a concat kernel of its own
    (not assembled in place), so the rotary is not split and reads it whole."""
    head_dim, text_rows, image_rows = 64, 3, 9

    def fn(text_q, image, wq, weight, cos, sin):
        return interleaved_rotary(torch.cat([text_q, head_norm(image @ wq, weight, head_dim)], dim=1), cos, sin)

    cos, sin = cos_sin(text_rows + image_rows, head_dim)
    inputs = [random_tensor((1, text_rows, 2, head_dim), seed=0), random_tensor((1, image_rows, 32), seed=1),
              _weights(32, 2 * head_dim, torch.float32, 2), random_tensor((head_dim,), seed=3), cos, sin]
    region = check_against_eager(fn, *inputs, tolerances=TOLERANCES)
    assert not _split_decisions(region)
    assert any(name.startswith("concat") for name in _kernel_names(region))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_launched_kernel_by_kernel_the_joint_rotary_stays(dtype):
    """Kernel by kernel, each kernel returns its outputs whole: nothing is assembled in place or split."""
    from neuron_compile import config

    head_dim, text_rows, image_rows = 64, 3, 9
    cos, sin = cos_sin(text_rows + image_rows, head_dim)
    inputs = [random_tensor((1, text_rows, 32), dtype, seed=0), random_tensor((1, image_rows, 32), dtype, seed=1),
              *(_weights(32, 2 * head_dim, dtype, seed) for seed in (2, 3, 4, 5)),
              random_tensor((head_dim,), dtype, seed=6), random_tensor((head_dim,), dtype, seed=7), cos, sin]
    with config.patch(launch_unit="kernel"):
        region = check_against_eager(double_block(head_dim), *inputs, tolerances=TOLERANCES)
    assert not _split_decisions(region)
    assert sum(name.startswith("concat") for name in _kernel_names(region)) >= 2  # the joint buffers, the rotaries


@settings(max_examples=15, deadline=None)
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3), data=st.data())
def test_a_layouts_extent_holds_every_element_it_touches(shape, data):
    """``Layout.extent`` (the element range a store or load may touch, which decides whose rows a kernel reads)
    against every address, negative strides included."""
    import itertools

    strides = [data.draw(st.integers(-6, 6)) for _ in shape]
    offset = data.draw(st.integers(30, 40))
    addresses = [offset + sum(i * s for i, s in zip(index, strides))
                 for index in itertools.product(*(range(size) for size in shape))]
    assert ir.Layout(tuple(shape), tuple(strides), offset).extent() == (min(addresses), max(addresses) + 1)

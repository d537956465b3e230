"""A concatenation assembled in place (passes/concat_in_place.py): its inputs' writers store into its output."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import neuron_compile
from lowering_harness import check_against_eager, random_tensor
from neuron_compile import ir
from neuron_compile.passes.concat_in_place import restated_in

SDPA = torch.nn.functional.scaled_dot_product_attention


def gather(flat: np.ndarray, layout: ir.Layout) -> np.ndarray:
    index = np.full(layout.shape, layout.offset)
    for dim, stride in enumerate(layout.strides):
        shape = [1] * len(layout.shape)
        shape[dim] = layout.shape[dim]
        index = index + np.arange(layout.shape[dim]).reshape(shape) * stride
    return flat[index]


@st.composite
def placements(draw):
    """(shape of a contiguous buffer, ``view``: where a larger buffer holds it, ``layout``: a permuted, sliced and
    stepped view of the buffer, a read or store of it)."""
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    margins = [draw(st.integers(0, 3)) for _ in shape]
    outer = tuple(size + margin for size, margin in zip(shape, margins))
    starts = [draw(st.integers(0, margin)) for margin in margins]
    outer_strides = ir.contiguous_strides(outer)
    view = ir.Layout(shape, outer_strides, sum(a * s for a, s in zip(starts, outer_strides)))
    strides = ir.contiguous_strides(shape)
    firsts = [draw(st.integers(0, size - 1)) for size in shape]
    steps = [draw(st.integers(1, 2)) for _ in shape]
    counts = [draw(st.integers(1, max(1, (size - first + step - 1) // step)))
              for size, first, step in zip(shape, firsts, steps)]
    order = draw(st.permutations(range(len(shape))))
    layout = ir.Layout(tuple(counts[d] for d in order), tuple(steps[d] * strides[d] for d in order),
                       sum(f * s for f, s in zip(firsts, strides)))
    return shape, outer, view, layout


@settings(max_examples=80, deadline=None)
@given(case=placements())
def test_a_restated_layout_reaches_the_same_elements_in_the_larger_buffer(case):
    shape, outer, view, layout = case
    large = np.arange(int(np.prod(outer)))
    small = gather(large, view).reshape(-1)  # the buffer's elements, in its own order, as the view places them
    restated = restated_in(layout, shape, view)
    assert restated is not None
    np.testing.assert_array_equal(gather(large, restated), gather(small, layout))


def test_a_layout_crossing_the_buffers_rows_has_no_restatement_unless_the_view_keeps_them_together():
    flat_rows = ir.Layout((12,), (1,))  # [3, 4] walked as 12 elements
    columns = ir.Layout((3, 4), (10, 1), 2)  # rows of 4 at a row stride of 10: not one run
    assert restated_in(flat_rows, (3, 4), columns) is None
    rows = ir.Layout((3, 4), (4, 1), 40)  # rows placed one after the other: still one run
    assert restated_in(flat_rows, (3, 4), rows) == ir.Layout((12,), (1,), 40)
    assert restated_in(ir.Layout((4,), (-1,), 3), (4,), ir.Layout((4,), (1,), 8)) is None  # negative stride


def _decisions(region) -> list[str]:
    return [decision for decision in region.fusion_decisions if ") assembled in place: " in decision]


@settings(max_examples=8, deadline=None)
@given(rows=st.sampled_from([1, 127, 128, 129]), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_flux_single_blocks_attention_and_mlp_are_stored_into_their_cat(rows, dtype):
    """``cat([attention, gelu(x @ w1)], -1) @ w2``: the attention kernel and the matmul store their outputs into
    column slices of the cat (rows of another stride), no concat kernel copies them, and the result is eager's."""
    x = random_tensor((1, rows, 64), dtype, seed=1)
    w1 = random_tensor((256, 64), dtype, seed=2, low=-0.2, high=0.2)
    w2 = random_tensor((32, 512), dtype, seed=3, low=-0.1, high=0.1)
    q, k, v = (random_tensor((1, 2, rows, 128), dtype, seed=seed) for seed in (4, 5, 6))

    def block(x, w1, w2, q, k, v):
        attention = SDPA(q, k, v).transpose(1, 2).flatten(2)
        mlp = torch.nn.functional.gelu(x @ w1.t(), approximate="tanh")
        return torch.cat([attention, mlp], dim=2) @ w2.t()

    region = check_against_eager(block, x, w1, w2, q, k, v, tolerances={torch.float32: (1e-4, 1e-4),
                                                                       torch.bfloat16: (2e-2, 2e-2)})
    assert not any(kernel.name.startswith("concat") for kernel in region.kernels)
    assert len(_decisions(region)) == 1 and ": yes," in _decisions(region)[0]


@settings(max_examples=8, deadline=None)
@given(rows=st.sampled_from([(1, 127), (127, 1), (128, 129), (129, 64)]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_joint_rows_are_stored_by_their_norms_and_projections(rows, dtype):
    """Flux's joint q and v: ``cat([norm(text @ wq), norm(image @ wq)], 1)`` and the same of the v projections, as
    attention reads them: each producer stores its tokens' rows at their offset in the joint buffer."""
    text_rows, image_rows = rows
    text, image = random_tensor((1, text_rows, 64), dtype, seed=1), random_tensor((1, image_rows, 64), dtype, seed=2)
    wq, wv = random_tensor((256, 64), dtype, seed=3, low=-0.3, high=0.3), random_tensor((256, 64), dtype, seed=4)
    weight = random_tensor((128,), dtype, seed=5)

    def joint(text, image, wq, wv, weight):
        def heads(x):
            return x.unflatten(-1, (2, 128))

        def norm(x):  # diffusers' RMSNorm
            x = heads(x).float()
            return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight).to(text.dtype)

        q = torch.cat([norm(text @ wq.t()), norm(image @ wq.t())], dim=1).transpose(1, 2)
        v = torch.cat([heads(text @ wv.t()), heads(image @ wv.t())], dim=1).transpose(1, 2)
        return SDPA(q, q, v).transpose(1, 2).flatten(2)

    region = check_against_eager(joint, text, image, wq, wv, weight, tolerances={torch.float32: (1e-4, 1e-4),
                                                                                 torch.bfloat16: (2e-2, 2e-2)})
    assert not any(kernel.name.startswith("concat") for kernel in region.kernels)
    assert len(_decisions(region)) == 2 and all(": yes," in decision for decision in _decisions(region))


def test_short_runs_and_interleaved_stacks_stay_a_kernel():
    """Columns of 40 fp32 (160 bytes a run) and a stack on the last dim (a step of 2) keep their concat kernel."""
    a, w = random_tensor((130, 40), seed=1), random_tensor((40, 40), seed=2)
    for fn in (lambda a, w: torch.cat([a @ w, torch.softmax(a, -1)], 1),
               lambda a, w: torch.stack([a @ w, torch.softmax(a, -1)], -1).flatten(-2)):
        region = check_against_eager(fn, a, w)
        assert any(kernel.name.startswith("concat") for kernel in region.kernels) and not _decisions(region)


def test_a_cat_of_graph_inputs_stays_a_kernel():
    a, b = random_tensor((3, 5), seed=1), random_tensor((4, 5), seed=2)
    region = check_against_eager(lambda a, b: torch.cat([a, b]) * 2, a, b)
    assert any(kernel.name.startswith("concat") for kernel in region.kernels) and not _decisions(region)


def test_a_writer_whose_store_has_no_layout_in_the_output_leaves_the_concat_a_kernel():
    """The add's kernel walks [3, 160] as 480 elements; in the cat's [3, 288] rows they are not one run."""
    a, b, c = random_tensor((480,), seed=1), random_tensor((480,), seed=2), random_tensor((3, 24), seed=3)

    def fn(a, b, c):
        return torch.cat([(a + b).view(3, 160), c @ torch.ones(24, 128)], dim=1)

    region = check_against_eager(fn, a, b, c)
    assert any(kernel.name.startswith("concat") for kernel in region.kernels)
    assert len(_decisions(region)) == 1 and ": no, " in _decisions(region)[0] and "has no layout" in _decisions(
        region)[0]


@pytest.mark.parametrize("launch_unit", ["kernel", "region"])
def test_only_a_region_launched_as_one_kernel_assembles_in_place(launch_unit):
    """Launched one by one, each kernel returns its outputs whole: a second writer would replace the first's."""
    a, w = random_tensor((130, 128), seed=1), random_tensor((128, 128), seed=2, low=-0.2, high=0.2)

    def fn(a, w):
        return torch.cat([a @ w, torch.softmax(a, -1)], dim=1) + 1

    with neuron_compile.config.patch(launch_unit=launch_unit):
        region = check_against_eager(fn, a, w)
    kept = any(kernel.name.startswith("concat") for kernel in region.kernels)
    assert kept == (launch_unit == "kernel")

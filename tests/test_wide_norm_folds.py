"""Norms over rows wider than 2048 (published checkpoints' hidden sizes: 2560, 3072) fold like the goal point's: the
norm's ``x * rstd * w`` is the reduction's row epilogue (no cap on the row's width: the fit is the planner's declared
tiles), the norm is computed inside the projections that multiply its rows (passes/row_norm_operands.py) or in the
epilogue of the projection writing them (passes/norm_epilogues.py), and each fold is weighed by the kernels' planned
rooflines (passes/fold_traffic.py: their planned HBM bytes or TensorE work): the norm's round trip and kernel it
saves against b's extra passes when the norm's rows leave room for fewer rows of a^T. Against eager under hypothesis
(rows 1, 127, 128, 129, 300; widths 2048, 2560, 3072 and a ragged 2600; fp32 and bf16; Gemma's ``(1 + w)`` and
Llama's ``w``), and a fold that loses on a small target: refused, with both figures in the decisions, the kernels
apart matching eager."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lowering_harness import check_against_eager, fused_kernels, projection_inputs, random_tensor
from test_residual_after_norm import NORMS, llama_norm, post_norm

from neuron_compile import hardware, ir
from neuron_compile.hardware import get_target
from neuron_compile.passes.fold_traffic import planned_bytes, planned_seconds, traffic_reason
from neuron_compile.tiles import TilingError

WIDTHS = [2048, 2560, 2600, 3072]


def input_norm(norm):
    def layer_head(x, weight, w):
        """A decoder layer's input norm read by a projection."""
        return norm(x, weight) @ w

    return layer_head


def head_inputs(rows, width, columns, dtype):
    return [random_tensor((rows, width), dtype, seed=0), random_tensor((width,), dtype, seed=1),
            random_tensor((width, columns), dtype, seed=2) / width ** 0.5]


def _folds(region) -> list[str]:
    return [decision for decision in region.fusion_decisions
            if "computed inside" in decision or "'s epilogue:" in decision]


@settings(max_examples=8, deadline=None)
@given(rows=st.sampled_from([1, 127, 128, 129, 300]), width=st.sampled_from(WIDTHS),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), norm=st.sampled_from(sorted(NORMS)),
       where=st.sampled_from(["input", "post"]))
def test_wide_norms_fold_into_their_projections_and_match_eager(rows, width, dtype, norm, where):
    if where == "input":
        region = check_against_eager(input_norm(NORMS[norm]), *head_inputs(rows, width, 64, dtype))
    else:
        region = check_against_eager(post_norm(NORMS[norm]), *projection_inputs(rows, 64, width, dtype))
    folds = _folds(region)
    assert folds and all(decision.endswith(": fused") for decision in folds), folds


@pytest.mark.parametrize("norm", sorted(NORMS))
def test_a_ragged_wide_row_folds_and_matches_eager(norm):
    """A ragged width and a ragged last row block, whatever the draws above: 129 rows of 2600 in bf16."""
    head = check_against_eager(input_norm(NORMS[norm]), *head_inputs(129, 2600, 64, torch.bfloat16))
    tail = check_against_eager(post_norm(NORMS[norm]), *projection_inputs(129, 64, 2600, torch.bfloat16))
    for region in (head, tail):
        folds = _folds(region)
        assert folds and all(decision.endswith(": fused") for decision in folds), folds


@pytest.mark.parametrize("norm", sorted(NORMS))
def test_at_hidden_2560_one_kernel_computes_the_norm_and_the_projection(norm):
    """Gemma3 4B's and Qwen3 4B's hidden size over a 256-row prefill: no pointwise kernel for ``x * rstd * w``
    (beside Gemma's ``1 + w`` of the weight), the projection computes the norm itself."""
    inputs = head_inputs(256, 2560, 256, torch.bfloat16)
    kernels = [kernel for kernel in fused_kernels(input_norm(NORMS[norm]), *inputs).kernels
               if not isinstance(kernel, ir.Pointwise) or kernel.domain != (2560,)]
    assert [type(kernel).__name__ for kernel in kernels] == ["NormedMatMul"]


def test_the_fold_weighs_planned_bytes_and_tensor_work_not_the_rows_width():
    """What a fold is weighed by: the normed projection moves x and b once and the output, where the kernels apart
    also write the normed rows and read them back; its planned time is the longer of those bytes over the DMA
    bandwidth and its 2 x M x N x K FLOPs at TensorE's bf16 peak."""
    inputs = head_inputs(256, 3072, 512, torch.bfloat16)
    (kernel,) = fused_kernels(input_norm(llama_norm), *inputs).kernels
    target = get_target("trn2")
    x, weight, w = (tensor.numel() * 2 for tensor in inputs)
    moved = x + weight + w + 256 * 512 * 2
    assert planned_bytes(kernel, target) == moved
    tensor = 2 * 256 * 512 * 3072 / (target.tensor_bf16_tflops * 1e12)
    assert planned_seconds(kernel, target) == pytest.approx(max(moved / target.dma_bytes_per_s, tensor))


def test_a_fold_whose_b_passes_outweigh_the_round_trip_is_refused_and_says_why(monkeypatch):
    """On a target of 32 KiB per partition a final norm's tiles beside a^T leave room for one 128-row block where
    the plain projection keeps both: b (2048 x 1024 bf16, 4.19 MB) would stream twice to save the 2 x 0.52 MB round
    trip of the rows, DMA time that TensorE's 1.1 GFLOP does not hide. The norm stays a kernel of its own, the
    decisions give both figures, and the kernels, planned and simulated on that target, match eager."""
    small = dataclasses.replace(get_target("trn2"), sbuf_bytes_per_partition=32 * 1024)
    monkeypatch.setitem(hardware.TARGETS, "trn2", small)
    _, a, w, weight = projection_inputs(256, 2048, 1024, torch.bfloat16)
    region = check_against_eager(lambda a, w, weight: llama_norm(a @ w, weight), a, w, weight)
    assert [kernel.name.rsplit("_kernel_", 1)[0] for kernel in region.kernels] == ["matmul", "reduction"]
    (decision,) = [decision for decision in region.fusion_decisions if "'s epilogue:" in decision]
    assert "would take 27.1 us fused at its planned roofline (9.96 MB through HBM), 18.5 us apart (6.82 MB)" in decision


def test_a_replaced_kernel_that_does_not_tile_never_refuses_the_fold():
    """A kernel apart that the target cannot tile (a 3072-wide norm on 8 KiB per partition) loses to any fold:
    ``traffic_reason`` gives no reason, where planning it raises."""
    (norm,) = fused_kernels(llama_norm, random_tensor((256, 3072), torch.bfloat16),
                            random_tensor((3072,), torch.bfloat16, seed=1)).kernels
    tiny = dataclasses.replace(get_target("trn2"), sbuf_bytes_per_partition=8 * 1024)
    with pytest.raises(TilingError):
        planned_seconds(norm, tiny)
    assert traffic_reason([norm], [norm], tiny) is None

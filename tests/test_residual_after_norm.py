"""Gemma's post-norms: ``h + norm(a @ w)``, the residual add after an RMSNorm of a projection's output, runs in the
norm's row epilogue, and the norm in the projection's epilogue (kinds/matmul_norm_epilogue.py): one kernel, which
stores only the residual sum. A row kernel's fit is decided by the tiles its body declares (kinds/reduction.py
``whole_row_bytes``, their dtypes and widths), where the row budget's count (kinds/rows.py) takes every value it
might keep as a row of fp32 plus staging and refused the add at hidden 2048. Against eager under hypothesis (rows
1, 127, 128, 129, 300; rows the count took and rows only the declared tiles take; fp32 and bf16; Gemma's
``(1 + w)`` weight in fp32 and Llama's ``w`` after the cast), and a target too small for the add, which keeps its
own kernel and says why (at hidden 2048 the norm epilogue runs by column chunks: kinds/reduction.py
``column_chunks``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lowering_harness import check_against_eager, fused_kernels, projection_inputs, random_tensor

from neuron_compile import hardware, ir
from neuron_compile.hardware import get_target
from neuron_compile.kinds.reduction import plan_reduction
from neuron_compile.tiles import TilingError

FITS_THE_COUNT = 200  # row widths whose norm and residual add the row budget's count takes
FILLS_THE_COUNT = 2048  # and one it refused (Gemma3 1B's hidden size)


def gemma_norm(x, weight):
    """Gemma's RMSNorm: the weight as ``1 + w``, multiplied in fp32 before the cast."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    return (normed * (1.0 + weight.float())).to(x.dtype)


def llama_norm(x, weight):
    """Llama's RMSNorm: the normed rows cast first, then the weight."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    return weight * normed.to(x.dtype)


NORMS = {"gemma": gemma_norm, "llama": llama_norm}


def post_norm(norm):
    def layer_tail(h, a, w, weight):
        """A decoder layer's o (or down) projection, its post-norm, the residual add."""
        return h + norm(a @ w, weight)

    return layer_tail


@settings(max_examples=10, deadline=None)
@given(rows=st.sampled_from([1, 127, 128, 129, 300]), width=st.sampled_from([96, FITS_THE_COUNT, FILLS_THE_COUNT]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), norm=st.sampled_from(sorted(NORMS)))
def test_the_residual_add_runs_in_the_norm_in_the_projection_and_matches_eager(rows, width, dtype, norm):
    region = check_against_eager(post_norm(NORMS[norm]), *projection_inputs(rows, 64, width, dtype))
    assert any(decision.endswith("'s epilogue: fused") for decision in region.fusion_decisions)


@pytest.mark.parametrize("norm", sorted(NORMS))
def test_one_kernel_stores_only_the_residual_sum(norm):
    """Hidden 2048 in bf16, where the row budget's count refused the add: the projection, its norm and the add are
    one kernel (beside Gemma's ``1 + w``), which stores the sum of the residual and the normed rows, nothing else."""
    inputs = projection_inputs(256, 64, FILLS_THE_COUNT, torch.bfloat16)
    kernels = [kernel for kernel in fused_kernels(post_norm(NORMS[norm]), *inputs).kernels
               if not isinstance(kernel, ir.Pointwise) or kernel.domain != (FILLS_THE_COUNT,)]  # Gemma's 1 + w
    assert [type(kernel).__name__ for kernel in kernels] == ["MatMulNormEpilogue"]
    (kernel,) = kernels
    assert not kernel.store_rows and not kernel.stores and not kernel.norm.stores
    (total,) = kernel.norm.row_stores
    assert "arg0_1" in {load.buffer for load in ir.loads_of(total.expr)}  # h + norm(a @ w)


def test_a_row_too_wide_for_the_target_keeps_the_add_apart_and_says_why(monkeypatch):
    """A target whose SBUF holds the norm's row tiles but not the add's beside them: the planner names the tiles'
    bytes and the budget, the fusion keeps the add a kernel of its own with the reason in its decisions, and the
    kernels (planned and simulated on that target, whose capacity the simulator checks) match eager."""
    def norm_then_add(h, y, weight):
        return h + llama_norm(y, weight)

    inputs = [random_tensor((256, FILLS_THE_COUNT), torch.bfloat16, seed=seed) for seed in (0, 1)]
    inputs.append(random_tensor((FILLS_THE_COUNT,), torch.bfloat16, seed=2))
    (with_add,) = fused_kernels(norm_then_add, *inputs).kernels  # on trn2: one kernel
    small = dataclasses.replace(get_target("trn2"), sbuf_bytes_per_partition=40 * 1024)
    with pytest.raises(TilingError, match=r"keeps \d+ B per partition on chip, over the SBUF budget of 30720 B"):
        plan_reduction(with_add, small)
    monkeypatch.setitem(hardware.TARGETS, "trn2", small)
    region = check_against_eager(norm_then_add, *inputs)
    assert [kernel.name.rsplit("_kernel_", 1)[0] for kernel in region.kernels] == ["reduction", "pointwise"]
    assert any(decision.endswith("the fused kernel would not fit the target's SBUF")
               for decision in region.fusion_decisions)

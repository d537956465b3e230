"""A matmul whose left operand is an RMSNorm of rows it loads itself (kinds/normed_matmul.py, the rule in
kinds/matmul_row_norm.py, the driver passes/row_norm_operands.py): the first matmul reading the normed rows computes
them and stores them for the other matmuls (every one recomputes them only where that one cannot store them), what
something else reads is still stored, and the results equal eager's (the same instructions as the norm kernel's,
then exact TensorE transposes)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowering_harness import check_against_eager, random_tensor, trace
from neuron_compile import ir, kinds
from neuron_compile.hardware import get_target
from neuron_compile.kinds.normed_matmul import plan_normed_matmul
from neuron_compile.lowering import lower_graph
from neuron_compile.passes import fusion
from neuron_compile.passes.fusion import fuse
from neuron_compile.passes.row_norm_operands import fold_row_norms
from neuron_compile.tiles import TilingError


def rms_norm(x, weight):
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return weight * (x.float() * torch.rsqrt(variance + 1e-6)).to(x.dtype)


def projections(x, weight, q, k, v):
    """A Llama layer's input norm read by its q projection and its k / v projections (paired: one kernel)."""
    normed = rms_norm(x, weight)
    return normed @ q, normed @ k, normed @ v


def _inputs(rows, width, columns, dtype, matrices=3):
    x = random_tensor((rows, width), dtype, seed=0)
    weight = random_tensor((width,), dtype, seed=1)
    return [x, weight] + [random_tensor((width, columns), dtype, seed=2 + i) / width ** 0.5 for i in range(matrices)]


def _fused(fn, *inputs, target=None):
    lowered = lower_graph(trace(fn, *inputs))
    return fuse(lowered.nodes, {value.buffer for value in lowered.outputs}, target=target)


def _normed(region) -> list[str]:
    return [decision for decision in region.fusion_decisions if "computed inside" in decision]


@settings(max_examples=6, deadline=None)
@given(rows=st.sampled_from([1, 127, 128, 129, 200]), width=st.sampled_from([96, 200, 384, 640]),
       columns=st.sampled_from([64, 129, 300]), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_projections_of_normed_rows_match_eager(rows, width, columns, dtype):
    region = check_against_eager(projections, *_inputs(rows, width, columns, dtype))
    first, second = _normed(region)
    stored = rows >= 128 and columns < width  # v (after q and k, paired) narrower than a row, in full row blocks
    assert first.endswith(": fused") and second.endswith(" stores" if stored else ": fused"), (first, second)


def test_the_first_matmul_computes_the_norm_once_and_stores_its_rows_for_the_others():
    """The first kernel (q and k, paired: one width) computes the normed rows and stores them; v's projection, narrower
    than a row, multiplies them (recomputing them cost more than their round trip: Gemma3's k / v kernel, 20.4 ->
    5.0 us of share)."""
    inputs = _inputs(256, 2048, 256, torch.bfloat16)
    result = _fused(projections, *inputs, target=get_target("trn2"))
    assert [type(kernel).__name__ for kernel in result.kernels] == ["NormedMatMul", "MatMul"]
    computing, reading = result.kernels
    (rows,) = [store.buffer.name for store in computing.norm.row_stores]
    assert not computing.norm.stores and reading.a.buffer == rows
    stored = {store.buffer.name for kernel in result.kernels for store in kinds.kind_of(kernel).stores(kernel)}
    assert len(stored) == 4, stored  # q, k, v and the normed rows


@pytest.mark.parametrize("rows, width, columns", [(256, 256, 256), (127, 2048, 256)])
def test_wide_products_or_a_partial_row_block_recompute_the_rows(rows, width, columns):
    """A later projection with as many columns as a row (its TensorE work hides the norm's passes), or fewer rows
    than one block (the rows' round trip does not repay): every matmul computes the rows, none stores them."""
    result = _fused(projections, *_inputs(rows, width, columns, torch.bfloat16), target=get_target("trn2"))
    assert [type(kernel).__name__ for kernel in result.kernels] == ["NormedMatMul", "NormedMatMul"]
    assert all(not kernel.norm.row_stores for kernel in result.kernels)


def test_a_first_matmul_that_cannot_store_the_rows_leaves_every_matmul_recomputing_them(monkeypatch):
    """Where the first matmul would not fit with the rows' stores, each matmul computes the rows itself and none
    crosses HBM."""
    def no_stored_rows(kernels, outputs, decisions, fits=None, weigh=None):
        return fold_row_norms(kernels, outputs, decisions,
                              lambda node: not (isinstance(node, ir.NormedMatMul) and node.norm.row_stores))

    monkeypatch.setattr(fusion, "fold_row_norms", no_stored_rows)
    inputs = _inputs(129, 384, 64, torch.float32)
    region = check_against_eager(projections, *inputs)
    assert len(_normed(region)) == 2 and all(decision.endswith(": fused") for decision in _normed(region))
    result = _fused(projections, *inputs, target=get_target("trn2"))
    assert [type(kernel).__name__ for kernel in result.kernels] == ["NormedMatMul", "NormedMatMul"]
    assert all(not kernel.norm.stores and not kernel.norm.row_stores for kernel in result.kernels)


def test_what_is_read_outside_is_stored_by_the_first_matmul():
    """A training forward keeps the normed rows (and here their rstd) for the backward: the first matmul computing
    them stores them; the second only multiplies them."""
    def fn(x, weight, q, k):
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        normed = weight * (x.float() * rstd).to(x.dtype)
        return normed @ q, normed @ k, normed, rstd

    for rows, dtype in [(129, torch.float32), (128, torch.bfloat16)]:
        inputs = _inputs(rows, 384, 200, dtype, matrices=2)
        region = check_against_eager(fn, *inputs)
        assert all(decision.endswith(": fused") for decision in _normed(region)), _normed(region)
        kernels = _fused(fn, *inputs, target=get_target("trn2")).kernels
        assert [type(kernel).__name__ for kernel in kernels] == ["NormedMatMul"]  # q and k paired
        assert kernels[0].norm.stores and kernels[0].norm.row_stores


def test_a_reader_before_the_first_matmul_keeps_the_norm_kernel():
    """The normed rows are read by a kernel that runs before the matmul (an attention-like scores matmul of the
    rows with themselves, which no rule lets compute them): the norm stays its own kernel, and says why."""
    def fn(x, weight, q):
        normed = rms_norm(x, weight)
        return normed @ normed.t(), normed @ q

    inputs = _inputs(128, 256, 64, torch.float32, matrices=1)
    region = check_against_eager(fn, *inputs)
    stays = [decision for decision in region.fusion_decisions if "stays its own kernel" in decision]
    assert len(stays) == 1 and "before" in stays[0], region.fusion_decisions  # the one matmul that could take it
    kernels = _fused(fn, *inputs, target=get_target("trn2")).kernels
    assert [type(kernel).__name__ for kernel in kernels] == ["Reduction", "MatMul", "MatMul"]


def test_a_normed_matmul_that_does_not_fit_keeps_the_norm_kernel_and_says_why(monkeypatch):
    """A matmul that could not hold the norm's rows beside its own tiles reads the stored rows; the decision names
    the rule. The planner's own error names the SBUF budget."""
    inputs = _inputs(256, 2048, 256, torch.bfloat16)
    normed = _fused(projections, *inputs, target=get_target("trn2")).kernels
    small = dataclasses.replace(get_target("trn2"), sbuf_bytes_per_partition=24 * 1024)
    with pytest.raises(TilingError, match="over half the SBUF budget"):
        plan_normed_matmul(normed[0], small)

    def no_normed_matmul_fits(kernels, outputs, decisions, fits=None, weigh=None):
        return fold_row_norms(kernels, outputs, decisions, lambda node: not isinstance(node, ir.NormedMatMul))

    monkeypatch.setattr(fusion, "fold_row_norms", no_normed_matmul_fits)
    result = _fused(projections, *inputs, target=get_target("trn2"))
    assert [type(kernel).__name__ for kernel in result.kernels] == ["Reduction", "MatMul", "MatMul"]
    refused = [decision for decision in result.decisions if "computed inside" in decision]
    assert len(refused) == 2 and all("would not fit the target's SBUF" in decision for decision in refused), refused


def modulated_layer_norm_linear(x, shift, scale, weight, bias, w):
    """A diffusers block's adaLN: layer norm without affine, modulated, into a linear; and an affine one."""
    width = x.shape[-1]
    modulated = torch.nn.functional.layer_norm(x, (width,), eps=1e-6) * (1 + scale) + shift
    affine = torch.nn.functional.layer_norm(x, (width,), weight, bias, 1e-5)
    return modulated @ w, affine @ w


@pytest.mark.parametrize("rows, dtype", [(1, torch.bfloat16), (129, torch.float32)])
def test_layer_norms_stay_their_own_kernel_and_say_why(rows, dtype):
    """A layer norm's two passes, recomputed in every projection, cost more than the round trip (the Flux mid
    size, measured): the rule refuses a variance, by name."""
    width = 384
    x, shift, scale, weight, bias = (random_tensor(shape, dtype, seed=seed) for seed, shape in
                                     enumerate([(rows, width), (width,), (width,), (width,), (width,)]))
    w = random_tensor((width, 80), dtype, seed=5) / width ** 0.5
    region = check_against_eager(modulated_layer_norm_linear, x, shift, scale, weight, bias, w)
    decisions = _normed(region)
    assert len(decisions) == 2 and all("is a var: a layer norm's two passes" in decision for decision in decisions)


@settings(max_examples=4, deadline=None)
@given(batch=st.sampled_from([2, 3]), sequence=st.sampled_from([1, 7, 65]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_batched_rows_flattened_by_a_linear_are_the_matmuls_rows(batch, sequence, dtype):
    """``F.linear`` of a (batch, sequence, hidden) norm flattens batch and sequence into mm's rows: the norm's
    kept dims merge into them (its layouts are contiguous rows, its weight stride 0)."""
    def fn(x, weight, w):
        return torch.nn.functional.linear(rms_norm(x, weight), w)

    x = random_tensor((batch, sequence, 200), dtype, seed=0)
    weight = random_tensor((200,), dtype, seed=1)
    w = random_tensor((96, 200), dtype, seed=2) / 200 ** 0.5
    region = check_against_eager(fn, x, weight, w)
    assert _normed(region) and all(decision.endswith(": fused") for decision in _normed(region)), _normed(region)

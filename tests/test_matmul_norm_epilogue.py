"""A matmul whose output rows an RMSNorm reduces in its own epilogue (kinds/matmul_norm_epilogue.py, the rule in
kinds/norm_epilogue_rule.py, the driver passes/norm_epilogues.py): a decoder's final norm of ``h + down(...)`` runs
on the rows the down projection keeps on chip; the rows still reach HBM when something else reads them, the norm's
statistics too, and the results are eager's, and the unfused kernels' (the same instructions on the same values but
for the fp32 sum of squares, added by N tile). Rows of two column chunks or more (1100: two whole chunks and a
ragged one) are normed chunk by chunk after the last N tile, each block's rsqrt once before the chunks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowering_harness import check_against_eager, compile_and_run, fused_kernels, projection_inputs, random_tensor
from neuron_compile import ir, kinds
from neuron_compile.hardware import get_target
from neuron_compile.kinds.matmul_norm_epilogue import plan_norm_epilogue
from neuron_compile.kinds.reduction import COLUMN_CHUNK_WIDTH
from neuron_compile.passes import fusion
from neuron_compile.passes.norm_epilogues import fold_norm_epilogues
from neuron_compile.tiles import TilingError


def rms_norm(x, weight):
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return weight * (x.float() * torch.rsqrt(variance + 1e-6)).to(x.dtype)


def down_then_norm(h, a, w, weight):
    """A decoder layer's last steps: the down projection, the residual, the final RMSNorm."""
    return rms_norm(h + a @ w, weight)


def _epilogues(decisions) -> list[str]:
    return [decision for decision in decisions if "'s epilogue: " in decision]


@settings(max_examples=8, deadline=None)
@given(rows=st.sampled_from([1, 127, 128, 129, 300]), inner=st.sampled_from([64, 300]),
       width=st.sampled_from([96, 200, 640, 1000, 1100]), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_a_norm_of_the_matmul_rows_matches_eager_inside_the_matmul(rows, inner, width, dtype):
    region = check_against_eager(down_then_norm, *projection_inputs(rows, inner, width, dtype))
    assert _epilogues(region.fusion_decisions) == [d for d in _epilogues(region.fusion_decisions)
                                                   if d.endswith(": fused")] != []


@pytest.mark.parametrize("rows, width, dtype", [(129, 640, torch.bfloat16), (300, 200, torch.float32),
                                                (129, 1100, torch.bfloat16)])
def test_the_fused_kernel_gives_the_unfused_pair(monkeypatch, rows, width, dtype):
    """Bit for bit here: the row sums added by N tile change no rstd enough to move an output."""
    inputs = projection_inputs(rows, 300, width, dtype)
    region, fused = compile_and_run(down_then_norm, *inputs)
    assert [d.endswith(": fused") for d in _epilogues(region.fusion_decisions)] == [True]
    monkeypatch.setattr(fusion, "fold_norm_epilogues", lambda kernels, *args: kernels)
    region, apart = compile_and_run(down_then_norm, *inputs)
    assert not _epilogues(region.fusion_decisions)
    assert torch.equal(fused[0], apart[0])


@pytest.mark.parametrize("width, chunked", [(640, False), (1100, True)])
def test_rows_of_two_chunks_or_more_are_normed_chunk_by_chunk(width, chunked):
    region, _ = compile_and_run(down_then_norm, *projection_inputs(129, 64, width, torch.bfloat16))
    (source,) = [kernel.source for kernel in region.kernels if kernel.name.startswith("matmul_norm_epilogue")]
    row_epilogue = source.split("# every N tile has passed")[1]
    loop = f"for f0 in range(0, {width}, {COLUMN_CHUNK_WIDTH}):"
    assert (loop in row_epilogue) == chunked
    assert not chunked or row_epilogue.index("op0=nl.rsqrt") < row_epilogue.index(loop)


def test_the_norm_kernel_is_gone_and_only_the_normed_rows_reach_hbm():
    result = fused_kernels(down_then_norm, *projection_inputs(256, 512, 2048, torch.bfloat16))
    assert [type(kernel).__name__ for kernel in result.kernels] == ["MatMulNormEpilogue"]
    kernel = result.kernels[0]
    assert not kernel.store_rows and not kernel.stores
    assert [store.buffer.name for store in kinds.stores(kernel)] == [s.buffer.name for s in kernel.norm.row_stores]


def rows_read_outside(h, a, w, weight):
    """A training forward keeps the rows and the norm's rstd for the backward; another kernel reading the rows (a
    sum) needs them in HBM too."""
    out = h + a @ w
    rstd = torch.rsqrt(out.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    return weight * (out.float() * rstd).to(out.dtype), rstd, out, out.sum(0)


def test_rows_and_statistics_read_outside_are_still_stored(monkeypatch):
    """Against eager in fp32; in bf16 against the unfused kernels, bit for bit here (eager's bf16 matmul rounds its
    product otherwise, so an fp32 rstd of it differs from eager's by more than fp32's tolerance either way)."""
    inputs = projection_inputs(129, 200, 384, torch.float32)
    region = check_against_eager(rows_read_outside, *inputs)
    assert [d.endswith(": fused") for d in _epilogues(region.fusion_decisions)] == [True]
    kernel = next(k for k in fused_kernels(rows_read_outside, *inputs).kernels if isinstance(k, ir.MatMulNormEpilogue))
    assert kernel.store_rows and kernel.norm.stores and kernel.norm.row_stores
    inputs = projection_inputs(128, 200, 384, torch.bfloat16)
    _, fused = compile_and_run(rows_read_outside, *inputs)
    monkeypatch.setattr(fusion, "fold_norm_epilogues", lambda kernels, *args: kernels)
    _, apart = compile_and_run(rows_read_outside, *inputs)
    assert all(torch.equal(one, other) for one, other in zip(fused, apart, strict=True))


def test_a_linear_over_a_sequence_norms_its_rows():
    """A decoder's (1, sequence, hidden) rows through ``F.linear`` (mm over the flattened rows)."""
    def fn(h, a, w, weight):
        return rms_norm(h + torch.nn.functional.linear(a, w), weight)

    for sequence, dtype in [(1, torch.bfloat16), (65, torch.float32)]:
        h = random_tensor((1, sequence, 200), dtype, seed=0)
        a = random_tensor((1, sequence, 96), dtype, seed=1)
        w = random_tensor((200, 96), dtype, seed=2) / 96 ** 0.5
        region = check_against_eager(fn, h, a, w, random_tensor((200,), dtype, seed=3))
        assert [d.endswith(": fused") for d in _epilogues(region.fusion_decisions)] == [True]


def test_a_layer_norm_and_a_partial_row_stay_apart_and_say_why():
    """A variance (a layer norm) is not taken, nor a norm over part of the matmul's row (a per-head q norm)."""
    def fn(h, a, w, weight):
        out = h + a @ w
        heads = out.view(out.shape[0], 4, -1)
        return torch.nn.functional.layer_norm(out, out.shape[-1:]), rms_norm(heads, weight[:heads.shape[-1]])

    region = check_against_eager(fn, *projection_inputs(129, 64, 256, torch.float32))
    decisions = _epilogues(region.fusion_decisions)
    assert any("is a var of other values than squares, not an RMSNorm's" in d for d in decisions), decisions
    assert not any(d.endswith(": fused") for d in decisions), decisions


def test_a_row_too_wide_keeps_the_norm_kernel_and_says_why(monkeypatch):
    """A target whose SBUF cannot hold a block's rows beside the matmul's tiles: the planner names the budget, and
    the norm stays its own kernel with the reason in the fusion decisions."""
    inputs = projection_inputs(256, 512, 2048, torch.bfloat16)
    fused = fused_kernels(down_then_norm, *inputs).kernels[0]
    small = dataclasses.replace(get_target("trn2"), sbuf_bytes_per_partition=24 * 1024)
    with pytest.raises(TilingError, match="over half the SBUF budget"):
        plan_norm_epilogue(fused, small)

    def nothing_fits(kernels, outputs, decisions, fits=None, weigh=None):
        def fits_unless_fused(node):
            return not isinstance(node, ir.MatMulNormEpilogue)

        return fold_norm_epilogues(kernels, outputs, decisions, fits_unless_fused)

    monkeypatch.setattr(fusion, "fold_norm_epilogues", nothing_fits)
    result = fused_kernels(down_then_norm, *inputs)
    assert [type(kernel).__name__ for kernel in result.kernels] == ["MatMul", "Reduction"]
    assert [d.split(": ", 1)[1] for d in _epilogues(result.decisions)] == [
        "the matmul norming its rows would not fit the target's SBUF"]

"""The fused flash-attention backward kernel (kinds/attention_backward.py) on the simulator vs eager's
``_scaled_dot_product_flash_attention_for_cpu_backward``: shapes around the tile and key-block edges (1, 127, 128,
129, ragged), causal (top-left, more or fewer queries than keys), additive masks, grouped-query heads (dk and dv
summed over each group), head dims up to 128, fp32 and bf16; its HBM traffic (the operands and gradients once: no
queries x keys tensor); where it does not apply (head dim over 128, the SBUF budget) the separate kernels."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import neuron_compile
from lowering_harness import check_against_eager, compile_and_run, random_tensor
from neuron_compile import config, ir
from neuron_compile.hardware import get_target
from neuron_compile.kinds import attention_backward as backward_kind
from neuron_compile.runtime import graph_records
from neuron_compile.tiles import TilingError, attention_backward_bytes, attention_backward_reason

FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
SDPA = torch.nn.functional.scaled_dot_product_attention
# Five chained products (S, P, dP, dS and a gradient) summed in another order than eager's: 1e-5 relative.
FP32 = {torch.float32: (1e-4, 1e-4)}


def backward_inputs(queries, keys, depth, dtype=torch.float32, heads=2, causal=False, mask=None):
    """(dO, q, k, v, out, logsumexp) as the training forward leaves them (eager's forward)."""
    q = random_tensor((1, heads, queries, depth), dtype, seed=1)
    k = random_tensor((1, heads, keys, depth), dtype, seed=2)
    v = random_tensor((1, heads, keys, depth), dtype, seed=3)
    grad = random_tensor((1, heads, queries, depth), dtype, seed=4)
    out, logsumexp = FLASH(q, k, v, is_causal=causal, attn_mask=mask)[:2]
    return grad, q, k, v, out, logsumexp


def backward_fn(causal, scale=None):
    return lambda grad, q, k, v, out, logsumexp, mask=None: BACKWARD(grad, q, k, v, out, logsumexp, 0.0, causal,
                                                                    attn_mask=mask, scale=scale)


def backward_kernels(region) -> list[str]:
    return [kernel.name for kernel in region.kernels if kernel.name.startswith("attention_backward_kernel")]


@settings(max_examples=14, deadline=None)
@given(queries=st.sampled_from([1, 127, 128, 129, 200, 600]), keys=st.sampled_from([1, 127, 128, 129, 530, 700]),
       depth=st.sampled_from([16, 64, 96, 128]), causal=st.booleans(), masked=st.booleans())
def test_fused_backward_matches_eager(queries, keys, depth, causal, masked):
    mask = random_tensor((queries, keys), seed=5) if masked and not causal else None
    inputs = backward_inputs(queries, keys, depth, causal=causal, mask=mask)
    region = check_against_eager(backward_fn(causal), *inputs, *([mask] if mask is not None else []),
                                 tolerances=FP32)
    assert backward_kernels(region) == [kernel.name for kernel in region.kernels]  # one kernel, nothing else


def test_scale_and_fully_masked_rows():
    mask = torch.zeros(130, 140)
    mask[3] = float("-inf")  # eager's forward: output 0, log-sum-exp 0; the gradients there are 0
    mask[100, :70] = float("-inf")
    inputs = backward_inputs(130, 140, 32, mask=mask)
    region = check_against_eager(backward_fn(False, scale=0.3), *inputs, mask, tolerances=FP32)
    assert len(backward_kernels(region)) == 1


def grads_through_backend(attention, base, dtype):
    """Gradients of ``(attention(q, k, v) ** 2).sum()`` compiled with the neuron backend (fallback raises) and
    eagerly, each from fresh leaves; and the backward graph's kernel names."""
    def grads(fn):
        leaves = [t.detach().clone().to(dtype).requires_grad_() for t in base]
        (fn(*leaves).float() ** 2).sum().backward()
        return [leaf.grad for leaf in leaves]

    torch._dynamo.reset()
    neuron_compile.reset_stats()
    graph_records.clear_records()  # only the compiles below
    with config.patch(fallback="raise"):
        ours = grads(torch.compile(attention, backend="neuron"))
    assert neuron_compile.stats()["fallback_nodes"] == 0, neuron_compile.stats()["fallback_reasons"]
    names = [kernel.name for record in neuron_compile.compiled_records() if record.kind == "backward"
             for kernel in record.kernels]
    return ours, grads(attention), names


@pytest.mark.parametrize("case", ["plain", "causal", "mask"])
def test_grouped_query_heads_sum_dk_and_dv_over_the_group(case):
    base = [random_tensor((2, 4, 140, 32), seed=1), random_tensor((2, 2, 140, 32), seed=2),
            random_tensor((2, 2, 140, 32), seed=3)]
    # heads viewed from [batch, seq, heads, depth] projections, as models make them
    base = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in base]
    mask = random_tensor((2, 4, 140, 140), seed=6) if case == "mask" else None  # one mask per query head

    def attention(q, k, v):
        return SDPA(q, k, v, is_causal=case == "causal", attn_mask=mask, enable_gqa=True)

    ours, eager, names = grads_through_backend(attention, base, torch.float32)
    assert names == ["attention_backward_kernel_0"]
    for mine, theirs in zip(ours, eager, strict=True):
        assert mine.stride() == theirs.stride()
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("causal", [False, True])
def test_bf16_gradients_are_as_close_to_fp32_as_eagers(causal):
    """P and dS enter TensorE in bf16 (eager's CPU kernel keeps fp32): against the fp32 gradients, ours stay within
    twice eager's own bf16 error."""
    region = check_bf16_against_fp32(causal, backward_inputs(129, 300, 64, torch.bfloat16, causal=causal))
    assert len(backward_kernels(region)) == 1


def check_bf16_against_fp32(causal, inputs):
    """The compiled bf16 gradients are within twice eager's bf16 error of eager's fp32 gradients."""
    truth = backward_fn(causal)(*[t.float() for t in inputs])
    region, ours = compile_and_run(backward_fn(causal), *inputs)
    for mine, theirs, exact in zip(ours, backward_fn(causal)(*inputs), truth, strict=True):
        assert mine.dtype == torch.bfloat16
        assert (mine.float() - exact).abs().max() <= 2 * (theirs.float() - exact).abs().max() + 1e-3
    return region


def test_hbm_traffic_is_the_operands_and_gradients_once():
    """Nothing of size queries x keys crosses HBM: dO, q, k, v, out, the log-sum-exp and the gradients, once each
    (the transposed operands are made on chip)."""
    inputs = backward_inputs(600, 700, 64, torch.bfloat16, causal=True)
    region, outputs = compile_and_run(backward_fn(True), *inputs)
    with neuron_compile.record_launches() as launches:
        region(*inputs)
    (launch,) = launches
    expected = sum(t.numel() * t.element_size() for t in (*inputs, *outputs))
    assert launch.report.hbm_bytes_read + launch.report.hbm_bytes_written == expected


def test_head_dims_over_128_take_the_separate_kernels():
    inputs = backward_inputs(130, 130, 160)
    region = check_against_eager(backward_fn(True), *inputs, tolerances=FP32)
    assert not backward_kernels(region) and len(region.kernels) > 1
    with config.patch(flash_attention=False):  # the option that measures what the fused kernels save
        region = check_against_eager(backward_fn(False), *backward_inputs(20, 30, 16), tolerances=FP32)
    assert not backward_kernels(region)


def test_the_sbuf_budget_is_checked_by_name():
    trn2 = get_target("trn2")
    assert attention_backward_reason(128, 128, 8192, 8192, 4, False, trn2) is None  # the query side streams
    reason = attention_backward_reason(128, 128, 2 ** 20, 1024, 4, False, trn2)
    assert reason and "SBUF" in reason and "budget" in reason
    assert "at most 128" in attention_backward_reason(256, 64, 128, 128, 4, False, trn2)
    load = ir.Load("x", ir.Layout((1, 2 ** 20, 128), (2 ** 27, 128, 1), 0), "float32")
    rows = ir.Load("lse", ir.Layout((1, 2 ** 20), (2 ** 20, 1), 0), "float32")
    buffer = ir.Buffer("dq", "float32", ir.Layout((1, 2 ** 20, 128), (2 ** 27, 128, 1), 0))
    store = ir.Store(buffer, ir.Result(), buffer.layout)
    node = ir.AttentionBackward("kernel", (1, 2 ** 20, 2 ** 20), load, load, load, load, load, rows, None,
                                1 / math.sqrt(128), False, store, store, store)
    with pytest.raises(TilingError, match="over the budget"):
        backward_kind.plan_attention_backward(node, trn2)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_seq_4096_within_the_sbuf_and_psum_budgets(dtype):
    """The simulator raises on any SBUF or PSUM overflow: seq 4096 at head dim 128, causal, against eager."""
    inputs = backward_inputs(4096, 4096, 128, dtype, heads=1, causal=True)
    if dtype == torch.bfloat16:  # eager's bf16 kernel and ours round differently: compare both to fp32
        region = check_bf16_against_fp32(True, inputs)
    else:
        region = check_against_eager(backward_fn(True), *inputs, tolerances=FP32)
    assert len(backward_kernels(region)) == 1


def test_trn1_without_dma_transpose():
    """trn1's DMA engines do not transpose: v^T comes in through a strided DMA, the rest is unchanged."""
    with config.patch(target="trn1"):
        region = check_against_eager(backward_fn(True), *backward_inputs(200, 300, 64, causal=True), tolerances=FP32)
    assert len(backward_kernels(region)) == 1 and "dma_transpose" not in region.kernels[0].source


def test_query_tiles_beyond_the_sbuf_budget_load_their_query_side_per_step(monkeypatch):
    """With room for two query tiles' q, q^T, dO, dO^T only, the last two keep them resident, the first three load
    them per step; the gradients are unchanged."""
    trn2 = get_target("trn2")
    always, query_side = attention_backward_bytes(64, 64, 600, 700, 4, False, trn2)
    monkeypatch.setattr(backward_kind, "SBUF_SHARE", (always + 2.5 * query_side) / trn2.sbuf_bytes_per_partition)
    region = check_against_eager(backward_fn(True), *backward_inputs(600, 700, 64, causal=True), tolerances=FP32)
    assert "query side resident from query tile 3 of 5 on" in region.kernels[0].source


def test_a_key_padding_mask_over_a_batch_and_a_negative_scale():
    """A [batch, 1, 1, keys] mask (padding, read with stride 0 over heads and queries) and a negative scale (no
    running max in the backward: any scale works)."""
    q, k, v, grad = (random_tensor((2, 2, rows, 32), seed=seed) for seed, rows in ((1, 130), (2, 150), (3, 150),
                                                                                  (4, 130)))
    padding = torch.zeros(2, 1, 1, 150)
    padding[1, ..., 100:] = float("-inf")
    out, logsumexp = FLASH(q, k, v, attn_mask=padding)[:2]
    region = check_against_eager(backward_fn(False), grad, q, k, v, out, logsumexp, padding, tolerances=FP32)
    assert len(backward_kernels(region)) == 1
    out, logsumexp = FLASH(q, k, v, scale=-0.5)[:2]
    region = check_against_eager(backward_fn(False, scale=-0.5), grad, q, k, v, out, logsumexp, tolerances=FP32)
    assert len(backward_kernels(region)) == 1


def grouped_inputs(queries, keys, depth, heads, kv_heads, dtype=torch.float32, causal=False):
    """(dO, q, k, v, out, logsumexp) with ``heads`` query heads on ``kv_heads`` key/value heads, q, dO and out
    viewed from [batch, seq, heads, depth] as models make them."""
    q, grad = (random_tensor((1, queries, heads, depth), dtype, seed=seed).transpose(1, 2) for seed in (1, 4))
    k, v = (random_tensor((1, kv_heads, keys, depth), dtype, seed=seed) for seed in (2, 3))
    group = heads // kv_heads
    out, logsumexp = FLASH(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), is_causal=causal)[:2]
    return grad, q, k, v, out.transpose(1, 2).contiguous().transpose(1, 2), logsumexp


@settings(max_examples=6, deadline=None)
@given(queries=st.sampled_from([1, 127, 128, 129, 300]), keys=st.sampled_from([1, 128, 129, 600]),
       group=st.sampled_from([2, 8]), causal=st.booleans())
def test_a_groups_heads_load_together(queries, keys, group, causal):
    """The query heads of a key/value group load q, dO, out and the log-sum-exp of a query tile in one DMA each
    ([rows, heads, D]), store dq in one and share one load of k and v: each operand crosses HBM once."""
    inputs = grouped_inputs(queries, keys, 32, group * 2, 2, causal=causal)
    region = check_against_eager(backward_fn(causal), *inputs, tolerances=FP32)
    (kernel,) = region.kernels
    assert "the group's heads loaded together" in kernel.source
    assert f"queries[0:rows, 0:{group}, 0:32]" in kernel.source
    outputs = region(*inputs)
    with neuron_compile.record_launches() as launches:
        region(*inputs)
    expected = sum(t.numel() * t.element_size() for t in (*inputs, *outputs))
    assert launches[0].report.hbm_bytes_read + launches[0].report.hbm_bytes_written == expected


def test_the_goal_points_grouped_bf16_backward():
    """32 query heads on 4 key/value heads of 64, seq 256, causal, bf16 (the 1-layer Llama of issue 17): within
    twice eager's bf16 error of the fp32 gradients, the group's heads loaded together."""
    inputs = grouped_inputs(256, 256, 64, 32, 4, torch.bfloat16, causal=True)
    truth = backward_fn(True)(*[t.float() for t in inputs])
    region, ours = compile_and_run(backward_fn(True), *inputs)
    assert "the group's heads loaded together" in region.kernels[0].source
    for mine, theirs, exact in zip(ours, backward_fn(True)(*inputs), truth, strict=True):
        assert (mine.float() - exact).abs().max() <= 2 * (theirs.float() - exact).abs().max() + 1e-3


def test_a_group_over_the_sbuf_budget_loads_per_head(monkeypatch):
    """Without room for the group's tiles the heads load their own (the gradients are unchanged)."""
    trn2 = get_target("trn2")
    always, query_side = attention_backward_bytes(32, 32, 300, 300, 4, True, trn2)
    monkeypatch.setattr(backward_kind, "SBUF_SHARE", (always + 3.5 * query_side) / trn2.sbuf_bytes_per_partition)
    region = check_against_eager(backward_fn(False), *grouped_inputs(300, 300, 32, 8, 2), tolerances=FP32)
    assert "the group's heads loaded together" not in region.kernels[0].source


@settings(max_examples=12, deadline=None)
@given(seq=st.sampled_from([1, 127, 128, 129, 300]), depth=st.sampled_from([64, 126, 128]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), causal=st.booleans(), kv_heads=st.sampled_from([1, 4]))
def test_the_row_term_rides_in_dp_where_dO_T_has_room(seq, depth, dtype, causal, kv_heads):
    """-rowsum(dO * O) as dO^T's extra rows (a high and a low bf16 part, one fp32 row) against v^T's ones: dP's
    matmul subtracts it and dS is one product with P; without room (head dim + rows over 128) dS's instruction
    subtracts an fp32 column. The gradients match eager either way (grouped heads, causal or not)."""
    inputs = grouped_inputs(seq, seq, depth, 4, kv_heads, dtype, causal=causal)
    if dtype == torch.float32:
        region = check_against_eager(backward_fn(causal), *inputs, tolerances=FP32)
    else:
        region = check_bf16_against_fp32(causal, inputs)
    (kernel,) = region.kernels
    rows = 1 if dtype == torch.float32 else 2
    if depth + rows <= 128:
        assert f"stationary=side[\"grad_t\"][0:{depth + rows}, 0:rows]" in kernel.source
        assert "nisa.scalar_tensor_tensor(dst=grad_scores" not in kernel.source
    else:
        assert f"stationary=side[\"grad_t\"][0:{depth}, 0:rows]" in kernel.source
        assert "nisa.scalar_tensor_tensor(dst=grad_scores" in kernel.source


def matmul_flops(causal: bool, seq: int) -> int:
    """TensorE FLOPs of one head's fused backward at ``seq`` queries and keys, D 32 (one key block)."""
    inputs = backward_inputs(seq, seq, 32, heads=1, causal=causal)
    region = check_against_eager(backward_fn(causal), *inputs, tolerances=FP32)
    with neuron_compile.record_launches() as launches:
        region(*inputs)
    return launches[0].report.flops


def test_a_causal_step_computes_only_the_chunks_up_to_its_last_query():
    """Seq 512, one key block of four chunks: query tile t sees chunks 0..t, 10 of 16. S and dP used to be computed
    over all 16 (then masked and skipped); now every product of the step is over the 10 (plus the transposes), so
    the FLOPs are under 0.7 of the non-causal kernel's (0.63; 0.78 before)."""
    assert matmul_flops(True, 512) < 0.7 * matmul_flops(False, 512)

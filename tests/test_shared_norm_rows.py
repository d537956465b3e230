"""Gemma3's attention inputs: one input RMSNorm read by the q projection and the paired k / v projection, per-head
RMSNorms of q and k, rotaries (passes/row_norm_operands.py, passes/rotary_epilogues.py). q's kernel computes the
normed rows once and stores them (in full row blocks); k / v's kernel multiplies the stored rows; both rotate their
heads in their epilogues, also when cos and sin are computed after k / v's projection (moved ahead of it). Against
eager under hypothesis (rows 1 / 127 / 128 / 129 / 300, fp32 and bf16), and the kernels' structure; negative: cos
and sin computed from k's projection cannot move ahead of it, and q's rotary stays a kernel of its own, saying why."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowering_harness import check_against_eager, random_tensor, trace
from neuron_compile import ir
from neuron_compile.hardware import get_target
from neuron_compile.lowering import lower_graph
from neuron_compile.passes.fusion import fuse

HEAD = 64
WIDTH = 512  # k / v's 256 columns narrower than a row: q's kernel stores the rows for them


def gemma_norm(x, weight):
    """Gemma's RMSNorm: fp32 statistics, the weight as ``1 + w``."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    return (normed * (1.0 + weight.float())).to(x.dtype)


def rotate(x, cos, sin):
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


def heads(x, weight):
    batch, rows, _ = x.shape
    return torch.nn.functional.linear(x, weight).view(batch, rows, -1, HEAD).transpose(1, 2)


def gemma3_qkv(x, norm_weight, wq, wk, wv, q_weight, k_weight, cos, sin):
    normed = gemma_norm(x, norm_weight)
    q, k, v = heads(normed, wq), heads(normed, wk), heads(normed, wv)
    q, k = gemma_norm(q, q_weight), gemma_norm(k, k_weight)
    return rotate(q, cos.unsqueeze(1), sin.unsqueeze(1)), rotate(k, cos.unsqueeze(1), sin.unsqueeze(1)), v


def gemma3_qkv_angles_after(x, norm_weight, wq, wk, wv, q_weight, k_weight, inv_freq, positions):
    """cos and sin computed after the projections (the concat of the angles a kernel of its own)."""
    normed = gemma_norm(x, norm_weight)
    q, k, v = heads(normed, wq), heads(normed, wk), heads(normed, wv)
    angles = positions.float()[:, :, None] * inv_freq[None, None, :]
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    q, k = gemma_norm(q, q_weight), gemma_norm(k, k_weight)
    return rotate(q, cos.unsqueeze(1), sin.unsqueeze(1)), rotate(k, cos.unsqueeze(1), sin.unsqueeze(1)), v


def gemma3_qkv_angles_from_k(x, norm_weight, wq, wk, wv, q_weight, k_weight, inv_freq, positions):
    """cos and sin that read k's projection (contrived): their kernel cannot run before k / v's."""
    normed = gemma_norm(x, norm_weight)
    q, k, v = heads(normed, wq), heads(normed, wk), heads(normed, wv)
    shift = k.float().sum(dim=(1, 3))[:, :, None] * 1e-3
    angles = positions.float()[:, :, None] * inv_freq[None, None, :] + shift
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    q, k = gemma_norm(q, q_weight), gemma_norm(k, k_weight)
    return rotate(q, cos.unsqueeze(1), sin.unsqueeze(1)), rotate(k, cos.unsqueeze(1), sin.unsqueeze(1)), v


def weights(dtype, seed=0):
    return [random_tensor((WIDTH,), dtype, seed=seed + 1) * 0.1,
            *(random_tensor((n, WIDTH), dtype, seed=seed + 2 + i) / WIDTH ** 0.5
              for i, n in enumerate((4 * HEAD, 2 * HEAD, 2 * HEAD))),
            random_tensor((HEAD,), dtype, seed=seed + 5) * 0.1, random_tensor((HEAD,), dtype, seed=seed + 6) * 0.1]


def given_angles(rows, dtype, seed=0):
    x = random_tensor((1, rows, WIDTH), dtype, seed=seed)
    angles = torch.arange(rows, dtype=torch.float32)[None, :, None] * 0.01 * torch.arange(HEAD)[None, None, :]
    return [x, *weights(dtype, seed), angles.cos().to(dtype), angles.sin().to(dtype)]


def computed_angles(rows, dtype, seed=0):
    x = random_tensor((1, rows, WIDTH), dtype, seed=seed)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, HEAD, 2, dtype=torch.float32) / HEAD))
    return [x, *weights(dtype, seed), inv_freq, torch.arange(rows, dtype=torch.float32)[None, :]]


def fused(fn, inputs):
    lowered = lower_graph(trace(fn, *inputs))
    return fuse(lowered.nodes, {value.buffer for value in lowered.outputs}, target=get_target("trn2"))


def fused_rotaries(decisions) -> list[str]:
    return [decision for decision in decisions if decision.endswith("(a rotary): fused")]


def assert_norm_computed_once(result, rows: int):
    """q's kernel computes the input norm and stores its rows, k / v's multiplies them (fewer rows than a block:
    each computes them); both rotate their heads."""
    projections = [kernel for kernel in result.kernels if isinstance(kernel, ir.MatMulRotary)]
    assert len(projections) == 2, [type(kernel).__name__ for kernel in result.kernels]
    q, kv = projections
    assert len(fused_rotaries(result.decisions)) == 2, result.decisions
    if rows < 128:
        assert all(isinstance(kernel.matmul, ir.NormedMatMul) and not kernel.matmul.norm.row_stores
                   for kernel in projections)
        return
    assert isinstance(q.matmul, ir.NormedMatMul) and type(kv.matmul) is ir.MatMul
    (stored,) = [store.buffer.name for store in q.matmul.norm.row_stores]
    assert kv.matmul.a.buffer == stored


ROWS = st.sampled_from([1, 127, 128, 129, 300])
DTYPES = st.sampled_from([torch.float32, torch.bfloat16])


def check_norm_computed_once(fn, inputs):
    check_against_eager(fn, *inputs)
    assert_norm_computed_once(fused(fn, inputs), inputs[0].shape[1])


@settings(max_examples=8, deadline=None)
@given(rows=ROWS, dtype=DTYPES)
def test_gemma3_q_and_k_on_one_normed_input_match_eager(rows, dtype):
    check_norm_computed_once(gemma3_qkv, given_angles(rows, dtype, seed=rows))


@pytest.mark.slow
@settings(max_examples=8, deadline=None)
@given(rows=ROWS, dtype=DTYPES)
def test_cos_and_sin_computed_after_k_match_eager(rows, dtype):
    check_norm_computed_once(gemma3_qkv_angles_after, computed_angles(rows, dtype, seed=rows))


def test_cos_and_sin_computed_after_k_move_ahead_of_it():
    result = fused(gemma3_qkv_angles_after, computed_angles(129, torch.bfloat16))
    assert_norm_computed_once(result, 129)
    q = next(index for index, kernel in enumerate(result.kernels) if isinstance(kernel, ir.MatMulRotary))
    assert any(isinstance(kernel, ir.Concat) for kernel in result.kernels[:q])  # the angles' concat


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cos_and_sin_reading_k_keep_q_rotary_apart_and_say_why(dtype):
    inputs = computed_angles(129, dtype)
    check_against_eager(gemma3_qkv_angles_from_k, *inputs)
    result = fused(gemma3_qkv_angles_from_k, inputs)
    refused = [decision for decision in result.decisions if "(a rotary)" in decision and "outputs before" in decision]
    # q's: k / v's projection reads the rows q's stores before q's rotary, and cos and sin (reading k) cannot move
    # ahead of it; k's: the shift reads k's product before k's rotary
    assert len(refused) == 2 and not fused_rotaries(result.decisions), result.decisions
    normed = next(kernel for kernel in result.kernels if isinstance(kernel, ir.NormedMatMul))
    assert any(f"in {normed.name}'s epilogue" in decision for decision in refused), refused

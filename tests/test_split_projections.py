"""passes/split_projections.py: a fused projection whose readers take column ranges is one matmul per range."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import neuron_compile
from lowering_harness import check_through_backend, compile_with_backend, random_tensor, trace
from neuron_compile.passes.split_projections import split_projections

aten = torch.ops.aten


def traced(fn, *inputs) -> torch.fx.GraphModule:
    """``fn``'s ATen graph with its values in one fake mode, as the pipeline's graph passes receive it."""
    gm = trace(fn, *inputs)
    FakeTensorProp(gm, mode=FakeTensorMode(allow_non_fake_inputs=True)).propagate(*inputs)
    return gm


def products(gm: torch.fx.GraphModule) -> int:
    return sum(node.target in (aten.mm.default, aten.addmm.default) for node in gm.graph.nodes)


def gated_mlp(x, gate_up, down):
    """Phi3's MLP: gate and up from one product, chunked apart."""
    gate, up = (x @ gate_up.t()).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ down.t()


def qkv_projection(x, weight):
    """Phi3's attention input: q, k and v sliced from one product."""
    qkv = x @ weight.t()
    return qkv[..., :64] * 2, qkv[..., 64:96] + 1, qkv[..., 96:] - 1


def conv1d_attention_input(x, weight, bias):
    """GPT-2's c_attn: a Conv1D (addmm with a bias, the weight stored [in, out]) split into q, k and v."""
    projected = torch.addmm(bias, x.view(-1, x.shape[-1]), weight).view(*x.shape[:-1], -1)
    q, k, v = projected.split(weight.shape[1] // 3, dim=2)
    return q.sum(-1), k * v


def test_each_column_range_becomes_its_own_product():
    x, weight = random_tensor((1, 8, 32)), random_tensor((128, 32), seed=1)
    gm = split_projections(traced(qkv_projection, x, weight))
    assert products(gm) == 3
    assert not any(node.target is aten.slice.Tensor and node.args[0].target is aten.view.default
                   for node in gm.graph.nodes)  # the slices now slice the weight, not the product
    for got, want in zip(gm(x, weight), qkv_projection(x, weight)):
        torch.testing.assert_close(got, want)


def separate_mlp(x, gate, up, down):
    """Llama's MLP: the same with gate and up as products of their own."""
    return (F.silu(x @ gate.t()) * (x @ up.t())) @ down.t()


@settings(max_examples=8, deadline=None)
@given(rows=st.sampled_from([2, 127, 128, 129, 300]), inner=st.sampled_from([64, 200, 704]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_a_gated_mlp_from_one_product_compiles_as_separate_gate_and_up(rows, inner, dtype):
    """Split, Phi3's MLP is Llama's: the same kernels (gate and up paired, silu(gate) * up inside, the product never
    stored), so the same bytes through HBM and bitwise the same result."""
    x = random_tensor((1, rows, 128), dtype)
    gate_up, down = random_tensor((2 * inner, 128), dtype, seed=1) / 8, random_tensor((128, inner), dtype, seed=2) / 8
    fused, fused_stats = compile_with_backend(gated_mlp, x, gate_up, down)
    separate, separate_stats = compile_with_backend(separate_mlp, x, gate_up[:inner].clone(), gate_up[inner:].clone(),
                                                    down)
    assert torch.equal(fused, separate)
    assert fused_stats["hbm_bytes"] == separate_stats["hbm_bytes"]
    if dtype is torch.float32:  # (that path's bf16 numerics: tests/test_fusion.py's paired gate and up)
        check_through_backend(gated_mlp, x, gate_up, down)


@settings(max_examples=6, deadline=None)
@given(rows=st.sampled_from([1, 127, 129]), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_sliced_and_split_products_match_eager(rows, dtype):
    x = random_tensor((1, rows, 64), dtype)
    check_through_backend(qkv_projection, x, random_tensor((128, 64), dtype, seed=1) / 8)
    check_through_backend(conv1d_attention_input, x, random_tensor((64, 96), dtype, seed=2) / 8,
                          random_tensor((96,), dtype, seed=3))


def test_a_product_read_whole_or_not_by_column_ranges_stays_fused():
    x, weight = random_tensor((1, 8, 32)), random_tensor((128, 32), seed=1)

    def read_whole_too(x, weight):
        qkv = x @ weight.t()
        return qkv[..., :64], qkv[..., 64:], qkv

    def every_other_column(x, weight):
        qkv = x @ weight.t()
        return qkv[..., ::2], qkv[..., 1::2]

    def row_ranges(x, weight):
        qkv = (x @ weight.t()).view(8, 128)
        return qkv[:4] * 2, qkv[4:] * 2

    def a_slice_returned(x, weight):  # its strides are the fused product's, which the caller sees
        qkv = x @ weight.t()
        return qkv[..., :64] * 2, qkv[..., 64:]

    for fn in (read_whole_too, every_other_column, row_ranges, a_slice_returned):
        assert products(split_projections(traced(fn, x, weight))) == 1, fn.__name__
        check_through_backend(fn, x, weight)
    one_row = x[0, :1]  # a modulation's product (Flux's adaLN, six chunks): one row, nothing to keep from HBM
    gm = traced(qkv_projection, one_row, weight)
    assert products(gm) == 1 and split_projections(gm) is gm
    check_through_backend(qkv_projection, one_row, weight)


def test_a_training_step_through_a_fused_projection_matches_eager():
    """The forward saves the slices its backward reads (the graph returns them): that product keeps its layout,
    the other is split, and the gradients are eager's."""
    x = random_tensor((1, 129, 64))
    weights = [random_tensor((96, 64), seed=seed) / 8 for seed in (1, 2)]

    def step(x, saved_weight, split_weight):
        q, k, v = (x @ saved_weight.t()).split(32, dim=-1)  # q * k saves q and k for the backward
        a, b = (x @ split_weight.t()).chunk(2, dim=-1)[:2]
        return ((q * k + v).sum() + (torch.relu(a) + b).sum()) / 100

    eager_inputs = [tensor.clone().requires_grad_() for tensor in (x, *weights)]
    step(*eager_inputs).backward()
    compiled_inputs = [tensor.clone().requires_grad_() for tensor in (x, *weights)]
    torch._dynamo.reset()
    with neuron_compile.config.patch(fallback="raise"):
        torch.compile(step, backend="neuron")(*compiled_inputs).backward()
    for compiled, eager in zip(compiled_inputs, eager_inputs):
        torch.testing.assert_close(compiled.grad, eager.grad, rtol=1e-5, atol=1e-5)

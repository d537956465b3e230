"""The launch order of a region's kernels (passes/launch_order.py): what attention's keys and values need first."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowering_harness import check_against_eager, random_tensor
from test_rotary_joint import cos_sin, double_block, head_norm, interleaved_rotary
from neuron_compile import ir
from neuron_compile.passes.launch_order import keys_and_values_first

LAYOUT = ir.Layout((1, 1, 4, 8), (32, 32, 8, 1))


def _buffer(name: str) -> ir.Buffer:
    return ir.Buffer(name, "float32", LAYOUT)


def _load(name: str) -> ir.Load:
    return ir.Load(name, LAYOUT, "float32")


def _pointwise(name: str, reads: list[str]) -> ir.Pointwise:
    expr = ir.Scalar(1.0)
    for read in reads:
        expr = ir.Op("add", (expr, _load(read)))
    return ir.Pointwise(name, LAYOUT.shape, (ir.Store(_buffer(name), expr, LAYOUT),))


def _attention(name: str, q: str, k: str, v: str) -> ir.Attention:
    return ir.Attention(name, LAYOUT.shape, _load(q), _load(k), _load(v), None, 1.0, False,
                        (ir.Store(_buffer(name), ir.Result(), LAYOUT),))


@st.composite
def regions(draw):
    """Pointwise kernels in a valid order, each reading some earlier ones, then an attention kernel reading three
    of them, then a kernel reading the attention's output and earlier kernels."""
    count = draw(st.integers(3, 9))
    kernels = []
    for index in range(count):
        reads = draw(st.lists(st.integers(0, index - 1), max_size=2, unique=True)) if index else []
        kernels.append(_pointwise(f"k{index}", [f"k{read}" for read in reads]))
    q, k, v = (f"k{draw(st.integers(0, count - 1))}" for _ in range(3))
    kernels.append(_attention("attention", q, k, v))
    kernels.append(_pointwise("after", ["attention", f"k{draw(st.integers(0, count - 1))}"]))
    return kernels


def _ancestors(kernels: list[ir.Node], names: set[str]) -> set[str]:
    by_name = {kernel.name: kernel for kernel in kernels}
    found, pending = set(), list(names)
    while pending:
        name = pending.pop()
        if name in by_name and name not in found:
            found.add(name)
            pending += [load.buffer for load in ir.loads_of(by_name[name].stores[0].expr)]
    return found


@settings(max_examples=100, deadline=None)
@given(kernels=regions())
def test_what_keys_and_values_need_comes_first_and_every_kernel_follows_its_writers(kernels):
    ordered = keys_and_values_first(kernels)
    assert sorted(kernel.name for kernel in ordered) == sorted(kernel.name for kernel in kernels)
    position = {kernel.name: index for index, kernel in enumerate(ordered)}
    for kernel in ordered:
        reads = {load.buffer for load in ir.loads_of(kernel.stores[0].expr)} if isinstance(kernel, ir.Pointwise) \
            else {kernel.q.buffer, kernel.k.buffer, kernel.v.buffer}
        assert all(position[read] < position[kernel.name] for read in reads)
    attention = next(kernel for kernel in kernels if isinstance(kernel, ir.Attention))
    needed = _ancestors(kernels, {attention.k.buffer, attention.v.buffer})
    before = [kernel.name for kernel in ordered[:position["attention"]]]
    assert before == [name for name in before if name in needed] + [name for name in before if name not in needed]


@settings(max_examples=6, deadline=None)
@given(rows=st.sampled_from([1, 127, 128, 129]), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_attention_after_a_query_chain_launched_last_matches_eager(rows, dtype):
    """q's chain (projection, norm) written first in the graph, launched after k's and v's projections."""
    x = random_tensor((1, rows, 64), dtype, seed=1)
    wq, wk, wv = (random_tensor((64, 64), dtype, seed=seed, low=-0.3, high=0.3) for seed in (2, 3, 4))

    def attend(x, wq, wk, wv):
        q = torch.nn.functional.layer_norm(x @ wq.t(), (64,)).unflatten(-1, (2, 32)).transpose(1, 2)
        k, v = ((x @ w.t()).unflatten(-1, (2, 32)).transpose(1, 2) for w in (wk, wv))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    check_against_eager(attend, x, wq, wk, wv, tolerances={torch.float32: (1e-4, 1e-4),
                                                          torch.bfloat16: (2e-2, 2e-2)})


def test_a_query_projection_of_its_own_keeps_its_place():
    """Llama: q's projection carries most of the weights; the attention waits for it, so it leads as in the graph."""
    projection = ir.MatMul("q_projection", LAYOUT.shape, 8, _load("x"), _load("w"),
                           (ir.Store(_buffer("q_projection"), ir.Result(), LAYOUT),))
    kernels = [projection, _pointwise("q", ["q_projection"]), _pointwise("k", []), _pointwise("v", []),
               _attention("attention", "q", "k", "v")]
    assert keys_and_values_first(kernels) == kernels
    without = [_pointwise("q_projection", []), *kernels[1:]]
    assert [kernel.name for kernel in keys_and_values_first(without)] == ["k", "v", "q_projection", "q", "attention"]


HEAD_DIM = 64
ATTENTION_TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2)}


def flux_attention(chained: bool):
    """Flux's attention: v projected first in the graph (from its own input ``y``: no sibling of q's or k's
    projection to pair with), then q and k (per-head norms, interleaved rotaries, the rotary in their projection's
    epilogue); ``chained``: q and k projected from another projection's output."""
    def fn(x, y, w0, wq, wk, wv, q_weight, k_weight, cos, sin):
        v = (y @ wv).unflatten(-1, (-1, HEAD_DIM)).transpose(1, 2)
        h = x @ w0 if chained else x
        q = interleaved_rotary(head_norm(h @ wq, q_weight, HEAD_DIM), cos, sin).transpose(1, 2)
        k = interleaved_rotary(head_norm(h @ wk, k_weight, HEAD_DIM), cos, sin).transpose(1, 2)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    return fn


def attention_inputs(rows: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """The norms' weights fp32 (a bf16 weight's cast to fp32 is a kernel the q / k kernel reads, launched just
    before it: the move stops there, as at any kernel it depends on)."""
    width = 2 * HEAD_DIM
    cos, sin = cos_sin(rows, HEAD_DIM)
    weights = [random_tensor((width, width), dtype, seed=seed, low=-0.3, high=0.3) for seed in (2, 3, 4, 5)]
    return [random_tensor((1, rows, width), dtype, seed=1), random_tensor((1, rows, width), dtype, seed=8),
            *weights, random_tensor((HEAD_DIM,), seed=6), random_tensor((HEAD_DIM,), seed=7), cos, sin]


def launched_before_attention(region) -> list[str]:
    names = [kernel.name for kernel in region.kernels]
    return [name for name in names[:next(i for i, name in enumerate(names) if name.startswith("attention"))]
            if name.startswith("matmul")]


def check_rotary_launched_first(rows: int, dtype: torch.dtype) -> None:
    region = check_against_eager(flux_attention(False), *attention_inputs(rows, dtype),
                                 tolerances=ATTENTION_TOLERANCES)
    projections = launched_before_attention(region)
    # the q / k kernels' epilogues start first; v's projection fills TensorE beside them
    kinds = [name.startswith("matmul_rotary") for name in projections]
    assert False in kinds and kinds == sorted(kinds, reverse=True), projections


@pytest.mark.slow  # a few seconds an example; the smoke test below is the fast one
@settings(max_examples=8, deadline=None)
@given(rows=st.sampled_from([1, 127, 128, 129, 300]), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_a_rotary_projection_launches_before_the_plain_projections_and_matches_eager(rows, dtype):
    check_rotary_launched_first(rows, dtype)


def test_a_rotary_projection_launches_before_the_plain_projections_smoke():
    check_rotary_launched_first(129, torch.bfloat16)


def test_a_rotary_projection_stays_after_the_projection_it_reads():
    """q and k projected from ``x @ w0``: the q / k kernel waits for that projection, which keeps its place after
    v's, so the rotary kernel stays last."""
    region = check_against_eager(flux_attention(True), *attention_inputs(127, torch.float32),
                                 tolerances=ATTENTION_TOLERANCES)
    projections = launched_before_attention(region)
    assert projections[-1].startswith("matmul_rotary") and len(projections) >= 2, projections


def joint_attention(text, image, wq, wk, wq_text, wk_text, wv, wv_text, q_weight, k_weight, cos, sin):
    """Flux's double block up to the attention: text and image q / k projected apart, normed, joined and rotated
    (each projection rotating its rows), v joined the same way."""
    q, k = double_block(HEAD_DIM)(text, image, wq, wk, wq_text, wk_text, q_weight, k_weight, cos, sin)
    v = torch.cat([text @ wv_text, image @ wv], 1).unflatten(-1, (-1, HEAD_DIM)).transpose(1, 2)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def check_largest_rotary_first(text_rows: int, image_rows: int, dtype: torch.dtype) -> None:
    hidden, width = 32, 2 * HEAD_DIM
    cos, sin = cos_sin(text_rows + image_rows, HEAD_DIM)
    weights = [random_tensor((hidden, width), dtype, seed=seed, low=-0.3, high=0.3) for seed in range(2, 8)]
    inputs = [random_tensor((1, text_rows, hidden), dtype, seed=0), random_tensor((1, image_rows, hidden), dtype,
                                                                                 seed=1),
              *weights, random_tensor((HEAD_DIM,), seed=8), random_tensor((HEAD_DIM,), seed=9), cos, sin]
    region = check_against_eager(joint_attention, *inputs, tolerances=ATTENTION_TOLERANCES)
    rows = [int(re.search(r"domain=\[1, (\d+),", kernel.source).group(1)) for kernel in region.kernels
            if kernel.name.startswith("matmul_rotary")]
    if len(rows) == 2:  # the joint rows split between the two projections (else a concat kernel rotates them)
        assert rows == sorted(rows, reverse=True), rows  # the larger epilogue starts first


@pytest.mark.slow  # ~10 s an example; the smoke test below is the fast one
@settings(max_examples=6, deadline=None)
@given(rows=st.sampled_from([(1, 128), (127, 129), (129, 300), (128, 1), (64, 127)]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_the_larger_rotary_projection_launches_first_and_matches_eager(rows, dtype):
    check_largest_rotary_first(*rows, dtype)


def test_the_larger_rotary_projection_launches_first_smoke():
    check_largest_rotary_first(3, 130, torch.float32)

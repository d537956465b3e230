"""A small value read through a repeating view (Gemma's ``1 + w.float()`` by its norm, a rotary's ``inv_freq.float()``
and ``positions.float()`` by its table) is computed where it is read (passes/broadcast_reads.py), once per kernel
when every row reads it alike (codegen/row_broadcast.py), not by a kernel of its own: results equal eager's, follow
weights updated in place, and only repeating views are restated."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import neuron_compile
from lowering_harness import TOLERANCES, check_against_eager, random_tensor, trace
from neuron_compile import ir
from neuron_compile.lowering import lower_graph
from neuron_compile.passes.broadcast_reads import MAX_BROADCAST_ELEMENTS, restated
from neuron_compile.passes.fusion import fuse

ROWS = st.sampled_from([1, 127, 128, 129, 300])
WIDTHS = st.sampled_from([64, 100, 129, 640])
DTYPES = st.sampled_from([torch.float32, torch.bfloat16])


def gemma_norm(x, weight):
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    return (normed * (1.0 + weight.float())).type_as(x)


def rotary_table(positions, inv_freq):
    freqs = positions[:, None].float() * inv_freq[None, :].float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(inv_freq.dtype), emb.sin().to(inv_freq.dtype)


def _kernels(fn, *inputs):
    lowered = lower_graph(trace(fn, *inputs))
    return fuse(lowered.nodes, {value.buffer for value in lowered.outputs}).kernels


def test_one_plus_weight_has_no_kernel_of_its_own():
    x, weight = random_tensor((256, 2048), torch.bfloat16, seed=0), random_tensor((2048,), torch.bfloat16, seed=1)
    (kernel,) = _kernels(gemma_norm, x, weight)
    assert isinstance(kernel, ir.Reduction)
    neuron_compile.reset_stats()
    check_against_eager(gemma_norm, x, weight)
    # x in, out back, the raw weight once: neither 1 + w (fp32) nor a broadcast of it crosses HBM
    assert neuron_compile.stats()["hbm_bytes"] == 2 * x.numel() * 2 + weight.numel() * 2


def test_the_weight_value_is_computed_once_per_kernel():
    x, weight = random_tensor((256, 2048), torch.bfloat16, seed=0), random_tensor((2048,), torch.bfloat16, seed=1)
    region = check_against_eager(gemma_norm, x, weight)
    (kernel,) = region.kernels
    before_loops, loops = kernel.source.split("for p0 in")
    assert "is the same for every row: computed once" in before_loops
    assert "operand0=1.0)" in before_loops and "operand0=1.0)" not in loops  # the + 1.0 once, not per row block


@settings(max_examples=10, deadline=None)
@given(rows=ROWS, width=WIDTHS, dtype=DTYPES)
def test_gemma_norm_matches_eager(rows, width, dtype):
    check_against_eager(gemma_norm, random_tensor((rows, width), dtype, seed=rows),
                        random_tensor((width,), dtype, seed=width, low=-0.5, high=0.5))


def inverse_frequencies(half: int, dtype: torch.dtype) -> torch.Tensor:
    return (1.0 / (10000 ** (torch.arange(0, 2 * half, 2).float() / (2 * half)))).to(dtype)


def test_rotary_table_reads_its_frequencies_without_a_cast_kernel():
    kernels = _kernels(lambda inv_freq: rotary_table(torch.arange(256), inv_freq), inverse_frequencies(32, torch.bfloat16))
    # the positions (an iota, stored as int32), their fp32 cast (read by the table for every frequency, along its
    # columns: it keeps its kernel) and the table; no kernel casts the frequencies
    assert [type(kernel).__name__ for kernel in kernels] == ["Pointwise", "Pointwise", "Concat"]
    positions, (cast,) = kernels[0].stores[0].buffer.name, kernels[1].stores
    assert [load.buffer for load in ir.loads_of(cast.expr)] == [positions]


@settings(max_examples=4, deadline=None)
@given(rows=ROWS, half=st.sampled_from([1, 16, 32, 33]), dtype=DTYPES)
def test_rotary_table_matches_eager(rows, half, dtype):
    check_against_eager(lambda inv_freq: rotary_table(torch.arange(rows), inv_freq), inverse_frequencies(half, dtype))


class GemmaNorm(nn.Module):
    def __init__(self, width: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(random_tensor((width,), dtype, seed=3, low=-0.5, high=0.5))

    def forward(self, x):
        return gemma_norm(x, self.weight)


@pytest.mark.parametrize("rows, width, dtype", [(129, 640, torch.float32), (256, 2048, torch.bfloat16)])
def test_the_norm_follows_its_weight_updated_in_place(rows, width, dtype):
    torch._dynamo.reset()
    module = GemmaNorm(width, dtype)
    compiled = torch.compile(module, backend="neuron")
    rtol, atol = TOLERANCES[dtype]
    neuron_compile.reset_stats()
    for step in range(3):
        x = random_tensor((rows, width), dtype, seed=step)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), module(x), rtol=rtol, atol=atol)
            module.weight.mul_(-1.5).add_(0.25)  # as an optimizer step: the same tensor, new values
    stats = neuron_compile.stats()
    assert stats["fallback_nodes"] == 0 and stats["kernels_launched"] == 3


# ------------------------------------------------------------------ which views are restated


def _store(shape, strides=None, numel=None) -> ir.Store:
    strides = strides or ir.contiguous_strides(shape)
    layout = ir.Layout(tuple(shape), tuple(strides))
    source = ir.Load("w", ir.Layout(tuple(shape), ir.contiguous_strides(shape)), "bfloat16")
    buffer = ir.Buffer("value", "float32", ir.Layout((numel or layout.span(),), (1,)))
    return ir.Store(buffer, ir.op("add", ir.Op("cast", (source,), "float32"), 1.0), layout)


def _read(shape, strides, offset=0) -> ir.Load:
    return ir.Load("value", ir.Layout(tuple(shape), tuple(strides), offset), "float32")


def test_a_row_repeated_for_every_row_reads_the_weight_the_same_way():
    value = restated(_store((2048,)), _read((1, 256, 2048), (0, 0, 1)))
    (load,) = ir.loads_of(value)
    assert load.layout == ir.Layout((1, 256, 2048), (0, 0, 1), 0)


def test_a_row_repeated_from_an_offset_start():
    value = restated(_store((4, 256)), _read((32, 256), (0, 1), offset=512))  # row 2 of the value, for every row
    (load,) = ir.loads_of(value)
    assert load.layout == ir.Layout((32, 256), (0, 1), 512)


@pytest.mark.parametrize("read", [
    _read((16, 16), (1, 16)),  # a transpose: nothing repeats
    _read((8,), (1,), offset=4),  # a slice: nothing repeats
    _read((16, 4, 16), (1, 0, 16)),  # a transposing repeat
    _read((4, 64), (0, 4)),  # strides no dim of the value has
    _read((4, 16, 16), (0, 16, 1), offset=16),  # runs past the value's last row
    _read((4, 16), (0, 0), offset=5),  # one element for every index: a scalar keeps its kernel
    _read((16, 32), (16, 0)),  # a column repeated along each row: the reader would fetch it once per column
    _read((2, 16, 8), (0, 16, 0)),  # the same behind a repeated outer dim
])
def test_views_that_do_not_repeat_rows_in_order_are_not_restated(read):
    assert restated(_store((16, 16)), read) is None


def test_a_value_too_large_to_recompute_per_repeat_is_not_restated():
    width = MAX_BROADCAST_ELEMENTS + 1
    assert restated(_store((width,)), _read((2, width), (0, 1))) is None

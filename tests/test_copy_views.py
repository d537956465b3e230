"""passes/copy_views.py: a pure copy's readers read its source as a view. The layout composition against numpy
indexing (random permuted copies, random views of their output, broadcasts), the copies kept where a view cannot
say it, and end to end: transformers' write of v into an empty cache read by the flash kernel, against eager; and
the other way round, a flash attention writing straight into the layout of the copy that only reads its output
(Phi-3's [heads, tokens, 96] output made [tokens, heads x 96] rows for the o projection)."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import neuron_compile
from lowering_harness import check_against_eager, random_tensor
from neuron_compile import ir
from neuron_compile.passes.copy_views import (
    dense_dims,
    read_copies_as_views,
    view_through_copy,
    write_copies_in_writers,
)

SDPA = torch.nn.functional.scaled_dot_product_attention


def gather(flat: np.ndarray, layout: ir.Layout) -> np.ndarray:
    """The elements ``layout`` addresses in ``flat``, in its shape."""
    index = np.full(layout.shape, layout.offset)
    for dim, (size, stride) in enumerate(zip(layout.shape, layout.strides, strict=True)):
        shape = [1] * len(layout.shape)
        shape[dim] = size
        index = index + np.arange(size).reshape(shape) * stride
    return flat[index]


@st.composite
def copies(draw):
    """A source layout (a permuted view of a flat buffer), the copy's contiguous store layout (possibly permuted
    too) and a view of the copy's output: a slice of some dims, a broadcast dim, or the whole."""
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=4)))
    rank = len(shape)
    source_order = draw(st.permutations(range(rank)))
    store_order = draw(st.permutations(range(rank)))

    def permuted(order, offset):
        strides, step = [0] * rank, 1
        for dim in reversed(order):
            strides[dim], step = step, step * shape[dim]
        return ir.Layout(shape, tuple(strides), offset)

    source, store = permuted(source_order, draw(st.integers(0, 3))), permuted(store_order, draw(st.integers(0, 2)))
    starts = [draw(st.integers(0, size - 1)) for size in shape]
    sizes = [draw(st.integers(1, size - start)) for size, start in zip(shape, starts, strict=True)]
    reader_dims = draw(st.permutations(range(rank)))
    view_shape = [sizes[d] for d in reader_dims]
    view_strides = [store.strides[d] for d in reader_dims]
    if draw(st.booleans()):  # a broadcast dim (grouped-query attention reads each key/value head per query head)
        where = draw(st.integers(0, rank))
        view_shape.insert(where, draw(st.integers(1, 3)))
        view_strides.insert(where, 0)
    offset = store.offset + sum(start * stride for start, stride in zip(starts, store.strides, strict=True))
    return source, store, ir.Layout(tuple(view_shape), tuple(view_strides), offset)


@settings(max_examples=200, deadline=None)
@given(case=copies())
def test_a_view_of_the_copy_reads_what_the_view_of_its_source_reads(case):
    source, store, reader = case
    flat_source = np.arange(source.span() + 5)
    copied = np.full(store.span(), -1)
    copied[gather(np.arange(store.span()), store).ravel()] = gather(flat_source, source).ravel()
    view = view_through_copy(reader, store, source)
    assert view is not None
    np.testing.assert_array_equal(gather(flat_source, view), gather(copied, reader))


@settings(max_examples=50, deadline=None)
@given(case=copies())
def test_multiples_keep_every_view_that_walks_the_dims_one_by_one(case):
    source, store, reader = case
    assert view_through_copy(reader, store, source, multiples=True) == view_through_copy(reader, store, source)


def test_views_that_walk_two_of_the_copys_dims_as_one_keep_the_copy():
    store = ir.Layout((4, 8), (8, 1))
    assert view_through_copy(ir.Layout((32,), (1,)), store, ir.Layout((4, 8), (1, 4))) is None  # flattened
    assert view_through_copy(ir.Layout((4, 4), (8, 2)), store, ir.Layout((4, 8), (1, 4))) is None  # every other
    assert dense_dims(ir.Layout((4, 8), (16, 1))) is None  # a store with gaps


def test_with_multiples_a_reader_may_split_one_of_the_copys_dims():
    """A grouped attention's store, [4 groups, 8 heads] over a copy of 32 heads: each element lands where the copy
    puts it (checked element by element), and the steps may not carry into the next dim."""
    source = ir.Layout((32, 16), (16, 1))  # heads-first, as the attention writes them
    store = ir.Layout((32, 16), (16, 1))  # the copy's view of that output, heads x D
    copy_rows = ir.Layout((32, 16), (1, 32))  # where the copy writes each element: transposed
    reader = ir.Layout((4, 8, 16), (128, 16, 1), 0)  # the attention's store: group, head in group, D
    assert view_through_copy(reader, store, copy_rows) is None  # one reader dim per store dim only
    view = view_through_copy(reader, store, copy_rows, multiples=True)
    assert view == ir.Layout((4, 8, 16), (8, 1, 32), 0)
    flat = np.arange(copy_rows.span())
    np.testing.assert_array_equal(gather(flat, view).reshape(32, 16), gather(flat, copy_rows))
    assert view_through_copy(ir.Layout((4, 4), (8, 2)), ir.Layout((4, 8), (8, 1)), ir.Layout((4, 8), (1, 4)),
                             multiples=True) == ir.Layout((4, 4), (1, 8), 0)  # every other, now a view
    assert view_through_copy(ir.Layout((4, 5), (8, 2)), ir.Layout((4, 8), (8, 1)), ir.Layout((4, 8), (1, 4)),
                             multiples=True) is None  # a fifth step of 2 runs past the row of 8
    carries = ir.Layout((5, 8, 16), (128, 16, 1), 0)  # a fifth group would run past the 32 heads
    assert view_through_copy(carries, ir.Layout((40, 16), (16, 1)), ir.Layout((40, 16), (1, 40)),
                             multiples=True) is not None  # inside 40 heads: fine
    assert view_through_copy(carries, store, copy_rows, multiples=True) is None


def _copy_and_reader(reader_layout: ir.Layout, source_layout=ir.Layout((4, 8), (16, 1), 3),
                     region_outputs=frozenset()):
    """``copied = x`` over [4, 8] (x read through ``source_layout``), and ``copied * 2`` read through
    ``reader_layout``, through the pass."""
    domain = (4, 8)
    out = ir.Buffer("copied", "float32", ir.Layout(domain, (8, 1)))
    copy = ir.Pointwise("copy", domain, (ir.Store(out, ir.Load("x", source_layout, "float32"), out.layout),))
    result = ir.Buffer("result", "float32", ir.Layout(reader_layout.shape, ir.contiguous_strides(reader_layout.shape)))
    reader = ir.Pointwise("reader", reader_layout.shape, (ir.Store(
        result, ir.op("mul", ir.Load("copied", reader_layout, "float32"), ir.Scalar(2.0)), result.layout),))
    return read_copies_as_views([copy, reader], set(region_outputs))


def test_a_copy_is_dropped_only_when_every_reader_reads_a_view_and_it_is_not_an_output():
    kept = _copy_and_reader(ir.Layout((4, 8), (8, 1)))
    assert [node.name for node in kept] == ["reader"]
    assert kept[0].stores[0].expr.args[0] == ir.Load("x", ir.Layout((4, 8), (16, 1), 3), "float32")
    assert len(_copy_and_reader(ir.Layout((32,), (1,)))) == 2  # a flattened read: no view says it
    assert len(_copy_and_reader(ir.Layout((4, 8), (8, 1)), region_outputs={"copied"})) == 2  # torch gets it
    # the copy made x's columns rows: the reader's contiguous rows would become strided reads
    assert len(_copy_and_reader(ir.Layout((4, 8), (8, 1)), source_layout=ir.Layout((4, 8), (1, 4)))) == 2


@settings(max_examples=6, deadline=None)
@given(seq=st.sampled_from([1, 127, 128, 129, 200]), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_values_written_into_an_empty_cache_are_read_where_the_projection_wrote_them(seq, dtype):
    """``cat([past, v])`` with no past copies v into the cache's layout; the attention kernel reads v from the
    projection's [seq, kv heads x 64] rows instead: one kernel, and v crosses HBM once."""
    q = random_tensor((1, seq, 8, 64), dtype, seed=1).transpose(1, 2)
    k = random_tensor((1, 2, seq, 64), dtype, seed=2)
    v = random_tensor((1, seq, 2 * 64), dtype, seed=3)
    past = torch.empty(1, 2, 0, 64, dtype=dtype)

    def attention(q, k, v, past):
        values = torch.cat([past, v.view(1, seq, 2, 64).transpose(1, 2)], 2)
        return SDPA(q, k, values, is_causal=True, enable_gqa=True)

    neuron_compile.reset_stats()
    region = check_against_eager(attention, q, k, v, past, tolerances={torch.float32: (1e-4, 1e-4),
                                                                       torch.bfloat16: (2e-2, 2e-2)})
    assert [kernel.name for kernel in region.kernels] == ["attention_kernel_0"]
    moved = sum(t.numel() * t.element_size() for t in (q, k, v)) + q.numel() * q.element_size()
    assert neuron_compile.stats()["hbm_bytes"] == moved


def _attention_and_copy(extra_reader: bool = False, region_outputs=()) -> list[ir.Node]:
    """A flash attention over [2 heads, 5 queries, 3] writing ``out`` heads-first, and its copy into [5, 2, 3] rows
    (``rows``); with ``extra_reader``, a pointwise node reading ``out`` too."""
    domain = (2, 5, 3)
    out = ir.Buffer("out", "float32", ir.Layout(domain, (15, 3, 1)))
    qkv = ir.Load("q", ir.Layout(domain, (15, 3, 1)), "float32")
    attention = ir.Attention("attention", domain, qkv, qkv, qkv, None, 1.0, False,
                             (ir.Store(out, ir.Result(), out.layout),))
    rows = ir.Buffer("rows", "float32", ir.Layout((5, 2, 3), (6, 3, 1)))
    copy = ir.Pointwise("copy", rows.layout.shape, (
        ir.Store(rows, ir.Load("out", ir.Layout((5, 2, 3), (3, 15, 1)), "float32"), rows.layout),))
    nodes = [attention, copy]
    if extra_reader:
        other = ir.Buffer("other", "float32", out.layout)
        nodes.append(ir.Pointwise("other", domain, (ir.Store(other, ir.Load("out", out.layout, "float32"),
                                                             other.layout),)))
    return write_copies_in_writers(nodes, set(region_outputs))


def test_an_attention_writes_the_layout_of_the_copy_that_alone_reads_its_output():
    nodes = _attention_and_copy()
    assert [node.name for node in nodes] == ["attention"]
    (store,) = nodes[0].stores
    assert store.buffer.name == "rows" and store.layout == ir.Layout((2, 5, 3), (3, 6, 1))
    assert len(_attention_and_copy(extra_reader=True)) == 3  # another reader needs the heads-first output
    assert len(_attention_and_copy(region_outputs={"out"})) == 2  # torch gets the heads-first output
    assert len(_attention_and_copy(region_outputs={"rows"})) == 2  # (not a pure copy: the copy is an output)


@settings(max_examples=12, deadline=None)
@given(seq=st.sampled_from([1, 127, 128, 129, 300]), depth=st.sampled_from([80, 96]), causal=st.booleans(),
       group=st.sampled_from([1, 2]), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_attention_output_made_contiguous_for_the_o_projection_is_written_in_place(seq, depth, causal, group, dtype):
    """Phi-3's ``attn_output.transpose(1, 2).contiguous()`` (head dim 96, and 80): with heads-first q, eager's flash
    output is heads-first, and the o projection walks heads and head dim as one K, so no view of it reads the copy's
    source; the attention kernel writes the [tokens, heads, D] rows itself, no copy kernel between. Grouped, the
    kernel's store splits the heads in (key/value head, group), whose steps are whole multiples of the copy's head
    stride (``view_through_copy(..., multiples=True)``): it writes the rows too."""
    heads = 4
    q = random_tensor((1, heads, seq, depth), dtype, seed=1)  # heads-first, as Phi-3's rotary (a cat) writes them
    k = random_tensor((1, heads // group, seq, depth), dtype, seed=2)
    v = random_tensor((1, heads // group, seq, depth), dtype, seed=3)
    weight = random_tensor((heads * depth, 64), dtype, seed=4) / (heads * depth) ** 0.5  # outputs of about 1

    def attention(q, k, v, weight):
        out = SDPA(q, k, v, is_causal=causal, enable_gqa=group > 1)
        return out.transpose(1, 2).contiguous().reshape(1, seq, heads * depth) @ weight

    region = check_against_eager(attention, q, k, v, weight, tolerances={torch.float32: (1e-4, 1e-4),
                                                                         torch.bfloat16: (3e-2, 3e-2)})
    assert [kernel.name.rsplit("_", 1)[0] for kernel in region.kernels] == ["attention_kernel", "matmul_kernel"]

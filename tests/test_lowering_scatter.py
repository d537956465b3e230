"""Scatter lowerings (index_put, index_copy, index_fill, index_add, index_reduce, scatter, scatter_add,
scatter_reduce, put) vs eager: duplicates, negatives, special values, out-of-range indices, a KV-cache update."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lowering_harness import (
    check_against_eager,
    check_through_backend,
    compile_with_backend,
    random_tensor,
    trace,
)

from neuron_compile.pipeline import compile_region
from neuron_compile.lowering import unsupported_reason
from neuron_compile.runtime.simulator.tensor import NkiTensor

INF, NAN = float("inf"), float("nan")
aten = torch.ops.aten


@pytest.fixture(autouse=True)
def serial_eager():
    """Eager's CPU index_put / index_copy without accumulation run in parallel above a few thousand elements, and
    then duplicate indices land in whichever thread writes last; with one thread the last index wins, which is
    what the kernels reproduce (torch documents the parallel result as undefined)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _indices(shape, low, high, seed, dtype=torch.int64):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, shape if isinstance(shape, tuple) else (shape,), generator=generator).to(dtype)


@pytest.mark.parametrize("count", [1, 127, 128, 129, 300])
@pytest.mark.parametrize("accumulate, dtype", [(False, torch.int64), (True, torch.int32)])
def test_index_put_rows_with_duplicates_and_negatives(count, accumulate, dtype):
    x = random_tensor((40, 7), seed=count)
    index = _indices(count, -40, 40, count, dtype)  # negative indices wrap; 300 into 40 rows repeats most
    values = random_tensor((count, 7), seed=count + 1)
    check_against_eager(lambda a, i, v: torch.index_put(a, (i,), v, accumulate=accumulate), x, index, values)


def test_index_put_several_indices_broadcast_values_and_bf16():
    x = random_tensor((2, 6, 7, 3), seed=2)
    i, j = _indices((4, 1), -6, 6, 3), _indices((1, 130), 0, 7, 4, torch.int32)
    check_against_eager(lambda a, i, j, v: aten.index_put(a, [None, i, j], v), x, i, j, random_tensor(3, seed=5))
    check_against_eager(lambda a, i, j, v: aten.index_put(a, [None, i, j], v, accumulate=True), x, i, j,
                        random_tensor((2, 4, 130, 3), seed=6))
    xb = x.to(torch.bfloat16)
    check_against_eager(lambda a, i, j, v: aten.index_put(a, [None, i, j], v), xb, i, j,
                        random_tensor((130, 3), torch.bfloat16, seed=7))
    # bf16 accumulation: eager rounds after every addition, the kernel once per tile (fp32 sums by design)
    check_against_eager(lambda a, i, j, v: aten.index_put(a, [None, i, j], v, accumulate=True), xb, i, j,
                        random_tensor((130, 3), torch.bfloat16, seed=8), fp32_reference=True)


def test_index_put_0d_index_and_0d_values():
    x = random_tensor((9,), seed=9)
    check_against_eager(lambda a, i, v: torch.index_put(a, (i,), v), x, torch.tensor(-2), torch.tensor(4.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_index_copy_fill_add_on_every_dim_non_contiguous(dtype):
    x = random_tensor((9, 6, 4), dtype, seed=10).permute(2, 0, 1)  # (4, 9, 6), non-contiguous
    for dim, size in ((0, 4), (1, 9), (2, 6)):
        index = _indices(size + 3, 0, size, dim)
        shape = list(x.shape)
        shape[dim] = len(index)
        source = random_tensor(tuple(reversed(shape)), dtype, seed=dim).permute(2, 1, 0)  # non-contiguous src
        check_against_eager(lambda a, i, s: a.index_copy(dim, i, s), x, index, source)
        check_against_eager(lambda a, i, s: a.index_add(dim, i, s, alpha=-1.5), x, index, source,
                            fp32_reference=dtype == torch.bfloat16)
        check_against_eager(lambda a, i: a.index_fill(dim, i, -0.0), x, index - size)  # negatives wrap here
        check_against_eager(lambda a, i, v: a.index_fill(dim, i, v), x, index, torch.tensor(INF, dtype=dtype))


@pytest.mark.parametrize("reduce", ["prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
def test_index_reduce(reduce, include_self):
    for dtype in (torch.float32, torch.bfloat16):
        x = random_tensor((12, 5), dtype, seed=11, low=0.5, high=1.5)
        index = _indices(140, 0, 10, 12)  # rows 10, 11 untouched; the rest hit ~14 times each
        source = random_tensor((140, 5), dtype, seed=13, low=0.5, high=1.5)
        check_against_eager(lambda a, i, s: a.index_reduce(0, i, s, reduce, include_self=include_self), x, index,
                            source, fp32_reference=dtype == torch.bfloat16)


@pytest.mark.parametrize("reduce", ["sum", "prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
def test_scatter_reduce_with_index_smaller_than_src(reduce, include_self):
    x = random_tensor((6, 131), seed=14, low=0.5, high=1.5)
    index = _indices((4, 130), 0, 6, 15, torch.int32)
    src = random_tensor((5, 140), seed=16, low=0.5, high=1.5)
    check_against_eager(lambda a, i, s: a.scatter_reduce(0, i, s, reduce, include_self=include_self), x, index, src)
    check_against_eager(lambda a, i, s: a.scatter_reduce(1, i, s, reduce, include_self=include_self), x,
                        _indices((4, 130), 0, 131, 17), src)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scatter_forms(dtype):
    x = random_tensor((7, 129), dtype, seed=18)
    index = _indices((3, 129), 0, 7, 19)
    src = random_tensor((129, 3), dtype, seed=20).t()  # non-contiguous src
    reference = dtype == torch.bfloat16
    check_against_eager(lambda a, i, s: a.scatter(0, i, s), x, index, src)
    check_against_eager(lambda a, i: a.scatter(0, i, -2.5), x, index)
    check_against_eager(lambda a, i, s: a.scatter_add(0, i, s), x, index, src, fp32_reference=reference)
    check_against_eager(lambda a, i, s: a.scatter(0, i, s, reduce="add"), x, index, src, fp32_reference=reference)
    check_against_eager(lambda a, i, s: a.scatter(0, i, s, reduce="multiply"), x, index, src,
                        fp32_reference=reference)
    check_against_eager(lambda a, i: a.scatter(1, i, 3.0, reduce="multiply"), x, _indices((7, 40), 0, 129, 21))


@pytest.mark.parametrize("accumulate", [False, True])
def test_put(accumulate):
    x = random_tensor((6, 50), seed=22)
    index = _indices(300, -300, 300, 23)
    check_against_eager(lambda a, i, s: a.put(i, s, accumulate=accumulate), x, index, random_tensor(300, seed=24))


def _reversed_indirect_writes(monkeypatch):
    """Make every indirect DMA write its elements last-to-first (hardware gives no order within one DMA)."""
    write = NkiTensor.write

    def reversed_write(self, values):
        if self.indirect is None:
            return write(self, values)
        self.storage.written = True
        index = self._indirect_indices().reshape(-1)
        self._flat()[index[::-1]] = np.broadcast_to(values, self.shape).reshape(-1)[::-1]

    monkeypatch.setattr(NkiTensor, "write", reversed_write)


@pytest.mark.parametrize("reverse", [False, True])
def test_duplicates_do_not_depend_on_the_write_order_within_a_dma(reverse, monkeypatch):
    if reverse:
        _reversed_indirect_writes(monkeypatch)
    x = random_tensor((3, 4), seed=25)
    index = _indices(300, 0, 3, 26)  # ~100 writes per row, within and across tiles
    values = random_tensor((300, 4), seed=27)
    check_against_eager(lambda a, i, v: torch.index_put(a, (i,), v), x, index, values)  # the last write wins
    check_against_eager(lambda a, i, v: a.index_copy(0, i, v), x, index, values)
    check_against_eager(lambda a, i, v: torch.index_put(a, (i,), v, accumulate=True), x, index, values)
    element = _indices((2, 200), 0, 3, 28)
    check_against_eager(lambda a, i, v: a.scatter(0, i, v), x[:, :1].expand(3, 200).contiguous(), element,
                        random_tensor((2, 200), seed=29))
    check_against_eager(lambda a, i, v: a.scatter_reduce(0, i, v, "amax"), x[:, :1].expand(3, 200).contiguous(),
                        element, random_tensor((2, 200), seed=30))


def test_special_values():
    x = torch.tensor([[0.0, -0.0, 1.0], [INF, -INF, NAN], [-0.0, 2.0, 3.0], [5.0, -0.0, 0.0]])
    values = torch.tensor([[INF, -0.0, NAN], [-0.0, -0.0, -0.0], [-INF, 1.0, 2.0], [NAN, -0.0, INF]])
    index = torch.tensor([0, 2, 0, 3])
    for accumulate in (False, True):
        check_against_eager(lambda a, i, v: torch.index_put(a, (i,), v, accumulate=accumulate), x, index, values)
    for reduce in ("sum", "prod", "amax", "amin", "mean"):
        for include_self in (True, False):
            check_against_eager(lambda a, i, v: a.scatter_reduce(0, i, v, reduce, include_self=include_self), x,
                                index.view(4, 1).expand(4, 3).contiguous(), values)
    zeros = torch.full((2, 3), -0.0)
    region = compile_region(trace(lambda a, i, v: torch.index_put(a, (i,), v, accumulate=True), zeros,
                                  torch.tensor([1, 1]), zeros), [zeros, torch.tensor([1, 1]), zeros])
    (out,) = region(zeros, torch.tensor([1, 1]), zeros)
    assert torch.signbit(out).all()  # -0.0 + -0.0 + -0.0 stays -0.0, as in eager


def test_empty_index_is_a_copy():
    x = random_tensor((5, 3), seed=31)
    empty = torch.zeros(0, dtype=torch.int64)
    check_against_eager(lambda a, i, v: torch.index_put(a, (i,), v, accumulate=True), x, empty, torch.zeros(0, 3))
    check_against_eager(lambda a, i, v: a.index_copy(0, i, v), x, empty, torch.zeros(0, 3))
    check_against_eager(lambda a, i, v: a.scatter_add(1, i, v), x, empty.view(0, 1), torch.zeros(0, 1))


def _run_compiled(fn, *inputs):
    torch._dynamo.reset()
    return torch.compile(fn, backend="neuron", options={"fallback": "silent"})(*inputs)


OUT_OF_RANGE = [
    (lambda a, i, v: torch.index_put(a, (i,), v), [0, 6, 1]),
    (lambda a, i, v: torch.index_put(a, (i,), v, accumulate=True), [0, -7, 1]),
    (lambda a, i, v: a.index_copy(0, i, v), [0, -1, 1]),
    (lambda a, i, v: a.index_add(0, i, v), [0, 6, 1]),
    (lambda a, i, v: a.index_reduce(0, i, v, "amax"), [0, 2**31 - 1, 1]),
    (lambda a, i, v: a.scatter(0, i.view(3, 1).expand(3, 4), v), [0, -1, 1]),
    (lambda a, i, v: a.scatter_add(0, i.view(3, 1).expand(3, 4), v), [6, 1, 1]),
    (lambda a, i, v: a.put(i, v[:, 0]), [0, 24, 1]),
    (lambda a, i, v: a.index_fill(1, i, 2.0), [0, -5, 1]),
]


@pytest.mark.parametrize("case", range(len(OUT_OF_RANGE)))
def test_out_of_range_indices_raise_like_eager(case):
    fn, bad = OUT_OF_RANGE[case]
    x, values, index = random_tensor((6, 4), seed=32), random_tensor((3, 4), seed=33), torch.tensor(bad)
    with pytest.raises((IndexError, RuntimeError)) as eager:
        fn(x, index, values)
    with pytest.raises(type(eager.value), match=re.escape(str(eager.value))):  # eager's own error, via the fallback
        _run_compiled(fn, x, index, values)
    region = compile_region(trace(fn, x, torch.tensor([0, 1, 2]), values), [x, index, values])
    with pytest.raises(Exception, match="err_tensor_access_out_of_bound"):  # the kernel never writes elsewhere
        region(x, index, values)


def test_bool_mask_index_put_with_values_constant_along_the_selection():
    # x[mask] = v where v does not vary along the selected elements: where(mask, v, x) whatever the mask holds
    x = random_tensor((5, 4, 3), seed=50)
    row_mask = torch.tensor([True, False, True, True, False])
    for dtype in (torch.float32, torch.bfloat16):
        a = x.to(dtype)
        check_against_eager(lambda a, m, v: aten.index_put(a, [m], v), a, row_mask, random_tensor((4, 3), dtype, 51))
        check_against_eager(lambda a, m, v: aten.index_put(a, [m], v, True), a, row_mask,
                            random_tensor((1, 4, 1), dtype, 52))
        check_against_eager(lambda a, m, v: aten.index_put(a, [None, m], v), a, row_mask[:4],
                            torch.tensor([INF, NAN, -0.0], dtype=dtype))
        check_against_eager(lambda a, m, v: aten.index_put(a, [m], v), a, torch.zeros(5, 4, dtype=torch.bool),
                            torch.tensor(2.0, dtype=dtype))
    check_through_backend(lambda a, m: a.masked_fill(m, 0.5) + a.clone().index_put_((m,), torch.tensor(-1.0)), x,
                          random_tensor((5, 4, 3), seed=53) > 0)


def test_static_kv_cache_update_inside_a_compiled_function():
    cache_k, cache_v = random_tensor((2, 3, 16, 8), seed=34), random_tensor((2, 3, 16, 8), seed=35)
    new_k, new_v = random_tensor((2, 3, 4, 8), seed=36), random_tensor((2, 3, 4, 8), seed=37)
    positions = torch.tensor([5, 6, 7, 8])

    def step(k_cache, v_cache, k, v, pos):
        k_cache.index_copy_(2, pos, k)
        v_cache[:, :, pos] = v
        return (k_cache * 2.0).sum(), v_cache[:, :, :9].mean()

    expected_k, expected_v = cache_k.clone(), cache_v.clone()
    want = step(expected_k, expected_v, new_k, new_v, positions)
    got_k, got_v = cache_k.clone(), cache_v.clone()
    got, stats = compile_with_backend(step, got_k, got_v, new_k, new_v, positions)
    torch.testing.assert_close(got, want)
    assert torch.equal(got_k, expected_k) and torch.equal(got_v, expected_v)  # the caches were written in place
    assert stats["nki_nodes"] > 0 and stats["fallback_nodes"] == 0, stats["fallback_reasons"]


def test_through_the_backend_every_node_in_kernels():
    x, source = random_tensor((10, 6), seed=43), random_tensor((12, 6), seed=44)
    index = _indices(12, 0, 10, 45)

    def fn(a, i, s, negative):
        added = a.index_add(0, i, s, alpha=0.5).index_fill(1, negative, 0.25)
        return added.scatter_reduce(0, i.view(12, 1).expand(12, 6), s, "amax", include_self=False) * 2.0

    check_through_backend(fn, x, index, source, torch.tensor([-6, 2]), eager_nodes=0)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_scatters(data):
    rank = data.draw(st.integers(1, 3))
    shape = tuple(data.draw(st.lists(st.integers(1, 7), min_size=rank, max_size=rank)))
    dim = data.draw(st.integers(0, rank - 1))
    count = data.draw(st.sampled_from([1, 3, 127, 129]))
    pattern = data.draw(st.sampled_from(["random", "same", "sorted"]))
    seed = data.draw(st.integers(0, 1000))
    index = _indices(count, 0, shape[dim], seed, data.draw(st.sampled_from([torch.int32, torch.int64])))
    if pattern == "same":
        index = torch.full_like(index, shape[dim] - 1)
    elif pattern == "sorted":
        index = index.sort().values
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16]))
    x = random_tensor(shape, dtype, seed=seed)
    source_shape = shape[:dim] + (count,) + shape[dim + 1:]
    source = random_tensor(source_shape, dtype, seed=seed + 1)
    op = data.draw(st.sampled_from(["index_copy", "index_add", "index_put", "amax", "mean"]))
    reference = dtype == torch.bfloat16 and op in ("index_add", "mean")
    if op == "index_copy":  # eager's index_copy takes int64 indices only
        check_against_eager(lambda a, i, s: a.index_copy(dim, i, s), x, index.long(), source)
    elif op == "index_add":
        check_against_eager(lambda a, i, s: a.index_add(dim, i, s), x, index, source, fp32_reference=reference)
    elif op == "index_put":
        indices = (None,) * dim + (index - shape[dim],)  # negative indices
        check_against_eager(lambda a, i, s: aten.index_put(a, [*indices[:-1], i], s), x, indices[-1], source)
    else:
        check_against_eager(lambda a, i, s: a.index_reduce(dim, i, s, op, include_self=False), x, index, source,
                            fp32_reference=reference)


def test_a_scatter_takes_no_epilogue():
    x = random_tensor((6, 4), seed=38)
    region = check_against_eager(lambda a, i, v: torch.index_put(a, (i,), v).exp(), x, torch.tensor([1, 1]),
                                 random_tensor((2, 4), seed=39))
    assert any("a scatter kernel (indirect DMA) takes no epilogue" in line for line in region.fusion_decisions)


def test_unsupported_reasons():
    def reasons(fn, *inputs):
        gm = trace(fn, *inputs)
        return [unsupported_reason(node) for node in gm.graph.nodes if node.op == "call_function"]

    x = random_tensor((4, 3), seed=40)
    mask = torch.tensor([True, False, True, False])
    assert "vary along the selected" in reasons(lambda a, m, v: torch.index_put(a, (m,), v), x, mask,
                                                random_tensor((2, 3), seed=49))[-1]
    assert "with other indices" in reasons(lambda a, m, i: aten.index_put(a, [m, i], torch.tensor(1.0)), x, mask,
                                           torch.tensor([0, 1]))[-1]
    cube = random_tensor((4, 3, 2), seed=41)
    two = torch.tensor([0, 1])
    assert "non-adjacent" in reasons(lambda a, i: aten.index_put(a, [i, None, i], torch.tensor(1.0)), cube, two)[-1]
    assert "shapes differ" in reasons(lambda a, i, s: a.put(i, s), x, two, torch.ones(1, 2))[-1]
    ints = torch.arange(12).view(4, 3)
    assert "self dtype" in reasons(lambda a, i: torch.index_put(a, (i,), torch.tensor(1)), ints, two)[-1]
    assert "non-contiguous self" in reasons(lambda a, i, s: a.put(i, s), x.t(), two, torch.ones(2))[-1]
    big = random_tensor((5000, 130), seed=42)  # 5000 x 2 tiles of 128 elements
    assert "copy and scatter tiles" in reasons(lambda a, i, s: a.scatter(0, i, s), big,
                                               torch.zeros(5000, 130, dtype=torch.int64), big)[-1]


def test_row_scatters_move_whole_rows_per_partition():
    # index_put / index_copy of rows: one partition per index, the row on the free axis (two DMAs per tile)
    x, values = random_tensor((40, 64), seed=46), random_tensor((130, 64), seed=47)
    index = _indices(130, -40, 40, 48)
    region = check_against_eager(lambda a, i, v: torch.index_put(a, (i,), v), x, index, values)
    (kernel,) = region.kernels
    assert "picked[0:rows, 0:64]" in kernel.source and "for o0 in" not in kernel.source
    region = check_against_eager(lambda a, i, v: a.index_copy(1, i, v), x.t(), index % 40, values.t())
    assert "picked[0:rows, 0:64]" not in region.kernels[0].source  # dim 1 of x.t(): one element per partition

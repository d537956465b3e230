"""Indexing lowerings (index_select, embedding, index.Tensor gathers) and the int32 kernel dtype, vs eager."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lowering_harness import check_against_eager, random_tensor, trace

import neuron_compile
from neuron_compile.pipeline import compile_region
from neuron_compile.lowering import unsupported_reason


def _indices(count, size, seed, dtype=torch.int64):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, size, (count,), generator=generator).to(dtype)


@pytest.mark.parametrize("count", [1, 127, 128, 129])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_index_select_rows(count, dtype):
    x = random_tensor((40, 7), seed=count)
    check_against_eager(lambda a, i: torch.index_select(a, 0, i), x, _indices(count, 40, count, dtype))


def test_index_select_inner_dim_repeated_and_0d_and_bf16():
    x = random_tensor((3, 9, 5), seed=1)
    check_against_eager(lambda a, i: torch.index_select(a, 1, i), x, torch.tensor([8, 0, 8, 8, 3]))
    check_against_eager(lambda a, i: torch.index_select(a, 2, i), x, torch.tensor(4))
    check_against_eager(lambda a, i: torch.index_select(a, 0, i), x.to(torch.bfloat16), torch.tensor([2, 0]))


def test_index_select_strided_source():
    x = random_tensor((12, 20), seed=2).t()  # (20, 12), strides (1, 20)
    check_against_eager(lambda a, i: torch.index_select(a, 0, i), x, _indices(130, 20, 3))


def test_embedding_2d_indices_and_special_values():
    weight = random_tensor((50, 600), seed=4)
    weight[3] = torch.tensor([float("inf"), float("nan"), -0.0] * 200)
    indices = _indices(2 * 129, 50, 5).reshape(2, 129)
    indices[1, 7] = 3
    check_against_eager(lambda w, i: torch.nn.functional.embedding(i, w), weight, indices)


def test_index_tensor_wraps_negative_indices():
    x = random_tensor((6, 10), seed=6)
    check_against_eager(lambda a, i: a[:, i], x, torch.tensor([[1, -1], [-10, 9]]))
    check_against_eager(lambda a, i: a[i], x, torch.tensor([-6, 5, 0, -1]))


def test_int32_view_of_index_is_free():
    x = random_tensor((8, 3), seed=7)
    region = check_against_eager(lambda a, i: a[i.view(-1)], x, torch.tensor([[1, 2], [7, -8]], dtype=torch.int32))
    assert region.nki_nodes == 2  # the view and the gather


def _run_compiled(fn, *inputs, fallback):
    torch._dynamo.reset()
    return torch.compile(fn, backend="neuron", options={"fallback": fallback})(*inputs)


@pytest.mark.parametrize("bad", [10, -1, 2**31 - 1, -(2**31)])
def test_out_of_range_index_raises_like_eager(bad):
    x = random_tensor((10, 4), seed=8)
    index = torch.tensor([0, bad, 3])
    with pytest.raises(IndexError):
        torch.index_select(x, 0, index)
    with pytest.raises(IndexError):
        _run_compiled(lambda a, i: torch.index_select(a, 0, i), x, index, fallback="silent")
    region = compile_region(trace(lambda a, i: torch.index_select(a, 0, i), x, torch.tensor([0, 1, 2])), [x, index])
    with pytest.raises(Exception, match="err_tensor_access_out_of_bound"):  # the kernel never reads garbage
        region(x, index)


def test_out_of_range_inner_dim_never_reads_the_next_row():
    # Column 4 of row r is element 5 * r + 4 + 1 = row r + 1's column 0 in memory: must still raise.
    x = random_tensor((3, 4), seed=9)
    region = compile_region(trace(lambda a, i: torch.index_select(a, 1, i), x, torch.tensor([0])), [x, torch.tensor([0])])
    with pytest.raises(Exception, match="err_tensor_access_out_of_bound"):
        region(x, torch.tensor([4]))
    with pytest.raises(IndexError):
        _run_compiled(lambda a, i: a[:, i], x, torch.tensor([-5]), fallback="silent")


def test_int64_values_beyond_int32_run_eagerly():
    x = random_tensor((10, 4), seed=10)
    index = torch.tensor([2**40, 1])
    gm = trace(lambda a, i: torch.index_select(a, 0, i), x, torch.tensor([0, 1]))
    region = compile_region(gm, [x, index])
    with pytest.raises(Exception, match="beyond int32"):
        region(x, index)
    with pytest.raises(IndexError):  # eager's own error, through the eager fallback
        _run_compiled(lambda a, i: torch.index_select(a, 0, i), x, index, fallback="silent")


def test_unsupported_reasons():
    x = random_tensor((4, 3), seed=11)

    def reasons(fn, *inputs):
        gm = trace(fn, *inputs)
        return [unsupported_reason(node) for node in gm.graph.nodes if node.op == "call_function"]

    # int arithmetic on values nothing bounds (a graph input) stays eager: fp32 would round beyond 2**24
    (reason,) = reasons(lambda a, i: a + i, x, torch.tensor([1, 2, 3]))
    assert "int64 values of arg1_1 not proved within +-2**24" in reason
    (reason,) = reasons(lambda a, i: torch.index_select(a, 0, i), x.to(torch.int32), torch.tensor([1]))
    assert "source dtype" in reason
    (reason,) = reasons(lambda a, i: torch.index_select(a, 0, i), random_tensor((4, 20000)), torch.tensor([1]))
    assert "bytes" in reason
    (reason,) = reasons(lambda a, i, j: a[i, :, j], random_tensor((2, 3, 4)), torch.tensor([1]), torch.tensor([0]))
    assert "non-adjacent" in reason
    (reason,) = reasons(lambda a, i: torch.index_select(a, 0, i), torch.zeros(1).expand(2**24), torch.tensor([1]))
    assert "2^24" in reason


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_gather_elements(dim):
    x = random_tensor((200, 3, 5), seed=12).transpose(0, 1)  # (3, 200, 5), non-contiguous
    shape = [3, 129, 4]
    index = torch.randint(0, x.shape[dim], shape, generator=torch.Generator().manual_seed(dim))
    check_against_eager(lambda a, i: torch.gather(a, dim, i), x, index)
    check_against_eager(lambda a, i: torch.gather(a, dim, i), x.to(torch.bfloat16), index.to(torch.int32))


def test_gather_1d_repeated_and_special_values():
    x = torch.tensor([float("inf"), float("nan"), -0.0, 1.5, -2.0])
    check_against_eager(lambda a, i: torch.gather(a, 0, i), x, torch.tensor([2, 2, 1, 0, 4, 4, 1]))


@pytest.mark.parametrize("bad", [-1, 5, 2**31 - 1])
def test_gather_out_of_range_raises(bad):
    x = random_tensor((4, 5), seed=13)
    index = torch.tensor([[0, bad], [1, 2]])
    with pytest.raises(RuntimeError):
        torch.gather(x, 1, index)
    region = compile_region(trace(lambda a, i: torch.gather(a, 1, i), x, torch.zeros(2, 2, dtype=torch.int64)),
                            [x, index])
    with pytest.raises(Exception, match="err_tensor_access_out_of_bound"):
        region(x, index)
    with pytest.raises(RuntimeError):
        _run_compiled(lambda a, i: torch.gather(a, 1, i), x, index, fallback="silent")


@pytest.mark.parametrize("count", [1, 127, 128, 129, 1000])
def test_arange_float(count):
    x = random_tensor((count,), seed=count)
    check_against_eager(lambda a: a + torch.arange(count, dtype=torch.float32), x)
    if count <= 256:  # beyond, eager's bf16 arange is not the exact value rounded once: declined (reason test)
        check_against_eager(lambda a: a * torch.arange(-3, count - 3, 1, dtype=torch.bfloat16), x.to(torch.bfloat16))


def test_arange_fractional_step_and_reasons():
    x = random_tensor((20,), seed=14)
    region = check_against_eager(lambda a: a - torch.arange(-3, 7, 0.5, dtype=torch.float32), x)
    assert region.nki_nodes == 2

    def reason(fn):
        gm = trace(fn, x)
        (node,) = [node for node in gm.graph.nodes if node.target is torch.ops.aten.arange.start_step]
        return unsupported_reason(node)

    assert "not exact" in reason(lambda a: torch.arange(0, 1, 0.1, dtype=torch.float32))  # 0.1 is inexact
    assert "not exact" in reason(lambda a: torch.arange(-3, 997, 1, dtype=torch.bfloat16))
    assert reason(lambda a: torch.arange(0, 5, 1)) is None  # int results: exact, the value range proves it
    assert "beyond +-2**24" in reason(lambda a: torch.arange(0, 2**26, 2**22))
    assert "fractional" in reason(lambda a: torch.arange(0, 5, 1.5, dtype=torch.int64))


def test_index_tensor_several_indices_broadcast_and_wrap():
    x = random_tensor((5, 6, 7), seed=15).transpose(0, 2)  # (7, 6, 5), non-contiguous
    rows = torch.tensor([[0], [-7], [6]])
    cols = torch.randint(-6, 6, (1, 129), generator=torch.Generator().manual_seed(3))
    check_against_eager(lambda a, i, j: a[i, j], x, rows, cols)  # broadcast (3, 129) x trailing 5
    check_against_eager(lambda a, i, j: a[:, i, j], x, torch.tensor([1, -1, 0]), torch.tensor([4], dtype=torch.int32))
    check_against_eager(lambda a, i, j, k: a[i, j, k], x, rows, cols, torch.tensor([-5, 4, 0]).view(3, 1))


def test_index_tensor_several_indices_out_of_range_raises():
    x = random_tensor((4, 5), seed=16)
    for bad in ([0, 5], [-6, 0]):
        index = torch.tensor(bad)
        region = compile_region(trace(lambda a, i, j: a[i, j], x, torch.tensor([0, 1]), torch.tensor([0, 1])),
                                [x, torch.tensor([1, 2]), index])
        with pytest.raises(Exception, match="err_tensor_access_out_of_bound"):
            region(x, torch.tensor([1, 2]), index)
        with pytest.raises(IndexError):
            _run_compiled(lambda a, i, j: a[i, j], x, torch.tensor([1, 2]), index, fallback="silent")


def scaled_embedding(ids, weight, scale):
    """Gemma's embedding: the gathered rows times sqrt(hidden) (a 0-d buffer), one kernel."""
    return torch.nn.functional.embedding(ids, weight) * scale.to(weight.dtype)


@settings(max_examples=12, deadline=None)
@given(rows=st.sampled_from([1, 127, 128, 129, 300]), width=st.sampled_from([1, 96, 700]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_a_row_gather_takes_its_elementwise_consumers_as_an_epilogue(rows, width, dtype):
    ids = torch.randint(0, 50, (1, rows), generator=torch.Generator().manual_seed(rows))
    weight, scale = random_tensor((50, width), dtype, seed=1), torch.tensor(width ** 0.5)
    region = check_against_eager(scaled_embedding, ids, weight, scale)
    gathers = [kernel for kernel in region.kernels if kernel.name.startswith("gather_kernel")]
    assert len(gathers) == 1 and "mul(result" in gathers[0].source  # the product is the gather's epilogue
    assert not any(kernel.name.startswith("pointwise") and "mul" in kernel.source for kernel in region.kernels)
    # a row read per element of another tensor, and a store of the rows themselves besides the epilogue's
    offsets = random_tensor((1, rows, width), dtype, seed=2)
    check_against_eager(lambda i, w, o: (torch.nn.functional.embedding(i, w) + o, torch.nn.functional.embedding(i, w)),
                        ids, weight, offsets)


def test_an_out_of_range_index_still_raises_with_an_epilogue():
    weight, scale = random_tensor((10, 4), seed=3), torch.tensor(2.0)
    region = compile_region(trace(scaled_embedding, torch.tensor([[0, 1]]), weight, scale),
                            [torch.tensor([[0, 1]]), weight, scale])
    with pytest.raises(Exception, match="err_tensor_access_out_of_bound"):
        region(torch.tensor([[0, 10]]), weight, scale)


def test_an_element_gather_takes_no_epilogue():
    x, index = random_tensor((6, 5), seed=4), torch.tensor([[0, 4, 1], [2, 2, 3]])
    region = check_against_eager(lambda a, i: torch.gather(a, 1, i) * 2.0, x, index)
    assert any("an element gather (one element per partition) takes no epilogue" in decision
               for decision in region.fusion_decisions)


def test_an_epilogue_too_wide_for_sbuf_beside_the_rows_stays_its_own_kernel():
    """16384 fp32 per row: the gathered rows fit, not with the epilogue's tiles beside them."""
    ids, weight = torch.tensor([[3, 1, 4, 1, 5]]), random_tensor((8, 16384), seed=5)
    region = check_against_eager(scaled_embedding, ids, weight, torch.tensor(2.0))
    assert [kernel.name.split("_kernel")[0] for kernel in region.kernels] == ["gather", "pointwise"]
    assert any("would not fit the target's SBUF" in decision for decision in region.fusion_decisions), \
        region.fusion_decisions


@settings(max_examples=12, deadline=None)
@given(rows=st.sampled_from([1, 127, 128, 129, 300]), width=st.sampled_from([1, 100, 129, 640]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_rows_gathered_into_the_output_directly_match_eager(rows, width, dtype):
    """An embedding with no epilogue: the indirect DMA writes the output itself (no SBUF stop, no store)."""
    ids = torch.randint(-3, 50, (1, rows), generator=torch.Generator().manual_seed(rows)).clamp(min=0)
    weight = random_tensor((50, width), dtype, seed=width)
    region = check_against_eager(torch.nn.functional.embedding, ids, weight)
    (kernel,) = region.kernels
    assert kernel.source.count("nisa.dma_copy(") == 2 and "gathered" not in kernel.source  # the indices, the rows


def test_the_gather_follows_its_table_updated_in_place():
    torch._dynamo.reset()
    table = torch.nn.Embedding(50, 129).to(torch.bfloat16)
    compiled = torch.compile(table, backend="neuron")
    ids = torch.tensor([[0, 49, 7, 7, 1]])
    neuron_compile.reset_stats()
    for _ in range(3):
        with torch.no_grad():
            torch.testing.assert_close(compiled(ids), table(ids), rtol=0, atol=0)
            table.weight.mul_(-2.0).add_(1.0)  # as an optimizer step: the same tensor, new values
    stats = neuron_compile.stats()
    assert stats["fallback_nodes"] == 0 and stats["kernels_launched"] == 3


@pytest.mark.parametrize("bad", [50, -1, 2**31 - 1, -(2**31)])
def test_an_out_of_range_index_never_lands_in_range_of_a_larger_table(bad):
    """The table is a slice of a larger buffer: an index past the slice must not read the rows after it."""
    storage = random_tensor((80, 4), seed=6)
    gm = trace(lambda t, i: torch.nn.functional.embedding(i, t[:50]), storage, torch.tensor([0, 1]))
    region = compile_region(gm, [storage, torch.tensor([0, 1])])
    with pytest.raises(Exception, match="err_tensor_access_out_of_bound"):
        region(storage, torch.tensor([0, bad]))

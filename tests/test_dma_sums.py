"""Stored sums added by the DMA engines (codegen/dma_sums.py): a pointwise kernel bound by a compute engine stores
its final ``add`` with one ``nisa.dma_compute`` and equals eager (and, bit for bit, the same kernel with the add on
the ALU) over 1, 127, 128, 129 and ragged shapes, fp32 and bf16; a DMA-bound kernel, or one whose busiest engine is
not the add's, keeps its add and its store; a sum that the tile also reads on chip is never moved; the choice weighs
the engines against the DMA as the cost model charges them."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowering_harness import check_against_eager, compile_and_run, random_tensor
from neuron_compile import ir
from neuron_compile.codegen import dma_sums
from neuron_compile.hardware import get_target
from neuron_compile.kinds import pointwise


def engine_bound(x, y):
    """GpSimd's rsqrt and the square root's multiply, two multiplies, then the add, on three tensors' bytes."""
    return torch.sqrt(x) * y + x * y


def rsqrt_bound(x, y):
    """GpSimd's two 4-cycle rsqrts bound the tile (no other engine runs them; a reciprocal would be shared with
    VectorE by columns); the multiply and the add fit beside them on VectorE."""
    return torch.rsqrt(x) * torch.rsqrt(y) + x


def dma_bound(x, y):
    return x + y


def _sources(region) -> str:
    return "\n".join(kernel.source for kernel in region.kernels)


def _inputs(shape, dtype):
    return random_tensor(shape, dtype, seed=1, low=0.5, high=2.0), random_tensor(shape, dtype, seed=2)


BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


@settings(max_examples=8, deadline=None)
@given(shape=st.sampled_from([(1,), (127,), (128,), (129,), (129, 130), (130, 1100), (3, 129, 700)]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_an_engine_bound_sum_matches_eager_and_the_alu_add_bit_for_bit(shape, dtype):
    check_against_eager(engine_bound, *_inputs(shape, dtype))
    _, (dma_sum,) = compile_and_run(engine_bound, *_inputs(shape, dtype))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pointwise, "summed_operands", lambda store: None)
        alu_region, (alu_sum,) = compile_and_run(engine_bound, *_inputs(shape, dtype))
    assert "dma_compute" not in _sources(alu_region)
    assert torch.equal(dma_sum.view(BITS[dtype]), alu_sum.view(BITS[dtype]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_dma_adds_where_an_engine_bounds_the_kernel(dtype):
    region, _ = compile_and_run(engine_bound, *_inputs((130, 1100), dtype))
    source = _sources(region)
    assert "nisa.dma_compute(" in source and " op=nl.add" not in source


@pytest.mark.parametrize("fn", [dma_bound, rsqrt_bound])
def test_where_the_add_is_not_on_the_busiest_engine_it_stays(fn):
    region = check_against_eager(fn, *_inputs((130, 1100), torch.bfloat16))
    source = _sources(region)
    assert "nisa.dma_compute(" not in source and " op=nl.add" in source


LAYOUT = ir.Layout((4, 8), (8, 1), 0)


def _store(expr, dtype="bfloat16", name="out"):
    return ir.Store(ir.Buffer(name, dtype, LAYOUT), expr, LAYOUT)


def _load(name, dtype="bfloat16"):
    return ir.Load(name, LAYOUT, dtype)


def _cast(expr, dtype):
    return ir.Op("cast", (expr,), dtype)


def test_which_stores_are_sums():
    a, b = _cast(_load("a"), "float32"), ir.op("mul", _load("b", "float32"), 2.0)
    total = ir.op("add", a, b)
    assert dma_sums.summed_operands(_store(_cast(total, "bfloat16"))) == (a, b)
    assert dma_sums.summed_operands(_store(total, "float32")) == (a, b)  # an fp32 add stored as it is
    assert dma_sums.summed_operands(_store(total, "bfloat16")) is None  # rounded by a cast the store does not say
    assert dma_sums.summed_operands(_store(_cast(total, "float16"))) is None  # another dtype
    assert dma_sums.summed_operands(_store(ir.op("mul", a, b), "float32")) is None
    assert dma_sums.summed_operands(_store(_cast(total, "int32"), "int32")) is None


def test_a_sum_read_on_chip_is_not_moved():
    total = ir.op("add", _load("a", "float32"), _load("b", "float32"))
    stored, reader = _store(total, "float32"), _store(ir.op("mul", total, 2.0), "float32", "twice")
    read = dma_sums.read_on_chip((stored, reader))
    assert total in read
    assert total not in dma_sums.read_on_chip((stored,))


def test_the_choice_weighs_the_busiest_engine_against_the_transfers():
    target = get_target("trn2")
    dma_only = dma_sums.tile_time_ns({}, [2, 2, 2], 128, 512, target)
    assert dma_only > 0 and dma_sums.tile_time_ns({"vector": 0.5}, [2, 2, 2], 128, 512, target) == dma_only
    engine = dma_sums.tile_time_ns({"vector": 20.0, "gpsimd": 5.0}, [2, 2, 2], 128, 512, target)
    assert engine == pytest.approx(20.0 * 512 / target.vector_ghz)
    # a transfer of the sum's 6 bytes per element costs what a 2-byte and a 4-byte one move, beside one fixed cost
    assert dma_sums.tile_time_ns({}, [6], 128, 512, target) < dma_sums.tile_time_ns({}, [2, 4], 128, 512, target)

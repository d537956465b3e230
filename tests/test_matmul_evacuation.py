"""The product of a bf16 matmul stored as it is leaves PSUM as bf16 (kinds/matmul.py ``evacuated_dtype``): the
PSUM -> SBUF copy rounds it once, where an fp32 copy and a cast for the store did the same in two passes. Against
eager and bit for bit against the fp32 evacuation, over sizes 1, 127, 128, 129 and ragged ones, in the resident
(a weight gradient, ``dy.t() @ x``) and the TensorE-transposing forms; fp32 products, a product with an epilogue
and a paired product keep the fp32 evacuation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lowering_harness import check_against_eager, compile_and_run, random_tensor

from neuron_compile import ir
from neuron_compile.kinds import matmul
from neuron_compile.kinds.matmul import evacuated_dtype

SIZES = st.sampled_from([1, 127, 128, 129, 300])


def weight_gradient(dy, x):
    return dy.t() @ x


def projection(x, w):
    return x @ w.t()


def _sources(region) -> str:
    return "\n".join(kernel.source for kernel in region.kernels)


def _matmul_lines(region) -> list[str]:
    return [line.strip() for line in _sources(region).splitlines() if line.strip().startswith("nisa.")]


@settings(max_examples=10, deadline=None)
@given(m=SIZES, n=SIZES, k=st.sampled_from([1, 129, 256]), fn=st.sampled_from([weight_gradient, projection]))
def test_a_bf16_product_stored_as_it_is_leaves_psum_as_bf16(m, n, k, fn):
    shapes = ((k, m), (k, n)) if fn is weight_gradient else ((m, k), (n, k))
    inputs = [random_tensor(shape, torch.bfloat16, seed=seed) for seed, shape in enumerate(shapes)]
    region = check_against_eager(fn, *inputs)
    assert not any(line.startswith("nisa.tensor_copy(dst=as_bfloat16") for line in _matmul_lines(region))
    direct = region(*inputs)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(matmul, "evacuated_dtype", lambda node: "float32")
        fp32_region, through_fp32 = compile_and_run(fn, *inputs)
    assert any(line.startswith("nisa.tensor_copy(dst=as_bfloat16") for line in _matmul_lines(fp32_region))
    for got, want in zip(direct if isinstance(direct, tuple) else (direct,),
                         through_fp32 if isinstance(through_fp32, tuple) else (through_fp32,)):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_an_epilogue_or_an_fp32_product_keeps_the_fp32_evacuation():
    def with_bias(x, w, b):
        return x @ w.t() + b

    shapes = [(130, 64), (96, 64), (96,)]
    inputs = [random_tensor(shape, torch.bfloat16, seed=seed) for seed, shape in enumerate(shapes)]
    region = check_against_eager(with_bias, *inputs)
    assert "dtype=nl.float32, buffer=nl.sbuf" in _sources(region)
    fp32 = [random_tensor(shape, torch.float32, seed=seed) for seed, shape in enumerate([(64, 130), (64, 96)])]
    region = check_against_eager(weight_gradient, *fp32)
    assert not any(line.startswith("nisa.tensor_copy(dst=as_") for line in _matmul_lines(region))


LAYOUT = ir.Layout((4, 8), (8, 1), 0)


def _node(*stores: ir.Store, paired: bool = False) -> ir.MatMul:
    operand = ir.Load("a", ir.Layout((4, 2), (2, 1), 0), "bfloat16")
    return ir.MatMul("mm", (1, 4, 8), 2, operand, operand, stores, b2=operand if paired else None)


def _store(expr, dtype="bfloat16", name="out"):
    return ir.Store(ir.Buffer(name, dtype, LAYOUT), expr, LAYOUT)


@pytest.mark.parametrize("stores, paired, want", [
    ((_store(ir.Result()),), False, "bfloat16"),
    ((_store(ir.Op("cast", (ir.Result(),), "bfloat16")),), False, "bfloat16"),
    ((_store(ir.Result(), "float32"),), False, "float32"),
    ((_store(ir.op("add", ir.Result(), 1.0)),), False, "float32"),  # an epilogue computes in fp32
    ((_store(ir.Result()), _store(ir.Result(), "float32", "wide")), False, "float32"),  # two dtypes
    ((_store(ir.Result()),), True, "float32"),  # a paired product's epilogue reads both in fp32
])
def test_which_products_leave_psum_in_their_store_dtype(stores, paired, want):
    assert evacuated_dtype(_node(*stores, paired=paired)) == want

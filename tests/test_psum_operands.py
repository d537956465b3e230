"""Values a pointwise tile computes into PSUM for the tensor_tensors that read them (codegen/psum_operands.py): the
AdamW-like moments ``(g * c) * g + v * b`` and ``m + (g - m) * c`` equal eager (and, bit for bit, the SBUF form) over
1, 127, 128, 129 and ragged shapes, fp32 and bf16, with their scaled gradient in PSUM; a kernel whose busiest engine
the PSUM form does not relieve (GpSimd's rsqrts) keeps SBUF; the rules: no stored value, no value a sequence, a cast
or a square reads, one PSUM operand per reader, a tile wider than a bank or past the banks' budget takes none; a
product of two tiles goes there too (VectorE writes it), and AdamW's update keeps its DMA sum, whose operand could
have gone to PSUM."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowering_harness import check_against_eager, compile_and_run, random_tensor
import neuron_compile
from neuron_compile import ir
from neuron_compile.codegen.psum_operands import psum_operands
from neuron_compile.kinds import pointwise

BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


def moments(g, m, v):
    return (g * 0.001) * g + v * 0.999, m + (g - m) * 0.1


def rsqrt_bound(x, y):
    # GpSimd's ALU rsqrts, which no other engine runs (a reciprocal is shared with VectorE by columns)
    return torch.rsqrt(x) + torch.rsqrt(y) + (x * 2.0) * y


def _sources(region) -> str:
    return "\n".join(kernel.source for kernel in region.kernels)


def _inputs(shape, dtype, count=3):
    return [random_tensor(shape, dtype, seed=seed, low=0.5, high=2.0) for seed in range(count)]


@settings(max_examples=8, deadline=None)
@given(shape=st.sampled_from([(1,), (127,), (128,), (129,), (129, 130), (130, 300), (3, 129, 200)]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_moments_in_psum_match_eager_and_the_sbuf_form_bit_for_bit(shape, dtype):
    check_against_eager(moments, *_inputs(shape, dtype))
    _, in_psum = compile_and_run(moments, *_inputs(shape, dtype))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pointwise, "psum_operands", lambda *args: ())
        sbuf_region, in_sbuf = compile_and_run(moments, *_inputs(shape, dtype))
    assert "nl.psum" not in _sources(sbuf_region)
    for got, want in zip(in_psum, in_sbuf):
        assert torch.equal(got.view(BITS[dtype]), want.view(BITS[dtype]))


def test_the_scaled_values_go_to_psum_and_their_readers_to_vectore():
    # fp32 (bf16 tensors round each scaled value to bf16 first: a cast, which keeps it in SBUF)
    region, _ = compile_and_run(moments, *_inputs((130, 300), torch.float32))  # one 312-column tile fits a bank
    source = _sources(region)
    psum_tiles = [line.split(" = ")[0].strip() for line in source.splitlines() if "buffer=nl.psum)" in line]
    assert len(psum_tiles) == 2  # one per kernel: a second one would move GpSimd's share of the first to VectorE
    readers = [line for line in source.splitlines() if "nisa.tensor_tensor(" in line
               and any(f"={tile}[" in line for tile in psum_tiles)]
    assert len(readers) == 2 and not any("gpsimd" in line for line in readers)


def test_a_kernel_the_psum_form_does_not_relieve_keeps_sbuf():
    region = check_against_eager(rsqrt_bound, *_inputs((130, 300), torch.float32, 2))
    assert "nl.psum" not in _sources(region)


LAYOUT = ir.Layout((4, 8), (8, 1), 0)


def _store(expr, name="out"):
    return ir.Store(ir.Buffer(name, "float32", LAYOUT), expr, LAYOUT)


def _load(name):
    return ir.Load(name, LAYOUT, "float32")


def _chosen(*exprs, free=383, banks=3):
    return set(psum_operands(tuple(_store(expr, f"out{i}") for i, expr in enumerate(exprs)), free, 512, banks))


def test_which_values_go_to_psum():
    g, m = _load("g"), _load("m")
    scaled = ir.op("mul", g, 0.001)
    assert _chosen(ir.op("mul", scaled, m)) == {scaled}
    assert _chosen(ir.op("mul", scaled, m), scaled) == set()  # stored: the DMA cannot read PSUM
    assert _chosen(ir.op("mul", scaled, scaled)) == set()  # a square: ScalarE's activation
    assert scaled not in _chosen(ir.op("mul", scaled, g))  # (g * c) * g: ScalarE's square with a scale
    assert _chosen(ir.op("add", ir.op("reciprocal_alu", scaled), m)) == set()  # a sequence reads it
    assert _chosen(ir.op("add", ir.Op("cast", (scaled,), "bfloat16"), m)) == set()  # a cast reads it
    assert _chosen(ir.op("mul", scaled, m), free=513) == set()  # wider than a bank
    other = ir.op("add", m, 2.0)
    assert len(_chosen(ir.op("mul", scaled, other))) == 1  # at most one PSUM operand per reader
    many = [ir.op("mul", ir.op("mul", _load(f"x{i}"), 2.0), g) for i in range(5)]
    assert len(_chosen(*many)) == 3 and len(_chosen(*many, banks=0)) == 0


def test_a_product_of_two_tiles_goes_to_psum_too():
    g, v = _load("g"), _load("v")
    product = ir.op("mul", ir.op("mul", g, 0.001), g)
    assert product in _chosen(ir.op("add", v, product))  # VectorE writes it, the add reads it at one pass
    assert _chosen(ir.op("add", v, ir.Op("mul", (g, v), "bfloat16"))) == set()  # rounded to bf16: a cast


def test_adamw_update_keeps_its_dma_sum_and_moves_its_second_moment_product_to_psum(tmp_path):
    # the last product (m * 1 / denominator) could go to PSUM, but the DMA engines' sum reads it: the two are
    # weighed together, and the sum wins
    parameter = torch.nn.Parameter(random_tensor((130, 1100), torch.bfloat16, seed=0))
    parameter.grad = random_tensor((130, 1100), torch.bfloat16, seed=1)
    optimizer = torch.optim.AdamW([parameter], lr=1e-2, foreach=True)
    torch._dynamo.reset()
    with neuron_compile.config.patch(dump_dir=str(tmp_path), fallback="raise"):
        torch.compile(optimizer.step, backend="neuron")()
    source = "\n".join(path.read_text() for path in tmp_path.rglob("*.py"))
    psum_tiles = [line.split(" = ")[0].strip() for line in source.splitlines() if "buffer=nl.psum)" in line]
    written = [line for line in source.splitlines() if line.strip().startswith(("nisa.tensor_tensor(",
                                                                                "nisa.activation("))
               and any(f"dst={tile}[" in line for tile in psum_tiles)]
    assert written and not any("gpsimd" in line for line in written)  # GpSimd cannot reach PSUM
    # the second moment's product, (1 - beta2) * g * g, is ScalarE's scaled square, written into PSUM
    assert any("op=nl.square" in line for line in written)
    assert "nisa.dma_compute(" in source

"""passes/complex_pairs.py: complex64 arithmetic carried as fp32 pairs, checked against eager PyTorch."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import neuron_compile
from neuron_compile.passes.complex_pairs import is_complex, rewrite_complex_pairs, unsupported_complex_nodes
from neuron_compile.passes.decompose import decomposition_table

aten = torch.ops.aten


def fake_traced(fn, *inputs) -> torch.fx.GraphModule:
    """The ATen graph of ``fn`` with a fake value in every node's meta (as after ``specialize``)."""
    return make_fx(lambda *args: fn(*args), decomposition_table=decomposition_table(), tracing_mode="fake")(*inputs)


def rotary(x, frequencies):
    """QwenImage's complex rotary embedding: query pairs as complex numbers times complex frequencies."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * frequencies.unsqueeze(1)).flatten(3).type_as(x)


def rotary_inputs(tokens=16, heads=4, head_dim=16):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, tokens, heads, head_dim, generator=generator)
    angles = torch.randn(tokens, head_dim // 2, generator=generator)
    return x, torch.polar(torch.ones_like(angles), angles)


def compiled_with_stats(fn, *inputs):
    torch._dynamo.reset()
    neuron_compile.reset_stats()
    result = torch.compile(fn, backend="neuron", fullgraph=True)(*inputs)
    return result, neuron_compile.stats()


def complex_ops(gm: torch.fx.GraphModule) -> list[str]:
    return [node.name for node in gm.graph.nodes if node.op == "call_function" and is_complex(node)]


def test_rotary_runs_in_kernels_and_matches_eager():
    x, frequencies = rotary_inputs()
    result, stats = compiled_with_stats(rotary, x, frequencies)
    torch.testing.assert_close(result, rotary(x, frequencies), rtol=1e-5, atol=1e-5)
    # The complex graph input enters the region as its fp32 pairs: every node runs in kernels.
    assert stats["fallback_nodes"] == 0 and stats["graphs_compiled"] == 1
    assert stats["nki_nodes"] >= 8


def test_complex_inputs_with_offsets_and_strides_enter_as_pairs():
    # A sliced and a transposed complex input: the pairs view doubles each stride and the storage offset.
    x, frequencies = rotary_inputs(tokens=12, heads=2, head_dim=8)
    wider = torch.polar(torch.ones(16, 4), torch.randn(16, 4, generator=torch.Generator().manual_seed(5)))
    for complex_input in (wider[4:], wider.t().contiguous().t()[2:14]):
        result, stats = compiled_with_stats(rotary, x, complex_input)
        torch.testing.assert_close(result, rotary(x, complex_input), rtol=1e-5, atol=1e-5)
        assert stats["fallback_nodes"] == 0


def test_rewritten_graph_has_no_complex_arithmetic_and_computes_the_same():
    x, frequencies = rotary_inputs(tokens=8, heads=2, head_dim=8)
    gm = fake_traced(rotary, x, frequencies)
    rewritten = rewrite_complex_pairs(gm)
    assert rewritten is not gm
    kept = [node.target for node in rewritten.graph.nodes if node.op == "call_function" and is_complex(node)]
    assert kept == []  # the input's view_as_real is fp32; nothing computes a complex value any more
    torch.testing.assert_close(rewritten(x, frequencies), rotary(x, frequencies), rtol=1e-6, atol=1e-6)


def permuted_rotary(x, frequencies):
    """SANA-WM's UCPE layout: the rotary half of head-major features read token-major, joined back to the other
    half and permuted back: in eager the complex product keeps its input's permuted strides, so the final reshape
    is a view."""
    features = x.permute(0, 2, 1, 3)
    projected, rotated = features.split(4, dim=-1)
    pairs = torch.view_as_complex(rotated.unflatten(-1, (-1, 2)))
    rotated = torch.view_as_real(pairs * frequencies).flatten(-2, -1)
    return torch.cat([projected, rotated], dim=-1).permute(0, 2, 1, 3).reshape(1, 16, 16)


def test_values_laid_out_unlike_eager_are_read_through_their_own_strides():
    # The pairs' cat is contiguous where eager's product was permuted: the nodes after it are re-propagated, or
    # the reshape would be lowered as a view through eager's strides (a wrong answer: 3.2 off before the fix).
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(1, 16, 2, 8, generator=generator)
    frequencies = torch.polar(torch.ones(16, 2), torch.randn(16, 2, generator=generator))
    result, stats = compiled_with_stats(permuted_rotary, x, frequencies)
    torch.testing.assert_close(result, permuted_rotary(x, frequencies), rtol=1e-5, atol=1e-5)
    assert stats["fallback_nodes"] == 0


def mixed_arithmetic(x, y, scale):
    """Complex by complex, by a real tensor and by a complex scalar; sums, differences, views and halves."""
    a = torch.view_as_complex(x)
    b = torch.view_as_complex(y)
    product = (a * b + a * scale.unsqueeze(-1)) * (0.5 - 2.0j) - b
    moved = product.permute(1, 0, 2).reshape(product.shape[1], -1)[:, 1:]
    return moved.real * 2.0 + moved.imag, torch.view_as_real(-moved)


def test_mixed_complex_arithmetic_matches_eager():
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(3, 5, 4, 2, generator=generator), torch.randn(3, 5, 4, 2, generator=generator)
    scale = torch.randn(3, 5, generator=generator)
    gm = fake_traced(mixed_arithmetic, x, y, scale)
    assert complex_ops(gm) and unsupported_complex_nodes(gm) == []
    assert complex_ops(rewrite_complex_pairs(gm)) == []
    result, stats = compiled_with_stats(mixed_arithmetic, x, y, scale)
    for got, want in zip(result, mixed_arithmetic(x, y, scale), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert stats["fallback_nodes"] == 0


def polar_output(magnitude, angle):
    return torch.polar(magnitude, angle) * 2.0


def test_polar_and_a_complex_graph_output_match_eager():
    generator = torch.Generator().manual_seed(2)
    magnitude, angle = torch.rand(6, 10, generator=generator), torch.rand(6, 10, generator=generator) * 3.0
    result, stats = compiled_with_stats(polar_output, magnitude, angle)
    assert result.dtype == torch.complex64
    torch.testing.assert_close(result, polar_output(magnitude, angle), rtol=1e-5, atol=1e-5)
    # The output leaves through one view_as_complex (eager); the cos, sin and products run in kernels.
    assert set(stats["fallback_reasons"]) == {
        "aten.view_as_complex.default: no lowering for aten.view_as_complex.default"}


def inverse_rotary(x, frequencies):
    """SANA-WM's inverse rotary: the pairs times the conjugate frequencies (a lazy ``conj()`` view), and a
    ``conj_physical`` of a product."""
    pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
    inverse = pairs * frequencies.unsqueeze(1).conj()
    return torch.view_as_real(inverse).flatten(-2), torch.view_as_real((inverse * pairs).conj_physical())


def test_conjugates_match_eager_in_kernels():
    x, frequencies = rotary_inputs(tokens=8, heads=2, head_dim=8)
    gm = fake_traced(inverse_rotary, x, frequencies)
    assert unsupported_complex_nodes(gm) == [] and complex_ops(rewrite_complex_pairs(gm)) == []
    result, stats = compiled_with_stats(inverse_rotary, x, frequencies)
    for got, want in zip(result, inverse_rotary(x, frequencies), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert stats["fallback_nodes"] == 0


def complex_quotient(x, y):
    return torch.view_as_real(torch.view_as_complex(x) / torch.view_as_complex(y))


def test_a_graph_with_an_unsupported_complex_op_is_left_whole():
    generator = torch.Generator().manual_seed(3)
    x, y = torch.randn(4, 8, 2, generator=generator), torch.randn(4, 8, 2, generator=generator)
    gm = fake_traced(complex_quotient, x, y)
    assert unsupported_complex_nodes(gm)
    assert rewrite_complex_pairs(gm) is gm
    result, stats = compiled_with_stats(complex_quotient, x, y)
    torch.testing.assert_close(result, complex_quotient(x, y), rtol=1e-6, atol=1e-6)
    assert stats["fallback_nodes"] > 0
    # view_as_real of a computed complex value (not rewritten here) keeps a reason naming what it takes.
    assert any("only of a complex64 graph input" in reason for reason in stats["fallback_reasons"])


def test_a_graph_without_complex_values_is_returned_as_is():
    x = torch.randn(4, 4)
    gm = fake_traced(lambda a: a * 2.0, x)
    assert rewrite_complex_pairs(gm) is gm


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_bf16_queries_through_the_fp32_rotary(dtype):
    x, frequencies = rotary_inputs()
    x = x.to(dtype)
    result, _ = compiled_with_stats(rotary, x, frequencies)
    # The rotary computes in fp32 like eager (x.float()) and rounds once to bf16 at the end.
    torch.testing.assert_close(result, rotary(x, frequencies), rtol=2e-2, atol=2e-2)

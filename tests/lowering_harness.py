"""Shared helpers for the lowering tests: trace a function to ATen, compile it as one region, compare to eager.

Tolerances (stated once, used by every lowering test):
* float32: rtol 1e-5, atol 1e-5. The engines compute in fp32 like eager, but division is reciprocal-then-
  multiply (up to 1.5 ulp) and reductions sum in a different order than ATen's vectorized loops.
* bfloat16: rtol 2e-2, atol 2e-2. bf16 keeps 8 significant bits (one rounding is up to 2**-9 = 0.2 %); a fused
  kernel keeps fp32 intermediates where eager rounds after every op, so the two can differ by a few roundings,
  and cancellation (x - mean) magnifies a rounding into the absolute term.
"""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from neuron_compile import config
from neuron_compile.hardware import get_target
from neuron_compile.lowering import lower_graph
from neuron_compile.passes.decompose import decomposition_table
from neuron_compile.passes.fusion import fuse
from neuron_compile.pipeline import compile_region

TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.bool: (0, 0)}


def trace(fn, *inputs) -> torch.fx.GraphModule:
    # The wrapper fixes the arity: functions with optional parameters (F.silu) would otherwise confuse make_fx.
    return make_fx(lambda *args: fn(*args), decomposition_table=decomposition_table())(*inputs)


def as_tuple(value):
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def compile_and_run(fn, *inputs):
    gm = trace(fn, *inputs)
    region = compile_region(gm, list(inputs), config.get())  # the configured target (config.patch(target=...))
    return region, region(*inputs)


def check_against_eager(fn, *inputs, tolerances=None, fp32_reference=False):
    """Compile ``fn`` as one region, run it on the simulator and compare each output with eager PyTorch.

    ``fp32_reference`` runs eager on float32 copies of the inputs and rounds its outputs to the compiled dtypes:
    for ops whose eager bf16 CPU kernels accumulate in bf16, where the kernels accumulate in fp32 by design.
    """
    region, outputs = compile_and_run(fn, *inputs)
    if fp32_reference:
        upcast = [value.float() if value.dtype == torch.bfloat16 else value for value in inputs]
        expected = tuple(out.to(got.dtype) for out, got in zip(as_tuple(fn(*upcast)), outputs))
    else:
        expected = as_tuple(fn(*inputs))
    assert len(outputs) == len(expected)
    for got, want in zip(outputs, expected):
        assert got.dtype == want.dtype, (got.dtype, want.dtype)
        assert got.shape == want.shape, (got.shape, want.shape)
        assert got.stride() == want.stride(), (got.stride(), want.stride())
        rtol, atol = (tolerances or TOLERANCES)[want.dtype]
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True)
    return region


def random_tensor(shape, dtype=torch.float32, seed=0, low=-2.0, high=2.0):
    generator = torch.Generator().manual_seed(seed)
    values = torch.rand(shape, generator=generator) * (high - low) + low
    return values.to(dtype)


def projection_inputs(rows, inner, width, dtype):
    """A decoder layer's tail: the residual ``h`` [rows, width], a projection's input [rows, inner] and weight
    [inner, width] (scaled to keep the products near 1), a norm's weight [width]."""
    return [random_tensor((rows, width), dtype, seed=0), random_tensor((rows, inner), dtype, seed=1),
            random_tensor((inner, width), dtype, seed=2) / inner ** 0.5, random_tensor((width,), dtype, seed=3)]


def fused_kernels(fn, *inputs, target="trn2"):
    """The fusion pass's result (kernels and decisions) for ``fn`` traced on ``inputs``, fitted to ``target``."""
    lowered = lower_graph(trace(fn, *inputs))
    return fuse(lowered.nodes, {value.buffer for value in lowered.outputs}, target=get_target(target))


def compile_with_backend(fn, *inputs):
    """``fn`` through ``torch.compile(backend="neuron")`` with ``fallback="raise"``: (result, stats())."""
    import neuron_compile

    torch._dynamo.reset()
    neuron_compile.reset_stats()
    with neuron_compile.config.patch(fallback="raise"):
        return torch.compile(fn, backend="neuron")(*inputs), neuron_compile.stats()


def check_through_backend(fn, *inputs, eager_nodes=0):
    """Compiled == eager for every output (dtype, shape, strides; integers bit for bit, floats within the
    tolerances above), and exactly ``eager_nodes`` ATen nodes left eager. Returns the stats."""
    got, stats = compile_with_backend(fn, *inputs)
    want = fn(*inputs)
    got, want = as_tuple(got), as_tuple(want)
    assert len(got) == len(want)
    for actual, expected in zip(got, want):
        assert (actual.dtype, actual.shape, actual.stride()) == (expected.dtype, expected.shape, expected.stride())
        if expected.is_floating_point():
            rtol, atol = TOLERANCES[expected.dtype]
            torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=True)
        else:
            assert torch.equal(actual, expected)
    assert stats["nki_nodes"] > 0
    assert stats["fallback_nodes"] == eager_nodes, stats["fallback_reasons"]
    return stats

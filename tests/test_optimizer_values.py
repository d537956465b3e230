"""The compiled AdamW update over the values that exercise its math: one ``torch.compile(optimizer.step)`` of
foreach AdamW from a given state equals eager's step from the same state (fp32 and bf16 parameters, weight decay
on and off, amsgrad, the first step and a late one), on moments that are zero, tiny (subnormal), huge, infinite,
negative or nan, and over sizes 1, 127, 128, 129 and ragged two-dimensional ones. The square root of the second
moment is ``v * rsqrt(v)`` on the ALU (guarded_math.alu_sqrt): its zeros, inf and nan come back as torch's."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lowering_harness import TOLERANCES

import neuron_compile

# the second moments the update's sqrt must get right, placed at the start of the tensor (the rest are random)
SPECIAL_SECOND_MOMENTS = [0.0, 1e-40, 1e-30, 2.0**-120, 1e30, 3.3e38, float("inf"), -1.0, float("nan"), 2.0**119]
LATE_STEP = 1e6  # beta ** step underflows: both bias corrections are 1


def _state(shape, dtype, step: float, amsgrad: bool, seed: int = 0):
    """(parameter, gradient, optimizer state) with the special second moments first, a zero gradient and a zero
    first moment beside the zero second moment."""
    generator = torch.Generator().manual_seed(seed)

    def draw(scale=1.0):
        return torch.randn(shape, generator=generator) * scale

    parameter, gradient, exp_avg = draw(), draw(), draw(0.1)
    exp_avg_sq = torch.rand(shape, generator=generator) * 0.01
    specials = torch.tensor(SPECIAL_SECOND_MOMENTS)[:exp_avg_sq.numel()]
    exp_avg_sq.view(-1)[:len(specials)] = specials
    gradient.view(-1)[0] = 0.0
    exp_avg.view(-1)[0] = 0.0
    state = {"step": torch.tensor(step), "exp_avg": exp_avg.to(dtype), "exp_avg_sq": exp_avg_sq.to(dtype)}
    if amsgrad:
        state["max_exp_avg_sq"] = (exp_avg_sq * 0.5).to(dtype)
    return parameter.to(dtype), gradient.to(dtype), state


def _step(parameter, gradient, state, compiled: bool, **options):
    """The parameter and the state after one AdamW step from ``state`` (compiled with the backend, or eager)."""
    trained = torch.nn.Parameter(parameter.clone())
    trained.grad = gradient.clone()
    optimizer = torch.optim.AdamW([trained], lr=1e-2, foreach=True, **options)
    optimizer.state[trained] = {name: value.clone() for name, value in state.items()}
    if compiled:
        torch._dynamo.reset()
        neuron_compile.reset_stats()
        with neuron_compile.config.patch(fallback="raise"):
            torch.compile(optimizer.step, backend="neuron")()
        stats = neuron_compile.stats()
        assert stats["fallback_nodes"] == 0 and stats["nki_nodes"] > 0, stats["fallback_reasons"]
    else:
        optimizer.step()
    return [trained.detach()] + [optimizer.state[trained][name] for name in state if name != "step"]


def _check_step(shape, dtype, step, amsgrad=False, weight_decay=0.01):
    parameter, gradient, state = _state(shape, dtype, step, amsgrad)
    options = dict(amsgrad=amsgrad, weight_decay=weight_decay)
    expected = _step(parameter, gradient, state, compiled=False, **options)
    got = _step(parameter, gradient, state, compiled=True, **options)
    rtol, atol = TOLERANCES[dtype]
    for actual, want in zip(got, expected):
        torch.testing.assert_close(actual, want, rtol=rtol, atol=atol, equal_nan=True)
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("amsgrad, weight_decay", [(False, 0.0), (False, 0.1), (True, 0.1)])
@pytest.mark.parametrize("step", [0.0, LATE_STEP])
def test_one_step_on_special_moments_equals_eager(dtype, amsgrad, weight_decay, step):
    parameter = _check_step((13, 29), dtype, step, amsgrad, weight_decay)[0].view(-1)
    # the moments' specials reach the parameter as torch gives them: nan from a negative or nan second moment,
    # finite values from zero, tiny, huge and infinite ones
    bad = [i for i, v in enumerate(SPECIAL_SECOND_MOMENTS) if v != v or v < 0]
    assert parameter[bad].isnan().all() and parameter[[i for i in range(10) if i not in bad]].isfinite().all()


@settings(max_examples=6, deadline=None)
@given(shape=st.sampled_from([(1,), (127,), (128,), (129,), (3, 129), (129, 130), (130, 1100)]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_one_step_over_sizes_equals_eager(shape, dtype):
    _check_step(shape, dtype, step=3.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("step", [0.0, LATE_STEP])
def test_the_parameter_sum_added_by_the_dma_engines_equals_eager(dtype, step, monkeypatch):
    """At (130, 1100) the update kernel is bound by its compute engines, so the decayed parameter plus the update
    is added by the DMA engines on its way to HBM (codegen/dma_sums.py): the special moments still reach the
    parameter as torch gives them. An fp32 update with its second moment's product as ScalarE's scaled square
    (codegen/expressions.py) has too little compute left for the sum to pay; with the two products it takes it."""
    if dtype == torch.float32:
        monkeypatch.setattr("neuron_compile.codegen.expressions._emit_scaled_square", lambda *args: None)
    with neuron_compile.record_launches() as launches:
        parameter = _check_step((130, 1100), dtype, step, weight_decay=0.1)[0].view(-1)
    assert any("nisa.dma_compute(" in launch.source.source for launch in launches if launch.source is not None)
    bad = [i for i, v in enumerate(SPECIAL_SECOND_MOMENTS) if v != v or v < 0]
    assert parameter[bad].isnan().all() and parameter[[i for i in range(10) if i not in bad]].isfinite().all()

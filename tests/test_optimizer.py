"""Compiled optimizers: ``torch.compile(optimizer.step, backend="neuron")`` for AdamW and SGD equals eager's
update step after step, with every ATen node in kernels (the ``_foreach_*`` ops decompose per tensor,
passes/decompose_foreach.py; Dynamo's ``prims.fma`` lowers as multiply-add); each foreach decomposition equals
its op."""

from __future__ import annotations

import pytest
import torch

import neuron_compile
from lowering_harness import TOLERANCES
from neuron_compile.passes.decompose_foreach import foreach_decompositions

STEPS = 3


def _model_and_optimizer(name: str, foreach: bool, dtype=torch.float32):
    torch.manual_seed(0)
    model = torch.nn.Linear(24, 40).to(dtype)  # a weight and a bias: two parameter shapes
    if name == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=foreach)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, weight_decay=0.01, foreach=foreach)
    return model, optimizer


def _train(model, optimizer, step, x):
    for _ in range(STEPS):
        optimizer.zero_grad()
        model(x).float().square().mean().backward()
        step()
    return [parameter.detach().clone() for parameter in model.parameters()]


@pytest.mark.parametrize("name,foreach,dtype", [("adamw", True, torch.float32), ("sgd", True, torch.float32),
                                                ("adamw", False, torch.bfloat16)])
def test_compiled_step_equals_eager(name, foreach, dtype):
    x = torch.randn(16, 24, generator=torch.Generator().manual_seed(1)).to(dtype)
    eager_model, eager_optimizer = _model_and_optimizer(name, foreach, dtype)
    expected = _train(eager_model, eager_optimizer, eager_optimizer.step, x)
    torch._dynamo.reset()
    neuron_compile.reset_stats()
    model, optimizer = _model_and_optimizer(name, foreach, dtype)
    with neuron_compile.config.patch(fallback="raise"):
        got = _train(model, optimizer, torch.compile(optimizer.step, backend="neuron"), x)
    stats = neuron_compile.stats()
    assert stats["fallback_nodes"] == 0, stats["fallback_reasons"]
    assert stats["nki_nodes"] > 0 and stats["recompiles"] == 0
    rtol, atol = TOLERANCES[dtype]
    for actual, want in zip(got, expected):
        torch.testing.assert_close(actual, want, rtol=rtol, atol=atol)
    assert not torch.equal(got[0], _model_and_optimizer(name, foreach, dtype)[0].weight)  # the steps moved it


def _arguments(overload, tensors):
    """Positional arguments for one foreach overload: distinct tensor lists, a scalar per list element."""
    lists = iter(tensors)
    arguments = []
    for argument in overload._schema.arguments:
        kind = str(argument.type)
        if argument.kwarg_only:
            continue
        if kind == "List[Tensor]":
            arguments.append(next(lists))
        elif kind.startswith("List["):
            arguments.append([0.5, 2.0])
        elif kind == "Tensor":
            arguments.append(torch.tensor(0.7))
        elif kind == "bool":
            arguments.append(False)
        elif kind.startswith("Optional"):
            arguments.append(None)
        else:
            arguments.append(2 if argument.name == "ord" else 0.3)
    return arguments


def test_each_foreach_decomposition_equals_its_op():
    generator = torch.Generator().manual_seed(0)
    tensors = [[torch.rand(3, 5, generator=generator) + 0.5 for _ in range(2)] for _ in range(3)]
    table = foreach_decompositions()
    assert torch.ops.aten._foreach_addcmul.Scalar in table and torch.ops.aten._foreach_norm.Scalar in table
    for overload, decompose in table.items():
        arguments = _arguments(overload, tensors)
        want, got = overload(*arguments), decompose(*arguments)
        assert len(got) == len(want), overload
        for actual, expected in zip(got, want):
            torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6, msg=str(overload))

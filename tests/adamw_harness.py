"""Test helper: one AdamW step from a prepared random state, compiled with the backend or eager (torch's foreach
AdamW, the reference the optimizer tests take)."""

from __future__ import annotations

import torch

import neuron_compile


def adamw_step(shape, dtype, amsgrad: bool, weight_decay: float, compiled: bool, seed: int = 0):
    """The parameter and state after one AdamW step from a random state (step 10: both bias corrections away
    from 1), compiled with the backend or eager."""
    generator = torch.Generator().manual_seed(seed)
    parameter = torch.nn.Parameter(torch.randn(shape, generator=generator).to(dtype))
    parameter.grad = torch.randn(shape, generator=generator).to(dtype)
    optimizer = torch.optim.AdamW([parameter], lr=1e-2, foreach=True, amsgrad=amsgrad, weight_decay=weight_decay)
    state = {"step": torch.tensor(10.0), "exp_avg": (torch.randn(shape, generator=generator) * 0.1).to(dtype),
             "exp_avg_sq": (torch.rand(shape, generator=generator) * 0.01).to(dtype)}
    if amsgrad:
        state["max_exp_avg_sq"] = (state["exp_avg_sq"].float() * 0.5).to(dtype)
    optimizer.state[parameter] = state
    if compiled:
        torch._dynamo.reset()
        with neuron_compile.config.patch(fallback="raise"):
            torch.compile(optimizer.step, backend="neuron")()
    else:
        optimizer.step()
    return [parameter.detach()] + [state[name] for name in state if name != "step"]

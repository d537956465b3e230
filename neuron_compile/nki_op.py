"""Front end for hand-written kernels: ``nki_op`` turns an ``@nki.jit`` kernel into a torch operator.

Input: a kernel taking tensors (positional, in the order of its signature) and returning ``nl.shared_hbm``
tensors, a declared output spec ``out(*inputs) -> (shape, dtype)`` (a list of such pairs for several outputs),
an op name ``"namespace::name"`` and, optionally, a backward. Output: an ``NkiOp``, callable like the kernel,
wrapping a ``torch.library`` custom op:

- eagerly (CPU tensors) the op runs the kernel through the configured launcher (the simulator, or the Neuron
  device), checks its outputs against the declared spec (``NkiOpSpecError`` otherwise) and counts the launch in
  ``stats()``;
- its fake implementation builds the declared outputs, so Dynamo and aot_autograd trace it as one node (no graph
  break); under ``backend="neuron"`` the partitioner gives that node a region of its own and the region launches
  the kernel (runtime/user_region.py); under Inductor or aot_eager the node calls the eager implementation;
- ``backward=fn`` registers ``fn(*grad_outputs, *inputs) -> one gradient (or None) per input`` as its autograd
  formula; ``fn`` may call torch ops or another ``NkiOp`` (a backward kernel), and is traced like any function;
- ``op.choose_for(aten_op, select)`` is the explicit registration through which our compiler launches the kernel
  for an ATen op of the graph (never without it): the node is then placed and launched as a call of the op.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from neuron_compile import config as config_module
from neuron_compile import user_kernels
from neuron_compile.runtime.launcher import select_launcher
from neuron_compile.runtime.user_region import launch_user_kernel
from neuron_compile.user_kernels import NkiOpSpecError, UserKernel

__all__ = ["NkiOp", "NkiOpSpecError", "nki_op"]

_LIBRARIES: dict[str, torch.library.Library] = {}  # one FRAGMENT library per namespace, kept alive here


def _argument_names(kernel: Callable) -> tuple[str, ...]:
    parameters = inspect.signature(getattr(kernel, "fn", kernel)).parameters.values()
    names = tuple(p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    if not names:
        raise TypeError("nki_op: the kernel takes no positional tensor arguments")
    return names


def _schema(argument_names: tuple[str, ...], num_outputs: int) -> str:
    returns = "Tensor" if num_outputs == 1 else "(" + ", ".join(["Tensor"] * num_outputs) + ")"
    return "(" + ", ".join(f"Tensor {name}" for name in argument_names) + f") -> {returns}"


def _library(namespace: str) -> torch.library.Library:
    if namespace not in _LIBRARIES:
        _LIBRARIES[namespace] = torch.library.Library(namespace, "FRAGMENT")
    return _LIBRARIES[namespace]


class NkiOp:
    """A user kernel as a torch op: ``op(*tensors)`` calls ``torch.ops.<namespace>.<name>``; ``op.op`` is it."""

    def __init__(self, user_kernel: UserKernel, op: torch._ops.OpOverloadPacket):
        self.user_kernel = user_kernel
        self.op = op

    def __call__(self, *tensors: torch.Tensor):
        return self.op(*tensors)

    def choose_for(self, aten_op, select: Callable) -> NkiOp:
        """Under ``backend="neuron"``, launch this kernel for the ATen op ``aten_op`` (an OpOverload, as in the
        ATen graph) wherever ``select(*args, **kwargs)`` returns the kernel's arguments; None leaves the node to our
        own lowering. ``select`` sees the node's arguments: FX nodes for tensors (their ``meta["val"]`` holds shape
        and dtype) and constants. The declared outputs must equal the ATen op's (``NkiOpSpecError`` otherwise)."""
        user_kernels.choose_for(aten_op, self.user_kernel, select)
        return self

    def forget_choices(self) -> None:
        """Withdraw every ``choose_for`` of this op (graphs compiled from then on use our own lowerings)."""
        user_kernels.forget_choices(self.user_kernel)

    def __repr__(self) -> str:
        return f"NkiOp({self.user_kernel.qualname})"


def _eager(user_kernel: UserKernel) -> Callable:
    def run(*inputs):
        launcher = select_launcher(config_module.get())
        outputs = launch_user_kernel(user_kernel, launcher, inputs)
        return outputs[0] if user_kernel.num_outputs == 1 else tuple(outputs)

    return run


def _fake(user_kernel: UserKernel) -> Callable:
    def fake(*inputs):
        outputs = [inputs[0].new_empty(spec.shape, dtype=spec.dtype) for spec in user_kernel.output_specs(inputs)]
        return outputs[0] if user_kernel.num_outputs == 1 else tuple(outputs)

    return fake


def _register_backward(qualname: str, backward: Callable, library: torch.library.Library, num_outputs: int) -> None:
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def formula(ctx, *grad_outputs):
        gradients = backward(*grad_outputs[:num_outputs], *ctx.saved_tensors)
        return tuple(gradients) if isinstance(gradients, (tuple, list)) else (gradients,)

    torch.library.register_autograd(qualname, formula, setup_context=setup_context, lib=library)


def nki_op(kernel: Callable, *, out: Callable, name: str, num_outputs: int = 1,
           backward: Callable | None = None) -> NkiOp:
    """Register ``kernel`` as the torch op ``name`` ("namespace::op_name"); see the module docstring."""
    if "::" not in name:
        raise ValueError(f"nki_op: name must be 'namespace::op_name', got {name!r}")
    namespace, op_name = name.split("::", 1)
    argument_names = _argument_names(kernel)
    user_kernel = UserKernel(name, kernel, argument_names, out, num_outputs)
    library = _library(namespace)
    library.define(op_name + _schema(argument_names, num_outputs))
    library.impl(op_name, _eager(user_kernel), "CPU")
    torch.library.register_fake(name, _fake(user_kernel), lib=library)
    if backward is not None:
        _register_backward(name, backward, library, num_outputs)
    user_kernels.register(user_kernel)
    return NkiOp(user_kernel, getattr(getattr(torch.ops, namespace), op_name))

"""The registry of user NKI kernels (hand-written ``@nki.jit`` kernels registered with ``neuron_compile.nki_op``).

Input: ``register(UserKernel)`` from nki_op.py: the torch op's name, the kernel, its argument names and its
declared output spec. Output: ``user_kernel_for(fx_target)`` (the partitioner asks it which nodes are user
kernels), ``output_specs`` and ``check_outputs``, which raises ``NkiOpSpecError`` naming the op, the output and
both specs when a kernel's outputs disagree with the declared ones. Plain data and torch only: the partitioner
imports it, and the launch itself lives in runtime/user_region.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from neuron_compile.errors import NeuronCompileError


class NkiOpSpecError(NeuronCompileError):
    """A user kernel returned outputs that disagree with its op's declared output spec."""


@dataclasses.dataclass(frozen=True)
class OutputSpec:
    """One declared output: its shape and torch dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def __str__(self) -> str:
        return f"shape {list(self.shape)} dtype {self.dtype}"


@dataclasses.dataclass(frozen=True)
class UserKernel:
    """A registered user kernel: ``qualname`` is its torch op ("namespace::name"); ``out(*inputs)`` returns the
    declared outputs as ``(shape, dtype)`` pairs, one per output (shapes and dtypes only: it also runs on fake
    tensors)."""

    qualname: str
    kernel: Callable
    argument_names: tuple[str, ...]
    out: Callable
    num_outputs: int

    @property
    def launch_name(self) -> str:
        return self.qualname.replace("::", "_")

    def output_specs(self, inputs) -> list[OutputSpec]:
        declared = self.out(*inputs)
        pairs = [declared] if self.num_outputs == 1 else list(declared)
        if len(pairs) != self.num_outputs:
            raise NkiOpSpecError(f"nki_op {self.qualname}: out() declared {len(pairs)} outputs, the op has "
                                 f"{self.num_outputs}")
        return [OutputSpec(tuple(int(size) for size in shape), dtype) for shape, dtype in pairs]


_REGISTRY: dict[str, UserKernel] = {}


def register(user_kernel: UserKernel) -> None:
    _REGISTRY[user_kernel.qualname] = user_kernel


def user_kernel_for(target) -> UserKernel | None:
    """The user kernel behind an FX node target (an OpOverload of a registered op), else None."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    return _REGISTRY.get(target._schema.name)


@dataclasses.dataclass(frozen=True)
class UserCall:
    """A graph node that launches a user kernel: the kernel, its arguments (FX nodes or constants, in the
    kernel's order) and, for an ATen node chosen through ``choose_for``, the ATen op it stands for."""

    user_kernel: UserKernel
    arguments: tuple
    stands_for: str | None = None


# ATen op -> [(user kernel, select)]: explicit choices of a user kernel for an ATen op (NkiOp.choose_for).
_CHOICES: dict[object, list[tuple[UserKernel, Callable]]] = {}


def choose_for(aten_op, user_kernel: UserKernel, select: Callable) -> None:
    """Launch ``user_kernel`` for the ATen op ``aten_op`` where ``select(*args, **kwargs)`` (the node's arguments:
    FX nodes for tensors, with ``meta["val"]``, and constants) returns the kernel's arguments; None declines."""
    _CHOICES.setdefault(aten_op, []).append((user_kernel, select))


def forget_choices(user_kernel: UserKernel) -> None:
    """Withdraw every ``choose_for`` of ``user_kernel``."""
    for aten_op, choices in list(_CHOICES.items()):
        _CHOICES[aten_op] = [choice for choice in choices if choice[0] is not user_kernel]


def _meta(value):
    return value.meta.get("val") if isinstance(value, torch.fx.Node) else value


def _chosen_call(node: torch.fx.Node) -> UserCall | None:
    for user_kernel, select in _CHOICES.get(node.target, ()):
        arguments = select(*node.args, **node.kwargs)
        if arguments is None:
            continue
        declared = user_kernel.output_specs([_meta(argument) for argument in arguments])
        produced = _meta(node)
        produced = [produced] if isinstance(produced, torch.Tensor) else list(produced)
        actual = [OutputSpec(tuple(int(size) for size in value.shape), value.dtype) for value in produced]
        if declared != actual:
            raise NkiOpSpecError(
                f"nki_op {user_kernel.qualname} chosen for {node.target} ({node.name}): its declared outputs "
                f"{', '.join(map(str, declared))} differ from the op's {', '.join(map(str, actual))}"
            )
        return UserCall(user_kernel, tuple(arguments), str(node.target))
    return None


def user_call(node: torch.fx.Node) -> UserCall | None:
    """The user-kernel launch a call_function node stands for: a call of a registered op, or an ATen op a user
    kernel was explicitly chosen for (its ``select`` accepting the node); else None."""
    if node.op != "call_function":
        return None
    user_kernel = user_kernel_for(node.target)
    if user_kernel is not None:
        return UserCall(user_kernel, tuple(node.args))
    return _chosen_call(node)


def check_outputs(user_kernel: UserKernel, outputs: list[torch.Tensor], specs: list[OutputSpec]) -> None:
    """Raise NkiOpSpecError where the kernel's outputs disagree with the declared ones (count, shape, dtype)."""
    if len(outputs) != len(specs):
        raise NkiOpSpecError(f"nki_op {user_kernel.qualname}: the kernel returned {len(outputs)} tensors, its "
                             f"declared output spec has {len(specs)}")
    for index, (got, spec) in enumerate(zip(outputs, specs, strict=True)):
        if tuple(got.shape) != spec.shape or got.dtype != spec.dtype:
            raise NkiOpSpecError(
                f"nki_op {user_kernel.qualname} output {index}: declared {spec}, the kernel returned "
                f"shape {list(got.shape)} dtype {got.dtype}; fix the kernel or the op's out= spec"
            )

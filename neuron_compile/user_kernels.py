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

"""Runtime stage for hand-written kernels: the registry of user NKI kernels and their launch.

Input: a user's ``@nki.jit`` kernel (a simulator ``Kernel``, or any function the launcher can call with tensors),
registered by ``neuron_compile.nki_op`` under a torch op name with its declared output spec; per launch, a
launcher (runtime/launcher.py) and the op's input tensors. Output: the kernel's outputs as torch-allocated
tensors with the declared shapes and dtypes, and the launch's cost report (None on the device); a kernel whose
outputs disagree with the declared spec raises ``NkiOpSpecError`` naming the op, the output and both specs.

A user kernel is arbitrary NKI source with its own argument shapes, so it is not one of our generated kernels:
it is launched as its own unit (``KernelSource`` carries its name, its text where ``inspect`` finds it, and
its output buffers, for records and dumps), with contiguous tensors of the shapes the op received. Eagerly and
under torch.compile both launches go through ``launch_user_kernel``, so both check the spec and count the
launch in ``stats()``.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable

import torch

from neuron_compile import ir
from neuron_compile.codegen.kernel_text import KernelSource
from neuron_compile.errors import NeuronCompileError
from neuron_compile.lowering import SUPPORTED_DTYPES
from neuron_compile.runtime import stats
from neuron_compile.runtime.launcher import Launcher


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


def kernel_text(kernel: Callable) -> str:
    """The kernel's Python source where inspect finds it (for records and dumps), else a one-line note."""
    function = getattr(kernel, "fn", kernel)  # a simulator Kernel keeps the function as ``fn``
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        return f"# source of {getattr(function, '__qualname__', function)!r} not available\n"


def kernel_source(user_kernel: UserKernel, inputs) -> KernelSource:
    """The launch unit's description: its name, text, parameter names and declared output buffers."""
    outputs = []
    for index, spec in enumerate(user_kernel.output_specs(inputs)):
        strides = tuple(torch.empty(spec.shape, device="meta").stride())
        dtype = SUPPORTED_DTYPES.get(spec.dtype, str(spec.dtype).removeprefix("torch."))
        outputs.append(ir.Buffer(f"{user_kernel.launch_name}_out{index}", dtype, ir.Layout(spec.shape, strides)))
    return KernelSource(user_kernel.launch_name, kernel_text(user_kernel.kernel), user_kernel.argument_names,
                        tuple(outputs))


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


def launch_user_kernel(user_kernel: UserKernel, launcher: Launcher, inputs) -> list[torch.Tensor]:
    """Run the kernel through ``launcher`` on contiguous copies of ``inputs`` (its own shapes); check the outputs
    against the declared spec; count the launch. The outputs own their storage (the launcher allocates them)."""
    specs = user_kernel.output_specs(inputs)
    source = kernel_source(user_kernel, inputs)
    arguments = [tensor.detach().contiguous() for tensor in inputs]
    returned, report = launcher.launch_function(user_kernel.kernel, arguments)
    check_outputs(user_kernel, returned, specs)
    stats.count_launch(source.name, report, source)
    return returned

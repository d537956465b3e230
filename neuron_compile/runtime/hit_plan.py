"""Runtime stage: a compiled graph's hit plan, what one call proved about the calls that follow it.

Input: one call of a ``CompiledGraph`` (runtime/compiled_graph.py) or a ``WarmGraph`` (runtime/warm_start.py): its
arguments (aot_autograd's list) as given and with the column-major weight copies swapped in
(runtime/weight_layouts.py), the config, the compiled entry its dispatch key found, and the positions of the
value-guarded float inputs. Output: a ``HitPlan`` whose ``matches(args)`` tells whether a later call has the same
dispatch key (``runtime/cache.dispatch_signature``) without building or hashing it, and whose ``run(args)`` then
calls the entry (through ``DirectHit``, runtime/direct_hit.py, when the entry is one region) and returns its outputs.
Both graphs call through their last plan with ``planned_outputs``; on None the caller builds the key and looks it up
as before. The plan only skips work; it never picks an entry the key would not pick.

How the plan checks each part of the key, on the arguments as given:

* every tensor's shape, strides, dtype and device: one C++ call over all of them, torch's tensor-match check
  (``TensorGuards``: the exact Python type, dispatch keys (device type, conjugate / negative bits), dtype, device
  index, requires_grad, sizes and strides; a call where one tensor fills two positions fails it); storage offsets:
  one list compare;
* every other argument: its type and value;
* the value bounds of the small integer tensors and the guarded float inputs (passes/input_ranges.py): recomputed
  on every call, since values change without any metadata changing; a tensor the guard does not read (too large,
  another dtype) keeps its "no bound" with its metadata. A guarded float input (a rotary embedding's frequencies,
  a buffer) that is the very tensor whose bound was last found, with the same version counter and data pointer,
  keeps that bound: what moves neither (a write through ``.data``) is not seen, as for the weights' copies;
* the weight copies: a copy's metadata follows from its weight's (the same shape, dtype and device, column-major
  strides, offset 0), checked above, so the copies' part of the key holds too; the copy itself is reused while its
  weight is the same object with the same version and data pointer (``KeptCopies``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from neuron_compile.config import Config
from neuron_compile.passes.input_ranges import float_values_bound, guard_reads_values, integer_values_bound
from neuron_compile.runtime import stats
from neuron_compile.runtime.cache import scalar_value
from neuron_compile.runtime.direct_hit import DirectHit
from neuron_compile.runtime.weight_layouts import KeptCopies

try:  # torch's C++ tensor-match check (Dynamo's own guards use its successor); without it, no plan: keys only
    from torch._C._dynamo.guards import TensorGuards
except ImportError:  # pragma: no cover -- present in the torch this package pins
    TensorGuards = None


class HitPlan:
    """The plan of one call (see the module docstring); build with ``HitPlan.of``."""

    def __init__(self, config: Config, args: list, swapped: list, entry, float_guarded: frozenset[int]):
        self.config = config
        self.entry = entry  # the compiled GraphModule the call's key found
        self.length = len(args)
        tensors = [position for position, arg in enumerate(args) if isinstance(arg, torch.Tensor)]
        # None when every argument is a tensor: the arguments list is then checked as it is
        self.tensor_positions: tuple[int, ...] | None = None if len(tensors) == len(args) else tuple(tensors)
        # None: every size and stride is checked; both keywords are required (the constructor reads them as given)
        self.tensor_check = TensorGuards(*[args[position] for position in tensors], dynamic_dims_sizes=None,
                                         dynamic_dims_strides=None)
        self.storage_offsets = [args[position].storage_offset() for position in tensors]
        self.scalars = tuple((position, type(arg), scalar_value(arg)) for position, arg in enumerate(args)
                             if not isinstance(arg, torch.Tensor))
        # (position, bound) per integer value guard and per float one; a float one's bound is kept with a stamp of
        # the tensor it was found on: (a weak reference to it, its version, its data pointer), or None (docstring)
        self.integer_guards = value_guards(args, tensors, float_guarded, float_guard=False)
        self.float_guards = value_guards(args, tensors, float_guarded, float_guard=True)
        self.float_stamps: list[tuple | None] = [None] * len(self.float_guards)
        self.copies = KeptCopies(args, swapped)
        self.direct = DirectHit.of(entry, args) if entry is not None else None

    @classmethod
    def of(cls, config: Config, args: list, swapped: list, entry, float_guarded: frozenset[int]) -> HitPlan | None:
        """The plan of a call whose key found ``entry``; None where no plan can hold (one tensor object in two
        positions, which the tensor check refuses; no ``TensorGuards`` in this torch)."""
        tensor_ids = [id(arg) for arg in args if isinstance(arg, torch.Tensor)]
        if TensorGuards is None or len(set(tensor_ids)) != len(tensor_ids):
            return None
        return cls(config, args, swapped, entry, float_guarded)

    def run(self, args: list) -> tuple:
        """The entry's outputs for ``args``, which have this plan's dispatch key (``matches``)."""
        if self.direct is not None:
            outputs = self.direct(args, self.copies.apply)
            if outputs is not None:
                return outputs
        return self.entry.forward(*self.copies.apply(args))

    def matches(self, args: list) -> bool:
        """Whether ``args`` have this plan's dispatch key."""
        if len(args) != self.length:
            return False
        tensors = args if self.tensor_positions is None else [args[position] for position in self.tensor_positions]
        if not self.tensor_check.check(*tensors):
            return False
        if list(map(torch.Tensor.storage_offset, tensors)) != self.storage_offsets:  # map: no Python frame per item
            return False
        for position, kind, value in self.scalars:
            if type(args[position]) is not kind or scalar_value(args[position]) != value:
                return False
        for position, bound in self.integer_guards:
            if integer_values_bound(args[position]) is not bound:  # each class has one bound object (or None)
                return False
        for guard in range(len(self.float_guards)):
            if not self.float_bound_holds(guard, args):
                return False
        return True

    def float_bound_holds(self, guard: int, args: list) -> bool:
        """Whether float guard ``guard``'s tensor in ``args`` has the plan's bound."""
        position, bound = self.float_guards[guard]
        tensor = args[position]
        stamp = self.float_stamps[guard]
        if stamp is not None and stamp[0]() is tensor and tensor._version == stamp[1] and tensor.data_ptr() == stamp[2]:
            return True
        if float_values_bound(tensor) is not bound:
            return False
        # one assignment: thread-safe; the tensor held weakly, as a plan must not keep a freed model's buffers
        self.float_stamps[guard] = (weakref.ref(tensor), tensor._version, tensor.data_ptr())
        return True


def planned_outputs(plan: HitPlan | None, config: Config, args: list,
                    before_run: Callable[[list], None] | None = None) -> tuple | None:
    """The outputs of a call through a graph's last ``plan``, counted as a hit, when the plan was made under
    ``config`` (the same object: ``config.get`` returns one per setting) and ``args`` have its dispatch key; None
    otherwise, and the caller builds the key. ``before_run`` (aot_autograd's version bumps) runs once the plan
    holds, before the entry."""
    if plan is None or plan.config is not config or not plan.matches(args):
        return None
    if before_run is not None:
        before_run(args)
    stats.count_hit()
    return plan.run(args)


def value_guards(args: list, positions: list[int], float_guarded: frozenset[int], float_guard: bool) -> tuple:
    """(position, the bound now) per tensor at ``positions`` whose values the dispatch key's integer guard reads
    (``float_guard``: its float guard, for the positions in ``float_guarded``)."""
    bound_of = float_values_bound if float_guard else integer_values_bound
    return tuple((position, bound_of(args[position])) for position in positions
                 if (position in float_guarded) == float_guard
                 and guard_reads_values(args[position], float_guard=float_guard))

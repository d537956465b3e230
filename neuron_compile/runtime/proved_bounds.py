"""Runtime stage: value bounds a compiled graph proved for the tensors it returned, handed to the graph that reads
them next.

Input: a forward graph's outputs and the bounds its value-range analysis proved for them (passes/input_ranges.py
``proved_output_bounds``: a rotary embedding's angles, positions from an ``arange`` times guarded frequencies,
which aot_autograd's partitioner saves for the backward). Output: a tag per tensor (its bound, version counter and
data pointer) that ``bound_of`` gives the backward's float guard in place of reading the values: one ``aminmax``
over the tensor every call, on a device a read-back of it.

A tag holds while the tensor is the same object with the same version and data pointer: an in-place write bumps
the version and drops the bound (the guard then reads the values, as for a tensor nothing tagged). Tensors are
held weakly: a tag dies with its tensor.
"""

from __future__ import annotations

import torch

from neuron_compile.runtime.kept import Kept

# id(tensor) -> (its version, its data pointer, the bound proved for its values), dropped when the tensor dies
_tags = Kept(limit=None)


def tag(tensor: torch.Tensor, bound) -> None:
    """Record that every value of ``tensor``, as it is now, lies within ``bound`` (an Interval)."""
    _tags.keep(id(tensor), (tensor._version, tensor.data_ptr(), bound), owners=(tensor,))


def bound_of(tensor: torch.Tensor):
    """The bound tagged on ``tensor`` while it is unchanged since, else None (a tag present is this tensor's:
    ``Kept`` drops it when its tensor dies, before the id can be reused)."""
    entry = _tags.get(id(tensor))
    if entry is None:
        return None
    version, pointer, bound = entry
    if tensor._version != version or tensor.data_ptr() != pointer:
        return None
    return bound


def tagged() -> int:
    """How many live tensors carry a tag."""
    return len(_tags)


def tag_outputs(outputs, bounds: tuple) -> None:
    """Tag ``outputs[position]`` with its bound for each (position, bound) of ``bounds``."""
    for position, bound in bounds:
        output = outputs[position]
        if isinstance(output, torch.Tensor):
            tag(output, bound)

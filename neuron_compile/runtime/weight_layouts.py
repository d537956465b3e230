"""Runtime stage: column-major copies of weight parameters, kept across calls (the layout passes/layouts.py chose).

Input: a call's arguments and the indices of the inputs the graph's matmuls read transposed. Output: the same
arguments with each such ``nn.Parameter`` replaced by a column-major copy of it: the same shape and values, dim 0
innermost (strides (1, rows) for a matrix; a convolution weight's output channels innermost), so the kernels
compiled for that signature load the weight's transpose with plain DMAs.

A copy is made once per parameter and version: it is keyed by the parameter's identity (weakly, so a freed model
frees its copies) and checked against the parameter's version counter and storage on every call, so an optimizer
step, an in-place update (``w.mul_(2)``) or ``w.data = ...`` is seen and the copy remade. Only parameters are
copied: an activation is a new tensor on every call, and copying it would cost a transpose per call. Only inference
graphs use copies (see CompiledGraph): a training step changes every weight, and the copy would then be remade by
the host on every step, a cost our device estimate would not show. The price is memory: one more copy of each such
weight; ``NEURON_COMPILE_TRANSPOSED_WEIGHTS=0`` keeps the weights as given.
"""

from __future__ import annotations

import functools
import threading
import weakref

import torch

from neuron_compile.runtime import stats


class ColumnMajorCopies:
    """Parameter -> (version, data pointer, its column-major copy); thread-safe.

    Keyed by ``id`` in a plain dict, with a weak reference that tells the parameter apart from a later object of
    the same id and drops the entry when the parameter dies: torch's ``WeakIdKeyDictionary`` makes a weak reference
    on every lookup, and a cache hit looks up every transposed weight of the graph."""

    def __init__(self):
        self._copies: dict[int, tuple[weakref.ref, tuple[int, int], torch.Tensor]] = {}
        # Reentrant: a parameter may die (and _forget run) in a garbage collection inside the locked section.
        self._lock = threading.RLock()

    def copy_of(self, weight: torch.nn.Parameter) -> torch.Tensor:
        """``weight``'s column-major copy, made now if the weight changed since the last one."""
        stamp = (weight._version, weight.data_ptr())
        entry = self._copies.get(id(weight))
        if entry is not None and entry[0]() is weight and entry[1] == stamp:
            return entry[2]
        with self._lock:
            entry = self._copies.get(id(weight))
            if entry is None or entry[0]() is not weight or entry[1] != stamp:
                with torch.no_grad():
                    copy = weight.detach().movedim(0, -1).contiguous().movedim(-1, 0)
                forget = functools.partial(self._forget, id(weight))
                entry = self._copies[id(weight)] = (weakref.ref(weight, forget), stamp, copy)
                stats.add(weight_copies=1, weight_copy_bytes=copy.numel() * copy.element_size())
        return entry[2]

    def _forget(self, key: int, dead: weakref.ref) -> None:
        """A parameter died: drop its copy (unless a new object of the same id has taken the entry since)."""
        with self._lock:
            entry = self._copies.get(key)
            if entry is not None and entry[0] is dead:
                del self._copies[key]

    def apply(self, args: list, indices: tuple[int, ...]) -> list:
        """``args`` with the parameters at ``indices`` replaced by their copies (a new list; ``args`` unchanged)."""
        swapped = list(args)
        for index in indices:
            weight = args[index]
            if isinstance(weight, torch.nn.Parameter) and weight.stride(0) != 1:
                swapped[index] = self.copy_of(weight)
        return swapped

    def __len__(self) -> int:
        return len(self._copies)


COPIES = ColumnMajorCopies()  # one per process: a weight shared by several graphs has one copy

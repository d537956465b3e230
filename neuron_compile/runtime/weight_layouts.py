"""Runtime stage: column-major copies of weight parameters, kept across calls (the layout passes/layouts.py chose).

Input: a call's arguments and the indices of the inputs the graph's matmuls read transposed. Output: the same
arguments with each such ``nn.Parameter`` replaced by a column-major copy of it: the same shape and values, dim 0
innermost (strides (1, rows) for a matrix; a convolution weight's output channels innermost), so the kernels
compiled for that signature load the weight's transpose with plain DMAs.

A copy is made once per parameter and version: it is keyed by the parameter's identity (weakly, so a freed model
frees its copies) and checked against the parameter's version counter, data pointer, shape, strides and storage
offset on every call, so an optimizer step, an in-place update (``w.mul_(2)``) or ``w.data = ...`` (even a view of
the same memory with other strides, which keeps the data pointer and the version) is seen and the copy remade. What
no counter shows is not seen: a write through ``w.data`` (``w.data.mul_(2)``) leaves ``w``'s version unchanged, so
the copy keeps the old values; update weights in place under ``torch.no_grad()`` instead, or set
``NEURON_COMPILE_TRANSPOSED_WEIGHTS=0``. Only parameters are
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
from neuron_compile.runtime.kept import Kept


class ColumnMajorCopies:
    """Parameter -> (its stamp: version, data pointer and metadata; its column-major copy; the memory it was made
    from); thread-safe.

    The entry holds the memory the copy was made from until the copy is remade or the parameter dies, so no other
    tensor can come at that address meanwhile: a weight swapped in two steps (``w.data = torch.empty(0)``, later
    ``w.data = new``) cannot land at its old address with its old version and be taken for the copied one.

    Keyed by ``id`` in a plain dict, with a weak reference that tells the parameter apart from a later object of
    the same id and drops the entry when the parameter dies: torch's ``WeakIdKeyDictionary`` makes a weak reference
    on every lookup, and a cache hit looks up every transposed weight of the graph."""

    def __init__(self):
        self._copies: dict[int, tuple[weakref.ref, tuple, torch.Tensor, torch.Tensor]] = {}
        # every live copy, by id (``owns``; not a WeakSet: it compares members with ``==``, elementwise for tensors)
        self._made: dict[int, weakref.ref] = {}
        # Reentrant: a parameter may die (and _forget run) in a garbage collection inside the locked section.
        self._lock = threading.RLock()

    def copy_of(self, weight: torch.nn.Parameter) -> torch.Tensor:
        """``weight``'s column-major copy, made now if the weight changed since the last one."""
        stamp = (weight._version, weight.data_ptr(), weight.shape, weight.stride(), weight.storage_offset())
        entry = self._copies.get(id(weight))
        if entry is not None and entry[0]() is weight and entry[1] == stamp:
            return entry[2]
        with self._lock:
            entry = self._copies.get(id(weight))
            if entry is None or entry[0]() is not weight or entry[1] != stamp:
                with torch.no_grad():
                    copy = weight.detach().movedim(0, -1).contiguous().movedim(-1, 0)
                forget = functools.partial(self._forget, id(weight))
                entry = self._copies[id(weight)] = (weakref.ref(weight, forget), stamp, copy, weight.detach())
                self._made[id(copy)] = weakref.ref(copy, functools.partial(self._forget_copy, id(copy)))
                stats.add(weight_copies=1, weight_copy_bytes=copy.numel() * copy.element_size())
        return entry[2]

    def _forget(self, key: int, dead: weakref.ref) -> None:
        """A parameter died: drop its copy (unless a new object of the same id has taken the entry since)."""
        with self._lock:
            entry = self._copies.get(key)
            if entry is not None and entry[0] is dead:
                del self._copies[key]

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a copy made here: only ever read (a graph that writes a weight gets no copy of it,
        passes/layouts.py), over a storage of its own that nothing resizes, so one object is one memory."""
        made = self._made.get(id(tensor))
        return made is not None and made() is tensor

    def _forget_copy(self, key: int, dead: weakref.ref) -> None:
        """A copy died: forget it (unless a new copy of the same id has taken the entry since)."""
        with self._lock:
            if self._made.get(key) is dead:
                del self._made[key]

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


class KeptCopies:
    """The copies calls swapped in, by argument position, for a hit plan (runtime/hit_plan.py) to reuse: a kept copy
    serves a later call while its weight is the same parameter object with the same version counter and data
    pointer, and its metadata is unchanged (which the plan checks first: the copy follows from the weight's metadata
    and values); otherwise ``copies.copy_of`` answers, and its copy is kept too. Up to ``KEPT_PER_OWNER`` weights
    per position (diffusers' regional compile calls one graph with each block's weights in turn). Weights and copies
    are held weakly, and an entry goes when its weight dies: a plan must not keep a freed model's weights or copies
    alive. An entry holds the memory its copy was made from, as ``ColumnMajorCopies`` does, so the same data pointer
    is the same memory."""

    def __init__(self, args: list, swapped: list, copies: ColumnMajorCopies = COPIES):
        self.copies = copies
        # per swapped position: (position, {id(weight): (weak reference to the weight, its version, its data
        # pointer, weak reference to the copy, the memory the copy was made from)})
        self.kept = [(position, Kept()) for position in range(len(args)) if swapped[position] is not args[position]]
        for position, kept in self.kept:
            self.keep(kept, args[position], swapped[position])

    @staticmethod
    def keep(kept: Kept, weight: torch.Tensor, copy: torch.Tensor) -> None:
        stamp = weakref.ref(weight), weight._version, weight.data_ptr(), weakref.ref(copy), weight.detach()
        kept.keep(id(weight), stamp, owners=(weight,))

    def apply(self, args: list) -> list:
        """``args`` with the kept positions' copies swapped in (``args`` itself when no position is kept)."""
        if not self.kept:
            return args
        swapped = list(args)
        for position, kept in self.kept:
            weight = args[position]
            entry = kept.get(id(weight))
            copy = None
            if entry is not None and entry[0]() is weight and weight._version == entry[1] \
                    and weight.data_ptr() == entry[2]:
                copy = entry[3]()
            if copy is None:
                copy = self.copies.copy_of(weight)
                self.keep(kept, weight, copy)
            swapped[position] = copy
        return swapped

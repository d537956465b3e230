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

    Kept by ``id`` in a ``Kept`` without a limit (one entry per live parameter), which drops an entry when its
    parameter dies, so an entry found under a parameter's id is that parameter's: torch's ``WeakIdKeyDictionary``
    makes a weak reference on every lookup, and a cache hit looks up every transposed weight of the graph."""

    def __init__(self):
        self._copies = Kept(limit=None)  # id(weight) -> (stamp, copy, the memory the copy was made from)
        # every live copy, by id (``owns``; not a WeakSet: it compares members with ``==``, elementwise for tensors)
        self._made = Kept(limit=None)
        self._lock = threading.Lock()

    def copy_of(self, weight: torch.nn.Parameter) -> torch.Tensor:
        """``weight``'s column-major copy, made now if the weight changed since the last one."""
        stamp = (weight._version, weight.data_ptr(), weight.shape, weight.stride(), weight.storage_offset())
        entry = self._copies.get(id(weight))
        if entry is not None and entry[0] == stamp:
            return entry[1]
        with self._lock:
            entry = self._copies.get(id(weight))
            if entry is None or entry[0] != stamp:
                with torch.no_grad():
                    copy = weight.detach().movedim(0, -1).contiguous().movedim(-1, 0)
                entry = (stamp, copy, weight.detach())
                self._copies.keep(id(weight), entry, owners=(weight,))
                self._made.keep(id(copy), True, owners=(copy,))
                stats.add(weight_copies=1, weight_copy_bytes=copy.numel() * copy.element_size())
        return entry[1]

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a copy made here: only ever read (a graph that writes a weight gets no copy of it,
        passes/layouts.py), over a storage of its own that nothing resizes, so one object is one memory."""
        return id(tensor) in self._made

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
        # per swapped position: (position, {id(weight): (its version, its data pointer, weak reference to the copy,
        # the memory the copy was made from)}); an entry present is its weight's (``Kept`` drops it when it dies)
        self.kept = [(position, Kept()) for position in range(len(args)) if swapped[position] is not args[position]]
        for position, kept in self.kept:
            self.keep(kept, args[position], swapped[position])

    @staticmethod
    def keep(kept: Kept, weight: torch.Tensor, copy: torch.Tensor) -> None:
        stamp = weight._version, weight.data_ptr(), weakref.ref(copy), weight.detach()
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
            if entry is not None and weight._version == entry[0] and weight.data_ptr() == entry[1]:
                copy = entry[2]()
            if copy is None:
                copy = self.copies.copy_of(weight)
                self.keep(kept, weight, copy)
            swapped[position] = copy
        return swapped

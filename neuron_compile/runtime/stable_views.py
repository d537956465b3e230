"""Runtime stage: a compiled region's flat kernel arguments, kept across calls where the memory stays put.

Input: a region call's input tensors and the region's input slots (runtime/launch_plan.py). Output: one flat tensor
per input, over the storage span its kernels read (``flat_argument``), remade only when it must be.

``StableViews`` keeps, per input, the flat views of storages that stay put, so a hit does not remake them: each
parameter's (several per input: a regional compile calls one graph with each block's weights), and a buffer's seen
at the same address on two calls in a row; a tensor new on every call (an activation) gets a fresh view, and no
view of it is kept. A column-major weight copy (runtime/weight_layouts.py) is only ever read and owns its storage,
so its view is kept at once and serves the same object without any check. A kept view holds its storage alive
no longer than the tensor it was made from lives (``Kept``): a freed model frees its weights.
"""

from __future__ import annotations

import torch

from neuron_compile.runtime.kept import Kept
from neuron_compile.runtime.launch_plan import InputSlot, flat_argument
from neuron_compile.runtime.weight_layouts import COPIES


class StableViews:
    """Per region input, the flat argument views it may serve again (see the module docstring). A view kept by
    address serves a call when it starts at the tensor's data pointer (its storage's address plus its offset), has
    its dtype, and its storage still covers the slot's span: it then reads the very memory a new view would (two
    live storages cannot share an address unless they share the memory), also after its storage was freed and
    regathered in place (FSDP2's ``resize_``). Parameters keep up to ``KEPT_PER_OWNER`` views each (diffusers'
    regional compile calls one graph with each block's weights in turn); any other tensor one, made when it came
    at the same address on two calls in a row (an activation new on every call keeps none). A weight copy's view
    serves the same copy object (``ColumnMajorCopies.owns``), an empty input's the same empty tensor."""

    def __init__(self, inputs: int):
        # per input: {data pointer: (the kept view, the view's storage, the bytes that storage must hold)}; a
        # storage object's nbytes shows a resize of it (FSDP2 freeing it)
        self._by_pointer: list[Kept] = [Kept() for _ in range(inputs)]
        self._last_pointer = [0] * inputs  # per input: the data pointer of a non-parameter on the last call
        self._empty: list[torch.Tensor | None] = [None] * inputs  # per input with an empty span: one empty view
        # per input: {id of a live tensor: the view that serves it whenever it comes again}: weight copies (one
        # object is one memory), empty inputs (nothing is read; the dtype is checked before, by the key or region)
        self._by_identity: list[Kept] = [Kept() for _ in range(inputs)]

    def arguments(self, tensors, slots: tuple[InputSlot, ...]) -> list[torch.Tensor]:
        """The kernels' flat argument for each input, in order (``argument``)."""
        return [self.argument(index, tensor, slot) for index, (tensor, slot) in enumerate(zip(tensors, slots))]

    def argument(self, index: int, tensor: torch.Tensor, slot: InputSlot) -> torch.Tensor:
        """Input ``index``'s flat argument: a view kept for the same object or the same memory, else ``view``'s."""
        known = self._by_identity[index].get(id(tensor))
        if known is not None:
            return known
        pointer = tensor.data_ptr()
        kept = self._by_pointer[index].get(pointer)
        if kept is not None and kept[0].data_ptr() == pointer and kept[0].dtype == tensor.dtype \
                and kept[1].nbytes() >= kept[2]:
            return kept[0]
        return self.view(index, tensor, slot)

    def view(self, index: int, tensor: torch.Tensor, slot: InputSlot) -> torch.Tensor:
        """The flat view of ``tensor`` for input ``index`` (``slot``), made now and kept where it may serve again
        (``arguments`` finds the kept ones). A kept view is detached: an autograd view's ``_base`` would hold the
        tensor it was made from alive, and nothing kept may outlive that tensor."""
        if slot.narrow_to_int32:  # a converted copy: its values are checked on every call
            return flat_argument(tensor, slot)
        if slot.span == 0:
            # Nothing is read: any empty view of the dtype serves (an empty tensor's address is 0 or arbitrary).
            kept = self._empty[index]
            if kept is None or kept.dtype != tensor.dtype:
                kept = self._empty[index] = flat_argument(tensor, slot).detach()
            self._by_identity[index].keep(id(tensor), kept, owners=(tensor,))
            return kept
        flat = flat_argument(tensor, slot)
        pointer, by_pointer = tensor.data_ptr(), self._by_pointer[index]
        if COPIES.owns(tensor):
            flat = flat.detach()
            self._by_identity[index].keep(id(tensor), flat, owners=(tensor,))
        elif isinstance(tensor, torch.nn.Parameter) and pointer != 0:
            flat = self.keep_by_pointer(by_pointer, tensor, flat, slot)
        else:  # one view at most, of a storage that stayed put
            by_pointer.drop(self._last_pointer[index])
            if pointer == self._last_pointer[index] and pointer != 0:
                flat = self.keep_by_pointer(by_pointer, tensor, flat, slot)
            self._last_pointer[index] = pointer
        return flat

    @staticmethod
    def keep_by_pointer(by_pointer: Kept, tensor: torch.Tensor, flat: torch.Tensor, slot: InputSlot) -> torch.Tensor:
        """Keep ``flat``, detached, for calls that bring ``tensor``'s memory again; the kept view."""
        flat = flat.detach()
        storage_bytes = (flat.storage_offset() + slot.span) * flat.element_size()
        by_pointer.keep(tensor.data_ptr(), (flat, flat.untyped_storage(), storage_bytes), owners=(tensor,))
        return flat

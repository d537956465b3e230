"""Runtime stage: a cache hit on a graph that is one NKI region, straight to the region's kernels.

Input: the entry a hit plan found (runtime/hit_plan.py), when its code only passes the graph's arguments and
constants to one region module (runtime/region_module.py ``RegionModule``) and returns items of that region's
outputs or arguments: the graph of a model whose every op is lowered. Output: ``DirectHit``; calling it with the
call's arguments returns the graph's outputs as the entry's ``forward`` would, without the FX code, the region
module's call or a region call's per-input work, once a memo of the call's stable arguments holds.

A memo (``StableArguments``) holds the region's flat kernel arguments of one call and what makes them valid again.
Stable arguments are the parameters and any tensor that was the very same object on the call before (a buffer);
the rest (activations) get a flat argument per call, as do int64 inputs narrowed to int32 (a converted copy). A
call reuses a memo's flat arguments when its stable arguments are at the same data pointers; the weights the
region reads as column-major copies (runtime/weight_layouts.py) must also be the same objects with the same
version counter (the copy holds their values then; a counter belongs to its object). A memo's flat views hold
their storages, and it holds the storages the copies were made from, so no other memory can take a viewed or
copied parameter's address: the same data pointer is the same memory (a storage freed in place, as FSDP2 does
with ``resize_(0)``, moves the tensor's pointer to 0; one resized elsewhere moves it too). The caller has checked
everything else of the call's dispatch key (every tensor's metadata and storage offset, the scalars, the value
bounds). Anything else makes a new memo through the region's ``prepare``, as a region call would. Memos are kept
per anchor, the first parameter (by identity): diffusers' regional compile calls one graph with each block's
weights in turn.

A memo lives no longer than its stable arguments (``Kept``): it holds their memory, not the tensors, so a freed
model frees its weights, and it tells its copied weights by ``id``, which no other object can take while they live.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable

import torch

from neuron_compile.runtime.kept import Kept
from neuron_compile.runtime.launch_plan import flat_argument

DATA_POINTER = torch.Tensor.data_ptr
VERSION = operator.attrgetter("_version")


def picker(positions: tuple[int, ...]) -> Callable[[list], tuple]:
    """A function from a list to its items at ``positions`` as a tuple (``operator.itemgetter`` returns one item
    bare, and takes no empty list)."""
    if not positions:
        return lambda items: ()
    if len(positions) == 1:
        (position,) = positions
        return lambda items: (items[position],)
    return operator.itemgetter(*positions)


def kept_arguments(arguments: list, volatile: tuple) -> tuple:
    """A memo's flat arguments: none for the inputs made per call (a kept one would hold its call's tensor), and
    the others detached: an autograd view's ``_base`` would hold the tensor it was made from, and a memo must not
    outlive its stable arguments."""
    kept = [argument.detach() if isinstance(argument, torch.Tensor) and argument._base is not None else argument
            for argument in arguments]
    for index, _, _ in volatile:
        kept[index] = None
    return tuple(kept)


class StableArguments:
    """One call's flat kernel arguments, and what must hold for a later call to reuse them (module docstring).

    ``sources``: per region input, the graph argument's position it reads, or the constant tensor it is."""

    def __init__(self, args: list, stable: tuple[int, ...], swapped: list, sources: tuple, arguments: list,
                 region):
        copied = tuple(position for position in stable if swapped[position] is not args[position])
        narrowed = {index for index, slot in enumerate(region.plan.inputs) if slot.narrow_to_int32}
        self.pick, self.pointers = picker(stable), [args[position].data_ptr() for position in stable]
        # the copied weights by id (sound: a memo lives no longer than its stable arguments) and version
        self.pick_copied = picker(copied)
        self.copied_ids, self.versions = [id(args[position]) for position in copied], [
            args[position]._version for position in copied]
        # the memory the copies were made from: no other tensor can come at its address while the memo lives
        self.copied_from = tuple(args[position].detach() for position in copied)
        # per region input made per call: (input index, the argument position it reads, whether it is narrowed)
        self.volatile = tuple((index, source, index in narrowed) for index, source in enumerate(sources)
                              if isinstance(source, int) and (source not in stable or index in narrowed))
        self.flat = kept_arguments(arguments, self.volatile)
        # the region inputs ``finish`` reads as tensors: (input index, argument position or the fixed tensor)
        self.reads = tuple((index, swapped[sources[index]] if sources[index] in copied else sources[index])
                           for index in region.reads_tensors)
        self.count = len(sources)

    def holds(self, args: list) -> bool:
        """Whether this memo's flat arguments serve ``args`` (a call with the memo's dispatch key)."""
        copied = self.pick_copied(args)
        return (list(map(DATA_POINTER, self.pick(args))) == self.pointers
                and list(map(id, copied)) == self.copied_ids
                and list(map(VERSION, copied)) == self.versions)

    def arguments(self, args: list, region) -> list:
        """The kernels' flat arguments for ``args``: the memo's, with the volatile inputs' made now."""
        arguments = list(self.flat)
        slots, views = region.plan.inputs, region.views
        for index, position, narrowed in self.volatile:
            if narrowed:  # a new tensor on every call: no view of it is ever kept
                arguments[index] = flat_argument(args[position], slots[index])
            else:
                arguments[index] = views.argument(index, args[position], slots[index])
        return arguments

    def tensors(self, args: list) -> list:
        """The region's input tensors ``finish`` reads (``reads``; the others None)."""
        tensors = [None] * self.count
        for index, source in self.reads:
            tensors[index] = args[source] if isinstance(source, int) else source
        return tensors


class DirectHit:
    """The hit path of a one-region graph (module docstring); build with ``DirectHit.of``."""

    def __init__(self, module, sources: tuple, outputs: tuple[tuple[bool, int], ...], anchor: int | None):
        self.module = module  # the region module: its settled state and its fall-back
        self.region = module.compiled
        self.sources = sources  # per region input: a graph argument's position, or a constant tensor
        self.outputs = outputs  # per graph output: (True, region output index) or (False, argument position)
        # when every graph output is a region output: the region's outputs -> the graph's, in one C call
        self.pick_outputs = picker(tuple(index for _, index in outputs)) if all(
            from_region for from_region, _ in outputs) else None
        self.anchor = anchor  # the first parameter's position: memos are kept by its id
        self.memos = Kept()  # anchor id -> StableArguments
        self.previous: list | None = None  # weak references to the last new memo's call's tensors
        # Whether the region module was settled (``RegionModule.settled``) with real inputs only: it stays so until
        # it fails, when its ``compiled`` is no longer this region
        self.settled = False

    @classmethod
    def of(cls, entry: torch.fx.GraphModule, args: list) -> DirectHit | None:
        """The direct hit of ``entry`` (called with arguments like ``args``), or None when its code does more than
        pass arguments and constants to one compiled region and return what it gives."""
        placeholders, region_node, outputs = {}, None, None
        for node in entry.graph.nodes:
            if node.op == "placeholder":
                placeholders[node] = len(placeholders)
            elif node.op == "call_module" and region_node is None:
                region_node = node
            elif node.op == "call_function" and node.target is operator.getitem and node.args[0] is region_node:
                continue
            elif node.op == "output":
                outputs = node.args[0]
            elif node.op != "get_attr" or "." in node.target:  # a constant of a submodule: not read as one here
                return None
        if region_node is None or not isinstance(outputs, (tuple, list)):
            return None
        module = getattr(entry, region_node.target)
        if not hasattr(module, "settled") or not hasattr(module.compiled, "prepare"):
            return None
        sources = tuple(placeholders[arg] if arg in placeholders else getattr(entry, arg.target)
                        for arg in region_node.args if isinstance(arg, torch.fx.Node) and arg.op != "call_module")
        if len(sources) != len(region_node.args) or region_node.kwargs:
            return None
        returned = []
        for output in outputs:
            if output in placeholders:
                returned.append((False, placeholders[output]))
            elif isinstance(output, torch.fx.Node) and output.target is operator.getitem:
                returned.append((True, output.args[1]))
            else:
                return None
        anchor = next((position for position, arg in enumerate(args) if isinstance(arg, torch.nn.Parameter)), None)
        return cls(module, sources, tuple(returned), anchor)

    def __call__(self, args: list, swap: Callable[[list], list]) -> tuple | None:
        """The graph's outputs for ``args`` (a call with the entry's dispatch key), or None when the region is not
        settled (not yet called, or failed): the caller runs the entry. ``swap``: the call's arguments with the
        column-major weight copies swapped in."""
        module, region = self.module, self.region
        if module.compiled is not region or not (self.settled or self.settle()):
            return None
        memo = self.memos.get(id(args[self.anchor]) if self.anchor is not None else 0)
        if memo is not None and memo.holds(args):
            tensors, arguments = memo.tensors(args) if memo.reads else (), memo.arguments(args, region)
        else:
            swapped = swap(args)
            tensors = self.region_tensors(swapped)
            try:
                tensors, arguments = region.prepare(tensors)
            except Exception as error:  # noqa: BLE001 -- as the region module's call: Config.fallback decides
                return self.graph_outputs(module.fall_back_from(error, tensors), args)
            self.remember(args, swapped, arguments)
        try:
            results = region.finish(tensors, arguments)
        except Exception as error:  # noqa: BLE001 -- as the region module's call: Config.fallback decides
            results = module.fall_back_from(error, self.region_tensors(swap(args)))
        return self.graph_outputs(results, args)

    def settle(self) -> bool:
        """Whether the region module has settled, for good (``settled``); complex inputs (as real pairs) never are."""
        self.settled = self.module.settled and not self.region.maybe_complex
        return self.settled

    def region_tensors(self, swapped: list) -> list:
        """The region's input tensors for a call whose arguments (copies swapped in) are ``swapped``."""
        return [swapped[source] if isinstance(source, int) else source for source in self.sources]

    def graph_outputs(self, results, args: list) -> tuple:
        if self.pick_outputs is not None:
            return self.pick_outputs(results)
        return tuple([results[index] if from_region else args[index] for from_region, index in self.outputs])

    def remember(self, args: list, swapped: list, arguments: list) -> None:
        """Keep a memo of this call when the call before it tells its stable arguments apart (the first call after
        a change only records its tensors)."""
        previous = self.previous
        self.previous = [weakref.ref(arg) if isinstance(arg, torch.Tensor) else None for arg in args]
        if previous is None or len(previous) != len(args):
            return
        stable = tuple(position for position, arg in enumerate(args) if isinstance(arg, torch.Tensor) and (
            isinstance(arg, torch.nn.Parameter) or (previous[position] is not None and previous[position]() is arg)))
        memo = StableArguments(args, stable, swapped, self.sources, arguments, self.region)
        self.memos.keep(id(args[self.anchor]) if self.anchor is not None else 0, memo,
                        owners=tuple(args[position] for position in stable))

"""Fusion stage, before grouping: a copy that its readers read as a view of its source.

Input: the lowered IR nodes of a region and the buffers that must reach HBM (region outputs). Output: the nodes
without the pure copies (a pointwise node storing one load of another buffer, no cast) whose every reader can read
the copy's source through a strided view instead, those readers' loads rewritten to it. A copy into a new layout is
what transformers' first write into an empty cache makes (``cat([past, v])`` with no past): the attention kernel then
reads v where the projection wrote it, one kernel and a round trip through HBM fewer. A reader whose view does not
compose (it walks two of the copy's dims as one, say) or whose innermost contiguous run would shrink keeps the copy.

A copy that no reader can read through (an o projection walks heads and head dim as one K) is taken the other
way where its source is a flash attention's output that only the copy reads: the attention writes straight into the
copy's layout (``write_copies_in_writers``), as it already does where eager's layout is [tokens, heads, D]. Phi-3's
``transpose(1, 2).contiguous()`` of a [heads, tokens, 96] output: one kernel and 3 MB of HBM traffic fewer.
"""

from __future__ import annotations

import dataclasses

from neuron_compile import ir, kinds


def dense_dims(layout: ir.Layout) -> list[int] | None:
    """The dims of more than one index of a layout that reaches each element of a contiguous range once, outermost
    (largest stride) first; None for any other layout (gaps, overlaps, negative or zero strides)."""
    dims = sorted((d for d, size in enumerate(layout.shape) if size > 1), key=lambda d: layout.strides[d])
    expected = 1
    for d in dims:
        if layout.strides[d] != expected:
            return None
        expected *= layout.shape[d]
    return dims[::-1]


def view_through_copy(reader: ir.Layout, store: ir.Layout, source: ir.Layout,
                      multiples: bool = False) -> ir.Layout | None:
    """The layout of the copy's source that addresses what ``reader`` reads of the copy's output, the copy writing
    ``source``'s elements at ``store``; None when ``reader`` does not walk the store's dims one by one. With
    ``multiples``, a reader dim may also step by a whole multiple of one store dim's stride, and several reader dims
    may share that store dim, as long as their steps added up stay inside it (a grouped attention's 4 groups of 8
    heads over a copy's 32 heads): no step then carries into the next dim, so each reader index still names one
    index of the copy's domain."""
    dims = dense_dims(store)
    if dims is None or reader.offset < store.offset:
        return None
    start, remainder = [0] * len(store.shape), reader.offset - store.offset
    for d in dims:  # the reader's first element as an index of the copy's domain
        start[d], remainder = divmod(remainder, store.strides[d])
    if remainder or any(start[d] >= store.shape[d] for d in dims):
        return None
    strides, used, reach = [], set(), list(start)  # reach[d]: the largest index of store dim d the reader gets to
    for size, stride in zip(reader.shape, reader.strides, strict=True):
        if size == 1 or stride == 0:
            strides.append(0)
            continue
        match = _store_dim(stride, store, [d for d in dims if multiples or d not in used], multiples)
        if match is None:
            return None
        step = stride // store.strides[match]
        reach[match] += (size - 1) * step
        if reach[match] >= store.shape[match]:
            return None
        used.add(match)
        strides.append(source.strides[match] * step)
    offset = source.offset + sum(start[d] * source.strides[d] for d in dims)
    return ir.Layout(reader.shape, tuple(strides), offset)


def _store_dim(stride: int, store: ir.Layout, dims: list[int], multiples: bool) -> int | None:
    """Of ``dims`` (dense), the store dim a reader dim of ``stride`` walks: the one of that stride or, with
    ``multiples``, the one whose strides' range holds it as a whole multiple; None for any other stride."""
    for d in dims:
        if store.strides[d] == stride:
            return d
        inside = store.strides[d] < stride < store.strides[d] * store.shape[d]
        if multiples and inside and stride % store.strides[d] == 0:
            return d
    return None


def _keeps_runs(reader: ir.Layout, view: ir.Layout) -> bool:
    """Whether the view reads contiguous runs wherever the reader did (its innermost dim)."""
    return not reader.shape or reader.shape[-1] == 1 or reader.strides[-1] != 1 or view.strides[-1] == 1


def _copied(node: ir.Node, region_outputs: set[str]) -> ir.Load | None:
    """The load a pure copy node stores (one store of one load of the same dtype, not a region output), else None."""
    if not kinds.kind_of(node).elementwise or len(kinds.stores(node)) != 1:
        return None
    store = kinds.stores(node)[0]
    source = store.expr
    if not isinstance(source, ir.Load) or source.dtype != store.buffer.dtype or store.buffer.name in region_outputs:
        return None
    return source if source.layout.shape == store.layout.shape else None


def _through(copy: ir.Store, source: ir.Load, reader: ir.Node) -> ir.Node | None:
    """``reader`` reading the copy's source instead of its output, or None if one of its loads cannot."""
    failed = []

    def redirect(load: ir.Load) -> ir.Load:
        if load.buffer != copy.buffer.name:
            return load
        view = view_through_copy(load.layout, copy.layout, source.layout)
        if view is None or not _keeps_runs(load.layout, view):
            failed.append(load)
            return load
        return ir.Load(source.buffer, view, source.dtype)

    rewritten = kinds.map_loads(reader, redirect)
    if failed or any(load.buffer == copy.buffer.name for load in kinds.loads(rewritten)):
        return None
    return rewritten


def read_copies_as_views(nodes: list[ir.Node], region_outputs: set[str]) -> list[ir.Node]:
    """``nodes`` without the copies every reader of which reads the copy's source as a view (see the module
    docstring)."""
    for name in [node.name for node in nodes]:
        node = next(node for node in nodes if node.name == name)  # as rewritten by an earlier copy's removal
        source = _copied(node, region_outputs)
        if source is None:
            continue
        copy = kinds.stores(node)[0]
        readers = [other for other in nodes if any(load.buffer == copy.buffer.name for load in kinds.loads(other))]
        rewritten = [_through(copy, source, reader) for reader in readers]
        if not readers or any(reader is None for reader in rewritten):
            continue
        replaced = dict(zip((reader.name for reader in readers), rewritten, strict=True))
        nodes = [replaced.get(other.name, other) for other in nodes if other is not node]
    return nodes


def _written_in_place(copy: ir.Store, source: ir.Load, writer: ir.Node) -> ir.Node | None:
    """``writer`` storing into the copy's output, each element where the copy would put it; None unless the writer
    is a flash attention whose one store is its plain output, the buffer the copy reads (any store layout is an
    access pattern to that kernel, kinds/attention_operands.py)."""
    if not isinstance(writer, ir.Attention) or len(writer.stores) != 1:
        return None
    store = writer.stores[0]
    if store.buffer.name != source.buffer or not isinstance(store.expr, ir.Result):
        return None
    layout = view_through_copy(store.layout, source.layout, copy.layout, multiples=True)
    if layout is None or not _keeps_runs(store.layout, layout):
        return None
    return dataclasses.replace(writer, stores=(ir.Store(copy.buffer, store.expr, layout),))


def write_copies_in_writers(nodes: list[ir.Node], region_outputs: set[str]) -> list[ir.Node]:
    """``nodes`` without the copies whose source only the copy reads and whose writer can store into the copy's
    layout instead (see the module docstring)."""
    for name in [node.name for node in nodes]:
        node = next((node for node in nodes if node.name == name), None)
        source = None if node is None else _copied(node, region_outputs)
        if source is None or source.buffer in region_outputs:
            continue
        readers = [other for other in nodes if any(load.buffer == source.buffer for load in kinds.loads(other))]
        writers = [other for other in nodes if any(store.buffer.name == source.buffer for store in kinds.stores(other))]
        if readers != [node] or len(writers) != 1:
            continue
        rewritten = _written_in_place(kinds.stores(node)[0], source, writers[0])
        if rewritten is not None:
            nodes = [rewritten if other is writers[0] else other for other in nodes if other is not node]
    return nodes

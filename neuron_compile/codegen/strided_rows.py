"""Codegen helper: rows read or written with a small step along their innermost dim, moved as contiguous DMAs.

Input: a kernel's loads and stores whose innermost free access-pattern entry has a step of 2-8 elements (the two
halves of a rotary pair, ``x[..., 0::2]`` and ``x[..., 1::2]``; ``stack([a, b], -1)``, ``out[..., 1::2] = v``).
Output: kernel text that moves whole contiguous rows and takes the step on chip. A DMA moves memory in bursts of
64 bytes, so an element-strided DMA pays a burst per element (32 times the bytes of a bf16 row); an engine reads
and writes an SBUF view with a step of up to 16 bytes at full rate (nki-spec §2). So:

* a load (``SpanLoads``) is one DMA of the contiguous span its elements lie in, read by the instructions through
  a view of that step; loads of the same span at another phase (``x[..., 1::2]`` beside ``x[..., 0::2]``) share
  the tile and its one DMA;
* the stores of ``k`` values that interleave (phases ``0 .. k-1`` of step ``k``, together every element of the
  rows: ``interleaved_store_lines``) are copied into the phases of one SBUF tile, stored by one contiguous DMA.
"""

from __future__ import annotations

import dataclasses

from neuron_compile import ir
from neuron_compile.codegen.expressions import AccessPattern, BroadcastLoad, Ref, TileScope, emit, emit_store
from neuron_compile.dims import LoopDim

STEP_BYTES_MAX = 16  # an SBUF operand's innermost step up to this many bytes streams at full rate


def small_step(stride: int, dtype: str) -> bool:
    """Whether an innermost step of ``stride`` elements is one these helpers take on chip."""
    return 2 <= stride and stride * ir.ITEMSIZE.get(dtype, 4) <= STEP_BYTES_MAX


def _size(count) -> int | None:
    """An access-pattern count as a number (``64`` or ``"64"``), None for a loop bound (``cols``)."""
    return int(count) if isinstance(count, int) or str(count).isdigit() else None


def _widened(entries: tuple, step: int) -> tuple:
    """The entries with the innermost ``[step, count]`` made a contiguous ``[1, count * step]``."""
    *outer, (_, count) = entries
    return (*outer, (1, f"{count} * {step}" if _size(count) is None else _size(count) * step))


def _tile_entries(entries: tuple, step: int) -> list[tuple[int, object]]:
    """The free entries of a tile filled row-major with ``entries`` widened by ``step``, read with that step:
    (the tile's stride, the entry's count) per entry (only the first count may be a loop variable)."""
    counts = [count for _, count in entries[1:]]
    strides, inner = [], step
    for count in reversed(counts):
        strides.append(inner)
        inner = inner * _size(count) if _size(count) is not None and inner is not None else None
    return list(zip(reversed(strides), counts))


def _ap_text(tile: str, width: int, free: list[tuple[int, object]], phase: int) -> str:
    return f"{tile}.ap([[{width}, rows], {', '.join(f'[{stride}, {count}]' for stride, count in free)}], offset={phase})"


@dataclasses.dataclass(frozen=True)
class SpanLoad:
    """A load with a small innermost step, as one DMA of its contiguous span (see the module docstring)."""

    key: tuple  # loads with the same key share the span's tile
    source: AccessPattern  # the span, contiguous innermost
    entries: tuple  # the load's own access-pattern entries (partition first)
    step: int
    phase: int  # the load's first element within the span

    def width(self, free: int) -> int:
        return free * self.step

    def destination(self, tile: str, free: int) -> str:
        """The tile as the span's DMA fills it: rows of ``count * step`` per innermost run."""
        length = self.source.free[-1][1]
        tile_entries = _tile_entries(self.entries, self.step)
        return _ap_text(tile, self.width(free), [*tile_entries[:-1], (1, length)], 0)

    def view(self, tile: str, free: int) -> str:
        return _ap_text(tile, self.width(free), _tile_entries(self.entries, self.step), self.phase)


class SpanLoads:
    """``span(load)`` -> a SpanLoad, or None for a load these helpers do not take. Built from every expression the
    scope will emit, so that a span is as long as its farthest phase needs (never past the last element the
    loads read, which may be the buffer's last) and loads of one span share one DMA."""

    def __init__(self, exprs, pattern, rank: int):
        self.pattern = pattern  # (buffer, layout) -> AccessPattern, partition entry first
        self.rank = rank  # the domain's: other loads (a random draw's one-element seed) are read some other way
        self.reach: dict[tuple, int] = {}
        for expr in exprs:
            for load in ir.loads_of(expr):
                found = self._phase(load)
                if found is not None:
                    key, phase = found
                    self.reach[key] = max(self.reach.get(key, 0), phase)

    def _phase(self, load: ir.Load) -> tuple[tuple, int] | None:
        if len(load.layout.shape) != self.rank:
            return None
        entries = self.pattern(load.buffer, load.layout).entries
        step = entries[-1][0]
        if len(entries) < 2 or load.dtype == "bool" or not small_step(step, load.dtype):
            return None
        phase = load.layout.offset % step
        # size-1 dims' strides do not matter (emit reads loads with them 0): keys must not differ by them
        strides = tuple(0 if size == 1 else stride for size, stride in zip(load.layout.shape, load.layout.strides))
        start = ir.Layout(load.layout.shape, strides, load.layout.offset - phase)
        return (load.buffer, load.dtype, start), phase

    def __call__(self, load: ir.Load) -> SpanLoad | None:
        found = self._phase(load)
        if found is None:
            return None
        key, phase = found
        pattern = self.pattern(load.buffer, key[2])
        *outer, (step, count) = pattern.entries
        # From phase 0 to the farthest phase any load of the span reads in its last run.
        short = step - 1 - self.reach.get(key, phase)
        if _size(count) is not None:
            length = _size(count) * step - short
        else:
            length = f"{count} * {step}" + (f" - {short}" if short else "")
        source = AccessPattern(pattern.tensor, (*outer, (1, length)), pattern.offset)
        return SpanLoad(key, source, self.pattern(load.buffer, load.layout).entries, step, phase)


def stepped_broadcast(width: int, repeats: str, source: AccessPattern, dtype: str) -> BroadcastLoad:
    """A broadcast load (``BroadcastLoad``) whose one inner entry has a small step reads its span instead."""
    if len(source.free) != 1 or not small_step(source.free[0][0], dtype):
        return BroadcastLoad(width, repeats, source)
    step = source.free[0][0]
    span = AccessPattern(source.tensor, (source.entries[0], (1, (width - 1) * step + 1)), source.offset)
    return BroadcastLoad(width, repeats, span, step)


def emit_span_load(load: ir.Load, span: SpanLoad, scope: TileScope, lines: list[str]) -> Ref:
    """The load as a view of its span's tile (the span loaded once per scope)."""
    name = scope.tiles.get(("span", span.key))
    if name is None:
        name = scope.allocator.new(f"{load.buffer}_rows", span.width(scope.free), load.dtype)
        scope.tiles[("span", span.key)] = name
        lines.append(f"nisa.dma_copy(dst={span.destination(name, scope.free)}, src={span.source})")
    return Ref(tile=name, dtype=load.dtype, view=span.view(name, scope.free))


def interleaving(stores: tuple[ir.Store, ...], innermost: LoopDim) -> tuple[ir.Store, ...] | None:
    """``stores`` ordered by phase when they interleave: the same buffer, shape and strides, offsets ``base .. base
    + k - 1`` for ``k`` stores, a step of ``k`` along ``innermost`` (so together they write every element of the
    rows); else None."""
    if len(stores) < 2 or len({(s.buffer.name, s.layout.shape, s.layout.strides) for s in stores}) != 1:
        return None
    ordered = tuple(sorted(stores, key=lambda store: store.layout.offset))
    base = ordered[0].layout.offset
    if [store.layout.offset - base for store in ordered] != list(range(len(stores))):
        return None
    step = innermost.stride(ordered[0].layout)
    return ordered if step == len(stores) and small_step(step, ordered[0].buffer.dtype) else None


def _phase_copy(view: str, source: str, value: Ref, scope: TileScope) -> str:
    """The copy of a phase into the rows' tile, on the least loaded engine: ScalarE (an activation copy) when the
    body left it idler than VectorE and GpSimd, as a rotary's multiply-adds do."""
    load = scope.balance.load
    if load["scalar"] + 1 <= min(load["vector"], load["gpsimd"]):
        scope.balance.note("scalar")
        return f"nisa.activation(dst={view}, op=nl.copy, data={source})"
    return f"nisa.tensor_copy(dst={view}, src={source}{scope.balance.pick([value], scope)})"


def interleaved_store_lines(stores: tuple[ir.Store, ...], scope: TileScope, pattern, lines: list[str]) -> None:
    """The phases of ``stores`` (from ``interleaving``) copied into one tile, stored by one contiguous DMA;
    ``pattern(buffer, layout)`` is the stores' HBM AccessPattern."""
    step, dtype = len(stores), stores[0].buffer.dtype
    entries = pattern(stores[0].buffer.name, stores[0].layout).entries
    rows = scope.allocator.new(f"{stores[0].buffer.name}_rows", scope.free * step, dtype)
    for phase, store in enumerate(stores):
        value = emit(store.expr, scope, lines)
        source = scope.ref_text(value) if value.tile is not None and not value.vector else emit_store(
            dtype, value, scope, lines)
        view = _ap_text(rows, scope.free * step, _tile_entries(entries, step), phase)
        lines.append(_phase_copy(view, source, value, scope))
    whole = pattern(stores[0].buffer.name, stores[0].layout)
    contiguous = AccessPattern(whole.tensor, _widened(whole.entries, step), whole.offset)
    counts = " * ".join(str(count) for _, count in contiguous.free)
    lines.append(f"nisa.dma_copy(dst={contiguous}, src={rows}[0:rows, 0:{counts}])")


"""Codegen helpers every kernel kind's renderer shares: the jinja2 environment (the only jinja2 user), HBM access
patterns walked by a plan's loop variables, the output and store lines, and the template context.

Input: an IR node, its TilePlan and the kernel's name and parameters. Output: pieces of kernel text and
the text of a ``KernelSource`` (codegen/kernel_source.py), what the render pass returns. The module
a kind renders imports ``nki``, ``nki.language as nl`` and ``nki.isa as nisa`` and defines one ``@nki.jit``
function taking flat 1-D HBM tensors (one per buffer it reads) and returning its ``nl.shared_hbm`` outputs.
Templates (codegen/templates/*.py.j2) call the helpers passed to them (``block``), never compute indices.

Inside ``subkernel_form()`` the same renderers give a kernel's *subkernel* text instead: a plain function (no
``@nki.jit``, no imports, the description as its docstring) that takes its output HBM tensors as parameters after
its inputs and writes them. A region launched as one kernel (codegen/region_text.py) calls its kernels' subkernels
in order: NKI inlines such calls, and ``nl.shared_hbm`` may only be allocated at the kernel's top level.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from pathlib import Path

import jinja2

from neuron_compile import ir
from neuron_compile.codegen.expressions import NL_DTYPES, AccessPattern, Ref, TileAllocator, TileScope, emit, emit_store
from neuron_compile.dims import LoopDim
from neuron_compile.kind_registry import describe
from neuron_compile.kind_registry import stores as stores_of
from neuron_compile.tiles import TilePlan

TEMPLATES = Path(__file__).parent / "templates"
# True while renderers produce subkernel text (``subkernel_form``): read by ``kernel_context``, so the eleven
# renderers need no flag of their own.
_SUBKERNEL_FORM = contextvars.ContextVar("subkernel_form", default=False)


@contextlib.contextmanager
def subkernel_form():
    """Within the block, kernel renderers produce subkernel text (see the module docstring)."""
    token = _SUBKERNEL_FORM.set(True)
    try:
        yield
    finally:
        _SUBKERNEL_FORM.reset(token)


@functools.cache
def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)), keep_trailing_newline=True, trim_blocks=True,
        lstrip_blocks=True, undefined=jinja2.StrictUndefined,
    )


def block(lines: list[str], indent: int) -> str:
    """``lines`` as one text block indented by ``indent`` levels (four spaces each)."""
    pad = "    " * indent
    return "\n".join(pad + line for line in lines)


def offset_text(base: int, terms: list[tuple[str, int]]) -> str:
    parts = [str(base)] if base or not terms else []
    parts += [f"{var} * {stride}" if stride != 1 else var for var, stride in terms if stride != 0]
    return " + ".join(parts) or "0"


def entries_text(entries) -> str:
    """An access pattern's ``[[stride, count], ...]`` as kernel text (counts may be loop variables)."""
    return "[" + ", ".join(f"[{stride}, {count}]" for stride, count in entries) + "]"


class Patterns:
    """Access patterns of one kernel: HBM layouts walked by the plan's loop variables.

    Loop variables: ``o<i>`` outer indices, ``p0`` the partition tile start (``rows`` rows), ``f0`` the free
    tile start (``cols`` columns).
    """

    def __init__(self, plan: TilePlan):
        self.plan = plan

    def outer_terms(self, layout: ir.Layout) -> list[tuple[str, int]]:
        return [(f"o{i}", dim.stride(layout)) for i, dim in enumerate(self.plan.outer)]

    def hbm(self, tensor: str, layout: ir.Layout, free: list[tuple[LoopDim, str]], chunked_free: bool,
            free_start: str = "f0") -> AccessPattern:
        """``tensor.ap(...)`` for a [rows, free...] tile; ``chunked_free`` adds ``free_start`` (the loop variable
        where the tile's first free dim starts) for the first free dim."""
        partition = self.plan.partition
        terms = self.outer_terms(layout) + [("p0", partition.stride(layout))]
        if chunked_free and free:
            terms.append((free_start, free[0][0].stride(layout)))
        entries = [(partition.stride(layout), "rows")] + [(dim.stride(layout), count) for dim, count in free]
        return AccessPattern(tensor, tuple(entries), offset_text(layout.offset, terms))


def render_template(template: str, **context) -> str:
    return _environment().get_template(template).render(block=block, **context)


def output_lines(stores) -> list[str]:
    return [
        f"{store.buffer.name} = nl.ndarray(({store.buffer.layout.span()},), dtype={NL_DTYPES[store.buffer.dtype]}, "
        "buffer=nl.shared_hbm)"
        for store in stores
    ]


def store_lines(stores, scope: TileScope, patterns: Patterns, free, chunked_free, lines: list[str],
                dma_sums=None) -> None:
    """Each store's value and its DMA to HBM; ``dma_sums`` (codegen/dma_sums.py ``DmaSums``): stored sums the DMA
    engines add, where they apply."""
    for store in stores:
        dst = patterns.hbm(store.buffer.name, store.layout, free, chunked_free)
        if dma_sums is not None and dma_sums.emit(store, str(dst), scope, lines):
            continue
        value = emit(store.expr, scope, lines)
        tile = emit_store(store.buffer.dtype, value, scope, lines)
        lines.append(f"nisa.dma_copy(dst={dst}, src={tile})")


def docstring(node: ir.Node, plan: TilePlan) -> str:
    return f"{describe(node)}\n\nTile plan: {plan.describe()}"


def kernel_names(node, parameters) -> frozenset[str]:
    """The names a kernel's tiles must not take: its parameters and its output buffers."""
    return frozenset(parameters) | {store.buffer.name for store in stores_of(node)}


def kernel_context(node, plan, name, parameters, **extra) -> dict:
    """What every kernel template reads: its name, parameters, docstring, plan, outputs and returned names, and
    whether it renders the subkernel form."""
    output_names = [store.buffer.name for store in stores_of(node)]
    return dict(
        name=name, parameters=parameters, docstring=docstring(node, plan), plan=plan,
        outputs=output_lines(stores_of(node)), returns=", ".join(output_names), output_names=output_names,
        subkernel=_SUBKERNEL_FORM.get(), **extra,
    )


def column_pattern(plan: TilePlan, patterns: Patterns, free_dims: tuple[LoopDim, ...] | None = None):
    """A scope's ``vector_pattern`` over [rows, free tile]: a load constant along every free dim of ``plan`` (or of
    ``free_dims``, where the plan's free axis is a flattened row) (a per-row statistic, as an RMSNorm's rsqrt in a
    matmul's epilogue) as one element per partition, a (P, 1) operand, instead of a DMA broadcast that moves one
    burst per repeated element; None for any other load."""

    def pattern(load: ir.Load, tile: str):
        if any(dim.stride(load.layout) != 0 for dim in (plan.free if free_dims is None else free_dims)):
            return None
        return f"{tile}[0:rows, 0:1]", patterns.hbm(load.buffer, load.layout, [(LoopDim(1, None), "1")], False)

    return pattern


def row_scopes(node, plan: TilePlan, allocator: TileAllocator, patterns: Patterns, columns: bool = True):
    """For a row kernel (reduction, softmax, scan): (the prologue's scope over [rows, row chunk], the row chunk's
    elements per partition, the free dims with their extents, whether the row is walked in chunks)."""
    chunked = plan.free[0].tile < plan.free[0].size
    row_free = plan.free[0].tile * math.prod(dim.size for dim in plan.free[1:])
    free = [(plan.free[0], "cols")] + [(dim, str(dim.size)) for dim in plan.free[1:]]

    def prologue_pattern(load: ir.Load, tile: str):
        # A DMA fills the tile row-major, so several free dims land flattened in one [rows, row] slice.
        return f"{tile}[0:rows, 0:{width}]", patterns.hbm(load.buffer, load.layout, free, chunked)

    def column_pattern(load: ir.Load, tile: str):
        # a load constant along the row (a per-row value, or a scalar): one element per partition, taken by the
        # ops as a (P, 1) operand, instead of a DMA broadcast that moves every repeated element
        if any(dim.stride(load.layout) != 0 for dim in plan.free):
            return None
        return f"{tile}[0:rows, 0:1]", patterns.hbm(load.buffer, load.layout, [(LoopDim(1, None), "1")], False)

    width = "cols" if len(free) == 1 else str(row_free)
    prologue = TileScope(allocator, row_free, f"[0:rows, 0:{width}]", prologue_pattern,
                         vector_pattern=column_pattern if columns else None)
    return prologue, row_free, free, chunked


def epilogue_scope(allocator: TileAllocator, patterns: Patterns, result: Ref,
                   results: list[tuple[LoopDim, str]] | None = None, more_results: tuple[Ref, ...] = ()) -> TileScope:
    """The scope over a row kernel's results: [rows, 1], one per partition, or [rows, k] when each partition
    holds k rows (``results``: the free dims of the results tile, with their extents); ``more_results``: the
    Refs of ``Result(1)``, ..."""
    results = results or [(LoopDim(1, None), "1")]
    width = math.prod(int(count) for _, count in results)

    def pattern(load: ir.Load, tile: str):
        return f"{tile}[0:rows, 0:{width}]", patterns.hbm(load.buffer, load.layout, results, False)

    return TileScope(allocator, width, f"[0:rows, 0:{width}]", pattern, result, more_results=more_results)

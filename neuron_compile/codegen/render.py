"""Codegen stage: a fused IR node and its TilePlan -> the source text of one standalone NKI kernel module.

Input: ``ir.Node``, ``TilePlan``, the kernel's name and its HBM input buffers. Output: ``KernelSource`` (name,
source, parameter buffer names, output buffer names). The module imports ``nki``, ``nki.language as nl`` and
``nki.isa as nisa`` and defines one ``@nki.jit`` function taking flat 1-D HBM tensors (one per buffer it
reads) and returning its ``nl.shared_hbm`` outputs. This is the only module that uses jinja2; templates call
the helpers defined here (``hbm_tile``, ``block``...), never compute indices themselves.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path

import jinja2

from neuron_compile import ir
from neuron_compile.codegen.expressions import NL_DTYPES, Ref, TileAllocator, TileScope, emit, emit_store, number
from neuron_compile.passes.tiling import TRANSPOSE_BLOCK, LoopDim, TilePlan, needs_transpose

TEMPLATES = Path(__file__).parent / "templates"
REDUCE_OPS = {"sum": "nl.add", "mean": "nl.add", "var": "nl.add", "max": "nl.maximum", "min": "nl.minimum",
              "prod": "nl.multiply"}


@dataclasses.dataclass(frozen=True)
class KernelSource:
    name: str
    source: str
    parameters: tuple[str, ...] = ()  # HBM buffers the kernel reads, in argument order
    outputs: tuple[ir.Buffer, ...] = ()  # buffers it returns, in order


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


def _offset_text(base: int, terms: list[tuple[str, int]]) -> str:
    parts = [str(base)] if base or not terms else []
    parts += [f"{var} * {stride}" if stride != 1 else var for var, stride in terms if stride != 0]
    return " + ".join(parts) or "0"


class Patterns:
    """Access patterns of one kernel: HBM layouts walked by the plan's loop variables.

    Loop variables: ``o<i>`` outer indices, ``p0`` the partition tile start (``rows`` rows), ``f0`` the free
    tile start (``cols`` columns).
    """

    def __init__(self, plan: TilePlan):
        self.plan = plan

    def outer_terms(self, layout: ir.Layout) -> list[tuple[str, int]]:
        return [(f"o{i}", dim.stride(layout)) for i, dim in enumerate(self.plan.outer)]

    def hbm(self, tensor: str, layout: ir.Layout, free: list[tuple[LoopDim, str]], chunked_free: bool) -> str:
        """``tensor.ap(...)`` for a [rows, free...] tile; ``chunked_free`` adds ``f0`` for the first free dim."""
        partition = self.plan.partition
        terms = self.outer_terms(layout) + [("p0", partition.stride(layout))]
        if chunked_free and free:
            terms.append(("f0", free[0][0].stride(layout)))
        entries = [f"[{partition.stride(layout)}, rows]"] + [f"[{dim.stride(layout)}, {count}]" for dim, count in free]
        return f"{tensor}.ap([{', '.join(entries)}], offset={_offset_text(layout.offset, terms)})"


def _render(template: str, **context) -> str:
    return _environment().get_template(template).render(block=block, **context)


def _output_lines(stores) -> list[str]:
    return [
        f"{store.buffer.name} = nl.ndarray(({store.buffer.layout.span()},), dtype={NL_DTYPES[store.buffer.dtype]}, "
        "buffer=nl.shared_hbm)"
        for store in stores
    ]


def _store_lines(stores, scope: TileScope, patterns: Patterns, free, chunked_free, lines: list[str]) -> None:
    for store in stores:
        value = emit(store.expr, scope, lines)
        tile = emit_store(store.buffer.dtype, value, scope, lines)
        dst = patterns.hbm(store.buffer.name, store.layout, free, chunked_free)
        lines.append(f"nisa.dma_copy(dst={dst}, src={tile})")


def _docstring(node: ir.Node, plan: TilePlan) -> str:
    return f"{ir.format_node(node)}\n\nTile plan: {plan.describe()}"


def render_kernel(node: ir.Node, plan: TilePlan, name: str, parameters: list[str]) -> KernelSource:
    if isinstance(node, ir.Pointwise):
        source = _render_pointwise(node, plan, name, parameters)
    elif isinstance(node, ir.Reduction) and plan.kind == "column_reduction":
        source = _render_column_reduction(node, plan, name, parameters)
    elif isinstance(node, ir.Reduction):
        source = _render_reduction(node, plan, name, parameters)
    elif isinstance(node, ir.RowNormalize):
        source = _render_row_normalize(node, plan, name, parameters)
    elif isinstance(node, ir.Scan):
        from neuron_compile.codegen.scan import render_scan  # it builds on this module's helpers

        source = render_scan(node, plan, name, parameters)
    elif isinstance(node, ir.Concat):
        source = _render_concat(node, plan, name, parameters)
    else:
        source = _render_matmul(node, plan, name, parameters)
    return KernelSource(name, source, tuple(parameters), tuple(store.buffer for store in _stores(node)))


def _stores(node: ir.Node) -> tuple[ir.Store, ...]:
    return tuple(node.stores) + tuple(getattr(node, "row_stores", ()))


def _common(node, plan, name, parameters, **extra) -> dict:
    return dict(
        name=name, parameters=parameters, docstring=_docstring(node, plan), plan=plan,
        outputs=_output_lines(_stores(node)), returns=", ".join(store.buffer.name for store in _stores(node)), **extra,
    )


def _pointwise_body(node: ir.Pointwise, plan: TilePlan, allocator: TileAllocator) -> list[str]:
    patterns = Patterns(plan)
    free = [(plan.free[0], "cols")]

    def load_pattern(load: ir.Load, tile: str):
        return f"{tile}[0:rows, 0:cols]", patterns.hbm(load.buffer, load.layout, free, True)

    def vector_pattern(load: ir.Load, tile: str):
        if plan.free[0].stride(load.layout) != 0:
            return None
        return f"{tile}[0:rows, 0:1]", patterns.hbm(load.buffer, load.layout, [(LoopDim(1, None), "1")], False)

    scope = TileScope(allocator, plan.free[0].tile, "[0:rows, 0:cols]", load_pattern, vector_pattern=vector_pattern)
    body: list[str] = []
    _store_lines(node.stores, scope, patterns, free, True, body)
    return body


def _render_pointwise(node: ir.Pointwise, plan: TilePlan, name: str, parameters: list[str]) -> str:
    allocator = TileAllocator(plan.partition.tile)
    body = _pointwise_body(node, plan, allocator)
    return _render("pointwise.py.j2", **_common(node, plan, name, parameters, allocations=allocator.lines, body=body))


def _render_concat(node: ir.Concat, plan: TilePlan, name: str, parameters: list[str]) -> str:
    allocations, parts = [], []
    for part, part_plan in zip(node.parts, plan.parts):
        allocator = TileAllocator(part_plan.partition.tile)
        allocator.count = len(allocations)  # distinct tile names across parts
        body = _pointwise_body(part, part_plan, allocator)
        allocations += allocator.lines
        parts.append(dict(plan=part_plan, body=body, depth=len(part_plan.outer) + 1))
    return _render("concat.py.j2", **_common(node, plan, name, parameters, allocations=allocations, parts=parts))


def _reduction_scopes(node, plan: TilePlan, allocator: TileAllocator, patterns: Patterns):
    """(prologue scope over [rows, row chunk], epilogue scope over [rows, 1], free dims, chunked?)."""
    chunked = plan.free[0].tile < plan.free[0].size
    row_free = plan.free[0].tile * math.prod(dim.size for dim in plan.free[1:])
    free = [(plan.free[0], "cols")] + [(dim, str(dim.size)) for dim in plan.free[1:]]

    def prologue_pattern(load: ir.Load, tile: str):
        # A DMA fills the tile row-major, so several free dims land flattened in one [rows, row] slice.
        return f"{tile}[0:rows, 0:{width}]", patterns.hbm(load.buffer, load.layout, free, chunked)

    width = "cols" if len(free) == 1 else str(row_free)
    prologue = TileScope(allocator, row_free, f"[0:rows, 0:{width}]", prologue_pattern)
    return prologue, row_free, free, chunked


def _reduce_pass(node, prologue: TileScope, transform, reduce_op: str, accumulator: str, partial: str,
                 chunked: bool) -> list[str]:
    """One walk over the row: prologue, optional per-element ``transform``, reduce, combine chunk partials."""
    lines: list[str] = []
    prologue.memo = {}  # a second pass re-emits the loads (same tiles) because a chunked row was overwritten
    value = emit(node.prologue, prologue, lines)
    if value.tile is None:  # a reduction of a fill (sum of full(1): a count): reduce a tile holding it
        constant = Ref(tile=prologue.tile(key=("reduced constant", value.value)))
        lines.append(f"nisa.memset(dst={prologue.ref_text(constant)}, value={number(value.value)})")
        value = constant
    data = transform(prologue.ref_text(value), lines) if transform else prologue.ref_text(value)
    target = partial if chunked else accumulator
    lines.append(f"nisa.tensor_reduce(dst={target}[0:rows, 0:1], op={reduce_op}, data={data}, axis=1, keepdims=True)")
    if chunked:
        lines += [
            "if f0 == 0:",
            f"    nisa.tensor_copy(dst={accumulator}[0:rows, 0:1], src={partial}[0:rows, 0:1])",
            "else:",
            f"    nisa.tensor_tensor(dst={accumulator}[0:rows, 0:1], data1={accumulator}[0:rows, 0:1], "
            f"data2={partial}[0:rows, 0:1], op={reduce_op})",
        ]
    return lines


def _render_reduction(node: ir.Reduction, plan: TilePlan, name: str, parameters: list[str]) -> str:
    patterns = Patterns(plan)
    allocator = TileAllocator(plan.partition.tile)
    prologue, row_free, free, chunked = _reduction_scopes(node, plan, allocator, patterns)
    count = math.prod(node.domain[d] for d in node.reduce_dims)
    accumulator = allocator.new("acc", 1)
    partial = allocator.new("partial", 1) if chunked else accumulator
    acc = f"{accumulator}[0:rows, 0:1]"
    passes = [(_reduce_pass(node, prologue, None, REDUCE_OPS[node.op], accumulator, partial, chunked), [])]
    if node.op == "mean":
        passes[0][1].append(f"nisa.tensor_scalar(dst={acc}, data={acc}, op0=nl.multiply, operand0={1.0 / count!r})")
    elif node.op == "var":
        # Two passes, as the numerically stable definition: mean first, then the mean of squared deviations.
        scale = 1.0 / (count - node.correction) if count > node.correction else float("nan")
        mean = allocator.new("mean", 1)
        centered, squares = allocator.new("centered", row_free), allocator.new("squares", row_free)
        window = prologue.slice_text
        passes[0][1].append(
            f"nisa.tensor_scalar(dst={mean}[0:rows, 0:1], data={acc}, op0=nl.multiply, operand0={1.0 / count!r})"
        )

        def squared_deviation(data: str, lines: list[str]) -> str:
            lines.append(f"nisa.tensor_scalar(dst={centered}{window}, data={data}, op0=nl.subtract, "
                         f"operand0={mean}[0:rows, 0:1])")
            lines.append(f"nisa.tensor_tensor(dst={squares}{window}, data1={centered}{window}, "
                         f"data2={centered}{window}, op=nl.multiply)")
            return f"{squares}{window}"

        second = _reduce_pass(node, prologue, squared_deviation, "nl.add", accumulator, partial, chunked)
        passes.append((second, [f"nisa.tensor_scalar(dst={acc}, data={acc}, op0=nl.multiply, "
                                f"operand0={number(scale)})"]))
    if plan.cross_partition:
        # Every partition holds a partial of the one result: transpose them into a row and reduce that.
        spread = allocator.new_psum("partials_row", plan.partition.tile)
        passes[-1][1].extend([
            f"nisa.nc_transpose(dst={spread}[0:1, 0:rows], data={acc})",
            f"nisa.tensor_reduce(dst={accumulator}[0:1, 0:1], op={REDUCE_OPS[node.op]}, data={spread}[0:1, 0:rows], "
            "axis=1, keepdims=True)",
            "rows = 1",
        ])
    epilogue = _epilogue_scope(allocator, patterns, Ref(tile=accumulator))
    _store_lines(node.stores, epilogue, patterns, [(LoopDim(1, None), "1")], False, passes[-1][1])
    if node.row_stores:
        # The row is still in SBUF: the fused consumers read it, with the reduced value as a (P, 1) operand.
        row = TileScope(allocator, row_free, prologue.slice_text, prologue.load_pattern,
                        Ref(tile=accumulator, vector=True))
        row.tiles, row.memo = prologue.tiles, dict(prologue.memo)
        _store_lines(node.row_stores, row, patterns, free, False, passes[-1][1])
    context = _common(node, plan, name, parameters, allocations=allocator.lines, passes=passes, chunked=chunked)
    return _render("reduction.py.j2", **context)


def _epilogue_scope(allocator: TileAllocator, patterns: Patterns, result: Ref) -> TileScope:
    one = [(LoopDim(1, None), "1")]

    def pattern(load: ir.Load, tile: str):
        return f"{tile}[0:rows, 0:1]", patterns.hbm(load.buffer, load.layout, one, False)

    return TileScope(allocator, 1, "[0:rows, 0:1]", pattern, result)


def _render_row_normalize(node: ir.RowNormalize, plan: TilePlan, name: str, parameters: list[str]) -> str:
    patterns = Patterns(plan)
    allocator = TileAllocator(plan.partition.tile)
    prologue, row_free, free, chunked = _reduction_scopes(node, plan, allocator, patterns)
    body: list[str] = []
    value = emit(node.prologue, prologue, body)
    data = prologue.ref_text(value)
    window = prologue.slice_text
    if node.causal:
        # Keep column j of query row p0 + c where (p0 + c) - j >= 0; the rest becomes -inf before the softmax.
        masked = allocator.new("causal", row_free)
        body.append(f"nisa.affine_select(dst={masked}{window}, pattern=[[-1, cols]], channel_multiplier=1, "
                    f"on_true_tile={data}, on_false_value=float('-inf'), cmp_op=nl.greater_equal, offset=p0)")
        data = f"{masked}{window}"
    row_max, negated_max, row_sum = (allocator.new(stem, 1) for stem in ("row_max", "negated_max", "row_sum"))
    exps, result = allocator.new("exps", row_free), allocator.new("softmax", row_free)
    body += [
        f"nisa.tensor_reduce(dst={row_max}[0:rows, 0:1], op=nl.maximum, data={data}, axis=1, keepdims=True)",
        f"nisa.tensor_scalar(dst={negated_max}[0:rows, 0:1], data={row_max}[0:rows, 0:1], op0=nl.multiply, "
        "operand0=-1.0)",
        f"nisa.activation(dst={exps}{window}, op=nl.exp, data={data}, bias={negated_max}[0:rows, 0:1])",
        f"nisa.tensor_reduce(dst={row_sum}[0:rows, 0:1], op=nl.add, data={exps}{window}, axis=1, keepdims=True)",
    ]
    if node.op == "softmax":
        body += [
            f"nisa.activation(dst={row_sum}[0:rows, 0:1], op=nl.reciprocal, data={row_sum}[0:rows, 0:1])",
            f"nisa.tensor_scalar(dst={result}{window}, data={exps}{window}, op0=nl.multiply, "
            f"operand0={row_sum}[0:rows, 0:1])",
        ]
    else:  # x - max - log(sum(exp(x - max)))
        body += [
            f"nisa.activation(dst={row_sum}[0:rows, 0:1], op=nl.log, data={row_sum}[0:rows, 0:1])",
            f"nisa.tensor_scalar(dst={result}{window}, data={data}, op0=nl.subtract, operand0={row_max}[0:rows, 0:1], "
            f"op1=nl.subtract, operand1={row_sum}[0:rows, 0:1])",
        ]
    scope = TileScope(allocator, row_free, window, prologue.load_pattern, Ref(tile=result))
    scope.tiles = prologue.tiles  # reuse the loaded tiles of operands read again by the epilogue
    _store_lines(node.stores, scope, patterns, free, False, body)
    return _render("row_normalize.py.j2", **_common(node, plan, name, parameters, allocations=allocator.lines,
                                                    body=body))


def _render_matmul(node: ir.MatMul, plan: TilePlan, name: str, parameters: list[str]) -> str:
    patterns = Patterns(plan)
    allocator = TileAllocator(plan.partition.tile)
    dtype = node.a.dtype
    a, b = node.a.layout, node.b.layout
    # a is (batch, M, K): the stationary tile is a^T [K chunk on partitions, M tile free].
    batch = len(node.domain) - 2
    a_batch = [(f"o{i}", a.strides[i]) for i in range(batch)]
    b_batch = [(f"o{i}", b.strides[i]) for i in range(batch)]
    a_m, a_k, b_k, b_n = a.strides[batch], a.strides[batch + 1], b.strides[batch], b.strides[batch + 1]
    stationary_offset = _offset_text(a.offset, a_batch + [("p0", a_m), ("k0", a_k)])
    transpose_stationary = needs_transpose(a_k, a_m)
    if transpose_stationary:  # a's rows [M tile, all of K] are contiguous
        stationary_offset = _offset_text(a.offset, a_batch + [("p0", a_m)])
        entries = f"[[{a_m}, rows], [{a_k}, {node.k}]]"
    else:
        entries = f"[[{a_k}, kk], [{a_m}, rows]]"
    stationary_src = f"{node.a.buffer}.ap({entries}, offset={stationary_offset})"
    # b is (batch, K, N): the moving tile is [K chunk on partitions, N tile free].
    transpose_moving = needs_transpose(b_k, b_n)
    if transpose_moving and plan.stream_moving:  # the whole N tile (128 rows of b^T) in one DMA
        offset = _offset_text(b.offset, b_batch + [("f0", b_n)])
        moving_src = f"{node.b.buffer}.ap([[{b_n}, cols], [{b_k}, {node.k}]], offset={offset})"
    elif transpose_moving:  # b^T's rows [N block of 128, K chunk] are contiguous (x @ W.T with W stored [N, K])
        offset = _offset_text(b.offset, b_batch + [("f0", b_n), ("n1", b_n)])
        moving_src = f"{node.b.buffer}.ap([[{b_n}, nn], [{b_k}, {node.k}]], offset={offset})"
    else:
        offset = _offset_text(b.offset, b_batch + [("k0", b_k), ("f0", b_n)])
        moving_src = f"{node.b.buffer}.ap([[{b_k}, kk], [{b_n}, cols]], offset={offset})"
    free = [(plan.free[0], "cols")]

    def load_pattern(load: ir.Load, tile: str):
        return f"{tile}[0:rows, 0:cols]", patterns.hbm(load.buffer, load.layout, free, True)

    product = allocator.new("product", plan.free[0].tile)
    scope = TileScope(allocator, plan.free[0].tile, "[0:rows, 0:cols]", load_pattern, Ref(tile=product))
    epilogue: list[str] = []
    _store_lines(node.stores, scope, patterns, free, True, epilogue)
    context = _common(
        node, plan, name, parameters, allocations=allocator.lines, epilogue=epilogue, product=product,
        stationary_src=stationary_src, moving_src=moving_src, operand_dtype=NL_DTYPES[dtype],
        k=node.k, k_tile=plan.k_tile, k_tiles=plan.k_tiles, transpose_stationary=transpose_stationary,
        transpose_moving=transpose_moving, transpose_block=min(plan.free[0].tile, TRANSPOSE_BLOCK),
        stream_moving=plan.stream_moving,
    )
    return _render("matmul.py.j2", **context)


def _render_column_reduction(node: ir.Reduction, plan: TilePlan, name: str, parameters: list[str]) -> str:
    """Sum over strided leading dims: ones[rows, 1].T @ tile[rows, cols] accumulates column sums in PSUM."""
    patterns = Patterns(plan)
    allocator = TileAllocator(plan.partition.tile)
    free = [(plan.free[0], "cols")]

    def load_pattern(load: ir.Load, tile: str):
        return f"{tile}[0:rows, 0:cols]", patterns.hbm(load.buffer, load.layout, free, True)

    prologue = TileScope(allocator, plan.free[0].tile, "[0:rows, 0:cols]", load_pattern)
    body: list[str] = []
    value = emit(node.prologue, prologue, body)
    # TensorE needs both operands fp32 or both bf16: the ones take the data's dtype (products by 1 are exact).
    if value.dtype not in ("float32", "bfloat16") or value.tile is None:
        staged = allocator.new("moving", plan.free[0].tile)
        body.append(f"nisa.tensor_copy(dst={staged}[0:rows, 0:cols], src={prologue.ref_text(value)})")
        value = Ref(tile=staged)
    body.append(f"nisa.nc_matmul(dst=column_sums[0:1, 0:cols], stationary=ones[0:rows, 0:1], "
                f"moving={prologue.ref_text(value)}, accumulate=p0 > 0)")
    result = allocator.new("sums", plan.free[0].tile)
    count = math.prod(node.domain[d] for d in node.reduce_dims)
    finish = ["rows = 1", f"nisa.tensor_copy(dst={result}[0:1, 0:cols], src=column_sums[0:1, 0:cols])"]
    if node.op == "mean":
        finish.append(f"nisa.tensor_scalar(dst={result}[0:1, 0:cols], data={result}[0:1, 0:cols], op0=nl.multiply, "
                      f"operand0={1.0 / count!r})")
    epilogue = TileScope(allocator, plan.free[0].tile, "[0:rows, 0:cols]", load_pattern, Ref(tile=result))
    _store_lines(node.stores, epilogue, patterns, free, True, finish)
    context = _common(node, plan, name, parameters, allocations=allocator.lines, body=body, finish=finish,
                      ones_dtype=NL_DTYPES[value.dtype])
    return _render("column_reduction.py.j2", **context)

"""Kernel kind ``row_normalize``: softmax or log_softmax of a prologue along one dim (``ir.RowNormalize``).

Fusion: a pointwise producer over the domain becomes the prologue, pointwise consumers over the domain the
epilogue. Tiling: kept dims on partitions, the whole row on the free axis (a row wider than the SBUF budget does
not tile); with ``causal`` the query dim stays on partitions. Codegen (row_normalize.py.j2), the sequence the
Neuron compiler itself emits: load, row max, exp(x - max) with its row sum, reciprocal (or log), scale, store;
``causal`` masks columns past the query row with affine_select first.
"""

from __future__ import annotations

from neuron_compile import ir
from neuron_compile.codegen.expressions import ROUNDING_DTYPES, Ref, TileAllocator, TileScope, emit
from neuron_compile.codegen.kernel_text import (
    Patterns,
    kernel_context,
    kernel_names,
    render_template,
    row_scopes,
    store_lines,
)
from neuron_compile.kind_registry import register_kind
from neuron_compile.kinds.fusion_rules import ProloguedKind
from neuron_compile.kinds.rows import partition_dim, row_budget, row_dims, row_layouts
from neuron_compile.tiles import TilePlan


def plan_row_normalize(node: ir.RowNormalize, target) -> TilePlan:
    kept, reduced = row_dims(node.domain, (node.dim,), row_layouts(node, node.stores), causal=node.causal)
    budget = row_budget(node, kept, reduced, [node.prologue] + [store.expr for store in node.stores], target)
    if not budget.whole_row:
        raise budget.too_wide(node, node.op, target)
    return TilePlan("row_normalize", tuple(kept[:-1]), partition_dim(kept, target), tuple(budget.free_dims()),
                    budget.tiles)


def render_row_normalize(node: ir.RowNormalize, plan: TilePlan, name: str, parameters: list[str]) -> str:
    patterns = Patterns(plan)
    allocator = TileAllocator(plan.partition.tile, reserved=kernel_names(node, parameters))
    prologue, row_free, free, chunked = row_scopes(node, plan, allocator, patterns)
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
    result_dtype = stored_dtype(node)
    exps, result = allocator.new("exps", row_free), allocator.new("softmax", row_free, result_dtype)
    body += [
        f"nisa.tensor_reduce(dst={row_max}[0:rows, 0:1], op=nl.maximum, data={data}, axis=1, keepdims=True)",
        f"nisa.tensor_scalar(dst={negated_max}[0:rows, 0:1], data={row_max}[0:rows, 0:1], op0=nl.multiply, "
        "operand0=-1.0)",
        # the row sum accumulates on ScalarE as the exponentials are written: no tensor_reduce on VectorE
        f"nisa.activation(dst={exps}{window}, op=nl.exp, data={data}, bias={negated_max}[0:rows, 0:1], "
        f"reduce_op=nl.add, reduce_res={row_sum}[0:rows, 0:1])",
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
    scope = TileScope(allocator, row_free, window, prologue.load_pattern, Ref(tile=result, dtype=result_dtype))
    scope.tiles = prologue.tiles  # reuse the loaded tiles of operands read again by the epilogue
    store_lines(node.stores, scope, patterns, free, False, body)
    context = kernel_context(node, plan, name, parameters, allocations=allocator.lines, body=body)
    return render_template("row_normalize.py.j2", **context)


def stored_dtype(node: ir.RowNormalize) -> str:
    """The dtype the normalized tile is written in: that of its stores when every store is the result rounded to
    one bf16-like dtype (stored as it is in a buffer of that dtype, or cast to it): the engines round to the
    destination once, as eager rounds its fp32 result. fp32 otherwise."""
    def written_dtype(store: ir.Store) -> str | None:
        if store.expr == ir.Result():
            return store.buffer.dtype
        rounded = isinstance(store.expr, ir.Op) and store.expr.op == "cast" and store.expr.args == (ir.Result(),)
        return store.expr.dtype if rounded and store.expr.dtype == store.buffer.dtype else None

    dtypes = {written_dtype(store) for store in node.stores}
    return dtypes.pop() if len(dtypes) == 1 and dtypes <= ROUNDING_DTYPES else "float32"


class RowNormalizeKind(ProloguedKind):
    node_type = ir.RowNormalize
    name = "row_normalize"

    def plan(self, node, target):
        return plan_row_normalize(node, target)

    def render(self, node, plan, name, parameters):
        return render_row_normalize(node, plan, name, parameters)


register_kind(RowNormalizeKind())

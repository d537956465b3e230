"""Kernel kind ``attention_backward``: flash attention's backward (dq, dk, dv) in one kernel (``ir.AttentionBackward``).

Tiling: per query head, key blocks of 512 keys in the outer loop, query tiles of 128 rows in the inner one. Each
(query tile, key block) step recomputes the scores and the probabilities from q, k and the forward's log-sum-exp
(one ScalarE exp with the scale and -lse as bias), dP = dO v^T and dS = P * (dP - rowsum(dO * O)) on chip (one
matmul and one instruction each over the block; where dO^T has spare partitions, -rowsum(dO * O) rides in it as
extra rows against rows of ones in v^T, so dP's matmul subtracts it and dS is a plain product); per chunk of 128
keys (on partitions) dv and dk accumulate in PSUM over every query tile that sees the chunk, and dS^T (TensorE
transpose) times k adds the chunk's share of dq in PSUM, which starts the query tile's fp32 accumulator in SBUF or
is added to it once per block (with one key block it is dq, scaled). The steps are software pipelined across query
heads (a step's P and dS before the previous step's gradients); the PSUM evacuations are split between ScalarE and
VectorE by measured balance (``VECTOR_COPY_PERIOD``), rowsum(dO * O) is a GpSimd product summed by a ScalarE copy.
A query tile's query side (q^T, q, dO^T, dO) stays resident in SBUF for as many query tiles as fit (the last ones:
causal masking shows them the most key blocks); the others load it per step. q, dO and k are read from HBM as they
are stored (queries or keys on partitions) and transposed on TensorE where the head dim must be on partitions (v^T,
needed only so, comes in through a DMA transpose). Causal: a key block skips the query tiles whose queries all come
before its keys, and a step computes only the chunks up to its tile's last query; the diagonal steps zero the
probabilities above the diagonal (affine_select, over the columns after the tile's first query only).
Grouped-query attention: a key/value head's dk and dv are summed over its query heads in fp32 SBUF tiles, stored once; where SBUF holds them, the group's query heads load q, dO, out and the log-sum-exp of
a query tile in one DMA each ([rows, heads, D]: one head's rows are D elements per partition, a transfer the DMA's
fixed cost dominates), store their dq in one and share one load of k, k^T and v^T.
No fusion: the kernel takes no epilogue or prologue (its stores read ``Result()``).
Codegen: attention_backward.py.j2.
"""

from __future__ import annotations

import dataclasses
import math

from neuron_compile import ir
from neuron_compile.codegen.expressions import NL_DTYPES
from neuron_compile.codegen.kernel_text import entries_text, kernel_context, offset_text, render_template
from neuron_compile.dims import LoopDim
from neuron_compile.kind_registry import KernelKind, register_kind
from neuron_compile.limits import SBUF_SHARE
from neuron_compile.tiles import (
    TilePlan,
    TilingError,
    attention_backward_bytes,
    attention_backward_reason,
    needs_transpose,
)

# Keys per block: S and dP of a block are one matmul each into one PSUM bank of fp32 (the moving operand's limit),
# P and dS one ScalarE / VectorE instruction each, and dq's share sums the block's four chunks in PSUM before its one
# add into SBUF (measured, seq 1024 D 128 bf16: blocks of 128 keys spend 21 us of VectorE on those adds).
KEY_BLOCK = 512
# Steps in flight: a step's P and dS are issued this many steps before its gradients (across query heads).
# Measured at the 1-layer Llama goal point (32 query heads of 64 over 4 key/value heads, seq 256, causal, bf16; the
# kernel alone, us): 1 / 2 / 3 / 4 steps 63.9 / 67.0 / 72.1 / 76.8 before dS took one instruction, 60.8 / 59.7
# after; 1 keeps the fewest working tiles live.
PIPELINE_DEPTH = 1
# One dS^T copy in this many leaves PSUM through VectorE (and dO^T does), the others through ScalarE, where dS is
# one product (row_term_context). Measured at the same point (us): one in 2 / 3 / 4 / 5 / 8: 63.2 / 62.4 / 61.8 /
# 60.8 / 62.2.
VECTOR_COPY_PERIOD = 5


@dataclasses.dataclass(frozen=True)
class AttentionBackwardPlan(TilePlan):
    """``outer`` the batch dims, ``group_dims`` those of them that pick a query head within a key/value group (dk
    and dv sum over them); ``resident_from``: the query tiles from this one on keep their query side in SBUF across
    key blocks (0: all of them), the earlier ones load it per step; ``transpose_loads``: v^T comes in through
    ``dma_transpose`` (head dim contiguous, target has it); ``free`` walks the keys in blocks of ``key_block``;
    ``group_loads``: the query heads of a key/value group (one group dim) load q, dO, out and the log-sum-exp of a
    query tile in one DMA each and store their dq in one, and share one load of the key side."""

    group_dims: tuple[int, ...] = ()
    key_block: int = KEY_BLOCK
    resident_from: int = 0
    transpose_loads: bool = False
    group_loads: bool = False

    def describe(self) -> str:
        text = super().describe() + f", key blocks of {self.key_block} (chunks of 128)"
        tiles = self.partition.count
        text += ", query side resident per head" if self.resident_from == 0 else \
            f", query side resident from query tile {self.resident_from} of {tiles} on, loaded per step before"
        text += ", the group's heads loaded together" if self.group_loads else ""
        return text + (f", dk/dv summed over dims {list(self.group_dims)}" if self.group_dims else "")


def group_dims(node: ir.AttentionBackward) -> tuple[int, ...]:
    """The batch dims along which dk and dv are stored with stride 0: the query heads of a key/value group."""
    rank = len(node.domain) - 2
    return tuple(dim for dim in range(rank) if node.domain[dim] > 1
                 and node.grad_key.layout.strides[dim] == 0 and node.grad_value.layout.strides[dim] == 0)


def plan_attention_backward(node: ir.AttentionBackward, target) -> AttentionBackwardPlan:
    *batch, queries, keys = node.domain
    itemsize = ir.ITEMSIZE[node.q.dtype]
    grouped = group_dims(node)
    reason = attention_backward_reason(node.depth, node.value_dim, queries, keys, itemsize, bool(grouped), target)
    if reason:
        raise TilingError(f"{node.name}: {reason}")
    always, query_side = attention_backward_bytes(node.depth, node.value_dim, queries, keys, itemsize, bool(grouped),
                                                  target)
    # as many query tiles' query side as the budget holds stay resident: the last ones, which under causal masking
    # see the most key blocks
    query_tiles = math.ceil(queries / target.partitions)
    resident_tiles = min(query_tiles, int((target.sbuf_bytes_per_partition * SBUF_SHARE - always) // query_side))
    rank = len(batch)
    transpose_loads = target.dma_transpose and needs_transpose(node.v.layout.strides[rank + 1],
                                                               node.v.layout.strides[rank])
    outer = tuple(LoopDim(size, dim, 1, 1) for dim, size in enumerate(batch))
    partition = LoopDim(queries, rank, 1, min(queries, target.partitions))
    key_block = min(KEY_BLOCK, 128 * math.ceil(keys / 128))
    free = (LoopDim(keys, rank + 1, 1, min(keys, key_block)),)
    spare = target.sbuf_bytes_per_partition * SBUF_SHARE - always - query_tiles * query_side
    group_loads = len(grouped) == 1 and resident_tiles == query_tiles and \
        group_bytes(node, batch[grouped[-1]], itemsize) <= spare
    return AttentionBackwardPlan("attention_backward", outer, partition, free, 0, group_dims=grouped,
                                 key_block=key_block, resident_from=query_tiles - resident_tiles,
                                 transpose_loads=transpose_loads, group_loads=group_loads)


def group_bytes(node: ir.AttentionBackward, heads: int, itemsize: int) -> int:
    """SBUF bytes per partition that loading a group's ``heads`` together adds: per query tile their q, dO, out,
    log-sum-exp and dq; the key side (k, k^T, v^T) of every key block."""
    *_, queries, keys = node.domain
    depth, value_dim = node.depth, node.value_dim
    per_tile = heads * ((depth + 2 * value_dim) * itemsize + 4 + depth * ir.ITEMSIZE[node.grad_query.buffer.dtype])
    key_side = math.ceil(keys / 128) * depth * itemsize + 2 * keys * itemsize
    return math.ceil(queries / 128) * per_tile + key_side


class Loads:
    """The kernel's DMA instructions over its loop variables: ``o<i>`` the batch indices, ``p0`` / ``rows`` the
    query tile, ``k0`` / ``cols`` the key block."""

    def __init__(self, plan: AttentionBackwardPlan):
        self.plan = plan
        self.rank = len(plan.outer)

    def offset(self, layout: ir.Layout, terms: list[tuple[str, int]], skip: tuple[int, ...] = ()) -> str:
        outer = [(f"o{i}", layout.strides[i]) for i in range(self.rank) if i not in skip]
        return offset_text(layout.offset, outer + terms)

    def group_rows(self, layout: ir.Layout, buffer: str, width: int, tile: str, store: bool = False) -> str:
        """Rows ``p0`` .. of a [seq, width] operand for every query head of the group, as ``tile`` [rows, heads,
        width] (``width`` 0: a per-query value, [rows, heads]); ``store``: the other way."""
        (group,) = self.plan.group_dims
        heads = self.plan.outer[group].size
        seq_stride = layout.strides[self.rank]
        entries = [[seq_stride, "rows"], [layout.strides[group], heads]]
        entries += [[layout.strides[self.rank + 1], width]] if width else []
        hbm = f"{buffer}.ap({entries_text(entries)}, offset={self.offset(layout, [('p0', seq_stride)], (group,))})"
        window = f"{tile}[0:rows, 0:{heads}" + (f", 0:{width}]" if width else "]")
        return f"nisa.dma_copy(dst={hbm}, src={window})" if store else f"nisa.dma_copy(dst={window}, src={hbm})"

    def rows(self, load: ir.Load, start: str, count: str, width: int, dst: str) -> str:
        """Rows ``start`` .. of a [seq, width] operand into ``dst`` [count on partitions, width]."""
        seq_stride, column_stride = load.layout.strides[self.rank], load.layout.strides[self.rank + 1]
        entries = [[seq_stride, count], [column_stride, width]]
        return f"nisa.dma_copy(dst={dst}, src={load.buffer}.ap({entries_text(entries)}, " \
               f"offset={self.offset(load.layout, [(start, seq_stride)])}))"

    def chunked_rows(self, load: ir.Load, start: str, count: str, width: int, tile: str) -> list[str]:
        """Rows ``start`` .. of a [seq, width] operand into ``tile`` [128, chunk, width] (row r in chunk r // 128):
        the whole chunks in one DMA, a ragged last chunk in another."""
        seq_stride, column_stride = load.layout.strides[self.rank], load.layout.strides[self.rank + 1]
        whole = [[seq_stride, 128], [seq_stride * 128, "whole"], [column_stride, width]]
        tail = [[seq_stride, f"{count} % 128"], [column_stride, width]]
        tail_offset = self.offset(load.layout, [(start, seq_stride), ("whole", seq_stride * 128)])
        return [
            f"whole = {count} // 128",
            "if whole:",
            f"    nisa.dma_copy(dst={tile}[0:128, 0:whole, 0:{width}], src={load.buffer}.ap({entries_text(whole)}, "
            f"offset={self.offset(load.layout, [(start, seq_stride)])}))",
            f"if {count} % 128:",
            f"    nisa.dma_copy(dst={tile}[0:{count} % 128, whole, 0:{width}], src={load.buffer}.ap("
            f"{entries_text(tail)}, offset={tail_offset}))",
        ]

    def transposed(self, load: ir.Load, start: str, count: str, width: int, dst: str) -> str:
        """The same rows transposed into ``dst`` [width on partitions, count]: a DMA transpose when the width is
        contiguous, else a strided DMA."""
        seq_stride, column_stride = load.layout.strides[self.rank], load.layout.strides[self.rank + 1]
        offset = self.offset(load.layout, [(start, seq_stride)])
        if self.plan.transpose_loads:
            entries = [[seq_stride, count], [column_stride, width]]
            return f"nisa.dma_transpose(dst={dst}, src={load.buffer}.ap({entries_text(entries)}, offset={offset}), " \
                   "axes=(1, 0))"
        entries = [[column_stride, width], [seq_stride, count]]
        return f"nisa.dma_copy(dst={dst}, src={load.buffer}.ap({entries_text(entries)}, offset={offset}))"

    def column(self, load: ir.Load, dst: str) -> str:
        """A per-query value [*batch, Sq] as the tile's (rows, 1) column."""
        stride = load.layout.strides[self.rank]
        return f"nisa.dma_copy(dst={dst}, src={load.buffer}.ap({entries_text([[stride, 'rows'], [1, 1]])}, " \
               f"offset={self.offset(load.layout, [('p0', stride)])}))"

    def mask(self, load: ir.Load, dst: str) -> str:
        query_stride, key_stride = load.layout.strides[self.rank], load.layout.strides[self.rank + 1]
        entries = [[query_stride, "rows"], [key_stride, "cols"]]
        terms = [("p0", query_stride), ("k0", key_stride)]
        return f"nisa.dma_copy(dst={dst}, src={load.buffer}.ap({entries_text(entries)}, " \
               f"offset={self.offset(load.layout, terms)}))"

    def store(self, store: ir.Store, start: str, count: str, width: int, src: str) -> str:
        seq_stride, column_stride = store.layout.strides[self.rank], store.layout.strides[self.rank + 1]
        entries = [[seq_stride, count], [column_stride, width]]
        return f"nisa.dma_copy(dst={store.buffer.name}.ap({entries_text(entries)}, " \
               f"offset={self.offset(store.layout, [(start, seq_stride)])}), src={src})"


def render_attention_backward(node: ir.AttentionBackward, plan: AttentionBackwardPlan, name: str,
                              parameters: list[str]) -> str:
    loads = Loads(plan)
    depth, value_dim = node.depth, node.value_dim
    *_, queries, keys = node.domain
    kv_dims = [dim for dim in range(len(plan.outer)) if dim not in plan.group_dims]
    context = kernel_context(
        node, plan, name, parameters,
        head_params="".join(f"o{dim}, " for dim in range(len(plan.outer))),
        kv_params="".join(f"o{dim}, " for dim in kv_dims),
        kv_loops=[(dim, plan.outer[dim].size) for dim in kv_dims],
        group_loops=[(dim, plan.outer[dim].size) for dim in plan.group_dims],
        grouped=bool(plan.group_dims), resident_from=plan.resident_from, query_tiles=plan.partition.count,
        causal=node.causal,
        queries=queries, keys=keys, depth=depth, value_dim=value_dim, key_tiles=math.ceil(keys / 128),
        key_block=plan.key_block, key_chunks=plan.key_block // 128, single_block=keys <= plan.key_block,
        pipeline_depth=PIPELINE_DEPTH, **row_term_context(node),
        scale=float(node.scale), operand_dtype=NL_DTYPES[node.q.dtype],
        query_dtype=NL_DTYPES[node.grad_query.buffer.dtype], key_dtype=NL_DTYPES[node.grad_key.buffer.dtype],
        value_dtype=NL_DTYPES[node.grad_value.buffer.dtype],
        load_queries=loads.rows(node.q, "p0", "rows", depth, f"queries[0:rows, 0:{depth}]"),
        load_grad=loads.rows(node.grad, "p0", "rows", value_dim, f"grad[0:rows, 0:{value_dim}]"),
        load_out=loads.rows(node.out, "p0", "rows", value_dim, f"outputs[0:rows, 0:{value_dim}]"),
        load_logsumexp=loads.column(node.logsumexp, "logsumexp[0:rows, 0:1]"),
        load_keys=loads.chunked_rows(node.k, "k0", "cols", depth, "keys"),
        load_values_t=loads.transposed(node.v, "k0", "cols", value_dim, f"values_t[0:{value_dim}, 0:cols]"),
        mask_load=loads.mask(node.mask, "mask_tile[0:rows, 0:cols]") if node.mask else None,
        mask_dtype=NL_DTYPES[node.mask.dtype] if node.mask else None,
        store_grad_query=loads.store(node.grad_query, "p0", "rows", depth, f"grad_query[0:rows, 0:{depth}]"),
        store_grad_key=loads.store(node.grad_key, "start", "kk", depth, f"grad_key[0:kk, 0:{depth}]"),
        store_grad_value=loads.store(node.grad_value, "start", "kk", value_dim, f"grad_value[0:kk, 0:{value_dim}]"),
        group_loads=plan.group_loads, **(group_load_context(node, loads) if plan.group_loads else {}),
    )
    return render_template("attention_backward.py.j2", **context)


def row_term_context(node: ir.AttentionBackward) -> dict:
    """The template's names for the softmax backward's row term -rowsum(dO * O): ``augmented`` when dO^T has room
    for it as ``row_columns`` more rows (dP's matmul subtracts it against v^T's rows of ones; in a 2-byte operand
    dtype as a high and a low part, whose sum keeps the fp32 value's precision), ``grad_width`` the dO tiles'
    columns with it; else it stays an fp32 column that dS's instruction subtracts."""
    row_columns = 1 if node.q.dtype == "float32" else 2
    augmented = node.value_dim + row_columns <= 128  # dO^T's partitions
    # with dS a subtract and a product (no room for the row term) VectorE is the busier engine: every PSUM
    # evacuation stays on ScalarE (seq 1024 D 128 bf16, 32 heads over 4: 907.6 us with one in 5 on VectorE)
    return dict(augmented=augmented, row_columns=row_columns,
                grad_width=node.value_dim + (row_columns if augmented else 0),
                vector_copy_period=VECTOR_COPY_PERIOD if augmented else 0)


def group_load_context(node: ir.AttentionBackward, loads: Loads) -> dict:
    """The template's names for ``group_loads``: the group's size and dim, its loads and its dq store."""
    (group,) = loads.plan.group_dims
    return dict(
        group_dim=group, group_size=loads.plan.outer[group].size,
        load_group_queries=loads.group_rows(node.q.layout, node.q.buffer, node.depth, "queries"),
        load_group_grad=loads.group_rows(node.grad.layout, node.grad.buffer, node.value_dim, "grad"),
        load_group_out=loads.group_rows(node.out.layout, node.out.buffer, node.value_dim, "outputs"),
        load_group_logsumexp=loads.group_rows(node.logsumexp.layout, node.logsumexp.buffer, 0, "logsumexp"),
        store_group_grad_query=loads.group_rows(node.grad_query.layout, node.grad_query.buffer.name, node.depth,
                                                'shared["grad_query"]', store=True),
    )


class AttentionBackwardKind(KernelKind):
    node_type = ir.AttentionBackward
    name = "attention_backward"
    # dk and dv are complete only after every query tile, dq after every key block: no tile of an epilogue's domain
    refusal = "an attention backward kernel takes no epilogue (its gradients are complete only at its end)"

    def stores(self, node):
        return node.stores

    def exprs(self, node):
        return [store.expr for store in node.stores]

    def operand_loads(self, node):
        return [node.grad, node.q, node.k, node.v, node.out, node.logsumexp] + ([node.mask] if node.mask else [])

    def map_exprs(self, node, fn):
        return node  # its stores read Result() only: nothing to guard

    def prune(self, node, needed):
        return node if any(store.buffer.name in needed for store in node.stores) else None

    def describe_head(self, node):
        mask = f"\n  mask: {node.mask}" if node.mask else ""
        return (f" scale={node.scale:g} causal={node.causal}\n  dO: {node.grad}\n  q: {node.q}\n  k: {node.k}\n"
                f"  v: {node.v}\n  out: {node.out}\n  logsumexp: {node.logsumexp}{mask}")

    def plan(self, node, target):
        return plan_attention_backward(node, target)

    def render(self, node, plan, name, parameters):
        return render_attention_backward(node, plan, name, parameters)


register_kind(AttentionBackwardKind())

"""Kernel kind ``attention``, its operands: the tile plan both attention forms share (the flash kernel,
kinds/attention.py, and the split-key decode form, kinds/attention_decode.py) and the instructions that bring q^T,
k^T, v and the mask from HBM into SBUF, walked by the plan's loop variables.

Input: an ``ir.Attention`` node, its ``AttentionPlan`` and the kernel's ``Patterns``. Output: lines of kernel text.
"""

from __future__ import annotations

import dataclasses

from neuron_compile import ir
from neuron_compile.codegen.expressions import AccessPattern
from neuron_compile.codegen.kernel_text import Patterns, entries_text, offset_text
from neuron_compile.dims import LoopDim
from neuron_compile.tiles import TilePlan

# The running max starts at the lowest finite fp32, not -inf: a row whose keys so far are all masked with -inf
# then gives exp(-inf) = 0 (never exp(-inf + inf) = nan), and a row masked with finfo.min everywhere keeps
# eager's uniform weights.
LOWEST_FP32 = -3.4028234663852886e38


@dataclasses.dataclass(frozen=True)
class AttentionPlan(TilePlan):
    """``partition`` is the query tile, ``free`` the output's head dim, ``k_tile`` x ``k_tiles`` the chunks of D.
    ``key_block`` keys per score tile; ``resident``: k^T and v of a head stay in SBUF across query tiles;
    ``transpose_loads``: q and k come in through ``dma_transpose`` (D contiguous, target has it); ``causal_bias``:
    the causal mask is accumulated onto the scores on TensorE (else applied in SBUF with affine_select); ``lanes``
    query heads of one key/value group (outer dim ``lane_dim``) share a query tile: row r is query p0 + r // lanes
    of head r % lanes, ``partition.tile`` queries each; ``mask_bias``: the mask is constant along the queries (a key
    padding mask), so its row per key block is accumulated onto the scores on TensorE (a ones column times the
    row), q^T taking the scale, instead of a [queries, keys] mask tile loaded and added on VectorE per block;
    ``dma_transpose_period``: in a query tile of at least ``dma_transpose_min_blocks`` key blocks, every n-th block
    brings its P^T through a DMA transpose (0: never); ``vector_copy_period``: one P^T chunk in n leaves PSUM
    through VectorE, the others through ScalarE (0: none through VectorE); ``whole_row``: a query tile's visible keys
    are one block whose scores span several PSUM banks, so one row max and one exponential serve the whole row (no
    online rescale), P @ [v | 1] accumulates in a PSUM bank of its own, the last ``dma_transpose_chunks`` whole
    chunks of P^T come through a DMA transpose and GpSimd normalizes (from the copy of P @ [v | 1] VectorE makes out
    of PSUM); ``scores_ahead``: how many steps ahead of its P @ v a block's scores are issued;
    ``transposed_bank_chunks``: P^T chunks of 128 keys per PSUM bank;
    ``head_group_dim``: the outer dim that picks a query head of a key/value group, when the group's heads take each
    query tile position one after another and share one q^T load and one output store there (-1: each head
    loads and stores its own); ``positions_outer``: with a head group, k^T and v of every key/value head stay
    resident and the query tile positions are the outermost loop, so that the output's first rows (every head of
    them) are done before its last: the output projection's first row block can start while attention runs;
    ``group_owns_kv``: the head group's heads each have a key/value head of their own (no grouped-query sharing):
    k^T and v of the whole group come in one DMA each too, resident side by side, indexed by the head;
    ``kv_loads_per_head``: with ``group_owns_kv``, k^T and v come in one DMA per head of the group instead, after the
    first position's q^T, so that the group's first head starts while the others' keys land;
    ``group_normalized``: with a head group, its heads' outputs leave their accumulators unscaled and the group's last
    head normalizes them all on GpSimd (one reciprocal for the group), not each head its own on ScalarE and VectorE
    (not in the training forward, which writes each head's log-sum-exp)."""

    key_block: int = 0
    resident: bool = False
    transpose_loads: bool = False
    causal_bias: bool = False
    lanes: int = 1
    lane_dim: int = -1
    mask_bias: bool = False
    dma_transpose_period: int = 0
    dma_transpose_min_blocks: int = 0
    vector_copy_period: int = 0
    whole_row: bool = False
    dma_transpose_chunks: int = 0
    scores_ahead: int = 1
    transposed_bank_chunks: int = 4
    head_group_dim: int = -1
    positions_outer: bool = False
    group_owns_kv: bool = False
    kv_loads_per_head: bool = False
    group_normalized: bool = False
    psum_rings: bool = False
    output_slots: int = 0
    scaled_keys: bool = False
    softmax_ahead: int = 1

    def describe(self) -> str:
        text = super().describe() + f" D {self.k_tiles}x{self.k_tile}, key blocks of {self.key_block}"
        text += ", k^T and v resident per head" if self.resident else ", k^T and v loaded per key block"
        text += f", {self.lanes} query heads per tile" if self.lanes > 1 else ""
        text += ", the mask row on TensorE" if self.mask_bias else ""
        if self.dma_transpose_period:
            text += f", P^T of every {self.dma_transpose_period}th block by DMA transpose"
        if self.whole_row:
            text += f", each row's keys in one block ({self.dma_transpose_chunks} chunks of P^T by DMA transpose)"
        if self.head_group_dim >= 0:
            loaded = "q^T, k^T, v" if self.group_owns_kv and not self.kv_loads_per_head else "q^T"
            text += f", {loaded} and output of the {self.outer[self.head_group_dim].size} heads of a group in one DMA each"
        text += ", k^T and v one DMA per head, after the first q^T" if self.kv_loads_per_head else ""
        text += ", query tile positions outermost (every head's k^T and v resident)" if self.positions_outer else ""
        text += ", the group's outputs normalized together" if self.group_normalized else ""
        text += f", P^T and P @ v in PSUM rings ({self.output_slots} outputs)" if self.psum_rings else ""
        text += ", k^T scaled (the row max negated on VectorE)" if self.scaled_keys else ""
        return text + (", causal mask on TensorE" if self.causal_bias else "")



class LanePatterns(Patterns):
    """HBM access patterns of a query tile shared by the query heads of a group (``AttentionPlan.lanes``): the
    partition axis walks queries (``lane_rows`` of them) and within each query the group's heads."""

    def outer_terms(self, layout: ir.Layout) -> list[tuple[str, int]]:
        return [term for i, term in enumerate(super().outer_terms(layout)) if i != self.plan.lane_dim]

    def hbm(self, tensor: str, layout: ir.Layout, free: list[tuple[LoopDim, str]], chunked_free: bool) -> AccessPattern:
        pattern = super().hbm(tensor, layout, free, chunked_free)
        lane = self.plan.outer[self.plan.lane_dim]
        entries = ((pattern.entries[0][0], "lane_rows"), (lane.stride(layout), lane.size), *pattern.entries[1:])
        return AccessPattern(tensor, entries, pattern.offset)


def transposed_load(plan: AttentionPlan, patterns: Patterns, load: ir.Load, dst: str, start: str, count: str) -> str:
    """The instruction that brings rows ``start`` .. ``start + count`` of q or k ([seq, D]) into ``dst`` as
    [D chunk on partitions, chunk, rows]: a DMA transpose when D is contiguous, else a strided DMA."""
    rank = len(plan.outer)
    seq_stride, depth_stride = load.layout.strides[rank], load.layout.strides[rank + 1]
    terms = patterns.outer_terms(load.layout) + ([(start, seq_stride)] if start != "0" else [])
    offset = offset_text(load.layout.offset, terms)
    chunks = [[depth_stride * plan.k_tile, plan.k_tiles], [depth_stride, plan.k_tile]]
    rows = [[seq_stride, count]]
    if load is not None and plan.lanes > 1 and load.layout.strides[plan.lane_dim]:  # q: queries, then heads
        rows.append([load.layout.strides[plan.lane_dim], plan.lanes])
    if plan.transpose_loads:
        axes = "(2, 1, 0)" if len(rows) == 1 else "(3, 2, 0, 1)"
        entries = [*rows, *chunks]
        return f"nisa.dma_transpose(dst={dst}, src={load.buffer}.ap({entries_text(entries)}, offset={offset}), " \
               f"axes={axes})"
    entries = [*reversed(chunks), *rows]
    return f"nisa.dma_copy(dst={dst}, src={load.buffer}.ap({entries_text(entries)}, offset={offset}))"


def grouped_transposed_load(plan: AttentionPlan, patterns: Patterns, load: ir.Load, dst: str, start: str = "p0",
                            count: str = "rows", head: str | None = None) -> str:
    """The DMA transpose that brings rows ``start`` .. ``start + count`` of q (or, where the group's heads own
    their key/value heads, of k) of every head of a group (``plan.head_group_dim``) into ``dst`` as
    [D chunk on partitions, chunk, head, rows]; of the group's head ``head`` alone (a loop variable) if given."""
    rank = len(plan.outer)
    seq_stride, depth_stride = load.layout.strides[rank], load.layout.strides[rank + 1]
    group = plan.outer[plan.head_group_dim]
    terms = [term for dim, term in enumerate(patterns.outer_terms(load.layout)) if dim != plan.head_group_dim]
    terms += [(head, group.stride(load.layout))] if head else []
    entries = [[group.stride(load.layout), 1 if head else group.size], [seq_stride, count],
               [depth_stride * plan.k_tile, plan.k_tiles], [depth_stride, plan.k_tile]]
    terms += [(start, seq_stride)] if start != "0" else []
    return (f"nisa.dma_transpose(dst={dst}, src={load.buffer}.ap({entries_text(entries)}, "
            f"offset={offset_text(load.layout.offset, terms)}), axes=(3, 2, 0, 1))")


def grouped_output_store(plan: AttentionPlan, patterns: Patterns, store: ir.Store, src: str) -> str:
    """The DMA that writes ``src`` [rows, head, D], the output of every query head of a group at the query tile
    ``p0``, to the output's buffer."""
    group = plan.outer[plan.head_group_dim]
    pattern = patterns.hbm(store.buffer.name, store.layout, [(plan.free[0], "cols")], False)
    terms = [term for dim, term in enumerate(patterns.outer_terms(store.layout)) if dim != plan.head_group_dim]
    entries = (pattern.entries[0], (group.stride(store.layout), group.size), *pattern.entries[1:])
    offset = offset_text(store.layout.offset, terms + [("p0", plan.partition.stride(store.layout))])
    return f"nisa.dma_copy(dst={store.buffer.name}.ap({entries_text(entries)}, offset={offset}), src={src})"


def value_loads(plan: AttentionPlan, patterns: Patterns, node: ir.Attention, first_chunk: str, start: str,
                count: str, head: str | None = None) -> list[str]:
    """Instructions that bring the ``count`` rows of v from row ``start`` into ``values`` [128 keys, chunk, Dv]
    from chunk ``first_chunk`` on: the whole chunks of 128 rows in one DMA, a ragged last chunk in another. Where
    the head group's heads own their key/value heads (``plan.group_owns_kv``), every head of the group in the same
    DMAs, into ``values`` [128 keys, head, chunk, Dv], or the group's head ``head`` alone (a loop variable) if given."""
    rank = len(plan.outer)
    seq_stride, depth_stride = node.v.layout.strides[rank], node.v.layout.strides[rank + 1]
    value_dim = node.domain[-1]
    base = patterns.outer_terms(node.v.layout)
    heads, head_entries = "", []
    if plan.group_owns_kv:
        group = plan.outer[plan.head_group_dim]
        base = [term for dim, term in enumerate(base) if dim != plan.head_group_dim]
        heads, head_entries = f"0:{group.size}, ", [[group.stride(node.v.layout), group.size]]
        if head:
            base += [(head, group.stride(node.v.layout))]
            heads, head_entries = f"{head}:{head} + 1, ", [[group.stride(node.v.layout), 1]]
    whole_entries = [[seq_stride, 128], *head_entries, [seq_stride * 128, "whole"], [depth_stride, value_dim]]
    tail_entries = [[seq_stride, f"{count} % 128"], *head_entries, [depth_stride, value_dim]]
    chunk = f"{first_chunk} + whole" if first_chunk != "0" else "whole"
    return [
        f"whole = {count} // 128",
        "if whole:",
        f"    nisa.dma_copy(dst=values[0:128, {heads}{first_chunk}:{chunk}, 0:{value_dim}], src={node.v.buffer}.ap("
        f"{entries_text(whole_entries)}, offset={offset_text(node.v.layout.offset, base + [(start, seq_stride)])}))",
        f"if {count} % 128:",
        f"    nisa.dma_copy(dst=values[0:{count} % 128, {heads}{chunk}, 0:{value_dim}], src={node.v.buffer}.ap("
        f"{entries_text(tail_entries)}, offset="
        f"{offset_text(node.v.layout.offset, base + [(start, seq_stride), ('whole', seq_stride * 128)])}))",
    ]


def logsumexp_store(patterns: Patterns, store: ir.Store) -> str:
    """The DMA that writes the (P, 1) column ``logsumexp`` to the row statistic's buffer."""
    dst = patterns.hbm(store.buffer.name, store.layout, [(LoopDim(1, None), "1")], False)
    return f"nisa.dma_copy(dst={dst}, src=logsumexp[0:rows, 0:1])"


def mask_load(plan: AttentionPlan, patterns: Patterns, mask: ir.Load, dst: str) -> str:
    rank = len(plan.outer)
    query_stride, key_stride = mask.layout.strides[rank], mask.layout.strides[rank + 1]
    terms = patterns.outer_terms(mask.layout) + [("p0", query_stride), ("kv0", key_stride)]
    entries = [[query_stride, "rows"], [key_stride, "block_cols"]]
    return f"nisa.dma_copy(dst={dst}, src={mask.buffer}.ap({entries_text(entries)}, " \
           f"offset={offset_text(mask.layout.offset, terms)}))"


def mask_row_load(plan: AttentionPlan, patterns: Patterns, mask: ir.Load, dst: str) -> str:
    """The mask's row of the key block (the same for every query) as a [1, block_cols] tile."""
    key_stride = mask.layout.strides[len(plan.outer) + 1]
    terms = patterns.outer_terms(mask.layout) + [("kv0", key_stride)]
    return f"nisa.dma_copy(dst={dst}, src={mask.buffer}.ap({entries_text([[0, 1], [key_stride, 'block_cols']])}, " \
           f"offset={offset_text(mask.layout.offset, terms)}))"


def head_loops(node: ir.Attention, plan: AttentionPlan) -> tuple[list[int], list[int]]:
    """The outer dims split into those that choose a key/value head and those that only choose a query head of
    its group (stride 0 in k and v): k^T and v load once per key/value head, outside the group's loops. A head
    group whose heads own their key/value heads counts as the latter: its k^T and v load once for the group."""
    shared = [i for i, dim in enumerate(plan.outer)
              if dim.stride(node.k.layout) == 0 and dim.stride(node.v.layout) == 0 and i != plan.lane_dim
              or plan.group_owns_kv and i == plan.head_group_dim]
    return [i for i in range(len(plan.outer)) if i not in shared and i != plan.lane_dim], shared


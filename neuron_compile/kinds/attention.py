"""Kernel kind ``attention``: flash attention, ``softmax(q @ k^T * scale + mask) @ v`` in one kernel (``ir.Attention``).

Tiling: queries in tiles of 128 on partitions; keys in blocks of 512 (one PSUM bank of fp32 scores); the head
dim D (up to 256) in chunks of at most 128 accumulated in PSUM. k^T and v of one key/value head stay resident in
SBUF while every query tile (and every query head of a grouped-query group) streams past them, so q, k, v and the
output cross HBM once; when they do not fit, they are loaded per key block. Per block: the scores in PSUM, the
online softmax (running max per query row on GpSimd, the output accumulator rescaled), the probabilities transposed
on TensorE (or, for every other block of a long tile, by a DMA transpose) and multiplied with [v | 1], whose ones
column accumulates the row sums beside the output. The (query tile, key block) steps are software pipelined: a step
issues the scores of the block SCORES_AHEAD ahead, the softmax of the next and its own P @ v, and stores the tile
finished a step before. Where every tile is one block, P^T chunks and P @ [v | 1] take slots of two kernel-wide
PSUM rings, so that a tile holds its score bank only until its exponential, and a power-of-two scale goes into the
resident k^T once (the row max then comes out negated as the exponential's bias). Causal: a query tile sees keys
0 .. its last query; the keys from its first query on (in its last block) get the mask as a bias accumulated onto
the scores on TensorE (identity x a constant mask tile), unless the scale is too small for the bias to dominate
(then an affine_select in SBUF on a diagonal block of its own).
With few queries per head, the query heads of a grouped-query group share each query tile (stacked on the
partitions), where that at least halves the tiles; otherwise they take each query tile position in turn, with one q^T
load and one output store for the group there (their outputs normalized together on GpSimd, but for the training
forward's), and, when every key/value head fits, the positions outermost. Heads with a key/value head each, adjacent
in the output's rows, form such a group too, their k^T and v also loaded for the whole group in one DMA each (with
whole rows, one per head, after the first q^T, so that the first head need not wait for all). The
training forward also writes each row's log-sum-exp.
Fusion: pointwise consumers over the output domain are epilogues on the normalized output tile.
Codegen: attention.py.j2.
"""

from __future__ import annotations

import dataclasses
import math

from neuron_compile import ir
from neuron_compile.codegen.expressions import NL_DTYPES, Ref, TileAllocator, TileScope
from neuron_compile.codegen.kernel_text import (
    Patterns,
    kernel_context,
    kernel_names,
    render_template,
    store_lines,
)
from neuron_compile.dims import LoopDim
from neuron_compile.kind_registry import loads, register_kind
from neuron_compile.kinds.attention_decode import DecodePlan, plan_decode, render_decode
from neuron_compile.kinds.attention_operands import (
    LOWEST_FP32,
    AttentionPlan,
    LanePatterns,
    grouped_output_store,
    grouped_transposed_load,
    head_loops,
    logsumexp_store,
    mask_load,
    mask_row_load,
    transposed_load,
    value_loads,
)
from neuron_compile.kinds.fusion_rules import MatchingIndexEpilogue
from neuron_compile.limits import SBUF_SHARE
from neuron_compile.tiles import (
    TilingError,
    attention_head_chunks,
    count_tiles,
    flash_attention_reason,
    needs_transpose,
)

# The causal bias: the lowest finite bf16 (also an fp32), so the mask tile holds it in either operand dtype. Added to
# the scores before the scale, it dominates them only while scale * 3.39e38 is far below any logit; under this
# scale (scale * 3.39e38 < 1e6) the kernel masks in SBUF with affine_select instead.
CAUSAL_BIAS = -3.3895313892515355e38
MIN_CAUSAL_BIAS_SCALE = 3e-33
# One P^T chunk in three leaves PSUM through VectorE, the others through ScalarE: per block VectorE has the row max
# and ScalarE the exponentials, both over the block's keys, and this evens them out (measured, bf16: one in four
# 39.3 / 27.6 / 38.4 us, one in three 38.4 / 28.1 / 38.1 us, one in two 42.2 / 28.3 / 37.9 us for seq 1024 D 64
# non-causal / causal and the goal point's attention).
VECTOR_COPY_PERIOD = 3
# Every DMA_TRANSPOSE_PERIOD-th key block of a query tile with at least DMA_TRANSPOSE_MIN_BLOCKS blocks brings its P^T
# through a DMA transpose (SBUF -> SBUF, at half the DMA rate): the DMA engines are idle in this kernel, TensorE and
# ScalarE / VectorE are not; ScalarE then copies all the other P^T chunks. Its latency (~2 us) costs where tiles
# have few blocks (seq 1024). Measured in bench/RESULTS.md (issue 16, stop 29).
DMA_TRANSPOSE_PERIOD = 2
DMA_TRANSPOSE_MIN_BLOCKS = 4
VECTOR_COPY_PERIOD_WITH_DMA = 0
# The pipeline issues a block's scores this many steps ahead of its P @ v (its softmax one step ahead): PSUM then
# holds 5 score banks, the P^T bank and a finished tile's output, 7 of 8; 5 ahead overflows PSUM. Measured, the
# kernel alone (2 heads, bf16 unless said; us), 3 / 4 ahead: seq 2048 D 64 non-causal 113.1 / 113.1, causal 74.5 /
# 74.3, D 128 123.9 / 116.4, fp32 D 64 203.6 / 194.2; seq 4096 D 64 non-causal 413.4 / 389.7, causal 236.1 / 227.6
# (stop 35; at stop 29, before one-block rows and sums read from PSUM, 3 ahead had measured best).
SCORES_AHEAD = 4
# Where every query tile is one block (all the keys fit one, as the goal point's 256), each tile holds its score bank
# until its normalization (P @ v and the sums stay there), and a step ahead fewer measured better, with the sums read
# from PSUM (the goal point's attention alone, 1 / 2 / 3 ahead: 38.7 / 35.7 / 36.7 us; seq 512 D 64 bf16 non-causal /
# causal: 16.7 / 16.3 / 16.6 and 14.8 / 14.4 / 14.5 us; bench/RESULTS.md, stop 35).
SINGLE_BLOCK_SCORES_AHEAD = 2
# One-block tiles with P^T and P @ [v | 1] in kernel-wide PSUM rings (``AttentionPlan.psum_rings``) hold their score
# bank only from their scores to their exponential. A head group normalized together (VectorE without the per-head
# normalization) then issues the scores a step further ahead and sends one P^T copy in two through VectorE.
# Measured (the goal point's attention alone: 32 query heads of 64 over 4, seq 256, causal, bf16; us): the rings
# 34.3 -> 33.4, with the scaled keys 33.0; then one copy in 3 / 2 at 2 ahead 33.0 / 32.8, at 3 ahead 33.2 / 32.3.
# The softmax then goes two steps ahead of P @ v, and the finished tiles' normalization before P @ v (its ScalarE
# copy out of PSUM first): 32.3 -> 31.8 (the normalization first) -> 31.2 us (with the softmax two ahead; scores 4
# ahead: 31.4). Heads normalized alone keep the scores 2 ahead, one copy in 3 and the softmax one step ahead (2
# heads of 512 keys, D 64 / 128: 3 ahead cost up to 0.7 us; the normalization first 0 to 0.2 us; bench/RESULTS.md,
# stop 37).
RING_GROUPED_SCORES_AHEAD = 3
RING_GROUPED_VECTOR_COPY_PERIOD = 2
RING_GROUPED_SOFTMAX_AHEAD = 2
# P^T chunks in the ring: a bank of bf16 ones, two banks of fp32 ones (with one fp32 bank, a 512-key tile's four
# chunks waited for the copies of the tile before: 2 heads of 512 fp32 keys, D 64, 21.8 -> 22.8 us).
RING_TRANSPOSED_CHUNKS = 8
RING_MIN_OUTPUT_SLOTS = 2  # P @ [v | 1] outputs per PSUM bank, at least (D + 1 <= 256 fp32 columns)
# A query tile's keys up to this many (three PSUM banks of fp32 scores) form one block: one row max over them all,
# one exponential, P @ [v | 1] accumulated across the row's chunks in PSUM, so no running max, no rescale of the
# output and no add of block outputs (VectorE's per-block work beside the max). The score banks are released as
# soon as the exponential has read them, and the pipeline issues the scores WHOLE_ROW_SCORES_AHEAD steps ahead (two
# tiles of three banks beside the P^T and output banks fill PSUM; at 1024 keys, without DMA transposes, 1 / 2 / 3
# ahead measured 129.8 / 118.9 / 129.0 us). Measured (the Flux / Wan mid-size attention: 8 heads, D 128, bf16):
# 1280 keys 208.9 -> 165.7 us, 1024 keys 131.9 -> 123.0 us (bench/RESULTS.md, issue 12, stop 31).
WHOLE_ROW_MAX_BANKS = 3
WHOLE_ROW_SCORES_AHEAD = 2
# Whole-row tiles over three score banks: the last two whole chunks of P^T come through a DMA transpose (SBUF ->
# SBUF), which spares TensorE the transposes and ScalarE / VectorE the PSUM copies; one copy in four of the others
# leaves PSUM through VectorE, which has the row max. Measured over 0 / 1 / 2 / 3 chunks: the kernel alone (us) at
# 1280 keys 184.4 / - / 165.7 / 162.8, at 1024 keys 123.0 / - / 111.5 / 112.2; but in a launch the DMA queues also
# carry the neighbouring matmuls' weights, and the mid-size forwards (ms) gave Flux (1280 keys) 3.760 / 3.723 /
# 3.698 / -, LTX-Video (1024) 1.622 / 1.653 / 1.671 / -, Wan (1024) 1.603 / - / 1.599 / 1.619: two chunks where the
# row has three banks, none under (three chunks with one copy in four: Flux 3.339 against 3.319 ms).
WHOLE_ROW_DMA_CHUNKS = 2
WHOLE_ROW_DMA_MIN_BANKS = 3
# One P^T copy in five leaves PSUM through VectorE. With the normalization on ScalarE (stop 31) the kernel was
# ScalarE-bound and one in four measured best; with the normalization on GpSimd (VectorE copying P @ [v | 1] out of
# PSUM for it), one in 4 / 5 / 6 / 8: the kernel alone at 1280 keys 160.8 / 160.2 / 160.8 / 160.5 us, at 1024 keys
# 116.3 / 112.0 / 113.2 / 117.5 us; the mid-size forwards (ms), one in 4 / 5: Flux 2.97774 / 2.97849, Wan 1.43538 /
# 1.42822, LTX-Video 1.43655 / 1.42794 (bench/RESULTS.md, stop 36).
WHOLE_ROW_VECTOR_COPY_PERIOD = 5
# A head group normalized together leaves VectorE a normalization per head lighter: one copy in three there.
# Measured (the kernel alone, 32 query heads of 64 over 4 key/value heads, bf16; us), one in 4 / 3: seq 1024 causal
# 252.1 / 242.6, non-causal 408.3 / 390.2, seq 1280 causal 365.3 / 368.8, seq 768 D 128 causal 171.6 / 169.9 (stop 35).
GROUPED_WHOLE_ROW_VECTOR_COPY_PERIOD = 3


def plan_attention(node: ir.Attention, target) -> AttentionPlan:
    *batch, queries, value_dim = node.domain
    reason = flash_attention_reason(node.depth, value_dim, node.scale, target)
    if reason:
        raise TilingError(f"{node.name}: {reason}")
    k_tile, k_tiles = attention_head_chunks(node.depth, target.partitions)
    itemsize = 2 if node.q.dtype == "bfloat16" else 4
    # PSUM per block: its scores (then its P @ v) in one bank and its transposed probabilities: with the next
    # block's scores issued ahead, the next block's matmul runs while this block's softmax does
    bank_keys = target.psum_bank_bytes // 4  # fp32 scores per PSUM bank
    whole_row = bank_keys < node.keys <= WHOLE_ROW_MAX_BANKS * bank_keys
    key_block = node.keys if whole_row else min(node.keys, target.gemm_moving_fmax)
    key_chunks = math.ceil(node.keys / target.partitions)
    tiles = count_tiles([store.expr for store in node.stores])
    # SBUF bytes per partition of one query tile: q^T, the scores (fp32 when masked), the probabilities and their
    # transposed chunks, the accumulator and the epilogue tiles; k^T and v of one head when resident.
    per_query_tile = (k_tiles * target.partitions * itemsize + key_block * (4 + 2 * itemsize)
                      + value_dim * 4 * (2 + tiles))
    per_head = k_tiles * node.keys * itemsize + key_chunks * (value_dim + 1) * itemsize
    per_block = k_tiles * key_block * itemsize + math.ceil(key_block / target.partitions) * (value_dim + 1) * itemsize
    budget = target.sbuf_bytes_per_partition * SBUF_SHARE
    resident = 2 * (per_head + per_query_tile) <= budget  # two of each: the next one loads while this one runs
    if not resident and 2 * (per_block + per_query_tile) > budget:
        raise TilingError(f"{node.name}: a query tile needs {2 * (per_block + per_query_tile)} B per partition, over "
                          f"the SBUF budget ({int(budget)} B on {target.name})")
    outer = tuple(LoopDim(size, dim, 1, 1) for dim, size in enumerate(batch))
    causal_bias = node.causal and node.mask is None and node.scale >= MIN_CAUSAL_BIAS_SCALE
    lane_dim = query_group_dim(node, batch, target) if node.mask is None and (causal_bias or not node.causal) else None
    lanes = batch[lane_dim] if lane_dim is not None else 1
    partition = LoopDim(queries, len(batch), 1, min(queries, target.partitions // lanes))
    free = (LoopDim(value_dim, len(batch) + 1, 1, value_dim),)
    rank = len(batch)
    transpose_loads = target.dma_transpose and all(
        needs_transpose(load.layout.strides[rank + 1], load.layout.strides[rank]) for load in (node.q, node.k))
    # a mask constant along the queries: q^T takes the scale (scale * S + mask, the mask added exactly in fp32
    # PSUM); not for scales so small that q * scale could leave the normal range
    mask_bias = node.mask is not None and node.mask.layout.strides[rank] == 0 and node.scale >= MIN_CAUSAL_BIAS_SCALE
    # P^T by DMA transpose for every other block of the tiles with many blocks (measured; see DMA_TRANSPOSE_PERIOD)
    dma_period = DMA_TRANSPOSE_PERIOD if target.dma_transpose and node.keys >= DMA_TRANSPOSE_MIN_BLOCKS * key_block else 0
    copy_period = VECTOR_COPY_PERIOD_WITH_DMA if dma_period else VECTOR_COPY_PERIOD
    scores_ahead = SINGLE_BLOCK_SCORES_AHEAD if node.keys <= key_block else SCORES_AHEAD
    if whole_row:
        copy_period, scores_ahead = WHOLE_ROW_VECTOR_COPY_PERIOD, WHOLE_ROW_SCORES_AHEAD
    bank_chunks = min(math.ceil(key_block / target.partitions),
                      target.psum_bank_bytes // (target.partitions * itemsize))  # P^T chunks per PSUM bank
    group_dim = shared_transfer_dim(node, batch, lane_dim, transpose_loads)
    # per head of a group: its q^T and output tile, and, normalized together, its unscaled fp32 output and sums
    unscaled = (value_dim + 1) * 4 if node.logsumexp is None else 0
    group_bytes = 0 if group_dim is None else batch[group_dim] * (
        (k_tiles * target.partitions + value_dim) * itemsize + unscaled)
    owns_kv = group_dim is not None and bool(node.k.layout.strides[group_dim])
    group_heads = batch[group_dim] if owns_kv else 1  # the key/value heads resident together
    if group_dim is not None and (not resident or 2 * (group_heads * per_head + per_query_tile + group_bytes) > budget):
        group_dim, owns_kv = None, False
    kv_heads = math.prod(size for dim, size in enumerate(batch)  # every batch index with k and v of its own
                         if node.k.layout.strides[dim] or node.v.layout.strides[dim])
    positions_outer = group_dim is not None and kv_heads * per_head + 2 * (per_query_tile + group_bytes) <= budget
    group_normalized = group_dim is not None and node.logsumexp is None
    if whole_row and group_normalized:
        copy_period = GROUPED_WHOLE_ROW_VECTOR_COPY_PERIOD
    softmax_ahead = 1
    output_slots, scaled_keys = one_block_rings(node, key_block, whole_row, positions_outer, causal_bias, target)
    if output_slots:
        bank_chunks = RING_TRANSPOSED_CHUNKS
        if group_normalized:
            copy_period, scores_ahead = RING_GROUPED_VECTOR_COPY_PERIOD, RING_GROUPED_SCORES_AHEAD
            softmax_ahead = RING_GROUPED_SOFTMAX_AHEAD
    return AttentionPlan("attention", outer, partition, free, tiles, k_tile, k_tiles, key_block=key_block,
                         resident=resident, transpose_loads=transpose_loads, causal_bias=causal_bias,
                         lanes=lanes, lane_dim=-1 if lane_dim is None else lane_dim, mask_bias=mask_bias,
                         dma_transpose_period=dma_period, dma_transpose_min_blocks=DMA_TRANSPOSE_MIN_BLOCKS,
                         vector_copy_period=copy_period, whole_row=whole_row, scores_ahead=scores_ahead,
                         dma_transpose_chunks=whole_row_dma_chunks(key_block, bank_keys, target) if whole_row
                         else 0,
                         transposed_bank_chunks=bank_chunks, head_group_dim=-1 if group_dim is None else group_dim,
                         positions_outer=positions_outer, group_owns_kv=owns_kv, group_normalized=group_normalized,
                         kv_loads_per_head=kv_loads_per_head(owns_kv, whole_row, positions_outer),
                         psum_rings=bool(output_slots), output_slots=output_slots, scaled_keys=scaled_keys,
                         softmax_ahead=softmax_ahead)


def kv_loads_per_head(owns_kv: bool, whole_row: bool, positions_outer: bool) -> bool:
    """Whether a head group owning its key/value heads loads them one DMA per head, after the first position's q^T
    (``AttentionPlan.kv_loads_per_head``): with whole rows, resident, the positions outermost (the diffusion
    transformers' self-attention). In one DMA each for the group the first tile waited for every head's (2 x 2.6 MB
    at 8 heads of 128 over 1280 keys: ~15 us without compute). Measured (bench/RESULTS.md, stop 37): the kernel
    alone 177.7 -> 168.8 us (1280 keys), 123.5 -> 114.9 us (1024); the mid-size forwards Wan 1.42232 -> 1.40562 ms,
    LTX-Video 1.40209 -> 1.39581 ms, Flux 2.72873 -> 2.72933 ms (its loads wait for their producers anyway)."""
    return owns_kv and whole_row and positions_outer


def one_block_rings(node: ir.Attention, key_block: int, whole_row: bool, positions_outer: bool, causal_bias: bool,
                    target) -> tuple[int, bool]:
    """Where every query tile is one block (not whole rows): the P @ [v | 1] outputs a PSUM bank of the output ring
    holds (``AttentionPlan.psum_rings``; 0: no rings, under RING_MIN_OUTPUT_SLOTS), and whether k^T takes the scale
    (``AttentionPlan.scaled_keys``)."""
    output_slots = target.psum_bank_bytes // ((node.domain[-1] + 1) * 4)
    if node.keys > key_block or whole_row or output_slots < RING_MIN_OUTPUT_SLOTS:
        return 0, False
    # k^T times the scale: exact for a power of two (and a scale far from the bottom of the float range, as for q^T
    # under mask_bias); not where the scores meet a mask in SBUF (they stay raw there). Only where every key/value
    # head loads up front (positions outermost), so that GpSimd scales them while the first q^T loads: a head loaded
    # at its first tile would wait for it (2 heads of 512 keys, D 64: up to 0.5 us more).
    scaled_keys = (positions_outer and math.frexp(node.scale)[0] == 0.5 and node.scale >= MIN_CAUSAL_BIAS_SCALE
                   and node.mask is None and (causal_bias or not node.causal))
    return output_slots, scaled_keys


def shared_transfer_dim(node: ir.Attention, batch: list[int], lane_dim: int | None,
                        transpose_loads: bool) -> int | None:
    """The outer dim that picks a query head within a key/value group (stride 0 in k and v), when its heads should
    take each query tile position in turn, with q^T of all of them in one DMA transpose and their outputs in one
    store: a DMA's fixed cost (~1.3 us, overhead-bound below 256 B per partition) is then paid once per group, not
    once per head (the goal point's 8 heads of D 64: 64 q^T loads and 64 stores of 16 KB -> 8 and 8, 23.3 -> 9.7 us
    of DMA). Only where q comes through a DMA transpose, the output is stored as computed (no epilogue), and the
    heads do not share a query tile (lanes). Heads without grouped-query sharing (each its own k and v) form a group
    too where they are adjacent in the output's rows (as models store them for the output projection): k^T and v
    of the group then also come in one DMA each (Phi-3-mini's 32 heads of D 96: 192 transfers of 24-48 KB, ~1.3 us
    of fixed cost each, became 6)."""
    if lane_dim is not None or not transpose_loads:
        return None
    if len(node.stores) != 1 or not isinstance(node.stores[0].expr, ir.Result):
        return None
    shared = [dim for dim, size in enumerate(batch)
              if size > 1 and node.k.layout.strides[dim] == 0 and node.v.layout.strides[dim] == 0]
    if shared:
        return shared[0] if len(shared) == 1 else None
    output = node.stores[0].layout
    own = [dim for dim, size in enumerate(batch) if size > 1 and 0 < output.strides[dim] < output.strides[len(batch)]]
    return min(own, key=lambda dim: output.strides[dim]) if own else None


def whole_row_dma_chunks(key_block: int, bank_keys: int, target) -> int:
    """Chunks of P^T a whole-row tile brings by DMA transpose (see WHOLE_ROW_DMA_CHUNKS)."""
    wide = math.ceil(key_block / bank_keys) >= WHOLE_ROW_DMA_MIN_BANKS
    return WHOLE_ROW_DMA_CHUNKS if wide and target.dma_transpose else 0


def query_group_dim(node: ir.Attention, batch: list[int], target) -> int | None:
    """The outer dim that picks a query head within a key/value group (stride 0 in k and v), when its heads
    should share each query tile: when that at least halves the query tiles of a tile per head (few queries per
    head). Not otherwise: the stacked q^T lands in SBUF in runs of one row per head, which DMA bursts pay for
    (measured: 8 heads of 37 queries 16.8 -> 14.3 us, of 100 queries 22.0 -> 24.2 us, of 256 39.4 -> 48.1 us)."""
    rank = len(batch)
    shared = [dim for dim, size in enumerate(batch)
              if size > 1 and node.k.layout.strides[dim] == 0 and node.v.layout.strides[dim] == 0]
    queries = node.domain[rank]
    if len(shared) != 1 or queries < 2 or batch[shared[0]] > target.partitions // 2:
        return None
    group = batch[shared[0]]
    lane_queries = min(queries, target.partitions // group)
    if 2 * math.ceil(queries / lane_queries) > group * math.ceil(queries / target.partitions):
        return None
    return shared[0]


def render_attention(node: ir.Attention, plan: AttentionPlan, name: str, parameters: list[str]) -> str:
    patterns = LanePatterns(plan) if plan.lanes > 1 else Patterns(plan)
    partitions = plan.partition.tile * plan.lanes
    allocator = TileAllocator(partitions, reserved=kernel_names(node, parameters))
    value_dim = node.domain[-1]
    free = [(plan.free[0], "cols")]

    def load_pattern(load: ir.Load, tile: str):
        return f"{tile}[0:rows, 0:cols]", patterns.hbm(load.buffer, load.layout, free, False)

    def column_pattern(load: ir.Load, tile: str):
        # an epilogue value constant along the head dim (a per-row flag or statistic): one element per partition,
        # a (P, 1) operand, instead of a DMA broadcast that moves every repeated element
        if plan.free[0].stride(load.layout) != 0:
            return None
        return f"{tile}[0:rows, 0:1]", patterns.hbm(load.buffer, load.layout, [(LoopDim(1, None), "1")], False)

    # The normalization writes the output tile in the stored dtype when the result is stored as it is (one
    # rounding either way), rather than in fp32 and then a cast copy on VectorE.
    stored = {store.buffer.dtype for store in node.stores}
    as_is = len(stored) == 1 and all(isinstance(store.expr, ir.Result) for store in node.stores)
    output_dtype = stored.pop() if as_is else "float32"
    output = allocator.new("output", value_dim, dtype=output_dtype)
    grouped = plan.head_group_dim >= 0
    epilogue: list[str] = []
    group_store = None
    if grouped:  # the normalization writes each head's slice of the group's output tile, stored with the last head
        head = f"o{plan.head_group_dim}"
        last = plan.outer[plan.head_group_dim].size - 1
        group_store = grouped_output_store(plan, patterns, node.stores[0], f"{output}[0:rows, 0:{last + 1}, 0:cols]")
        epilogue = [f"if {head} == {last}:  # the group's last head: one store for all of them", "    " + group_store]
    else:
        scope = TileScope(allocator, value_dim, "[0:rows, 0:cols]", load_pattern, Ref(tile=output, dtype=output_dtype),
                          vector_pattern=column_pattern)
        store_lines(node.stores, scope, patterns, free, False, epilogue)
    kv_dims, group_dims = head_loops(node, plan)
    key_load, value_lines = key_value_loads(node, plan, patterns)
    # q^T: [D chunk, chunk, rows], or with lanes [D chunk, chunk, queries, heads] (row r = query r // lanes)
    query_rows = f"0:lane_rows, 0:{plan.lanes}" if plan.lanes > 1 else "0:rows"
    if grouped:
        query_rows = f"{head}, 0:rows"
    context = kernel_context(
        node, plan, name, parameters, allocations=allocator.lines, epilogue=epilogue,
        kv_dims=kv_dims, group_dims=group_dims, kv_params=", ".join(f"o{i}" for i in kv_dims),
        kv_key=f"({', '.join(f'o{i}' for i in kv_dims)},)" if kv_dims else "()",  # a single head: the empty tuple
        tile_params="".join(f"o{i}, " for i in kv_dims + group_dims),
        group_first="".join(f"o{j} == 0 and " for j in group_dims), operand_dtype=NL_DTYPES[node.q.dtype], value_dim=value_dim,
        keys=node.keys, key_chunks=math.ceil(node.keys / 128), scale=float(node.scale), causal=node.causal,
        query_load=grouped_transposed_load(plan, patterns, node.q, f"queries_t[0:{plan.k_tile}, 0:{plan.k_tiles}, "
                                      f"0:{plan.outer[plan.head_group_dim].size}, 0:rows]") if grouped else
        transposed_load(plan, patterns, node.q, f"queries_t[0:{plan.k_tile}, 0:{plan.k_tiles}, {query_rows}]",
                        "p0", "lane_rows" if plan.lanes > 1 else "rows"),
        group_head=head if grouped else None, group_size=plan.outer[plan.head_group_dim].size if grouped else 1,
        group_store=group_store, kv_head=f"{head}, " if plan.group_owns_kv else "",
        kv_heads=f"{plan.outer[plan.head_group_dim].size}, " if plan.group_owns_kv else "",
        output_dtype=NL_DTYPES[output_dtype], tile_loops=tile_loops(plan, kv_dims, group_dims),
        partitions=partitions, query_rows=query_rows,
        query_columns=f"{plan.partition.tile}, {plan.lanes}" if plan.lanes > 1 else plan.partition.tile,
        key_load=key_load, value_loads=value_lines,
        mask_load=(mask_row_load(plan, patterns, node.mask, "mask_row[0:1, 0:block_cols]") if plan.mask_bias else
                   mask_load(plan, patterns, node.mask, "mask_tile[0:rows, 0:block_cols]")) if node.mask else None,
        mask_dtype=NL_DTYPES[node.mask.dtype] if node.mask else None, lowest=LOWEST_FP32, epilogue_source=output,
        masked_value=CAUSAL_BIAS,
        logsumexp_store=logsumexp_store(patterns, node.logsumexp) if node.logsumexp else None,
    )
    return render_template("attention.py.j2", **context)


def key_value_loads(node: ir.Attention, plan: AttentionPlan, patterns: Patterns) -> tuple[str, list[str]]:
    """The k^T load and the v loads of one key block: into the resident tiles (the first query tile starts on the
    first block while the others arrive), by load_head's loop variables, or into the block's own tiles."""
    start, count = ("load_start", "load_cols") if plan.resident else ("kv0", "block_cols")  # (load_head's names)
    key_columns = f"{start}:{start} + {count}" if plan.resident else f"0:{count}"
    kv_load_head = "kv_index" if plan.kv_loads_per_head else None  # (one head of the group at a time)
    if plan.group_owns_kv:  # k^T of every head of the group: [D chunk, chunk, head, keys]
        group_size = plan.outer[plan.head_group_dim].size
        heads = f"{kv_load_head}:{kv_load_head} + 1" if kv_load_head else f"0:{group_size}"
        key_load = grouped_transposed_load(plan, patterns, node.k, f"keys_t[0:{plan.k_tile}, 0:{plan.k_tiles}, "
                                           f"{heads}, {key_columns}]", start, count, kv_load_head)
    else:
        key_load = transposed_load(plan, patterns, node.k, f"keys_t[0:{plan.k_tile}, 0:{plan.k_tiles}, {key_columns}]",
                                   start, count)
    first_chunk = f"{start} // 128" if plan.resident else "0"
    return key_load, value_loads(plan, patterns, node, first_chunk, start, count, kv_load_head)


def tile_loops(plan: AttentionPlan, kv_dims: list[int], group_dims: list[int]) -> str:
    """The comprehension loops over the query tiles: per key/value head, its group's query heads, then the query tile
    positions; with a head group (``plan.head_group_dim``), the group's heads innermost, so that they take each
    position one after another, and the positions outermost where every head stays resident
    (``plan.positions_outer``)."""
    def loops(dims):
        return "".join(f" for o{j} in range({plan.outer[j].size})" for j in dims)

    positions = f" for p0 in range(0, {plan.partition.size}, {plan.partition.tile})"
    if plan.positions_outer:
        return positions + loops(kv_dims) + loops(group_dims)
    if plan.head_group_dim >= 0:
        return loops(kv_dims) + positions + loops(group_dims)
    return loops(kv_dims + group_dims) + positions


class AttentionKind(MatchingIndexEpilogue):
    node_type = ir.Attention
    name = "attention"

    def stores(self, node):
        return tuple(node.stores) + ((node.logsumexp,) if node.logsumexp else ())

    def prune(self, node, needed):
        logsumexp = node.logsumexp if node.logsumexp and node.logsumexp.buffer.name in needed else None
        return dataclasses.replace(super().prune(node, needed), logsumexp=logsumexp)

    def epilogue_reason(self, group, consumer, outside):
        if group.logsumexp and any(load.buffer == group.logsumexp.buffer.name for load in loads(consumer)):
            return f"{consumer.name} reads the log-sum-exp, a row statistic, not the output tile"
        return super().epilogue_reason(group, consumer, outside)

    def operand_loads(self, node):
        return [node.q, node.k, node.v] + ([node.mask] if node.mask else [])

    def describe_head(self, node):
        mask = f"\n  mask: {node.mask}" if node.mask else ""
        logsumexp = f"\n  {node.logsumexp.buffer.name} = logsumexp (per query row)" if node.logsumexp else ""
        return (f" scale={node.scale:g} causal={node.causal}\n  q: {node.q}\n  k: {node.k}\n  v: {node.v}{mask}"
                f"{logsumexp}")

    def plan(self, node, target):
        return plan_decode(node, target) or plan_attention(node, target)

    def render(self, node, plan, name, parameters):
        if isinstance(plan, DecodePlan):
            return render_decode(node, plan, name, parameters)
        return render_attention(node, plan, name, parameters)


register_kind(AttentionKind())

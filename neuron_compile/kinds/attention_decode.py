"""Kernel kind ``attention``, the split-key decode form: attention whose query tiles have few rows (a decode step:
one query per head, a grouped-query group's heads as the rows) against a long key/value cache.

The flash kernel (kinds/attention.py) puts a tile's query rows on the partitions: with 8 rows, 8 of 128 partitions
work and every ScalarE / VectorE instruction streams all the keys. Here the keys go on the partitions instead, in
chunks of 128, and the rows on the free axis: S^T = k q^T per chunk (TensorE, k^T as the stationary operand), all
chunks of all tiles of a *wave* side by side in one PSUM bank. The softmax then runs once per wave: the row max
(per partition over the chunks, then across the partitions after a TensorE transpose), subtracted on TensorE (a
ones matrix times the negated maxima, placed on each row's columns by a selector), one exponential over every
score, and P @ [v | 1] per chunk with P^T straight from the exponentials (no transposes) and the ones column of v
giving each row's sum. A ragged last chunk takes the cache's last 128 keys: the keys it repeats count in the max
but not in P @ [v | 1] (their v rows and ones are zeroed). The mask, an additive float mask the same for every row
(the valid length transformers builds from cache_position, a key padding mask), accumulates onto S^T on TensorE,
q^T taking the scale; a mask that differs per row stays with the flash kernel.

Latency, not bandwidth, bounds a decode step's attention (a few KiB per head), and every DMA transfer occupies
the engines it spreads over for a fixed cost: q therefore lands as it lies (rows on partitions, one DMA engine)
and TensorE transposes it, the PSUM copy taking the scale, rather than in a DMA transpose over eight engines
that k^T's transfers would queue behind. The sums' clamp and reciprocal are one instruction, and the tiles'
normalizations alternate between VectorE and ScalarE.

Input: an ``ir.Attention`` node and a Target. Output: a ``DecodePlan`` (or None where the form does not apply) and
the kernel text (attention_decode.py.j2).
"""

from __future__ import annotations

import dataclasses
import math

from neuron_compile import ir
from neuron_compile.codegen.expressions import NL_DTYPES, Ref, TileAllocator, TileScope
from neuron_compile.codegen.kernel_text import (
    Patterns,
    entries_text,
    kernel_context,
    kernel_names,
    offset_text,
    render_template,
    store_lines,
)
from neuron_compile.dims import LoopDim
from neuron_compile.kinds.attention_operands import (
    LOWEST_FP32,
    AttentionPlan,
    head_loops,
    mask_row_load,
    transposed_load,
    value_loads,
)
from neuron_compile.limits import SBUF_SHARE
from neuron_compile.tiles import attention_head_chunks, count_tiles, flash_attention_reason, needs_transpose

# A tile of at most this many query rows takes the split-key form (a decode step's query heads of one group).
# Measured (2 heads, head dim 64, bf16, est us flash / split at 512 and 2048 keys): 8 rows 11.8 / 11.0, 18.7 / 15.6;
# 16 rows 11.8 / 11.3, 18.7 / 16.8; 32 rows 11.8 / 11.9, 18.7 / 17.4; 64 rows 11.8 / 13.1, 18.8 / 18.8.
DECODE_MAX_ROWS = 16
# k^T comes in blocks of this many keys (4 KiB per partition in bf16, where DMA efficiency saturates), so that
# the first chunks' scores need not wait for a long cache's whole load.
KEY_LOAD_BLOCK = 2048


@dataclasses.dataclass(frozen=True)
class DecodePlan(AttentionPlan):
    """The split-key form: ``key_chunks`` chunks of ``chunk_keys`` keys on the partitions (the last one ends at
    the last key), the tile's rows on the free axis; ``wave`` query tiles share each softmax instruction."""

    key_chunks: int = 1
    chunk_keys: int = 128
    wave: int = 1

    def describe(self) -> str:
        text = f"{self.kind} (split keys): outer [{', '.join(f'{d.size}/{d.tile}' for d in self.outer) or '-'}] "
        text += f"rows {self.partition.size} D {self.k_tiles}x{self.k_tile}, {self.key_chunks} key chunks of "
        text += f"{self.chunk_keys} on partitions, {self.wave} query tiles per wave"
        return text + (", the mask row on TensorE" if self.mask_bias else "")


def plan_decode(node: ir.Attention, target) -> DecodePlan | None:
    """The split-key plan, or None where the flash kernel's query tiles serve: more than DECODE_MAX_ROWS rows,
    causal (a few queries see few keys), the training form (log-sum-exp), at most one chunk of keys (measured, 8
    rows x 2 heads, bf16: 40 keys 9.7 us flash / 10.2 split, 128 keys 10.5 / 10.4, 200 keys 10.5 / 10.5, 512
    keys 11.8 / 10.9: the split's longer chain of small steps only pays from two chunks on), or shapes past one
    PSUM bank."""
    *batch, rows, value_dim = node.domain
    keys, partitions = node.keys, target.partitions
    if not node.split_keys or node.causal or node.logsumexp is not None or rows > DECODE_MAX_ROWS \
            or keys <= partitions:
        return None
    if flash_attention_reason(node.depth, value_dim, node.scale, target):
        return None  # the flash planner names the reason
    rank = len(batch)
    if node.mask is not None and rows > 1 and node.mask.layout.strides[rank] != 0:
        # a mask that differs per row (per-head biases such as ALiBi): its transpose onto S^T would take a matmul
        # against an identity, whose zeros times a -inf of the mask give nan
        return None
    chunk_keys, chunks = partitions, math.ceil(keys / partitions)
    bank = target.gemm_moving_fmax  # fp32 elements of one PSUM bank
    if chunks * rows > bank or value_dim + 1 > bank:
        return None
    k_tile, k_tiles = attention_head_chunks(node.depth, partitions)
    widest = min(math.prod(batch), bank // (chunks * rows), partitions // rows, bank // (value_dim + 1))
    budget = target.sbuf_bytes_per_partition * SBUF_SHARE
    wave = next((tiles for tiles in range(widest, 0, -1)
                 if decode_wave_bytes(node, batch, tiles, chunks, k_tiles) <= budget), 0)
    if wave < 1:
        return None
    transpose_loads = target.dma_transpose and all(
        needs_transpose(load.layout.strides[rank + 1], load.layout.strides[rank]) for load in (node.q, node.k))
    return DecodePlan("attention", tuple(LoopDim(size, dim, 1, 1) for dim, size in enumerate(batch)),
                      LoopDim(rows, rank, 1, rows), (LoopDim(value_dim, rank + 1, 1, value_dim),),
                      count_tiles([store.expr for store in node.stores]), k_tile, k_tiles, resident=True,
                      transpose_loads=transpose_loads, mask_bias=node.mask is not None, key_chunks=chunks,
                      chunk_keys=chunk_keys, wave=wave)


def decode_wave_bytes(node: ir.Attention, batch: list[int], wave: int, chunks: int, k_tiles: int) -> int:
    """SBUF bytes per partition of waves of ``wave`` query tiles, two in flight (the next one loads while this one
    computes) unless one wave holds every tile: each tile's q^T, P^T and output tiles, and the k^T and [v | 1] of
    one head and the row of one mask per tile, at most as many as the kernel has."""
    rows, value_dim = node.domain[-2:]
    itemsize = 2 if node.q.dtype == "bfloat16" else 4
    heads = math.prod(size for dim, size in enumerate(batch)
                      if node.k.layout.strides[dim] or node.v.layout.strides[dim])
    per_head = (k_tiles * node.keys + chunks * (value_dim + 1)) * itemsize
    masks, per_mask = 0, 0
    if node.mask is not None:
        masks = math.prod(size for dim, size in enumerate(batch) if node.mask.layout.strides[dim])
        per_mask = node.keys * (2 if node.mask.dtype == "bfloat16" else 4)
    per_tile = ((k_tiles + chunks) * rows * itemsize
                + value_dim * 4 * (1 + count_tiles([store.expr for store in node.stores])))
    tiles = min(2 * wave, math.prod(batch))
    return min(tiles, heads) * per_head + min(tiles, masks) * per_mask + tiles * per_tile


def value_lines(plan: DecodePlan, patterns: Patterns, node: ir.Attention) -> list[str]:
    """v into ``values`` [chunk keys, chunk, Dv + 1]: the whole chunks, then (ragged) the keys left as the end of
    the last chunk, which covers the last 128 keys; its first rows (keys the previous chunk has) are zeroed below,
    ones column included."""
    keys, chunk, whole = node.keys, plan.chunk_keys, node.keys // plan.chunk_keys
    lines = value_loads(plan, patterns, node, "0", "0", str(whole * chunk))
    if whole < plan.key_chunks:
        rank, value_dim = len(plan.outer), node.domain[-1]
        seq_stride, depth_stride = node.v.layout.strides[rank], node.v.layout.strides[rank + 1]
        repeated, first_left = plan.key_chunks * chunk - keys, whole * chunk
        entries = entries_text([[seq_stride, keys - first_left], [depth_stride, value_dim]])
        offset = offset_text(node.v.layout.offset + first_left * seq_stride, patterns.outer_terms(node.v.layout))
        source = f"{node.v.buffer}.ap({entries}, offset={offset})"
        lines.append(f"nisa.dma_copy(dst=values[{repeated}:{chunk}, {whole}, 0:{value_dim}], src={source})")
    return lines


def mask_positions(node: ir.Attention, plan: DecodePlan, tile_dims: list[int]) -> tuple[int, ...]:
    """Positions in a tile's loop indices (``tile_dims`` order) of the outer dims the mask varies along: tiles
    equal there read the same mask row."""
    if node.mask is None:
        return ()
    return tuple(i for i, dim in enumerate(tile_dims) if plan.outer[dim].stride(node.mask.layout) != 0)


def render_decode(node: ir.Attention, plan: DecodePlan, name: str, parameters: list[str]) -> str:
    patterns = Patterns(plan)
    rows, value_dim = plan.partition.size, node.domain[-1]
    allocator = TileAllocator(rows, reserved=kernel_names(node, parameters))
    free = [(plan.free[0], "cols")]

    def load_pattern(load: ir.Load, tile: str):
        return f"{tile}[0:rows, 0:cols]", patterns.hbm(load.buffer, load.layout, free, False)

    stored = {store.buffer.dtype for store in node.stores}
    as_is = len(stored) == 1 and all(isinstance(store.expr, ir.Result) for store in node.stores)
    output_dtype = stored.pop() if as_is else "float32"
    output = allocator.new("output", value_dim, dtype=output_dtype)
    scope = TileScope(allocator, value_dim, "[0:rows, 0:cols]", load_pattern, Ref(tile=output, dtype=output_dtype))
    epilogue: list[str] = []
    store_lines(node.stores, scope, patterns, free, False, epilogue)
    kv_dims, group_dims = head_loops(node, plan)
    keys, rank = node.keys, len(plan.outer)
    mask = mask_row_load(plan, patterns, node.mask, f"mask[0:1, 0:{keys}]") if node.mask is not None else None
    context = kernel_context(
        node, plan, name, parameters, allocations=allocator.lines, epilogue=epilogue, epilogue_source=output,
        kv_count=len(kv_dims), mask_positions=mask_positions(node, plan, kv_dims + group_dims),
        kv_params=", ".join(f"o{i}" for i in kv_dims), tile_params="".join(f"o{i}, " for i in kv_dims + group_dims),
        tile_loops="".join(f" for o{j} in range({plan.outer[j].size})" for j in kv_dims + group_dims),
        operand_dtype=NL_DTYPES[node.q.dtype], mask_dtype=NL_DTYPES[node.mask.dtype] if node.mask else None,
        rows=rows, value_dim=value_dim, keys=keys, chunks=plan.key_chunks, chunk_keys=plan.chunk_keys,
        repeated=plan.key_chunks * plan.chunk_keys - keys, scale=float(node.scale), lowest=LOWEST_FP32,
        key_load=transposed_load(plan, patterns, node.k, f"keys_t[0:{plan.k_tile}, 0:{plan.k_tiles}, "
                                 "load_start:load_start + load_cols]", "load_start", "load_cols"),
        query_rows=patterns.hbm(node.q.buffer, node.q.layout, [(LoopDim(node.depth, rank + 1, 1, node.depth),
                                                                str(node.depth))], False),
        depth=node.depth, key_load_block=KEY_LOAD_BLOCK,
        value_loads=value_lines(plan, patterns, node), mask_load=mask,
    )
    return render_template("attention_decode.py.j2", **context)

"""Kernel kind ``matmul``, its resident form's stores: a product stored as it is (a backward's weight gradient,
``dy.t() @ x``) leaves each row block in one DMA per column group instead of one per N tile.

Input: a plain ``ir.MatMul`` and its kept-moving tile plan (b's tiles resident for ``column_group`` columns, a^T
streamed past them ``row_group`` rows at a time). Output: the resident template's entries that evacuate each N
tile's PSUM product into its columns of a row buffer (one per 128-row block of the row group, ``column_group``
columns wide, in the store's dtype) and store every buffer once after the group's last N tile.

Why: an N tile is one PSUM bank (512 fp32 columns), so a bf16 product's store per N tile moves 1 KiB per
partition, where the DMA's fixed cost per transfer is a third of its time (nki-spec §2: >= 2 KiB per partition
recommended, 4 KiB saturates); the MLP's weight gradient ([5632, 256] x [256, 2048]) was bound by those stores.
The values are the same: the same rounding copy out of PSUM, moved by fewer, larger DMAs.
"""

from __future__ import annotations

import dataclasses
import math

from neuron_compile import ir
from neuron_compile.codegen.expressions import NL_DTYPES
from neuron_compile.codegen.kernel_text import Patterns
from neuron_compile.limits import SBUF_SHARE
from neuron_compile.tiles import TilePlan

ROW_BUFFER = "product_rows"  # the row buffers' name in the kernel: one per row block of the group
ROW_BUFFER_SETS = 2  # the next row group's buffers fill while this group's are stored
# A row of fewer bytes per partition is overhead-bound anyway (nki-spec §2: < 2 KiB per partition); at least two N
# tiles of 512 bf16 columns
ROW_STORE_MIN_BYTES = 2048


def stores_rows(node: ir.MatMul) -> bool:
    """Whether ``node`` stores its product as it is, in a bf16 / fp16 dtype, once (no epilogue, no paired product,
    no implicit GEMM), in rows of at least ``ROW_STORE_MIN_BYTES``: its evacuation rounds to the store's dtype
    (kinds/matmul.py ``evacuated_dtype``) and can write straight into a row buffer."""
    if node.b2 is not None or node.shifts or len(node.stores) != 1:
        return False
    store = node.stores[0]
    dtype = store.buffer.dtype
    if dtype not in ("bfloat16", "float16") or node.domain[-1] * ir.ITEMSIZE[dtype] < ROW_STORE_MIN_BYTES:
        return False
    return store.expr in (ir.Result(), ir.Op("cast", (ir.Result(),), dtype))


def beside_row_buffers(node: ir.MatMul, target, blocks: int):
    """``target`` with the SBUF the row buffers of ``blocks`` row blocks take (whole rows, ``ROW_BUFFER_SETS``
    sets) set aside, for the kept-moving planner to plan the rest in."""
    row_bytes = ROW_BUFFER_SETS * blocks * node.domain[-1] * ir.ITEMSIZE[node.stores[0].buffer.dtype]
    return dataclasses.replace(target, sbuf_bytes_per_partition=target.sbuf_bytes_per_partition
                               - math.ceil(row_bytes / SBUF_SHARE))


def row_store_entries(node: ir.MatMul, plan: TilePlan, patterns: Patterns) -> dict:
    """The resident template's entries of the row stores (``plan`` kept-moving): the row buffers per group, the
    evacuation into the N tile's columns of its block's buffer, no per-tile epilogue, and the stores after the
    group's last N tile."""
    store = node.stores[0]
    n = node.domain[-1]
    dtype = NL_DTYPES[store.buffer.dtype]
    dst = patterns.hbm(store.buffer.name, store.layout, [(plan.free[0], "cols")], True, free_start="c0")
    group_tiles = [f"{ROW_BUFFER} = [nl.ndarray(({plan.partition.tile}, {plan.column_group}), dtype={dtype}, "
                   "buffer=nl.sbuf) for _ in range(blocks)]"]
    # PSUM -> SBUF on ScalarE, rounded to the store's dtype, into this N tile's columns of the block's row buffer
    evacuate = [f"nisa.activation(dst={ROW_BUFFER}[block][0:rows, f0 - c0:f0 - c0 + cols], op=nl.copy, "
                "data=accumulator[0:rows, 0:cols])"]
    row_epilogue = [f"cols = min({plan.column_group}, {n} - c0)  # the column group's width",
                    f"nisa.dma_copy(dst={dst}, src={ROW_BUFFER}[block][0:rows, 0:cols])"]
    return dict(allocations=[], evacuate=evacuate, epilogue=[], group_tiles=group_tiles, row_epilogue=row_epilogue,
                group_note="each block's rows of the product, filled one N tile at a time, stored after the last",
                row_note="every N tile of the column group has passed: each block's rows leave in one DMA")

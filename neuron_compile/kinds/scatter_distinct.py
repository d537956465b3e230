"""Kernel kind ``scatter``, the assign form whose tile elements hit distinct targets (``ir.Scatter`` with
``reduce="assign"`` and no index varying along the partition dim: a static KV-cache update, one position written
for every batch and head).

Input: the node, its TilePlan and the address helpers of kinds/indirect.py. Output: kernel lines per tile and the
tiles they use. Two elements of a tile differ only along the partition dim, which no index drives, so their
targets differ by a multiple of the output's (nonzero) stride there: no two collide, and the collision search of
kinds/scatter.py (a rows x rows comparison, a max, an indirect read of each winner) has nothing to find. Per tile:

* the target offset of each partition: an iota of the output coordinates, plus each index (loaded once per
  partition, wrapped where the op wraps negatives) times its stride; an index outside [0, size) zeroes its
  partition's address and adds OUT_OF_RANGE_ROW, so the write's bounds check fails (the call then runs eagerly and
  raises eager's error), never a write elsewhere. A range check is ``|index - c| > c`` with c = (size - 1) / 2: two
  ops on one instruction, then one compare;
* one indirect DMA writes every partition's row, straight from the values in HBM (no SBUF hop: the write follows
  the values' writer by one DMA, not two).

Six VectorE instructions and one iota per tile for one index, where the collision search takes some twenty.
"""

from __future__ import annotations

from collections.abc import Callable

from neuron_compile import ir
from neuron_compile.codegen.expressions import NL_DTYPES, number
from neuron_compile.kinds.indirect import indirect_offset, wrap_negative_lines
from neuron_compile.kinds.scatter_rows import row_entries
from neuron_compile.limits import OUT_OF_RANGE_ROW
from neuron_compile.tiles import TilePlan

COLUMN = "[0:rows, 0:1]"  # one value per partition


def distinct_targets(node: ir.Scatter, plan: TilePlan) -> bool:
    """An assign whose tile elements cannot collide: a tile of one element, or no index varies along the
    partition dim and the output does."""
    part = plan.partition.source
    if node.reduce != "assign":
        return False
    if plan.partition.tile == 1:
        return True
    return node.target.strides[part] != 0 and all(load.layout.strides[part] == 0 for load, *_ in node.indices)


def distinct_allocations(node: ir.Scatter, plan: TilePlan) -> list[str]:
    """The form's SBUF tiles: the int32 index and offsets, the fp32 address arithmetic (the wrap's and a second
    index's tiles only where used), and a tile of the number a Scalar writes."""
    rows, free = plan.partition.tile, plan.free[0].size
    fp32 = ["address", "distance", "bad", "keep"]
    fp32 += ["wrapped"] if any(wrap for *_, wrap in node.indices) else []
    fp32 += ["outside"] if len(node.indices) > 1 else []
    lines = [f"{tile} = nl.ndarray(({rows}, 1), dtype=nl.int32, buffer=nl.sbuf)" for tile in ("index", "offsets")]
    lines += [f"{tile} = nl.ndarray(({rows}, 1), dtype=nl.float32, buffer=nl.sbuf)" for tile in fp32]
    if isinstance(node.values, ir.Scalar):
        lines += [f"filled = nl.ndarray(({rows}, {free}), dtype=nl.float32, buffer=nl.sbuf)",
                  f"nisa.memset(dst=filled, value={number(node.values.value)})"]
    return lines


def distinct_lines(node: ir.Scatter, plan: TilePlan, offset: Callable, terms: Callable) -> list[str]:
    """One tile: each partition's target offset, then one indirect DMA from the values (HBM to HBM: no SBUF hop
    between the values' writer and the cache) or from the filled tile."""
    part, values, target = plan.partition.source, node.values, node.target
    lines = [f"nisa.iota(address{COLUMN}, [[0, 1]], offset={indirect_offset(target.offset, terms(target))}, "
             f"channel_multiplier={target.strides[part]})"]
    for position, entry in enumerate(node.indices):
        lines += _index_lines(entry, offset, first=position == 0)
    if isinstance(values, ir.Load):
        source = f"{values.buffer}.ap([[{values.layout.strides[part]}, rows]{row_entries(node, values.layout)}], " \
                 f"offset={offset(values.layout)})"
    else:
        source = f"filled[0:rows, 0:{plan.free[0].size}]"
    return lines + [
        # keep = 1 - bad; offsets = address * keep + bad * OUT_OF_RANGE_ROW (bad is 0 or 1)
        f"nisa.tensor_scalar(dst=keep{COLUMN}, data=bad{COLUMN}, op0=nl.multiply, operand0=-1.0, op1=nl.add, "
        "operand1=1.0)",
        f"nisa.tensor_tensor(dst=address{COLUMN}, data1=address{COLUMN}, data2=keep{COLUMN}, op=nl.multiply)",
        f"nisa.scalar_tensor_tensor(dst=offsets{COLUMN}, data=bad{COLUMN}, op0=nl.multiply, "
        f"operand0={float(OUT_OF_RANGE_ROW)}, op1=nl.add, operand1=address{COLUMN})",
        f"nisa.dma_copy(dst={node.stores[0].buffer.name}.ap([[1, rows]{row_entries(node, target)}], offset=0, "
        f"vector_offset=offsets{COLUMN}, indirect_dim=0), src={source})",
    ]


def _index_lines(entry, offset: Callable, first: bool) -> list[str]:
    """address += index * stride for one (Load, stride, size, wrap) entry; bad = 1 where the index (wrapped when
    the op wraps negatives) lies outside [0, size). Every partial sum of valid indices is an integer below the
    span < 2^24 (checked by the lowering): exact fp32."""
    index, stride, size, wrap = entry
    middle = (size - 1) / 2
    lines = [f"nisa.dma_copy(dst=index{COLUMN}, src={index.buffer}.ap([[0, rows], [1, 1]], "
             f"offset={offset(index.layout)}))"]
    wrapped = f"index{COLUMN}"
    if wrap:
        lines += wrap_negative_lines(wrapped, size, COLUMN)
        wrapped = f"wrapped{COLUMN}"
    flag = "bad" if first else "outside"
    lines += [
        f"nisa.tensor_scalar(dst=distance{COLUMN}, data={wrapped}, op0=nl.subtract, operand0={middle!r}, "
        "op1=nl.abs_max, operand1=0.0)",
        f"nisa.tensor_scalar(dst={flag}{COLUMN}, data=distance{COLUMN}, op0=nl.greater, operand0={middle!r})",
    ]
    if not first:
        lines.append(f"nisa.tensor_tensor(dst=bad{COLUMN}, data1=bad{COLUMN}, data2=outside{COLUMN}, op=nl.maximum)")
    return lines + [
        f"nisa.scalar_tensor_tensor(dst=address{COLUMN}, data={wrapped}, op0=nl.multiply, operand0={float(stride)}, "
        f"op1=nl.add, operand1=address{COLUMN})",
    ]

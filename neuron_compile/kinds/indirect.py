"""Kernel kinds through the indirect DMA (gather, scatter): the address arithmetic both kinds share.

Input: the addressed layout restated over the domain and the (index load, stride, size, wrap) entries of a node.
Output: kernel lines that compute each element's flat offset on its partition (``address``, then the int32
``offsets`` an indirect DMA takes), flag out-of-range indices (``bad``) and redirect them to OUT_OF_RANGE_ROW,
so the DMA's bounds check fails (the call then runs eagerly and raises eager's error), and the kernel module text
(``render_indirect``: outer loops, then row tiles on partitions, from the kind's TilePlan).
"""

from __future__ import annotations

from neuron_compile import ir
from neuron_compile.codegen.kernel_text import kernel_context, render_template
from neuron_compile.limits import OUT_OF_RANGE_ROW


def indirect_offset(base: int, terms: list[tuple[str, int]]) -> str:
    """``base + var * stride + ...`` (every term written, stride 1 too; stride-0 terms dropped)."""
    parts = [str(base)] + [f"{var} * {stride}" for var, stride in terms if stride != 0]
    return " + ".join(parts)


def column_address_lines(base: ir.Layout, indices, terms, part: int, window: str) -> list[str]:
    """The flat offset of each element of a tile on its partition, in the fp32 tile ``address``, with ``bad``
    flags: an iota of ``base`` (the addressed layout restated over the domain, stride 0 on index-driven dims) plus
    each index's contribution. ``terms(layout)`` names the loop variables' part of a layout's offset."""
    lines = [
        # The output coordinates' part of the offset: exact int32 iota on GpSimd (stride 0 on index-driven dims).
        f"nisa.iota(base{window}, [[0, 1]], offset={indirect_offset(base.offset, terms(base))}, "
        f"channel_multiplier={base.strides[part]})",
        f"nisa.memset(dst=bad{window}, value=0.0)",
        f"nisa.tensor_copy(dst=address{window}, src=base{window})",
    ]
    return lines + element_address_lines(
        indices, lambda index: f"{index.buffer}.ap([[{index.layout.strides[part]}, rows], [1, 1]], "
        f"offset={indirect_offset(index.layout.offset, terms(index.layout))})", window)


def element_address_lines(indices, index_pattern, window: str, suffix: str = "", check: bool = True) -> list[str]:
    """Add each index's contribution to the fp32 tile ``address{suffix}`` (initialised by the caller).

    ``indices`` holds (Load, stride, size, wrap) entries; ``index_pattern(load)`` is the HBM access pattern that
    DMAs the load into ``raw{suffix}{window}``. index.Tensor / index_put wrap idx < 0 to idx + size (gather and
    scatter do not); with ``check``, ``bad`` becomes 1 where an index lies outside [0, size). For valid indices
    every partial sum is an integer below the span < 2^24 (checked by the lowerings): exact fp32.
    """
    raw, shift, wrapped, address = (f"{tile}{suffix}{window}" for tile in ("raw", "shift", "wrapped", "address"))
    lines = []
    for index, stride, size, wrap in indices:
        lines += [
            f"nisa.dma_copy(dst={raw}, src={index_pattern(index)})",
            f"nisa.tensor_scalar(dst={shift}, data={raw}, op0=nl.less, operand0=0.0, op1=nl.multiply, "
            f"operand1={float(size) if wrap else 0.0})",
            f"nisa.tensor_tensor(dst={wrapped}, data1={raw}, data2={shift}, op=nl.add)",
        ]
        if check:
            lines += [
                f"nisa.tensor_scalar(dst=low{window}, data={wrapped}, op0=nl.less, operand0=0.0)",
                f"nisa.tensor_scalar(dst=high{window}, data={wrapped}, op0=nl.greater_equal, "
                f"operand0={float(size)})",
                f"nisa.tensor_tensor(dst=bad{window}, data1=bad{window}, data2=low{window}, op=nl.maximum)",
                f"nisa.tensor_tensor(dst=bad{window}, data1=bad{window}, data2=high{window}, op=nl.maximum)",
            ]
        lines += [
            f"nisa.tensor_scalar(dst={wrapped}, data={wrapped}, op0=nl.multiply, operand0={float(stride)})",
            f"nisa.tensor_tensor(dst={address}, data1={address}, data2={wrapped}, op=nl.add)",
        ]
    return lines


def wrap_negative_lines(value: str, size: int, window: str) -> list[str]:
    """``wrapped`` = ``value`` + size where ``value`` < 0 (index.Tensor's and index_put's negative indices), in two
    instructions on [rows, 1] fp32 tiles."""
    return [f"nisa.tensor_scalar(dst=wrapped{window}, data={value}, op0=nl.less, operand0=0.0, op1=nl.multiply, "
            f"operand1={float(size)})",
            f"nisa.tensor_tensor(dst=wrapped{window}, data1={value}, data2=wrapped{window}, op=nl.add)"]


def redirect_lines(window: str) -> list[str]:
    """``offsets`` (int32) = ``address``, or OUT_OF_RANGE_ROW where ``bad``: a bad element's address (finite:
    |idx| < 2^31, stride < 2^24) is zeroed by keep = 0 and redirected beyond the buffer, so the DMA's bounds
    check fails, never an access of another element."""
    return [
        f"nisa.tensor_scalar(dst=keep{window}, data=bad{window}, op0=nl.multiply, operand0=-1.0, op1=nl.add, "
        "operand1=1.0)",
        f"nisa.tensor_tensor(dst=address{window}, data1=address{window}, data2=keep{window}, op=nl.multiply)",
        f"nisa.tensor_scalar(dst=bad{window}, data=bad{window}, op0=nl.multiply, operand0={float(OUT_OF_RANGE_ROW)})",
        f"nisa.tensor_tensor(dst=offsets{window}, data1=address{window}, data2=bad{window}, op=nl.add)",
    ]


def render_indirect(node, plan, name: str, parameters: list[str], allocations: list[str], body: list[str],
                    template: str, prelude: tuple[str, ...] = ()) -> str:
    """A gather or scatter module: ``prelude`` (lines at kernel level), the plan's outer loops (``o0``, ``o1``, ...),
    then its row tiles on partitions (``p0``, ``rows``), each running ``body``."""
    context = kernel_context(node, plan, name, parameters, allocations=allocations, body=body, prelude=list(prelude),
                             depth=len(plan.outer) + 1)
    return render_template(template, **context)

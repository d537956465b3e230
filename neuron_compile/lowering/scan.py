"""Lowering stage, scan family: cumsum, cumprod, logcumsumexp, cummax and cummin along any dim.

Input: an ATen FX node. Output: one ``ir.Scan`` over the input shape whose store writes the running value with
eager's strides (a 0-d input is copied, as eager does); cummax / cummin emit two, the values and the int64
indices (exact: fp32 positions below 2**24, widened to int64 at the region's output).

Eager's CPU kernels accumulate a float32 scan in double and a bfloat16 one in float32, rounding each output to
the result dtype. The engines scan in fp32 (``nisa.tensor_tensor_scan``), which matches bfloat16 results
exactly; float32 sums and products are ``compensated``: the kernel also carries each step's exact fp32
rounding error (TwoSum, TwoProduct; codegen/scan.py), so the output is the double-accumulated value rounded to
fp32, as eager's (products whose error terms underflow, below about 2**-100, keep plain fp32 rounding). A running
sum or product that overflows fp32 stays inf where eager's double accumulator could come back into range.
logcumsumexp is m + log(s) with m the running max and s the running sum of exp(x - m), rescaled whenever m grows
(fp32, within rounding of eager's double).

Integer scans (cumsum of bool or integer tensors, or ``dtype=`` an integer type) produce int64 in eager, which
needs exact integer arithmetic the fp32 engines do not have: they run eagerly, with that reason.
"""

from __future__ import annotations

import torch

from neuron_compile import ir
from neuron_compile.limits import FP32_EXACT_INTEGER
from neuron_compile.lowering.pointwise import emit_pointwise
from neuron_compile.lowering.registry import INTEGER_OPS, TensorValue, load, register_lowering

aten = torch.ops.aten

SCAN_OPS = {aten.cumsum.default: "sum", aten.cumprod.default: "prod", aten.logcumsumexp.default: "logsumexp"}
FLOAT_DTYPES = (torch.float32, torch.bfloat16)


def _check_scan(node: torch.fx.Node) -> str | None:
    source, result = node.args[0].meta["val"], node.meta["val"]
    if result.dtype not in FLOAT_DTYPES:
        dtype = str(result.dtype).removeprefix("torch.")
        return (f"{node.target}: an integer running {SCAN_OPS[node.target]} ({dtype} result) needs exact integer "
                "arithmetic; the engines scan in fp32")
    if source.dtype not in FLOAT_DTYPES + (torch.bool,):
        dtype = str(source.dtype).removeprefix("torch.")
        return f"{node.target}: {dtype} input (its integers are exact in fp32 only within +-2**24)"
    return None


# The check states the integer cases itself (a clearer reason than the registry's bare dtype).
INTEGER_OPS.update((aten.cumsum.default, aten.cumprod.default))


@register_lowering(*SCAN_OPS, check=_check_scan)
def lower_scan(ctx, node):
    source, dim = node.args[:2]
    op = SCAN_OPS[node.target]
    result = node.meta["val"]
    domain = ctx.value(source).layout.shape
    prologue = load(ctx, source, domain)
    if ctx.value(source).dtype == "float32" and result.dtype == torch.bfloat16:
        prologue = ir.Op("cast", (prologue,), dtype="bfloat16")  # dtype=bf16: eager rounds the input first
    if not domain:
        return emit_pointwise(ctx, node, prologue)  # eager copies a 0-d input (-0.0 stays -0.0)
    buffer = ctx.output_buffer(node, node.target.overloadpacket.__name__)
    # A bf16 result is rounded in the store's expression, so a fused epilogue reads it rounded, as eager does.
    rounded = ir.Result() if buffer.dtype == "float32" else ir.Op("cast", (ir.Result(),), dtype=buffer.dtype)
    store = ir.Store(buffer, rounded, buffer.layout)
    compensated = result.dtype == torch.float32 and op in ("sum", "prod")
    ctx.emit(ir.Scan(ctx.fresh_name("kernel"), domain, dim % len(domain), op, prologue, (store,), compensated))
    return TensorValue(buffer.name, buffer.layout, buffer.dtype)


# ---------------------------------------------------------------- cummax / cummin

EXTREMUM_SCANS = {aten.cummax.default: "max", aten.cummin.default: "min"}


def _check_extremum_scan(node: torch.fx.Node) -> str | None:
    source = node.args[0].meta["val"]
    if source.dtype not in FLOAT_DTYPES:
        dtype = str(source.dtype).removeprefix("torch.")
        return f"{node.target}: {dtype} input (its integers are exact in fp32 only within +-2**24)"
    length = source.shape[node.args[1] % source.dim()] if source.dim() else 1
    if length > FP32_EXACT_INTEGER:  # positions are fp32 in the kernel: exact integers up to here
        return f"{node.target}: a scan of {length} elements (its indices are exact in fp32 only up to 2**24)"
    return None


# The int64 indices are computed exactly (positions below 2**24) and widened to int64 at the region's output.
INTEGER_OPS.update(EXTREMUM_SCANS)


@register_lowering(*EXTREMUM_SCANS, check=_check_extremum_scan, multi_output=True)
def lower_cumulative_extremum(ctx, node):
    """Two Scan kernels over the input: the running values, and the indices eager gives them."""
    source, dim = node.args[:2]
    op = EXTREMUM_SCANS[node.target]
    domain = ctx.value(source).layout.shape
    x = load(ctx, source, domain)
    outputs = []
    for meta, scan_op, result in zip(node.meta["val"], (op, f"{op}_index"), (x, ir.Scalar(0.0))):
        buffer = ctx.new_buffer(meta, f"cum{scan_op}")
        if not domain:  # a 0-d input: the value itself, at index 0
            ctx.emit(ir.Pointwise(ctx.fresh_name("kernel"), (), (ir.Store(buffer, result, buffer.layout),)))
        else:
            store = ir.Store(buffer, ir.Result(), buffer.layout)
            ctx.emit(ir.Scan(ctx.fresh_name("kernel"), domain, dim % len(domain), scan_op, x, (store,)))
        outputs.append(TensorValue(buffer.name, buffer.layout, buffer.dtype))
    return tuple(outputs)

"""Fusion stage, after grouping: matmuls that compute their left operand, a row norm, from its rows themselves.

Input: the fused kernels in launch order, the region's outputs, the decisions so far and the target's fit check
(passes/fusion.py calls it last). Output: the kernels with each row-norm kernel (an RMSNorm, weight included) whose
normed rows matmuls multiply folded into those matmuls (the rule: kinds/matmul_row_norm.py; the kernel:
kinds/normed_matmul.py). Where the matmuls after the first are narrow (``_narrow_after_first``), only the first
computes the rows from the norm's input, and stores them for the others: a Llama layer's input norm goes into its q
projection, whose kernel stores the normed rows its paired k / v projection multiplies. Recomputing them there (x
read twice, the normed rows never written) costs the narrow projection the norm's passes, transposes and weight
spread, longer than the rows' round trip (the goal point, est us: Gemma3's layer 417.3 -> 400.9, Llama's 370.7 ->
368.5, stop 37). Otherwise, or where the first would not fit with the rows' stores, every matmul recomputes them,
and they never cross HBM. The norm's outputs something else reads (a training
forward's saved statistics, or the normed rows where a kernel other than a matmul reads them) are stored by the
first of those matmuls too, which must then come before their other readers; otherwise, when no normed matmul fits
the target, or when the normed matmuls' planned rooflines are longer than the norm kernel's and the plain matmuls'
(passes/fold_traffic.py: b streamed past more row groups than the normed rows' round trip saves), the norm stays
its own kernel. Each decision, with its reason, joins the fusion decisions.
"""

from __future__ import annotations

import math

from neuron_compile import ir, kinds

PARTITIONS = 128  # a row block: the rows one recomputation of the norm serves


def fold_row_norms(kernels: list[ir.Node], region_outputs: set[str], decisions: list[str], fits=None,
                   weigh=None) -> list[ir.Node]:
    """``kernels`` with every row norm that matmuls may compute themselves folded into them (module docstring);
    ``weigh(replaced, merged)``: why the merged kernels cost more than the ones they replace, or None."""
    for norm in list(kernels):
        kernels = _fold(norm, kernels, region_outputs, decisions, fits, weigh)
    return kernels


def _takers(norm: ir.Node, readers: list[ir.Node], decisions: list[str], fits) -> list[ir.Node]:
    """The readers of ``norm`` that may compute its rows themselves, each asked of its kind."""
    takers = []
    for reader in readers:
        kind = kinds.kind_of(reader)
        reason = kind.row_operand_reason(norm, reader)
        if reason is None and fits is not None and not fits(kind.merge_row_operand(norm, reader, set())):
            reason = "the matmul computing the norm would not fit the target's SBUF"
        if reason is None:
            takers.append(reader)
        else:
            decisions.append(f"{norm.name} computed inside {reader.name}: {reason}")
    return takers


def _kept_reason(kept: set[str], first: ir.Node, merged: ir.Node, others: list[ir.Node], kernels: list[ir.Node],
                 fits) -> str | None:
    """None if ``first``, the first matmul taking the norm (``merged`` once it does), may store the norm's outputs
    ``kept`` for their other readers."""
    early = [other.name for other in others
             if kept & kinds.read_buffers(other) and kernels.index(other) < kernels.index(first)]
    if early:
        return f"{', '.join(early)} read {sorted(kept)} before {first.name}, the first matmul computing them"
    if fits is not None and not fits(merged):
        return f"{first.name} would not fit the target's SBUF with the norm's stores {sorted(kept)}"
    return None


def _fold(norm: ir.Node, kernels: list[ir.Node], region_outputs: set[str], decisions: list[str],
          fits, weigh) -> list[ir.Node]:
    if norm not in kernels:
        return kernels
    written = kinds.written_buffers(norm)
    readers = [kernel for kernel in kernels[kernels.index(norm) + 1:] if written & kinds.read_buffers(kernel)]
    # asked (and their answers recorded) only of the readers taking one of the outputs as an operand
    operand_readers = [reader for reader in readers
                       if written & {load.buffer for load in kinds.kind_of(reader).operand_loads(reader)}]
    takers = _takers(norm, operand_readers, decisions, fits)
    if not takers:
        return kernels
    # the first matmul computing the rows and storing them for the others (when they are narrow), else every one
    plans = ([takers[:1]] if _narrow_after_first(takers) else []) + [takers]
    for computing in plans:
        merged, reason = _merged(norm, computing, readers, kernels, region_outputs, fits, weigh)
        if reason is None:
            break
    for taker in takers:
        outcome = ("fused" if taker.name in merged else f"no, it multiplies the rows {takers[0].name} stores") \
            if reason is None else f"{norm.name} stays its own kernel: {reason}"
        decisions.append(f"{norm.name} computed inside {taker.name}: {outcome}")
    if reason is not None:
        return kernels
    return [merged.get(kernel.name, kernel) for kernel in kernels if kernel is not norm]


def _narrow_after_first(takers: list[ir.Node]) -> bool:
    """Whether the matmuls after the first are narrow: full row blocks, and their products have fewer columns in all
    than a row (Llama's k / v beside q at hidden 2048). Recomputing the rows costs each of them the norm's passes,
    transposes and weight spread per row block, which a wide product hides under its own TensorE work (Phi-3-mini's
    k / v of 3072 columns each: 866.6 us recomputed, 869.4 with the rows stored by q), and rows too few to fill a
    block do not repay (a decode step's one: 563.7 us recomputed, 565.0 stored)."""
    first, later = takers[0], takers[1:]
    rows = math.prod(first.domain[:-1])
    columns = sum(taker.domain[-1] * (1 if getattr(taker, "b2", None) is None else 2) for taker in later)
    return bool(later) and rows >= PARTITIONS and columns < first.k


def _merged(norm: ir.Node, computing: list[ir.Node], readers: list[ir.Node], kernels: list[ir.Node],
            region_outputs: set[str], fits, weigh) -> tuple[dict[str, ir.Node], str | None]:
    """The matmuls ``computing`` (by name) with the norm computed inside them, the first storing what the norm's
    other ``readers`` read, and None; or ({}, why they may not take it)."""
    others = [reader for reader in readers if reader not in computing]
    kept = {name for name in kinds.written_buffers(norm)
            if name in region_outputs or any(name in kinds.read_buffers(other) for other in others)}
    merged = {taker.name: kinds.kind_of(taker).merge_row_operand(norm, taker, kept if taker is computing[0] else set())
              for taker in computing}
    reason = _kept_reason(kept, computing[0], merged[computing[0].name], others, kernels, fits) if kept else None
    if reason is None and weigh is not None:
        reason = weigh([norm, *computing], list(merged.values()))
    return (merged, None) if reason is None else ({}, reason)

"""Fusion stage, after grouping: matmuls that compute their left operand, a row norm, from its rows themselves.

Input: the fused kernels in launch order, the region's outputs, the decisions so far and the target's fit check
(passes/fusion.py calls it last). Output: the kernels with each row-norm kernel (an RMSNorm, weight included) whose
normed rows matmuls multiply folded into those matmuls (the rule: kinds/matmul_row_norm.py; the kernel:
kinds/normed_matmul.py). Every matmul reading the rows recomputes them from the norm's input, so that they never
cross HBM: a Llama layer's input norm goes into its q projection and into its paired k / v projections, reading x
twice instead of writing and reading back the normed rows. The norm's outputs something else reads (a training
forward's saved statistics, or the normed rows where a kernel other than a matmul reads them) are stored by the
first of those matmuls, which must then come before their other readers; otherwise, when no normed matmul fits
the target, or when the normed matmuls' planned rooflines are longer than the norm kernel's and the plain matmuls'
(passes/fold_traffic.py: b streamed past more row groups than the normed rows' round trip saves), the norm stays
its own kernel. Each decision, with its reason, joins the fusion decisions.
"""

from __future__ import annotations

from neuron_compile import ir, kinds


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
    others = [reader for reader in readers if reader not in takers]
    kept = {name for name in written
            if name in region_outputs or any(name in kinds.read_buffers(other) for other in others)}
    merged = {taker.name: kinds.kind_of(taker).merge_row_operand(norm, taker, kept if taker is takers[0] else set())
              for taker in takers}
    reason = _kept_reason(kept, takers[0], merged[takers[0].name], others, kernels, fits) if kept else None
    if reason is None and weigh is not None:
        reason = weigh([norm, *takers], list(merged.values()))
    for taker in takers:
        outcome = "fused" if reason is None else f"{norm.name} stays its own kernel: {reason}"
        decisions.append(f"{norm.name} computed inside {taker.name}: {outcome}")
    if reason is not None:
        return kernels
    return [merged.get(kernel.name, kernel) for kernel in kernels if kernel is not norm]

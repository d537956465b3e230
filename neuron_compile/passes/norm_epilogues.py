"""Fusion stage, after grouping: row norms computed in the epilogue of the matmul whose output rows they read.

Input: the fused kernels in launch order (after ``fold_row_norms``, which puts a norm inside the matmuls that
multiply its rows when it can), the region's outputs, the decisions so far and the target's fit check
(passes/fusion.py calls it last). Output: the kernels with each row norm left on its own whose rows the latest
matmul before it writes in a matmul epilogue folded into that matmul (the rule: kinds/norm_epilogue_rule.py; the
kernel: kinds/matmul_norm_epilogue.py): a 1-layer decoder's final RMSNorm of ``h + down(...)`` runs on the rows
the down projection keeps on chip, instead of a kernel that waits for them to reach HBM and loads them back, and
Gemma's post-norms (with the residual add in their row epilogue) on the o and down projections' rows. The merged
kernel takes the matmul's place, so everything else the norm reads must be written before it: the kernels between
them that write it (Gemma's ``1 + w``) move before the matmul when they do not depend on it. The rows still go to
HBM when another kernel reads them or the region returns them. The fold is refused where the merged kernel's planned
roofline is longer than the two kernels' apart (passes/fold_traffic.py: the kept rows and the norm's tiles leave
room for fewer rows of a^T, and b's extra passes outlast the rows' round trip saved). Each decision,
with its reason, joins the fusion decisions.
"""

from __future__ import annotations

from neuron_compile import ir, kinds


def fold_norm_epilogues(kernels: list[ir.Node], region_outputs: set[str], decisions: list[str],
                        fits=None, weigh=None) -> list[ir.Node]:
    """``kernels`` with every norm that may run in its producer matmul's epilogue folded into it (module
    docstring); ``weigh(replaced, merged)``: why the merged kernel costs more than the two it replaces, or None."""
    for norm in list(kernels):
        kernels = _fold(norm, kernels, region_outputs, decisions, fits, weigh)
    return kernels


def _producer(norm: ir.Node, kernels: list[ir.Node]) -> ir.Node | None:
    """The latest kernel before ``norm`` writing something it reads that may take a norm epilogue."""
    before = kernels[:kernels.index(norm)]
    return next((kernel for kernel in reversed(before)
                 if kinds.written_buffers(kernel) & kinds.read_buffers(norm)
                 and kinds.kind_of(kernel).takes_norm_epilogue), None)


def _hoisted(norm: ir.Node, producer: ir.Node, kernels: list[ir.Node]) -> tuple[list[ir.Node], str | None]:
    """(``kernels`` with those between ``producer`` and ``norm`` that write what ``norm`` reads, and the kernels
    between that they read, moved right before ``producer``, which the merged kernel replaces; the reason they
    may not move: one of them reads what ``producer`` writes, or ``producer`` what one of them writes). Gemma's
    weights as ``1 + w`` are kernels of their own, launched anywhere before their norm."""
    first, last = kernels.index(producer), kernels.index(norm)
    between = kernels[first + 1:last]
    moved: list[ir.Node] = []
    wanted = kinds.read_buffers(norm)
    for kernel in reversed(between):  # each writer of a wanted buffer, then what it reads, latest first
        if kinds.written_buffers(kernel) & wanted:
            moved.insert(0, kernel)
            wanted |= kinds.read_buffers(kernel)
    late = sorted({name for kernel in moved for name in kinds.read_buffers(kernel) & kinds.written_buffers(producer)}
                  | {name for kernel in moved for name in kinds.written_buffers(kernel) & kinds.read_buffers(producer)})
    if late:
        return kernels, f"{norm.name} reads what is computed from {producer.name}'s {', '.join(late)}"
    rest = [kernel for kernel in between if kernel not in moved]
    return kernels[:first] + moved + [producer] + rest + kernels[last:], None


def _fold(norm: ir.Node, kernels: list[ir.Node], region_outputs: set[str], decisions: list[str],
          fits, weigh) -> list[ir.Node]:
    producer = _producer(norm, kernels)
    if producer is None:
        return kernels
    kind = kinds.kind_of(producer)
    hoisted, reason = kernels, kind.norm_epilogue_reason(producer, norm)
    if reason is None:
        hoisted, reason = _hoisted(norm, producer, kernels)
    merged = None
    if reason is None:
        rows = kinds.written_buffers(producer) & kinds.read_buffers(norm)
        others = [kernel for kernel in kernels if kernel is not producer and kernel is not norm]
        store_rows = bool(rows & region_outputs) or any(rows & kinds.read_buffers(other) for other in others)
        merged = kind.merge_norm_epilogue(producer, norm, store_rows)
        if fits is not None and not fits(merged):
            reason = "the matmul norming its rows would not fit the target's SBUF"
        elif weigh is not None:
            reason = weigh([producer, norm], [merged])
    decisions.append(f"{norm.name} in {producer.name}'s epilogue: " + ("fused" if reason is None else reason))
    if reason is not None:
        return kernels
    return [merged if kernel is producer else kernel for kernel in hoisted if kernel is not norm]

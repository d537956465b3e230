"""Fusion stage, after grouping: rotary embeddings computed in the epilogue of the q / k projection whose heads
they rotate.

Input: the fused kernels in launch order (after ``fold_norm_epilogues``), the region's outputs, the decisions so
far and the target's fit check (passes/fusion.py calls it). Output: the kernels with each rotary concat
(``x * cos + rotate_half(x) * sin``, a kernel of its own since a concat takes no matmul prologue) folded into the
latest matmul before it that writes what it rotates, when the rule allows (kinds/rotary_epilogue_rule.py; the
kernel: kinds/matmul_rotary.py): q and k are then rotated on the projection's output tiles instead of stored and
loaded back. A per-head norm between them (Qwen3's and Gemma3's q / k RMSNorm over head_dim) goes into the same
epilogue when the rule allows it too, and nothing else reads the normed heads. The merged kernel takes the concat's
place (cos and sin are written before it), so no kernel between the two (but the norm) may read what the projection
writes; the projection's output still goes to HBM when another kernel reads it or the region returns it. Each
decision, with its reason, joins the fusion decisions.
"""

from __future__ import annotations

from neuron_compile import ir, kinds


def fold_rotary_epilogues(kernels: list[ir.Node], region_outputs: set[str], decisions: list[str],
                          fits=None) -> list[ir.Node]:
    """``kernels`` with every rotary that may run in its projection's epilogue folded into it (module docstring)."""
    for rotary in list(kernels):
        kernels = _fold(rotary, kernels, region_outputs, decisions, fits)
    return kernels


def _latest_projection(reader: ir.Node, kernels: list[ir.Node]) -> ir.Node | None:
    """The latest kernel before ``reader`` that writes something it reads and takes rotary epilogues."""
    before = kernels[:kernels.index(reader)]
    return next((kernel for kernel in reversed(before) if kinds.written_buffers(kernel) & kinds.read_buffers(reader)
                 and kinds.kind_of(kernel).takes_rotary_epilogue), None)


def _projection(rotary: ir.Node, kernels: list[ir.Node]) -> tuple[ir.Node | None, ir.Node | None]:
    """(the projection whose output ``rotary`` rotates, the kernel between them norming each head or None): the
    latest kernel before it taking rotary epilogues that writes what it reads, else the latest that writes what a
    writer of its reads reads (Qwen3's q norm between q's projection and its rotary)."""
    projection = _latest_projection(rotary, kernels)
    if projection is not None:
        return projection, None
    before = kernels[:kernels.index(rotary)]
    for norm in reversed(before):
        if kinds.written_buffers(norm) & kinds.read_buffers(rotary) and not kinds.kind_of(norm).takes_rotary_epilogue:
            projection = _latest_projection(norm, kernels)
            if projection is not None:
                return projection, norm
    return None, None


def _placement_reason(rotary: ir.Node, projection: ir.Node, norm: ir.Node | None, kernels: list[ir.Node],
                      region_outputs: set[str]) -> str | None:
    """None if no kernel between ``projection`` and ``rotary`` (but ``norm``) reads what the projection writes (the
    merged kernel takes the rotary's place), and nothing but the rotary reads the normed heads."""
    between = [kernel for kernel in kernels[kernels.index(projection) + 1:kernels.index(rotary)] if kernel is not norm]
    early = [kernel.name for kernel in between if kinds.written_buffers(projection) & kinds.read_buffers(kernel)]
    if early:
        return f"{', '.join(early)} read {projection.name}'s outputs before {rotary.name}"
    if norm is None:
        return None
    normed = kinds.written_buffers(norm)
    elsewhere = [kernel.name for kernel in kernels if kernel is not rotary and normed & kinds.read_buffers(kernel)]
    if elsewhere or normed & region_outputs:
        return f"{norm.name}'s normed heads are read outside {rotary.name}"
    return None


def _fold(rotary: ir.Node, kernels: list[ir.Node], region_outputs: set[str], decisions: list[str],
          fits) -> list[ir.Node]:
    projection, norm = _projection(rotary, kernels)
    if projection is None:
        return kernels
    kind = kinds.kind_of(projection)
    reason = kind.rotary_epilogue_reason(projection, rotary, norm) or _placement_reason(
        rotary, projection, norm, kernels, region_outputs)
    merged = None
    if reason is None:
        rotated = kinds.written_buffers(projection) & kinds.read_buffers(norm or rotary)
        others = [kernel for kernel in kernels if all(kernel is not taken for taken in (projection, norm, rotary))]
        store_source = bool(rotated & region_outputs) or any(rotated & kinds.read_buffers(other) for other in others)
        merged = kind.merge_rotary_epilogue(projection, rotary, store_source, norm)
        if fits is not None and not fits(merged):
            reason = "the projection rotating its heads would not fit the target's SBUF"
    through = "" if norm is None else f" through {norm.name}"
    decisions.append(f"{rotary.name} in {projection.name}'s epilogue{through} (a rotary): "
                     + ("fused" if reason is None else reason))
    if reason is not None:
        return kernels
    return [merged if kernel is rotary else kernel for kernel in kernels
            if kernel is not projection and kernel is not norm]

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
writes, or else the projection's place, when cos and sin are written before that (a paired projection's q and k:
each one's norm reads the projection before the other's rotary; the second rotary then joins the first in the
merged kernel), or else just before the first kernel reading what the projection writes, the kernels writing cos and
sin after that one moved ahead of it when they depend on none they pass (q's projection storing the input norm's rows
that k's reads, passes/row_norm_operands.py); the projection's output still goes to HBM when another kernel reads it
or the region returns it. A rotary of joint rows that several kernels store in place (Flux's
``cat([text_q, image_q], 1)``, after ``assemble_in_place``) is split into one slice per writer (passes/rotary_rows.py),
kept only when every slice folds into its projection; its output then has a writer per slice. Each decision, with
its reason, joins the fusion decisions.
"""

from __future__ import annotations

from neuron_compile import ir, kinds
from neuron_compile.passes.rotary_rows import joint_row_slices


def fold_rotary_epilogues(kernels: list[ir.Node], region_outputs: set[str], decisions: list[str], fits=None,
                          assembled: frozenset = frozenset()) -> tuple[list[ir.Node], frozenset]:
    """``kernels`` with every rotary that may run in its projection's epilogue folded into it (module docstring),
    and ``assembled`` with the outputs of rotaries split by their joint rows (several kernels write them now)."""
    for rotary in list(kernels):
        slices, why_not = joint_row_slices(rotary, kernels, assembled)
        if why_not is not None:
            decisions.append(f"{rotary.name} split by its joint rows: no, {why_not}")
        folded = None if slices is None else _fold_slices(rotary, slices, kernels, region_outputs, decisions, fits)
        if folded is not None:
            kernels, assembled = folded, assembled | kinds.written_buffers(rotary)
        else:
            kernels = _fold(rotary, kernels, region_outputs, decisions, fits)
    return kernels, assembled


def _fold_slices(rotary: ir.Node, slices: list[ir.Node], kernels: list[ir.Node], region_outputs: set[str],
                 decisions: list[str], fits) -> list[ir.Node] | None:
    """``kernels`` with ``rotary`` replaced by its row slices (passes/rotary_rows.py), each folded into the
    projection behind the kernel writing its rows; None (and the decisions say why) unless every slice folds."""
    at = kernels.index(rotary)
    trial, notes = kernels[:at] + slices + kernels[at + 1:], []
    for piece in slices:
        trial = _fold(piece, trial, region_outputs, notes, fits)
    folded = not any(kernel is piece for kernel in trial for piece in slices)
    decisions.append(f"{rotary.name} split by its joint rows into {', '.join(piece.name for piece in slices)}: "
                     + ("yes" if folded else "no, a slice stays a kernel of its own"))
    decisions.extend(notes)
    return trial if folded else None


def _overlaps(writer: ir.Node, reader: ir.Node) -> bool:
    """Whether ``writer`` may store elements ``reader`` loads (of a buffer several kernels write in row slices, only
    the writer of the rows read counts)."""
    extents: dict[str, list[tuple[int, int]]] = {}
    for store in kinds.stores(writer):
        extents.setdefault(store.buffer.name, []).append(store.layout.extent())
    return any(first < end and start < last for load in kinds.loads(reader)
               for start, end in [load.layout.extent()] for first, last in extents.get(load.buffer, ()))


def _products(kernel: ir.Node) -> set[str]:
    """What ``kernel`` writes that a rotary may rotate: a projection already rotating one product (q's of a paired
    q / k projection) offers only its others."""
    return kinds.written_buffers(kernel.matmul if isinstance(kernel, ir.MatMulRotary) else kernel)


def _latest_projection(reader: ir.Node, kernels: list[ir.Node]) -> ir.Node | None:
    """The latest kernel before ``reader`` that writes a product it reads and takes rotary epilogues."""
    before = kernels[:kernels.index(reader)]
    return next((kernel for kernel in reversed(before) if kinds.kind_of(kernel).takes_rotary_epilogue
                 and _products(kernel) & kinds.read_buffers(reader) and _overlaps(kernel, reader)), None)


def _projection(rotary: ir.Node, kernels: list[ir.Node]) -> tuple[ir.Node | None, ir.Node | None]:
    """(the projection whose output ``rotary`` rotates, the kernel between them norming each head or None): the
    latest kernel before it taking rotary epilogues that writes what it reads, else the latest that writes what a
    writer of its reads reads (Qwen3's q norm between q's projection and its rotary)."""
    projection = _latest_projection(rotary, kernels)
    if projection is not None:
        return projection, None
    before = kernels[:kernels.index(rotary)]
    for norm in reversed(before):
        if _overlaps(norm, rotary) and not kinds.kind_of(norm).takes_rotary_epilogue:
            projection = _latest_projection(norm, kernels)
            if projection is not None:
                return projection, norm
    return None, None


def _normed_reason(rotary: ir.Node, norm: ir.Node | None, kernels: list[ir.Node],
                   region_outputs: set[str]) -> str | None:
    """None if nothing but the rotary reads the normed heads (or there is no norm)."""
    if norm is None:
        return None
    normed = kinds.written_buffers(norm)
    elsewhere = [kernel.name for kernel in kernels if kernel is not rotary and _overlaps(norm, kernel)]
    if elsewhere or normed & region_outputs:
        return f"{norm.name}'s normed heads are read outside {rotary.name}"
    return None


def _place(rotary: ir.Node, projection: ir.Node, norm: ir.Node | None,
           kernels: list[ir.Node]) -> tuple[ir.Node | None, tuple[ir.Node, ...], str | None]:
    """(the kernel the merged kernel goes before, the kernels moved ahead of it, None) or (None, (), the reason there
    is none). The rotary's place, when no kernel between the projection and it (but the norm) reads what the
    projection writes; else the projection's, when every other input of the rotary and the norm (cos and sin) is
    written before it: a paired projection's q and k are normed and rotated by kernels reading each other's
    product; else just before the first kernel reading what the projection writes, the kernels writing cos and sin
    after it moved ahead when they depend on none of the kernels they pass (q's projection storing the normed rows
    k's reads, cos and sin computed after k's)."""
    between = [kernel for kernel in kernels[kernels.index(projection) + 1:kernels.index(rotary)] if kernel is not norm]
    early = [kernel for kernel in between if kinds.written_buffers(projection) & kinds.read_buffers(kernel)]
    if not early:
        return rotary, (), None
    inputs = (kinds.read_buffers(rotary) | (kinds.read_buffers(norm) if norm is not None else set())) - \
        kinds.written_buffers(projection) - (kinds.written_buffers(norm) if norm is not None else set())
    writers = [kernel for kernel in between if inputs & kinds.written_buffers(kernel)]
    if not writers:
        return projection, (), None
    first = between.index(early[0])
    late = tuple(writer for writer in writers if between.index(writer) > first)
    if all(_passes(writer, between[first:between.index(writer)]) for writer in late):
        return early[0], late, None
    readers = ", ".join(kernel.name for kernel in early)
    return None, (), f"{readers} read {projection.name}'s outputs before {rotary.name}"


def _passes(kernel: ir.Node, passed: list[ir.Node]) -> bool:
    """Whether ``kernel`` may run before the kernels ``passed``: none of them writes what it reads or writes, nor
    reads what it writes."""
    reads, writes = kinds.read_buffers(kernel), kinds.written_buffers(kernel)
    return not any(kinds.written_buffers(other) & (reads | writes) or kinds.read_buffers(other) & writes
                   for other in passed)


def _fold(rotary: ir.Node, kernels: list[ir.Node], region_outputs: set[str], decisions: list[str],
          fits) -> list[ir.Node]:
    projection, norm = _projection(rotary, kernels)
    if projection is None:
        return kernels
    kind = kinds.kind_of(projection)
    reason = kind.rotary_epilogue_reason(projection, rotary, norm) or _normed_reason(
        rotary, norm, kernels, region_outputs)
    place, hoisted, merged = None, (), None
    if reason is None:
        place, hoisted, reason = _place(rotary, projection, norm, kernels)
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
    taken = (projection, norm, rotary, *hoisted)
    return [each for kernel in kernels for each in ((*hoisted, merged) if kernel is place else ()) + (
        () if any(kernel is node for node in taken) else (kernel,))]

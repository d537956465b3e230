"""Kernel kinds: the fusion rule that gives a matmul a rotary epilogue (``ir.MatMul`` / ``ir.NormedMatMul`` ->
``ir.MatMulRotary``).

Input: a whole matmul kernel (a q or k projection, or a ``MatMulRotary`` already rotating the other product of a
paired q / k projection) and a whole concat kernel after it that reads one of its stores (the rotary embedding
``x * cos + rotate(x) * sin``: rotate_half = cat(-x2, x1) over each head's halves, or an interleaved rotary's
stack(-x[2i+1], x[2i]) over each head's pairs, Flux's). Output: a reason they may not fuse, or the matmul computing
the rotary on its output tiles (kinds/matmul_rotary.py plans and renders it; passes/rotary_epilogues.py drives it).

The rule: the matmul is plain or normed (no implicit GEMM), the concat is not assembled in place and reads exactly
one of the matmul's stores (``source``); every part reads ``source`` along the matmul's rows, its heads
(``head_dim`` columns apart) and the columns within one head (every one, or every second: ``HeadAxes.step``), from a
column offset that keeps the read inside the head, so that an N tile of whole heads holds everything a part reads;
every other load of a part is the same for every head (cos and sin, per position and column within the head); no
part computes an index or draws random numbers; and ``head_dim`` divides N and is at most the widest N tile (512
columns): the matmul's planner then takes N tiles of whole heads (kinds/matmul_rotary.py), Gemma3's heads of 256
two to a 512-column tile, Phi-3's heads of 96 five to a 480-column one; a plan of whole heads that does not fit
beside the rotary's tiles is refused by the target's fit check. With a per-head norm between them
(``head_norm_reason``), the norm must be a mean of squares over each head of ``source``, store no statistics, and N
a whole number of N tiles of whole heads (its heads lie several to a partition, as many per tile); the rotary then
reads the normed heads as it would read ``source``.
"""

from __future__ import annotations

import dataclasses
import math

from neuron_compile import ir
from neuron_compile.kind_registry import kind_of, loads
from neuron_compile.kinds.matmul_row_norm import NORM_OPS

# The N tiles a resident matmul takes (kinds/matmul.py ``moving_tile_widths``), narrowed to whole heads
N_TILES = (128, 256, 512)


def whole_heads_tile(head_dim: int) -> int:
    """The widest N tile of whole heads of ``head_dim`` columns (480 of heads of 96)."""
    return max(N_TILES) // head_dim * head_dim


@dataclasses.dataclass(frozen=True)
class HeadAxes:
    """Where a rotary part's dims lie in the matmul's output: the part dim along the rows (M), along the heads,
    along the columns within a head (None: the matmul has one of them), and (part dim, matmul batch dim) pairs;
    ``column`` is the first column within the head a read of ``source`` starts at. ``outer_rows``: the part dims
    that M also spans, outermost first (a linear flattens batch and sequence into M: the part's batch dim walks
    whole sequences of rows), each one the next one's stride times its size in every layout the part uses.
    ``step``: the columns one index of ``within`` advances (1; 2 for an interleaved rotary's pairs: Flux's, GPT-J's)."""

    rows: int | None
    heads: int | None
    within: int | None
    batch: tuple[tuple[int, int], ...]
    column: int = 0
    outer_rows: tuple[int, ...] = ()
    step: int = 1


def rows_dims(shape: tuple[int, ...], strides: tuple[int, ...], dims: list[int], row_stride: int,
              m: int) -> tuple[int, ...] | None:
    """``dims`` (of a read through ``shape`` and ``strides``) ordered as they split the matmul's M rows, outermost
    first, when their strides chain from ``row_stride`` and their sizes multiply to ``m``; None otherwise."""
    ordered = sorted(dims, key=lambda dim: strides[dim])
    step = row_stride
    for dim in ordered:
        if strides[dim] != step:
            return None
        step *= shape[dim]
    return tuple(reversed(ordered)) if math.prod(shape[dim] for dim in dims) == m else None


def rows_merge(layout: ir.Layout, axes: HeadAxes) -> bool:
    """Whether ``layout`` walks the part's row dims as one (each outer one's stride the next one's times its size),
    so that a tile's partitions from ``p0`` on are equally spaced in it."""
    dims = (*axes.outer_rows, axes.rows) if axes.rows is not None else ()
    return all(layout.strides[outer] == layout.strides[inner] * layout.shape[inner]
               for outer, inner in zip(dims, dims[1:]))


def head_dim_of(matmul_domain: tuple[int, ...], source: ir.Store, load: ir.Load,
                shared: tuple[ir.Load, ...] = ()) -> int:
    """The head width ``load`` (of ``source``'s buffer) implies: the column step of its dim that walks whole
    heads across N, or all of N (one head). ``shared``: the part's other loads (cos and sin), the same for every
    head: a dim they walk walks columns within a head (an interleaved rotary's pairs of one head of N columns)."""
    n, column_stride = matmul_domain[-1], source.layout.strides[-1]
    for dim, (size, stride) in enumerate(zip(load.layout.shape, load.layout.strides)):
        if size > 1 and column_stride and stride % column_stride == 0 and stride // column_stride > 1 \
                and (stride // column_stride) * size == n and not any(other.layout.strides[dim] for other in shared):
            return stride // column_stride
    return n


def head_axes(matmul_domain: tuple[int, ...], source: ir.Store, load: ir.Load, head_dim: int) -> HeadAxes | None:
    """The axes of ``load``'s dims in the matmul's output (``HeadAxes``), or None when a dim walks anything else
    or the read leaves its head."""
    *batch, m, n = matmul_domain
    strides = source.layout.strides
    roles: dict[str, int] = {}
    row_candidates = []
    for dim, (size, stride) in enumerate(zip(load.layout.shape, load.layout.strides)):
        if size == 1:
            continue
        role = next((name for name, want, extent in (
            ("heads", strides[-1] * head_dim, n // head_dim),
            *((f"batch{i}", strides[i], batch[i]) for i in range(len(batch))))
            if name not in roles and stride == want and size == extent), None)
        if role is None and "within" not in roles and within_step(stride, size, strides[-1], head_dim):
            role = "within"
        if role is not None:
            roles[role] = dim
        elif strides[-2] and stride % strides[-2] == 0 and stride > 0:
            row_candidates.append(dim)
        else:
            return None
    rows = rows_dims(load.layout.shape, load.layout.strides, row_candidates, strides[-2], m) if row_candidates else ()
    if rows is None:
        return None
    if rows:
        roles["rows"] = rows[-1]
    delta = load.layout.offset - source.layout.offset
    within = roles.get("within")
    width, step = (1, 1) if within is None else (load.layout.shape[within], load.layout.strides[within] // strides[-1])
    if strides[-1] == 0 or delta % strides[-1] or not 0 <= delta // strides[-1] <= head_dim - 1 - step * (width - 1):
        return None
    covered = {"heads": n // head_dim, "rows": m, **{f"batch{i}": size for i, size in enumerate(batch)}}
    if any(extent > 1 and name not in roles for name, extent in covered.items()):
        return None  # a part covers every row, head and batch index: each N tile computes its heads' share
    return HeadAxes(roles.get("rows"), roles.get("heads"), roles.get("within"),
                    tuple((dim, int(name[5:])) for name, dim in roles.items() if name.startswith("batch")),
                    column=delta // strides[-1], outer_rows=rows[:-1], step=step)


def within_step(stride: int, size: int, column_stride: int, head_dim: int) -> bool:
    """Whether a dim of ``size`` indices ``stride`` elements apart walks columns within one head: a step of 1 column
    (rotate_half's halves), or of a few (the pairs of an interleaved rotary, every second column)."""
    if column_stride <= 0 or stride <= 0 or stride % column_stride:
        return False
    step = stride // column_stride
    return step == 1 or (step * (size - 1) < head_dim and step * size <= head_dim)


def source_store(matmul, rotary: ir.Concat) -> ir.Store | None:
    """The one store of ``matmul`` the rotary reads, or None."""
    read = {load.buffer for load in loads(rotary)}
    written = [store for store in kind_of(matmul).stores(matmul) if store.buffer.name in read]
    return written[0] if len(written) == 1 else None


def _part_reason(part: ir.Pointwise, domain: tuple[int, ...], rotated: ir.Store, written: set[str], owner: str,
                 head_dim: int) -> str | None:
    axes = set()
    for load in loads(part):
        if load.buffer == rotated.buffer.name:
            found = head_axes(domain, rotated, load, head_dim)
            if found is None:
                return (f"{part.name} reads {load.buffer} through {load.layout}, which is not the rows, heads of "
                        f"{head_dim} and columns within one head of {owner}'s output")
            axes.add(dataclasses.replace(found, column=0))
        elif load.buffer in written:
            return f"{part.name} reads {load.buffer}, another output of {owner}"
    if len(axes) != 1:
        return f"{part.name} reads {rotated.buffer.name} along different axes (or not at all)"
    found = next(iter(axes))
    for load in loads(part):
        if load.buffer != rotated.buffer.name and found.heads is not None and load.layout.strides[found.heads] != 0:
            return f"{part.name} reads {load.buffer} differently for each head (a rotary's cos and sin are not)"
    if not all(rows_merge(layout, found) for layout in [load.layout for load in loads(part)]
               + [store.layout for store in part.stores]):
        return f"{part.name}'s layouts do not walk its rows as {owner}'s rows (a batch of sequences) are walked"
    for store in part.stores:  # an iota's layout is an access layout that no load reads through
        iotas = set(ir.access_layouts(store.expr)) - {load.layout for load in ir.loads_of(store.expr)}
        if iotas or ir.draws_random(store.expr):
            return f"{part.name} computes an index (iota) or draws random numbers, which follow its own domain"
    return None


def rotated_head_dim(domain: tuple[int, ...], rotated: ir.Store, rotary: ir.Concat) -> int:
    """The head width the rotary's first read of ``rotated`` implies."""
    part, first = next((part, load) for part in rotary.parts for load in loads(part)
                       if load.buffer == rotated.buffer.name)
    shared = tuple(load for load in loads(part) if load.buffer != rotated.buffer.name)
    return head_dim_of(domain, rotated, first, shared)


def norm_axes(domain: tuple[int, ...], source: ir.Store, norm: ir.Reduction) -> HeadAxes | None:
    """Where a per-head norm's dims lie in the product (``HeadAxes``, the same for each of its reads of ``source``),
    its reduced last dim a whole head's columns; None otherwise. Qwen3 norms [batch, seq, heads, head_dim], Gemma3
    the transposed [batch, heads, seq, head_dim]."""
    reads = {load for expr in kind_of(norm).exprs(norm) for load in ir.loads_of(expr)
             if load.buffer == source.buffer.name}
    found = {head_axes(domain, source, load, norm.domain[-1]) for load in reads}
    axes = found.pop() if len(found) == 1 else None
    if axes is None or axes.column != 0 or axes.step != 1 or (
            norm.domain[-1] > 1 and axes.within != len(norm.domain) - 1):
        return None
    return axes


def normed_heads(domain: tuple[int, ...], source: ir.Store, norm: ir.Reduction) -> ir.Store | None:
    """The per-head norm's one row store (the normed heads) restated over the matmul's [*batch, M, N], or None when
    its heads are not laid out one after the other."""
    axes = norm_axes(domain, source, norm)
    if axes is None or len(norm.row_stores) != 1:
        return None
    store = norm.row_stores[0]

    def stride(dim: int | None) -> int:
        return 0 if dim is None else store.layout.strides[dim]

    if axes.heads is not None and stride(axes.heads) != stride(axes.within) * norm.domain[-1]:
        return None
    batch = {matmul_dim: dim for dim, matmul_dim in axes.batch}
    strides = (*(stride(batch.get(i)) for i in range(len(domain) - 2)), stride(axes.rows), stride(axes.within))
    return dataclasses.replace(store, layout=ir.Layout(tuple(domain), strides, store.layout.offset))


def head_norm_reason(matmul, source: ir.Store, norm) -> str | None:
    """None if ``norm`` is an RMSNorm over each head of ``source`` (Qwen3's and Gemma3's q / k norms) whose normed
    heads only the rotary reads: the rotary's epilogue computes it first, on the tile's heads."""
    if not isinstance(norm, ir.Reduction):
        return f"{norm.name} is a {type(norm).__name__}, not a per-head norm"
    n = matmul.domain[-1]
    if norm.op not in NORM_OPS or not ir.is_square(norm.prologue):
        return f"{norm.name} is a {norm.op} of other values than squares, not an RMSNorm's"
    if norm.reduce_dims != (len(norm.domain) - 1,) or n % norm.domain[-1] or norm_axes(
            matmul.domain, source, norm) is None:
        return (f"{norm.name} (domain {list(norm.domain)} over {list(norm.reduce_dims)}) is not a norm of each "
                f"head of {source.buffer.name}")
    axes = norm_axes(matmul.domain, source, norm)
    layouts = [load.layout for expr in kind_of(norm).exprs(norm) for load in ir.loads_of(expr)]
    if not all(rows_merge(layout, axes) for layout in layouts + [store.layout for store in norm.row_stores]):
        return f"{norm.name}'s layouts do not walk its rows as {matmul.name}'s rows are walked"
    if norm.stores or normed_heads(matmul.domain, source, norm) is None:
        return f"{norm.name} stores its statistics, or its normed heads are not laid out as the product"
    widest = whole_heads_tile(norm.domain[-1])
    if n > widest and n % widest:
        return f"{norm.name}'s heads: N={n} is not a whole number of {widest}-column tiles (of whole heads)"
    if any(ir.draws_random(expr) for expr in kind_of(norm).exprs(norm)):
        return f"{norm.name} draws random numbers"
    return None


def rotary_epilogue_reason(matmul, rotary, norm=None) -> str | None:
    """None if the concat ``rotary``, a later kernel, may run in ``matmul``'s epilogue on its output tiles (after
    ``norm``, a per-head norm between them, when given)."""
    if not isinstance(rotary, ir.Concat):
        return f"a matmul's rotary epilogue is a concat, not a {type(rotary).__name__}"
    if isinstance(matmul, ir.MatMulRotary):  # a second product of a paired projection, its first one rotated
        rotated = {store.buffer.name for store in kind_of(matmul).stores(matmul)} - {
            store.buffer.name for store in matmul.matmul.stores}
        if rotated & {load.buffer for load in loads(rotary if norm is None else norm)}:
            return f"{(rotary if norm is None else norm).name} reads what {matmul.name}'s other rotary computes"
        matmul = matmul.matmul
    if getattr(matmul, "shifts", ()):
        return f"{matmul.name} is an implicit GEMM"
    if rotary.in_place:
        return f"{rotary.name} is assembled in place"
    source = source_store(matmul, rotary if norm is None else norm)
    if source is None or source not in matmul.stores:
        return f"{(rotary if norm is None else norm).name} does not read exactly one of {matmul.name}'s product stores"
    written = {store.buffer.name for store in kind_of(matmul).stores(matmul)}
    rotated = source
    if norm is not None:
        reason = head_norm_reason(matmul, source, norm)
        if reason is not None:
            return reason
        rotated = normed_heads(matmul.domain, source, norm)
        written |= {store.buffer.name for store in kind_of(norm).stores(norm)}
    head_dim = rotated_head_dim(matmul.domain, rotated, rotary)
    n = matmul.domain[-1]
    if head_dim > max(N_TILES):
        return (f"no N tile of at most {max(N_TILES)} columns holds a whole head of {head_dim} (the epilogue rotates "
                f"whole heads)")
    if n % head_dim:
        return f"head_dim {head_dim} does not divide {matmul.name}'s N={n}, so a tile would cut a head"
    if norm is not None and head_dim != norm.domain[-1]:
        return f"{rotary.name}'s heads of {head_dim} are not {norm.name}'s of {norm.domain[-1]}"
    for part in rotary.parts:
        reason = _part_reason(part, matmul.domain, rotated, written - {rotated.buffer.name}, matmul.name, head_dim)
        if reason is not None:
            return reason
    return None


def merge_rotary_epilogue(matmul, rotary: ir.Concat, store_source: bool, norm=None) -> ir.MatMulRotary:
    """``matmul`` computing ``rotary`` (after ``norm``) on its tiles, after the rotaries it computes already (a
    ``MatMulRotary``: the other product of a paired projection); ``store_source``: the product still goes to HBM."""
    earlier = matmul.rotaries if isinstance(matmul, ir.MatMulRotary) else ()
    matmul = matmul.matmul if isinstance(matmul, ir.MatMulRotary) else matmul
    source = source_store(matmul, rotary if norm is None else norm)
    rotated = source if norm is None else normed_heads(matmul.domain, source, norm)
    others = tuple(store for store in matmul.stores if store.buffer.name != source.buffer.name)
    entry = ir.HeadRotary(source, store_source, rotary, rotated_head_dim(matmul.domain, rotated, rotary), norm)
    return ir.MatMulRotary(matmul.name, dataclasses.replace(matmul, stores=others), (*earlier, entry))

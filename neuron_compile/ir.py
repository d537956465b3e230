"""Kernel IR: the data the lowering stage produces and fusion, tiling and codegen consume.

Input: nothing (definitions). Output: frozen, hashable, printable dataclasses.

* ``Layout`` is an access pattern into one flat HBM buffer: ``flat[offset + sum(index_d * stride_d)]``; a
  broadcast dim has stride 0. ``Layout.index_expr()`` states it as a sympy expression.
* Expression trees (``Load``, ``Scalar``, ``Op``, ``Result``, ``Iota``, ``RandomKeep``) describe per-element math
  over a node's iteration domain; they are data, not closures, so they print and hash.
* IR nodes (``Pointwise``, ``Reduction``, ``RowNormalize``, ``Scan``, ``MatMul``, ``Attention``,
  ``AttentionBackward``, ``Concat``, ``Gather``, ``Scatter``, ``Collective``)
  each write one or more ``Store``s; what a node reads, how it fuses, tiles and renders is its kernel kind's
  (neuron_compile/kinds/).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

import sympy

from neuron_compile import op_table

# Bytes per element of the IR's dtype names (fusion, tiling and codegen size their tiles and DMAs by them).
ITEMSIZE = {"float32": 4, "int32": 4, "bfloat16": 2, "float16": 2, "bool": 1}


@dataclass(frozen=True)
class Layout:
    """Sizes, strides and offset (in elements) of a view onto a flat buffer."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int = 0

    def index_expr(self) -> sympy.Expr:
        """The flat element index as a sympy expression in the iteration indices i0, i1, ..."""
        indices = sympy.symbols(f"i0:{len(self.shape)}", integer=True, nonnegative=True)
        return sympy.Integer(self.offset) + sum((i * s for i, s in zip(indices, self.strides)), sympy.Integer(0))

    def span(self) -> int:
        """Elements of the flat buffer this layout can touch (highest index + 1)."""
        if any(size == 0 for size in self.shape):
            return self.offset
        return self.offset + 1 + sum((size - 1) * abs(stride) for size, stride in zip(self.shape, self.strides))

    def extent(self) -> tuple[int, int]:
        """The first and one past the last element this layout may touch (negative strides too)."""
        reach = [(size - 1) * stride for size, stride in zip(self.shape, self.strides) if size > 0]
        return (self.offset + sum(min(0, step) for step in reach),
                self.offset + sum(max(0, step) for step in reach) + 1)

    def __str__(self) -> str:
        return f"ap(shape={list(self.shape)}, strides={list(self.strides)}, offset={self.offset})"


def same_index_map(a: Layout, b: Layout) -> bool:
    """Whether two layouts address the same elements for every index: equal shapes and offsets, and equal strides
    wherever a dim has more than one index (a size-1 dim's stride is never multiplied by anything but 0; eager
    gives it the contiguous stride, a broadcast view 0)."""
    if a.shape != b.shape:
        return False
    if 0 in a.shape:
        return True
    return a.offset == b.offset and all(
        sa == sb for size, sa, sb in zip(a.shape, a.strides, b.strides) if size != 1
    )


def refine_layout(layout: Layout, domain: tuple[int, ...]) -> Layout | None:
    """``layout`` restated over ``domain`` when ``domain`` only splits its dims into consecutive ones (and adds or
    drops size-1 dims): [.., 128] over [.., 64, 2] reads the same elements with strides (2s, s). None when
    ``domain`` regroups the elements otherwise. A split is always expressible, whatever the dim's stride."""
    if 0 in layout.shape or 0 in domain:
        return None
    wanted = [(size, stride) for size, stride in zip(layout.shape, layout.strides) if size != 1]
    sizes = [size for size in domain if size != 1]
    strides: list[int] = []
    for size, stride in reversed(wanted):  # innermost first: each dim is the product of the next few of domain's
        remaining = size
        while remaining > 1:
            if not sizes or remaining % sizes[-1]:
                return None
            part = sizes.pop()
            strides.append(stride)
            stride, remaining = stride * part, remaining // part
    if sizes:
        return None
    split = iter(reversed(strides))
    return Layout(tuple(domain), tuple(0 if size == 1 else next(split) for size in domain), layout.offset)


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))


@dataclass(frozen=True)
class Buffer:
    """One HBM tensor a kernel writes (or a graph input): its name, dtype and the layout eager gives it."""

    name: str
    dtype: str  # "float32" | "bfloat16" | "bool"
    layout: Layout

    @property
    def numel(self) -> int:
        return math.prod(self.layout.shape)


# ---------------------------------------------------------------- expressions


@dataclass(frozen=True)
class Load:
    """Read ``buffer`` through ``layout``; the layout's shape is the reading node's iteration domain."""

    buffer: str
    layout: Layout
    dtype: str

    def __str__(self) -> str:
        return f"load({self.buffer}, {self.layout})"


@dataclass(frozen=True)
class Scalar:
    value: float

    def __str__(self) -> str:
        return repr(self.value)


@dataclass(frozen=True)
class Result:
    """The value the node's main operation produced (reduction row value, softmax row, matmul tile). ``operand`` 1
    is a paired matmul's second product (``MatMul.b2``)."""

    operand: int = 0

    def __str__(self) -> str:
        return "result" if self.operand == 0 else f"result{self.operand}"


@dataclass(frozen=True)
class Op:
    """An elementwise operation; ``dtype`` is set only for ``cast``. ``op`` names an entry of the op table
    (neuron_compile/op_table.py) and ``args`` has its arity: anything else raises ``op_table.OpTableError``.

    Expressions are DAGs: exact math (an argument reduction, a compensated sum) shares subexpressions thousands of
    times, so the hash is computed once per node and ``str`` writes each shared subexpression once.
    """

    op: str
    args: tuple
    dtype: str | None = None

    def __post_init__(self):
        op_table.check(self.op, len(self.args))
        object.__setattr__(self, "_hash", hash((self.op, self.args, self.dtype)))

    def __hash__(self) -> int:
        return self._hash

    def __str__(self) -> str:
        """``op(args)``; with shared subexpressions ``{%0 = ...; %1 = ...; root}``, each written once."""
        uses: dict[Op, int] = {}

        def count(expr: Op) -> None:
            for arg in expr.args:
                if isinstance(arg, Op):
                    uses[arg] = uses.get(arg, 0) + 1
                    if uses[arg] == 1:
                        count(arg)

        names: dict[Op, str] = {}
        lines: list[str] = []

        def text(expr) -> str:
            if not isinstance(expr, Op):
                return str(expr)
            if expr in names:
                return names[expr]
            inner = ", ".join(text(arg) for arg in expr.args)
            written = f"{expr.op}[{expr.dtype}]({inner})" if expr.dtype else f"{expr.op}({inner})"
            if uses.get(expr, 0) < 2:
                return written
            names[expr] = f"%{len(lines)}"
            lines.append(f"{names[expr]} = {written}")
            return names[expr]

        count(self)
        root = text(self)
        return "{" + "; ".join([*lines, root]) + "}" if lines else root


@dataclass(frozen=True)
class Iota:
    """The int32 value ``layout.offset + sum(index_d * stride_d)`` at each domain index, computed on chip
    (nisa.iota, exact on GpSimd); no buffer is read. ``layout``'s shape is the node's domain (arange)."""

    layout: Layout

    def __str__(self) -> str:
        return f"iota({self.layout})"


RANDOM_SEEDS = "random_seeds"  # a region's int32 seed buffer, one seed per random op, drawn afresh for every call


@dataclass(frozen=True)
class RandomKeep:
    """1.0 where an element is kept, 0.0 where it is dropped with probability ``probability`` (dropout's mask),
    drawn on chip: each tile seeds the Vector engine's generator with ``seed`` (one int32 of ``RANDOM_SEEDS``)
    xor the tile's first flat index in ``layout`` (the domain, contiguous), then ``nisa.dropout`` zeroes a tile
    of ones. The values depend on the seed and the tile plan, never on the order tiles are visited; a kernel
    that evaluated it twice over different tiles would draw two different masks, so fusion keeps it in
    pointwise kernels (``draws_random``)."""

    seed: Load
    layout: Layout
    probability: float

    def __str__(self) -> str:
        return f"random_keep(p={self.probability!r}, {self.seed})"


Expr = Load | Scalar | Result | Op | Iota | RandomKeep


def op(name: str, *args) -> Op:
    """``Op(name, args)`` with plain numbers among ``args`` made Scalars: the builder the lowerings write math with.
    A name the op table does not list raises ``op_table.OpTableError`` naming it."""
    return Op(name, tuple(arg if isinstance(arg, Expr) else Scalar(float(arg)) for arg in args))


def nodes_of(expr: Expr) -> Iterator[Expr]:
    """Every node of ``expr`` (the root, its subexpressions and leaves), depth first, arguments left to right, each
    Op once: an expression is a DAG whose shared subexpressions a tree walk would visit once per path, which is
    exponential in the sharing depth (a Payne-Hanek reduction reuses its pieces many levels deep)."""
    seen: set[Op] = set()  # by value (each Op's hash is computed once): equal copies of a subexpression count once
    pending = [expr]
    while pending:
        node = pending.pop()
        if isinstance(node, Op):
            if node in seen:
                continue
            seen.add(node)
            pending.extend(reversed(node.args))
        yield node


def loads_of(expr: Expr) -> list[Load]:
    """Every Load leaf of ``expr``, in order of first appearance, without duplicates."""
    found: dict[Load, None] = {}
    for node in nodes_of(expr):
        if isinstance(node, Load):
            found[node] = None
        elif isinstance(node, RandomKeep):
            found[node.seed] = None
    return list(found)


def access_layouts(expr: Expr) -> list[Layout]:
    """Every layout ``expr`` indexes through: its Loads' and its Iotas' (tiling must keep both exact)."""
    return list(dict.fromkeys(node.layout for node in nodes_of(expr) if isinstance(node, (Load, Iota, RandomKeep))))


def map_leaves(expr: Expr, fn) -> Expr:
    """Rebuild ``expr`` with ``fn`` applied to every Load and Result leaf; a shared subexpression is rebuilt once
    and stays shared."""
    rebuilt: dict[Op, Expr] = {}  # by value, as nodes_of

    def rebuild(node: Expr) -> Expr:
        if isinstance(node, (Load, Result)):
            return fn(node)
        if not isinstance(node, Op):
            return node
        if node not in rebuilt:
            rebuilt[node] = replace(node, args=tuple(rebuild(arg) for arg in node.args))
        return rebuilt[node]

    return rebuild(expr)


def with_stored_value(expr: Expr, store: Store) -> Expr:
    """``expr`` with ``store``'s value wherever it loads ``store``'s buffer: an epilogue reading a value its kernel
    keeps on chip instead of loading it back from HBM."""
    name = store.buffer.name
    return map_leaves(expr, lambda leaf: store.expr if isinstance(leaf, Load) and leaf.buffer == name else leaf)


def draws_random(expr: Expr) -> bool:
    """Whether ``expr`` draws random numbers (has a RandomKeep leaf); each shared subexpression is visited once."""
    return any(isinstance(node, RandomKeep) for node in nodes_of(expr))


def uses_result(expr: Expr) -> bool:
    """Whether ``expr`` reads a Result leaf."""
    return any(isinstance(node, Result) for node in nodes_of(expr))


def is_square(expr: Expr) -> bool:
    """``pow(x, 2)`` or ``mul(x, x)``."""
    if not isinstance(expr, Op):
        return False
    return (expr.op == "pow" and isinstance(expr.args[1], Scalar) and expr.args[1].value == 2.0) or (
        expr.op == "mul" and expr.args[0] == expr.args[1])


def scaled_square(expr: Expr) -> tuple[Expr, float] | None:
    """``(x, c)`` when ``expr`` is ``(x * c) * x`` or ``x * (x * c)`` (either product's operands in either order)
    computed in fp32 with ``0 < c <= 1`` (AdamW's ``(1 - beta2) * g * g``), else None. With ``c <= 1`` the
    product ``x * c`` cannot overflow where ``c * x * x`` does not (so ``(x * sqrt(c)) ** 2`` overflows where
    it does, to the rounding)."""
    if not (isinstance(expr, Op) and expr.op == "mul" and expr.dtype is None and len(expr.args) == 2):
        return None
    for scaled, x in (expr.args, expr.args[::-1]):
        if isinstance(x, Scalar) or not (isinstance(scaled, Op) and scaled.op == "mul" and scaled.dtype is None):
            continue
        if x in scaled.args and len(scaled.args) == 2:
            number = scaled.args[1] if scaled.args[0] == x else scaled.args[0]
            if isinstance(number, Scalar) and 0.0 < float(number.value) <= 1.0:
                return x, float(number.value)
    return None


# ---------------------------------------------------------------- nodes


@dataclass(frozen=True)
class Store:
    """Write ``expr`` to ``buffer``; ``layout`` is the buffer's layout restated in the node's domain."""

    buffer: Buffer
    expr: Expr
    layout: Layout


@dataclass(frozen=True)
class Pointwise:
    """Elementwise over ``domain`` (the output shape)."""

    name: str
    domain: tuple[int, ...]
    stores: tuple[Store, ...]


@dataclass(frozen=True)
class Reduction:
    """Reduce ``prologue`` (over ``domain``, the input shape) along ``reduce_dims`` with ``op``.

    ``op`` is sum | max | min | prod | mean | var. Stores read ``Result()`` (the reduced value) and loads whose
    layouts have stride 0 on the reduced dims; they are evaluated once per kept index. ``row_stores`` are
    fused consumers over the whole domain (rms norm's ``x * rsqrt(mean(x * x) + eps)``): they read the row
    still in SBUF, with ``Result()`` broadcast along it.
    """

    name: str
    domain: tuple[int, ...]
    reduce_dims: tuple[int, ...]
    op: str
    prologue: Expr
    stores: tuple[Store, ...]
    correction: float = 0.0  # var only
    row_stores: tuple[Store, ...] = ()


@dataclass(frozen=True)
class RowNormalize:
    """softmax | log_softmax of ``prologue`` along ``dim``; stores read ``Result()`` over the whole domain."""

    name: str
    domain: tuple[int, ...]
    dim: int
    op: str
    prologue: Expr
    stores: tuple[Store, ...]
    causal: bool = False  # mask column j > row i of the last two dims to -inf first (attention's is_causal)


@dataclass(frozen=True)
class Scan:
    """A running sum | prod | logsumexp of ``prologue`` along ``dim`` (cumsum, cumprod, logcumsumexp); stores read
    ``Result()`` over the whole domain. ``compensated``: also carry each step's fp32 rounding error (eager
    accumulates fp32 in double)."""

    name: str
    domain: tuple[int, ...]
    dim: int
    op: str
    prologue: Expr
    stores: tuple[Store, ...]
    compensated: bool = False


@dataclass(frozen=True)
class MatMul:
    """``a @ b`` over domain (*batch, M, N); ``a`` is (*batch, M, K), ``b`` is (*batch, K, N); mm has one size-1,
    stride-0 batch dim.

    Stores read ``Result()`` (the fp32 product tile) plus loads over (*batch, M, N) — the epilogue. A paired
    matmul (horizontal fusion: a gated MLP's up and gate projections read the same ``a``) also multiplies ``a`` by
    ``b2``, of ``b``'s shape, and its epilogue reads that product as ``Result(1)``.

    ``shifts`` makes it an implicit GEMM (a convolution, one term per kernel position): the product is
    ``sum_t a[+a_shift_t] @ b[+b_shift_t]``, each operand read through its layout with ``(a_shift_t, b_shift_t)``
    added to its offset, all terms accumulated in PSUM. Empty: the one term ``a @ b``.
    """

    name: str
    domain: tuple[int, ...]
    k: int
    a: Load
    b: Load
    stores: tuple[Store, ...]
    b2: Load | None = None
    shifts: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class NormedMatMul:
    """A ``MatMul`` whose left operand is computed on chip from rows the kernel loads itself (a row-norm prologue):
    ``norm`` (a ``Reduction`` over (*batch, M, K) along K, an RMSNorm's mean of squares) reduces each row block,
    ``operand`` (over the same domain, ``Result()`` the row's reduced value: the normed rows, weight included) is
    the operand, transposed on TensorE into a^T; ``a`` is the load of the buffer it stood for (its dtype is the
    operand's). ``norm``'s own stores and row stores are what the norm still writes to HBM because something
    outside the kernel reads them (a training forward's saved rstd). The other fields are ``MatMul``'s.
    """

    name: str
    domain: tuple[int, ...]
    k: int
    a: Load
    b: Load
    stores: tuple[Store, ...]
    norm: Reduction
    operand: Expr
    b2: Load | None = None


@dataclass(frozen=True)
class MatMulNormEpilogue:
    """A ``MatMul`` whose output rows a row norm then reduces in the same kernel (a norm epilogue): ``rows`` is the
    matmul's epilogue value the norm reads (a decoder layer's ``h + down(...)``), kept in SBUF for each row block
    across the N tiles; ``norm`` (a ``Reduction`` over (*batch, M, N) along N, an RMSNorm's mean of squares, its
    loads of ``rows.buffer`` standing for those tiles) runs on each block once its last N tile is done.
    ``store_rows``: ``rows`` also goes to HBM (something else reads it). The other fields are ``MatMul``'s.
    """

    name: str
    domain: tuple[int, ...]
    k: int
    a: Load
    b: Load
    stores: tuple[Store, ...]
    rows: Store
    store_rows: bool
    norm: Reduction


@dataclass(frozen=True)
class HeadRotary:
    """One rotary embedding a ``MatMulRotary`` computes on its tiles: ``source`` is the matmul's store it reads (q or
    k as the projection rounds them), computed in each N tile's epilogue and kept on chip; ``rotary`` (a ``Concat``
    of ``x * cos + rotate(x) * sin`` over each head of ``head_dim`` columns: rotate_half's halves, or an interleaved
    rotary's pairs; its loads of ``source.buffer`` standing for that tile) runs on the tile's whole heads.
    ``store_source``: ``source`` also goes to HBM (something else reads it). ``norm``: a per-head RMSNorm of
    ``source`` (Qwen3's, Gemma3's, Flux's; a ``Reduction`` over [*batch, M, heads, head_dim] along the last dim)
    computed on the tile first; the rotary reads its one row store, the normed heads, which never go to HBM."""

    source: Store
    store_source: bool
    rotary: Concat
    head_dim: int
    norm: Reduction | None = None


@dataclass(frozen=True)
class MatMulRotary:
    """A matmul kernel (``MatMul`` or ``NormedMatMul``) whose products rotary embeddings then read in the same kernel
    (rotary epilogues, ``rotaries``: one per product rotated, q's and k's of a paired projection). ``matmul`` keeps
    its other stores."""

    name: str
    matmul: MatMul | NormedMatMul
    rotaries: tuple[HeadRotary, ...]

    @property
    def domain(self) -> tuple[int, ...]:
        return self.matmul.domain


@dataclass(frozen=True)
class Attention:
    """``softmax(q @ k^T * scale + mask) @ v`` over domain (*batch, Sq, Dv), the scores never leaving the chip.

    ``q`` is (*batch, Sq, D), ``k`` (*batch, Sk, D), ``v`` (*batch, Sk, Dv): grouped-query attention shares a
    key/value head across a group dim of stride 0 in ``k`` and ``v``. ``mask`` is an additive float mask read
    as (*batch, Sq, Sk) (broadcasts have stride 0); ``causal`` masks key j > query i (top-left aligned, as
    eager's ``is_causal``). Stores read ``Result()`` (the normalized fp32 output tile) plus loads over the
    domain — the epilogue. ``logsumexp`` (training's forward) writes each query row's log-sum-exp of the
    scaled, masked scores (fp32; 0 for a row with every key masked, as eager), its layout restated over the domain
    with stride 0 on the head dim. ``split_keys``: a tile of few query rows (a decode step) may spread its keys over
    the partitions (kinds/attention_decode.py) instead of its rows (config ``flash_decode``).
    """

    name: str
    domain: tuple[int, ...]
    q: Load
    k: Load
    v: Load
    mask: Load | None
    scale: float
    causal: bool
    stores: tuple[Store, ...]
    logsumexp: Store | None = None
    split_keys: bool = True

    @property
    def keys(self) -> int:
        return self.k.layout.shape[-2]

    @property
    def depth(self) -> int:
        return self.q.layout.shape[-1]


@dataclass(frozen=True)
class AttentionBackward:
    """Flash attention's backward in one kernel: dq, dk, dv of ``softmax(q @ k^T * scale + mask) @ v`` from the
    forward's output and log-sum-exp, the probabilities and their gradient recomputed on chip per (query tile, key
    block), so nothing of size Sq x Sk crosses HBM. ``domain`` is (*batch, Sq, Sk).

    ``grad`` (dO) and ``out`` are (*batch, Sq, Dv), ``q`` (*batch, Sq, D), ``k`` (*batch, Sk, D), ``v`` (*batch,
    Sk, Dv), ``logsumexp`` (*batch, Sq) (fp32). Grouped-query attention: a group dim of stride 0 in ``k``, ``v`` and
    the ``grad_key`` / ``grad_value`` stores, over which the kernel sums (fp32). ``mask`` (additive, read as
    (*batch, Sq, Sk)) and ``causal`` (top-left) as in ``Attention``. The stores read ``Result()`` (no epilogue).
    """

    name: str
    domain: tuple[int, ...]
    grad: Load
    q: Load
    k: Load
    v: Load
    out: Load
    logsumexp: Load
    mask: Load | None
    scale: float
    causal: bool
    grad_query: Store
    grad_key: Store
    grad_value: Store

    @property
    def stores(self) -> tuple[Store, ...]:
        return (self.grad_query, self.grad_key, self.grad_value)

    @property
    def depth(self) -> int:
        return self.q.layout.shape[-1]

    @property
    def value_dim(self) -> int:
        return self.v.layout.shape[-1]


@dataclass(frozen=True)
class Concat:
    """Copy each part (a Pointwise over its input's shape) into its slice of one output buffer (aten.cat); the parts
    never overlap. ``starts``: where each part's box begins in ``domain`` (empty: not known). A pointwise epilogue
    that reads the output with its own index map is distributed over the parts (kinds/concat.py): each part also
    stores the epilogue's results on its slice, and ``epilogue_stores`` hold those buffers' layouts over the domain.
    ``stores`` are the buffers the parts still write (the output itself may be pruned away). ``in_place``: its parts
    copy whole buffers whose writers are to store them into the output instead (passes/concat_in_place.py)."""

    name: str
    domain: tuple[int, ...]
    parts: tuple[Pointwise, ...]
    output: Buffer
    starts: tuple[tuple[int, ...], ...] = ()
    epilogue_stores: tuple[Store, ...] = ()
    in_place: bool = False

    @property
    def stores(self) -> tuple[Store, ...]:
        written = {store.buffer.name for part in self.parts for store in part.stores}
        candidates = (Store(self.output, Result(), self.output.layout), *self.epilogue_stores)
        return tuple(store for store in candidates if store.buffer.name in written)


@dataclass(frozen=True)
class Gather:
    """``out = source`` with its dim ``dim`` replaced by ``index``'s dims: ``out[a, j..., b] = source[a,
    index[j...], b]`` (index_select, embedding, index.Tensor with one index); one indirect DMA per index tile.
    Indices outside the valid range make the kernel fail (never a read of another element).

    ``source`` reads the source through its own shape, ``index`` (an int32 buffer) through the index shape
    (at least 1-D); the one store writes ``Result()`` over the domain ``source.shape[:dim] + index.shape +
    source.shape[dim + 1:]``.
    """

    name: str
    domain: tuple[int, ...]
    dim: int
    source: Load
    index: Load
    stores: tuple[Store, ...]
    wrap_negative: bool = False  # index.Tensor wraps idx < 0 to idx + size; index_select and embedding raise
    # elements=True: one element per output element (aten.gather, index.Tensor with several indices). Then
    # ``source``'s layout is restated over the domain (stride 0 on index-driven dims) and ``indices`` holds
    # (Load over the domain, source stride, source size, wrap negatives) per index: flat offset = source
    # layout's value + sum(index * stride); ``index`` is the first of them.
    elements: bool = False
    indices: tuple = ()



@dataclass(frozen=True)
class Scatter:
    """``out = base``, then for every element e of ``domain``, tile by tile in order: ``out[target(e)] =
    reduce(out[target(e)], values(e))`` (index_put, scatter, scatter_add, scatter_reduce, index_reduce, put).

    ``reduce`` is assign | add | multiply | maximum | minimum. ``base`` reads self over the output's shape, or
    is the number self is filled with (a constant ``full``: the embedding gradient's zeros);
    ``target`` is the output's layout restated over the domain (stride 0 on index-driven dims) and ``indices``
    holds (Load over the domain, output stride, output size, wrap negatives) per index, as ``Gather.indices``:
    target(e) = target's value + sum(index * stride). ``values`` is a Load over the domain or a Scalar. Elements
    of one tile that hit the same place all write the same value (assign: the last one's; otherwise every one's
    contribution combined), so the result does not depend on the order of one DMA's writes. Indices outside the
    valid range make the kernel fail (never a write elsewhere). The one store is the output (``Result()``).
    """

    name: str
    domain: tuple[int, ...]
    base: Load | Scalar
    target: Layout
    values: Load | Scalar
    indices: tuple
    stores: tuple[Store, ...]
    reduce: str = "assign"
    # The domain dim on partitions (the others are outer loops in domain order); the lowering picks one that keeps
    # eager's order among colliding elements: a dim no index drives, or the last one an index drives.
    partition_dim: int = -1
    # assign and add: the trailing domain dims no index drives, carried whole on the free axis (one row of
    # ``row_dims`` dims per partition: index_copy / index_put of rows, a KV-cache update, the embedding gradient's
    # sum of rows); 0 = one element each
    row_dims: int = 0


@dataclass(frozen=True)
class Collective:
    """A collective across the ranks of a torch.distributed job, run by ``nki.collectives`` (_c10d_functional
    all_reduce, all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single with even splits).

    ``collective`` is all_reduce | all_gather | reduce_scatter | all_to_all; ``reduce`` the reduction of the first
    and third (add | maximum | minimum). ``source`` reads a whole contiguous buffer (offset 0, its span its
    elements): the collective moves flat HBM tensors, so the lowering copies any other view first. ``ranks``: the
    replica group's rank-lists. Chunks are taken along dim 0 in rank order. The one store writes ``Result()`` into
    a contiguous buffer of the output's shape (``domain``).
    """

    name: str
    domain: tuple[int, ...]
    collective: str
    source: Load
    ranks: tuple[tuple[int, ...], ...]
    stores: tuple[Store, ...]
    reduce: str = "add"


Node = (Pointwise | Reduction | RowNormalize | Scan | MatMul | NormedMatMul | MatMulNormEpilogue | MatMulRotary
        | Attention | AttentionBackward | Concat | Gather | Scatter | Collective)


@dataclass(frozen=True)
class TensorValue:
    """What an FX node evaluates to: a buffer read through a layout (views only change the layout)."""

    buffer: str
    layout: Layout
    dtype: str

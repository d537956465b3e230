"""Pointwise lowerings, compiled and launched on the simulator, against eager PyTorch (see lowering_harness)."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowering_harness import check_against_eager, check_through_backend, compile_and_run, random_tensor, trace
from neuron_compile.lowering import unsupported_reason

SIZES = st.sampled_from([1, 2, 5, 127, 128, 129])
DTYPES = st.sampled_from([torch.float32, torch.bfloat16])


def _shape(draw, rank):
    shape = [draw(SIZES) for _ in range(rank)]
    while len(shape) > 1 and torch.Size(shape).numel() > 40_000:
        shape[0] = 1 if shape[0] > 1 else shape[0]
        shape = shape[1:] if shape[0] == 1 and len(shape) > 2 else shape
    return tuple(shape)


@st.composite
def shapes(draw, max_rank=4):
    return _shape(draw, draw(st.integers(1, max_rank)))


UNARY = {
    "exp": torch.exp,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "relu": torch.relu,
    "neg": torch.neg,
    "abs": torch.abs,
    "gelu": torch.nn.functional.gelu,
    "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
    "silu": torch.nn.functional.silu,
    "erf": torch.erf,
    "square": lambda x: x * x,
    "pow3": lambda x: x**3,
}
POSITIVE_UNARY = {"log": torch.log, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt, "reciprocal": torch.reciprocal}


@settings(max_examples=20, deadline=None)
@given(shape=shapes(), dtype=DTYPES, name=st.sampled_from(sorted(UNARY)))
def test_unary_matches_eager(shape, dtype, name):
    check_against_eager(UNARY[name], random_tensor(shape, dtype))


@settings(max_examples=8, deadline=None)
@given(shape=shapes(3), dtype=DTYPES, name=st.sampled_from(sorted(POSITIVE_UNARY)))
def test_positive_domain_unary_matches_eager(shape, dtype, name):
    check_against_eager(POSITIVE_UNARY[name], random_tensor(shape, dtype, low=0.1, high=4.0))


BINARY = {
    "add": lambda a, b: a + b,
    "sub_alpha": lambda a, b: torch.sub(a, b, alpha=2),
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / (b.abs() + 0.5),
    "maximum": torch.maximum,
    "minimum": torch.minimum,
}


@st.composite
def broadcast_pair(draw):
    shape = draw(shapes(4))
    # The second operand drops leading dims and sets some dims to 1: numpy broadcasting.
    start = draw(st.integers(0, len(shape) - 1))
    other = tuple(1 if draw(st.booleans()) else size for size in shape[start:])
    if draw(st.booleans()):
        return shape, other
    return other, shape


@settings(max_examples=20, deadline=None)
@given(pair=broadcast_pair(), dtype=DTYPES, name=st.sampled_from(sorted(BINARY)))
def test_broadcast_binary_matches_eager(pair, dtype, name):
    a, b = random_tensor(pair[0], dtype, seed=1), random_tensor(pair[1], dtype, seed=2)
    check_against_eager(BINARY[name], a, b)


@settings(max_examples=10, deadline=None)
@given(shape=shapes(3), dtype=DTYPES)
def test_scalars_and_clamp_match_eager(shape, dtype):
    def fn(x):
        return (x * 3.0 - 1.5, 2.0 - x, 1.0 / (x.abs() + 1), x / 4, x.clamp(-0.5, 0.75), x.clamp_min(0.1),
                torch.rsub(x, 1.0))

    check_against_eager(fn, random_tensor(shape, dtype))


@settings(max_examples=10, deadline=None)
@given(pair=broadcast_pair())
def test_comparisons_store_bool(pair):
    a, b = random_tensor(pair[0], seed=3), random_tensor(pair[1], seed=4)
    check_against_eager(lambda a, b: (a > b, a <= b, a == a, a != b, a < 0.5), a, b)


@pytest.mark.parametrize("source,target", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_casts_match_eager(source, target):
    x = random_tensor((129, 33), source)
    check_against_eager(lambda x: (x.to(target), (x.to(target) * 3).to(source)), x)


def test_large_tiles_ragged_in_both_axes():
    # 300 rows (3 partition tiles, the last one ragged) x 5000 columns (two free tiles of 4096, one ragged).
    x, y = random_tensor((300, 5000), seed=5), random_tensor((5000,), seed=6)
    check_against_eager(lambda x, y: torch.tanh(x) * y + 1, x, y)


def test_five_dims_with_a_transposed_input():
    x = random_tensor((2, 3, 4, 5, 6), seed=7)
    y = random_tensor((6, 5, 4, 3, 2), seed=8).permute(4, 3, 2, 1, 0)
    check_against_eager(lambda x, y: x * y + x, x, y)


def test_unsupported_reasons_name_the_rule():
    gm = trace(lambda x, i: (torch.sort(x)[0], x.to(torch.int64), torch.div(x, 2, rounding_mode="floor")),
               torch.randn(4, 4), torch.zeros(4, dtype=torch.int64))
    reasons = {node.name: unsupported_reason(node) for node in gm.graph.nodes if node.op == "call_function"}
    assert reasons["sort"] == "no lowering for aten.sort.default"
    # a cast of unbounded floats to int64 (1e10, nan) cannot be exact in the int32 kernel dtype
    assert reasons["_to_copy"] == "float32 values of arg0_1 not proved within +-2**24 (integer math runs in fp32)"
    # float floor division needs a correctly rounded division (integer operands are lowered)
    assert reasons["div"] == ("aten.div.Tensor_mode: float operands (their remainder needs a correctly rounded "
                              "division)")


@settings(max_examples=10, deadline=None)
@given(pair=broadcast_pair(), dtype=DTYPES)
def test_where_is_an_exact_select(pair, dtype):
    x, y = random_tensor(pair[0], dtype, seed=5), random_tensor(pair[1], dtype, seed=6)
    x.view(-1)[0] = float("inf")
    y.view(-1)[-1] = float("nan")

    def fn(x, y):
        # the masked -inf / nan / inf of the unselected side must not leak into the result
        return torch.where(x > y, x, y), torch.where(y < 0.5, float("-inf"), x), torch.where(x > 0, 1.0, 0.0) * y

    check_against_eager(fn, x, y)


@pytest.mark.parametrize("shape", [(1,), (3, 127), (2, 129)])
def test_where_with_a_constant_condition_selects_statically(shape):
    """flex attention's no-op mask is a constant True expanded over the scores: the select is a copy of one side
    (it failed the region before), the other side's inf / nan never read."""
    x, y = random_tensor(shape, seed=5), random_tensor(shape, seed=6)
    y.view(-1)[-1] = float("nan")

    def fn(x, y):
        attended = torch.ones((), dtype=torch.bool).expand(x.shape)
        return torch.where(attended, x * 2, y), torch.where(~attended, y, float("inf")), torch.where(attended, 1.0, y)

    check_through_backend(fn, x, y)


@settings(max_examples=10, deadline=None)
@given(shape=shapes(3), dtype=DTYPES, name=st.sampled_from(["gelu", "gelu_tanh", "silu", "softplus", "mish"]))
def test_activation_backward_and_kept_activations_match_eager(shape, dtype, name):
    aten = torch.ops.aten
    functions = {
        "gelu": lambda g, x: aten.gelu_backward(g, x),
        "gelu_tanh": lambda g, x: aten.gelu_backward(g, x, approximate="tanh"),
        "silu": lambda g, x: aten.silu_backward(g, x),
        "softplus": lambda g, x: aten.softplus(x) * g,
        "mish": lambda g, x: aten.mish(x) + g,
    }
    check_against_eager(functions[name], random_tensor(shape, dtype, seed=1), random_tensor(shape, dtype, seed=2))


def test_constants_are_memset_kernels():
    def fn(x):
        return torch.full((129, 3), 2.5), torch.zeros_like(x) + x, torch.ones(5, dtype=torch.bfloat16)

    check_against_eager(fn, random_tensor((4, 6)))


def _special_values(dtype):
    """Signed zeros, small and large magnitudes, nan and infinities, over 135 rows (more than one partition tile)."""
    values = torch.tensor([0.0, -0.0, 0.3, -0.2, 1e-3, 1e-30, 1.5, -2.0, float("nan"), float("inf"), -float("inf")])
    return values.repeat(15, 1).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cast_to_bool_is_a_truth_test(dtype):
    # Found by the OpInfo sweep: a numeric cast rounded 0.3 to False; eager's bool() is `x != 0` (nan -> True).
    x = _special_values(dtype)
    eager, compiled = x.bool(), compile_and_run(lambda t: t.bool(), x)[1][0]
    assert compiled.dtype == torch.bool
    assert torch.equal(compiled, eager)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool])
@pytest.mark.parametrize("name", ["isnan", "logical_not"])
def test_predicates_are_exact_on_special_values(dtype, name):
    x = _special_values(dtype)
    fn = getattr(torch, name)
    compiled = compile_and_run(fn, x)[1][0]
    assert compiled.dtype == torch.bool
    assert torch.equal(compiled, fn(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pow_with_tensor_exponents(dtype):
    base = random_tensor((130, 7), dtype=torch.float32, low=-3, high=3)
    exponent = random_tensor((130, 7), dtype=torch.float32, seed=3, low=-4, high=4)
    # C pow's special cases: 0 ** -1 = inf, (-0) ** 3 = -0, nan ** 0 = 1, inf ** -2 = 0, negative ** integer
    base[0, :4] = torch.tensor([0.0, -0.0, float("nan"), float("inf")])
    exponent[0, :4] = torch.tensor([-1.0, 3.0, 0.0, -2.0])
    exponent[1] = exponent[1].round()
    base, exponent = base.to(dtype), exponent.to(dtype)
    check_against_eager(lambda a, b: torch.pow(a, b), base, exponent)
    check_against_eager(lambda a, b: a ** b[0], base, exponent)  # broadcast exponent row
    check_against_eager(lambda a: torch.pow(2.0, a), exponent)
    check_against_eager(lambda a, b: a[:, :1] ** b[:, 1:2], base, exponent)  # one column: (P, 1) row vectors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_backward_on_special_values(dtype):
    x = _special_values(dtype)
    x[0, :4] = torch.tensor([12.0, -12.0, 3e4, -3e4])  # saturated tanh: derivative 1 and 0
    check_against_eager(lambda g, a: torch.ops.aten.gelu_backward(g, a, approximate="tanh"),
                        random_tensor(tuple(x.shape), dtype, seed=3), x)


@pytest.mark.parametrize("heads, rows, cols", [(8, 128, 128), (3, 130, 70), (2, 1, 4096)])
def test_few_leading_rows_do_not_leave_partitions_idle(heads, rows, cols):
    # A mask broadcast over heads stops the heads from merging with the rows, and the rows with the columns
    # merge into one long dim: it is split so that rows fill the partitions, the heads become a loop.
    scores = random_tensor((1, heads, rows, cols), seed=30)
    mask = random_tensor((1, 1, rows, cols), seed=31) > 0
    region = check_against_eager(lambda s, m: s.masked_fill(m, float("-inf")) * 2, scores, mask)
    kernel = next(kernel.source for kernel in region.kernels if "where(" in kernel.source)
    plan_line = next(line for line in kernel.splitlines() if line.startswith("Tile plan"))
    partitions = int(plan_line.split("partition ")[1].split("/")[1].split()[0])
    expected = max(d for d in range(1, 129) if (rows * cols) % d == 0)
    assert partitions == expected, plan_line


def test_a_rotary_product_puts_the_tokens_on_partitions():
    # Heads of 128 (one column each if the head dim went on partitions) times a table broadcast over the heads: the
    # tokens, the widest dim, take the partitions and a tile holds every head (was one DMA element per partition,
    # one tile per token: 2.9 ms per kernel in a mid-size Flux block).
    x, table = random_tensor((1, 300, 8, 128), seed=1), random_tensor((300, 1, 128), seed=2)
    region = check_against_eager(lambda x, t: x * t, x, table)
    assert "partition 300/128 free [8/8, 128/128]" in region.kernels[0].source


@settings(max_examples=8, deadline=None)
@given(rows=st.sampled_from([1, 127, 128, 129, 300]), cols=st.sampled_from([1, 7, 600]), dtype=DTYPES,
       masked_first=st.booleans())
def test_a_per_row_mask_is_loaded_as_a_column(rows, cols, dtype, masked_first):
    """where(mask[:, None], ...) with a bool mask per row (the embedding gradient's padding test): the mask comes
    in as one element per partition and is widened on chip, never a broadcast DMA of each repeated element; the
    select stays exact (inf and nan of the unselected side do not leak)."""
    mask = torch.arange(rows) % 3 == (0 if masked_first else 1)
    x = random_tensor((rows, cols), dtype, seed=7)
    x[0, 0], x[-1, -1] = float("inf"), float("nan")

    def fn(m, x):
        return torch.where(m[:, None], 0.0, x * 2), torch.where(m[:, None], x, float("-inf"))

    region = check_against_eager(fn, mask, x)
    if cols == 1:  # a one-column mask is no broadcast
        return
    sources = "".join(kernel.source for kernel in region.kernels)
    assert not re.search(r"src=\w+\.ap\(\[\[\d+, rows\], \[0, cols\]\]", sources)  # no broadcast load
    assert "_column_" in sources

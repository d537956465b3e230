"""Row reductions over short rows take several rows per partition (kinds/reduction.py, tiles.py
``rows_per_partition``): a q / k norm's statistics over [tokens x heads, head_dim] load k rows per partition in one
DMA, one tensor_reduce over the innermost axis of a [P, k, row] view gives k results per partition, and the
epilogue (``rsqrt(mean + eps)``) runs on [P, k] tiles; a fused norm's row epilogue reads those through a view
that repeats each along its row. Against eager under hypothesis (tokens 1 / 127 / 128 / 129 /
200, head dims 64 / 128, fp32 and bf16) with the plan the shape should take asserted, on special values, and the
estimate against one row per partition."""

from __future__ import annotations

import re
import unittest.mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lowering_harness import check_against_eager, compile_and_run, random_tensor

import neuron_compile
from neuron_compile.tiles import GROUPED_ROWS_MAX_ELEMENTS

PARTITIONS = 128


def qk_norm_statistics(x: torch.Tensor) -> torch.Tensor:
    """diffusers' RMSNorm statistic, per head: rsqrt(mean(x * x) + eps) in fp32."""
    return torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """diffusers' RMSNorm with a weight, as Flux's q / k norms run it: one kernel with a row epilogue."""
    normalized = x.float() * qk_norm_statistics(x)
    return (normalized.to(weight.dtype) * weight).to(x.dtype)


ROW_REDUCTIONS = {
    "rms_statistic": qk_norm_statistics,
    "sum": lambda x: x.sum(-1),
    "mean": lambda x: x.mean(-1, keepdim=True),
    "amax": lambda x: x.amax(-1),
    "amin": lambda x: x.amin(-1),
}


def rows_per_partition(region) -> int:
    """k of the region's one reduction kernel (1: one row per partition), read from its tile plan."""
    plans = [line for kernel in region.kernels for line in kernel.source.splitlines()
             if line.startswith("Tile plan: reduction")]
    assert len(plans) == 1, plans
    return int(plans[0].split("(")[1].split()[0]) if "rows per partition" in plans[0] else 1


def expected_rows_per_partition(rows: int, width: int) -> int:
    """The grouping rule: at least four partition tiles of rows; k divides the rows, keeps a full tile of row
    groups and holds at most GROUPED_ROWS_MAX_ELEMENTS per partition."""
    if rows < 4 * PARTITIONS:
        return 1
    limit = min(GROUPED_ROWS_MAX_ELEMENTS // width, rows // PARTITIONS)
    return max(k for k in range(1, limit + 1) if rows % k == 0)


@settings(max_examples=30, deadline=None)
@given(tokens=st.sampled_from([1, 127, 128, 129, 200]), heads=st.sampled_from([5, 8]),
       head_dim=st.sampled_from([64, 128]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       name=st.sampled_from(sorted(ROW_REDUCTIONS)))
def test_short_row_reductions_match_eager_with_rows_grouped_per_partition(tokens, heads, head_dim, dtype, name):
    x = random_tensor((1, tokens, heads, head_dim), dtype, seed=tokens + heads)
    region = check_against_eager(ROW_REDUCTIONS[name], x, fp32_reference=dtype == torch.bfloat16 and name == "sum")
    assert rows_per_partition(region) == expected_rows_per_partition(tokens * heads, head_dim)


ROW_EPILOGUES = {
    "rms_norm": rms_norm,
    "centered": lambda x, w: x - x.amax(-1, keepdim=True),  # the reduced value itself, read along each row
    "per_row_scale": lambda x, w: x * (x.sum(-1, keepdim=True) * w[:1]),  # a per-row value from a load too
}


@settings(max_examples=30, deadline=None)
@given(tokens=st.sampled_from([1, 127, 128, 129, 200]), heads=st.sampled_from([5, 8]),
       head_dim=st.sampled_from([64, 128]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       name=st.sampled_from(sorted(ROW_EPILOGUES)))
def test_row_epilogues_over_grouped_rows_match_eager(tokens, heads, head_dim, dtype, name):
    """The epilogue reading each row with its own reduced value (a fused norm): its values constant along a row
    are computed on the [P, k] results and read through a view that repeats each along its row."""
    x = random_tensor((1, tokens, heads, head_dim), dtype, seed=tokens * heads)
    weight = random_tensor((head_dim,), dtype, seed=7)
    region = check_against_eager(ROW_EPILOGUES[name], x, weight)
    assert rows_per_partition(region) == expected_rows_per_partition(tokens * heads, head_dim)


def test_the_flux_mid_size_statistics_take_eight_rows_per_partition():
    x = random_tensor((1, 1280, 8, 128), torch.bfloat16, seed=1)
    region = check_against_eager(qk_norm_statistics, x)
    assert rows_per_partition(region) == 8
    source = region.kernels[0].source
    assert "axis=2" in source and "op0=nl.rsqrt" in source  # k sums per instruction; the ALU rsqrt on [P, k]
    norm = check_against_eager(rms_norm, x, random_tensor((128,), torch.bfloat16, seed=2))
    assert rows_per_partition(norm) == 8
    # each row scaled by its statistic on ScalarE, a (P, 1) column of the [P, 8] results as the scale
    assert re.search(r"op=nl.copy, data=\w+\[0:rows, 896:1024\], scale=\w+\[0:rows, 7:8\]\)", norm.kernels[0].source)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_special_rows_match_eager(dtype):
    """Zero rows (rsqrt(eps)), rows whose squares overflow (rsqrt(inf) = 0), an inf, a nan, -inf: each result is
    eager's, wherever the row sits among the k rows of its partition."""
    x = random_tensor((1, 128, 8, 128), seed=3)
    x[0, 0, 0] = 0.0
    x[0, 5, 3] = 3e38
    x[0, 9, 7, 11] = float("inf")
    x[0, 17, 2, 100] = float("nan")
    x[0, 33, 6, 0] = -float("inf")
    x[0, 64] = 0.0  # a whole partition's worth of zero rows
    x = x.to(dtype)
    for name in ("rms_statistic", "amax", "amin", "sum"):
        region = check_against_eager(ROW_REDUCTIONS[name], x, fp32_reference=name == "sum")
        assert rows_per_partition(region) == 8
    region = check_against_eager(rms_norm, x, random_tensor((128,), dtype, seed=8))
    assert rows_per_partition(region) == 8


def test_what_the_rows_cannot_share_keeps_one_row_per_partition():
    # a variance's second pass subtracts each row's mean
    variance = check_against_eager(lambda a: a.var(-1), random_tensor((1, 128, 8, 128), seed=4))
    wide = check_against_eager(lambda a: a.sum(-1), random_tensor((1024, 512), seed=5))  # long enough rows
    assert [rows_per_partition(region) for region in (variance, wide)] == [1, 1]


def test_grouped_rows_cut_the_statistics_estimate_and_the_norms_dma_time(monkeypatch):
    from neuron_compile.kinds import reduction

    x = random_tensor((1, 1280, 8, 128), torch.bfloat16, seed=6)
    weight = random_tensor((128,), torch.bfloat16, seed=9)

    def estimated(fn, *inputs) -> tuple[float, float]:
        neuron_compile.reset_stats()
        with neuron_compile.record_launches() as launches:
            check_against_eager(fn, *inputs)
        dma = sum(launch.report.busy_s_per_engine["dma"] for launch in launches)
        return neuron_compile.stats()["est_time_s"], dma

    grouped = estimated(qk_norm_statistics, x), estimated(rms_norm, x, weight)
    monkeypatch.setattr(reduction, "SHORT_ROW_ELEMENTS", 0)  # one row per partition, as before
    single = estimated(qk_norm_statistics, x), estimated(rms_norm, x, weight)
    assert grouped[0][0] < 0.6 * single[0][0]
    # the fused norm: inside a model's region launch its DMAs share the pool with every other kernel's
    assert grouped[1][1] < 0.5 * single[1][1]


def expected_heads_per_partition(heads: int, width: int) -> int:
    """Rows grouped from an outer dim (the heads of a heads-first view): the largest divisor of the heads that
    keeps at most GROUPED_ROWS_MAX_ELEMENTS per partition."""
    return max(k for k in range(1, heads + 1) if heads % k == 0 and k * width <= GROUPED_ROWS_MAX_ELEMENTS)


@settings(max_examples=30, deadline=None)
@given(tokens=st.sampled_from([2, 127, 128, 129, 200]), heads=st.sampled_from([5, 8, 32]),
       head_dim=st.sampled_from([64, 128]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       name=st.sampled_from(sorted(ROW_REDUCTIONS) + sorted(ROW_EPILOGUES)))
def test_heads_first_views_group_the_heads_of_a_position_per_partition(tokens, heads, head_dim, dtype, name):
    """Gemma3's q / k norms run after the heads' transpose: [batch, heads, seq, dim] over rows laid out [batch, seq,
    heads, dim]. A position's heads lie side by side in memory, so they share a partition (one DMA of k x dim
    contiguous elements), not consecutive positions (k rows far apart). Each row takes the same instructions on the
    same values either way: bitwise the result without the heads grouped. Compared with eager too up to 1600 rows
    (at 4096 fp32 rows of 128 random values, some sums cancel enough that eager's summation order and ours differ by
    more than the fp32 tolerance, both as far from the float64 sum)."""
    from neuron_compile.kinds import reduction

    x = random_tensor((1, tokens, heads, head_dim), dtype, seed=tokens + 3 * heads)
    weight = random_tensor((head_dim,), dtype, seed=11)
    fn = ROW_REDUCTIONS.get(name) or ROW_EPILOGUES[name]
    heads_first = (lambda a: fn(a.transpose(1, 2))) if name in ROW_REDUCTIONS else (
        lambda a, w: fn(a.transpose(1, 2), w))
    inputs = (x,) if name in ROW_REDUCTIONS else (x, weight)
    region, grouped = compile_and_run(heads_first, *inputs)
    assert rows_per_partition(region) == expected_heads_per_partition(heads, head_dim)
    with unittest.mock.patch.object(reduction, "rows_beside_each_row", lambda *args: None):
        _, positions_grouped = compile_and_run(heads_first, *inputs)
    assert all(torch.equal(a, b) for a, b in zip(grouped, positions_grouped))
    if tokens * heads <= 1600:  # the sizes the tests above compare with eager
        check_against_eager(heads_first, *inputs, fp32_reference=dtype == torch.bfloat16 and name == "sum")


def test_grouped_heads_cut_a_heads_first_norms_dma_time(monkeypatch):
    from neuron_compile.kinds import reduction

    x = random_tensor((1, 256, 32, 64), torch.bfloat16, seed=12)
    weight = random_tensor((64,), torch.bfloat16, seed=13)

    def dma_time() -> float:
        with neuron_compile.record_launches() as launches:
            check_against_eager(lambda a, w: rms_norm(a.transpose(1, 2), w), x, weight)
        return sum(launch.report.busy_s_per_engine["dma"] for launch in launches)

    grouped = dma_time()
    monkeypatch.setattr(reduction, "rows_beside_each_row", lambda *args: None)  # consecutive positions grouped
    assert grouped < 0.4 * dma_time()

"""The rotary embedding of a Llama layer (``q * cos + rotate_half(q) * sin``) on the simulator against eager, and
the tile plans that keep its DMAs long: a pointwise kernel over [heads, seq, 64] takes the heads into its free axis
(kinds/pointwise.py ``widen_free``), so one DMA moves [128 rows, heads x 64] instead of [128, 64] per head; with no
outer dim (a q / k norm's epilogue over [tokens x heads, 128]) each partition takes several rows
(``rows_per_partition``)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import neuron_compile
from lowering_harness import check_against_eager, random_tensor
from neuron_compile import ir
from neuron_compile.hardware import get_target
from neuron_compile.kinds.pointwise import WIDE_FREE_MIN, plan_pointwise


def _head_major(heads: int, seq: int, dim: int, name: str = "q") -> ir.Load:
    """A [1, heads, seq, dim] view of a [seq, heads * dim] projection (the permuted q of a Llama layer)."""
    layout = ir.Layout((1, heads, seq, dim), (0, dim, heads * dim, 1))
    return ir.Load(name, layout, "float32")


def _pointwise(heads: int, seq: int, dim: int = 64) -> ir.Pointwise:
    domain = (1, heads, seq, dim)
    out = ir.Buffer("out", "float32", ir.Layout(domain, ir.contiguous_strides(domain)))
    cos = ir.Load("cos", ir.Layout(domain, (0, 0, dim, 1)), "float32")
    expr = ir.op("mul", _head_major(heads, seq, dim), cos)
    return ir.Pointwise("kernel", domain, (ir.Store(out, expr, out.layout),))


def test_short_rows_take_the_heads_into_the_free_axis():
    plan = plan_pointwise(_pointwise(32, 256), get_target("trn2"))
    assert plan.outer == () and plan.partition.size == 256
    assert [(dim.size, dim.tile) for dim in plan.free] == [(32, 32), (64, 64)]  # [128, 32 x 64] per tile


def test_long_rows_and_lone_dims_keep_one_free_dim():
    target = get_target("trn2")
    assert len(plan_pointwise(_pointwise(4, 256, dim=WIDE_FREE_MIN), target).free) == 1
    assert len(plan_pointwise(_pointwise(1, 256), target).free) == 1  # no outer dim to take in


def test_many_heads_are_walked_in_chunks_with_a_ragged_last_one():
    plan = plan_pointwise(_pointwise(200, 130), get_target("trn2"))
    heads = plan.free[0]
    assert heads.size == 200 and 1 < heads.tile < 200 and 200 % heads.tile  # a ragged last chunk


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(q_projection, cos, sin, heads: int):
    """transformers' apply_rotary_pos_emb on a [seq, heads * dim] projection viewed as [1, heads, seq, dim]."""
    seq = q_projection.shape[0]
    q = q_projection.view(1, seq, heads, -1).transpose(1, 2)
    return q * cos[None, None] + rotate_half(q) * sin[None, None]


def _rotary_inputs(heads: int, seq: int, dtype):
    q = random_tensor((seq, heads * 64), dtype, seed=1)
    angles = torch.arange(seq).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, 64, 2).float() / 64))[None]
    emb = torch.cat((angles, angles), dim=-1)
    return q, emb.cos().to(dtype), emb.sin().to(dtype)


def test_rotary_matches_eager_with_ragged_rows_and_many_heads():
    for heads, seq, dtype in ((4, 130, torch.float32), (200, 129, torch.float32), (8, 256, torch.bfloat16)):
        q, cos, sin = _rotary_inputs(heads, seq, dtype)
        check_against_eager(lambda a, c, s, h=heads: apply_rotary(a, c, s, h), q, cos, sin)


def _estimated_seconds(q, cos, sin) -> float:
    neuron_compile.reset_stats()
    check_against_eager(lambda a, c, s: apply_rotary(a, c, s, 16), q, cos, sin)
    return neuron_compile.stats()["est_time_s"]


def test_widened_tiles_cut_the_rotary_kernels_time(monkeypatch):
    from neuron_compile.kinds import pointwise

    inputs = _rotary_inputs(16, 256, torch.bfloat16)
    widened = _estimated_seconds(*inputs)
    monkeypatch.setattr(pointwise, "WIDE_FREE_MIN", 0)  # one 64-wide head per tile, as before
    assert widened < 0.6 * _estimated_seconds(*inputs)


def test_the_rotary_moves_each_input_once():
    """q is read once although both halves of the output read both its halves (the concat's parts share one loop
    nest and its loads), and cos / sin once although every head multiplies by them (one [rows, 32] load read
    through a step-0 view, not a DMA repeating them per head): HBM traffic is exactly inputs + output."""
    heads, seq = 16, 256
    q, cos, sin = _rotary_inputs(heads, seq, torch.bfloat16)
    neuron_compile.reset_stats()
    check_against_eager(lambda a, c, s: apply_rotary(a, c, s, heads), q, cos, sin)
    stats = neuron_compile.stats()
    moved = sum(t.numel() * t.element_size() for t in (q, cos, sin)) + q.numel() * q.element_size()
    assert stats["fallback_nodes"] == 0
    assert stats["hbm_bytes"] == moved


def _row_scaled(rows: int, width: int, dtype) -> ir.Pointwise:
    """``x * s`` over [rows, width]: a per-row statistic times the row (a q / k norm's epilogue)."""
    domain = (rows, width)
    out = ir.Buffer("out", dtype, ir.Layout(domain, ir.contiguous_strides(domain)))
    x = ir.Load("x", ir.Layout(domain, (width, 1)), dtype)
    statistic = ir.Load("s", ir.Layout(domain, (1, 0)), "float32")
    return ir.Pointwise("kernel", domain, (ir.Store(out, ir.op("mul", x, statistic), out.layout),))


def test_short_rows_with_no_outer_dim_put_several_rows_on_each_partition():
    target = get_target("trn2")
    plan = plan_pointwise(_row_scaled(2048, 128, "bfloat16"), target)  # tokens x heads rows of one 128-wide head
    assert plan.partition.size == 256 and [(dim.size, dim.tile) for dim in plan.free] == [(8, 8), (128, 128)]
    assert len(plan_pointwise(_row_scaled(2048, 256, "bfloat16"), target).free) == 1  # 512-byte rows: long enough
    assert len(plan_pointwise(_row_scaled(300, 128, "bfloat16"), target).free) == 1  # too few rows to group


def norm_epilogue(x, statistic, weight):
    return (x.float() * statistic * weight).to(x.dtype)


@settings(max_examples=10, deadline=None)
@given(rows=st.sampled_from([512, 513, 1030, 2048]), width=st.sampled_from([1, 3, 64, 128]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_rows_grouped_per_partition_match_eager(rows, width, dtype):
    x = random_tensor((rows, width), dtype, seed=1)
    statistic, weight = random_tensor((rows, 1), seed=2), random_tensor((width,), dtype, seed=3)
    check_against_eager(norm_epilogue, x, statistic, weight)


def test_rows_grouped_per_partition_cut_the_norm_epilogues_time(monkeypatch):
    from neuron_compile.kinds import pointwise

    inputs = (random_tensor((8192, 128), torch.bfloat16, seed=1), random_tensor((8192, 1), seed=2),
              random_tensor((128,), torch.bfloat16, seed=3))

    def estimated() -> float:
        neuron_compile.reset_stats()
        check_against_eager(norm_epilogue, *inputs)
        return neuron_compile.stats()["est_time_s"]

    grouped = estimated()
    monkeypatch.setattr(pointwise, "SHORT_ROW_BYTES", 0)  # one 256-byte row per partition per tile, as before
    assert grouped < 0.6 * estimated()


@settings(max_examples=6, deadline=None)
@given(seq=st.sampled_from([1, 127, 128, 129, 256]), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_the_rotary_written_into_an_empty_cache_is_one_kernel(seq, dtype):
    """A cache's first ``cat([past, k_rotated])`` with an empty past (transformers' first forward) copies the rotated
    keys: one part covering the output, lowered as a pointwise copy that joins the rotary's kernel, not a concat of
    its own re-reading rotate_half(k) from HBM. One kernel; from 127 rows on, HBM traffic exactly inputs + output."""
    heads = 4
    k, cos, sin = _rotary_inputs(heads, seq, dtype)
    past = torch.empty(1, heads, 0, 64, dtype=dtype)
    neuron_compile.reset_stats()
    region = check_against_eager(lambda p, a, c, s: torch.cat([p, apply_rotary(a, c, s, heads)], 2), past, k, cos, sin)
    stats = neuron_compile.stats()
    assert len(region.kernels) == 1 and stats["fallback_nodes"] == 0
    moved = sum(t.numel() * t.element_size() for t in (k, cos, sin)) + k.numel() * k.element_size()
    assert stats["hbm_bytes"] == moved or seq == 1  # (one row: cos / sin come per head, a [1, 64] row each)

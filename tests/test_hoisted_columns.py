"""Row-vector work hoisted out of a pointwise kernel's column loop (codegen/hoisted_columns.py, the pointwise
template): kernels that scale by a scalar input's reciprocal (AdamW's bias corrections) and by a per-row value
match eager over 1, 127, 128, 129 and ragged rows, with the (P, 1) loads and reciprocals issued once per row tile,
before the column loop; the hoist takes VectorE and DMA work off the cost model's estimate; an op over numbers alone
or a load that varies along the columns is never hoisted."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import neuron_compile
from lowering_harness import check_against_eager, compile_and_run, random_tensor
from neuron_compile import ir
from neuron_compile.codegen import expressions


def scaled_by_row_vectors(p, step_size, row_scale):
    """p / (1 - step_size) + p * (2 / row_scale): a 0-d input's and a per-row input's reciprocals, each the same
    in every column tile."""
    return p / (1 - step_size) + p * (row_scale.reciprocal() * 2.0)


def _inputs(rows, cols):
    row_scale = random_tensor((rows, 1), seed=3).abs() + 0.5
    return random_tensor((rows, cols), seed=1), torch.tensor(0.3), row_scale


def _update_kernel(region) -> str:
    """The source of the kernel that reads ``p`` (the graph's first input); the others compute the row vectors."""
    sources = [kernel.source for kernel in region.kernels if "arg0_1.ap(" in kernel.source]
    assert len(sources) == 1, [kernel.name for kernel in region.kernels]
    return sources[0]


@settings(max_examples=6, deadline=None)
@given(rows=st.sampled_from([1, 127, 128, 129, 300]), cols=st.sampled_from([64, 2049, 5001]))
def test_hoisted_row_vectors_match_eager(rows, cols):
    region = check_against_eager(scaled_by_row_vectors, *_inputs(rows, cols))
    source = _update_kernel(region)
    hoisted = source.index("# The same in every column tile")
    column_loop = source.index("for f0 in range(", hoisted)
    # both row vectors are loaded before the column loop, inside the row loop (the per-row one varies with p0)
    assert source.index("for p0 in range(") < hoisted
    reciprocals = [line for line in source.splitlines() if "nisa.reciprocal(" in line and "0:rows, 0:1]" in line]
    assert reciprocals and all(hoisted < source.index(line) < column_loop for line in reciprocals)


@pytest.mark.parametrize("rows, cols", [(129, 5001), (300, 64)])
def test_pipelined_and_plain_column_loops_match_eager(rows, cols):
    """Several column tiles (the software pipeline's stage functions read the hoisted tiles) and one column tile
    over three row tiles (the plain loop)."""
    check_against_eager(scaled_by_row_vectors, *_inputs(rows, cols))


def _busy(monkeypatch, hoisted: bool) -> dict[str, float]:
    if not hoisted:
        monkeypatch.setattr(expressions, "column_invariant", lambda expr, scope, known=None: False)
    with neuron_compile.record_launches() as launches:
        compile_and_run(scaled_by_row_vectors, *_inputs(128, 20000))
    reports = [launch.report for launch in launches if launch.report is not None]
    return {engine: sum(report.busy_s_per_engine.get(engine, 0.0) for report in reports)
            for engine in ("vector", "dma")}


def test_the_hoist_takes_per_tile_work_off_vector_and_dma(monkeypatch):
    hoisted = _busy(monkeypatch, True)
    per_tile = _busy(monkeypatch, False)
    assert hoisted["vector"] < per_tile["vector"] and hoisted["dma"] < per_tile["dma"], (hoisted, per_tile)


class _Scope:
    """What ``column_invariant`` reads of a scope: loads constant along the last dim are (P, 1) vectors."""

    @staticmethod
    def vector_pattern(load, tile):
        return None if load.layout.strides[-1] != 0 else ("dst", "src")


def test_only_row_vector_work_is_column_invariant():
    column = ir.Load("scale", ir.Layout((128, 512), (1, 0)), "float32")
    tile = ir.Load("x", ir.Layout((128, 512), (512, 1)), "float32")
    flags = ir.Load("mask", ir.Layout((128, 512), (1, 0)), "bool")
    scope = _Scope()
    assert expressions.column_invariant(ir.Op("reciprocal_alu", (column,)), scope)
    assert expressions.column_invariant(ir.Op("add", (ir.Op("mul", (column, ir.Scalar(2.0))), column)), scope)
    assert not expressions.column_invariant(ir.Op("mul", (column, tile)), scope)
    assert not expressions.column_invariant(ir.Op("abs", (ir.Scalar(-2.0),)), scope)  # numbers alone: a memset
    assert not expressions.column_invariant(ir.Op("mul", (column, ir.Op("abs", (ir.Scalar(-2.0),)))), scope)
    assert not expressions.column_invariant(flags, scope)

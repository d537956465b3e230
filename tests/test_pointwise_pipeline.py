"""The pointwise kind's software pipeline over column tiles (kinds/pointwise.py ``pipeline_stages``, the
pointwise template) and the engine balance that feeds it (codegen/engine_balance.py): kernels of several column
tiles, ragged last tile and ragged partitions included, match eager; the pipeline and the planned balance shorten
AdamW's update on the cost model's schedule."""

from __future__ import annotations

import pytest
import torch

import neuron_compile
from lowering_harness import check_against_eager, compile_and_run, random_tensor
from neuron_compile.codegen.engine_balance import EngineBalance
from neuron_compile.kinds import pointwise


def adam_like_update(p, m, v):
    """AdamW's parameter update with its sqrt written as 1 / rsqrt: two ALU reciprocals in a chain (the sqrt
    itself now takes GpSimd's rsqrt and a multiply)."""
    return p * 0.999 - 0.01 * m / (v.rsqrt().reciprocal() * 31.6 + 1e-8)


def _inputs(rows, cols, dtype):
    p, m, v = (random_tensor((rows, cols), dtype, seed=seed) for seed in (1, 2, 3))
    return p, m, v.abs()


@pytest.mark.parametrize("rows, cols", [(1, 5001), (127, 4100), (128, 5001), (129, 5001)])
def test_kernels_of_several_column_tiles_match_eager(rows, cols):
    region = check_against_eager(adam_like_update, *_inputs(rows, cols, torch.float32))
    source = "\n".join(kernel.source for kernel in region.kernels)
    if rows > 1:  # (a single row of 5001 goes on 3 partitions of 1667 columns: one column tile)
        assert "def first_stage(f0, cols):" in source and "second_stage(*previous)" in source


def test_one_column_tile_is_not_pipelined():
    region = check_against_eager(adam_like_update, *_inputs(130, 64, torch.float32))
    assert all("first_stage" not in kernel.source for kernel in region.kernels)


def _update_time(monkeypatch, pipelined: bool) -> float:
    if not pipelined:
        monkeypatch.setattr(pointwise, "pipeline_stages", lambda plan, body, halfway: None)
    inputs = _inputs(128, 8000, torch.bfloat16)
    with neuron_compile.record_launches() as launches:
        compile_and_run(adam_like_update, *inputs)
    return sum(launch.report.est_time_s for launch in launches if launch.report is not None)


def test_the_pipeline_shortens_a_chain_of_reciprocals(monkeypatch):
    pipelined = _update_time(monkeypatch, True)
    serial = _update_time(monkeypatch, False)
    assert pipelined < 0.9 * serial, (pipelined, serial)


def test_the_planned_balance_gives_each_engine_one_of_two_reciprocals():
    """Online, three small instructions first left VectorE loaded, and both 8-cycle reciprocals went where the
    rule sent them one at a time; planned, the longest go first, one to each engine."""
    online = EngineBalance()
    small = {"vector": 1.0, "gpsimd": 0.8, "scalar": 0.8}
    reciprocal = {"vector": 8.0, "gpsimd": 6.4}
    for costs in (small, small, small, reciprocal, reciprocal):
        online.choose(costs)
    replay = online.planned()
    replay.lines = []
    engines = []
    for costs in (small, small, small, reciprocal, reciprocal):
        engines.append(replay.choose(costs))
        replay.lines.append(f"instruction {len(replay.lines)}")
    assert sorted(engines[3:]) == ["gpsimd", "vector"]
    assert max(replay.load.values()) < max(online.load.values())
    assert replay.halfway_line == 4  # the first reciprocal takes the issued work past half: the stages split after it

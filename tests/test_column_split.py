"""An instruction split by columns between two engines (codegen/engine_balance.py ``choose_split``,
codegen/expressions.py ``column_parts``), and column tiles sized by the SBUF a body's tiles take
(kinds/pointwise.py ``measured_plan``).

AdamW's update, split (its ALU reciprocal mostly on GpSimd, the rest of the columns on VectorE), equals eager's
``torch.optim.AdamW(foreach=True)`` (which the repository's tests take as the reference, fused=False) over sizes 1,
127, 128, 129, 300 and ragged two-dimensional ones, fp32 and bf16 parameters, weight decay on and off, amsgrad, and
the split form equals the unsplit one bit for bit; the planned split's arithmetic. A long body of bf16 tiles gets
wider column tiles than one fp32 tile per op allows, and AdamW's update, whose values in PSUM take a bank per
tile, gets wider ones within a bank."""

from __future__ import annotations

import re

import pytest
import torch
from adamw_harness import adamw_step
from hypothesis import given, settings
from hypothesis import strategies as st
from lowering_harness import TOLERANCES, check_against_eager, compile_and_run, random_tensor

import neuron_compile
from neuron_compile.codegen.engine_balance import SPLIT_STEPS, EngineBalance
from neuron_compile.codegen.expressions import column_parts

SPLIT_RECIPROCAL = re.compile(r"reciprocal\(dst=\w+\[0:rows, cols \* (\d+) // 32:cols\]")


def _dumped_sources(tmp_path) -> str:
    return "\n".join(path.read_text() for path in tmp_path.rglob("*.py"))


def _check_against_eager(shape, dtype, amsgrad, weight_decay, tmp_path):
    with neuron_compile.config.patch(dump_dir=str(tmp_path)):
        got = adamw_step(shape, dtype, amsgrad, weight_decay, compiled=True)
    want = adamw_step(shape, dtype, amsgrad, weight_decay, compiled=False)
    rtol, atol = TOLERANCES[dtype]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol)
    return _dumped_sources(tmp_path)


@settings(max_examples=8, deadline=None)
@given(shape=st.sampled_from([(1,), (127,), (128,), (129,), (300,), (3, 129), (129, 130), (130, 1100)]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       options=st.sampled_from([(False, 0.0), (False, 0.1), (True, 0.1)]))
def test_adamw_with_its_reciprocal_split_equals_eager(shape, dtype, options, tmp_path_factory):
    _check_against_eager(shape, dtype, *options, tmp_path_factory.mktemp("dump"))


def test_the_split_reciprocal_is_emitted_and_equals_the_unsplit_form_bit_for_bit(tmp_path, monkeypatch):
    # bf16 parameters (an fp32 update's plan keeps its reciprocal whole on VectorE at this size)
    dtype = torch.bfloat16
    sources = _check_against_eager((130, 1100), dtype, False, 0.1, tmp_path / "split")
    shares = SPLIT_RECIPROCAL.findall(sources)
    assert shares and all(0 < int(share) < SPLIT_STEPS for share in shares)
    split = adamw_step((130, 1100), dtype, False, 0.1, compiled=True)
    monkeypatch.setattr(EngineBalance, "_splits", lambda self, plan, loads: {})
    with neuron_compile.config.patch(dump_dir=str(tmp_path / "whole")):
        whole = adamw_step((130, 1100), dtype, False, 0.1, compiled=True)
    assert not SPLIT_RECIPROCAL.findall(_dumped_sources(tmp_path / "whole"))
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    for a, b in zip(split, whole):
        assert torch.equal(a.view(bits), b.view(bits))


def _planned(costs: list[dict[str, float]], splittable: set[int]) -> EngineBalance:
    online = EngineBalance()
    for index, cost in enumerate(costs):
        if index in splittable:
            online.choose_split(cost)
        else:
            online.choose(cost)
    return online.planned()


def test_the_plan_moves_the_share_of_columns_that_evens_the_busiest_engine_with_another():
    # GpSimd takes the reciprocal whole (6.4 against VectorE's 8), VectorE has 5 of fixed-choice work
    costs = [{"vector": 5.0}, {"vector": 8.0, "gpsimd": 6.4}]
    whole = _planned(costs, set())
    assert whole.expected == pytest.approx({"vector": 5.0, "gpsimd": 6.4, "scalar": 0.0})
    split = _planned(costs, {1})
    # moving x of the columns: 6.4 (1 - x) = 5 + 8 x, x = 1.4 / 14.4, rounded down to 3 / 32
    assert split.splits == {1: ("vector", SPLIT_STEPS - 3)}
    assert split.expected["gpsimd"] == pytest.approx(6.4 * 29 / 32)
    assert split.expected["vector"] == pytest.approx(5.0 + 8.0 * 3 / 32)
    # the replay charges the two parts as planned
    replay = split
    replay.choose({"vector": 5.0})
    assert replay.choose_split(costs[1]) == ("gpsimd", "vector", SPLIT_STEPS - 3)
    assert replay.load == pytest.approx(split.expected)


def test_an_instruction_off_the_busiest_engine_or_with_nothing_to_gain_is_not_split():
    # VectorE is busiest with fixed work: the reciprocal on GpSimd is not split onto it
    assert _planned([{"vector": 20.0}, {"vector": 8.0, "gpsimd": 6.4}], {1}).splits == {}
    # the loads are already within a 32nd of the instruction of each other
    assert _planned([{"vector": 6.3}, {"vector": 8.0, "gpsimd": 6.4}], {1}).splits == {}
    # one candidate engine: nothing to split onto
    assert _planned([{"vector": 8.0}], {0}).splits == {}


def test_column_parts_cut_every_operand_at_the_same_share():
    parts = column_parts(("gpsimd", "vector", 28), "out_1[0:rows, 0:cols]", "x_2[0:rows, 0:cols]")
    assert parts == [("gpsimd", "out_1[0:rows, 0:cols * 28 // 32]", "x_2[0:rows, 0:cols * 28 // 32]"),
                     ("vector", "out_1[0:rows, cols * 28 // 32:cols]", "x_2[0:rows, cols * 28 // 32:cols]")]
    assert column_parts(("vector", None, SPLIT_STEPS), "out_1[0:rows, 0:cols]") == [("vector",
                                                                                     "out_1[0:rows, 0:cols]")]


def _column_tile(region) -> int:
    plans = re.findall(r"Tile plan: pointwise: outer \[[^\]]*\] partition \S+ free \[(\d+)/(\d+)\]",
                       "\n".join(kernel.source for kernel in region.kernels))
    return max(int(tile) for _, tile in plans)


def long_bf16_chain(x, y):
    for step in range(12):
        x = (x * y + step).to(torch.bfloat16)
    return x


@pytest.mark.parametrize("shape", [(128, 12000), (129, 9001), (3, 127, 5000)])
def test_a_body_of_bf16_tiles_gets_the_column_tiles_its_sbuf_allows(shape, monkeypatch):
    inputs = [random_tensor(shape, torch.bfloat16, seed=seed, low=0.5, high=1.0) for seed in range(2)]
    region = check_against_eager(long_bf16_chain, *inputs)  # ragged last row and column tiles included
    measured = _column_tile(region)
    monkeypatch.setattr("neuron_compile.kinds.pointwise.measured_plan", lambda node, plan, target: plan)
    counted_region, _ = compile_and_run(long_bf16_chain, *inputs)
    assert measured > _column_tile(counted_region)


def _update_column_tile(tmp_path) -> int:
    with neuron_compile.config.patch(dump_dir=str(tmp_path)):
        _check_against_eager((128, 4096), torch.bfloat16, False, 0.1, tmp_path)
    sources = _dumped_sources(tmp_path)
    update = max(re.findall(r"free \[4096/(\d+)\]", sources), key=int)
    assert "buffer=nl.psum" in sources
    return int(update)


def test_adamw_update_gets_wider_column_tiles_within_a_psum_bank(tmp_path, monkeypatch):
    measured = _update_column_tile(tmp_path / "measured")
    monkeypatch.setattr("neuron_compile.kinds.pointwise.measured_plan", lambda node, plan, target: plan)
    counted = _update_column_tile(tmp_path / "counted")
    assert counted < measured <= 512

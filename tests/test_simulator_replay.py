"""The simulator's replay (runtime/simulator/replay.py): a kernel launched again with the shapes and dtypes of an
earlier launch runs the numpy work that launch recorded. Every kernel kind, compiled from torch, is replayed on new
values (special values and bf16 rounding included) and compared bit for bit with a full simulation of the same
launch; values a replay must still check (indirect offsets, activation input ranges) raise as the full simulation
does; a new shape or dtype is validated again; what cannot be replayed is refused with its reason and simulated in
full."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lowering_harness import compile_and_run
from neuron_compile import config
from neuron_compile.hardware import Target, get_target
from neuron_compile.runtime import simulator as nki
from neuron_compile.runtime.simulator import replay
from neuron_compile.runtime.simulator.errors import NkiValidationError
from simulator_tiles import load_tile, store_tile

nl = nki.language
nisa = nki.isa
SPECIAL_VALUES = (float("nan"), float("inf"), float("-inf"), -0.0, 1e-40, 3.0e38, -1.5)


def _bits(array: np.ndarray) -> bytes:
    return np.ascontiguousarray(array).view(np.uint8).tobytes()


@pytest.fixture
def checked_replays(monkeypatch) -> list[str]:
    """From now on, every launch that replays a plan is also simulated in full on copies of its arguments, and the
    outputs (and written arguments) must be the same bits; the list names the kernels replayed."""
    replayed, run_kernel = [], nki.run_kernel

    def checked(fn, args, **kwargs):
        target = kwargs.get("target")
        name = (target if isinstance(target, Target) else get_target(target)).name
        signature = replay.launch_signature(args, name, kwargs.get("lnc", 1))
        body = fn.fn if isinstance(fn, nki.Kernel) else fn  # plans are kept per kernel function
        plan = replay.known(body, signature) if kwargs.get("replay") and signature else None
        copies = [np.array(argument) for argument in args]
        run = run_kernel(fn, args, **kwargs)
        if isinstance(plan, replay.ReplayPlan) and not kwargs.get("trace", True):
            full = run_kernel(fn, copies, **{**kwargs, "replay": False})
            assert [_bits(a) for a in run.outputs] == [_bits(a) for a in full.outputs]
            assert [_bits(a) for a in args] == [_bits(a) for a in copies]
            replayed.append(fn.__name__)
        return run

    monkeypatch.setattr(nki, "run_kernel", checked)
    return replayed


def _values(shape, dtype, seed: int, special: bool) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=generator)
    if special:
        flat = values.view(-1)
        flat[: len(SPECIAL_VALUES)] = torch.tensor(SPECIAL_VALUES)[: flat.numel()]
    return values.to(dtype)


def _indices(shape, high: int, seed: int) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


# kind -> (function, argument makers (seed, special values) -> tensor); the kernel of that kind must be in the region
CASES = {
    "pointwise": (lambda x, y: torch.sigmoid(x) * y + torch.exp(x).clamp(max=3.0), [(129, 67), (129, 67)]),
    "reduction": (lambda x: (x.sum(-1), x.amax(0)), [(130, 70)]),
    "row_normalize": (lambda x, w: (torch.softmax(x, -1), F.layer_norm(x, (96,), w)), [(127, 96), (96,)]),
    "scan": (lambda x: torch.cumsum(x, 1), [(5, 300)]),
    "matmul": (lambda x, w, b: torch.addmm(b, x, w), [(129, 160), (160, 70), (70,)]),
    "attention": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                  [(1, 2, 130, 32)] * 3),
    "attention_decode": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
                         [(1, 2, 1, 32), (1, 2, 300, 32), (1, 2, 300, 32)]),
    "concat": (lambda x, y: torch.cat([x, y * 2], 0), [(33, 40), (20, 40)]),
    "gather": (lambda w, i: F.embedding(i, w), [(50, 24), ("index", (3, 17), 50)]),
    "scatter": (lambda x, i, s: x.index_add(0, i, s), [(40, 8), ("index", (60,), 40), (60, 8)]),
}
KERNEL_NAMES = {"attention_decode": "attention_kernel", "row_normalize": "normalize"}


def _arguments(shapes, dtype, seed: int, special: bool) -> list[torch.Tensor]:
    made = []
    for number, shape in enumerate(shapes):
        if shape[0] == "index":
            made.append(_indices(shape[1], shape[2], seed + number))
        else:
            made.append(_values(shape, dtype, seed + number, special))
    return made


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", list(CASES))
def test_a_replay_of_every_kind_is_bit_identical_to_its_full_simulation(kind, dtype, checked_replays):
    if dtype == torch.bfloat16 and kind in ("scan", "attention_decode", "concat", "gather"):
        pytest.skip("bf16 is covered by the kinds with engine arithmetic and matmuls")
    function, shapes = CASES[kind]
    with config.patch(replay=True, fallback="raise"):
        region, _ = compile_and_run(function, *_arguments(shapes, dtype, 0, special=False))
        assert any(KERNEL_NAMES.get(kind, kind) in source.name for source in region.kernels), region.kernels
        region(*_arguments(shapes, dtype, 10, special=True))
    assert checked_replays, "the second call did not replay"


def test_a_training_step_replays_the_attention_backward_bit_identically(checked_replays):
    def step(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).square().sum()

    compiled = torch.compile(step, backend="neuron", fullgraph=True)
    with config.patch(replay=True, fallback="raise"):
        for seed in (0, 10, 20):
            inputs = [_values((1, 2, 130, 32), torch.float32, seed + n, special=False).requires_grad_()
                      for n in range(3)]
            compiled(*inputs).backward()
    assert any("backward" in name or "region" in name for name in checked_replays)
    assert len(checked_replays) >= 4  # forward and backward, at the second and third steps


# ------------------------------------------------------------------------------------------------ hand-written
def _gather_kernel(table, offsets):
    index = load_tile(offsets)
    rows = nl.ndarray((offsets.shape[0], table.shape[1]), table.dtype)
    nisa.dma_copy(rows, table.ap([[table.shape[1], offsets.shape[0]], [1, table.shape[1]]], offset=0,
                                 vector_offset=index, indirect_dim=0))
    return store_tile(rows)


def _log_kernel(x):
    tile = load_tile(x)
    out = nl.ndarray(x.shape, x.dtype)
    nisa.activation(out, nl.log, tile)
    return store_tile(out)


def _launch(kernel, *arrays):
    return nki.run_kernel(kernel, list(arrays), trace=False, replay=True)


def test_replayed_indirect_offsets_are_read_and_bounds_checked_at_every_launch():
    table = np.arange(40, dtype=np.float32).reshape(10, 4)
    first = _launch(_gather_kernel, table, np.array([[1], [3], [5]], dtype=np.int32))
    np.testing.assert_array_equal(first.outputs[0], table[[1, 3, 5]])
    assert isinstance(replay.known(_gather_kernel, replay.launch_signature(
        [table, np.zeros((3, 1), np.int32)], get_target().name, 1)), replay.ReplayPlan)
    again = _launch(_gather_kernel, table, np.array([[9], [0], [9]], dtype=np.int32))
    np.testing.assert_array_equal(again.outputs[0], table[[9, 0, 9]])
    with pytest.raises(NkiValidationError, match="err_tensor_access_out_of_bound"):
        _launch(_gather_kernel, table, np.array([[1], [10], [2]], dtype=np.int32))


def test_replayed_activation_inputs_are_range_checked_at_every_launch():
    valid = np.full((4, 8), 2.0, dtype=np.float32)
    np.testing.assert_array_equal(_launch(_log_kernel, valid).outputs[0], np.log(valid))
    np.testing.assert_array_equal(_launch(_log_kernel, valid * 4).outputs[0], np.log(valid * 4))
    with pytest.raises(NkiValidationError, match="err_activation_input_out_of_range"):
        _launch(_log_kernel, np.zeros((4, 8), dtype=np.float32))


def test_unwritten_memory_reads_as_nan_at_every_replay_even_when_a_tile_reuses_an_array():
    def partly_written(x):
        outputs = []
        for block in range(3):  # the third tile takes the first one's array (released by then)
            tile = nl.ndarray(x.shape, x.dtype)
            nisa.dma_copy(tile[:, 2 * block:2 * block + 2], x[:, 2 * block:2 * block + 2])
            outputs.append(store_tile(tile))
        return tuple(outputs)

    for seed in range(3):
        x = np.random.default_rng(seed).standard_normal((4, 6)).astype(np.float32)
        for block, output in enumerate(_launch(partly_written, x).outputs):
            written = slice(2 * block, 2 * block + 2)
            np.testing.assert_array_equal(output[:, written], x[:, written])
            assert np.isnan(np.delete(output, np.r_[written], axis=1)).all()


def test_a_dma_compute_sum_replays_on_new_values():
    def summed(x, y):
        out = nl.ndarray(x.shape, nl.bfloat16, buffer=nl.shared_hbm)
        nisa.dma_compute(out, [load_tile(x), load_tile(y)], nl.add)  # fp32 sum, rounded to bf16 on the way to HBM
        return out

    for seed in range(3):
        x, y = (np.random.default_rng(seed + i).standard_normal((5, 7)).astype(np.float32) for i in (0, 10))
        np.testing.assert_array_equal(_launch(summed, x, y).outputs[0], (x + y).astype(nl.bfloat16))
    plan = replay.known(summed, replay.launch_signature([x, y], get_target().name, 1))
    assert isinstance(plan, replay.ReplayPlan)


def test_a_new_shape_or_dtype_is_validated_and_recorded_again():
    def widen(x):
        tile = load_tile(x)
        out = nl.ndarray(x.shape, nl.float32)
        nisa.tensor_copy(out, tile)
        return store_tile(out)

    for rows in (4, 4, 128, 128):
        x = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)
        np.testing.assert_array_equal(_launch(widen, x).outputs[0], x)
    bf16 = np.arange(12, dtype=np.float32).reshape(4, 3).astype(nl.bfloat16)
    np.testing.assert_array_equal(_launch(widen, bf16).outputs[0], bf16.astype(np.float32))
    with pytest.raises(NkiValidationError, match="err_num_partition_exceed_arch_limit"):
        _launch(widen, np.zeros((129, 3), dtype=np.float32))
    target = get_target().name
    plans = [replay.known(widen, replay.launch_signature([x], target, 1)) for x in
             (np.zeros((4, 3), np.float32), np.zeros((128, 3), np.float32), bf16)]
    assert all(isinstance(plan, replay.ReplayPlan) for plan in plans) and len({id(p) for p in plans}) == 3


def test_a_kernel_reading_values_outside_an_instruction_is_refused_and_simulated_in_full():
    def data_dependent(x):
        tile = load_tile(x)
        out = nl.ndarray(x.shape, x.dtype)
        nisa.memset(out, float(np.asarray(tile)[0, 0]))  # a value the kernel's Python reads
        return store_tile(out)

    for value in (1.0, 2.0, 3.0):
        x = np.full((2, 2), value, dtype=np.float32)
        np.testing.assert_array_equal(_launch(data_dependent, x).outputs[0], x)
    reason = replay.known(data_dependent, replay.launch_signature([x], get_target().name, 1))
    assert isinstance(reason, str) and "outside an instruction's step" in reason


def test_an_instruction_without_a_step_is_refused():
    def stats(x):
        tile = load_tile(x)
        out = nl.ndarray((x.shape[0], 6), nl.float32)
        nisa.bn_stats(out, tile)
        return store_tile(out)

    x = np.ones((4, 8), dtype=np.float32)
    first, again = _launch(stats, x), _launch(stats, x * 2)
    np.testing.assert_array_equal(again.outputs[0][:, 1], np.full(4, 2.0, np.float32))
    assert first.plan == replay.known(stats, replay.launch_signature([x], get_target().name, 1))
    assert isinstance(first.plan, str) and "sbuf" in first.plan  # bn_stats reads its data tile itself


def test_the_switch_turns_replay_off():
    from neuron_compile.runtime.launcher import select_launcher

    with config.patch(replay=False):
        assert select_launcher(target="trn2").replay is False
    with config.patch(replay=True):
        assert select_launcher(target="trn2").replay is True
    with pytest.raises(ValueError, match="replay"):
        config.Config().replace(replay="sometimes")

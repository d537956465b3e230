"""LNC=2 launches on the simulator: the two programs run as concurrent NeuronCores sharing HBM, so core_barrier
and sendrecv synchronize and exchange data between them, deterministically; mismatched or missing partners are
named errors, not hangs."""

from __future__ import annotations

import numpy as np
import pytest

from neuron_compile.runtime import simulator as nki
from neuron_compile.runtime.simulator import cost
from neuron_compile.runtime.simulator.errors import NkiValidationError

nl = nki.language
nisa = nki.isa
F32 = np.float32


def _half_then_whole(x):
    """Each core scales its half of the rows into a shared tensor, then reads the other core's half."""
    rows = x.shape[0] // 2
    me = nl.program_id(0)
    shared = nl.ndarray(x.shape, F32, buffer=nl.shared_hbm)
    tile = nl.ndarray((rows, x.shape[1]), F32)
    nisa.dma_copy(tile, x[me * rows:(me + 1) * rows, :])
    nisa.tensor_scalar(tile, tile, nl.multiply, 2.0)
    nisa.dma_copy(shared[me * rows:(me + 1) * rows, :], tile)
    nisa.core_barrier(shared, (0, 1))
    other = nl.ndarray((rows, x.shape[1]), F32)
    nisa.dma_copy(other, shared[(1 - me) * rows:(2 - me) * rows, :])
    out = nl.ndarray(x.shape, F32, buffer=nl.shared_hbm)
    nisa.dma_copy(out[me * rows:(me + 1) * rows, :], other)
    return shared, out


def test_core_barrier_makes_each_cores_writes_visible_to_the_other():
    x = np.arange(64, dtype=F32).reshape(8, 8)
    shared, swapped = nki.run_kernel(_half_then_whole, [x], lnc=2).outputs
    np.testing.assert_array_equal(shared, 2 * x)
    np.testing.assert_array_equal(swapped, np.concatenate([2 * x[4:], 2 * x[:4]]))


def test_lnc2_launches_are_deterministic():
    x = np.arange(64, dtype=F32).reshape(8, 8)
    names = [[(r.name, r.program) for r in nki.run_kernel(_half_then_whole, [x], lnc=2).trace] for _ in range(3)]
    assert names[0] == names[1] == names[2]


def test_core_barrier_with_one_program_passes():
    x = np.ones((4, 4), F32)

    def kernel(a):
        out = nl.ndarray(a.shape, F32, buffer=nl.shared_hbm)
        nisa.dma_copy(out, a)
        nisa.core_barrier(out, (0, 1))
        return out

    np.testing.assert_array_equal(nki.run_kernel(kernel, [x]).outputs[0], x)


@pytest.mark.parametrize("dma_engine", [None, "gpsimd_dma"])
def test_sendrecv_swaps_tiles_between_the_cores(dma_engine):
    x = np.arange(2 * 16 * 8, dtype=F32).reshape(2, 16, 8)

    def kernel(a):
        me = nl.program_id(0)
        mine, theirs = nl.ndarray((16, 8), F32), nl.ndarray((16, 8), F32)
        nisa.dma_copy(mine, a[me])
        engine = getattr(nisa.dma_engine, dma_engine) if dma_engine else nisa.dma_engine.dma
        nisa.sendrecv(mine, theirs, send_to_rank=1 - me, recv_from_rank=1 - me, pipe_id=0, dma_engine=engine)
        out = nl.ndarray((2, 16, 8), F32, buffer=nl.shared_hbm)
        nisa.dma_copy(out[me], theirs)
        return out

    np.testing.assert_array_equal(nki.run_kernel(kernel, [x], lnc=2).outputs[0], x[::-1])


def test_a_barrier_one_core_never_reaches_is_a_deadlock_error():
    def kernel():
        shared = nl.ndarray((2, 2), F32, buffer=nl.shared_hbm)
        shared.write(np.zeros((2, 2), F32))
        if nl.program_id(0) == 0:
            nisa.core_barrier(shared, (0, 1))
        return shared

    with pytest.raises(NkiValidationError, match="err_lnc_deadlock"):
        nki.run_kernel(kernel, [], lnc=2)


def test_cores_meeting_at_different_points_is_an_error():
    def kernel():
        shared = nl.ndarray((2, 2), F32, buffer=nl.shared_hbm)
        shared.write(np.zeros((2, 2), F32))
        tile, other = nl.zeros((2, 2), F32), nl.ndarray((2, 2), F32)
        if nl.program_id(0) == 0:
            nisa.core_barrier(shared, (0, 1))
        else:
            nisa.sendrecv(tile, other, 0, 0, pipe_id=0)
        return shared

    with pytest.raises(NkiValidationError, match="err_lnc_mismatched_sync"):
        nki.run_kernel(kernel, [], lnc=2)


def test_a_failing_core_stops_the_launch_with_its_error():
    def kernel():
        shared = nl.ndarray((2, 2), F32, buffer=nl.shared_hbm)
        shared.write(np.zeros((2, 2), F32))
        if nl.program_id(0) == 1:
            nl.ndarray((256, 2), F32)  # more partitions than the hardware has
        nisa.core_barrier(shared, (0, 1))
        return shared

    with pytest.raises(NkiValidationError, match="err_num_partition_exceed_arch_limit"):
        nki.run_kernel(kernel, [], lnc=2)


@pytest.mark.parametrize("bad, rule", [
    (lambda: nisa.sendrecv(nl.zeros((2, 2), F32), nl.ndarray((2, 2), F32), 1, 1, 0), "err_sendrecv_rank"),
    (lambda: nisa.sendrecv(nl.zeros((2, 2), F32), nl.ndarray((2, 3), F32), 1, 1, 0), "err_sendrecv_shape"),
    (lambda: nisa.sendrecv(nl.zeros((2, 300), F32), nl.ndarray((2, 300), F32), 1, 1, 0,
                           dma_engine=nisa.dma_engine.gpsimd_dma), "err_sendrecv_gpsimd_dma_size"),
    (lambda: nisa.core_barrier(nl.zeros((2, 2), F32), (0, 1)), "err_core_barrier_data"),
    (lambda: nisa.core_barrier(nl.ndarray((2, 2), F32, buffer=nl.shared_hbm), (0, 2)), "err_core_barrier_cores"),
])
def test_lnc_instruction_limits(bad, rule):
    with pytest.raises(NkiValidationError) as info:
        nki.run_kernel(lambda: bad(), [])
    assert info.value.rule == rule


def test_lnc_instructions_need_neuroncore_v3():
    with pytest.raises(NkiValidationError, match="err_unsupported_arch"):
        nki.run_kernel(lambda: nisa.core_barrier(nl.ndarray((2, 2), F32, buffer=nl.shared_hbm), (0, 1)), [],
                       target="trn1")


def test_the_schedule_joins_the_cores_at_a_barrier():
    def kernel():
        shared = nl.ndarray((128, 2048), F32, buffer=nl.shared_hbm)
        tile = nl.zeros((128, 2048), F32)
        if nl.program_id(0) == 0:  # core 0 works long before the barrier, core 1 does not
            for _ in range(20):
                nisa.activation(tile, nl.exp, tile)
        nisa.dma_copy(shared, tile)
        nisa.core_barrier(shared, (0, 1))
        nl.zeros((128, 8), F32, name="after_barrier")
        return shared

    run = nki.run_kernel(kernel, [], lnc=2)
    plan = cost.launch_schedule(run.trace)
    barrier_ends = [t.end_ns for r, t in zip(run.trace, plan.timings) if r.name == "core_barrier"]
    core1_after = [t.start_ns for r, t in zip(run.trace, plan.timings)
                   if r.program == 1 and r.name == "memset" and r.dst.shape == (128, 8)]
    assert core1_after and min(core1_after) >= max(barrier_ends)

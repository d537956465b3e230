"""The simulator's gather, index and cross-partition instructions (local_gather, nc_n_gather, sequence_bounds,
nonzero_with_count, nc_stream_shuffle, nc_match_replace8) against numpy goldens over hypothesis-drawn shapes
and dtypes, and the named errors of their documented limits."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neuron_compile.runtime import simulator as nki
from neuron_compile.runtime.simulator import cost
from neuron_compile.runtime.simulator.errors import NkiValidationError
from simulator_tiles import load_tile, store_tile

nl = nki.language
nisa = nki.isa
F32 = np.float32
dtypes = st.sampled_from([np.dtype(np.float32), nl.bfloat16, np.dtype(np.int32), np.dtype(np.uint16)])


def _run(kernel, *arrays):
    run = nki.run_kernel(kernel, arrays)
    return run.outputs[0] if len(run.outputs) == 1 else run.outputs


def _values(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 1000, size=shape).astype(dtype)


@settings(max_examples=15, deadline=None)
@given(cores=st.integers(1, 8), free=st.sampled_from([32, 64, 200]), per_partition=st.integers(1, 4),
       elements=st.sampled_from([1, 2, 4, 8]), dtype=dtypes, data=st.data())
def test_local_gather_matches_the_documented_numpy(cores, free, per_partition, elements, dtype, data):
    p = 16 * cores
    src = _values((p, free * elements), dtype, 1)
    slots = np.random.default_rng(2).integers(0, free, size=(p, per_partition))
    index = (slots * elements).astype(np.uint16)
    valid = data.draw(st.integers(1, 16 * per_partition))

    def kernel(s, i):
        out = nl.ndarray((p, valid, elements), s.dtype)
        nisa.local_gather(out, load_tile(s), load_tile(i), num_elem_per_idx=elements, num_valid_indices=valid)
        return store_tile(out)

    got = _run(kernel, src, index)
    want = np.empty((p, valid, elements), dtype=src.dtype)
    rows = src.reshape(p, free, elements)
    for core in range(cores):
        block = slice(16 * core, 16 * core + 16)
        order = slots[block].flatten(order="F")[:valid]
        want[block] = np.take(rows[block], order, axis=1)
    np.testing.assert_array_equal(got, want)


@settings(max_examples=15, deadline=None)
@given(p=st.integers(1, 128), shape=st.sampled_from([(7,), (4, 9), (2, 3, 5)]), count=st.integers(1, 40), dtype=dtypes)
def test_nc_n_gather_indexes_each_partition_flattened(p, shape, count, dtype):
    data = _values((p, *shape), dtype, 3)
    free = int(np.prod(shape))
    indices = np.random.default_rng(4).integers(0, free, size=(p, count)).astype(np.uint32)

    def kernel(d, i):
        out = nl.ndarray((p, count), d.dtype)
        nisa.nc_n_gather(out, load_tile(d), load_tile(i))
        return store_tile(out)

    np.testing.assert_array_equal(_run(kernel, data, indices), np.take_along_axis(data.reshape(p, -1), indices, 1))


def _documented_sequence_bounds(sequence):
    """The SDK example's loop, element by element."""
    n = len(sequence)
    low, high = np.zeros(n), np.zeros(n)
    low[0] = 0 if sequence[0] != 0 else n
    for i in range(1, n):
        low[i] = n if sequence[i] == 0 else (low[i - 1] if sequence[i] == sequence[i - 1] else i)
    high[-1] = n if sequence[-1] != 0 else -1
    for i in range(n - 2, -1, -1):
        high[i] = -1 if sequence[i] == 0 else (high[i + 1] if sequence[i] == sequence[i + 1] else i + 1)
    return np.stack([low, high])


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 300), segments=st.integers(1, 12), dtype=st.sampled_from([np.float32, np.int32]))
def test_sequence_bounds_matches_the_documented_loop(n, segments, dtype):
    ids = np.sort(np.random.default_rng(n).integers(0, segments, size=n)).astype(dtype)[None, :]

    def kernel(s):
        out = nl.ndarray((1, 2, n), s.dtype)
        nisa.sequence_bounds(out, load_tile(s))
        return store_tile(out)

    np.testing.assert_array_equal(_run(kernel, ids)[0], _documented_sequence_bounds(ids[0]).astype(dtype))


def test_sequence_bounds_example_of_the_documentation():
    ids = np.array([[0, 1, 1, 2, 2, 2, 0, 3, 3]], dtype=np.int32)

    def kernel(s):
        out = nl.ndarray((1, 2, 9), nl.int32)
        nisa.sequence_bounds(out, load_tile(s))
        return store_tile(out)

    np.testing.assert_array_equal(_run(kernel, ids)[0], [[9, 1, 1, 3, 3, 3, 9, 7, 7], [-1, 3, 3, 6, 6, 6, -1, 9, 9]])


@settings(max_examples=15, deadline=None)
@given(t=st.integers(1, 200), offset=st.integers(-50, 50), dtype=st.sampled_from([np.float32, np.int32]))
def test_nonzero_with_count_on_each_cores_first_partition(t, offset, dtype):
    src = (np.random.default_rng(t).random((128, t)) < 0.3).astype(dtype) * 3

    def kernel(s):
        out = nl.ndarray((128, t + 1), nl.int32)
        nisa.memset(out, 7)
        nisa.nonzero_with_count(out, load_tile(s), index_offset=offset, padding_val=-9)
        return store_tile(out)

    got = _run(kernel, src)
    for row in range(128):
        if row % 16:
            assert (got[row] == 7).all()  # other partitions are not written
            continue
        found = np.flatnonzero(src[row]) + offset
        want = np.full(t + 1, -9)
        want[:found.size], want[-1] = found, found.size
        np.testing.assert_array_equal(got[row], want)


@settings(max_examples=15, deadline=None)
@given(quadrants=st.integers(1, 4), free=st.sampled_from([1, 5, 64]), dtype=dtypes, data=st.data())
def test_nc_stream_shuffle_moves_partitions_within_quadrants(quadrants, free, dtype, data):
    p = 32 * quadrants
    mask = data.draw(st.lists(st.sampled_from(list(range(32)) + [255]), min_size=32, max_size=32))
    src = _values((p, free), dtype, 5)
    old = _values((p, free), dtype, 6)

    def kernel(s, d):
        out = load_tile(d)
        nisa.nc_stream_shuffle(out, load_tile(s), mask)
        return store_tile(out)

    want = old.copy()
    for row in range(p):
        if mask[row % 32] != 255:
            want[row] = src[row - row % 32 + mask[row % 32]]
    np.testing.assert_array_equal(_run(kernel, src, old), want)


def test_nc_match_replace8_pairs_duplicates_as_documented():
    data = np.array([[1, 2, 3, 4, 8, 8, 8, 8, 8, 8, 8]], dtype=np.float32)
    vals = np.array([[3, 8, 8, 8, 8, 8, 8, 8]], dtype=np.float32)

    def kernel(d, v):
        tile = load_tile(d)
        index = nl.ndarray((1, 8), nl.uint32)
        nisa.nc_match_replace8(tile, tile, load_tile(v), imm=-1.0, dst_idx=index)
        return store_tile(tile), store_tile(index)

    replaced, index = _run(kernel, data, vals)
    np.testing.assert_array_equal(index[0], [2, 10, 9, 8, 7, 6, 5, 4])
    np.testing.assert_array_equal(replaced[0], [1, 2, -1, 4, -1, -1, -1, -1, -1, -1, -1])


@settings(max_examples=15, deadline=None)
@given(p=st.integers(1, 128), f=st.sampled_from([8, 33, 500]), rounds=st.integers(1, 3))
def test_max8_and_match_replace8_give_a_top_k(p, f, rounds):
    x = np.random.default_rng(f).permutation(p * f).reshape(p, f).astype(np.float32)

    def kernel(d):
        tile = load_tile(d)
        values, index = nl.ndarray((p, 8 * rounds), nl.float32), nl.ndarray((p, 8 * rounds), nl.uint32)
        for r in range(rounds):
            nisa.max8(values[:, 8 * r:8 * r + 8], tile)
            nisa.nc_match_replace8(tile, tile, values[:, 8 * r:8 * r + 8], float("-inf"),
                                   dst_idx=index[:, 8 * r:8 * r + 8])
        return store_tile(values), store_tile(index)

    values, index = _run(kernel, x)
    k = min(8 * rounds, f)
    order = np.argsort(-x, axis=1)[:, :k]
    np.testing.assert_array_equal(values[:, :k], np.take_along_axis(x, order, 1))
    np.testing.assert_array_equal(index[:, :k], order)


def test_gather_instructions_are_costed_on_gpsimd():
    def kernel(d, i):
        data, index = load_tile(d), load_tile(i)
        out = nl.ndarray((128, 4), nl.float32)
        nisa.nc_n_gather(out, data, index)
        return store_tile(out)

    run = nki.run_kernel(kernel, [np.zeros((128, 64), np.float32), np.zeros((128, 4), np.uint32)])
    gather = next(r for r in run.trace if r.name == "nc_n_gather")
    assert cost.instruction_cycles(gather) == ("gpsimd", 150 + 64)
    assert not run.report.unmodeled


def _tile(shape, dtype=F32, buffer=None):
    tile = nl.ndarray(shape, dtype, buffer=buffer or nl.sbuf)
    nisa.memset(tile, 0 if np.dtype(dtype).kind in "iu" else 0.0)
    return tile


LIMITS = {
    "err_local_gather_partitions": lambda: nisa.local_gather(
        _tile((8, 4)), _tile((8, 16)), _tile((8, 4), nl.uint16)),
    "err_local_gather_dtype": lambda: nisa.local_gather(
        _tile((16, 4)), _tile((16, 16)), _tile((16, 4), nl.int32)),
    "err_local_gather_elements": lambda: nisa.local_gather(
        _tile((16, 12)), _tile((16, 16)), _tile((16, 4), nl.uint16), num_elem_per_idx=3),
    "err_local_gather_indices": lambda: nisa.local_gather(
        _tile((16, 4)), _tile((16, 16)), _tile((16, 4), nl.uint16), num_valid_indices=65),
    "err_gpsimd_psum_access": lambda: nisa.nc_n_gather(
        _tile((4, 4), buffer=nl.psum), _tile((4, 16)), _tile((4, 4), nl.uint32)),
    "err_nc_n_gather_dtype": lambda: nisa.nc_n_gather(_tile((4, 4)), _tile((4, 16)), _tile((4, 4), nl.int32)),
    "err_nc_n_gather_out_of_bounds": lambda: nisa.nc_n_gather(
        _tile((4, 4)), _tile((4, 2)), _indices((4, 4), 2)),
    "err_sequence_bounds_partitions": lambda: nisa.sequence_bounds(_tile((2, 2, 8)), _tile((2, 8))),
    "err_sequence_bounds_dtype": lambda: nisa.sequence_bounds(_tile((1, 2, 8), nl.bfloat16), _tile((1, 8))),
    "err_nonzero_with_count_shape": lambda: nisa.nonzero_with_count(_tile((16, 8), nl.int32), _tile((16, 8))),
    "err_nonzero_with_count_dtype": lambda: nisa.nonzero_with_count(_tile((16, 9), nl.float32), _tile((16, 8))),
    "err_shuffle_mask": lambda: nisa.nc_stream_shuffle(_tile((32, 4)), _tile((32, 4)), list(range(31))),
    "err_shuffle_dtype": lambda: nisa.nc_stream_shuffle(_tile((32, 4), nl.bfloat16), _tile((32, 4)), list(range(32))),
    "err_match_replace8_value_absent": lambda: nisa.nc_match_replace8(
        _tile((4, 16)), _tile((4, 16)), _ones((4, 8)), 0.0),
}


def _indices(shape, value):
    tile = nl.ndarray(shape, nl.uint32)
    nisa.memset(tile, value)
    return tile


def _ones(shape):
    tile = nl.ndarray(shape, F32)
    nisa.memset(tile, 1.0)
    return tile


@pytest.mark.parametrize("rule", sorted(LIMITS))
def test_limits_raise_their_rule(rule):
    with pytest.raises(NkiValidationError) as info:
        nki.run_kernel(lambda: LIMITS[rule](), [])
    assert info.value.rule == rule


def test_nonzero_with_count_needs_neuroncore_v3():
    with pytest.raises(NkiValidationError, match="err_unsupported_arch"):
        nki.run_kernel(lambda: nisa.nonzero_with_count(_tile((16, 9), nl.int32), _tile((16, 8))), [], target="trn1")


def test_nc_find_index8_pairs_duplicates_in_ascending_order():
    data = np.array([[1, 2, 3, 4, 8, 8, 8, 8, 8, 8, 8]], dtype=np.float32)
    vals = np.array([[3, 8, 8, 8, 8, 8, 8, 8]], dtype=np.float32)

    def kernel(d, v):
        index = nl.ndarray((1, 8), nl.uint32)
        nisa.nc_find_index8(index, load_tile(d), load_tile(v))
        return store_tile(index)

    np.testing.assert_array_equal(_run(kernel, data, vals)[0], [2, 4, 5, 6, 7, 8, 9, 10])


@settings(max_examples=10, deadline=None)
@given(p=st.integers(1, 128), f=st.sampled_from([1, 33, 256]), count=st.integers(1, 4),
       dst_dtype=st.sampled_from([np.dtype(np.float32), nl.bfloat16]))
def test_dma_compute_sums_its_sources_in_fp32(p, f, count, dst_dtype):
    arrays = [np.random.default_rng(i).uniform(-2, 2, (p, f)).astype(F32) for i in range(count)]

    def kernel(*sources):
        out = nl.ndarray((p, f), dst_dtype)
        nisa.dma_compute(out, [sources[0], *(load_tile(s) for s in sources[1:])], nl.add, scales=[1.0] * count)
        return store_tile(out)

    want = np.sum(arrays, axis=0, dtype=F32).astype(dst_dtype)
    np.testing.assert_array_equal(_run(kernel, *arrays), want)


def test_dma_compute_gathers_and_adds_rows_by_vector_offset():
    table = np.arange(40, dtype=F32).reshape(10, 4)
    rows = np.array([[7], [2], [7]], dtype=np.int32)

    def kernel(t, r):
        index, acc = load_tile(r), nl.ndarray((3, 4), F32)
        nisa.memset(acc, 1.0)
        nisa.dma_compute(acc, [acc, t.ap([[4, 3], [1, 4]], vector_offset=index, indirect_dim=0)], nl.add)
        return store_tile(acc)

    np.testing.assert_array_equal(_run(kernel, table, rows), 1 + table[[7, 2, 7]])


@pytest.mark.parametrize("bad, rule", [
    (lambda: nisa.dma_compute(_tile((4, 4)), [_tile((4, 4))], nl.multiply), "err_dma_compute_reduce_op"),
    (lambda: nisa.dma_compute(_tile((4, 4)), [_tile((4, 4))], nl.add, scales=[2.0]), "err_dma_compute_scales"),
    (lambda: nisa.dma_compute(_tile((4, 4)), [_tile((4, 4))] * 17, nl.add), "err_dma_compute_sources"),
    (lambda: nisa.dma_compute(_tile((4, 4)), [_tile((4, 4), buffer=nl.psum)], nl.add), "err_dma_from_psum"),
    (lambda: nisa.dma_compute(_tile((4, 4)), [_tile((4, 5))], nl.add), "err_dma_shape_mismatch"),
])
def test_dma_compute_limits(bad, rule):
    with pytest.raises(NkiValidationError) as info:
        nki.run_kernel(lambda: bad(), [])
    assert info.value.rule == rule


def test_every_new_instruction_has_a_cost_model_entry():
    def kernel():
        data, index = _tile((16, 64)), _indices((16, 4), 3)
        nisa.local_gather(_tile((16, 64)), data, _tile((16, 4), nl.uint16))
        nisa.nc_n_gather(_tile((16, 4)), data, index)
        nisa.sequence_bounds(_tile((1, 2, 64)), _tile((1, 64)))
        nisa.nonzero_with_count(_tile((16, 65), nl.int32), data)
        nisa.nc_stream_shuffle(_tile((32, 8)), _tile((32, 8)), list(range(32)))
        nisa.nc_match_replace8(_tile((16, 64)), _ones((16, 64)), _ones((16, 8)), 0.0)
        nisa.dma_compute(_tile((16, 64)), [data, data], nl.add)
        nisa.select_reduce(_tile((16, 64)), _tile((16, 64), nl.uint8), data, 0.0)
        nisa.range_select(_tile((16, 64)), data, nl.greater_equal, nl.less, _tile((16, 1)), _tile((16, 1)))
        register = nisa.register_alloc(1)
        nisa.register_store(_tile((1, 1), nl.int32), register)
        nisa.register_load(register, _tile((1, 1), nl.int32))
        shared = nl.ndarray((2, 2), F32, buffer=nl.shared_hbm)
        nisa.dma_copy(shared, _tile((2, 2)))
        nisa.core_barrier(shared, (0, 1))
        return shared

    run = nki.run_kernel(kernel, [])
    names = {r.name for r in run.trace}
    assert {"local_gather", "sequence_bounds", "nonzero_with_count", "nc_stream_shuffle", "nc_match_replace8",
            "dma_compute", "select_reduce", "range_select", "register_load", "register_store", "core_barrier"} <= names
    assert not run.report.unmodeled


def test_dma_oob_skip_drops_only_the_elements_past_the_tensor():
    table = np.zeros((6, 4), F32)
    rows = np.arange(12, dtype=F32).reshape(3, 4)

    def kernel(t, r, where):
        tile, position = load_tile(r), load_tile(where)
        # three rows written from a dynamic row offset: at 4, the last row falls past the 6-row table
        nisa.dma_copy(t.ap([[4, 3], [1, 4]], scalar_offset=position, indirect_dim=0), tile, oob_mode=nisa.oob_mode.skip)
        return t

    out = nki.run_kernel(kernel, [table, rows, np.array([[4]], np.int32)]).outputs[0]
    want = np.zeros((6, 4), F32)
    want[4:6] = rows[:2]
    np.testing.assert_array_equal(out, want)
    with pytest.raises(NkiValidationError, match="err_tensor_access_out_of_bound"):
        def strict(t, r, where):
            nisa.dma_copy(t.ap([[4, 3], [1, 4]], scalar_offset=load_tile(where), indirect_dim=0), load_tile(r))
            return t

        nki.run_kernel(strict, [table, rows, np.array([[4]], np.int32)])

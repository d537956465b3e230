"""The simulator's random-number instructions (nisa.set_rng_seed, rand_set_state, rand_get_state, rng, rand2,
dropout): statistics of what they draw, determinism under a seed, the state round trip, and the named errors."""

from __future__ import annotations

import numpy as np
import pytest

from neuron_compile.runtime import simulator as nki
from neuron_compile.runtime.simulator import cost
from neuron_compile.runtime.simulator.errors import NkiValidationError

nl = nki.language
nisa = nki.isa
P, F = 128, 512


def _seed_tile(seed: int):
    tile = nl.ndarray((1, 1), nl.int32)
    nisa.memset(tile, seed)
    return tile


def _store(tile):
    out = nl.ndarray(tile.shape, tile.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(out, tile)
    return out


def _bits(seed: int, draws: int = 1, dtype=nl.uint32, free: int = F):
    """``draws`` rng tiles drawn after set_rng_seed(seed), stacked along the free axis."""
    def kernel():
        nisa.set_rng_seed(_seed_tile(seed))
        outs = []
        for _ in range(draws):
            tile = nl.ndarray((P, free), dtype)
            nisa.rng(tile)
            outs.append(_store(tile))
        return tuple(outs)

    outputs = nki.run_kernel(kernel, ()).outputs
    return np.concatenate(outputs, axis=1)


def test_rng_bits_are_uniform_and_lanes_differ():
    bits = _bits(7).astype(np.float64)
    u = bits / 2.0**32
    n = u.size
    # mean 1/2 and variance 1/12 of U(0, 1), within 5 standard errors for n = 65536 draws
    assert abs(u.mean() - 0.5) < 5 * np.sqrt(1 / 12 / n)
    assert abs(u.var() - 1 / 12) < 5 * np.sqrt(1 / 180 / n)
    for bit in (0, 15, 31):  # every bit is set half the time
        share = ((bits.astype(np.uint64) >> bit) & 1).mean()
        assert abs(share - 0.5) < 5 * np.sqrt(0.25 / n)
    assert len({row.tobytes() for row in bits}) == P  # each partition is its own stream
    neighbours = np.corrcoef(u[:-1].ravel(), u[1:].ravel())[0, 1]
    assert abs(neighbours) < 5 / np.sqrt(n)


def test_rng_is_deterministic_per_seed_and_advances_per_draw():
    first = _bits(11, draws=2)
    np.testing.assert_array_equal(first, _bits(11, draws=2))
    assert (first != _bits(12, draws=2)).mean() > 0.99
    one, two = first[:, :F], first[:, F:]
    assert (one != two).mean() > 0.99  # a second draw continues the stream, it does not repeat it
    # drawing in two tiles of F gives the same stream as one tile of 2F: values depend on position, not tiling
    np.testing.assert_array_equal(first, _bits(11, draws=1, free=2 * F))


def test_rng_truncates_to_the_low_bits_of_narrow_dtypes():
    wide = _bits(3)
    np.testing.assert_array_equal(_bits(3, dtype=nl.uint8), (wide & 0xFF).astype(np.uint8))
    np.testing.assert_array_equal(_bits(3, dtype=nl.int16), (wide & 0xFFFF).astype(np.uint16).view(np.int16))


def _dropped(prob, data_dtype=nl.float32, seed=5):
    def kernel():
        nisa.set_rng_seed(_seed_tile(seed))
        data = nl.ndarray((P, F), data_dtype)
        nisa.memset(data, 3.0 if data_dtype != nl.int32 else 3)
        out = nl.ndarray((P, F), data_dtype)
        nisa.dropout(out, data, prob=prob)
        return _store(out)

    return nki.run_kernel(kernel, ()).outputs[0].astype(np.float64)


@pytest.mark.parametrize("prob", [0.1, 0.5, 0.9])
def test_dropout_keeps_one_minus_p_and_zeroes_the_rest(prob):
    out = _dropped(prob)
    assert set(np.unique(out)) <= {0.0, 3.0}  # kept values unscaled
    kept = (out != 0).mean()
    assert abs(kept - (1 - prob)) < 5 * np.sqrt(prob * (1 - prob) / out.size)


def test_dropout_edges_and_per_partition_probabilities():
    assert (_dropped(0.0) == 3.0).all()
    assert (_dropped(1.0) == 0.0).all()
    assert (_dropped(0.5, nl.bfloat16) != 0).mean() == pytest.approx(0.5, abs=0.02)

    def kernel():
        nisa.set_rng_seed(_seed_tile(9))
        prob = nl.ndarray((P, 1), nl.float32)
        nisa.iota(prob, [[0, 1]], channel_multiplier=1)  # partition p drops with probability p / 127
        nisa.tensor_scalar(prob, prob, op0=nl.multiply, operand0=1 / 127)
        data = nl.ndarray((P, F), nl.float32)
        nisa.memset(data, 1.0)
        nisa.dropout(data, data, prob=prob)
        return _store(data)

    kept = nki.run_kernel(kernel, ()).outputs[0].mean(axis=1)
    expected = 1 - np.arange(P) / 127
    assert np.abs(kept - expected).max() < 5 * np.sqrt(0.25 / F)


def test_state_round_trip_resumes_the_stream():
    def kernel():
        seeds = nl.ndarray((P, 6), nl.uint32)
        nisa.iota(seeds, [[1, 6]], channel_multiplier=6)
        nisa.rand_set_state(seeds)
        first = nl.ndarray((P, 64), nl.uint32)
        nisa.rng(first, engine=nisa.engine.gpsimd)
        saved = nl.ndarray((P, 6), nl.uint32)
        nisa.rand_get_state(saved)
        second = nl.ndarray((P, 64), nl.uint32)
        nisa.rng(second, engine=nisa.engine.gpsimd)
        nisa.rand_set_state(saved)
        again = nl.ndarray((P, 64), nl.uint32)
        nisa.rng(again, engine=nisa.engine.gpsimd)
        return _store(first), _store(second), _store(again), _store(saved)

    first, second, again, saved = nki.run_kernel(kernel, ()).outputs
    np.testing.assert_array_equal(second, again)
    assert (first != second).mean() > 0.99
    assert (saved[:, 2] == 6 * np.arange(P) + 2 + 64).all()  # the counter word (seeded 6p + 2) advanced by 64


def test_rand2_is_uniform_in_its_range_on_trn3():
    def kernel():
        nisa.set_rng_seed(_seed_tile(1))
        out = nl.ndarray((P, F), nl.float32)
        nisa.rand2(out, min=-2.0, max=6.0)
        return _store(out)

    out = nki.run_kernel(kernel, (), target="trn3").outputs[0].astype(np.float64)
    assert out.min() >= -2.0 and out.max() < 6.0
    assert abs(out.mean() - 2.0) < 5 * np.sqrt(64 / 12 / out.size)
    assert abs(out.var() - 64 / 12) < 0.1


def _raises(rule: str, kernel, target=None):
    with pytest.raises(NkiValidationError) as error:
        nki.run_kernel(kernel, (), target=target)
    assert error.value.rule == rule, str(error.value)


def test_errors_name_the_rule():
    def unseeded():
        tile = nl.ndarray((P, 8), nl.uint32)
        nisa.rng(tile)

    def float_rng():
        nisa.set_rng_seed(_seed_tile(1))
        nisa.rng(nl.ndarray((P, 8), nl.float32))

    def wide_seed():
        nisa.set_rng_seed(nl.ndarray((2, 1), nl.int32))

    def bad_prob():
        nisa.set_rng_seed(_seed_tile(1))
        data = nl.ndarray((P, 8), nl.float32)
        nisa.memset(data, 1.0)
        nisa.dropout(data, data, prob=1.5)

    def mixed_dtypes():
        nisa.set_rng_seed(_seed_tile(1))
        data = nl.ndarray((P, 8), nl.float32)
        nisa.memset(data, 1.0)
        nisa.dropout(nl.ndarray((P, 8), nl.bfloat16), data, prob=0.5)

    def short_state():
        nisa.rand_set_state(nl.ndarray((P, 5), nl.uint32))

    def rand2_now():
        nisa.set_rng_seed(_seed_tile(1))
        nisa.rand2(nl.ndarray((P, 8), nl.float32), min=0.0, max=1.0)

    _raises("err_rng_not_seeded", unseeded)
    _raises("err_rng_dst_dtype", float_rng)
    _raises("err_rng_seed_shape", wide_seed)
    _raises("err_dropout_prob_range", bad_prob)
    _raises("err_dropout_dtype", mixed_dtypes)
    _raises("err_rng_state_shape", short_state)
    _raises("err_unsupported_arch", rand2_now)  # rand2 is NeuronCore-v4 (trn3) only
    _raises("err_unsupported_arch", short_state, target="trn1")  # rand_set_state: NeuronCore-v3 on


def test_random_instructions_are_costed():
    def kernel():
        nisa.set_rng_seed(_seed_tile(1))
        data = nl.ndarray((P, F), nl.float32)
        nisa.memset(data, 1.0)
        nisa.dropout(data, data, prob=0.25)
        bits = nl.ndarray((P, F), nl.uint32)
        nisa.rng(bits)

    trace = nki.run_kernel(kernel, ()).trace
    assert not set(cost.cost_report(trace).unmodeled) & {"set_rng_seed", "dropout", "rng"}
    cycles = {record.name: cost.instruction_cycles(record)[1] for record in trace}
    assert cycles["dropout"] == cycles["rng"] == F
    assert cycles["set_rng_seed"] == cost.MIN_II

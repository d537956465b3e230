"""The simulator's accumulating instructions (tensor_scalar_reduce, tensor_scalar_cumulative, exponential,
select_reduce, range_select, activate2) against numpy goldens over hypothesis-drawn shapes and dtypes, the
accumulator-register protocol across instructions, and the named errors of their documented limits."""

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
FP32_MIN = np.float32(-3.4028235e38)

partitions = st.integers(1, 128)
free_sizes = st.sampled_from([1, 2, 7, 64, 129, 512])
dtypes = st.sampled_from([np.dtype(np.float32), nl.bfloat16])


def _random(shape, dtype, seed=0, low=-2.0, high=2.0):
    return np.random.default_rng(seed).uniform(low, high, size=shape).astype(F32).astype(dtype)


def _run(kernel, *arrays, target=None):
    run = nki.run_kernel(kernel, arrays, target=target)
    return run.outputs[0] if len(run.outputs) == 1 else run.outputs


def _rounded(values, dtype):
    return np.asarray(values, dtype=F32).astype(dtype).astype(F32)


@settings(max_examples=20, deadline=None)
@given(p=partitions, f=free_sizes, dtype=dtypes, op=st.sampled_from(["add", "multiply", "maximum", "minimum"]),
       negate=st.booleans(), vector=st.booleans())
def test_tensor_scalar_reduce_matches_numpy(p, f, dtype, op, negate, vector):
    x = _random((p, f), dtype, 1, 0.5, 1.5)  # positive and near 1: products stay finite
    scale = _random((p, 1), F32, 2, 0.5, 1.5)

    def kernel(a, s):
        tile, column = load_tile(a), load_tile(s)
        out, total = nl.ndarray((p, f), dtype), nl.ndarray((p, 1), F32)
        nisa.tensor_scalar_reduce(out, tile, nl.multiply, column if vector else 0.75, getattr(nl, op), total,
                                  reduce_res_negate=negate)
        return store_tile(out), store_tile(total)

    got, total = _run(kernel, x, scale)
    y = x.astype(F32) * (scale if vector else F32(0.75))
    np.testing.assert_array_equal(got.astype(F32), _rounded(y, dtype))
    want = {"add": np.sum, "multiply": np.prod, "maximum": np.max, "minimum": np.min}[op](y, axis=1, keepdims=True)
    np.testing.assert_allclose(total, -want if negate else want, rtol=2e-6 * f, atol=1e-6)


def test_tensor_scalar_reduce_accumulates_across_tiles_with_reduce_and_load_reduce():
    x = _random((4, 96), F32, 3)

    def kernel(a):
        tile, out = load_tile(a), nl.ndarray((4, 32), F32)
        total, start = nl.ndarray((4, 1), F32), nl.ndarray((4, 1), F32)
        nisa.memset(start, 10.0)
        nisa.tensor_scalar_reduce(out, tile[:, 0:32], nl.add, 0.0, nl.add, None, reduce_cmd=nisa.reduce_cmd.load_reduce,
                                  reduce_init=start)
        nisa.tensor_scalar_reduce(out, tile[:, 32:64], nl.add, 0.0, nl.add, None, reduce_cmd=nisa.reduce_cmd.reduce)
        nisa.tensor_scalar_reduce(out, tile[:, 64:96], nl.add, 0.0, nl.add, total, reduce_cmd=nisa.reduce_cmd.reduce)
        return store_tile(total)

    np.testing.assert_allclose(_run(kernel, x)[:, 0], 10 + x.sum(axis=1), rtol=1e-6)


@settings(max_examples=20, deadline=None)
@given(p=partitions, f=free_sizes, dtype=dtypes, op1=st.sampled_from(["add", "subtract", "multiply", "maximum",
                                                                     "minimum"]), load=st.booleans())
def test_tensor_scalar_cumulative_matches_a_sequential_scan(p, f, dtype, op1, load):
    x = _random((p, f), dtype, 4, 0.9, 1.1)

    def kernel(a):
        tile, out = load_tile(a), nl.ndarray((p, f), dtype)
        command = nisa.reduce_cmd.load_reduce if load else nisa.reduce_cmd.reset_reduce
        nisa.tensor_scalar_cumulative(out, tile, nl.multiply, getattr(nl, op1), 1.0625, imm1=0.5 if load else None,
                                      reduce_cmd=command)
        return store_tile(out)

    got = _run(kernel, x).astype(F32)
    values = x.astype(F32) * F32(1.0625)
    reg = np.full(p, 0.5 if load else {"add": 0, "subtract": 0, "multiply": 1, "maximum": -np.inf,
                                       "minimum": np.inf}[op1], dtype=F32)
    want = np.empty((p, f), F32)
    fold = {"add": np.add, "subtract": lambda v, r: v - r, "multiply": np.multiply, "maximum": np.maximum,
            "minimum": np.minimum}[op1]
    for i in range(f):
        reg = fold(values[:, i], reg).astype(F32)
        want[:, i] = reg
    np.testing.assert_array_equal(got, _rounded(want, dtype))


def test_cumulative_is_a_cumsum_and_continues_with_reduce():
    x = _random((8, 64), F32, 5)

    def kernel(a):
        tile, out = load_tile(a), nl.ndarray((8, 64), F32)
        nisa.tensor_scalar_cumulative(out[:, 0:32], tile[:, 0:32], nl.add, nl.add, 0.0)
        nisa.tensor_scalar_cumulative(out[:, 32:64], tile[:, 32:64], nl.add, nl.add, 0.0,
                                      reduce_cmd=nisa.reduce_cmd.reduce)
        return store_tile(out)

    np.testing.assert_allclose(_run(kernel, x), np.cumsum(x, axis=1), rtol=1e-5, atol=1e-5)


@settings(max_examples=15, deadline=None)
@given(p=partitions, f=free_sizes, dtype=dtypes)
def test_exponential_with_running_sum(p, f, dtype):
    x = _random((p, f), dtype, 6)
    shift = _random((p, 1), F32, 7)

    def kernel(a, m):
        tile, column = load_tile(a), load_tile(m)
        out, total = nl.ndarray((p, f), dtype), nl.ndarray((p, 1), F32)
        nisa.exponential(out, tile, max_value=column, reduce_res=total, reduce_cmd=nisa.reduce_cmd.reset_reduce)
        return store_tile(out), store_tile(total)

    got, total = _run(kernel, x, shift, target="trn3")
    y = np.exp(x.astype(F32) - shift)
    np.testing.assert_allclose(got.astype(F32), _rounded(y, dtype), rtol=1e-6)
    np.testing.assert_allclose(total[:, 0], y.sum(axis=1), rtol=1e-5)


@settings(max_examples=20, deadline=None)
@given(p=partitions, f=free_sizes, dtype=dtypes, reverse=st.booleans(), column=st.booleans(),
       command=st.sampled_from(["idle", "reset_reduce"]))
def test_select_reduce_matches_numpy_where_and_max(p, f, dtype, reverse, column, command):
    x = _random((p, f), dtype, 8)
    mask = (np.random.default_rng(9).random((p, f)) < 0.5).astype(np.uint8)
    fill = _random((p, 1), F32, 10)

    def kernel(a, m, c):
        tile, predicate, fill_tile = load_tile(a), load_tile(m), load_tile(c)
        out, best = nl.ndarray((p, f), dtype), nl.ndarray((p, 1), F32)
        nisa.select_reduce(out, predicate, tile, fill_tile if column else -5.0, reduce_res=best,
                           reduce_cmd=getattr(nisa.reduce_cmd, command), reverse_pred=reverse)
        return store_tile(out), store_tile(best)

    got, best = _run(kernel, x, mask, fill)
    chosen = (mask == 0) if reverse else (mask != 0)
    want = np.where(chosen, x.astype(F32), fill if column else F32(-5))
    np.testing.assert_array_equal(got.astype(F32), _rounded(want, dtype))
    np.testing.assert_array_equal(best[:, 0], want.max(axis=1))


@settings(max_examples=20, deadline=None)
@given(p=partitions, f=free_sizes, dtype=dtypes, start=st.integers(0, 300),
       ops=st.sampled_from([("greater_equal", "less"), ("greater", "less_equal"), ("equal", "less")]))
def test_range_select_keeps_the_index_window_and_takes_its_max(p, f, dtype, start, ops):
    x = _random((p, f), dtype, 11)
    rng = np.random.default_rng(12)
    low = rng.integers(start - 5, start + f + 5, size=(p, 1)).astype(F32)
    high = low + rng.integers(0, f + 1, size=(p, 1)).astype(F32)

    def kernel(a, lo, hi):
        tile, bound0, bound1 = load_tile(a), load_tile(lo), load_tile(hi)
        out, best = nl.ndarray((p, f), dtype), nl.ndarray((p, 1), F32)
        nisa.range_select(out, tile, getattr(nl, ops[0]), getattr(nl, ops[1]), bound0, bound1, reduce_res=best,
                          range_start=start)
        return store_tile(out), store_tile(best)

    got, best = _run(kernel, x, low, high)
    index = start + np.arange(f, dtype=F32)[None, :]
    golden = {"greater_equal": np.greater_equal, "less": np.less, "greater": np.greater,
              "less_equal": np.less_equal, "equal": np.equal}
    keep = golden[ops[0]](index, low) & golden[ops[1]](index, high)
    want = np.where(keep, x.astype(F32), FP32_MIN)
    np.testing.assert_array_equal(got.astype(F32), _rounded(want, dtype))
    np.testing.assert_array_equal(best[:, 0], want.max(axis=1))


@settings(max_examples=15, deadline=None)
@given(p=partitions, f=free_sizes, dtype=dtypes, function=st.sampled_from(["exp", "tanh", "gelu", "prelu"]),
       pair=st.sampled_from([("multiply", "add"), ("multiply", "subtract"), ("add", "bypass"),
                             ("bypass", "bypass")]), reverse=st.booleans(), reduce=st.sampled_from(["add", "maximum",
                                                                                                   "abs_max"]))
def test_activate2_matches_numpy(p, f, dtype, function, pair, reverse, reduce):
    x = _random((p, f), dtype, 13)
    reverse = reverse and pair[0] != "bypass"

    def kernel(a):
        tile, out, total = load_tile(a), nl.ndarray((p, f), dtype), nl.ndarray((p, 1), F32)
        nisa.activate2(out, getattr(nl, function), tile, 1.5, 0.25, getattr(nl, pair[0]), getattr(nl, pair[1]),
                       relu_param=0.1, reverse0=reverse, reduce_op=getattr(nl, reduce), reduce_res=total,
                       reduce_cmd=nisa.reduce_cmd.reset_reduce)
        return store_tile(out), store_tile(total)

    got, total = _run(kernel, x, target="trn3")
    stage = {"multiply": np.multiply, "add": np.add, "subtract": np.subtract}
    y = x.astype(F32)
    if pair[0] != "bypass":
        y = stage[pair[0]](F32(1.5), y) if reverse else stage[pair[0]](y, F32(1.5))
    if pair[1] != "bypass":
        y = stage[pair[1]](y, F32(0.25))
    activations = {"exp": np.exp, "tanh": np.tanh, "prelu": lambda v: np.where(v > 0, v, F32(0.1) * v),
                   "gelu": nl.gelu.fn}
    y = activations[function](y.astype(F32)).astype(F32)
    np.testing.assert_allclose(got.astype(F32), _rounded(y, dtype), rtol=1e-6, atol=1e-7)
    folded = {"add": y.sum(axis=1), "maximum": y.max(axis=1), "abs_max": np.abs(y).max(axis=1)}[reduce]
    np.testing.assert_allclose(total[:, 0], folded, rtol=1e-5, atol=1e-6)


def test_accumulating_instructions_are_costed_on_their_engines():
    x = _random((128, 256), F32, 14)

    def kernel(a):
        tile, out, total = load_tile(a), nl.ndarray((128, 256), F32), nl.ndarray((128, 1), F32)
        nisa.tensor_scalar_reduce(out, tile, nl.add, 1.0, nl.maximum, total)
        nisa.tensor_scalar_cumulative(out, tile, nl.add, nl.add, 0.0)
        nisa.exponential(out, tile, reduce_res=total, reduce_cmd=nisa.reduce_cmd.reset_reduce)
        nisa.activate2(out, nl.exp, tile, 1.0, 0.0, nl.multiply, nl.add)
        return store_tile(total)

    trace = nki.run_kernel(kernel, [x], target="trn3").trace
    engines = {r.name: cost.instruction_cycles(r, "trn3") for r in trace if r.engine != "dma"}
    assert engines["activate2"][0] == "scalar"
    for name in ("tensor_scalar_reduce", "tensor_scalar_cumulative", "exponential"):
        assert engines[name] == ("vector", 256)
    assert not nki.run_kernel(kernel, [x], target="trn3").report.unmodeled


def _tile(shape, dtype=F32):
    tile = nl.ndarray(shape, dtype)
    nisa.memset(tile, 1.0 if np.dtype(dtype).kind == "f" or dtype == nl.bfloat16 else 1)
    return tile


LIMITS = {
    "err_tensor_scalar_reduce_reverse": lambda: nisa.tensor_scalar_reduce(
        _tile((4, 8)), _tile((4, 8)), nl.add, 1.0, nl.add, _tile((4, 1)), reverse0=True),
    "err_unsupported_reduce_op": lambda: nisa.tensor_scalar_reduce(
        _tile((4, 8)), _tile((4, 8)), nl.add, 1.0, nl.subtract, _tile((4, 1))),
    "err_reduce_init": lambda: nisa.tensor_scalar_reduce(
        _tile((4, 8)), _tile((4, 8)), nl.add, 1.0, nl.add, _tile((4, 1)), reduce_cmd=nisa.reduce_cmd.load_reduce),
    "err_reduce_res_shape": lambda: nisa.tensor_scalar_reduce(
        _tile((4, 8)), _tile((4, 8)), nl.add, 1.0, nl.add, _tile((4, 2))),
    "err_tensor_scalar_operand_dtype": lambda: nisa.tensor_scalar_reduce(
        _tile((4, 8)), _tile((4, 8)), nl.add, _tile((4, 1), nl.bfloat16), nl.add, _tile((4, 1))),
    "err_cumulative_dtype": lambda: nisa.tensor_scalar_cumulative(
        _tile((4, 8), nl.int32), _tile((4, 8), nl.int32), nl.add, nl.add, 1.0),
    "err_unsupported_op": lambda: nisa.tensor_scalar_cumulative(
        _tile((4, 8)), _tile((4, 8)), nl.add, nl.divide, 1.0),
    "err_predicate_dtype": lambda: nisa.select_reduce(
        _tile((4, 8)), _tile((4, 8), nl.int32), _tile((4, 8)), 0.0),
    "err_select_both_psum": lambda: nisa.select_reduce(
        _tile((4, 8)), nl.zeros((4, 8), nl.uint8, buffer=nl.psum), nl.zeros((4, 8), F32, buffer=nl.psum), 0.0),
    "err_select_dtype": lambda: nisa.select_reduce(
        _tile((4, 8), nl.int32), _tile((4, 8), nl.uint8), _tile((4, 8), nl.int32), 0.0),
    "err_range_select_fill": lambda: nisa.range_select(
        _tile((4, 8)), _tile((4, 8)), nl.greater_equal, nl.less, _tile((4, 1)), _tile((4, 1)), on_false_value=0.0),
    "err_range_select_bound": lambda: nisa.range_select(
        _tile((4, 8)), _tile((4, 8)), nl.greater_equal, nl.less, _tile((4, 1), nl.bfloat16), _tile((4, 1))),
    "err_range_select_start": lambda: nisa.range_select(
        _tile((4, 8)), _tile((4, 8)), nl.greater_equal, nl.less, _tile((4, 1)), _tile((4, 1)), range_start=2**24),
}


@pytest.mark.parametrize("rule", sorted(LIMITS))
def test_limits_raise_their_rule(rule):
    with pytest.raises(NkiValidationError) as info:
        nki.run_kernel(lambda: LIMITS[rule](), [])
    assert info.value.rule == rule


@pytest.mark.parametrize("instruction", ["exponential", "activate2"])
def test_neuroncore_v4_instructions_are_refused_on_trn2(instruction):
    def kernel():
        tile = _tile((4, 8))
        if instruction == "exponential":
            nisa.exponential(tile, tile)
        else:
            nisa.activate2(tile, nl.exp, tile, 1.0, 0.0, nl.multiply, nl.add)

    with pytest.raises(NkiValidationError, match="err_unsupported_arch.*gen4"):
        nki.run_kernel(kernel, [], target="trn2")


def test_activate2_refuses_op_pairs_the_hardware_lacks():
    with pytest.raises(NkiValidationError, match="err_activate2_op_pair"):
        nki.run_kernel(lambda: nisa.activate2(_tile((4, 8)), nl.exp, _tile((4, 8)), 1.0, 1.0, nl.add, nl.add), [],
                       target="trn3")

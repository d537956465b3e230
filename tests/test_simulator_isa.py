"""nki.isa instructions of the simulator against numpy goldens (fp32 math rounded to the dst dtype)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neuron_compile.runtime import simulator as nki
from neuron_compile.runtime.simulator import rules
from neuron_compile.runtime.simulator.cost import instruction_cycles

nl = nki.language
nisa = nki.isa
F32 = np.float32
DTYPES = [np.dtype(np.float32), nl.bfloat16]

partitions = st.integers(1, 128)
free_sizes = st.sampled_from([1, 2, 7, 64, 127, 129, 512, 600])
dtypes = st.sampled_from(DTYPES)


def _random(shape, dtype, seed=0, low=-2.0, high=2.0):
    rng = np.random.default_rng(seed)
    return rng.uniform(low, high, size=shape).astype(F32).astype(dtype)


def _load(src, dtype=None, buffer=None):
    tile = nl.ndarray(src.shape, dtype or src.dtype, buffer=buffer or nl.sbuf)
    nisa.dma_copy(tile, src)
    return tile


def _store(tile):
    out = nl.ndarray(tile.shape, tile.dtype, buffer=nl.shared_hbm)
    if tile.kind == "psum":
        staged = nl.ndarray(tile.shape, tile.dtype)
        nisa.tensor_copy(staged, tile)
        tile = staged
    nisa.dma_copy(out, tile)
    return out


def _run(kernel, *arrays):
    run = nki.run_kernel(kernel, arrays)
    return run.outputs[0] if len(run.outputs) == 1 else run.outputs


BINARY_GOLDEN = {
    "add": np.add, "subtract": np.subtract, "multiply": np.multiply, "maximum": np.maximum, "minimum": np.minimum,
}


@settings(max_examples=25, deadline=None)
@given(p=partitions, f=free_sizes, dtype=dtypes, op=st.sampled_from(sorted(BINARY_GOLDEN)))
def test_tensor_tensor_matches_fp32_math_rounded_to_dst(p, f, dtype, op):
    a, b = _random((p, f), dtype, 1), _random((p, f), dtype, 2)

    def kernel(x, y):
        tx, ty = _load(x), _load(y)
        out = nl.ndarray((p, f), dtype)
        nisa.tensor_tensor(out, tx, ty, getattr(nl, op))
        return _store(out)

    golden = BINARY_GOLDEN[op](a.astype(F32), b.astype(F32)).astype(dtype)
    np.testing.assert_array_equal(_run(kernel, a, b), golden)


def test_tensor_tensor_psum_operand_and_integer_bitvec():
    a = np.arange(12, dtype=np.int32).reshape(3, 4)
    b = np.full((3, 4), 6, dtype=np.int32)

    def kernel(x, y):
        out = nl.ndarray((3, 4), nl.int32)
        nisa.tensor_tensor(out, _load(x), _load(y), nl.bitwise_and)
        return _store(out)

    np.testing.assert_array_equal(_run(kernel, a, b), a & b)


@settings(max_examples=20, deadline=None)
@given(p=partitions, f=free_sizes, dtype=dtypes, reverse=st.booleans(), vector=st.booleans())
def test_tensor_scalar_two_ops_scalar_and_vector_operands(p, f, dtype, reverse, vector):
    a = _random((p, f), dtype, 3)
    column = _random((p, 1), F32, 4, 0.5, 2.0)

    def kernel(x, c):
        tx, tc = _load(x), _load(c)
        out = nl.ndarray((p, f), dtype)
        nisa.tensor_scalar(out, tx, nl.subtract, tc if vector else 0.75, reverse0=reverse, op1=nl.multiply,
                           operand1=3.0)
        return _store(out)

    operand = column if vector else F32(0.75)
    first = operand - a.astype(F32) if reverse else a.astype(F32) - operand
    golden = (first * F32(3.0)).astype(dtype)
    np.testing.assert_array_equal(_run(kernel, a, column), golden)


@settings(max_examples=15, deadline=None)
@given(p=partitions, f=free_sizes, dtype=dtypes, reverse0=st.booleans(), reverse1=st.booleans())
def test_scalar_tensor_tensor(p, f, dtype, reverse0, reverse1):
    a, b = _random((p, f), dtype, 27), _random((p, f), dtype, 28)
    column = _random((p, 1), F32, 29)

    def kernel(x, y, c):
        out = nl.ndarray((p, f), dtype)
        nisa.scalar_tensor_tensor(out, _load(x), nl.subtract, _load(c), nl.multiply, _load(y), reverse0=reverse0,
                                  reverse1=reverse1)
        return _store(out)

    first = column - a.astype(F32) if reverse0 else a.astype(F32) - column
    np.testing.assert_array_equal(_run(kernel, a, b, column), (first * b.astype(F32)).astype(dtype))


ACTIVATIONS = {
    "exp": np.exp, "tanh": np.tanh, "relu": lambda x: np.maximum(x, 0), "square": np.square,
    "sigmoid": lambda x: 1 / (1 + np.exp(-x)), "silu": lambda x: x / (1 + np.exp(-x)),
    "gelu_apprx_tanh": lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3))),
}


@settings(max_examples=25, deadline=None)
@given(p=partitions, f=free_sizes, dtype=dtypes, op=st.sampled_from(sorted(ACTIVATIONS)))
def test_activation_scale_bias_and_reduce(p, f, dtype, op):
    a = _random((p, f), dtype, 5)
    bias = _random((p, 1), F32, 6)

    def kernel(x, b):
        tx, tb = _load(x), _load(b)
        out = nl.ndarray((p, f), dtype)
        total = nl.ndarray((p, 1), nl.float32)
        nisa.activation(out, getattr(nl, op), tx, bias=tb, scale=0.5, reduce_op=nl.add, reduce_res=total)
        return _store(out), _store(total)

    out, total = _run(kernel, a, bias)
    exact = ACTIVATIONS[op](a.astype(np.float64) * 0.5 + bias)
    tol = 1e-2 if dtype == nl.bfloat16 else 1e-5
    np.testing.assert_allclose(out.astype(np.float64), exact, rtol=tol, atol=tol)
    np.testing.assert_allclose(total[:, 0], exact.sum(axis=1), rtol=1e-4, atol=1e-4)


def test_activation_reduce_cmd_accumulates_across_instructions():
    x = _random((16, 96), F32, 32)

    def kernel(a):
        ta = _load(a)
        out = nl.ndarray((16, 96), nl.float32)
        total = nl.ndarray((16, 1), nl.float32)
        first = nl.ndarray((16, 1), nl.float32)
        nisa.activation(out[:, 0:32], nl.exp, ta[:, 0:32], reduce_cmd=nisa.reduce_cmd.reset_reduce,
                        reduce_res=first)
        nisa.activation(out[:, 32:64], nl.exp, ta[:, 32:64], reduce_cmd=nisa.reduce_cmd.reduce)
        nisa.activation(out[:, 64:96], nl.exp, ta[:, 64:96], reduce_op=nl.add, reduce_cmd=nisa.reduce_cmd.reduce,
                        reduce_res=total)
        return _store(first), _store(total)

    first, total = _run(kernel, x)
    np.testing.assert_allclose(first[:, 0], np.exp(x[:, :32]).sum(axis=1), rtol=1e-5)
    np.testing.assert_allclose(total[:, 0], np.exp(x).sum(axis=1), rtol=1e-5)


def test_activation_gelu_and_erf_match_math_erf():
    import math

    x = np.linspace(-4, 4, 256, dtype=F32).reshape(2, 128)

    def kernel(a):
        ta = _load(a)
        g, e = nl.ndarray(a.shape, nl.float32), nl.ndarray(a.shape, nl.float32)
        nisa.activation(g, nl.gelu, ta)
        nisa.activation(e, nl.erf, ta)
        return _store(g), _store(e)

    gelu, erf = _run(kernel, x)
    golden_erf = np.vectorize(math.erf)(x.astype(np.float64))
    np.testing.assert_allclose(erf, golden_erf, atol=1e-6)
    np.testing.assert_allclose(gelu, 0.5 * x * (1 + np.vectorize(math.erf)(x / np.sqrt(2))), atol=1e-6)


@settings(max_examples=20, deadline=None)
@given(p=partitions, shape=st.sampled_from([(5,), (1,), (3, 7), (2, 3, 4)]), op=st.sampled_from(["add", "maximum"]),
       negate=st.booleans(), reduce_all=st.booleans())
def test_tensor_reduce_last_free_axes(p, shape, op, negate, reduce_all):
    a = _random((p, *shape), F32, 7)
    axes = tuple(range(1, len(shape) + 1)) if reduce_all else (len(shape),)
    kept = (p,) + shape[: len(shape) - len(axes)]

    def kernel(x):
        out = nl.ndarray(kept if len(kept) > 1 else (p, 1), nl.float32)
        nisa.tensor_reduce(out, getattr(nl, op), _load(x), axis=axes, negate=negate)
        return _store(out)

    golden = {"add": np.sum, "maximum": np.max}[op](a, axis=axes)
    golden = -golden if negate else golden
    np.testing.assert_allclose(_run(kernel, a).reshape(golden.shape), golden, rtol=1e-5, atol=1e-5)


@settings(max_examples=15, deadline=None)
@given(p=partitions, f=free_sizes, src=dtypes, dst=dtypes)
def test_tensor_copy_casts_like_astype(p, f, src, dst):
    a = _random((p, f), src, 8)

    def kernel(x):
        out = nl.ndarray((p, f), dst)
        nisa.tensor_copy(out, _load(x))
        return _store(out)

    np.testing.assert_array_equal(_run(kernel, a), a.astype(F32).astype(dst))


def test_memset_iota_and_fresh_buffers_are_nan():
    def kernel():
        fresh = nl.ndarray((4, 3), nl.float32)
        filled = nl.ndarray((4, 3), nl.bfloat16)
        nisa.memset(filled, 2.5)
        ramp = nl.ndarray((4, 2, 3), nl.int32)
        nisa.iota(ramp, [[10, 2], [1, 3]], offset=5, channel_multiplier=100)
        ints = nl.ndarray((4, 3), nl.int32)
        return _store(fresh), _store(filled), _store(ramp), _store(ints)

    fresh, filled, ramp, ints = _run(kernel)
    assert np.isnan(fresh).all()
    np.testing.assert_array_equal(filled.astype(F32), np.full((4, 3), 2.5))
    c, j, k = np.meshgrid(np.arange(4), np.arange(2), np.arange(3), indexing="ij")
    np.testing.assert_array_equal(ramp, 5 + 100 * c + 10 * j + k)
    np.testing.assert_array_equal(ints, np.full((4, 3), 4))


def test_affine_select_causal_mask():
    x = _random((8, 8), F32, 9)

    def kernel(a):
        out = nl.ndarray((8, 8), nl.float32)
        # keep element (row, col) when row - col >= 0
        nisa.affine_select(out, [[-1, 8]], 1, _load(a), -1e9, cmp_op=nl.greater_equal)
        return _store(out)

    np.testing.assert_array_equal(_run(kernel, x), np.where(np.tril(np.ones((8, 8))) > 0, x, F32(-1e9)))


@settings(max_examples=20, deadline=None)
@given(k=st.integers(1, 128), m=st.integers(1, 128), n=st.sampled_from([1, 3, 128, 500, 512]), dtype=dtypes)
def test_nc_matmul_stationary_transposed_times_moving(k, m, n, dtype):
    s, mv = _random((k, m), dtype, 10), _random((k, n), dtype, 11)

    def kernel(a, b):
        acc = nl.ndarray((m, n), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(acc, _load(a), _load(b))
        return _store(acc)

    golden = s.astype(np.float64).T @ mv.astype(np.float64)
    np.testing.assert_allclose(_run(kernel, s, mv), golden, rtol=1e-5, atol=1e-4)


def test_nc_matmul_first_write_overwrites_later_accumulate():
    s = _random((32, 16), F32, 12)
    mv = _random((32, 64), F32, 13)

    def kernel(a, b):
        ta, tb = _load(a), _load(b)
        acc = nl.ndarray((16, 64), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(acc, ta, tb)  # overwrites the NaN fill
        nisa.nc_matmul(acc, ta, tb)  # accumulates
        twice = _store(acc)
        nisa.nc_matmul(acc, ta, tb, accumulate=False)  # explicit overwrite
        once = _store(acc)
        nisa.memset(acc, 0.0)  # a non-matmul write ends the accumulation group
        nisa.nc_matmul(acc, ta, tb)
        after_memset = _store(acc)
        return twice, once, after_memset

    twice, once, after_memset = _run(kernel, s, mv)
    golden = s.T @ mv
    np.testing.assert_allclose(twice, 2 * golden, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(once, golden, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(after_memset, golden, rtol=1e-5, atol=1e-5)


def test_nc_matmul_in_a_pe_array_tile_computes_the_same_product():
    s, mv = _random((64, 32), F32, 25), _random((64, 100), F32, 26)

    def kernel(a, b):
        acc = nl.ndarray((32, 100), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(acc, _load(a), _load(b), tile_position=(64, 0), tile_size=(64, 64))
        return _store(acc)

    np.testing.assert_allclose(_run(kernel, s, mv), s.T @ mv, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("engine, shape", [("tensor", (128, 96)), ("tensor", (5, 1)), ("vector", (32, 17))])
@pytest.mark.parametrize("dtype", DTYPES)
def test_nc_transpose_engines(engine, shape, dtype):
    a = _random(shape, dtype, 14)

    def kernel(x):
        out = nl.ndarray(shape[::-1], dtype, buffer=nl.psum if engine == "tensor" else nl.sbuf)
        nisa.nc_transpose(out, _load(x), engine=getattr(nisa.engine, engine))
        return _store(out)

    np.testing.assert_array_equal(_run(kernel, a), a.T)


def test_dma_copy_converts_dtype_and_gathers_indirectly():
    table = _random((50, 16), F32, 15)
    index = np.array([[3], [0], [49], [3], [17]], dtype=np.int32)

    def kernel(t, idx):
        rows = nl.ndarray((5, 16), nl.bfloat16)
        nisa.dma_copy(rows, t.ap([[16, 5], [1, 16]], vector_offset=_load(idx), indirect_dim=0))
        return _store(rows)

    np.testing.assert_array_equal(_run(kernel, table, index), table[index[:, 0]].astype(nl.bfloat16))


def test_dma_copy_indirect_scatter_and_oob_skip():
    values = _random((3, 4), F32, 16)
    index = np.array([[5], [1], [99]], dtype=np.int32)

    def kernel(v, idx):
        out = nl.ndarray((8, 4), nl.float32, buffer=nl.shared_hbm)
        zero = nl.ndarray((8, 4), nl.float32)
        nisa.memset(zero, 0.0)
        nisa.dma_copy(out, zero)
        nisa.dma_copy(out.ap([[4, 3], [1, 4]], vector_offset=_load(idx), indirect_dim=0), _load(v),
                      oob_mode=nisa.oob_mode.skip)
        return out

    golden = np.zeros((8, 4), F32)
    golden[5], golden[1] = values[0], values[1]
    np.testing.assert_array_equal(_run(kernel, values, index), golden)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dma_transpose(dtype):
    a = _random((64, 40), dtype, 17)

    def kernel(x):
        out = nl.ndarray((40, 64), dtype)
        nisa.dma_transpose(out, x)
        return _store(out)

    np.testing.assert_array_equal(_run(kernel, a), a.T)


@settings(max_examples=15, deadline=None)
@given(p=partitions, chunks=st.integers(1, 3), f=st.sampled_from([1, 2, 33, 512]))
def test_bn_stats_bn_aggr_give_mean_and_population_variance(p, chunks, f):
    a = _random((p, chunks * f), F32, 18)

    def kernel(x):
        tx = _load(x)
        stats = nl.ndarray((p, chunks * 6), nl.float32)
        for c in range(chunks):
            nisa.bn_stats(stats[:, c * 6:(c + 1) * 6], tx[:, c * f:(c + 1) * f])
        result = nl.ndarray((p, 2), nl.float32)
        nisa.bn_aggr(result, stats)
        return _store(result)

    result = _run(kernel, a)
    np.testing.assert_allclose(result[:, 0], a.mean(axis=1), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(result[:, 1], a.var(axis=1), rtol=1e-4, atol=1e-5)


@settings(max_examples=15, deadline=None)
@given(p=partitions, f=st.sampled_from([1, 5, 64]), ops=st.sampled_from([("multiply", "add"), ("add", "add"),
                                                                          ("maximum", "multiply")]))
def test_tensor_tensor_scan_recurrence(p, f, ops):
    a, b = _random((p, f), F32, 19), _random((p, f), F32, 20)
    init = _random((p, 1), F32, 21)
    op0, op1 = ops

    def kernel(x, y, i):
        out = nl.ndarray((p, f), nl.float32)
        nisa.tensor_tensor_scan(out, _load(x), _load(y), _load(i), getattr(nl, op0), getattr(nl, op1))
        return _store(out)

    fns = {"multiply": np.multiply, "add": np.add, "maximum": np.maximum}
    golden = np.empty((p, f), F32)
    state = init[:, 0]
    for i in range(f):
        state = fns[op1](fns[op0](a[:, i], state), b[:, i]).astype(F32)
        golden[:, i] = state
    np.testing.assert_allclose(_run(kernel, a, b, init), golden, rtol=1e-5, atol=1e-5)


def test_reciprocal_and_partition_reduce():
    a = _random((16, 24), F32, 22, 0.5, 3.0)

    def kernel(x):
        tx = _load(x)
        inverse = nl.ndarray((16, 24), nl.float32)
        nisa.reciprocal(inverse, tx)
        column_max = nl.ndarray((1, 24), nl.float32)
        nisa.tensor_partition_reduce(column_max, nl.maximum, tx)
        return _store(inverse), _store(column_max)

    inverse, column_max = _run(kernel, a)
    np.testing.assert_array_equal(inverse, F32(1) / a)
    np.testing.assert_array_equal(column_max[0], a.max(axis=0))


def test_alu_unary_operators_in_tensor_scalar_over_every_special_value():
    """GpSimd's rsqrt and the ALU reciprocal as tensor_scalar stages (their operand unread): fp32 over every input,
    with IEEE's special values; an activation function is not an ALU operator; the cost model charges the
    reciprocal 8 and rsqrt 4 cycles per element."""
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 2.0**-126, 3.4e38, 2.0**-140, 7.0, -2.5],
                        dtype=F32).reshape(3, 4).repeat(32, axis=1)  # 128 elements per partition

    def kernel(x):
        tx = _load(x)
        rsqrt, inverse = nl.ndarray((3, 128), nl.float32), nl.ndarray((3, 128), nl.float32)
        nisa.tensor_scalar(rsqrt, tx, op0=nl.rsqrt, operand0=0.0, engine=nisa.engine.gpsimd)
        nisa.tensor_scalar(inverse, tx, op0=nl.reciprocal, operand0=0.0, engine=nisa.engine.gpsimd)
        return _store(rsqrt), _store(inverse)

    run = nki.run_kernel(kernel, [specials])
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(run.outputs[0], F32(1) / np.sqrt(specials))
        np.testing.assert_array_equal(run.outputs[1], F32(1) / specials)
    assert np.signbit(run.outputs[0][0, 32]) and np.signbit(run.outputs[1][0, 32])  # rsqrt(-0) = 1/-0 = -inf
    cycles = {r.attrs["op0"]: instruction_cycles(r)[1] for r in run.trace if r.name == "tensor_scalar"}
    assert cycles == {"rsqrt": 4 * 128, "reciprocal": 8 * 128}

    def activation_function(x):
        tx = _load(x)
        nisa.tensor_scalar(tx, tx, op0=nl.exp, operand0=0.0)
        return _store(tx)

    with pytest.raises(nki.NkiValidationError, match="exp is an activation function, not an ALU operator"):
        _run(activation_function, specials)


@settings(max_examples=10, deadline=None)
@given(p=partitions, f=st.sampled_from([8, 9, 100, 512]))
def test_max8_and_find_index8_give_top_values_and_their_first_index(p, f):
    rng = np.random.default_rng(p * 1000 + f)
    a = rng.permutation(np.arange(p * f, dtype=F32)).reshape(p, f)  # distinct values: the indices are unique

    def kernel(x):
        tx = _load(x)
        top = nl.ndarray((p, 8), nl.float32)
        nisa.max8(top, tx)
        where = nl.ndarray((p, 8), nl.uint32)
        nisa.nc_find_index8(where, tx, top)
        return _store(top), _store(where)

    top, where = _run(kernel, a)
    order = np.argsort(-a, axis=1)[:, :8]
    np.testing.assert_array_equal(top, np.take_along_axis(a, order, axis=1))
    np.testing.assert_array_equal(where, order)


def test_trace_records_engine_operands_and_flops():
    s, mv = _random((64, 32), nl.bfloat16, 23), _random((64, 256), nl.bfloat16, 24)

    def kernel(a, b):
        acc = nl.ndarray((32, 256), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(acc, _load(a), _load(b))
        return _store(acc)

    trace = nki.run_kernel(kernel, [s, mv]).trace
    matmul = next(r for r in trace if r.name == "nc_matmul")
    assert matmul.engine == "tensor" and matmul.flops == 2 * 64 * 32 * 256
    assert [o.role for o in matmul.srcs] == ["stationary", "moving"]
    assert matmul.dst.buffer == "psum" and matmul.dst.free_elems == 256 and matmul.srcs[0].dtype == "bfloat16"
    loads = [r for r in trace if r.name == "dma_copy" and r.srcs[0].buffer == "hbm"]
    assert len(loads) == 2 and loads[1].srcs[0].nbytes == 64 * 256 * 2
    assert {r.engine for r in trace} == {"dma", "tensor", "vector"}


def test_dma_trace_counts_hbm_side_in_the_sbuf_partitions():
    x = _random((4, 32, 16), F32, 31)

    def kernel(a):
        tile = nl.ndarray((128, 16), nl.float32)
        nisa.dma_copy(tile, a)  # 3-D HBM source spread over 128 partitions
        return _store(tile)

    load = nki.run_kernel(kernel, [x]).trace[0]
    assert load.srcs[0].partitions == 128 and load.srcs[0].free_elems == 16 and load.dst.partitions == 128


def test_get_nc_version_follows_target():
    def kernel():
        version = nisa.get_nc_version()
        out = nl.ndarray((1, 1), nl.int32)
        nisa.memset(out, int(version))
        return _store(out)

    assert nki.run_kernel(kernel, [], target="trn1").outputs[0][0, 0] == 2
    assert nki.run_kernel(kernel, [], target="trn3").outputs[0][0, 0] == 4


@settings(max_examples=10, deadline=None)
@given(p=partitions, f=free_sizes, reverse=st.booleans(), scalar=st.booleans())
def test_tensor_copy_predicated_copies_where_the_predicate_holds(p, f, reverse, scalar):
    a, b = _random((p, f), F32, 1), _random((p, f), F32, 2)
    a[0, 0], b[-1, -1] = np.inf, np.nan  # an exact select passes them through
    pred = (_random((p, f), F32, 3) > 0).astype(np.uint8)

    def kernel(x, y, m):
        out = _load(y)
        nisa.tensor_copy_predicated(dst=out, src=2.5 if scalar else _load(x), predicate=_load(m), reverse_pred=reverse)
        return _store(out)

    chosen = (pred == 0) if reverse else (pred != 0)
    golden = np.where(chosen, np.float32(2.5) if scalar else a, b)
    np.testing.assert_array_equal(_run(kernel, a, b, pred), golden)


@pytest.mark.parametrize("case,rule", [("float predicate", "err_predicate_dtype"),
                                       ("dtype mismatch", "err_predicated_copy_dtype")])
def test_tensor_copy_predicated_rejects_what_the_hardware_does(case, rule):
    a = np.ones((4, 8), F32)

    def kernel(x):
        out = _load(x)
        if case == "float predicate":
            nisa.tensor_copy_predicated(dst=out, src=_load(x), predicate=_load(x))
        else:
            nisa.tensor_copy_predicated(dst=out, src=_load(x, nl.bfloat16), predicate=_load(x, nl.uint8))
        return _store(out)

    with pytest.raises(nki.NkiValidationError, match=rule):
        _run(kernel, a)


@pytest.mark.parametrize("source", [np.float32, np.float16])
@pytest.mark.parametrize("destination", [np.int8, np.uint8, np.int16, np.int32])
def test_a_float_to_integer_store_rounds_to_nearest_and_saturates(source, destination):
    """nan stores 0, halves round to even, values beyond the integer's range its extremes; an infinity first becomes
    the float's largest finite value (as np.nan_to_num makes it), which float16's 65504 leaves inside int32."""
    values = np.array([np.nan, np.inf, -np.inf, 2.5, -3.5, 1e30, -1e30, 0.5, -0.0, 300.0, -300.0], dtype=source)
    info = np.iinfo(destination)
    top = 65504 if source is np.float16 and destination is np.int32 else info.max  # 1e30 is inf in float16
    bottom = -65504 if source is np.float16 and destination is np.int32 else info.min
    expected = [0, top, bottom, 2, max(-4, info.min), top, bottom, 0, 0, min(300, info.max), max(-300, info.min)]
    np.testing.assert_array_equal(rules.cast_to(values, np.dtype(destination)), np.array(expected, dtype=destination))

"""nki.language of the simulator: tensor views and access patterns, creation, wrappers, elementwise functions,
reductions, launch ids and the launcher API (jit, run_kernel, load_module, nki_import_alias, hooks)."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from neuron_compile.runtime import simulator as nki
from neuron_compile.runtime.simulator.errors import NkiValidationError

nl = nki.language
nisa = nki.isa
F32 = np.float32


def _random(shape, dtype=F32, seed=0, low=-2.0, high=2.0):
    return np.random.default_rng(seed).uniform(low, high, size=shape).astype(F32).astype(dtype)


def _store(tile):
    out = nl.ndarray(tile.shape, tile.dtype, buffer=nl.shared_hbm)
    nl.store(out, tile)
    return out


# ------------------------------------------------------------------------------------------------ views
def test_on_chip_indexing_keeps_partition_dim_and_two_dims():
    def kernel():
        t = nl.ndarray((64, 64, 64), nl.float32)
        h = nl.ndarray((64, 64, 64), nl.float32, buffer=nl.hbm)
        assert t[:, 0, 10].shape == (64, 1)
        assert t[3].shape == (1, 64, 64)
        assert t[..., 5].shape == (64, 64)
        assert h[:, 0, 10].shape == (64,)
        assert h[3].shape == (64, 64)
        assert t[nl.ds(8, 16), ::2, -1].shape == (16, 32)

    nki.run_kernel(kernel, [])


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 20), cols=st.integers(1, 20), data=st.data())
def test_hbm_views_read_like_numpy_views(rows, cols, data):
    array = np.arange(rows * cols, dtype=F32).reshape(rows, cols)
    r0 = data.draw(st.integers(0, rows - 1))
    r1 = data.draw(st.integers(r0 + 1, rows))
    step = data.draw(st.integers(1, 3))
    c = data.draw(st.integers(-cols, cols - 1))
    views = {}

    def kernel(x):
        views["slice"] = np.array(x[r0:r1:step, :])
        views["negative"] = np.array(x[:, c])
        views["reversed"] = np.array(x[::-1, ::-1])
        views["permuted"] = np.array(x.permute((1, 0)))
        views["reshaped"] = np.array(x.reshape((cols, rows)))
        views["ap"] = np.array(x.ap([[1, cols], [cols, rows]]))  # transpose by access pattern

    nki.run_kernel(kernel, [array])
    np.testing.assert_array_equal(views["slice"], array[r0:r1:step, :])
    np.testing.assert_array_equal(views["negative"], array[:, c])
    np.testing.assert_array_equal(views["reversed"], array[::-1, ::-1])
    np.testing.assert_array_equal(views["permuted"], array.T)
    np.testing.assert_array_equal(views["reshaped"], array.reshape(cols, rows))
    np.testing.assert_array_equal(views["ap"], array.T)


def test_on_chip_ap_broadcast_expand_squeeze_and_dtype_view():
    array = _random((4, 6))

    def kernel(x):
        t = nl.load(x)
        assert np.array_equal(np.array(t.ap([[6, 4], [2, 3]], offset=1)), array[:, 1::2])
        column = t[:, 0]
        assert np.array_equal(np.array(column.broadcast(1, 5)), np.repeat(array[:, :1], 5, axis=1))
        assert t.expand_dim(1).shape == (4, 1, 6) and nl.expand_dims(t, 2).shape == (4, 6, 1)
        assert np.array_equal(np.array(nl.broadcast_to(column, (4, 3))), np.repeat(array[:, :1], 3, axis=1))
        assert t.expand_dim(1).squeeze_dim(1).shape == (4, 6)
        bits = t.view(nl.int32)
        assert np.array_equal(np.array(bits), array.view(np.int32))

    nki.run_kernel(kernel, [array])


def test_dtype_views_of_other_element_sizes_reinterpret_bytes():
    array = _random((4, 6))

    def kernel(x):
        t = nl.load(x)
        halves = t.view(nl.bfloat16)
        assert halves.shape == (4, 12)
        assert np.array_equal(np.array(halves).view(np.uint16), array.view(np.uint16))
        assert np.array_equal(np.array(t[:, 2:4].view(nl.int8)), array[:, 2:4].view(np.int8))
        assert np.array_equal(np.array(x.view(nl.uint16)[1:3]), array.view(np.uint16)[1:3])

    nki.run_kernel(kernel, [array])


@settings(max_examples=25, deadline=None)
@given(p=st.integers(1, 16), f=st.integers(4, 64), data=st.data())
def test_on_chip_access_patterns_address_flat_storage(p, f, data):
    """view[c, j, k] = flat[offset + c * f + j * s1 + k * s2], checked against numpy as_strided."""
    s1, n1 = data.draw(st.integers(0, 8)), data.draw(st.integers(1, 4))
    s2, n2 = data.draw(st.integers(0, 3)), data.draw(st.integers(1, 4))
    reach = s1 * (n1 - 1) + s2 * (n2 - 1)
    assume(reach < f)  # stay inside each partition's f elements
    offset = data.draw(st.integers(0, f - 1 - reach))
    array = np.arange(p * f, dtype=F32).reshape(p, f)
    seen = {}

    def kernel(x):
        tile = nl.load(x)
        seen["view"] = np.array(tile.ap([[f, p], [s1, n1], [s2, n2]], offset=offset))
        with pytest.raises(NkiValidationError, match="err_tensor_access_out_of_bound"):
            tile.ap([[f, p], [s1, n1], [s2, n2]], offset=offset + p * f).read()

    nki.run_kernel(kernel, [array])
    item = array.itemsize
    strides = (f * item, s1 * item, s2 * item)
    golden = np.lib.stride_tricks.as_strided(array.reshape(-1)[offset:], (p, n1, n2), strides)
    np.testing.assert_array_equal(seen["view"], golden)


def test_views_share_storage_so_writes_land_in_the_parent():
    def kernel():
        t = nl.zeros((4, 8), nl.float32)
        nisa.memset(t[:, 2:4], 7.0)
        nisa.memset(t.ap([[8, 4], [8, 1]], offset=7), 1.0)  # last column of each partition
        return _store(t)

    golden = np.zeros((4, 8), F32)
    golden[:, 2:4], golden[:, 7] = 7, 1
    np.testing.assert_array_equal(nki.run_kernel(kernel, []).outputs[0], golden)


# ------------------------------------------------------------------------------------------------ creation
def test_creation_functions():
    def kernel():
        return (_store(nl.zeros((3, 2), nl.float32)), _store(nl.ones((3, 2), nl.bfloat16)),
                _store(nl.full((3, 2), 5, nl.int32)), _store(nl.zeros_like(nl.ndarray((2, 2), nl.float16))),
                _store(nl.empty_like(nl.ndarray((2, 2), nl.int16))))

    zeros, ones, fives, like, empty = nki.run_kernel(kernel, []).outputs
    np.testing.assert_array_equal(zeros, np.zeros((3, 2)))
    assert ones.dtype == nl.bfloat16 and (ones.astype(F32) == 1).all()
    np.testing.assert_array_equal(fives, np.full((3, 2), 5))
    assert like.dtype == np.float16 and (like == 0).all()
    assert (empty == 4).all()


def test_tile_size_follows_target():
    seen = {}

    def kernel():
        ts = nl.tile_size
        seen.update(pmax=ts.pmax, psum=ts.psum_bank_fmax, stat=ts.gemm_stationary_fmax, mov=ts.gemm_moving_fmax,
                    bn=ts.bn_stats_fmax, banks=ts.psum_num_banks, sbuf=ts.sbuf_size_bytes)

    nki.run_kernel(kernel, [], target="trn1")
    assert seen == dict(pmax=128, psum=512, stat=128, mov=512, bn=512, banks=8, sbuf=180224)


# ------------------------------------------------------------------------------------------------ wrappers
ELEMENTWISE_UNARY = {
    "exp": np.exp, "log": np.log, "sqrt": np.sqrt, "rsqrt": lambda x: 1 / np.sqrt(x), "tanh": np.tanh,
    "sigmoid": lambda x: 1 / (1 + np.exp(-x)), "relu": lambda x: np.maximum(x, 0), "abs": np.abs,
    "square": np.square, "reciprocal": lambda x: 1 / x, "sin": np.sin, "cos": np.cos, "arctan": np.arctan,
    "ceil": np.ceil, "floor": np.floor, "trunc": np.trunc, "negative": np.negative, "sign": np.sign,
    "softplus": lambda x: np.log1p(np.exp(x)), "silu": lambda x: x / (1 + np.exp(-x)),
    "mish": lambda x: x * np.tanh(np.log1p(np.exp(x))), "gelu_apprx_sigmoid": lambda x: x / (1 + np.exp(-1.702 * x)),
}
ELEMENTWISE_BINARY = {
    "add": np.add, "subtract": np.subtract, "multiply": np.multiply, "maximum": np.maximum, "minimum": np.minimum,
    "power": np.power, "equal": np.equal, "not_equal": np.not_equal, "less": np.less, "less_equal": np.less_equal,
    "greater": np.greater, "greater_equal": np.greater_equal, "abs_max": lambda a, b: np.maximum(abs(a), abs(b)),
    "abs_min": lambda a, b: np.minimum(abs(a), abs(b)), "logical_and": np.logical_and, "logical_or": np.logical_or,
    "logical_xor": np.logical_xor,
}


@pytest.mark.parametrize("name", sorted(ELEMENTWISE_UNARY))
@pytest.mark.parametrize("dtype", [np.dtype(F32), nl.bfloat16])
def test_unary_elementwise_functions(name, dtype):
    # inputs in (0.1, 1.5): inside every function's valid range (arctan's is [-pi/2, pi/2]; test_simulator_limits
    # checks the refusals outside)
    x = _random((5, 33), dtype, 1, 0.1, 1.5)

    def kernel(a):
        return _store(getattr(nl, name)(nl.load(a), dtype=nl.float32))

    golden = ELEMENTWISE_UNARY[name](x.astype(np.float64))
    np.testing.assert_allclose(nki.run_kernel(kernel, [x]).outputs[0], golden, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("name", sorted(ELEMENTWISE_BINARY))
def test_binary_elementwise_functions_tile_tile_scalar_and_column(name):
    x, y = _random((6, 9), F32, 2, 0.5, 2.0), _random((6, 9), F32, 3, 0.5, 2.0)
    y[0, :3] = x[0, :3]  # some equal elements for the comparisons
    column = _random((6, 1), F32, 4, 0.5, 2.0)

    def kernel(a, b, c):
        ta, tb, tc = nl.load(a), nl.load(b), nl.load(c)
        fn = getattr(nl, name)
        return _store(fn(ta, tb)), _store(fn(ta, 1.5)), _store(fn(2.0, ta)), _store(fn(ta, tc))

    both, right, left, col = nki.run_kernel(kernel, [x, y, column]).outputs
    golden = ELEMENTWISE_BINARY[name]
    np.testing.assert_allclose(both, golden(x, y).astype(F32), rtol=1e-6)
    np.testing.assert_allclose(right, golden(x, F32(1.5)).astype(F32), rtol=1e-6)
    np.testing.assert_allclose(left, golden(F32(2.0), x).astype(F32), rtol=1e-6)
    np.testing.assert_allclose(col, golden(x, column).astype(F32), rtol=1e-6)


_erf = np.vectorize(math.erf)
DERIVATIVES = {  # name -> the function it differentiates (float64), checked by central differences
    "gelu_dx": lambda x: 0.5 * x * (1 + _erf(x / np.sqrt(2))),
    "silu_dx": lambda x: x / (1 + np.exp(-x)),
    "erf_dx": _erf,
    "gelu_apprx_sigmoid_dx": lambda x: x / (1 + np.exp(-1.702 * x)),
}


@pytest.mark.parametrize("name", sorted(DERIVATIVES))
def test_derivative_activations_match_finite_differences(name):
    x = np.linspace(-3, 3, 64, dtype=F32).reshape(2, 32)

    def kernel(a):
        return _store(getattr(nl, name)(nl.load(a)))

    h = 1e-5
    fn = DERIVATIVES[name]
    golden = (fn(x.astype(np.float64) + h) - fn(x.astype(np.float64) - h)) / (2 * h)
    np.testing.assert_allclose(nki.run_kernel(kernel, [x]).outputs[0], golden, atol=2e-5)


def test_bitwise_functions_on_integer_tiles():
    a = np.arange(24, dtype=np.int32).reshape(4, 6)
    b = np.full((4, 6), 5, dtype=np.int32)

    def kernel(x, y):
        tx, ty = nl.load(x), nl.load(y)
        return (_store(nl.bitwise_and(tx, ty)), _store(nl.bitwise_or(tx, ty)), _store(nl.bitwise_xor(tx, ty)),
                _store(nl.left_shift(tx, 2)), _store(nl.right_shift(tx, 1)), _store(nl.invert(tx)))

    outputs = nki.run_kernel(kernel, [a, b]).outputs
    goldens = [a & b, a | b, a ^ b, a << 2, a >> 1, ~a]
    for got, want in zip(outputs, goldens):
        np.testing.assert_array_equal(got, want)


def test_nl_softmax_wrapper():
    x = _random((70, 33), F32, 11, -4, 4)

    def kernel(a):
        return _store(nl.softmax(nl.load(a), axis=-1))

    e = np.exp(x - x.max(axis=1, keepdims=True))
    np.testing.assert_allclose(nki.run_kernel(kernel, [x]).outputs[0], e / e.sum(axis=1, keepdims=True), rtol=1e-6)


def test_type_promotion_of_wrappers():
    def kernel():
        bf = nl.ones((2, 2), nl.bfloat16)
        fp16 = nl.ones((2, 2), nl.float16)
        i8, u8 = nl.ones((2, 2), nl.int8), nl.ones((2, 2), nl.uint8)
        assert nl.add(bf, fp16).dtype == nl.float32
        assert nl.add(bf, 1).dtype == nl.bfloat16
        assert nl.add(fp16, 1.5).dtype == nl.float32  # weak float scalars are fp32
        assert nl.add(i8, u8).dtype == nl.int16
        assert nl.multiply(bf, bf, dtype=nl.float32).dtype == nl.float32

    nki.run_kernel(kernel, [])


@pytest.mark.parametrize("name, golden", [("sum", np.sum), ("max", np.max), ("min", np.min), ("mean", np.mean),
                                          ("prod", np.prod), ("var", np.var), ("all", np.all)])
def test_reductions_over_last_free_axes(name, golden):
    x = _random((7, 4, 5), F32, 5, 0.5, 1.5)
    if name == "all":
        x[2, 1, 3] = 0

    def kernel(a):
        t = nl.load(a)
        axes = (1, 2)
        results = [_store(getattr(nl, name)(t, axis=axes))]
        if name != "var":
            results.append(_store(getattr(nl, name)(t, axis=2, keepdims=True)))
        return tuple(results)

    outputs = nki.run_kernel(kernel, [x]).outputs
    np.testing.assert_allclose(outputs[0].reshape(7), golden(x, axis=(1, 2)), rtol=1e-5)
    if name != "var":
        np.testing.assert_allclose(outputs[1], golden(x, axis=2, keepdims=True), rtol=1e-5)


def test_reduction_axis_rule_rejects_partition_and_non_trailing_axes():
    def kernel(a):
        t = nl.load(a)
        with pytest.raises(NkiValidationError, match="err_reduce_axis"):
            nl.sum(t, axis=0)
        with pytest.raises(NkiValidationError, match="err_reduce_axis"):
            nl.sum(t, axis=1)

    nki.run_kernel(kernel, [np.zeros((4, 3, 2), F32)])


def test_load_store_copy_transpose_matmul_wrappers():
    a, b = _random((96, 64), F32, 6), _random((96, 200), F32, 7)
    m = _random((40, 96), F32, 8)

    def kernel(x, y, z):
        tx, ty, tz = nl.load(x), nl.load(y), nl.load(z)
        as_bf16 = nl.copy(tx, dtype=nl.bfloat16)
        transposed = nl.transpose(tx)
        transposed_load = nl.load_transpose2d(x)
        product_t = nl.matmul(tx, ty, transpose_x=True)
        product = nl.matmul(tz, ty)
        return (_store(as_bf16), _store(transposed), _store(transposed_load), _store(product_t), _store(product),
                _store(nl.load(x, dtype=nl.bfloat16)))

    bf, tr, trl, pt, p, loaded = nki.run_kernel(kernel, [a, b, m]).outputs
    np.testing.assert_array_equal(bf, a.astype(nl.bfloat16))
    np.testing.assert_array_equal(tr, a.T)
    np.testing.assert_array_equal(trl, a.T)
    np.testing.assert_allclose(pt, a.T @ b, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(p, m @ b, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(loaded, a.astype(nl.bfloat16))


def test_where_selects():
    cond = (np.arange(12).reshape(3, 4) % 2).astype(F32)
    x, y = _random((3, 4), F32, 9), _random((3, 4), F32, 10)

    def kernel(c, a, b):
        return _store(nl.where(nl.load(c), nl.load(a), nl.load(b)))

    np.testing.assert_allclose(nki.run_kernel(kernel, [cond, x, y]).outputs[0], np.where(cond > 0, x, y), rtol=1e-6)


# ------------------------------------------------------------------------------------------------ launcher
@nki.jit
def _row_block_copy(x):
    """Each of the LNC programs copies its half of the rows."""
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    half = x.shape[0] // nl.num_programs()
    rows = nl.ds(nl.program_id(0) * half, half)
    tile = nl.ndarray((half, x.shape[1]), x.dtype)
    nisa.dma_copy(tile, x[rows, :])
    doubled = nl.ndarray(tile.shape, x.dtype)
    nisa.tensor_scalar(doubled, tile, nl.multiply, 2.0)
    nisa.dma_copy(out[rows, :], doubled)
    return out


def test_jit_lnc_programs_share_outputs_and_torch_roundtrip():
    x = _random((8, 3))
    np.testing.assert_array_equal(_row_block_copy[2](x), 2 * x)
    assert len(_row_block_copy.last_run.trace) == 2 * 3
    result = _row_block_copy(torch.from_numpy(x).to(torch.bfloat16))
    assert isinstance(result, torch.Tensor) and result.dtype == torch.bfloat16
    torch.testing.assert_close(result, 2 * torch.from_numpy(x).to(torch.bfloat16))
    assert nki.simulate(_row_block_copy)(x).shape == (8, 3)


def test_run_kernel_with_plain_function_and_launch_hooks():
    seen = []
    nki.launch_hooks.append(seen.append)
    try:
        run = nki.run_kernel(_row_block_copy.fn, [np.ones((4, 2), F32)], target="trn3")
    finally:
        nki.launch_hooks.remove(seen.append)
    assert seen == [run] and run.target.name == "trn3"
    np.testing.assert_array_equal(run.outputs[0], np.full((4, 2), 2))
    assert {r.name for r in run.trace} == {"dma_copy", "tensor_scalar"}


KERNEL_SOURCE = '''
import nki
import nki.language as nl
import nki.typing as nt
from nki import isa as nisa
from nki.language import ds


@nki.jit
def scale_kernel(x: nt.tensor[3, 5, nl.float32], factor):
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    tile = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=x[ds(0, x.shape[0]), :])
    nisa.tensor_scalar(dst=tile, data=tile, op0=nl.multiply, operand0=factor)
    nisa.dma_copy(dst=out, src=tile)
    return out
'''


def test_load_module_binds_nki_without_touching_sys_modules():
    before = {k for k in sys.modules if k == "nki" or k.startswith("nki.")}
    module = nki.load_module(KERNEL_SOURCE, "scale_module")
    x = _random((3, 5))
    np.testing.assert_allclose(module.scale_kernel(x, 3.0), 3 * x, rtol=1e-6)
    np.testing.assert_allclose(nki.run_kernel(module.scale_kernel, [x, 0.5]).outputs[0], 0.5 * x, rtol=1e-6)
    assert {k for k in sys.modules if k == "nki" or k.startswith("nki.")} == before


def test_nki_import_alias_is_restored():
    assert "nki" not in sys.modules
    with nki.nki_import_alias():
        import nki as aliased
        import nki.isa as aliased_isa

        assert aliased is nki and aliased_isa is nisa
    assert "nki" not in sys.modules and "nki.isa" not in sys.modules


def test_kernel_report_is_the_cost_model():
    run = nki.run_kernel(_row_block_copy, [np.ones((128, 64), F32)])
    report = run.report
    assert report is run.report  # computed once
    assert report.hbm_bytes > 0


def test_launch_restores_the_blas_thread_count():
    from neuron_compile.runtime.simulator import blas_threads

    if blas_threads._OPENBLAS is None:
        pytest.skip("numpy does not use OpenBLAS here")
    get_threads = blas_threads._OPENBLAS[0]
    before, inside = get_threads(), []
    nki.run_kernel(lambda: inside.append(get_threads()), [])
    assert inside == [1] and get_threads() == before


def test_a_kernel_writing_an_input_mutates_the_callers_array():
    cache = np.zeros((6, 4), F32)
    update = _random((2, 4), F32, 30)
    cache_torch = torch.zeros(6, 4)

    def index_copy(c, u):
        rows = nl.load(u)
        nisa.dma_copy(c[3:5, :], rows)

    nki.run_kernel(index_copy, [cache, update])
    nki.run_kernel(index_copy, [cache_torch, update])
    golden = np.zeros((6, 4), F32)
    golden[3:5] = update
    np.testing.assert_array_equal(cache, golden)
    np.testing.assert_array_equal(cache_torch.numpy(), golden)
    untouched = np.zeros((6, 4), F32)

    def read_only(c, u):
        nl.load(c)

    nki.run_kernel(read_only, [untouched, update])
    assert (untouched == 0).all()

"""The API surface published kernels rely on: nki.dtype, nki.isa.constants and the engine selectors,
nl.NKIObject, the legacy neuronxcc.nki import alias, virtual registers and dynamic loops, dynamic offsets,
shared constants, and the rules the simulator keeps no stricter than the hardware (returning the caller's
HBM tensors, activation bias dtypes, partition broadcasts)."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
import pytest

from neuron_compile.runtime import simulator as nki
from neuron_compile.runtime.simulator.errors import NkiValidationError
from simulator_tiles import load_tile, store_tile

nl = nki.language
nisa = nki.isa
F32 = np.float32


LEGACY_SOURCE = '''
import nki
import nki.language as nl
import nki.isa as nisa
import neuronxcc.nki.typing as nt
from nki.isa.constants import oob_mode, dge_mode
from nki.language import NKIObject
from dataclasses import dataclass


@dataclass
class Config(NKIObject):
    scale: float = 2.0


@nki.jit
def scaled(x: nt.tensor[4, 8], dtype: nki.dtype = nl.float32, config: Config = Config()):
    tile = nl.ndarray(x.shape, dtype)
    nisa.dma_copy(tile, x, dge_mode=dge_mode.none, oob_mode=oob_mode.error)
    nisa.tensor_scalar(tile, tile, nl.multiply, config.scale, engine=nisa.vector_engine)
    out = nl.ndarray(x.shape, dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(out, tile)
    return out
'''


def test_published_kernel_imports_load_through_the_loader_without_sys_modules():
    before = set(sys.modules)
    module = nki.load_module(LEGACY_SOURCE, "legacy_names")
    assert not {name for name in set(sys.modules) - before if name.split(".")[0] in ("nki", "neuronxcc")}
    x = np.arange(32, dtype=F32).reshape(4, 8)
    np.testing.assert_array_equal(module.scaled(x), 2 * x)


def test_import_alias_binds_the_legacy_names_only_inside_the_block():
    with nki.nki_import_alias():
        import neuronxcc.nki.language as legacy_nl
        from nki.isa.constants import oob_mode

        assert legacy_nl is nl and oob_mode is nisa.oob_mode
        assert sys.modules["nki.dtype"].bfloat16 == nl.bfloat16
    assert "neuronxcc" not in sys.modules and "nki.isa.constants" not in sys.modules


def test_engine_selectors_and_constants_are_the_enums():
    assert nisa.vector_engine is nisa.engine.vector and nisa.gpsimd_engine is nisa.engine.gpsimd
    assert nisa.constants.dma_engine.gpsimd_dma.value == 2
    assert nisa.matmul_perf_mode.double_row.value == "double_row"
    assert nisa.get_nc_sub_version() == 0


def test_nki_object_takes_keywords_and_dataclass_subclasses_keep_theirs():
    base = nl.NKIObject(a=1, b="x")
    assert (base.a, base.b) == (1, "x")

    @dataclass
    class Tiling(nl.NKIObject):
        rows: int = 128
        cols: int = 512

    assert Tiling(cols=64) == Tiling(128, 64)


def test_packed_x4_dtypes_allocate_and_move():
    def kernel(x):
        tile = nl.ndarray((4, 2), nl.float8_e4m3fn_x4)
        nisa.dma_copy(tile, x.view(nl.float8_e4m3fn_x4))
        out = nl.ndarray((4, 2), nl.uint32, buffer=nl.shared_hbm)
        nisa.dma_copy(out, tile.view(nl.uint32))
        return out

    x = np.arange(8, dtype=np.uint32).reshape(4, 2)
    np.testing.assert_array_equal(nki.run_kernel(kernel, [x]).outputs[0], x)


def test_registers_drive_dynamic_loops_and_offsets():
    def kernel(data, count):
        bound = nl.ndarray((1, 1), nl.int32)
        nisa.dma_copy(bound, count)
        trips = nisa.register_alloc()
        nisa.register_load(trips, bound)
        acc = nl.zeros((1, 8), F32)
        row = nl.ndarray((1, 8), F32)
        for i in nl.dynamic_range(trips):
            nisa.dma_copy(row, data.ap([[8, 1], [1, 8]], scalar_offset=i, indirect_dim=0))
            nisa.tensor_tensor(acc, acc, row, nl.add)

        def body(i):
            nisa.dma_copy(row, data.ap([[8, 1], [1, 8]], scalar_offset=i, indirect_dim=0))
            nisa.tensor_tensor(acc, acc, row, nl.add)

        nl.fori_loop(0, trips, body)
        left = nisa.register_alloc(2)

        def countdown(r):
            nisa.tensor_scalar(acc, acc, nl.multiply, 2.0)
            nisa.register_move(r, int(r) - 1)
            return r

        nl.while_loop(left, countdown)
        stored = nl.ndarray((1, 1), nl.int32)
        nisa.register_store(stored, trips)
        return store_tile(acc), store_tile(stored)

    data = np.arange(48, dtype=F32).reshape(6, 8)
    acc, stored = nki.run_kernel(kernel, [data, np.array([[3]], np.int32)]).outputs
    np.testing.assert_array_equal(acc[0], 4 * 2 * data[:3].sum(axis=0))
    assert stored[0, 0] == 3


def test_scalar_offset_reads_a_one_element_sbuf_tensor():
    def kernel(data, where):
        position = load_tile(where)
        row = nl.ndarray((1, 4), F32)
        nisa.dma_copy(row, data.ap([[4, 1], [1, 4]], scalar_offset=position, indirect_dim=0))
        return store_tile(row)

    data = np.arange(20, dtype=F32).reshape(5, 4)
    np.testing.assert_array_equal(nki.run_kernel(kernel, [data, np.array([[3]], np.int32)]).outputs[0], data[3:4])


@pytest.mark.parametrize("bad", [lambda: nisa.register_load(nisa.register_alloc(), nl.zeros((2, 2), nl.int32)),
                                 lambda: int(nisa.register_alloc()),
                                 lambda: nisa.register_move(nisa.register_alloc(), 2**40),
                                 lambda: nl.dynamic_range(0, 4, step=0)])
def test_register_misuse_is_a_named_error(bad):
    with pytest.raises(NkiValidationError, match=r"err_(register_memory|register_uninitialized|register_value|"
                                                 r"dynamic_range_step)"):
        nki.run_kernel(lambda: bad(), [])


def test_shared_constants_and_identity():
    def kernel():
        identity = nl.shared_identity_matrix(n=32, dtype=nl.bfloat16)
        table = nl.shared_constant(np.arange(6, dtype=np.int32).reshape(2, 3))
        return store_tile(identity), table

    identity, table = nki.run_kernel(kernel, []).outputs
    np.testing.assert_array_equal(identity.astype(F32), np.eye(32))
    np.testing.assert_array_equal(table, np.arange(6).reshape(2, 3))


def test_a_kernel_may_return_the_callers_hbm_tensors_it_wrote():
    @nki.jit
    def add_one_in_place(x, out):
        tile = load_tile(x)
        nisa.tensor_scalar(tile, tile, nl.add, 1.0)
        nisa.dma_copy(out, tile)
        return out

    x, out = np.ones((4, 8), F32), np.zeros((4, 8), F32)
    result = add_one_in_place(x, out)
    np.testing.assert_array_equal(result, 2 * x)
    np.testing.assert_array_equal(out, 2 * x)  # written back into the caller's array


def test_a_kernel_may_not_return_private_hbm_it_allocated():
    def kernel():
        scratch = nl.ndarray((2, 2), F32, buffer=nl.private_hbm)
        scratch.write(np.zeros((2, 2), F32))
        return scratch

    with pytest.raises(NkiValidationError, match="err_output_must_be_shared_hbm"):
        nki.run_kernel(kernel, [])


@pytest.mark.parametrize("bias_dtype", [nl.bfloat16, nl.float16, nl.float32])
def test_activation_bias_may_be_any_float_dtype_but_scale_must_be_fp32(bias_dtype):
    x = np.random.default_rng(0).uniform(-1, 1, (8, 16)).astype(F32)
    bias = np.linspace(-1, 1, 8, dtype=F32).reshape(8, 1)

    def kernel(a, b):
        out = nl.ndarray((8, 16), F32)
        nisa.activation(out, nl.exp, load_tile(a), bias=load_tile(b, bias_dtype))
        return store_tile(out)

    rounded = bias.astype(bias_dtype).astype(F32)
    np.testing.assert_allclose(nki.run_kernel(kernel, [x, bias]).outputs[0], np.exp(x + rounded), rtol=1e-6)

    def bad_scale(a, b):
        out = nl.ndarray((8, 16), F32)
        nisa.activation(out, nl.exp, load_tile(a), scale=load_tile(b, nl.bfloat16))

    with pytest.raises(NkiValidationError, match="err_activation_scale_scalar_or_vector"):
        nki.run_kernel(bad_scale, [x, bias])


@pytest.mark.parametrize("dtype, shape", [(np.dtype(np.float32), (1, 7)), (nl.bfloat16, (1, 600)),
                                          (np.dtype(np.float32), (1, 3, 5))])
def test_broadcast_to_copies_a_one_partition_tile_to_every_partition(dtype, shape):
    row = np.random.default_rng(1).uniform(-3, 3, shape).astype(F32).astype(dtype)
    wide = (96,) + shape[1:]

    def kernel(r):
        return store_tile(nl.broadcast_to(load_tile(r), wide))

    run = nki.run_kernel(kernel, [row])
    np.testing.assert_array_equal(run.outputs[0], np.broadcast_to(row, wide))
    assert any(r.name == "nc_matmul" for r in run.trace)  # the partition broadcast runs on TensorE


def test_broadcast_to_refuses_a_partition_dim_that_is_not_one():
    with pytest.raises(NkiValidationError, match="err_broadcast_non_unit"):
        nki.run_kernel(lambda: nl.broadcast_to(nl.zeros((2, 4), F32), (8, 4)), [])


def test_tensors_placed_at_one_address_share_their_bytes():
    def kernel(x):
        whole = nl.ndarray((4, 8), F32, address=(0, 64))
        nisa.dma_copy(whole, x)
        second_half = nl.ndarray((4, 4), F32, address=(0, 64 + 16))  # 4 fp32 further into each partition
        lower_rows = nl.ndarray((2, 8), F32, address=(2, 64))
        as_bf16 = nl.ndarray((4, 16), nl.bfloat16, address=(0, 64))
        flat = whole.ap([[8, 2], [1, 8]], offset=16)  # the kernel's own layout: rows 2 and 3
        return store_tile(second_half), store_tile(lower_rows), store_tile(flat), store_tile(as_bf16)

    x = np.arange(32, dtype=F32).reshape(4, 8)
    second_half, lower_rows, flat, as_bf16 = nki.run_kernel(kernel, [x]).outputs
    np.testing.assert_array_equal(second_half, x[:, 4:])
    np.testing.assert_array_equal(lower_rows, x[2:])
    np.testing.assert_array_equal(flat, x[2:])
    np.testing.assert_array_equal(as_bf16.view(np.uint16), x.view(np.uint16).reshape(4, 16))


def test_psum_tiles_placed_in_one_bank_alias_and_start_new_accumulation_groups():
    def kernel(a, b):
        left, right = load_tile(a), load_tile(b)
        first = nl.ndarray((8, 8), F32, buffer=nl.psum, address=(0, 2048))
        nisa.nc_matmul(first, left, right)
        staged = nl.ndarray((8, 8), F32)
        nisa.tensor_copy(staged, first)
        again = nl.ndarray((8, 8), F32, buffer=nl.psum, address=(0, 2048))  # the same bank, next output tile
        nisa.nc_matmul(again, left, right)
        nisa.nc_matmul(again, left, right)
        result = nl.ndarray((8, 8), F32)
        nisa.tensor_copy(result, again)
        return store_tile(staged), store_tile(result)

    a, b = np.ones((8, 8), F32), np.full((8, 8), 2.0, F32)
    staged, again = nki.run_kernel(kernel, [a, b]).outputs
    np.testing.assert_array_equal(staged, a.T @ b)
    np.testing.assert_array_equal(again, 2 * (a.T @ b))


@pytest.mark.parametrize("shape, address, buffer, rule", [
    ((4, 8), (0, 2000), nl.psum, "err_psum_address_bank"),
    ((4, 8), (126, 0), nl.sbuf, "err_address_out_of_bounds"),
    ((4, 8), (0, 2), nl.sbuf, "err_address_alignment"),
    ((4, 600), (0, 15 * 1024), nl.psum, "err_address_out_of_bounds"),
])
def test_placement_limits(shape, address, buffer, rule):
    with pytest.raises(NkiValidationError) as info:
        nki.run_kernel(lambda: nl.ndarray(shape, F32, buffer=buffer, address=address), [])
    assert info.value.rule == rule


def test_named_views_match_numpy():
    def kernel(x, rows):
        tile = nl.ndarray((4, 24), F32)
        nisa.dma_copy(tile, x)
        split = tile.reshape_dim(1, (4, -1))  # (4, 4, 6)
        swapped = tile.rearrange(("p", ("h", "w")), ("p", "w", "h"), {"h": 4})  # (4, 6, 4)
        merged = split.flatten_dims(1, 2)
        picked = nl.ndarray((3, 24), F32)
        index = nl.ndarray((3, 1), nl.int32)
        nisa.dma_copy(index, rows)
        nisa.dma_copy(picked, x.vector_select(0, index))
        one = nl.ndarray((1, 1), nl.int32)
        nisa.memset(one, 2)
        row_two = nl.ndarray((1, 24), F32)
        nisa.dma_copy(row_two, x.select(0, one))
        outs = [split.slice(2, 1, 5, 2), swapped, merged, tile.select(1, 5), picked, row_two]
        copies = []
        for view in outs:
            copy = nl.ndarray(view.shape, F32)
            nisa.tensor_copy(copy, view)
            copies.append(store_tile(copy))
        return tuple(copies)

    x = np.arange(96, dtype=F32).reshape(4, 24)
    rows = np.array([[3], [0], [3]], np.int32)
    sliced, swapped, merged, column, picked, row_two = nki.run_kernel(kernel, [x, rows]).outputs
    np.testing.assert_array_equal(sliced, x.reshape(4, 4, 6)[:, :, 1:5:2])
    np.testing.assert_array_equal(swapped, x.reshape(4, 4, 6).transpose(0, 2, 1))
    np.testing.assert_array_equal(merged, x)
    np.testing.assert_array_equal(column, x[:, 5:6])
    np.testing.assert_array_equal(picked, x[[3, 0, 3]])
    np.testing.assert_array_equal(row_two, x[2:3])


@pytest.mark.parametrize("bad, rule", [
    (lambda t: t.reshape_dim(0, (2, 2)), "err_leading_dimension_of_tensor_must_be_partition"),
    (lambda t: t.permute((1, 0)).flatten_dims(0, 1), "err_leading_dimension_of_tensor_must_be_partition"),
    (lambda t: t.reshape_dim(1, (4, 3)), "err_reshape_size"),
    (lambda t: t.slice(1, 3, 2), "err_tensor_access_out_of_bound"),
    (lambda t: t.vector_select(0, t[:, 0:1]), "err_vector_select"),
])
def test_named_view_limits(bad, rule):
    def kernel():
        bad(nl.zeros((4, 8), F32))

    with pytest.raises(NkiValidationError) as info:
        nki.run_kernel(kernel, [])
    assert info.value.rule == rule


@dataclass(frozen=True)
class _FrozenTiling(nl.NKIObject):
    rows: int
    cols: int = 512


@dataclass
class _LooseConfig(nl.NKIObject):
    needed: int
    section = None  # no annotation: not a dataclass field, still set by keyword


def test_nki_object_constructs_frozen_and_partial_dataclasses_by_keyword():
    frozen = _FrozenTiling(rows=128)
    assert (frozen.rows, frozen.cols) == (128, 512)
    loose = _LooseConfig(section=3)
    assert loose.section == 3 and loose.needed is None


def test_language_wrappers_rms_norm_gather_and_no_reorder():
    x = np.random.default_rng(3).uniform(-2, 2, (16, 64)).astype(F32)
    w = np.random.default_rng(4).uniform(0.5, 1.5, (16, 64)).astype(F32)
    where = np.random.default_rng(5).integers(0, 64, (16, 10)).astype(np.int32)

    def kernel(a, b, i):
        with nl.no_reorder():
            normed = nl.rms_norm(load_tile(a), load_tile(b), axis=1, n=64, epsilon=1e-6)
            gathered = nl.gather_flattened(load_tile(a), load_tile(i))
        return store_tile(normed), store_tile(gathered)

    normed, gathered = nki.run_kernel(kernel, [x, w, where]).outputs
    want = x / np.sqrt((x * x).mean(axis=1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(normed, want, rtol=2e-6, atol=1e-6)
    np.testing.assert_array_equal(gathered, np.take_along_axis(x, where, 1))


@pytest.mark.parametrize("target", ["trn2", "trn3"])
def test_rand_and_dropout_draw_after_random_seed(target):
    def kernel():
        seed = nl.full((1, 1), 42, dtype=nl.int32)
        nl.random_seed(seed)
        first = nl.rand((128, 256), nl.float32)
        nl.random_seed(seed)
        again = nl.rand((128, 256), nl.float32)
        kept = nl.dropout(nl.ones((128, 256), nl.float32), 0.25)
        return store_tile(first), store_tile(again), store_tile(kept)

    first, again, kept = nki.run_kernel(kernel, [], target=target).outputs
    np.testing.assert_array_equal(first, again)  # the same seed draws the same values
    assert 0.0 <= first.min() and first.max() < 1.0 and abs(first.mean() - 0.5) < 0.01
    assert set(np.unique(kept)) <= {0.0, 1.0} and abs((kept == 0).mean() - 0.25) < 0.01


def test_ap_with_a_narrower_dtype_counts_its_pattern_in_that_dtype():
    def kernel(x):
        scales = load_tile(x)  # (4, 1) float32: 4 bytes per partition
        out = nl.ndarray((4, 4), nl.uint8, buffer=nl.shared_hbm)
        nisa.dma_copy(out, scales.ap([[4, 4], [1, 4]], dtype=nl.uint8))
        return out

    x = np.array([[1.5], [-2.0], [3.25], [1e-3]], dtype=F32)
    np.testing.assert_array_equal(nki.run_kernel(kernel, [x]).outputs[0], x.view(np.uint8).reshape(4, 4))

"""Every hardware / language rule the simulator enforces: a kernel that breaks it raises the named error."""

from __future__ import annotations

import numpy as np
import pytest

from neuron_compile.runtime import simulator as nki
from neuron_compile.runtime.simulator.errors import NkiCapacityError, NkiNotSimulatedError, NkiValidationError

nl = nki.language
nisa = nki.isa


def sbuf(shape, dtype=nl.float32, value=1.0):
    tile = nl.ndarray(shape, dtype)
    nisa.memset(tile, value if np.dtype(dtype).kind == "f" or dtype == nl.bfloat16 else int(value))
    return tile


def psum(shape, dtype=nl.float32):
    return nl.ndarray(shape, dtype, buffer=nl.psum)


def hbm(shape, dtype=nl.float32):
    return nl.ndarray(shape, dtype, buffer=nl.shared_hbm)


# rule id -> (kernel body breaking exactly that rule, a value the message must name)
CASES = {
    "err_num_partition_exceed_arch_limit": (lambda: nl.ndarray((129, 4), nl.float32), "129"),
    "err_num_partition_mismatch": (lambda: nisa.nc_matmul(psum((4, 8)), sbuf((16, 4)), sbuf((32, 8))), "16"),
    "err_matmul_stationary_fmax": (lambda: nisa.nc_matmul(psum((128, 8)), sbuf((8, 129)), sbuf((8, 8))), "129"),
    "err_matmul_moving_fmax": (lambda: nisa.nc_matmul(psum((8, 513)), sbuf((8, 8)), sbuf((8, 513))), "513"),
    "err_matmul_dst_not_psum": (lambda: nisa.nc_matmul(sbuf((8, 8)), sbuf((8, 8)), sbuf((8, 8))), "sbuf"),
    "err_matmul_input_not_sbuf": (lambda: nisa.nc_matmul(psum((8, 8)), psum((8, 8)), sbuf((8, 8))), "psum"),
    "err_matmul_fp32_mixed": (
        lambda: nisa.nc_matmul(psum((8, 8)), sbuf((8, 8)), sbuf((8, 8), nl.bfloat16)), "bfloat16"),
    "err_matmul_input_dtype": (
        lambda: nisa.nc_matmul(psum((8, 8)), sbuf((8, 8), nl.int8), sbuf((8, 8), nl.int8)), "int8"),
    "err_matmul_dst_dtype": (
        lambda: nisa.nc_matmul(psum((8, 8), nl.bfloat16), sbuf((8, 8), nl.bfloat16), sbuf((8, 8), nl.bfloat16)),
        "bfloat16"),
    "err_matmul_shape": (lambda: nisa.nc_matmul(psum((8, 16)), sbuf((8, 8)), sbuf((8, 8))), "(8, 16)"),
    "err_psum_tile_exceeds_bank": (
        lambda: nisa.nc_matmul(psum((8, 1024))[:, 256:768], sbuf((8, 8)), sbuf((8, 512))), "bank"),
    "err_matmul_tile_position": (
        lambda: nisa.nc_matmul(psum((8, 8)), sbuf((8, 8)), sbuf((8, 8)), tile_position=(32, 0), tile_size=(64, 64)),
        "32"),
    "err_matmul_accumulate_uninitialized": (
        lambda: nisa.nc_matmul(psum((8, 8)), sbuf((8, 8)), sbuf((8, 8)), accumulate=True), "64 of 64"),
    "err_tensor_scalar_scalar_engine_ops": (
        lambda: nisa.tensor_scalar(sbuf((4, 4)), sbuf((4, 4)), nl.subtract, 1.0, engine=nisa.engine.scalar),
        "subtract"),
    "err_free_size_exceed_arch_limit": (
        lambda: nisa.tensor_copy(nl.ndarray((2, 70000), nl.int8), sbuf((2, 70000), nl.int8, 1)), "70000"),
    "err_tensor_engine_reads_sbuf": (lambda: nisa.nc_transpose(psum((8, 4)), psum((4, 8)), engine=nisa.engine.tensor),
                                     "psum"),
    "err_gpsimd_psum_access": (lambda: nisa.tensor_copy(sbuf((4, 4)), psum((4, 4)), engine=nisa.engine.gpsimd),
                               "PSUM"),
    "err_dma_from_psum": (lambda: nisa.dma_copy(hbm((4, 4)), psum((4, 4))), "PSUM"),
    "err_dma_to_psum": (lambda: nisa.dma_copy(psum((4, 4)), sbuf((4, 4))), "PSUM"),
    "err_reduce_axis": (lambda: nisa.tensor_reduce(sbuf((4, 3)), nl.add, sbuf((4, 3, 5)), axis=1), "(4, 3, 5)"),
    "err_reduce_dst_shape": (lambda: nisa.tensor_reduce(sbuf((4, 2)), nl.add, sbuf((4, 3, 5)), axis=2), "3"),
    "err_start_partition": (lambda: nisa.activation(sbuf((8, 4)), nl.exp, sbuf((128, 4))[48:56]), "48"),
    "err_tensor_scalar_operand_dtype": (
        lambda: nisa.tensor_scalar(sbuf((4, 4)), sbuf((4, 4)), nl.add, sbuf((4, 1), nl.bfloat16)), "bfloat16"),
    "err_tensor_scalar_operand_shape": (
        lambda: nisa.tensor_scalar(sbuf((4, 4)), sbuf((4, 4)), nl.add, sbuf((4, 2))), "(4, 2)"),
    "err_tensor_scalar_op_kind": (
        lambda: nisa.tensor_scalar(sbuf((4, 4), nl.int32), sbuf((4, 4), nl.int32), nl.bitwise_and, 1,
                                   op1=nl.add, operand1=1), "bitwise_and"),
    "err_memset_value_dtype": (lambda: nisa.memset(nl.ndarray((4, 4), nl.int32), 1.5), "1.5"),
    "err_num_elements_mismatch": (lambda: nisa.tensor_tensor(sbuf((4, 4)), sbuf((4, 4)), sbuf((4, 5)), nl.add), "5"),
    "err_dma_shape_mismatch": (lambda: nisa.dma_copy(hbm((4, 4)), sbuf((4, 5))), "20"),
    "err_tensor_access_out_of_bound": (lambda: sbuf((4, 4))[:, 2:6], "6"),
    "err_unsupported_advanced_indexing": (lambda: sbuf((8, 4))[:, [0, 2]], "[0, 2]"),
    "err_partition_range_not_contiguous": (lambda: sbuf((8, 4))[::2], "step 2"),
    "err_size_of_dimension_exceed_arch_limit": (
        lambda: nisa.nc_transpose(sbuf((64, 64)), sbuf((64, 64)), engine=nisa.engine.vector), "32"),
    "err_transpose_dtype": (lambda: nisa.nc_transpose(psum((8, 4), nl.float32), sbuf((4, 8), nl.bfloat16)),
                            "bfloat16"),
    "err_tensor_tensor_both_psum": (lambda: nisa.tensor_tensor(sbuf((4, 4)), psum((4, 4)), psum((4, 4)), nl.add),
                                    "PSUM"),
    "err_bitvec_op_dtype": (lambda: nisa.tensor_tensor(sbuf((4, 4)), sbuf((4, 4)), sbuf((4, 4)), nl.bitwise_or),
                            "float32"),
    "err_activation_bias_invalid_type": (
        lambda: nisa.activation(sbuf((4, 4)), nl.exp, sbuf((4, 4)), bias=sbuf((4, 2))), "(4, 2)"),
    "err_activation_scale_scalar_or_vector": (
        lambda: nisa.activation(sbuf((4, 4)), nl.exp, sbuf((4, 4)), scale=sbuf((2, 1))), "(2, 1)"),
    "err_activation_reduce_op": (
        lambda: nisa.activation(sbuf((4, 4)), nl.exp, sbuf((4, 4)), reduce_op=nl.multiply, reduce_res=sbuf((4, 1))),
        "multiply"),
    "err_bn_stats_fmax": (lambda: nisa.bn_stats(sbuf((4, 6)), sbuf((4, 513))), "513"),
    "err_leading_dimension_of_tensor_must_be_partition": (lambda: sbuf((4, 8, 2)).permute((1, 0, 2)), "(1, 0, 2)"),
    "err_ap_partition_step": (lambda: sbuf((4, 8)).ap([[4, 4], [1, 4]]), "8"),
    "err_dma_hwdge_dtype": (
        lambda: nisa.dma_copy(hbm((4, 4), nl.bfloat16), sbuf((4, 4)), dge_mode=nisa.dge_mode.hwdge), "bfloat16"),
    "err_dma_transpose_shape": (lambda: nisa.dma_transpose(sbuf((4, 8)), hbm((4, 8))), "(8, 4)"),
    "err_unsupported_memory": (lambda: nisa.tensor_tensor(sbuf((4, 4)), hbm((4, 4)), sbuf((4, 4)), nl.add),
                               "shared_hbm"),
}


def test_dma_transpose_is_trn2_and_later():
    def kernel(x):
        tile = nl.ndarray((8, 4), nl.float32, buffer=nl.sbuf)
        nisa.dma_transpose(tile, x)

    x = np.arange(32, dtype=np.float32).reshape(4, 8)
    with pytest.raises(NkiValidationError) as info:
        nki.run_kernel(kernel, [x], target="trn1")
    assert info.value.rule == "err_dma_transpose_unsupported" and "trn1" in str(info.value)
    for target in ("trn2", "trn3"):
        nki.run_kernel(kernel, [x], target=target)


@pytest.mark.parametrize("rule", sorted(CASES))
def test_breaking_a_rule_raises_it_by_name(rule):
    body, value = CASES[rule]

    def kernel():
        body()

    with pytest.raises(NkiValidationError) as info:
        nki.run_kernel(kernel, [])
    assert info.value.rule == rule, str(info.value)
    assert rule in str(info.value) and value in str(info.value)


def test_reusing_a_read_psum_tile_starts_a_new_accumulation_group():
    def reuse(accumulate_first):
        def kernel():
            a, b = sbuf((8, 8)), sbuf((8, 8))
            acc = psum((8, 8))
            out = sbuf((8, 8))
            for _ in range(2):  # two output tiles through one PSUM tile allocated outside the loop
                nisa.nc_matmul(acc, a, b, accumulate=accumulate_first)
                nisa.nc_matmul(acc, a, b)
                nisa.tensor_copy(out, acc)
            return _store(out)

        return kernel

    # the tensor_copy read the first tile's result, so the next auto-accumulating matmul overwrites it
    np.testing.assert_array_equal(nki.run_kernel(reuse(None), []).outputs[0], np.full((8, 8), 16.0))
    np.testing.assert_array_equal(nki.run_kernel(reuse(False), []).outputs[0], np.full((8, 8), 16.0))


def _store(tile):
    out = hbm(tile.shape, tile.dtype)
    nisa.dma_copy(out, tile)
    return out


def test_indirect_offsets_out_of_bounds_raise_unless_skipped():
    table = np.zeros((10, 4), np.float32)
    index = np.array([[2], [10]], np.int32)

    def kernel(t, idx):
        offsets = nl.ndarray((2, 1), nl.int32)
        nisa.dma_copy(offsets, idx)
        rows = nl.ndarray((2, 4), nl.float32)
        nisa.dma_copy(rows, t.ap([[4, 2], [1, 4]], vector_offset=offsets, indirect_dim=0))

    with pytest.raises(NkiValidationError, match="err_tensor_access_out_of_bound"):
        nki.run_kernel(kernel, [table, index])


def test_sbuf_capacity_names_buffer_requested_and_available():
    def kernel():
        keep = nl.ndarray((128, 50000), nl.float32, name="big")  # 200000 of 212984 bytes per partition
        nl.ndarray((128, 4000), nl.float32, name="extra")
        del keep

    with pytest.raises(NkiCapacityError) as info:
        nki.run_kernel(kernel, [], target="trn2")
    message = str(info.value)
    assert info.value.rule == "sbuf_capacity" and "extra" in message and "16000" in message and "12984" in message


def test_psum_capacity_counts_whole_banks():
    def kernel():
        banks = [nl.ndarray((128, 1), nl.float32, buffer=nl.psum) for _ in range(8)]  # one bank each
        nl.ndarray((128, 1), nl.float32, buffer=nl.psum, name="ninth")
        del banks

    with pytest.raises(NkiCapacityError) as info:
        nki.run_kernel(kernel, [])
    assert info.value.rule == "psum_capacity" and "ninth" in str(info.value) and "0 of 8" in str(info.value)


def test_freed_buffers_return_capacity_so_loops_can_allocate():
    def kernel():
        for _ in range(20):
            nl.ndarray((128, 40000), nl.float32)  # 160 KB per partition, dropped at the end of the iteration
            nl.ndarray((128, 512), nl.float32, buffer=nl.psum)

    nki.run_kernel(kernel, [])


def test_kernel_run_reports_peak_on_chip_usage():
    def kernel():
        a = nl.ndarray((128, 1000), nl.float32)  # 4000 bytes per partition
        b = nl.ndarray((64, 10), nl.bfloat16)  # 20
        p = nl.ndarray((128, 600), nl.float32, buffer=nl.psum)  # 2400 bytes: two banks
        del a, b, p
        nl.ndarray((128, 10), nl.float32)

    run = nki.run_kernel(kernel, [])
    assert run.sbuf_peak_bytes == 4020 and run.psum_peak_banks == 2


def test_output_must_be_shared_hbm():
    def kernel():
        out = nl.ndarray((2, 2), nl.float32, buffer=nl.hbm)
        return out

    with pytest.raises(NkiValidationError, match="err_output_must_be_shared_hbm"):
        nki.run_kernel(kernel, [])


def test_outputs_must_be_written():
    def kernel():
        return nl.ndarray((2, 2), nl.float32, buffer=nl.shared_hbm, name="forgotten")

    with pytest.raises(NkiValidationError, match="err_tensor_output_not_written_to.*forgotten"):
        nki.run_kernel(kernel, [])


def test_64_bit_inputs_are_rejected():
    with pytest.raises(NkiValidationError, match="err_unsupported_dtype.*float64"):
        nki.run_kernel(lambda x: None, [np.zeros((2, 2))])


def test_lnc_must_be_one_or_two():
    kernel = nki.jit(lambda: None)
    with pytest.raises(NkiValidationError, match="err_lnc"):
        kernel[3]()


@pytest.mark.parametrize("name", ["nisa.quantize_mx", "nisa.topk", "nisa.nc_matmul_mx", "nl.fmod"])
def test_unsimulated_nki_names_raise_not_simulated(name):
    module = nisa if name.startswith("nisa") else nl
    function = getattr(module, name.split(".")[1])
    with pytest.raises(NkiNotSimulatedError) as info:
        function()
    assert info.value.rule == "not_simulated" and name.split(".")[1] in str(info.value)


def test_unknown_names_are_attribute_errors():
    with pytest.raises(AttributeError):
        nisa.not_an_instruction  # noqa: B018


@pytest.mark.parametrize("function, inside, outside", [
    ("log", [2.0**-64, 1.0, 2.0**64, np.nan], [0.0, -1.0, 2.0**-65, 2.0**65, np.inf]),
    ("sqrt", [2.0**-116, 4.0, 2.0**118], [0.0, -4.0, 2.0**-117, np.inf]),
    ("rsqrt", [2.0**-87, 4.0, 2.0**97], [0.0, 2.0**98, -1.0]),
    ("reciprocal", [2.0**-42, -3.0, -(2.0**42)], [0.0, -0.0, 2.0**43, -(2.0**-43), np.inf]),
    ("arctan", [-1.5, 0.0, 1.5], [1.6, -np.inf]),
])
def test_activations_refuse_inputs_outside_their_valid_range(function, inside, outside):
    def run(values):
        def kernel(a):
            tile, out = nl.ndarray(a.shape, nl.float32), nl.ndarray(a.shape, nl.float32)
            nisa.dma_copy(tile, a)
            nisa.activation(out, getattr(nl, function), tile)
            result = hbm(a.shape)
            nisa.dma_copy(result, out)
            return result

        return nki.run_kernel(kernel, [np.array([values], dtype=np.float32)]).outputs[0]

    run(inside)  # nan propagates: no refusal
    for value in outside:
        with pytest.raises(NkiValidationError, match=rf"err_activation_input_out_of_range.*{function} is valid"):
            run([1.0, value])

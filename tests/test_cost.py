"""Cost model: formulas on hand-built traces (checked against the nki-spec.md §2 figures computed here from
the target's constants), report arithmetic, and the estimates of real simulated kernels."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neuron_compile.hardware import TRN1, TRN2
from neuron_compile.runtime.simulator import cost
from neuron_compile.runtime.simulator.schedule import DEPENDENCY_LATENCY_CYCLES
from neuron_compile.runtime.simulator.trace import InstructionRecord, OperandInfo

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "int32": 4, "float8_e4m3": 1}


def tile(role, shape, dtype="float32", buffer="sbuf", stride_elems=1):
    """An on-chip tile (partitions first) or an HBM operand of ``shape``."""
    itemsize = ITEMSIZE[dtype]
    return OperandInfo(
        role=role, buffer=buffer, shape=tuple(shape), dtype=dtype, itemsize=itemsize, partitions=shape[0],
        free_elems=math.prod(shape[1:]), innermost_stride_bytes=stride_elems * itemsize,
    )


def matmul(k=128, m=128, n=512, dtype="bfloat16"):
    return InstructionRecord(
        "nc_matmul", "tensor", tile("dst", (m, n), buffer="psum"),
        (tile("stationary", (k, m), dtype), tile("moving", (k, n), dtype)), flops=2 * m * n * k,
    )


def vector(name, shape=(128, 512), dtype="float32", buffer="sbuf", engine="vector", srcs=1, **attrs):
    inputs = tuple(tile(f"src{i}", shape, dtype, buffer) for i in range(srcs))
    return InstructionRecord(name, engine, tile("dst", shape, dtype), inputs, attrs=attrs)


def dma(shape=(128, 2048), dtype="bfloat16", load=True, hbm_stride_elems=1, name="dma_copy", on_chip="sbuf"):
    hbm = tile("src" if load else "dst", shape, dtype, "hbm", hbm_stride_elems)
    sbuf = tile("dst" if load else "src", shape, dtype, on_chip)
    return InstructionRecord(name, "dma", sbuf if load else hbm, (hbm if load else sbuf,))


# --- per-instruction formulas ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("k", "m", "n", "dtype", "expected"),
    [
        (128, 128, 512, "bfloat16", 512),  # max(min(64, 128), 512)
        (128, 128, 32, "bfloat16", 64),  # tiny moving tile: bounded by min(64, N_stationary)
        (128, 16, 8, "bfloat16", 16),
        (128, 128, 512, "float32", 2048),  # x4 for fp32
        (64, 128, 256, "float8_e4m3", 256),
    ],
)
def test_matmul_cycles(k, m, n, dtype, expected):
    assert cost.instruction_cycles(matmul(k, m, n, dtype), TRN2) == ("tensor", expected)


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        (vector("activation", (128, 1000), engine="scalar"), 1000),
        (vector("activation", (128, 10), engine="scalar"), cost.MIN_II),
        (vector("activation", (128, 1000), engine="scalar", reduce=True), 1000 + cost.MIN_II),
        (vector("tensor_scalar", (128, 700)), 700),
        (vector("tensor_tensor", (128, 700), srcs=2, op="add"), 1400),
        (vector("tensor_tensor", (128, 20), srcs=2, op="add"), cost.MIN_II),
        (vector("tensor_reduce", (128, 700), op="add"), 700),
        (vector("tensor_copy", (128, 300)), 300),
        (vector("memset", (128, 300), srcs=0, value=1.0), 300),
        (vector("reciprocal", (128, 100)), 800),
        (vector("bn_stats", (128, 512)), 512),
        (vector("bn_aggr", (128, 300)), 1300),
        (vector("iota", (128, 100), dtype="int32", engine="gpsimd", srcs=0), 250),
        (vector("affine_select", (128, 100), engine="gpsimd"), 250),
        (vector("tensor_tensor_scan", (128, 300), srcs=2), 600),
        (vector("scalar_tensor_tensor", (128, 300), srcs=2, op0="add", op1="multiply"), 600),
        (vector("tensor_copy_dynamic_src", (128, 100)), 600),
    ],
    ids=lambda value: value.name if isinstance(value, InstructionRecord) else None,
)
def test_streaming_formulas_fp32(record, expected):
    assert cost.instruction_cycles(record, TRN2) == (record.engine, expected)


def test_tensor_tensor_with_one_psum_input_streams_once():
    psum_input = InstructionRecord(
        "tensor_tensor", "vector", tile("dst", (128, 512)),
        (tile("a", (128, 512), buffer="psum"), tile("b", (128, 512))), attrs={"op": "add"},
    )
    assert cost.instruction_cycles(psum_input, TRN2)[1] == 512


def test_bf16_fast_paths_on_trn1_have_no_performance_mode():
    # trn1 VectorE has one data path width for every dtype, so only the SDK's bf16 special cases apply.
    assert cost.instruction_cycles(vector("tensor_tensor", dtype="bfloat16", srcs=2, op="add"), TRN1)[1] == 512
    assert cost.instruction_cycles(vector("tensor_tensor", dtype="bfloat16", srcs=2, op="maximum"), TRN1)[1] == 1024
    assert cost.instruction_cycles(vector("tensor_reduce", dtype="bfloat16", op="add"), TRN1)[1] == 256
    assert cost.instruction_cycles(vector("memset", dtype="bfloat16", srcs=0, value=0), TRN1)[1] == 256
    stt = vector("scalar_tensor_tensor", dtype="bfloat16", srcs=2, op0="subtract", op1="multiply")
    assert cost.instruction_cycles(stt, TRN1)[1] == 512
    # a (P, 1) operand0 is fp32 by rule; the fast path depends on the two tensors only
    with_vector_operand = InstructionRecord(
        "scalar_tensor_tensor", "vector", tile("dst", (128, 512), "bfloat16"),
        (tile("data", (128, 512), "bfloat16"), tile("operand0", (128, 1)), tile("operand1", (128, 512), "bfloat16")),
        attrs={"op0": "subtract", "op1": "multiply"},
    )
    assert cost.instruction_cycles(with_vector_operand, TRN1)[1] == 512


def test_trn2_vector_performance_mode_speeds_bf16_sbuf_copies_only():
    ratio = TRN2.vector_elems_per_cycle_bf16 / TRN2.vector_elems_per_cycle_other
    assert ratio > 1
    assert cost.instruction_cycles(vector("tensor_copy", (128, 2048), "bfloat16"), TRN2)[1] == 2048 / ratio
    assert cost.instruction_cycles(vector("tensor_copy", (128, 2048), "float32"), TRN2)[1] == 2048
    psum = vector("tensor_copy", (128, 2048), "bfloat16", buffer="psum")
    assert cost.instruction_cycles(psum, TRN2)[1] == 2048


def test_strided_on_chip_operand_halves_streaming_bandwidth():
    contiguous = vector("activation", (128, 1024), engine="scalar")
    strided = InstructionRecord(
        "activation", "scalar", tile("dst", (128, 1024)), (tile("data", (128, 1024), stride_elems=8),)
    )
    assert cost.instruction_cycles(strided, TRN2)[1] == 2 * cost.instruction_cycles(contiguous, TRN2)[1]


def test_transposes():
    on_tensor = InstructionRecord("nc_transpose", "tensor", tile("dst", (100, 128), buffer="psum"),
                                  (tile("data", (128, 100)),))
    assert cost.instruction_cycles(on_tensor, TRN2) == ("tensor", max(128, min(64, 100)))
    on_vector = InstructionRecord("nc_transpose", "vector", tile("dst", (32, 32)), (tile("data", (32, 32)),))
    assert cost.instruction_cycles(on_vector, TRN2) == ("vector", cost.MIN_II)


def test_unknown_instruction_is_costed_and_named():
    report = cost.cost_report([vector("max8", (128, 1000))], TRN2)
    assert report.unmodeled == ("max8",)
    assert report.cycles_per_engine["vector"] == 1000
    assert "max8" in report.format()


def test_unknown_engine_names_the_rule():
    with pytest.raises(ValueError, match=r"cost_unknown_engine.*'warp'"):
        cost.instruction_cycles(vector("tensor_copy", engine="warp"), TRN2)


# --- DMA --------------------------------------------------------------------------------------------------


def test_dma_large_transfer_is_bandwidth_bound():
    record = dma((128, 8192), "float32")  # 32 KiB per partition
    nbytes = 128 * 8192 * 4
    time = cost.dma_transfer_time(record, TRN2)
    data_ns = nbytes / (TRN2.dma_bytes_per_s / 1e9)
    assert time.engines_used == TRN2.dma_engines
    assert time.latency_ns == pytest.approx(TRN2.dma_fixed_overhead_ns + data_ns)
    efficiency = data_ns / (time.pool_ns)
    assert efficiency > 0.95


@pytest.mark.parametrize(("bytes_per_partition", "low", "high"), [(64, 0.0, 0.2), (256, 0.2, 0.5),
                                                                  (2048, 0.7, 0.9), (4096, 0.85, 1.0)])
def test_dma_efficiency_follows_the_bandwidth_guide(bytes_per_partition, low, high):
    # The guide: < 256 B/partition overhead-bound, >= 2 KiB recommended, >= 4 KiB saturates.
    record = dma((128, bytes_per_partition // 2), "bfloat16")
    ideal_ns = 128 * bytes_per_partition / (TRN2.dma_bytes_per_s / 1e9)
    efficiency = ideal_ns / cost.dma_transfer_time(record, TRN2).pool_ns
    assert low <= efficiency <= high


def test_dma_few_partitions_use_few_engines():
    one_partition = cost.dma_transfer_time(dma((1, 65536), "bfloat16"), TRN2)
    all_partitions = cost.dma_transfer_time(dma((128, 512), "bfloat16"), TRN2)  # same bytes
    assert (one_partition.engines_used, all_partitions.engines_used) == (1, TRN2.dma_engines)
    overhead = TRN2.dma_fixed_overhead_ns
    # one engine moves all the bytes: 16x the data time of a transfer spread over every engine
    assert one_partition.latency_ns - overhead == pytest.approx(16 * (all_partitions.latency_ns - overhead))


def test_dma_strided_innermost_costs_more():
    contiguous = cost.dma_transfer_time(dma((128, 512), "bfloat16"), TRN2)
    strided = cost.dma_transfer_time(dma((128, 512), "bfloat16", hbm_stride_elems=2048), TRN2)
    data = contiguous.latency_ns - TRN2.dma_fixed_overhead_ns
    assert strided.latency_ns - TRN2.dma_fixed_overhead_ns == pytest.approx(data * cost.DMA_BURST_BYTES / 2)


def test_dma_transpose_runs_below_dma_throughput():
    plain = cost.dma_transfer_time(dma((128, 4096)), TRN2)
    transposed = cost.dma_transfer_time(dma((128, 4096), name="dma_transpose"), TRN2)
    overhead = TRN2.dma_fixed_overhead_ns
    assert (transposed.latency_ns - overhead) == pytest.approx((plain.latency_ns - overhead) / 0.9)


def dma_compute(dst, *srcs):
    """A dma_compute record: ``dst`` and ``srcs`` are (buffer, dtype) over (128, 2048) elements."""
    operands = [tile(f"src{i}", (128, 2048), dtype, buffer) for i, (buffer, dtype) in enumerate(srcs)]
    return InstructionRecord("dma_compute", "dma", tile("dst", (128, 2048), dst[1], dst[0]), tuple(operands))


def data_ns(record):
    return cost.dma_transfer_time(record, TRN2).latency_ns - TRN2.dma_fixed_overhead_ns


def test_dma_compute_streams_every_source():
    # SDK: dst = reduce_op(srcs[0] * scales[0], srcs[1] * scales[1], ...): each source is read, the sum written.
    fp32_and_bf16_to_hbm = dma_compute(("hbm", "bfloat16"), ("sbuf", "float32"), ("sbuf", "bfloat16"))
    fp32_store, bf16_store = dma((128, 2048), "float32", load=False), dma((128, 2048), "bfloat16", load=False)
    assert data_ns(fp32_and_bf16_to_hbm) == pytest.approx(data_ns(fp32_store) + data_ns(bf16_store))
    # one source is a copy; a wider destination than its sources is the side that bounds it
    assert data_ns(dma_compute(("hbm", "bfloat16"), ("sbuf", "bfloat16"))) == pytest.approx(data_ns(bf16_store))
    widening = dma_compute(("sbuf", "float32"), ("sbuf", "bfloat16"))
    assert data_ns(widening) == pytest.approx(data_ns(fp32_store))


def test_dma_hbm_to_hbm_charges_the_read_and_the_write():
    bf16_store = dma((128, 2048), "bfloat16", load=False)
    assert data_ns(dma_compute(("hbm", "bfloat16"), ("hbm", "bfloat16"))) == pytest.approx(2 * data_ns(bf16_store))
    two_sources = dma_compute(("hbm", "bfloat16"), ("hbm", "bfloat16"), ("hbm", "float32"))
    assert data_ns(two_sources) == pytest.approx(4 * data_ns(bf16_store))  # 2 + 4 bytes read, 2 written


def test_many_small_dmas_are_overhead_bound_and_overlap():
    small = [dma((128, 32), "bfloat16") for _ in range(1000)]  # 64 B per partition
    report = cost.cost_report(small, TRN2)
    ideal = report.hbm_bytes_read / TRN2.dma_bytes_per_s
    assert report.busy_s_per_engine["dma"] > 5 * ideal
    # queues overlap the fixed cost: far less than 1000 serial fixed overheads
    assert report.busy_s_per_engine["dma"] < 1000 * TRN2.dma_fixed_overhead_ns * 1e-9 / 4
    assert report.roofline_memory_s == pytest.approx(ideal)


def test_single_dma_lasts_at_least_its_latency():
    report = cost.cost_report([dma((128, 64))], TRN2)
    latency_s = cost.dma_transfer_time(dma((128, 64)), TRN2).latency_ns * 1e-9
    assert report.device_time_s == pytest.approx(latency_s)
    assert report.est_time_s == pytest.approx(cost.KERNEL_LAUNCH_S + latency_s)


def test_hbm_bytes_by_direction():
    trace = [dma((128, 1024), "float32"), dma((128, 1024), "float32"), dma((64, 256), "bfloat16", load=False)]
    report = cost.cost_report(trace, TRN2)
    assert (report.hbm_bytes_read, report.hbm_bytes_written) == (2 * 128 * 1024 * 4, 64 * 256 * 2)
    assert report.hbm_bytes == report.hbm_bytes_read + report.hbm_bytes_written


# --- whole reports ----------------------------------------------------------------------------------------


def test_report_totals_and_overlap():
    trace = [matmul() for _ in range(8)] + [vector("tensor_copy", (128, 512))] + [dma((128, 2048))] * 4
    report = cost.cost_report(trace, TRN2)
    assert report.instructions_per_engine == {"tensor": 8, "vector": 1, "dma": 4}
    assert report.cycles_per_engine["tensor"] == 8 * 512
    assert report.busy_s_per_engine["tensor"] == pytest.approx(8 * 512 / (TRN2.tensor_ghz * 1e9))
    assert report.busy_s_per_engine["vector"] == pytest.approx(512 / (TRN2.vector_ghz * 1e9))
    # hand-built records name no memory, so nothing depends on anything: the queues only overlap
    assert report.est_lower_bound_s == pytest.approx(cost.KERNEL_LAUNCH_S + max(report.busy_s_per_engine.values()))
    transfer = cost.dma_transfer_time(dma((128, 2048)), TRN2)
    per_engine_ns = transfer.pool_ns * TRN2.dma_engines / transfer.engines_used
    # four 128-partition transfers on all 16 DMA engines: three occupancies, then the last one's latency
    assert report.device_time_s == pytest.approx((3 * per_engine_ns + transfer.latency_ns) * 1e-9)
    assert report.est_time_s == pytest.approx(cost.KERNEL_LAUNCH_S + report.device_time_s)
    assert report.est_lower_bound_s <= report.est_time_s <= report.serial_time_s
    serial_ns = 4 * transfer.latency_ns + sum(
        (cycles + DEPENDENCY_LATENCY_CYCLES * count) / getattr(TRN2, f"{engine}_ghz")
        for engine, cycles, count in (("tensor", 8 * 512, 8), ("vector", 512, 1))
    )
    assert report.serial_time_s == pytest.approx(cost.KERNEL_LAUNCH_S + serial_ns * 1e-9)
    assert report.flops == 8 * 2 * 128 * 128 * 512
    assert report.utilization == pytest.approx(report.roofline_s / report.device_time_s)
    assert sum(report.time_per_instruction.values()) == pytest.approx(
        sum(report.cycles_per_engine[e] / (getattr(TRN2, f"{e}_ghz") * 1e9) for e in ("tensor", "vector"))
        + report.cycles_per_engine["dma"] * 1e-9
    )


def test_matmul_stream_reaches_tensor_peak():
    report = cost.cost_report([matmul() for _ in range(64)], TRN2)
    achieved = report.flops / report.device_time_s
    # 128x128 PEs x 2 flops x 2.4 GHz = 78.6 TFLOP/s against the documented 79
    assert achieved == pytest.approx(128 * 128 * 2 * TRN2.tensor_ghz * 1e9)
    assert report.utilization > 0.99
    assert "compute-bound" in report.format()


def test_fp32_matmul_roofline_uses_fp32_peak():
    report = cost.cost_report([matmul(dtype="float32")], TRN2)
    assert report.roofline_compute_s == pytest.approx(2 * 128 * 128 * 512 / (TRN2.tensor_fp32_tflops * 1e12))


@settings(max_examples=25, deadline=None)
@given(
    k=st.integers(1, 128), m=st.integers(1, 128), n=st.integers(1, 512), extra=st.integers(1, 512),
    dtype=st.sampled_from(["bfloat16", "float32"]),
)
def test_bigger_matmul_never_costs_less(k, m, n, extra, dtype):
    smaller = cost.cost_report([matmul(k, m, n, dtype)], TRN2)
    bigger = cost.cost_report([matmul(k, m, min(512, n + extra), dtype)], TRN2)
    assert bigger.est_time_s >= smaller.est_time_s
    assert smaller.est_time_s <= smaller.serial_time_s
    assert smaller.est_time_s >= smaller.roofline_s * 0.99  # the model never beats its own roofline


def test_hbm_to_hbm_copy_crosses_hbm_twice():
    shape = (128, 2048)
    hbm_to_hbm = InstructionRecord(
        "dma_copy", "dma", tile("dst", shape, buffer="hbm"), (tile("src", shape, buffer="hbm"),)
    )
    load = cost.dma_transfer_time(dma(shape, "float32"), TRN2)
    copy = cost.dma_transfer_time(hbm_to_hbm, TRN2)
    overhead = TRN2.dma_fixed_overhead_ns
    assert copy.latency_ns - overhead == pytest.approx(2 * (load.latency_ns - overhead))
    report = cost.cost_report([hbm_to_hbm], TRN2)
    assert report.hbm_bytes_read == report.hbm_bytes_written == 128 * 2048 * 4


def random_record(draw_kind, shape, dtype, buffer):
    kinds = {
        "matmul": lambda: matmul(shape[0], min(shape[0], 128), min(shape[1], 512), dtype),
        "load": lambda: dma(shape, dtype),
        "store": lambda: dma(shape, dtype, load=False),
        "hbm_copy": lambda: InstructionRecord(
            "dma_copy", "dma", tile("dst", shape, dtype, "hbm"), (tile("src", shape, dtype, "hbm"),)
        ),
        "tensor_tensor": lambda: vector("tensor_tensor", shape, dtype, buffer, srcs=2, op="add"),
        "activation": lambda: vector("activation", shape, dtype, buffer, engine="scalar"),
        "iota": lambda: vector("iota", shape, "int32", engine="gpsimd", srcs=0),
    }
    record = kinds[draw_kind]()
    if record.name in ("tensor_tensor", "activation"):  # elementwise FLOPs, one per element
        record = InstructionRecord(record.name, record.engine, record.dst, record.srcs, record.attrs,
                                   flops=shape[0] * shape[1])
    return record


@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["matmul", "load", "store", "hbm_copy", "tensor_tensor", "activation", "iota"]),
            st.tuples(st.integers(1, 128), st.integers(1, 4096)),
            st.sampled_from(["bfloat16", "float32"]),
            st.sampled_from(["sbuf", "psum"]),
        ),
        min_size=1, max_size=30,
    ),
    st.sampled_from([TRN1, TRN2]),
)
def test_any_trace_is_between_its_roofline_and_its_serial_time(instructions, target):
    report = cost.cost_report([random_record(*instruction) for instruction in instructions], target)
    assert report.est_time_s <= report.serial_time_s * (1 + 1e-12)
    assert report.est_time_s >= report.roofline_memory_s * (1 - 1e-12)
    # TensorE's 128x128x2 flops per cycle is 0.5% under the documented peak, hence 0.99
    assert report.est_time_s >= 0.99 * report.roofline_compute_s
    assert 0.0 <= report.utilization <= 1.01


def test_sum_reports_adds_launches():
    first = cost.cost_report([matmul(), dma()], TRN2)
    second = cost.cost_report([vector("tensor_copy"), dma(load=False)], TRN2)
    total = cost.sum_reports([first, second])
    assert total.launches == 2
    assert total.est_time_s == pytest.approx(first.est_time_s + second.est_time_s)
    assert total.flops == first.flops
    assert total.hbm_bytes == first.hbm_bytes + second.hbm_bytes
    assert total.instructions_per_engine == {"tensor": 1, "vector": 1, "dma": 2}
    assert total.est_lower_bound_s == pytest.approx(first.est_lower_bound_s + second.est_lower_bound_s)
    assert total.launch_s == pytest.approx(2 * cost.KERNEL_LAUNCH_S)
    assert total.utilization == pytest.approx(total.roofline_s / total.device_time_s)
    assert "2 launches" in total.format()


def test_sum_reports_rejects_mixed_targets_and_nothing():
    with pytest.raises(ValueError, match="cost_sum_mixed_targets.*trn1.*trn2"):
        cost.sum_reports([cost.cost_report([matmul()], TRN1), cost.cost_report([matmul()], TRN2)])
    with pytest.raises(ValueError, match="cost_sum_empty"):
        cost.sum_reports([])


def test_empty_trace_and_target_by_name():
    report = cost.cost_report([], "trn1")
    assert (report.target, report.est_time_s, report.utilization) == ("trn1", 0.0, 0.0)
    assert "0 instructions" in report.format()


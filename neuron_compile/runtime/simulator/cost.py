"""Simulator stage: the per-instruction cost model. Input: an instruction trace (trace.InstructionRecord list)
and a hardware.Target. Output: a CostReport (cycles and busy time per engine, HBM bytes, FLOPs, estimated
device time, roofline and utilization).

Sources. Every formula below is one of nki-spec.md §2 ("Instruction cost model"), which condenses the
"Estimated instruction cost" sections of the Neuron SDK's legacy ``general/nki/api/nki/isa/__init__.py``
docstrings, the Trainium/Trainium2 architecture guides (engine clocks and data paths) and the DMA guides
(``nki/get-started/about/nki-dma-overview.rst``, ``nki/deep-dives/nki-dma-bandwidth-guide.rst``). Figures
that are our own inference, not documentation, are marked [I] where they are used.

Compute engines (cycles at the engine clock of hardware.py; N = elements per partition of the streamed
operand, MIN_II = 64):

====================================  ==============================================================
nc_matmul (TensorE)                   max(min(64, N_stationary), N_moving); x4 when the inputs are fp32
nc_transpose                          TensorE max(P, min(64, F)); VectorE max(MIN_II, N)
activation / exponential (ScalarE)    max(MIN_II, N); + MIN_II with a reduction (activation_reduce)
tensor_scalar, tensor_copy            max(MIN_II, N); a tensor_scalar with the ALU's reciprocal 8N, rsqrt 4N
tensor_copy_predicated                max(MIN_II, N) [I: a tensor_copy that also reads its predicate]
tensor_tensor                         max(MIN_II, 2N); max(MIN_II, N) with a PSUM input or all-bf16
                                      contiguous add/multiply/subtract
tensor_reduce                         N (N/2 for bf16 add/max)
memset                                max(MIN_II, N) (N/2 for a zero bf16/fp16 memset)
reciprocal (VectorE)                  max(MIN_II, 8N)
bn_stats / bn_aggr                    max(MIN_II, N) / max(MIN_II, 13N/3)
iota, affine_select (GpSimd)          150 + N
tensor_tensor_scan                    max(MIN_II, 2N)
scalar_tensor_tensor                  2N (N for bf16 subtract -> multiply)
rng, rand2, dropout, set_rng_seed,    [I] VectorE max(MIN_II, N), GpSimd 150 + N: no SDK figure; costed as one
rand_set_state, rand_get_state        pass over the elements (N: elements or state words per partition)
activate2 (ScalarE)                   max(MIN_II, N) [I: activation's figure; the tensor-scalar stage is inline]
tensor_scalar_reduce,                 max(MIN_II, N) [I: tensor_scalar's figure; the SDK calls the reduction "a
tensor_scalar_cumulative,             small additional cost"]; select_reduce, range_select, nc_match_replace8,
select_reduce, range_select,          nc_stream_shuffle (VectorE): max(MIN_II, N) [I: one pass over the elements]
nc_match_replace8, nc_stream_shuffle
local_gather, nc_n_gather,            150 + N (GpSimd) [I: the GpSimd startup plus one element per cycle, as iota]
sequence_bounds, nonzero_with_count
register_load, register_store (sync)  MIN_II [I: one sequencer instruction]
core_barrier                          MIN_II [I: a semaphore write and wait]; the schedule joins the two cores there
sendrecv                              a DMA transfer of the tile (SBUF to the other core's SBUF)
dynamic-address copies                max(600, N)
====================================  ==============================================================

Adjustments: [I] MIN_II bounds every instruction from below (tensor_reduce and scalar_tensor_tensor too),
it being the engines' minimum initiation interval; from the sources again, an SBUF/PSUM operand whose innermost free stride exceeds 16 bytes halves
the streaming bandwidth, so it doubles the N term; trn2's VectorE "performance mode" speeds bf16/fp16
SBUF-only tensor_copy / tensor_scalar / tensor_tensor by 2-4x, of which we take the conservative end,
vector_elems_per_cycle_bf16 / vector_elems_per_cycle_other (2 on trn2, 1 on trn1). Instructions the SDK gives
no figure for are costed max(MIN_II, N), GpSimd ones 150 + N (its startup), and listed in
``CostReport.unmodeled`` so a report never hides a guess.

DMA (nanoseconds; 16 engines per NeuronCore, each serving 128/16 = 8 partitions, sustained
``target.dma_bytes_per_s / 16`` each, ~1300 ns fixed cost per transfer):

* A transfer of P partitions is split over ``ceil(P / 8)`` engines (at most 16), which move their share of
  the bytes in parallel. Its isolated latency is ``overhead + bytes_per_engine / engine_bandwidth``.
* Each engine has 16 queues and keeps several transfers in flight, so the fixed cost overlaps with other
  transfers' data movement. [I] We charge each transfer ``overhead / 8`` of engine occupancy: with that
  figure a 128-partition transfer is overhead-bound below 256 B/partition (35% efficient), 81% efficient
  at 2 KiB and 90% at 4 KiB, which is the curve the DMA bandwidth guide describes (< 256 B overhead-bound,
  >= 2 KiB recommended, >= 4 KiB saturates).
* [I] Contiguity: memory is moved in 64-byte bursts, so a contiguous run shorter than 64 bytes (an
  element-strided or broadcast access) costs a whole burst per element. This is why a transpose through a
  strided DMA is slow and a TensorE or dma_transpose is not.
* dma_transpose runs at 90% of DMA throughput HBM->SBUF and 50% SBUF->SBUF (trn2 guide).
* A transfer streams the bytes of every source it reads (a dma_compute reads all of its sources) and of its
  destination, reads and write pipelined: the larger side is charged. [I] An HBM->HBM copy moves its bytes
  through the core's HBM bandwidth twice (a read and a write), so both sides are charged, consistently with
  the roofline, which counts HBM bytes read plus written.
* DMA busy time = max(sum of engine occupancy / 16 engines, the longest single transfer's latency): the 16
  engines are load-balanced (transfers round-robin over queues) and a kernel lasts at least one transfer.

Whole-kernel model and its limits. ``est_time_s`` is the busy time of the busiest engine: all engines
(TensorE, VectorE, ScalarE, GpSimd, the DMA pool) are assumed to overlap perfectly, as a well-pipelined kernel
(loads of tile i+1 during compute on tile i) does. It ignores dependency stalls (an engine waiting for
another's result), the pipeline fill and drain, semaphore and instruction-issue costs, the ~100-cycle
static overhead of dependent back-to-back small VectorE instructions (the trace does not say which
instructions depend on which), SBUF bank conflicts, software-DGE descriptor generation on GpSimd and the
~600 ns HWDGE issue cost, so it is a lower bound of a real run; ``serial_time_s`` (every engine's time added
up, no overlap) is the other end of the range. A launch with lnc=2 records both programs in one trace, which is costed
as if one NeuronCore ran it all.
``roofline_s = max(FLOPs / TensorE peak for the dtype, HBM bytes / HBM bandwidth)``, where the HBM bandwidth
of one NeuronCore is its sustained DMA bandwidth (trn2: 368 GB/s, and the chip's 2.9 TB/s shared by 8 cores is
362 GB/s each), and FLOPs off TensorE are counted at the bf16 TensorE peak (an optimistic bound, harmless since
such kernels are memory-bound). ``utilization = roofline_s / est_time_s``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from neuron_compile.hardware import Target, get_target
from neuron_compile.runtime.simulator import comm_cost
from neuron_compile.runtime.simulator.report import ENGINES, CostReport, SectionCost, sum_reports
from neuron_compile.runtime.simulator.schedule import (
    DEPENDENCY_LATENCY_CYCLES,
    InstructionCost,
    Schedule,
    dma_queue,
    schedule,
)
from neuron_compile.runtime.simulator.trace import InstructionRecord, OperandInfo

__all__ = ["CostReport", "sum_reports", "cost_report", "instruction_cycles", "dma_transfer_time", "DmaTime",
           "KERNEL_LAUNCH_S", "MIN_II"]

MIN_II = 64  # minimum initiation interval of any engine, cycles
GPSIMD_STARTUP = 150  # GpSimd fixed startup, cycles (iota, affine_select)
DYNAMIC_COPY_MIN = 600  # dynamic-address copies, cycles
MATMUL_FP32_FACTOR = 4  # fp32 matmul runs at a quarter of the bf16 rate
STRIDED_STREAM_BYTES = 16  # an innermost SBUF/PSUM stride above this halves the streaming bandwidth
DMA_TRANSFERS_IN_FLIGHT = 8  # [I] per engine; calibrated to the DMA guide's efficiency curve (see docstring)
DMA_BURST_BYTES = 64  # [I] smallest unit of memory a DMA moves
DMA_TRANSPOSE_EFFICIENCY = {"hbm": 0.9, "sbuf": 0.5}  # by source buffer (trn2 guide)

KERNEL_LAUNCH_S = 5e-6  # [I] fixed cost of one kernel launch (a NEFF boundary); see the docstring
_TWO_BYTE_FLOATS = {"bfloat16", "float16"}
_FP32_MATMUL = {"float32"}  # tf32 ("tfloat32") runs at the bf16 rate


# ---------------------------------------------------------------------------------------------------------
# Operand helpers
# ---------------------------------------------------------------------------------------------------------


def _operand(record: InstructionRecord, *roles: str) -> OperandInfo | None:
    for role in roles:
        for src in record.srcs:
            if src.role == role:
                return src
    return None


def _op_name(value) -> str:
    """``attrs['op']`` may be a string, an nl function or a numpy ufunc: reduce it to a lower-case name."""
    if value is None:
        return ""
    name = getattr(value, "__name__", None) or str(value)
    return name.rsplit(".", 1)[-1].lower()


def _on_chip(operand: OperandInfo) -> bool:
    return operand.buffer in ("sbuf", "psum")


def _streamed(record: InstructionRecord) -> list[OperandInfo]:
    """The on-chip operands the engine streams through (srcs, else the dst for memset/iota)."""
    operands = [src for src in record.srcs if _on_chip(src)]
    if not operands and record.dst is not None:
        operands = [record.dst]
    return operands


def _elems_per_partition(record: InstructionRecord) -> int:
    return max((operand.free_elems for operand in _streamed(record)), default=1)


def _stride_factor(record: InstructionRecord) -> int:
    """2 when an SBUF/PSUM operand's innermost stride exceeds 16 bytes (half streaming bandwidth)."""
    operands = [*_streamed(record), *([record.dst] if record.dst is not None else [])]
    strided = any(_on_chip(op) and op.innermost_stride_bytes > STRIDED_STREAM_BYTES for op in operands)
    return 2 if strided else 1


def _contiguous(operand: OperandInfo) -> bool:
    return operand.innermost_stride_bytes == operand.itemsize


# ---------------------------------------------------------------------------------------------------------
# Compute-engine formulas (cycles)
# ---------------------------------------------------------------------------------------------------------


def _matmul_cycles(record: InstructionRecord) -> float:
    stationary = _operand(record, "stationary") or record.srcs[0]
    moving = _operand(record, "moving") or record.srcs[-1]
    n_stationary, n_moving = stationary.free_elems, moving.free_elems
    if record.attrs.get("perf_mode") == "double_row":  # [128, 2, N] operands: two rows of K per column
        n_stationary, n_moving = n_stationary // 2, n_moving // 2
    cycles = max(min(64, n_stationary), n_moving * _stride_factor(record))
    if stationary.dtype in _FP32_MATMUL or moving.dtype in _FP32_MATMUL:
        cycles *= MATMUL_FP32_FACTOR
    return cycles


def _transpose_cycles(record: InstructionRecord) -> float:
    data = record.srcs[0]
    if record.engine == "tensor":
        return max(data.partitions, min(64, data.free_elems))
    return max(MIN_II, data.free_elems)


def _tensor_tensor_cycles(record: InstructionRecord, n: int) -> float:
    op = _op_name(record.attrs.get("op"))
    operands = [*record.srcs, *([record.dst] if record.dst else [])]
    one_psum_input = any(src.buffer == "psum" for src in record.srcs)
    fast_bf16 = (
        op in ("add", "multiply", "subtract")
        and all(o.dtype == "bfloat16" and _contiguous(o) for o in operands)
    )
    return n if one_psum_input or fast_bf16 else 2 * n


def _tensor_reduce_cycles(record: InstructionRecord, n: int) -> float:
    op = _op_name(record.attrs.get("op"))
    halved = record.srcs and record.srcs[0].dtype == "bfloat16" and op in ("add", "max", "maximum")
    return n / 2 if halved else n


def _memset_cycles(record: InstructionRecord, n: int) -> float:
    value = record.attrs.get("value")
    zero_two_byte = record.dst is not None and record.dst.dtype in _TWO_BYTE_FLOATS and value == 0
    return n / 2 if zero_two_byte else n


def _scalar_tensor_tensor_cycles(record: InstructionRecord, n: int) -> float:
    op0, op1 = _op_name(record.attrs.get("op0")), _op_name(record.attrs.get("op1"))
    tiles = [src for src in record.srcs if src.free_elems > 1]  # not the fp32 scalar / (P, 1) operand0
    bf16 = bool(tiles) and all(src.dtype == "bfloat16" for src in tiles)
    return n if bf16 and op0 == "subtract" and op1 == "multiply" else 2 * n


# The ALU's iterative unary operators, in cycles per element: the SDK's engine-selection guide gives the Vector
# engine's reciprocal 8x and GpSimd's reverse square root 4x the Scalar engine's one cycle per element; [I] the
# reciprocal is charged 8 on any engine (the SDK gives GpSimd's no figure), rsqrt 4.
ALU_UNARY_CYCLES = {"reciprocal": 8, "rsqrt": 4}


def _alu_unary_factor(record: InstructionRecord) -> float:
    ops = (_op_name(record.attrs.get("op0")), _op_name(record.attrs.get("op1")))
    return max(ALU_UNARY_CYCLES.get(op, 1) for op in ops)


# Streaming formulas: name -> cycles as a function of (record, N); the result is floored at MIN_II.
_STREAMING = {
    "activation": lambda r, n: n + (MIN_II if r.attrs.get("reduce") else 0),
    "activation_reduce": lambda r, n: n + MIN_II,
    "activate2": lambda r, n: n,
    "exponential": lambda r, n: n,
    "tensor_scalar": lambda r, n: n * _alu_unary_factor(r),
    "tensor_copy": lambda r, n: n,
    "tensor_copy_predicated": lambda r, n: n,
    "tensor_tensor": _tensor_tensor_cycles,
    "tensor_reduce": _tensor_reduce_cycles,
    "memset": _memset_cycles,
    "reciprocal": lambda r, n: 8 * n if r.engine == "vector" else n,
    "bn_stats": lambda r, n: n,
    "bn_aggr": lambda r, n: 13 * n / 3,
    "tensor_tensor_scan": lambda r, n: 2 * n,
    "scalar_tensor_tensor": _scalar_tensor_tensor_cycles,
    "tensor_scalar_reduce": lambda r, n: n,
    "tensor_scalar_cumulative": lambda r, n: n,
    "select_reduce": lambda r, n: n,
    "range_select": lambda r, n: n,
    "nc_match_replace8": lambda r, n: n,
    "nc_stream_shuffle": lambda r, n: n,
    "core_barrier": lambda r, n: MIN_II,
    "register_load": lambda r, n: MIN_II,
    "register_store": lambda r, n: MIN_II,
}
_GPSIMD_STARTUP_OPS = {"iota", "affine_select", "local_gather", "nc_n_gather", "sequence_bounds",
                       "nonzero_with_count"}
_RANDOM_OPS = {"rng", "rand2", "dropout", "set_rng_seed", "rand_set_state", "rand_get_state"}
_DYNAMIC_COPIES = {"tensor_copy_dynamic_src", "tensor_copy_dynamic_dst"}
_PERF_MODE_OPS = {"tensor_copy", "tensor_scalar", "tensor_tensor"}


def _vector_perf_mode_speedup(record: InstructionRecord, target: Target) -> float:
    """trn2+ VectorE performance mode for bf16/fp16 SBUF-only copies and elementwise ops (1 elsewhere)."""
    if record.engine != "vector" or record.name not in _PERF_MODE_OPS:
        return 1.0
    operands = [*record.srcs, *([record.dst] if record.dst else [])]
    if not all(o.buffer == "sbuf" and o.dtype in _TWO_BYTE_FLOATS for o in operands if o.free_elems > 1):
        return 1.0
    return target.vector_elems_per_cycle_bf16 / target.vector_elems_per_cycle_other


def _compute_cycles(record: InstructionRecord, target: Target) -> tuple[float, bool]:
    """(cycles, modeled) for an instruction on a compute engine."""
    name = record.name
    if name == "nc_matmul":
        return _matmul_cycles(record), True
    if name == "nc_transpose":
        return _transpose_cycles(record) * _stride_factor(record), True
    n = _elems_per_partition(record) * _stride_factor(record)
    if name in _GPSIMD_STARTUP_OPS:
        return GPSIMD_STARTUP + n, True
    if name in _RANDOM_OPS:
        return (GPSIMD_STARTUP + n if record.engine == "gpsimd" else max(MIN_II, n)), True
    if name in _DYNAMIC_COPIES or record.attrs.get("dynamic"):
        return max(DYNAMIC_COPY_MIN, n), True
    formula = _STREAMING.get(name)
    if formula is not None:
        return max(MIN_II, formula(record, n) / _vector_perf_mode_speedup(record, target)), True
    if record.engine == "gpsimd":
        return GPSIMD_STARTUP + n, False
    return max(MIN_II, n), False


# ---------------------------------------------------------------------------------------------------------
# DMA (nanoseconds)
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DmaTime:
    """One transfer: ``latency_ns`` alone on an idle DMA pool; ``pool_ns`` its share of the 16-engine pool."""

    latency_ns: float
    pool_ns: float
    engines_used: int


def _contiguous_run_bytes(operand: OperandInfo) -> int:
    """Bytes of the innermost contiguous run of an operand's access pattern."""
    if _contiguous(operand):
        inner = operand.shape[-1] if operand.shape else 1
        return inner * operand.itemsize
    return operand.itemsize  # strided or broadcast: every element is its own run


def _burst_inflated_bytes(nbytes: int, run_bytes: int) -> float:
    """Bytes of memory traffic once every contiguous run is rounded up to a whole DMA burst."""
    if run_bytes >= DMA_BURST_BYTES or run_bytes <= 0:
        return float(nbytes)
    return nbytes / run_bytes * DMA_BURST_BYTES


def _moved_bytes(record: InstructionRecord) -> int:
    """The bytes a DMA engine streams: every source read (a dma_compute reads all of its sources, SDK ``dst =
    reduce_op(srcs[0] * scales[0], srcs[1] * scales[1], ...)``) and the destination written, the reads and the
    write pipelined, so the larger side bounds it; HBM -> HBM, both sides cross the core's HBM bandwidth."""
    read = sum(src.nbytes for src in record.srcs)
    written = record.dst.nbytes if record.dst is not None else 0
    operands = [o for o in (record.dst, *record.srcs) if o is not None]
    if operands and all(o.buffer == "hbm" for o in operands):
        return read + written  # [I] the read and the write share the HBM bandwidth
    return max(read, written)


def dma_transfer_time(record: InstructionRecord, target: Target) -> DmaTime:
    operands = [o for o in (record.dst, *record.srcs) if o is not None]
    nbytes = _moved_bytes(record)
    on_chip = [o for o in operands if _on_chip(o)]
    partitions = max((o.partitions for o in (on_chip or operands)), default=1)
    partitions_per_engine = max(1, target.partitions // target.dma_engines)
    engines_used = max(1, min(target.dma_engines, math.ceil(partitions / partitions_per_engine)))
    run_bytes = min((_contiguous_run_bytes(o) for o in operands), default=nbytes)
    traffic = _burst_inflated_bytes(nbytes, run_bytes)
    engine_bytes_per_ns = target.dma_bytes_per_s / target.dma_engines / 1e9
    if record.name == "dma_transpose":
        source = record.srcs[0].buffer if record.srcs else "hbm"
        engine_bytes_per_ns *= DMA_TRANSPOSE_EFFICIENCY.get(source, 0.5)
    data_ns = traffic / engines_used / engine_bytes_per_ns
    overhead_ns = target.dma_fixed_overhead_ns
    occupancy_ns = engines_used * (overhead_ns / DMA_TRANSFERS_IN_FLIGHT + data_ns)
    return DmaTime(overhead_ns + data_ns, occupancy_ns / target.dma_engines, engines_used)


def _is_dma(record: InstructionRecord) -> bool:
    return record.engine == "dma" or record.name.startswith("dma_")


# ---------------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------------


def _engine_ghz(engine: str, target: Target) -> float:
    # [I] the sync engine (SP) has no documented clock; it issues DMA triggers and barriers like ScalarE.
    return {
        "tensor": target.tensor_ghz,
        "vector": target.vector_ghz,
        "scalar": target.scalar_ghz,
        "gpsimd": target.gpsimd_ghz,
        "sync": target.scalar_ghz,
    }[engine]


def instruction_cycles(record: InstructionRecord, target: Target | str | None = None) -> tuple[str, float]:
    """(engine, cycles) of one instruction; for DMA, nanoseconds of DMA-pool occupancy."""
    target = target if isinstance(target, Target) else get_target(target)
    if _is_dma(record):
        return "dma", dma_transfer_time(record, target).pool_ns
    _check_engine(record)
    return record.engine, _compute_cycles(record, target)[0]


def _check_engine(record: InstructionRecord) -> None:
    if record.engine not in ENGINES:
        raise ValueError(
            f"[cost_unknown_engine] instruction {record.name} ran on engine {record.engine!r}: "
            f"expected one of {ENGINES}"
        )


def _hbm_traffic(record: InstructionRecord) -> tuple[int, int]:
    """(bytes read from HBM, bytes written to HBM) by a DMA."""
    read = sum(src.nbytes for src in record.srcs if src.buffer == "hbm")
    written = record.dst.nbytes if record.dst is not None and record.dst.buffer == "hbm" else 0
    return read, written


def _peak_flops_per_s(record: InstructionRecord, target: Target) -> float:
    if record.name == "nc_matmul":
        dtypes = {src.dtype for src in record.srcs}
        if dtypes & _FP32_MATMUL:
            return target.tensor_fp32_tflops * 1e12
        if record.attrs.get("perf_mode") == "double_row":
            return 2 * target.tensor_bf16_tflops * 1e12
    return target.tensor_bf16_tflops * 1e12


def _compute_cost(record: InstructionRecord, target: Target, cycles: float) -> InstructionCost:
    ghz = _engine_ghz(record.engine, target)
    return InstructionCost(record.engine, duration_ns=cycles / ghz, visible_after_ns=DEPENDENCY_LATENCY_CYCLES / ghz)


def _dma_cost(record: InstructionRecord, dma: DmaTime, target: Target) -> InstructionCost:
    per_engine_ns = dma.pool_ns * target.dma_engines / dma.engines_used
    return InstructionCost(dma_queue(record), latency_ns=dma.latency_ns, occupancy_ns=per_engine_ns,
                           dma_engines=dma.engines_used)


@dataclass
class _Tally:
    """Counts, busy time per (core, engine), bytes and FLOPs of a trace, gathered while costing it."""

    target: Target
    counts: Counter = field(default_factory=Counter)
    cycles: dict[str, float] = field(default_factory=dict)
    core_busy_s: dict[tuple[int, str], float] = field(default_factory=dict)
    longest_dma_s: dict[int, float] = field(default_factory=dict)
    per_instruction: dict[str, float] = field(default_factory=dict)
    unmodeled: set[str] = field(default_factory=set)
    read: int = 0
    written: int = 0
    flops: int = 0
    compute_bound_s: float = 0.0

    def add(self, record: InstructionRecord) -> InstructionCost:
        """Account for one instruction; return its cost for the scheduler."""
        target = self.target
        if _is_dma(record):
            engine, dma = "dma", dma_transfer_time(record, target)
            amount, seconds = dma.pool_ns, dma.pool_ns * 1e-9
            longest = self.longest_dma_s.get(record.program, 0.0)
            self.longest_dma_s[record.program] = max(longest, dma.latency_ns * 1e-9)
            record_read, record_written = _hbm_traffic(record)
            self.read, self.written = self.read + record_read, self.written + record_written
            scheduled = _dma_cost(record, dma, target)
        elif record.engine == "collective":  # its time on the links, in ns (the engines have no clock here)
            engine, amount = "collective", collective_duration_ns(record)
            seconds = amount * 1e-9
            scheduled = InstructionCost("collective", duration_ns=amount)
        else:
            _check_engine(record)
            engine = record.engine
            amount, modeled = _compute_cycles(record, target)
            if not modeled:
                self.unmodeled.add(record.name)
            seconds = amount / (_engine_ghz(engine, target) * 1e9)
            scheduled = _compute_cost(record, target, amount)
        self.counts[engine] += 1
        self.cycles[engine] = self.cycles.get(engine, 0.0) + amount
        key = (record.program, engine)
        self.core_busy_s[key] = self.core_busy_s.get(key, 0.0) + seconds
        self.per_instruction[record.name] = self.per_instruction.get(record.name, 0.0) + seconds
        self.flops += record.flops
        self.compute_bound_s += record.flops / _peak_flops_per_s(record, target)
        return scheduled

    def busy_per_core(self) -> dict[tuple[int, str], float]:
        """Busy seconds per (core, engine); a core's DMA pool lasts at least its longest transfer."""
        busy = dict(self.core_busy_s)
        for program, longest in self.longest_dma_s.items():
            busy[(program, "dma")] = max(busy.get((program, "dma"), 0.0), longest)
        return busy


def collective_duration_ns(record: InstructionRecord) -> float:
    """A collective instruction's time on the chip links (comm_cost.py's ring model), in ns."""
    attrs = record.attrs
    return 1e9 * comm_cost.collective_time_s(attrs["collective"], attrs["ranks"], attrs["input_bytes"],
                                             attrs["output_bytes"])


def communication(trace: list[InstructionRecord], plan: Schedule) -> tuple[float, float]:
    """(seconds the trace's collectives take, seconds of that during which another queue of the same core was
    busy): the communication a launch costs, and how much of it compute hid."""
    busy: dict[int, list[tuple[float, float]]] = {}
    collectives = []
    for record, timing in zip(trace, plan.timings, strict=True):
        if record.engine == "collective":
            collectives.append((record.program, timing.start_ns, timing.end_ns))
        else:
            busy.setdefault(record.program, []).append((timing.start_ns, timing.end_ns))
    total = overlapped = 0.0
    merged = {program: merge_intervals(intervals) for program, intervals in busy.items()}
    for program, start, end in collectives:
        total += end - start
        overlapped += sum(max(0.0, min(end, b) - max(start, a)) for a, b in merged.get(program, ()))
    return total * 1e-9, overlapped * 1e-9


def merge_intervals(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of [start, end) intervals, as disjoint intervals in order."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def launch_schedule(trace: Iterable[InstructionRecord], target: Target | str | None = None) -> Schedule:
    """The instruction schedule behind ``cost_report``'s ``device_time_s`` (one ``Timing`` per instruction of
    ``trace``, in order): the timeline a profile view draws."""
    target = target if isinstance(target, Target) else get_target(target)
    trace = list(trace)
    tally = _Tally(target)
    return schedule(trace, [tally.add(record) for record in trace], target.dma_engines)


def _section_costs(trace: list[InstructionRecord], costs: list[InstructionCost], plan: Schedule,
                   target: Target) -> tuple[SectionCost, ...]:
    """Per section of the trace (report.SectionCost), in order of first instruction."""
    members: dict[str, list[int]] = {}
    for index, record in enumerate(trace):
        members.setdefault(record.section, []).append(index)
    sections, latest_end_ns = [], 0.0
    for name, indices in members.items():
        busy: dict[str, float] = {}
        hbm_bytes = flops = 0
        compute_bound_s = 0.0
        for index in indices:
            record, cost = trace[index], costs[index]
            if _is_dma(record):
                engine, seconds = "dma", dma_transfer_time(record, target).pool_ns * 1e-9  # as the tally counts it
                hbm_bytes += sum(_hbm_traffic(record))
            else:
                engine, seconds = record.engine, cost.duration_ns * 1e-9
            busy[engine] = busy.get(engine, 0.0) + seconds
            flops += record.flops
            compute_bound_s += record.flops / _peak_flops_per_s(record, target)
        start_ns = min(plan.timings[index].start_ns for index in indices)
        end_ns = max(plan.timings[index].end_ns for index in indices)
        sections.append(SectionCost(
            name, max(0.0, end_ns - latest_end_ns) * 1e-9, busy, hbm_bytes, flops, len(indices), start_ns * 1e-9,
            end_ns * 1e-9, roofline_s=max(compute_bound_s, hbm_bytes / target.dma_bytes_per_s),
        ))
        latest_end_ns = max(latest_end_ns, end_ns)
    return tuple(sections)


def cost_report(trace: Iterable[InstructionRecord], target: Target | str | None = None) -> CostReport:
    """Cost one kernel launch's trace on ``target`` (a Target, a target name, or None for the default)."""
    target = target if isinstance(target, Target) else get_target(target)
    trace = list(trace)
    tally = _Tally(target)
    costs = [tally.add(record) for record in trace]
    plan: Schedule = schedule(trace, costs, target.dma_engines)
    core_busy = tally.busy_per_core()
    busy: dict[str, float] = {}
    for (_, engine), seconds in core_busy.items():
        busy[engine] = busy.get(engine, 0.0) + seconds
    cores = max(1, len({program for program, _ in core_busy}))
    launch = KERNEL_LAUNCH_S if trace else 0.0
    device = plan.makespan_ns * 1e-9
    compute_bound_s = tally.compute_bound_s / cores
    memory_bound_s = (tally.read + tally.written) / (target.dma_bytes_per_s * cores)
    roofline = max(compute_bound_s, memory_bound_s)
    comm_s, comm_overlap_s = communication(trace, plan) if tally.counts.get("collective") else (0.0, 0.0)
    return CostReport(
        target=target.name,
        instructions_per_engine=dict(tally.counts),
        cycles_per_engine=tally.cycles,
        busy_s_per_engine=busy,
        hbm_bytes_read=tally.read,
        hbm_bytes_written=tally.written,
        flops=tally.flops,
        est_time_s=launch + device,
        serial_time_s=launch + plan.serial_ns * 1e-9,
        roofline_s=roofline,
        utilization=roofline / device if device else 0.0,
        roofline_compute_s=compute_bound_s,
        roofline_memory_s=memory_bound_s,
        time_per_instruction=tally.per_instruction,
        unmodeled=tuple(sorted(tally.unmodeled)),
        est_lower_bound_s=launch + max(core_busy.values(), default=0.0),
        device_time_s=device,
        launch_s=launch,
        wait_s_per_queue={queue: ns * 1e-9 for queue, ns in plan.wait_ns_per_queue.items()},
        cores=cores,
        sections=_section_costs(trace, costs, plan, target),
        est_comm_s=comm_s,
        comm_overlap_s=comm_overlap_s,
    )

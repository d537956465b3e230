"""Simulator stage: the running kernel's context and on-chip memory allocation.

Input: allocation requests (shape, dtype, buffer) from ``nl.ndarray`` & co. Output: NaN-filled (ints: 4)
NkiTensors, with SBUF bytes per partition and PSUM banks accounted against the target. A buffer is released
when its last Python reference dies (``weakref.finalize``), so allocating inside a loop works as on hardware,
where the allocator reuses the space of tiles that are no longer live. The reuse is visible to the cost model,
as the allocator's ring mode does it (``nki.compiler.AllocationMode.RING``: each tile gets fresh memory, and
freed memory is reused only once the allocation wraps around; PSUM rotates through its 8 banks): a released
on-chip tensor's ``memory_id`` joins a first-in first-out pool, and an allocation takes a fresh id while fresh
space remains (live bytes plus pooled bytes within capacity), else the oldest pooled id whatever its size (the
ring reuses the space freed first, whichever tile held it), whose last reads its writes then wait for
(trace.Region).

The ``KernelContext`` also holds the instruction trace, the target, the program id of the current launch and the
engines' random-number generator states.
"""

from __future__ import annotations

import collections

import math
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from neuron_compile.runtime.simulator.errors import NkiCapacityError, NkiValidationError
from neuron_compile.hardware import Target, get_target
from neuron_compile.runtime.simulator.tensor import Buffer, NkiTensor, Storage, new_storage_tensor
from neuron_compile.runtime.simulator.trace import InstructionRecord

UNINITIALIZED_INT = 4  # the official simulator's fill value for integer buffers

sbuf = Buffer("sbuf", "sbuf")
psum = Buffer("psum", "psum")
hbm = Buffer("hbm", "hbm")
private_hbm = Buffer("private_hbm", "hbm")
shared_hbm = Buffer("shared_hbm", "hbm")


@dataclass
class KernelContext:
    target: Target
    program_id: int = 0
    num_programs: int = 1
    # the launch's instruction trace; None: a launch that records none (run_kernel's trace=False)
    trace: list[InstructionRecord] | None = field(default_factory=list)
    sbuf_live_bytes: int = 0  # per partition
    psum_live_banks: int = 0
    sbuf_peak_bytes: int = 0
    psum_peak_banks: int = 0
    outputs_allocated: list[NkiTensor] = field(default_factory=list)
    # nl.shared_hbm tensors of an earlier program of the same launch: program i's k-th output allocation
    # returns the k-th of them, since on hardware all LNC programs write one shared output
    shared_reuse: list[NkiTensor] = field(default_factory=list)
    allocations: int = 0  # numbers unnamed tensors in error messages
    # the engines' accumulator registers (accumulators.py): engine name -> 128 fp32 values, one per lane, driven
    # by the reduce_cmd of ScalarE's activation / activate2 and VectorE's accumulating instructions
    accumulators: dict = field(default_factory=dict)
    launched: bool = False  # False for the throwaway context used outside any kernel
    launch_frame: object = None  # the simulator's launch frame: where attributing instructions stops looking
    # the engines' PRNG states (isa_random.py): engine name -> (128, words) uint32 lane states, absent until seeded
    random_states: dict = field(default_factory=dict)
    # released on-chip memory not yet reused, oldest first: buffer kind -> (units, memory id) pairs, and the units
    # (SBUF bytes per partition, PSUM banks) those ids hold per buffer kind
    free_memory_ids: dict = field(default_factory=dict)
    pooled_units: dict = field(default_factory=dict)
    collectives: list = field(default_factory=list)  # collectives.CollectiveRecord per nki.collectives call
    # the kernel's SBUF and PSUM as bytes (buffer kind -> Storage), made when a tensor is first placed at an address
    physical: dict = field(default_factory=dict)
    program_group: object = None  # lnc.ProgramGroup of a launch of several programs (None: one program)
    recorder: object = None  # replay.Recorder of a launch that records its replay plan (None: it records none)


# The stack of running kernels, one per thread: threads that launch kernels at the same time (a compiled model
# called from several threads) each record into their own launch's trace and capacity accounting.
_running = threading.local()


def _stack() -> list[KernelContext]:
    stack = getattr(_running, "stack", None)
    if stack is None:
        stack = _running.stack = []
    return stack


def current() -> KernelContext:
    """This thread's running kernel's context; outside a kernel, a throwaway one on the default target."""
    stack = _stack()
    if not stack:
        stack.append(KernelContext(get_target()))
    return stack[-1]


def inside_launch() -> bool:
    """True while a launched kernel runs in this thread (a kernel called from another kernel is then inlined)."""
    stack = _stack()
    return bool(stack) and stack[-1].launched


@contextmanager
def kernel_context(context: KernelContext):
    stack = _stack()
    stack.append(context)
    try:
        yield context
    finally:
        stack.remove(context)


def _release_sbuf(context: KernelContext, nbytes: int) -> None:
    context.sbuf_live_bytes -= nbytes


def _release_psum(context: KernelContext, banks: int) -> None:
    context.psum_live_banks -= banks


def _release_memory_id(context: KernelContext, kind: str, units: int, memory_id: int) -> None:
    context.free_memory_ids.setdefault(kind, collections.deque()).append((units, memory_id))
    context.pooled_units[kind] = context.pooled_units.get(kind, 0) + units


def _ring_memory_id(context: KernelContext, tensor: NkiTensor, kind: str, units: int, live: int, capacity: int):
    """Give an on-chip tensor fresh memory while the ring has fresh space (``live`` units in use, after this
    one, plus those pooled, within ``capacity``), else the oldest released memory of any size: memory that a
    finished kernel of the same launch freed is reused as well as a previous loop iteration's. Where the oldest
    is smaller than the tensor, the next oldest are reclaimed too until the ring has room (the tensor takes the
    first one's id, so its accesses wait for that memory's last ones). Its id is pooled back on release."""
    pool = context.free_memory_ids.get(kind)
    reused = None
    while live + context.pooled_units.get(kind, 0) > capacity and pool:
        pooled_units, memory_id = pool.popleft()
        context.pooled_units[kind] -= pooled_units
        reused = memory_id if reused is None else reused
    if reused is not None:
        tensor.storage.memory_id = reused
    weakref.finalize(tensor.storage, _release_memory_id, context, kind, units, tensor.storage.memory_id)


def _fill_value(dtype: np.dtype):
    return np.nan if dtype.kind == "f" or dtype.name.startswith(("bfloat", "float")) else UNINITIALIZED_INT


PHYSICAL_FILL = 0xFF  # unwritten physical SBUF/PSUM bytes: NaN for every float dtype, -1 for signed ints


def _physical_memory(context: KernelContext, buffer: Buffer):
    """The kernel's whole SBUF or PSUM as one byte storage (one row of bytes per partition)."""
    memory = context.physical.get(buffer.kind)
    if memory is None:
        target = context.target
        row = target.sbuf_bytes_per_partition if buffer.kind == "sbuf" else target.psum_banks * target.psum_bank_bytes
        data = np.full(target.partitions * row, PHYSICAL_FILL, dtype=np.uint8)
        memory = context.physical[buffer.kind] = Storage(data, buffer, f"{buffer.name}_memory", row, physical=True)
        _replayed_fill(context, memory, PHYSICAL_FILL)
    return memory


def _placed(context: KernelContext, shape: tuple, dtype: np.dtype, buffer: Buffer, name: str, address) -> NkiTensor:
    """A tensor at ``address`` = (partition offset, byte offset within each partition) of the kernel's physical
    SBUF or PSUM: tensors placed at overlapping addresses share their bytes, as on the device. The byte reading of
    the free offset is the one production kernels use (their allocators count bytes, PSUM banks are 2048 apart);
    placed tensors are the kernel's own budget, so they are not counted against capacity."""
    partition, offset = (int(a) for a in address)
    memory = _physical_memory(context, buffer)
    row = memory.partition_stride
    free_bytes = math.prod(shape[1:]) * dtype.itemsize
    if partition < 0 or partition + shape[0] > context.target.partitions or offset < 0 or offset + free_bytes > row:
        raise NkiValidationError(
            "err_address_out_of_bounds",
            f"{name} {shape} {dtype.name} at address ({partition}, {offset}) reaches past {buffer.name}: "
            f"{context.target.partitions} partitions of {row} bytes",
        )
    if offset % dtype.itemsize:
        raise NkiValidationError("err_address_alignment", f"{name} at byte {offset} is not {dtype.name}-aligned")
    if buffer.kind == "psum" and offset % context.target.psum_bank_bytes:
        raise NkiValidationError(
            "err_psum_address_bank", f"{name} at PSUM byte {offset}: a PSUM tensor must start at a bank boundary "
            f"(a multiple of {context.target.psum_bank_bytes})",
        )
    item = dtype.itemsize
    strides = (row // item,) + tuple(math.prod(shape[d + 1:]) for d in range(1, len(shape)))
    return NkiTensor(memory, shape, strides, (partition * row + offset) // item, dtype,
                     allocation_free=math.prod(shape[1:]))


def _filled_array(context: KernelContext, buffer: Buffer, size: int, dtype: np.dtype, fill) -> np.ndarray:
    """A new allocation's array, filled; while the launch records a replay plan, a new tile takes the array of a
    released one of its size (replay.Recorder.reused_array), so the plan holds no more arrays than were live."""
    recorder = context.recorder
    reused = recorder.reused_array(size, dtype) if recorder is not None and buffer.kind in ("sbuf", "psum") else None
    if reused is None:
        return np.full(size, fill, dtype=dtype)
    np.copyto(reused, fill, casting="unsafe")  # as np.full fills
    return reused


def _replayed_fill(context: KernelContext, storage: Storage, fill) -> None:
    """While the launch records a replay plan: the new storage belongs to it, its fill is a step, and an on-chip
    tile's array is pooled for reuse once the tile is released."""
    recorder = context.recorder
    if recorder is not None:
        storage.recorder = recorder
        recorder.fill_on_replay(storage.data, fill)
        if storage.buffer.kind in ("sbuf", "psum") and not storage.physical:
            recorder.release_when_dead(storage)


def allocate(shape, dtype, buffer: Buffer = sbuf, name: str = "", address=None) -> NkiTensor:
    """A new uninitialized tensor (NaN / 4 filled) in ``buffer``, accounted against the target's capacity; with
    an ``address``, a tensor placed in the kernel's physical SBUF / PSUM (``_placed``)."""
    shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
    dtype = np.dtype(dtype)
    if not isinstance(buffer, Buffer):
        raise NkiValidationError(
            "err_unsupported_memory", f"buffer must be nl.sbuf/psum/hbm/shared_hbm, got {buffer!r}"
        )
    if dtype.itemsize > 4 or dtype.kind == "c":
        raise NkiValidationError("err_unsupported_dtype", f"dtype {dtype.name} is not a Neuron dtype (no 64-bit types)")
    context = current()
    context.allocations += 1
    name = name or f"{buffer.name}_{context.allocations}"
    if buffer.kind in ("sbuf", "psum"):
        if len(shape) < 2:
            raise NkiValidationError(
                "err_leading_dimension_of_tensor_must_be_partition",
                f"on-chip tensor {name} needs a partition dim and a free dim, got shape {shape}",
            )
        if shape[0] > context.target.partitions:
            raise NkiValidationError(
                "err_num_partition_exceed_arch_limit",
                f"Size of partition dimension {shape[0]} of {name} exceeds architecture limitation of "
                f"{context.target.partitions}.",
            )
    if address is not None and buffer.kind in ("sbuf", "psum"):
        return _placed(context, shape, dtype, buffer, name, address)
    if buffer is shared_hbm and len(context.outputs_allocated) < len(context.shared_reuse):
        shared = context.shared_reuse[len(context.outputs_allocated)]
        if shared.shape == shape and shared.dtype == dtype:
            context.outputs_allocated.append(shared)
            return shared
        raise NkiValidationError(
            "err_lnc_shared_output", f"shared_hbm allocation {len(context.outputs_allocated)} of program "
            f"{context.program_id} is {shape} {dtype.name}; another program allocated it as {shared.shape} "
            f"{shared.dtype.name} (every program allocates the same shared outputs in the same order)",
        )
    fill = _fill_value(dtype)
    tensor = new_storage_tensor(_filled_array(context, buffer, math.prod(shape), dtype, fill), buffer, shape, name)
    _replayed_fill(context, tensor.storage, fill)
    bytes_per_partition = math.prod(shape[1:]) * dtype.itemsize
    if buffer.kind == "sbuf":
        available = context.target.sbuf_bytes_per_partition - context.sbuf_live_bytes
        if bytes_per_partition > available:
            raise NkiCapacityError(
                "sbuf_capacity",
                f"allocating {name} {shape} {dtype.name} needs {bytes_per_partition} bytes per partition, "
                f"{available} of {context.target.sbuf_bytes_per_partition} available",
            )
        context.sbuf_live_bytes += bytes_per_partition
        context.sbuf_peak_bytes = max(context.sbuf_peak_bytes, context.sbuf_live_bytes)
        weakref.finalize(tensor.storage, _release_sbuf, context, bytes_per_partition)
        _ring_memory_id(context, tensor, "sbuf", bytes_per_partition,
                        context.sbuf_live_bytes, context.target.sbuf_bytes_per_partition)
    elif buffer.kind == "psum":
        # a PSUM tensor occupies whole 2 KiB banks
        banks = math.ceil(bytes_per_partition / context.target.psum_bank_bytes)
        available = context.target.psum_banks - context.psum_live_banks
        if banks > available:
            raise NkiCapacityError(
                "psum_capacity",
                f"allocating {name} {shape} {dtype.name} needs {banks} PSUM bank(s) "
                f"({bytes_per_partition} bytes per partition), {available} of {context.target.psum_banks} free",
            )
        context.psum_live_banks += banks
        context.psum_peak_banks = max(context.psum_peak_banks, context.psum_live_banks)
        weakref.finalize(tensor.storage, _release_psum, context, banks)
        _ring_memory_id(context, tensor, "psum", banks, context.psum_live_banks,
                        context.target.psum_banks)
    elif buffer is shared_hbm:
        context.outputs_allocated.append(tensor)
        context.shared_reuse.append(tensor)  # the launch's list: the other programs get this tensor
    return tensor


def hbm_input(array: np.ndarray, name: str) -> NkiTensor:
    """A kernel argument: an HBM tensor over a copy of ``array``'s values (row-major)."""
    if array.dtype.itemsize > 4 or array.dtype.kind == "c":
        raise NkiValidationError(
            "err_unsupported_dtype", f"kernel argument {name} has dtype {array.dtype.name}: no 64-bit types on Neuron"
        )
    # a private row-major copy: the kernel sees HBM, the caller's array changes only by write-back
    return new_storage_tensor(np.array(array, order="C").reshape(-1), hbm, array.shape, name)

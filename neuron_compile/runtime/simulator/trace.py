"""Simulator stage: the instruction trace, the contract between the interpreter and the cost model.

Every simulated ISA instruction (``nki.isa.*``, and the ``nki.language`` wrappers through the instructions they
lower to) appends one ``InstructionRecord`` to the running kernel's trace. The cost model (cost.py) turns a
trace into cycles per engine, time, bytes and FLOPs; it never sees numpy arrays, only these descriptors.
Each record also names the memory ``Region``s it reads and writes, from which the scheduler (schedule.py)
derives the dependencies between instructions (read after write, write after read, write after write).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class OperandInfo:
    """What the cost model needs to know about one operand of an instruction."""

    role: str  # "dst", "src", "stationary", "moving", "bias", "scale", "operand0", "index", ...
    buffer: str  # "sbuf" | "psum" | "hbm" (private_hbm and shared_hbm report "hbm")
    shape: tuple[int, ...]
    dtype: str  # numpy dtype name: "float32", "bfloat16", "float8_e4m3", "int32", ...
    itemsize: int
    partitions: int  # shape[0] for on-chip tiles; for HBM, the partition-side count of the transfer
    free_elems: int  # elements per partition (product of the free dims)
    innermost_stride_bytes: int  # stride of the innermost free dim in bytes (0 for broadcast)

    @property
    def nbytes(self) -> int:
        return self.partitions * self.free_elems * self.itemsize


@dataclass(frozen=True)
class Region:
    """A box of memory one operand touches: which allocation, which partitions, which bytes of each.

    ``memory`` identifies the memory, not the Python object: on-chip tensors are numbered by allocation slot,
    and a slot is handed to a new tensor once its previous owner is released (the space is reused, as the
    allocator on hardware reuses it), so the new owner's first write waits for the old owner's last use. HBM
    tensors are numbered per allocation. ``partitions`` and ``free_bytes`` are half-open ranges; the free range
    is the hull of the bytes the access pattern reaches in each partition (a conservative box). HBM regions
    (``hbm``) have a single partition (0, 1) and the hull of the bytes reached in the flat tensor.
    """

    memory: int
    partitions: tuple[int, int]
    free_bytes: tuple[int, int]
    hbm: bool = False

    def overlaps(self, other: Region) -> bool:
        return (
            self.memory == other.memory
            and self.partitions[0] < other.partitions[1] and other.partitions[0] < self.partitions[1]
            and self.free_bytes[0] < other.free_bytes[1] and other.free_bytes[0] < self.free_bytes[1]
        )

    def covers(self, other: Region) -> bool:
        return (
            self.memory == other.memory
            and self.partitions[0] <= other.partitions[0] and other.partitions[1] <= self.partitions[1]
            and self.free_bytes[0] <= other.free_bytes[0] and other.free_bytes[1] <= self.free_bytes[1]
        )


@dataclass(frozen=True)
class InstructionRecord:
    """One executed instruction. ``engine`` is one of tensor, vector, scalar, gpsimd, dma, sync."""

    name: str  # ISA name, e.g. "nc_matmul", "tensor_tensor", "dma_copy", "activation"
    engine: str
    dst: OperandInfo | None
    srcs: tuple[OperandInfo, ...] = ()
    # Instruction attributes the cost formulas depend on, e.g. {"op": "add"}, {"accumulate": True},
    # {"reduce": True} for activation_reduce, {"dge_mode": "hwdge"}, {"indirect": True}.
    attrs: dict = field(default_factory=dict, compare=False, hash=False)
    flops: int = 0  # useful floating point operations (2*M*N*K for a matmul, one per element for elementwise)
    # Memory the instruction reads and writes (empty for hand-built records: no dependencies are known then).
    reads: tuple[Region, ...] = field(default=(), compare=False)
    writes: tuple[Region, ...] = field(default=(), compare=False)
    program: int = 0  # the LNC program (NeuronCore) that ran it: 0, or 0 and 1 with lnc=2
    # The kernel-source function it ran in, below the launched kernel: a region kernel's subkernel (the kernel
    # it was rendered from), or the launched kernel itself; "" for kernels not loaded from source text.
    section: str = field(default="", compare=False)

"""Simulator stage: the instruction trace, the contract between the interpreter and the cost model.

Every simulated ISA instruction (``nki.isa.*``, and the ``nki.language`` wrappers through the instructions they
lower to) appends one ``InstructionRecord`` to the running kernel's trace. The cost model (cost.py) turns a
trace into cycles per engine, time, bytes and FLOPs; it never sees numpy arrays, only these descriptors.
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

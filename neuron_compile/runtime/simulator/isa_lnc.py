"""Simulator stage: the instructions between the two NeuronCores of an LNC=2 launch (core_barrier, sendrecv).

Input: a shared HBM tensor (core_barrier) or an SBUF tile to send and one to receive into (sendrecv). Output:
the programs synchronized through the launch's lnc.ProgramGroup (a barrier; an exchange of tiles), every
documented rule checked (NkiValidationError naming the rule), one InstructionRecord each. With a single program
a core barrier has no one to wait for and passes; a sendrecv has no peer and is an error.
"""

from __future__ import annotations

import numpy as np

from neuron_compile.runtime.simulator.errors import NkiValidationError
from neuron_compile.runtime.simulator.lnc import program_group
from neuron_compile.runtime.simulator.memory import current
from neuron_compile.runtime.simulator.rules import (
    check_tile,
    engine_name,
    record,
    require_buffers,
    require_tensor,
    require_version,
    store,
)

# gpsimd_dma sendrecv: most bytes per partition, by element size
GPSIMD_DMA_BYTES = {4: 1024, 2: 512, 1: 256}


def core_barrier(data, cores, engine=None, name=None):
    """Every core of ``cores`` (only (0, 1)) waits here until all have arrived: their writes into the shared
    HBM tensor ``data`` before the barrier are visible to all after it."""
    op = "core_barrier"
    require_version(op, "gen3")
    data = require_tensor(op, "data", data)
    require_buffers(op, "data", data, ("hbm",), "err_core_barrier_data")
    if tuple(cores) != (0, 1):
        raise NkiValidationError("err_core_barrier_cores", f"cores must be (0, 1), got {cores!r}", op)
    group = program_group()
    if group is not None:
        group.sync(current().program_id, "core_barrier")
    record(op, engine_name(engine, "gpsimd"), None, [("data", data)], {"programs": current().num_programs})


def _check_sendrecv_tiles(op: str, src, dst, dma_engine) -> None:
    for role, tile in (("src", src), ("dst", dst)):
        require_buffers(op, role, tile, ("sbuf",), "err_sendrecv_buffer")
        check_tile(op, role, tile, compute=False)
    if src.dtype != dst.dtype or src.shape != dst.shape:
        raise NkiValidationError(
            "err_sendrecv_shape", f"src {src.shape} {src.dtype.name} and dst {dst.shape} {dst.dtype.name} must share "
            "shape and dtype", op,
        )
    if getattr(dma_engine, "name", dma_engine) == "gpsimd_dma":
        limit = GPSIMD_DMA_BYTES.get(src.itemsize, 0)
        if src.free_size * src.itemsize > limit:
            raise NkiValidationError(
                "err_sendrecv_gpsimd_dma_size", f"{src.free_size * src.itemsize} bytes per partition; the GpSimd DMA "
                f"moves at most {limit} of {src.dtype.name}", op,
            )


def sendrecv(src, dst, send_to_rank, recv_from_rank, pipe_id, dma_engine=None, name=None):
    """Send ``src`` to core ``send_to_rank`` while receiving core ``recv_from_rank``'s tile into ``dst``; the
    sendrecvs of one ``pipe_id`` complete together."""
    op = "sendrecv"
    require_version(op, "gen3")
    src, dst = require_tensor(op, "src", src), require_tensor(op, "dst", dst)
    _check_sendrecv_tiles(op, src, dst, dma_engine)
    context, group = current(), program_group()
    for role, rank in (("send_to_rank", send_to_rank), ("recv_from_rank", recv_from_rank)):
        if rank not in (0, 1) or group is None:
            raise NkiValidationError(
                "err_sendrecv_rank", f"{role} {rank!r}: sendrecv exchanges tiles between cores 0 and 1 of an LNC=2 "
                f"launch (this launch has {context.num_programs} program)", op,
            )
    sent = np.array(src.read())
    payloads = group.sync(context.program_id, f"sendrecv pipe {pipe_id}", (int(send_to_rank), sent))
    sender = payloads.get(int(recv_from_rank))
    if sender is None or sender[0] != context.program_id:
        raise NkiValidationError(
            "err_sendrecv_pairing", f"program {context.program_id} receives from {recv_from_rank}, which sends to "
            f"{None if sender is None else sender[0]}", op,
        )
    if sender[1].shape != dst.shape:
        raise NkiValidationError("err_sendrecv_shape", f"received {sender[1].shape} into dst {dst.shape}", op)
    store(dst, sender[1])
    record(op, "dma", dst, [("src", src)], {"dma_engine": getattr(dma_engine, "name", dma_engine) or "dma"},
           hbm_partitions=dst.partitions)

"""Simulator stage: ``nki.collectives`` — collective communication between ranks, run through torch.distributed.

Input: calls from kernel text (``import nki.collectives as ncc``, then ``ncc.all_reduce(srcs=[x], dsts=[out],
replica_group=ncc.ReplicaGroup([[0, 1]]), op=nl.add)`` ...) with HBM tensors, as the official API stubs define
them: ``all_reduce(srcs, dsts, replica_group, op)``, ``all_gather(srcs, dsts, replica_group, collective_dim)``,
``reduce_scatter(srcs, dsts, replica_group, collective_dim, op)``, ``all_to_all(srcs, dsts, replica_group,
collective_dim)``, ``rank_id()``. Output: the ``dsts`` written with the real result of the collective across the
processes of the running torch.distributed job, and one ``CollectiveRecord`` per call in the running kernel's
context (``KernelRun.collectives``), which the communication model (comm_cost.py) prices.

Each rank runs the same kernel in its own process; a collective call blocks until every rank of its rank-list
made the matching call, as on the device. The rank-list containing this process's rank must be the ranks of a
process group torch.distributed knows (the world, or one made by ``new_group``): the simulator executes the call
on that group with the gloo (or any) backend. Values travel as fp32 (ints as int32) and are rounded to the
destination's dtype, as the simulator's engines compute in fp32.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.distributed as dist

from neuron_compile.runtime.simulator import rules
from neuron_compile.runtime.simulator.errors import NkiValidationError
from neuron_compile.runtime.simulator.memory import current
from neuron_compile.runtime.simulator.tensor import NkiTensor

# NKI reduction operators (nl.add, nl.maximum, nl.minimum) by name -> torch.distributed's.
REDUCE_OPS = {"add": dist.ReduceOp.SUM, "maximum": dist.ReduceOp.MAX, "minimum": dist.ReduceOp.MIN}


@dataclasses.dataclass(frozen=True)
class CollectiveRecord:
    """One executed collective: what it was, how many ranks took part, and the bytes each rank's input holds
    (``bytes``) and its output holds (``output_bytes``)."""

    name: str
    ranks: int
    bytes: int
    output_bytes: int


@dataclasses.dataclass
class ReplicaGroup:
    """The ranks a collective runs on, as a list of rank-lists (each runs the collective independently)."""

    groups: list

    def rank_list(self, rank: int) -> tuple[int, ...]:
        for ranks in self.groups:
            if rank in ranks:
                return tuple(int(r) for r in ranks)
        raise NkiValidationError("err_collective_rank", f"rank {rank} is in no rank-list of {self.groups}")


def rank_id() -> int:
    """This process's rank in the torch.distributed job."""
    _require_process_group("rank_id")
    return dist.get_rank()


def _require_process_group(name: str) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise NkiValidationError(
            "err_collective_no_process_group",
            "collectives run across the processes of a torch.distributed job: call "
            "torch.distributed.init_process_group first", op=name)


def _process_group(replica_group: ReplicaGroup, name: str):
    """The torch.distributed group whose ranks are this rank's rank-list of ``replica_group``."""
    _require_process_group(name)
    ranks = replica_group.rank_list(dist.get_rank())
    if sorted(ranks) == list(range(dist.get_world_size())):
        return dist.group.WORLD, len(ranks)
    # torch keeps every group it created with its ranks; there is no public way to list them
    for group, members in dist.distributed_c10d._world.pg_group_ranks.items():
        if sorted(members) == sorted(ranks):
            return group, len(ranks)
    raise NkiValidationError("err_collective_group", f"no torch.distributed process group has the ranks {ranks}",
                             op=name)


def _check_lists(srcs, dsts, name: str) -> list[tuple[NkiTensor, NkiTensor]]:
    if not isinstance(srcs, (list, tuple)) or not isinstance(dsts, (list, tuple)) or len(srcs) != len(dsts):
        raise NkiValidationError("err_collective_operands", "srcs and dsts must be lists of equal length", op=name)
    pairs = list(zip(srcs, dsts))
    for src, dst in pairs:
        if not isinstance(src, NkiTensor) or not isinstance(dst, NkiTensor):
            raise NkiValidationError("err_collective_operands", "srcs and dsts hold NKI tensors", op=name)
        if src.dtype != dst.dtype:
            raise NkiValidationError("err_collective_dtype", f"src {src.dtype} and dst {dst.dtype} differ", op=name)
    memories = {tensor.on_chip for pair in pairs for tensor in pair}
    if len(memories) > 1:
        raise NkiValidationError("err_collective_memory", "tensors must be all on HBM or all on SBUF", op=name)
    if len(pairs) > 1 and memories == {True}:
        raise NkiValidationError("err_collective_coalesced", "several tensors in one call need HBM", op=name)
    return pairs


def _check_dim(collective_dim: int, name: str) -> None:
    if collective_dim != 0:
        raise NkiValidationError("err_collective_dim", f"collective_dim must be 0, got {collective_dim}", op=name)


def _reduce_op(op, name: str):
    key = getattr(op, "name", None)
    if key not in REDUCE_OPS:
        raise NkiValidationError("err_collective_op", f"op must be nl.add, nl.maximum or nl.minimum, got {op!r}",
                                 op=name)
    return REDUCE_OPS[key]


def _as_torch(tensor: NkiTensor) -> torch.Tensor:
    """The tensor's values, flat (dim-0 chunks of a row-major tensor are flat chunks), in fp32 or int32."""
    values = np.asarray(tensor.read())
    wide = np.float32 if np.issubdtype(values.dtype, np.floating) or values.dtype.name == "bfloat16" else np.int32
    return torch.from_numpy(np.ascontiguousarray(values.astype(wide)).reshape(-1))


def _write(dst: NkiTensor, values: torch.Tensor) -> None:
    dst.write(values.numpy().reshape(dst.shape).astype(dst.dtype))


def _check_sizes(got: int, want: int, what: str, name: str) -> None:
    if got != want:
        raise NkiValidationError("err_collective_shape", f"{what}: {got} elements, expected {want}", op=name)


def _record(name: str, ranks: int, pairs) -> None:
    """Note the call for the cost model: one ``CollectiveRecord`` for the launch's communication figures, and one
    trace instruction per (src, dst) pair on the ``collective`` queue, reading src and writing dst, so the
    schedule runs it beside compute and makes only its readers wait."""
    record = CollectiveRecord(name, ranks, sum(src.size * src.itemsize for src, _ in pairs),
                              sum(dst.size * dst.itemsize for _, dst in pairs))
    context = current()
    if context.num_programs > 1:
        raise NkiValidationError("err_collective_lnc", "collectives are simulated for lnc=1 launches only", op=name)
    context.collectives.append(record)
    for src, dst in pairs:
        attrs = {"collective": name, "ranks": ranks, "input_bytes": src.size * src.itemsize,
                 "output_bytes": dst.size * dst.itemsize}
        rules.record(f"collective_{name}", "collective", dst, [("src", src)], attrs)


def all_reduce(srcs, dsts, replica_group: ReplicaGroup, op, priority=None, name=None) -> None:
    """Every dst = the reduction (``op``) of its src over the ranks of the rank-list."""
    pairs = _check_lists(srcs, dsts, "all_reduce")
    reduce = _reduce_op(op, "all_reduce")
    group, ranks = _process_group(replica_group, "all_reduce")
    for src, dst in pairs:
        _check_sizes(dst.size, src.size, "all_reduce dst", "all_reduce")
        values = _as_torch(src)
        dist.all_reduce(values, op=reduce, group=group)
        _write(dst, values)
    _record("all_reduce", ranks, pairs)


def all_gather(srcs, dsts, replica_group: ReplicaGroup, collective_dim: int, priority=None, name=None) -> None:
    """Every dst = the srcs of the rank-list's ranks, concatenated along dim 0 in rank order."""
    pairs = _check_lists(srcs, dsts, "all_gather")
    _check_dim(collective_dim, "all_gather")
    group, ranks = _process_group(replica_group, "all_gather")
    for src, dst in pairs:
        _check_sizes(dst.size, src.size * ranks, "all_gather dst", "all_gather")
        values = _as_torch(src)
        gathered = torch.empty(ranks * values.numel(), dtype=values.dtype)
        dist.all_gather_single(gathered, values, group=group)
        _write(dst, gathered)
    _record("all_gather", ranks, pairs)


def reduce_scatter(srcs, dsts, replica_group: ReplicaGroup, collective_dim: int, op, priority=None,
                   name=None) -> None:
    """Every dst = this rank's dim-0 chunk of the reduction (``op``) of the srcs over the rank-list."""
    pairs = _check_lists(srcs, dsts, "reduce_scatter")
    _check_dim(collective_dim, "reduce_scatter")
    reduce = _reduce_op(op, "reduce_scatter")
    group, ranks = _process_group(replica_group, "reduce_scatter")
    for src, dst in pairs:
        _check_sizes(src.size, dst.size * ranks, "reduce_scatter src", "reduce_scatter")
        values = _as_torch(src)
        chunk = torch.empty(values.numel() // ranks, dtype=values.dtype)
        dist.reduce_scatter_single(chunk, values, op=reduce, group=group)
        _write(dst, chunk)
    _record("reduce_scatter", ranks, pairs)


def all_to_all(srcs, dsts, replica_group: ReplicaGroup, collective_dim: int, priority=None, name=None) -> None:
    """Every src split in equal dim-0 chunks, chunk j sent to rank j; dst = the chunks received, in rank order."""
    pairs = _check_lists(srcs, dsts, "all_to_all")
    _check_dim(collective_dim, "all_to_all")
    group, ranks = _process_group(replica_group, "all_to_all")
    for src, dst in pairs:
        _check_sizes(dst.size, src.size, "all_to_all dst", "all_to_all")
        if src.size % ranks:
            raise NkiValidationError("err_collective_shape", f"all_to_all: {src.size} elements do not split in "
                                     f"{ranks} equal chunks", op="all_to_all")
        values = _as_torch(src)
        received = torch.empty_like(values)
        dist.all_to_all_single(received, values, group=group)
        _write(dst, received)
    _record("all_to_all", ranks, pairs)


__all__ = ["CollectiveRecord", "ReplicaGroup", "all_gather", "all_reduce", "all_to_all", "rank_id", "reduce_scatter"]

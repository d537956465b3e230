"""User API, before compile: fully sharded data parallel whose collectives are in the traced graph.

FSDP2's ``fully_shard`` gathers parameters and reduce-scatters gradients in module hooks, and torch 2.13 no
longer lets Dynamo trace those hooks: a compiled FSDP2 layer runs its collectives eagerly, outside our kernels.
``fully_shard_in_graph`` shards the same way (each rank keeps a dim-0 shard of every parameter, as a DTensor) but
gathers through a parametrization: reading ``module.weight`` redistributes the shard to a replicated tensor, so
Dynamo traces an ``all_gather_into_tensor`` into the forward graph, and autograd's transpose of it, a
``reduce_scatter_tensor`` of the gradient (averaged over the ranks, as FSDP2 and DDP do), into the backward graph.
Our backend lowers both to collective kernels, and the cost model overlaps them with compute.

With ``reshard_after_forward`` (the default, FSDP2's too) the gather runs under activation checkpointing, so the
backward gathers again instead of keeping every full parameter alive between forward and backward; the
partitioner recomputes a collective only inside such a user-annotated region.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.nn.utils import parametrize
from torch.utils.checkpoint import checkpoint


class GatherShard(torch.nn.Module):
    """The parametrization: a parameter's shard (a DTensor) in, the full parameter (a plain tensor) out. Its
    gradient is a partial sum on every rank, averaged into the shard's placement: a reduce-scatter for a dim-0
    shard, an all-reduce for a replicated scalar."""

    def __init__(self, mesh: DeviceMesh, reshard_after_forward: bool):
        super().__init__()
        self.mesh = mesh
        self.reshard_after_forward = reshard_after_forward

    def gather(self, shard: DTensor) -> torch.Tensor:
        replicated = shard.redistribute(self.mesh, [Replicate()])
        return replicated.to_local(grad_placements=[Partial("avg")])

    def forward(self, shard: DTensor) -> torch.Tensor:
        if self.reshard_after_forward and torch.is_grad_enabled() and shard.requires_grad:
            return checkpoint(self.gather, shard, use_reentrant=False)
        return self.gather(shard)


def fully_shard_in_graph(model: torch.nn.Module, mesh: DeviceMesh | None = None, *,
                         reshard_after_forward: bool = True) -> torch.nn.Module:
    """Shard every parameter of ``model`` over ``mesh`` (default: one dimension over the default process group's
    ranks), in place, and return ``model``. Compile it whole afterwards (``torch.compile(model, backend="neuron")``);
    build the optimizer over ``model.parameters()`` afterwards too (they are the shards). Tied parameters stay tied.
    Each rank should compute the mean loss of its own slice of the global batch: the gradients are averaged."""
    if mesh is None:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if mesh.ndim != 1:
        raise ValueError(f"fully_shard_in_graph shards over a 1-D mesh, got a {mesh.ndim}-D one; pass the "
                         f"data-parallel dimension, e.g. mesh['dp']")
    shards: dict[int, torch.nn.Parameter] = {}  # id(full parameter) -> its shard, so tied parameters stay tied
    for module in list(model.modules()):
        for name, full in list(module.named_parameters(recurse=False)):
            if isinstance(full, DTensor):
                raise ValueError(f"parameter {name!r} of {type(module).__name__} is already a DTensor (sharded "
                                 f"by another parallelism); fully_shard_in_graph shards plain parameters only")
            if id(full) not in shards:
                placement = Shard(0) if full.dim() > 0 else Replicate()
                shard = distribute_tensor(full.detach(), mesh, [placement])
                shards[id(full)] = torch.nn.Parameter(shard, requires_grad=full.requires_grad)
            del module._parameters[name]
            module.register_parameter(name, shards[id(full)])
            parametrize.register_parametrization(module, name, GatherShard(mesh, reshard_after_forward),
                                                 unsafe=True)
    return model


def gathered_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state dict under its unsharded names with full tensors (every rank gets all of it): what
    ``save_pretrained(state_dict=...)`` or ``torch.save`` of an unsharded checkpoint wants."""
    state = {key: value for key, value in model.state_dict().items() if ".parametrizations." not in key}
    with torch.no_grad():
        for prefix, module in model.named_modules():
            for name in getattr(module, "parametrizations", {}):
                state[f"{prefix}.{name}" if prefix else name] = getattr(module, name).detach().clone()
    return state

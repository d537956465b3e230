"""Test helper: run a function on several CPU processes joined by torch.distributed (gloo, a FileStore), and the
distributed workloads the tests and the bench run: one functional all_reduce graph, a tiny random Llama under
tensor parallelism (``parallelize_module``), and FSDP2 (``fully_shard``) training of it with compiled layers.

``run_ranks(worker, world_size, *args)`` spawns the ranks, calls ``worker(rank, world_size, *args)`` in each and
returns their results in rank order (each must be picklable by ``torch.save``). Nothing is downloaded.
"""

from __future__ import annotations

import copy
import datetime
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RANK_TIMEOUT = datetime.timedelta(seconds=300)  # a rank that waits longer on a collective fails instead of hanging
TINY_LLAMA = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=64)


def gloo_available() -> bool:
    return dist.is_available() and dist.is_gloo_available()


def _rank_entry(rank: int, worker, world_size: int, init_file: str, out_dir: str, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=RANK_TIMEOUT)
    try:
        result = worker(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        # both ranks done before either tears its gloo connections down: a rank destroying its group while the
        # other still has one open aborted the other ("terminate called without an active exception") in CI
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(worker, world_size: int, *args) -> list:
    """``worker(rank, world_size, *args)`` on ``world_size`` spawned processes; their results in rank order."""
    with tempfile.TemporaryDirectory() as folder:
        init_file = os.path.join(folder, "store")
        mp.spawn(_rank_entry, args=(worker, world_size, init_file, folder, args), nprocs=world_size, join=True)
        return [torch.load(os.path.join(folder, f"rank{rank}.pt"), weights_only=False) for rank in range(world_size)]


def neuron_stats() -> dict:
    import neuron_compile

    stats = neuron_compile.stats()
    keys = ("kernels_launched", "nki_nodes", "fallback_nodes", "collectives", "collective_bytes", "est_comm_s",
            "est_comm_overlap_s", "est_time_s")
    return {key: stats[key] for key in keys} | {"fallback_reasons": dict(stats["fallback_reasons"])}


# ---------------------------------------------------------------- one all_reduce graph


def smoke(rank: int, world_size: int) -> dict:
    """The fast test's workloads in one spawn: ``all_reduce_graph``, ``every_collective_graph``, and the process
    groups a graph's collectives name, as the on-disk cache key records them."""
    from neuron_compile import process_groups

    def collective(x):
        return torch.ops._c10d_functional.all_reduce.default(x, "sum", dist.group.WORLD.group_name)

    groups = process_groups.graph_groups(torch.fx.symbolic_trace(collective))
    return dict(all_reduce=all_reduce_graph(rank, world_size), every=every_collective_graph(rank, world_size),
                overlap=overlapping_graph(rank, world_size), groups=groups, group_name=dist.group.WORLD.group_name,
                tensor_parallel=tensor_parallel_mlp(rank, world_size), fsdp=fsdp_mlp_step(rank, world_size),
                in_graph_fsdp={reshard: in_graph_fsdp_mlp_steps(rank, world_size, reshard)
                               for reshard in (True, False)},
                one_rank=every_collective_graph(rank, world_size, group=own_group(rank, world_size)))


def own_group(rank: int, world_size: int):
    """A process group of this rank alone (every rank creates every rank's, as new_group requires)."""
    groups = [dist.new_group([other]) for other in range(world_size)]
    return groups[rank]


class TwoLayerMLP(torch.nn.Module):
    """A transformers-free block for the fast tests: ``down(gelu(up(x)))``."""

    def __init__(self, width: int = 32, hidden: int = 64):
        super().__init__()
        self.up = torch.nn.Linear(width, hidden)
        self.down = torch.nn.Linear(hidden, width)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


def tensor_parallel_mlp(rank: int, world_size: int) -> dict:
    """A column-parallel up and row-parallel down projection (``parallelize_module``) compiled with
    backend="neuron", and the whole block run eagerly in one process."""
    import neuron_compile
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    reference = TwoLayerMLP()
    model = parallelize_module(copy.deepcopy(reference), init_device_mesh("cpu", (world_size,)),
                               {"up": ColwiseParallel(), "down": RowwiseParallel()})
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(3))
    neuron_compile.reset_stats()
    with torch.no_grad():
        compiled = torch.compile(model, backend="neuron")(x)
    return dict(compiled=compiled, expected=reference(x).detach(), stats=neuron_stats())


def fsdp_mlp_step(rank: int, world_size: int) -> dict:
    """One AdamW step of two blocks, each ``fully_shard``-ed and compiled with backend="neuron" (then the root
    sharded), each rank on its slice of the batch; and of the whole model on the whole batch in one process.
    The full gradients of both (FSDP2's are reduce-scattered across the ranks), and the stats."""
    import neuron_compile
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    reference = torch.nn.Sequential(TwoLayerMLP(), TwoLayerMLP())
    model = copy.deepcopy(reference)
    for block in model:
        fully_shard(block)
        block.compile(backend="neuron")
    fully_shard(model)
    batch = torch.randn(4 * world_size, 32, generator=torch.Generator().manual_seed(5))
    neuron_compile.reset_stats()
    gradients = {}
    for name, net, inputs in (("fsdp", model, batch.chunk(world_size)[rank]), ("single", reference, batch)):
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
        net(inputs).square().mean().backward()
        gradients[name] = {key: (param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad).clone()
                           for key, param in net.named_parameters()}
        optimizer.step()
    return dict(gradients=gradients, stats=neuron_stats())


def in_graph_fsdp_mlp_steps(rank: int, world_size: int, reshard_after_forward: bool = True,
                            steps: int = 2) -> dict:
    """``steps`` AdamW steps of two blocks sharded by ``fully_shard_in_graph`` and compiled whole with
    backend="neuron" (each rank on its slice of the batch), and of the whole model eagerly on the whole batch in
    one process: the global losses of both, their parameters at the end, and the stats."""
    import neuron_compile
    from neuron_compile.in_graph_fsdp import fully_shard_in_graph, gathered_state_dict

    torch.manual_seed(0)
    single = torch.nn.Sequential(TwoLayerMLP(), TwoLayerMLP())
    model = fully_shard_in_graph(copy.deepcopy(single), reshard_after_forward=reshard_after_forward)
    compiled = torch.compile(model, backend="neuron")
    batch = torch.randn(4 * world_size, 32, generator=torch.Generator().manual_seed(5))
    optimizers = {"sharded": torch.optim.AdamW(model.parameters(), lr=1e-2),
                  "single": torch.optim.AdamW(single.parameters(), lr=1e-2)}
    losses: dict[str, list[float]] = {"sharded": [], "single": []}
    neuron_compile.reset_stats()
    for _ in range(steps):
        for name, net, inputs in (("sharded", compiled, batch.chunk(world_size)[rank]), ("single", single, batch)):
            loss = net(inputs).square().mean()
            loss.backward()
            optimizers[name].step()
            optimizers[name].zero_grad()
            loss = loss.detach()
            if name == "sharded":
                dist.all_reduce(loss)  # the mean over equal slices is the mean over the batch
                loss /= world_size
            losses[name].append(float(loss))
    return dict(losses=losses, parameters={"sharded": gathered_state_dict(model), "single": single.state_dict()},
                stats=neuron_stats())


def overlapping_graph(rank: int, world_size: int) -> dict:
    """An all_reduce next to a matmul that does not read its result (as a tensor-parallel backward's weight
    gradient runs beside its input gradient's all_reduce), and a reader of both: compiled vs eager, the stats."""
    import torch.distributed._functional_collectives as funcol

    import neuron_compile

    def step(x, a, b):
        reduced = funcol.all_reduce(x * 2, "sum", dist.group.WORLD)
        product = a @ b
        return reduced, product, reduced.sum() + product.sum()

    generator = torch.Generator().manual_seed(rank)
    inputs = (torch.randn(128, 512, generator=generator), torch.randn(256, 256, generator=generator),
              torch.randn(256, 512, generator=generator))
    neuron_compile.reset_stats()
    with neuron_compile.record_launches() as launches:
        compiled = torch.compile(step, backend="neuron")(*inputs)
    return dict(compiled=compiled, eager=step(*inputs), stats=neuron_stats(),
                reports=[launch.report for launch in launches])


def all_reduce_graph(rank: int, world_size: int) -> dict:
    """``relu(all_reduce(x * 2) + 1)`` compiled with backend="neuron" vs eager; the kernels' texts."""
    import torch.distributed._functional_collectives as funcol

    import neuron_compile

    def step(x):
        return (funcol.all_reduce(x * 2, "sum", dist.group.WORLD) + 1).relu()

    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(rank)) - 0.5
    neuron_compile.reset_stats()
    with neuron_compile.record_launches() as launches:
        compiled = torch.compile(step, backend="neuron")(x)
    return dict(compiled=compiled, eager=step(x), stats=neuron_stats(),
                sources=[launch.source.source for launch in launches if launch.source is not None])


def uneven_all_to_all_graph(rank: int, world_size: int) -> dict:
    """An all_to_all_single with uneven splits (not lowered: it must run eagerly, with the reason counted)."""
    import torch.distributed._functional_collectives as funcol

    import neuron_compile

    inputs = [1] + [world_size + 1] * (world_size - 1)  # rank r sends inputs[j] rows to rank j
    outputs = [inputs[rank]] * world_size

    def step(x):
        return funcol.all_to_all_single(x * 2, outputs, inputs, dist.group.WORLD).relu()

    x = torch.randn(sum(inputs), 16, generator=torch.Generator().manual_seed(rank))
    neuron_compile.reset_stats()
    compiled = torch.compile(step, backend="neuron")(x)
    return dict(compiled=compiled, eager=step(x), stats=neuron_stats())


def mismatched_all_gather(rank: int, world_size: int) -> str:
    """The simulator's error for an all_gather whose destination is not world_size times its source."""
    from neuron_compile.runtime import simulator as nki
    from neuron_compile.runtime.simulator import collectives as ncc

    def kernel(x):
        out = nki.language.ndarray((x.shape[0],), dtype=x.dtype, buffer=nki.language.shared_hbm)
        ncc.all_gather(srcs=[x], dsts=[out], replica_group=ncc.ReplicaGroup([list(range(world_size))]),
                       collective_dim=0)
        return out

    try:
        nki.run_kernel(kernel, [torch.ones(8).numpy()])
    except nki.NkiValidationError as error:
        return str(error)
    return "no error"


def every_collective_graph(rank: int, world_size: int, dtype: torch.dtype = torch.float32, group=None) -> dict:
    """all_reduce (sum, avg, max), all_gather, reduce_scatter of a transposed (non-contiguous) view, all_to_all,
    between pointwise ops in one graph, compiled with backend="neuron" vs eager; over ``group`` (default: all
    ranks)."""
    import torch.distributed._functional_collectives as funcol

    import neuron_compile

    group = group or dist.group.WORLD

    def step(x):
        summed = funcol.all_reduce(x * 2, "sum", group)
        gathered = funcol.all_gather_tensor(summed + 1, 0, group)
        scattered = funcol.reduce_scatter_tensor(gathered.t().contiguous().t() * 0.5, "sum", 0, group)
        exchanged = funcol.all_to_all_single(scattered, None, None, group)
        averaged = funcol.all_reduce(exchanged - 1, "avg", group)
        return funcol.all_reduce(averaged, "max", group).relu(), averaged

    x = (torch.randn(4 * world_size, 6, generator=torch.Generator().manual_seed(rank)) + rank).to(dtype)
    neuron_compile.reset_stats()
    compiled = torch.compile(step, backend="neuron")(x)
    return dict(compiled=compiled, eager=step(x), stats=neuron_stats())


# ---------------------------------------------------------------- tiny Llama


def tiny_llama(seed: int = 0, **sizes):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**(TINY_LLAMA | sizes), attn_implementation="sdpa")
    return LlamaForCausalLM(config).eval()


def tensor_parallel_plan(model) -> None:
    """Column-parallel q/k/v, gate and up projections; row-parallel o and down projections (Megatron style)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}
    for layer in model.model.layers:
        parallelize_module(layer, mesh, plan)


def sequence_parallel_plan(model) -> None:
    """Tensor parallel with sequence parallel between the blocks (as torchtitan plans it): the embedding's output,
    the norms and the residual stream sharded along the sequence; attention and MLP inputs gathered to whole
    sequences, their row-parallel outputs reduce-scattered back to sequence shards; the LM head gathers. The
    sequence-sharded values stay DTensors (``use_local_output=False``): transformers derives positions and masks
    from the embedding's (global) shape."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    parallelize_module(model.model, mesh, {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False),
        "norm": SequenceParallel(),
    })
    parallelize_module(model, mesh, {"lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})
    gathered = PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                  desired_input_kwarg_layouts={"hidden_states": Replicate()})
    plan = {
        "input_layernorm": SequenceParallel(), "self_attn": gathered,
        "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }
    for layer in model.model.layers:
        parallelize_module(layer, mesh, plan)


def tensor_parallel_llama(rank: int, world_size: int, sequence_parallel: bool = False) -> dict:
    """Logits of the tiny Llama sharded over the ranks (tensor parallel, with sequence parallel if asked) and
    compiled with backend="neuron", and of the whole model run eagerly in one process."""
    import neuron_compile

    reference = tiny_llama()
    model = copy.deepcopy(reference)
    (sequence_parallel_plan if sequence_parallel else tensor_parallel_plan)(model)
    ids = torch.randint(0, TINY_LLAMA["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = reference(ids).logits
        neuron_compile.reset_stats()
        logits = torch.compile(model, backend="neuron")(ids).logits
    logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    return dict(logits=logits, expected=expected, stats=neuron_stats())


def tensor_parallel_llama_gradients(rank: int, world_size: int) -> dict:
    """Loss and full gradients of one forward and backward of the sharded tiny Llama compiled with
    backend="neuron" (the backward graph holds the column-parallel inputs' all_reduces), and of the whole model
    run eagerly in one process."""
    import neuron_compile

    reference = tiny_llama().train()
    model = copy.deepcopy(reference)
    tensor_parallel_plan(model)
    ids = torch.randint(0, TINY_LLAMA["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(7))
    neuron_compile.reset_stats()
    loss = torch.compile(model, backend="neuron")(ids, labels=ids).loss
    loss.backward()
    expected = reference(ids, labels=ids).loss
    expected.backward()
    gradients = {key: (param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad).detach()
                 for key, param in model.named_parameters()}
    return dict(loss=float(loss.detach()), expected=float(expected.detach()), gradients=gradients,
                expected_gradients={key: param.grad.detach() for key, param in reference.named_parameters()},
                stats=neuron_stats())


# ---------------------------------------------------------------- FSDP2 training


def _loss(model, ids) -> torch.Tensor:
    return model(ids, labels=ids).loss


def _sharded_llama(reference, backend: str | None):
    """A copy of ``reference`` with every decoder layer and the root ``fully_shard``-ed, each layer compiled with
    ``backend`` (None: eager), as torchtitan applies FSDP2 with compile."""
    from torch.distributed.fsdp import fully_shard

    model = copy.deepcopy(reference)
    for layer in model.model.layers:
        fully_shard(layer)
        if backend is not None:
            layer.compile(backend=backend)
    fully_shard(model)
    return model


def _train_step(model, optimizer, ids, gradients: dict | None = None) -> torch.Tensor:
    """One AdamW step; ``gradients`` (when given) receives each parameter's full gradient before the step."""
    loss = _loss(model, ids)
    loss.backward()
    if gradients is not None:
        gradients.update({key: (param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad).clone()
                          for key, param in model.named_parameters()})
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def _train_runs(runs: dict, optimizers: dict, rank: int, world_size: int, steps: int) -> tuple[dict, dict]:
    """``steps`` AdamW steps of every run: "single" on the whole global batch, the others on this rank's slice.
    Per run the global loss of each step and the full gradients of the first step."""
    batch = torch.randint(0, TINY_LLAMA["vocab_size"], (2 * world_size, 12),
                          generator=torch.Generator().manual_seed(11))
    local = batch.chunk(world_size)[rank]
    losses: dict[str, list[float]] = {name: [] for name in runs}
    first_gradients: dict[str, dict] = {name: {} for name in runs}
    for step in range(steps):
        for name, model in runs.items():
            gradients = first_gradients[name] if step == 0 else None
            loss = _train_step(model, optimizers[name], batch if name == "single" else local, gradients)
            if name != "single":
                dist.all_reduce(loss)  # the mean over equal slices is the mean over the batch
                loss /= world_size
            losses[name].append(float(loss))
    return losses, first_gradients


def fsdp_llama_training(rank: int, world_size: int, steps: int = 3) -> dict:
    """``steps`` AdamW steps of the tiny Llama three ways: FSDP2 with each layer compiled with backend="neuron",
    FSDP2 eagerly (each rank on its slice of the global batch), and the whole model eagerly on the whole batch in
    one process. Per step the global loss of each run; each run's full gradients of the first step; at the end each
    run's full parameters."""
    import neuron_compile

    single = tiny_llama().train()
    runs = {"neuron": _sharded_llama(single, "neuron"), "eager": _sharded_llama(single, None), "single": single}
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-2) for name, model in runs.items()}
    neuron_compile.reset_stats()
    losses, first_gradients = _train_runs(runs, optimizers, rank, world_size, steps)
    parameters = {name: {key: (param.full_tensor() if name != "single" else param).detach()
                         for key, param in model.named_parameters()} for name, model in runs.items()}
    return dict(losses=losses, parameters=parameters, first_gradients=first_gradients, stats=neuron_stats())


def unsharded_name(key: str) -> str:
    """A parameter's name in the plain model, from its name under torch.compile and a parametrization."""
    return key.removeprefix("_orig_mod.").replace(".parametrizations.", ".").removesuffix(".original")


def in_graph_fsdp_llama_training(rank: int, world_size: int, steps: int = 10) -> dict:
    """``steps`` AdamW steps of the tiny Llama with tied embeddings, sharded by ``fully_shard_in_graph`` and
    compiled whole with backend="neuron" (each rank on its slice of the global batch), and of the whole model
    eagerly on the whole batch in one process. Per step the global loss of both, the first step's full gradients,
    the stats and the gathered parameters at the end."""
    import neuron_compile
    from neuron_compile.in_graph_fsdp import fully_shard_in_graph, gathered_state_dict

    single = tiny_llama(tie_word_embeddings=True).train()
    sharded = fully_shard_in_graph(copy.deepcopy(single))
    runs = {"neuron": torch.compile(sharded, backend="neuron"), "single": single}
    optimizers = {"neuron": torch.optim.AdamW(sharded.parameters(), lr=1e-2),
                  "single": torch.optim.AdamW(single.parameters(), lr=1e-2)}
    neuron_compile.reset_stats()
    losses, first_gradients = _train_runs(runs, optimizers, rank, world_size, steps)
    first_gradients["neuron"] = {unsharded_name(key): value for key, value in first_gradients["neuron"].items()}
    return dict(losses=losses, first_gradients=first_gradients, stats=neuron_stats(),
                parameters={"neuron": gathered_state_dict(sharded), "single": single.state_dict()})


# ---------------------------------------------------------------- DDP training

# Dynamo's DDP optimizer cuts the graph after the first 1 MB of parameters (DDP's first bucket), then every
# bucket_cap_mb, and refuses buckets under 1 MB: a 1.4 MB Llama in 1 MB buckets gives it two pieces.
DDP_BUCKET_MB = 1
DDP_LLAMA = dict(hidden_size=128, intermediate_size=256, head_dim=32)


def ddp_llama_training(rank: int, world_size: int, steps: int = 10) -> dict:
    """``steps`` AdamW steps of the tiny Llama under DDP compiled whole with backend="neuron" (Dynamo's DDP
    optimizer splits the graph at the gradient buckets' boundaries, so the backend gets several graphs), and of
    DDP eagerly, and of the whole model eagerly on the whole batch in one process. Per step the global loss of
    each run, each run's gradients of the first step, and how many graphs the backend compiled."""
    import neuron_compile
    from torch.nn.parallel import DistributedDataParallel

    single = tiny_llama(**DDP_LLAMA).train()
    ddp = DistributedDataParallel(copy.deepcopy(single), bucket_cap_mb=DDP_BUCKET_MB)
    eager = DistributedDataParallel(copy.deepcopy(single), bucket_cap_mb=DDP_BUCKET_MB)
    runs = {"neuron": torch.compile(ddp, backend="neuron"), "eager": eager, "single": single}
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-2)
                  for name, model in (("neuron", ddp), ("eager", eager), ("single", single))}
    neuron_compile.reset_stats()
    losses, first_gradients = _train_runs(runs, optimizers, rank, world_size, steps)
    graphs = neuron_compile.stats()["graphs_compiled"]
    # the compiled and DDP runs name parameters under their wrappers (_orig_mod., module.)
    first_gradients = {name: {key.removeprefix("_orig_mod.").removeprefix("module."): value
                              for key, value in gradients.items()} for name, gradients in first_gradients.items()}
    return dict(losses=losses, first_gradients=first_gradients, stats=neuron_stats(), graphs=graphs)


def ddp_compiled_autograd_training(rank: int, world_size: int, steps: int = 3) -> dict:
    """DDP whose gradient all-reduces are collective kernels: the whole forward and backward compiled with
    backend="neuron", with compiled autograd and Dynamo's python reducer (``optimize_ddp="python_reducer"``), so
    DDP's all-reduces are functional collectives in the compiled backward instead of calls from its C++ reducer.
    ``steps`` AdamW steps against the whole model on the whole batch in one process: per step the global loss of
    both, the first step's gradients of both, and the stats of the compiled steps."""
    import neuron_compile
    from torch.nn.parallel import DistributedDataParallel

    single = tiny_llama(**DDP_LLAMA).train()
    with torch._dynamo.config.patch(optimize_ddp="python_reducer"):  # DDP picks its reducer when it is built
        ddp = DistributedDataParallel(copy.deepcopy(single))

    def forward_backward(ids):
        loss = _loss(ddp, ids)
        loss.backward()
        return loss.detach()

    batch = torch.randint(0, TINY_LLAMA["vocab_size"], (2 * world_size, 12), generator=torch.Generator().manual_seed(11))
    optimizers = {"neuron": torch.optim.AdamW(ddp.parameters(), lr=1e-2),
                  "single": torch.optim.AdamW(single.parameters(), lr=1e-2)}
    losses: dict[str, list[float]] = {"neuron": [], "single": []}
    first_gradients: dict[str, dict] = {}
    neuron_compile.reset_stats()
    with torch._dynamo.config.patch(optimize_ddp="python_reducer", compiled_autograd=True):
        compiled = torch.compile(forward_backward, backend="neuron")
        for step in range(steps):
            loss = compiled(batch.chunk(world_size)[rank])
            dist.all_reduce(loss)
            losses["neuron"].append(float(loss) / world_size)
            if step == 0:
                first_gradients["neuron"] = {key.removeprefix("module."): param.grad.clone()
                                             for key, param in ddp.named_parameters()}
            optimizers["neuron"].step()
            optimizers["neuron"].zero_grad()
            gradients = first_gradients.setdefault("single", {}) if step == 0 else None
            losses["single"].append(float(_train_step(single, optimizers["single"], batch, gradients)))
    return dict(losses=losses, first_gradients=first_gradients, stats=neuron_stats())


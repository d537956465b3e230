"""Distributed graphs through backend="neuron": collectives as kernels, on CPU processes joined by gloo.

Per world size (ranks are processes on this machine, a FileStore rendezvous) and workload, on rank 0:

- all_reduce: ``relu(all_reduce(x * 2) + 1)`` on an [8, 1024] fp32 tensor (functional collectives);
- TP forward: a random Llama (``--hidden``, ``--layers``) with ColwiseParallel q/k/v/gate/up and RowwiseParallel
  o/down projections (``parallelize_module``), one forward of a [2, 12] batch compiled whole;
- TP step: the same tensor-parallel Llama, one forward and backward with labels (the second; the first
  compiles): the backward's all_reduces of the column-parallel inputs' gradients may run beside other kernels;
- DDP step: the same Llama under DistributedDataParallel, forward and backward compiled together with compiled
  autograd and Dynamo's python reducer, so DDP's gradient all-reduces are collective kernels in the backward (the
  second step; each rank on its half of the batch);
- FSDP2 step: the same Llama, every decoder layer and the root ``fully_shard``-ed and each layer compiled, one
  AdamW step (the second; the first compiles). FSDP2's all-gathers and reduce-scatters run in its hooks, outside
  the compiled layers: they are eager torch.distributed calls, not kernels (collect. and bytes count none); their
  comm time is the ring model's for the parameter and gradient bytes they move (``fsdp_comm_s``), none hidden;
- FSDP in-graph: the same Llama sharded by ``neuron_compile.in_graph_fsdp.fully_shard_in_graph`` and compiled
  whole, one AdamW step (the second): every parameter's all-gather (again in the backward: resharded after the
  forward) and gradient reduce-scatter is a collective kernel in the compiled graphs, priced and overlapped by the
  cost model like the other kernels.

Columns: max |error| against the same model run eagerly in one process (TP: logits, TP step, DDP and FSDP2: the step's
loss; all_reduce: against eager on the ranks), kernels launched, collective kernels run (nki.collectives calls) and
the bytes of their inputs on the rank; then the cost model's estimate split in three: compute (the schedule
without the communication nothing hid), comm (the ring model's time for the collectives on trn2 links,
runtime/simulator/comm_cost.py: 320 GB/s per link and 5 us per ring step are assumptions), hidden (the part of comm
during which the same launch's compute ran: the schedule puts collectives on a queue of their own), est = compute +
comm - hidden (est_time_s); eager fallbacks (ATen and collective nodes that ran eagerly), and the wall time of the
run on this CPU.

    .venv/bin/python bench/distributed_bench.py
    .venv/bin/python bench/distributed_bench.py --world-sizes 2 4 --hidden 256 --layers 1
    .venv/bin/python bench/distributed_bench.py --world-sizes 1 2 4 --workloads "FSDP2 step" "FSDP in-graph" --hidden 2048 --layers 1
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

VOCAB = 96
HEAD_DIM = 16
STATS = ("kernels_launched", "collectives", "collective_bytes", "est_comm_s", "est_comm_overlap_s", "est_time_s",
         "fallback_nodes")


def llama(hidden: int, layers: int, world_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = max(4, hidden // HEAD_DIM // 4, world_size)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads, head_dim=hidden // heads,
                         max_position_embeddings=64, attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def snapshot(wall_s: float, error: float) -> dict:
    import neuron_compile

    stats = neuron_compile.stats()
    return {key: stats[key] for key in STATS} | {"wall_s": wall_s, "error": error}


def all_reduce_row(rank: int, world_size: int, hidden: int, layers: int) -> dict:
    import torch.distributed._functional_collectives as funcol

    import neuron_compile

    def step(x):
        return (funcol.all_reduce(x * 2, "sum", dist.group.WORLD) + 1).relu()

    x = torch.randn(8, 1024, generator=torch.Generator().manual_seed(rank))
    neuron_compile.reset_stats()
    start = time.perf_counter()
    out = torch.compile(step, backend="neuron")(x)
    return snapshot(time.perf_counter() - start, float((out - step(x)).abs().max()))


def parallelize(model, world_size: int) -> None:
    """Megatron-style tensor parallel over the ranks: q/k/v/gate/up column-parallel, o/down row-parallel."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world_size,))
    plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}
    for layer in model.model.layers:
        parallelize_module(layer, mesh, plan)


def tensor_parallel_row(rank: int, world_size: int, hidden: int, layers: int) -> dict:
    import neuron_compile

    reference = llama(hidden, layers, world_size).eval()
    model = copy.deepcopy(reference)
    parallelize(model, world_size)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = reference(ids).logits
        neuron_compile.reset_stats()
        start = time.perf_counter()
        logits = torch.compile(model, backend="neuron")(ids).logits
    return snapshot(time.perf_counter() - start, float((logits - expected).abs().max()))


def tensor_parallel_step_row(rank: int, world_size: int, hidden: int, layers: int) -> dict:
    """One forward and backward of the TP Llama (the second call; the first compiles): the backward's all_reduces
    of the column-parallel inputs' gradients can run beside the weight-gradient matmuls."""
    import neuron_compile

    reference = llama(hidden, layers, world_size).train()
    model = copy.deepcopy(reference)
    parallelize(model, world_size)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(7))
    compiled = torch.compile(model, backend="neuron")
    compiled(ids, labels=ids).loss.backward()
    model.zero_grad()
    neuron_compile.reset_stats()
    start = time.perf_counter()
    loss = compiled(ids, labels=ids).loss
    loss.backward()
    wall = time.perf_counter() - start
    expected = reference(ids, labels=ids).loss
    return snapshot(wall, abs(float(loss.detach()) - float(expected.detach())))


def ddp_row(rank: int, world_size: int, hidden: int, layers: int) -> dict:
    """DDP's all-reduces as collective kernels: forward and backward compiled together with compiled autograd and
    Dynamo's python reducer; the second step (the first compiles), its loss against one process on the batch."""
    import neuron_compile
    from torch.nn.parallel import DistributedDataParallel

    reference = llama(hidden, layers, world_size).train()
    with torch._dynamo.config.patch(optimize_ddp="python_reducer"):  # DDP picks its reducer when it is built
        ddp = DistributedDataParallel(copy.deepcopy(reference))

    def forward_backward(ids):
        loss = ddp(ids, labels=ids).loss
        loss.backward()
        return loss.detach()

    batch = torch.randint(0, VOCAB, (2 * world_size, 12), generator=torch.Generator().manual_seed(11))
    with torch._dynamo.config.patch(optimize_ddp="python_reducer", compiled_autograd=True):
        compiled = torch.compile(forward_backward, backend="neuron")
        compiled(batch.chunk(world_size)[rank])
        ddp.zero_grad()
        neuron_compile.reset_stats()
        start = time.perf_counter()
        loss = compiled(batch.chunk(world_size)[rank])
        wall = time.perf_counter() - start
    dist.all_reduce(loss)
    expected = reference(batch, labels=batch).loss
    return snapshot(wall, abs(float(loss) / world_size - float(expected.detach())))


def second_sharded_step(model, reference, rank: int, world_size: int) -> dict:
    """Two AdamW steps of the sharded ``model`` (each rank on its slice of the batch) beside ``reference`` on the
    whole batch in one process; the second step's snapshot (the first compiles), its loss against the reference's."""
    import neuron_compile

    batch = torch.randint(0, VOCAB, (2 * world_size, 12), generator=torch.Generator().manual_seed(11))
    local = batch.chunk(world_size)[rank]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(2):
        if step == 1:
            neuron_compile.reset_stats()
            start = time.perf_counter()
        loss = model(local, labels=local).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        expected = reference(batch, labels=batch).loss
        expected.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    wall = time.perf_counter() - start
    total = loss.detach().clone()
    dist.all_reduce(total)
    return snapshot(wall, abs(float(total) / world_size - float(expected.detach())))


def fsdp_row(rank: int, world_size: int, hidden: int, layers: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    reference = llama(hidden, layers, world_size).train()
    model = copy.deepcopy(reference)
    for layer in model.model.layers:
        fully_shard(layer)
        layer.compile(backend="neuron")
    fully_shard(model)
    row = second_sharded_step(model, reference, rank, world_size)
    comm_s = fsdp_comm_s(reference, world_size)
    return row | {"est_comm_s": comm_s, "est_comm_overlap_s": 0.0, "est_time_s": row["est_time_s"] + comm_s}


def in_graph_fsdp_row(rank: int, world_size: int, hidden: int, layers: int) -> dict:
    """Fully sharded with the collectives in the graph (``fully_shard_in_graph``), the model compiled whole."""
    from neuron_compile.in_graph_fsdp import fully_shard_in_graph

    reference = llama(hidden, layers, world_size).train()
    model = fully_shard_in_graph(copy.deepcopy(reference))
    return second_sharded_step(torch.compile(model, backend="neuron"), reference, rank, world_size)


def fsdp_comm_s(model, world_size: int) -> float:
    """The ring model's time for the collectives FSDP2's hooks run in one step (eagerly, not as kernels): per
    decoder layer an all-gather of its parameters in the forward and again in the backward (resharded after the
    forward) and a reduce-scatter of its gradients; the root's parameters (embedding, norm, head) gathered once
    and reduced once. Counted as not overlapped: FSDP2's prefetching would hide part of it."""
    from neuron_compile.runtime.simulator import comm_cost

    def gather_and_reduce(nbytes: int, gathers: int) -> float:
        return (gathers * comm_cost.collective_time_s("all_gather", world_size, nbytes // world_size, nbytes)
                + comm_cost.collective_time_s("reduce_scatter", world_size, nbytes, nbytes // world_size))

    layer_bytes = [sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in model.model.layers]
    root_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) - sum(layer_bytes)
    return sum(gather_and_reduce(nbytes, 2) for nbytes in layer_bytes) + gather_and_reduce(root_bytes, 1)


WORKLOADS = {"all_reduce": all_reduce_row, "TP forward": tensor_parallel_row, "TP step": tensor_parallel_step_row,
             "DDP step": ddp_row, "FSDP2 step": fsdp_row, "FSDP in-graph": in_graph_fsdp_row}


def rank_entry(rank: int, world_size: int, init_file: str, out_dir: str, workload: str, hidden: int,
               layers: int) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=900))
    try:
        row = WORKLOADS[workload](rank, world_size, hidden, layers)
        torch.save(row, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run(world_size: int, workload: str, hidden: int, layers: int) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(rank_entry, args=(world_size, os.path.join(folder, "store"), folder, workload, hidden, layers),
                 nprocs=world_size, join=True)
        return torch.load(os.path.join(folder, "rank0.pt"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    header = (f"{'ranks':>5}  {'workload':<13} {'model':<10} {'max err':>9} {'kernels':>7} {'collect.':>8} "
              f"{'bytes':>9} {'compute us':>10} {'comm us':>8} {'hidden us':>9} {'est us':>8} {'fallbacks':>9} "
              f"{'wall s':>7}")
    print(header)
    print("-" * len(header))
    for world_size in args.world_sizes:
        for workload in args.workloads:
            row = run(world_size, workload, args.hidden, args.layers)
            model = "x[8,1024]" if workload == "all_reduce" else f"h{args.hidden} L{args.layers}"
            exposed = row["est_comm_s"] - row["est_comm_overlap_s"]
            print(f"{world_size:>5}  {workload:<13} {model:<10} {row['error']:>9.2e} {row['kernels_launched']:>7} "
                  f"{row['collectives']:>8} {row['collective_bytes']:>9} {(row['est_time_s'] - exposed) * 1e6:>10.1f} "
                  f"{row['est_comm_s'] * 1e6:>8.1f} {row['est_comm_overlap_s'] * 1e6:>9.1f} "
                  f"{row['est_time_s'] * 1e6:>8.1f} {row['fallback_nodes']:>9} {row['wall_s']:>7.1f}", flush=True)


if __name__ == "__main__":
    main()

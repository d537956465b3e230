"""Training steps of tiny causal LMs through backend="neuron", side by side with eager in one run.

Per model (tiny Llama, Qwen3, Gemma3; random weights from a config) and dtype (fp32; bf16 = bf16 parameters,
gradients and AdamW state): the same AdamW steps on the same batches, eager and compiled, and per step:

- loss: the largest relative difference of the compiled loss from eager's over the steps;
- ATen nodes of the forward, the backward and (``--compile-optimizer``) the optimizer's graph that run in NKI
  kernels (the rest run eagerly);
- compiles: Dynamo graphs / aot_autograd graphs / shape signatures compiled over all steps;
- est trn2: the simulator cost model's estimated device time of one steady step (the sum of est_time_s over
  its kernel launches; eager nodes and the eager optimizer add nothing to it), against the step's roofline:
  max(FLOPs at TensorE peak, bytes over DMA bandwidth), FLOPs of forward + backward from
  torch.utils.flop_counter.FlopCounterMode, bytes = parameters + gradients + AdamW state (read and written
  once) + saved activations (written by the forward, read by the backward);
- saved activations: the bytes the forward keeps for the backward (parameters excluded; the tensors autograd
  saves, seen through torch.autograd.graph.saved_tensors_hooks), compiled (what aot_autograd's min-cut
  partitioner chose to save) and eager;
- wall time of a steady step (median over steps after the first), compiled and eager (the simulator runs on
  this CPU).

``--compile-optimizer`` also compiles ``optimizer.step`` (AdamW, ``foreach=True``: its ``_foreach_*`` ops become
kernels too) in the compiled run; without it the optimizer runs eagerly in both runs and adds nothing to the
estimate.

    .venv/bin/python bench/train_bench.py
    .venv/bin/python bench/train_bench.py --models llama --dtypes fp32 --steps 3 --compile-optimizer
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings

import torch
from torch.utils.flop_counter import FlopCounterMode

import neuron_compile
from neuron_compile.hardware import get_target

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
)
MODELS = {"llama": "llama", "qwen3": "qwen3", "gemma3": "gemma3_text"}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _model(model_type: str, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **TINY)
    return AutoModelForCausalLM.from_config(config).to(dtype).train()


def _batches(steps: int, batch: int, seq: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, TINY["vocab_size"], (batch, seq), generator=generator) for _ in range(steps)]


def _run(model, batches, compiled: bool, compile_optimizer: bool = False):
    """(loss per step, wall seconds per step, estimated trn2 seconds per step, the model as run) of AdamW steps
    over ``batches``; ``compile_optimizer`` compiles the optimizer's step too (in the compiled run)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    run = torch.compile(model, backend="neuron") if compiled else model
    step = torch.compile(optimizer.step, backend="neuron") if compiled and compile_optimizer else optimizer.step
    losses, walls, estimates = [], [], []
    for tokens in batches:
        before = neuron_compile.stats()["est_time_s"]
        started = time.perf_counter()
        loss = run(tokens, labels=tokens).loss
        loss.backward()
        step()
        optimizer.zero_grad()
        walls.append(time.perf_counter() - started)
        estimates.append(neuron_compile.stats()["est_time_s"] - before)
        losses.append(loss.detach().float().item())
    return losses, walls, estimates, run


def saved_activation_bytes(run, tokens: torch.Tensor, parameters) -> int:
    """Bytes of the distinct storages autograd saves for the backward in one forward of ``run`` (eager or
    compiled), parameters excluded."""
    saved: dict[int, int] = {}

    def pack(tensor):
        saved.setdefault(tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run(tokens, labels=tokens)
    parameter_ids = {parameter.untyped_storage().data_ptr() for parameter in parameters}
    return sum(size for pointer, size in saved.items() if pointer not in parameter_ids)


def _node_shares(earlier: set[int]) -> dict[str, tuple[int, int]]:
    """Per graph kind (forward / backward): (ATen nodes in NKI regions, all ATen nodes) over the graphs compiled
    since the records ``earlier`` (their ids)."""
    shares: dict[str, tuple[int, int]] = {}
    for record in neuron_compile.compiled_records():
        if id(record) in earlier:
            continue
        aten = [p for p in record.report.placements if p.op.startswith(("aten.", "prims."))]
        in_kernels = sum(1 for placement in aten if placement.region is not None)
        done, total = shares.get(record.kind, (0, 0))
        shares[record.kind] = (done + in_kernels, total + len(aten))
    return shares


def _roofline(model, tokens: torch.Tensor, dtype: torch.dtype) -> tuple[float, int, int]:
    """(roofline seconds, FLOPs, bytes) of one training step of ``model`` on ``tokens`` (see module docstring)."""
    saved: dict[int, int] = {}

    def pack(tensor):
        saved.setdefault(tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
        return tensor

    parameter_ids = {parameter.untyped_storage().data_ptr() for parameter in model.parameters()}
    counter = FlopCounterMode(display=False)
    with counter:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = model(tokens, labels=tokens).loss
        loss.backward()
    model.zero_grad()
    activations = sum(size for pointer, size in saved.items() if pointer not in parameter_ids)
    parameters = sum(parameter.numel() * parameter.element_size() for parameter in model.parameters())
    # parameters read and written, gradients written and read, AdamW's two moments read and written
    moved = 2 * parameters + 2 * parameters + 4 * parameters + 2 * activations
    target = get_target()
    peak = (target.tensor_bf16_tflops if dtype == torch.bfloat16 else target.tensor_fp32_tflops) * 1e12
    flops = counter.get_total_flops()
    return max(flops / peak, moved / target.dma_bytes_per_s), flops, moved


def row(name: str, dtype_name: str, steps: int, batch: int, seq: int, compile_optimizer: bool = False) -> str:
    dtype = DTYPES[dtype_name]
    batches = _batches(steps, batch, seq)
    eager_model = _model(MODELS[name], dtype)
    eager_losses, eager_walls, _, _ = _run(eager_model, batches, compiled=False)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    neuron_compile.reset_stats()
    earlier = {id(record) for record in neuron_compile.compiled_records()}
    model = _model(MODELS[name], dtype)
    losses, walls, estimates, run = _run(model, batches, compiled=True, compile_optimizer=compile_optimizer)
    stats = neuron_compile.stats()
    shares = _node_shares(earlier)
    saved = (saved_activation_bytes(run, batches[-1], model.parameters()),
             saved_activation_bytes(eager_model, batches[-1], eager_model.parameters()))
    roofline, flops, moved = _roofline(_model(MODELS[name], dtype), batches[0], dtype)
    difference = max(abs(a - b) / abs(b) for a, b in zip(losses, eager_losses, strict=True))
    steady = slice(1, None) if steps > 1 else slice(0, None)
    estimate = statistics.median(estimates[steady])
    forward, backward, optimizer = (shares.get(kind, (0, 0)) for kind in ("forward", "backward", "inference"))
    compiles = (
        f"{torch._dynamo.utils.counters['stats']['unique_graphs']} / {stats['graphs_compiled']} / "
        f"{stats['cache_misses']}"
    )
    return (
        f"| {name} | {dtype_name} | {difference:.1e} | {forward[0]}/{forward[1]} | {backward[0]}/{backward[1]} | "
        f"{f'{optimizer[0]}/{optimizer[1]}' if compile_optimizer else '-'} | "
        f"{compiles} | {estimate * 1e6:.1f} | {roofline * 1e6:.2f} ({flops / 1e6:.1f} MFLOP, {moved / 1e6:.2f} MB) "
        f"| {estimate / roofline:.0f}x | {saved[0] / 1e6:.3f} / {saved[1] / 1e6:.3f} | "
        f"{statistics.median(walls[steady]):.2f} | {statistics.median(eager_walls[steady]) * 1e3:.1f} ms |"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated, of fp32, bf16")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--compile-optimizer", action="store_true",
                        help="also torch.compile the optimizer's step (its foreach ops in kernels)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (1: on a shared machine, more threads than free cores made "
        "eager steps 100x slower)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    print(
        f"{args.steps} AdamW steps, batch {args.batch} x seq {args.seq}, hidden {TINY['hidden_size']}, "
        f"{TINY['num_hidden_layers']} layers; target {get_target().name}; {args.threads} torch thread(s); "
        f"optimizer {'compiled' if args.compile_optimizer else 'eager'}"
    )
    print(
        "| model | dtype | loss max rel diff | fwd ATen nodes in NKI | bwd ATen nodes in NKI | "
        "optimizer ATen nodes in NKI | "
        "compiles (Dynamo / aot / signatures) | est trn2 us/step | roofline us/step | est / roofline | "
        "saved activations MB (compiled / eager) | wall s/step | eager wall |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        for dtype_name in args.dtypes.split(","):
            try:
                print(row(name, dtype_name, args.steps, args.batch, args.seq, args.compile_optimizer), flush=True)
            except Exception as failure:  # noqa: BLE001 -- one configuration's failure is a row, not the end
                print(f"| {name} | {dtype_name} | failed: {type(failure).__name__}: {str(failure)[:100]} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

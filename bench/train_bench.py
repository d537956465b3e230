"""Training steps of tiny causal LMs through backend="neuron", side by side with eager in one run.

Per model (tiny Llama, Qwen3, Gemma3; random weights from a config) and dtype (fp32; bf16 = bf16 parameters,
gradients and AdamW state): the same AdamW steps on the same batches, eager and compiled, and per step:

- loss: the largest relative difference of the compiled loss from eager's over the steps;
- ATen nodes of the forward, the backward and (``--compile-optimizer``) the optimizer's graph that run in NKI
  kernels (the rest run eagerly), and the share of the forward's and the backward's matmul-class FLOPs (mm, bmm,
  addmm, attention: torch's flop-counter formulas per ATen node) in nodes placed in kernels;
- compiles: Dynamo graphs / aot_autograd graphs / shape signatures compiled over all steps;
- est trn2: the simulator cost model's estimated device time of one steady step (the sum of est_time_s over
  its kernel launches; eager nodes and the eager optimizer add nothing to it), against the step's roofline:
  max(FLOPs at TensorE peak, bytes over DMA bandwidth), FLOPs of forward + backward from
  torch.utils.flop_counter.FlopCounterMode (attention counted too: bench/flops.py), bytes = parameters +
  gradients + AdamW state (read and written once) + saved activations (written by the forward, read by the backward);
- saved activations: the bytes the forward keeps for the backward (parameters excluded; the tensors autograd
  saves, seen through torch.autograd.graph.saved_tensors_hooks), compiled (what aot_autograd's min-cut
  partitioner chose to save) and eager;
- wall time of a steady step (median over steps after the first), compiled and eager (the simulator runs on
  this CPU).

``--compile-optimizer`` also compiles ``optimizer.step`` (AdamW, ``foreach=True``: its ``_foreach_*`` ops become
kernels too) in the compiled run; without it the optimizer runs eagerly in both runs and adds nothing to the
estimate.

The model size is the tiny one below unless ``--hidden``, ``--layers``, ``--heads``, ``--kv-heads``,
``--head-dim``, ``--intermediate`` or ``--vocab`` say otherwise; ``--breakdown N`` prints, per phase of one more
steady step (forward, backward, optimizer), its estimate and its N most expensive kernels.

    .venv/bin/python bench/train_bench.py
    .venv/bin/python bench/train_bench.py --models llama --dtypes fp32 --steps 3 --compile-optimizer
    .venv/bin/python bench/train_bench.py --models llama --dtypes bf16 --hidden 2048 --layers 1 --head-dim 64 \
        --seq 256 --batch 1 --vocab 1024 --breakdown 12
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
import warnings

import torch
from flops import flop_counter

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


def model_size(args: argparse.Namespace) -> dict:
    """TINY with the sizes given on the command line; the intermediate size defaults to Llama's ratio (11/4)."""
    size = dict(TINY)
    overrides = {"hidden_size": args.hidden, "num_hidden_layers": args.layers, "num_attention_heads": args.heads,
                 "num_key_value_heads": args.kv_heads, "head_dim": args.head_dim,
                 "intermediate_size": args.intermediate, "vocab_size": args.vocab}
    size.update({key: value for key, value in overrides.items() if value is not None})
    if args.hidden is not None and args.intermediate is None:
        size["intermediate_size"] = args.hidden * 11 // 4
    if args.heads is None:
        size["num_attention_heads"] = size["hidden_size"] // size["head_dim"]
    if args.kv_heads is None:
        size["num_key_value_heads"] = max(1, size["num_attention_heads"] // 2)
    size["max_position_embeddings"] = max(size["max_position_embeddings"], args.seq)
    return size


def _model(model_type: str, dtype: torch.dtype, size: dict):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **size)
    return AutoModelForCausalLM.from_config(config).to(dtype).train()


def _batches(steps: int, batch: int, seq: int, vocab: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (batch, seq), generator=generator) for _ in range(steps)]


@dataclasses.dataclass
class Run:
    """AdamW steps over a list of batches: per step the loss, wall seconds and estimated trn2 seconds; the model
    as run (compiled or not) and its optimizer step (compiled or not), for more steps after."""

    losses: list[float]
    walls: list[float]
    estimates: list[float]
    model: object
    optimizer: torch.optim.Optimizer
    step: object


def _run(model, batches, compiled: bool, compile_optimizer: bool = False) -> Run:
    """AdamW steps over ``batches``; ``compile_optimizer`` compiles the optimizer's step too (in the compiled
    run)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    run = torch.compile(model, backend="neuron") if compiled else model
    step = torch.compile(optimizer.step, backend="neuron") if compiled and compile_optimizer else optimizer.step
    result = Run([], [], [], run, optimizer, step)
    for tokens in batches:
        before = neuron_compile.stats()["est_time_s"]
        started = time.perf_counter()
        loss = run(tokens, labels=tokens).loss
        loss.backward()
        step()
        optimizer.zero_grad()
        result.walls.append(time.perf_counter() - started)
        result.estimates.append(neuron_compile.stats()["est_time_s"] - before)
        result.losses.append(loss.detach().float().item())
    return result


def breakdown(run: Run, tokens: torch.Tensor, top: int) -> list[str]:
    """One more step of ``run`` with its launches recorded per phase: per phase its estimate and its ``top``
    most expensive kernels (est us, the engine each kept busiest)."""
    phases = {}
    with neuron_compile.record_launches() as phases["forward"]:
        loss = run.model(tokens, labels=tokens).loss
    with neuron_compile.record_launches() as phases["backward"]:
        loss.backward()
    with neuron_compile.record_launches() as phases["optimizer"]:
        run.step()
    run.optimizer.zero_grad()
    lines = []
    for phase, launches in phases.items():
        costs = [cost for launch in launches if launch.report is not None
                 for cost in launch.report.kernel_costs(launch.kernel)]
        total = sum(cost.est_time_s for cost in costs)
        ranked = sorted(costs, key=lambda cost: -cost.est_time_s)[:top]
        lines.append(f"- {phase}: {total * 1e6:.1f} us in {len(costs)} entries; top: " + ", ".join(
            f"{cost.name} {cost.est_time_s * 1e6:.1f} ({cost.bottleneck}, roofline {cost.roofline_s * 1e6:.1f})"
            for cost in ranked))
    return lines


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


@dataclasses.dataclass
class Share:
    """Of one graph kind's ATen nodes: how many are in NKI regions, and their matmul-class FLOPs."""

    nodes_in_kernels: int = 0
    nodes: int = 0
    flops_in_kernels: int = 0
    flops: int = 0

    def flop_share(self) -> str:
        return f"{100 * self.flops_in_kernels / self.flops:.1f}%" if self.flops else "-"


def _node_shares(earlier: set[int]) -> dict[str, Share]:
    """Per graph kind (forward / backward / inference): nodes and FLOPs in NKI regions (that compiled and ran) over
    the graphs compiled since the records ``earlier`` (their ids)."""
    shares: dict[str, Share] = {}
    for record in neuron_compile.compiled_records():
        if id(record) in earlier:
            continue
        share = shares.setdefault(record.kind, Share())
        # a region that failed to compile or to run fell back to eager: its nodes count as eager
        fell_back = {placement.region for placement in record.report.placements
                     if any(failure.startswith(f"NKI region {placement.region} (") for failure in record.failures)}
        aten = [p for p in record.report.placements if p.op.startswith(("aten.", "prims."))]
        in_kernels = [placement for placement in aten if placement.region not in (None, *fell_back)]
        share.nodes_in_kernels += len(in_kernels)
        share.nodes += len(aten)
        share.flops_in_kernels += sum(placement.flops for placement in in_kernels)
        share.flops += sum(placement.flops for placement in aten)
    return shares


def _roofline(model, tokens: torch.Tensor, dtype: torch.dtype) -> tuple[float, int, int]:
    """(roofline seconds, FLOPs, bytes) of one training step of ``model`` on ``tokens`` (see module docstring)."""
    saved: dict[int, int] = {}

    def pack(tensor):
        saved.setdefault(tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
        return tensor

    parameter_ids = {parameter.untyped_storage().data_ptr() for parameter in model.parameters()}
    counter = flop_counter()
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


def _ratio(value: float) -> str:
    return f"{value:.2f}x" if value < 10 else f"{value:.0f}x"


def row(name: str, dtype_name: str, args: argparse.Namespace) -> tuple[str, list[str]]:
    """The table row of one model and dtype, and (with ``--breakdown``) the lines of its per-phase breakdown."""
    dtype, size = DTYPES[dtype_name], model_size(args)
    batches = _batches(args.steps, args.batch, args.seq, size["vocab_size"])
    eager_model = _model(MODELS[name], dtype, size)
    eager = _run(eager_model, batches, compiled=False)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    neuron_compile.reset_stats()
    earlier = {id(record) for record in neuron_compile.compiled_records()}
    model = _model(MODELS[name], dtype, size)
    compiled = _run(model, batches, compiled=True, compile_optimizer=args.compile_optimizer)
    stats = neuron_compile.stats()
    shares = _node_shares(earlier)
    details = breakdown(compiled, batches[-1], args.breakdown) if args.breakdown else []
    saved = (saved_activation_bytes(compiled.model, batches[-1], model.parameters()),
             saved_activation_bytes(eager_model, batches[-1], eager_model.parameters()))
    roofline, flops, moved = _roofline(_model(MODELS[name], dtype, size), batches[0], dtype)
    difference = max(abs(a - b) / abs(b) for a, b in zip(compiled.losses, eager.losses, strict=True))
    steady = slice(1, None) if args.steps > 1 else slice(0, None)
    estimate = statistics.median(compiled.estimates[steady])
    forward, backward, optimizer = (shares.get(kind, Share()) for kind in ("forward", "backward", "inference"))
    compiles = (
        f"{torch._dynamo.utils.counters['stats']['unique_graphs']} / {stats['graphs_compiled']} / "
        f"{stats['cache_misses']}"
    )
    line = (
        f"| {name} | {dtype_name} | {difference:.1e} | {forward.nodes_in_kernels}/{forward.nodes} | "
        f"{backward.nodes_in_kernels}/{backward.nodes} | "
        f"{f'{optimizer.nodes_in_kernels}/{optimizer.nodes}' if args.compile_optimizer else '-'} | "
        f"{forward.flop_share()} / {backward.flop_share()} | "
        f"{compiles} | {estimate * 1e6:.1f} | {roofline * 1e6:.2f} ({flops / 1e6:.1f} MFLOP, {moved / 1e6:.2f} MB) "
        f"| {_ratio(estimate / roofline)} | {saved[0] / 1e6:.3f} / {saved[1] / 1e6:.3f} | "
        f"{statistics.median(compiled.walls[steady]):.2f} | {statistics.median(eager.walls[steady]) * 1e3:.1f} ms |"
    )
    return line, [f"{name} {dtype_name}:", *details] if details else []


def parse_args(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated, of fp32, bf16")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    for option, what in (("hidden", "hidden size"), ("layers", "decoder layers"),
                         ("heads", "attention heads (default: hidden / head dim)"),
                         ("kv-heads", "key/value heads (default: heads / 2)"), ("head-dim", "head dim"),
                         ("intermediate", "MLP size (default: hidden * 11 / 4 with --hidden)"),
                         ("vocab", "vocabulary size")):
        parser.add_argument(f"--{option}", type=int, help=f"{what}; the tiny config's otherwise")
    parser.add_argument("--compile-optimizer", action="store_true",
                        help="also torch.compile the optimizer's step (its foreach ops in kernels)")
    parser.add_argument("--breakdown", type=int, default=0, metavar="N",
                        help="after the table, the N most expensive kernels of each phase of one more step")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (1: on a shared machine, more threads than free cores made "
        "eager steps 100x slower)",
    )
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    size = model_size(args)
    print(
        f"{args.steps} AdamW steps, batch {args.batch} x seq {args.seq}, hidden {size['hidden_size']}, "
        f"{size['num_hidden_layers']} layers, {size['num_attention_heads']} heads / {size['num_key_value_heads']} KV "
        f"heads of {size['head_dim']}, intermediate {size['intermediate_size']}, vocab {size['vocab_size']}; "
        f"target {get_target().name}; {args.threads} torch thread(s); "
        f"optimizer {'compiled' if args.compile_optimizer else 'eager'}"
    )
    print(
        "| model | dtype | loss max rel diff | fwd ATen nodes in NKI | bwd ATen nodes in NKI | "
        "optimizer ATen nodes in NKI | fwd / bwd matmul FLOPs in NKI | "
        "compiles (Dynamo / aot / signatures) | est trn2 us/step | roofline us/step | est / roofline | "
        "saved activations MB (compiled / eager) | wall s/step | eager wall |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    details = []
    for name in args.models.split(","):
        for dtype_name in args.dtypes.split(","):
            try:
                line, lines = row(name, dtype_name, args)
            except Exception as failure:  # noqa: BLE001 -- one configuration's failure is a row, not the end
                line, lines = f"| {name} | {dtype_name} | failed: {type(failure).__name__}: {str(failure)[:100]} |", []
            print(line, flush=True)
            details += lines
    if details:
        print("\nWhere a steady step's estimate goes (est us, busiest engine, roofline us):")
        print("\n".join(details))
    return 0


if __name__ == "__main__":
    sys.exit(main())

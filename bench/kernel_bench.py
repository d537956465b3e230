"""Benchmark: our kernels against the graph roofline and against Inductor's fused schedule (issue 10).

For each graph, in one run: our kernels launched and HBM bytes (the simulator's cost reports, fused and with
``config.patch(fusion=False)``), Inductor's fused schedule (HBM bytes: ``get_read_write_buffers_sizes()`` summed
over the nodes ``Scheduler.fuse_nodes`` returns, since ``metrics.num_bytes_accessed`` stays 0 on CPU; kernels:
generated + extern), our estimated device time (each launch's ``est_time_s`` summed, and its lower bound: the
report's ``est_lower_bound_s``: the launch plus the busiest engine's time, perfect overlap) and the graph
roofline ``max(FLOPs / TensorE peak, (parameters + inputs + outputs) bytes / DMA bandwidth)`` with FLOPs from
``torch.utils.flop_counter.FlopCounterMode`` (attention counted too: bench/flops.py) and trn2's numbers from
``neuron_compile/hardware.py``.

Graphs (random weights, tiny configs built in code, nothing downloaded), at hidden 512 fp32 and hidden 2048
bf16, seq 128 and 1024, batch 1: a Llama MLP (gate/up/down, SiLU), LayerNorm + Linear + GELU, causal attention
written with matmuls and softmax, a VAE's GroupNorm (32 groups over ``hidden`` channels of ``seq`` x 16 pixels), a
1-layer LlamaModel (``llama_layer``; ``llama_prefill``: the same called with its positions as an input, as
generate() calls a prefill), a 2-layer LlamaForCausalLM, one decode step of that
model with a static cache of ``seq`` positions (prefilled eagerly with ``seq - 1`` tokens), and a 1-layer model of
other popular architectures sized as the Llama one (``qwen3_layer``, ``mistral_layer``, ``gemma3_layer``,
``phi3_layer``; not in the default run). Inductor only
schedules: its compile stops once the scheduler has fused (no C++ is generated or built) and the graph then runs
eagerly. Needs the ``models`` extra (transformers) for the Llama graphs.

    python bench/kernel_bench.py             # every graph (~4 min on 2 shared cores)
    python bench/kernel_bench.py --quick     # hidden 512, seq 128 only (~30 s)
    python bench/kernel_bench.py --only mlp,attention --quick
    python bench/kernel_bench.py --smoke     # the Inductor byte check and a tiny MLP through our side
    python bench/kernel_bench.py --only llama_layer --size 2048,256 --kernels   # and each kernel's share

Progress goes to stderr; the table (markdown) to stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
import warnings
from collections.abc import Callable

import torch
from torch import nn
from flops import flop_counter

import neuron_compile
from neuron_compile.hardware import get_target

MB = 1e6
# (hidden, dtype, seq): hidden 512 in fp32 and 2048 in bf16 (the two sizes), each at seq 128 and 1024.
SIZES = [(512, torch.float32, 128), (512, torch.float32, 1024), (2048, torch.bfloat16, 128),
         (2048, torch.bfloat16, 1024)]
QUICK_SIZES = SIZES[:1]
HEAD_DIM = 64
VOCAB = 1024


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- graphs


@dataclasses.dataclass
class Case:
    """A graph to measure: ``fn(*args)`` returns its outputs; ``state`` are the tensors it reads besides
    ``args`` (parameters, buffers, a cache); ``reset`` restores mutated state before each run."""

    fn: Callable
    args: tuple
    state: list[torch.Tensor]
    reset: Callable[[], None] = lambda: None


def intermediate_size(hidden: int) -> int:
    return hidden * 11 // 4  # Llama's ratio (2048 -> 5632, TinyLlama)


class LlamaMLP(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        inner = intermediate_size(hidden)
        self.gate = nn.Linear(hidden, inner, bias=False)
        self.up = nn.Linear(hidden, inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))


class LayerNormLinearGelu(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.linear = nn.Linear(hidden, 4 * hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(self.linear(self.norm(x)))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    seq = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    return torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ v


def module_case(module: nn.Module, dtype: torch.dtype, *args: torch.Tensor) -> Case:
    module = module.eval().to(dtype)
    return Case(module, args, [*module.parameters(), *module.buffers()])


def llama_config(hidden: int, layers: int, seq: int):
    from transformers import LlamaConfig

    heads = hidden // HEAD_DIM
    return LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate_size(hidden),
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 8),
                       max_position_embeddings=max(seq, 128), tie_word_embeddings=False)


def tokens(seq: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(0))


def llama_layer(hidden: int, dtype: torch.dtype, seq: int) -> Case:
    from transformers import LlamaModel

    model = LlamaModel(llama_config(hidden, 1, seq)).eval().to(dtype)
    return Case(lambda ids: model(ids).last_hidden_state, (tokens(seq),), [*model.parameters(), *model.buffers()])


def llama_prefill(hidden: int, dtype: torch.dtype, seq: int) -> Case:
    """``llama_layer`` called as generate() calls a prefill: the positions are an input (what the integer guard
    bounds by 2**20), not computed inside the graph."""
    from transformers import LlamaModel

    model = LlamaModel(llama_config(hidden, 1, seq)).eval().to(dtype)
    return Case(lambda ids, positions: model(ids, position_ids=positions).last_hidden_state,
                (tokens(seq), torch.arange(seq)[None]), [*model.parameters(), *model.buffers()])


def llama_2layer(hidden: int, dtype: torch.dtype, seq: int) -> Case:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(llama_config(hidden, 2, seq)).eval().to(dtype)
    return Case(lambda ids: model(ids).logits, (tokens(seq),), [*model.parameters(), *model.buffers()])


def decoder_layer(model_type: str) -> Callable[[int, torch.dtype, int], Case]:
    """One decoder layer of another popular architecture (``model_type`` as transformers names it), sized as
    ``llama_layer``: what users of those models get next to the Llama goal point."""

    def case(hidden: int, dtype: torch.dtype, seq: int) -> Case:
        from transformers import AutoConfig, AutoModel

        heads = hidden // HEAD_DIM
        config = AutoConfig.for_model(
            model_type, vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate_size(hidden),
            num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=max(1, heads // 8), head_dim=HEAD_DIM,
            max_position_embeddings=max(seq, 128), tie_word_embeddings=False, pad_token_id=0, eos_token_id=1)
        model = AutoModel.from_config(config).eval().to(dtype)
        return Case(lambda ids: model(ids).last_hidden_state, (tokens(seq),),
                    [*model.parameters(), *model.buffers()])

    return case


def decode_step(hidden: int, dtype: torch.dtype, seq: int) -> Case:
    """One token through the 2-layer model, attending over a static cache of ``seq`` positions (``seq - 1``
    filled by an eager prefill)."""
    from transformers import LlamaForCausalLM, StaticCache

    model = LlamaForCausalLM(llama_config(hidden, 2, seq)).eval().to(dtype)
    cache = StaticCache(config=model.config, max_cache_len=seq)
    prompt = tokens(seq)
    with torch.no_grad():
        model(prompt[:, :-1], cache=cache, use_cache=True)
    lengths = [(layer.cumulative_length, layer.cumulative_length.clone()) for layer in cache.layers]

    def reset() -> None:  # every run writes position seq - 1 again
        for length, prefilled in lengths:
            length.copy_(prefilled)

    def step(ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return model(ids, position_ids=positions, cache=cache, use_cache=True).logits

    cached = [tensor for layer in cache.layers for tensor in (layer.keys, layer.values)]
    return Case(step, (prompt[:, -1:], torch.tensor([[seq - 1]])), [*model.parameters(), *model.buffers(), *cached],
                reset)


def random(shape, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


GRAPHS: dict[str, Callable[[int, torch.dtype, int], Case]] = {
    "mlp": lambda h, dt, s: module_case(LlamaMLP(h), dt, random((1, s, h), dt, 1)),
    "ln_linear_gelu": lambda h, dt, s: module_case(LayerNormLinearGelu(h), dt, random((1, s, h), dt, 1)),
    "attention": lambda h, dt, s: Case(causal_attention, tuple(
        random((1, h // HEAD_DIM, s, HEAD_DIM), dt, seed) for seed in (1, 2, 3)), []),
    "group_norm": lambda h, dt, s: module_case(nn.GroupNorm(32, h), dt, random((1, h, s, 16), dt, 1)),
    "llama_layer": llama_layer,
    "llama_prefill": llama_prefill,
    "llama_2layer": llama_2layer,
    "decode": decode_step,
}
DEFAULT_GRAPHS = list(GRAPHS)  # the other architectures' layers run with --only
GRAPHS.update({f"{name}_layer": decoder_layer(model_type) for name, model_type in (
    ("qwen3", "qwen3"), ("mistral", "mistral"), ("gemma3", "gemma3_text"), ("phi3", "phi3"))})

# Decoder layers at the sizes of published checkpoints (their configs' numbers, random weights, one layer): what
# users run, where head_dim, the key/value groups and the row width differ from the goal point's. --size gives
# their seq; its hidden is ignored (the table shows the model's).
REAL_SIZES: dict[str, tuple[str, dict]] = {
    "llama3_3b_layer": ("llama", dict(hidden_size=3072, intermediate_size=8192, num_attention_heads=24,
                                      num_key_value_heads=8, head_dim=128)),
    "phi3_mini_layer": ("phi3", dict(hidden_size=3072, intermediate_size=8192, num_attention_heads=32,
                                     num_key_value_heads=32)),
    "qwen3_4b_layer": ("qwen3", dict(hidden_size=2560, intermediate_size=9728, num_attention_heads=32,
                                     num_key_value_heads=8, head_dim=128)),
    "gemma3_4b_layer": ("gemma3_text", dict(hidden_size=2560, intermediate_size=10240, num_attention_heads=8,
                                            num_key_value_heads=4, head_dim=256)),
}


def real_size_layer(model_type: str, sizes: dict) -> Callable[[int, torch.dtype, int], Case]:
    """One decoder layer of ``model_type`` at a published checkpoint's ``sizes`` (``hidden`` is ignored)."""

    def case(hidden: int, dtype: torch.dtype, seq: int) -> Case:
        from transformers import AutoConfig, AutoModel

        config = AutoConfig.for_model(model_type, vocab_size=VOCAB, num_hidden_layers=1,
                                      max_position_embeddings=max(seq, 128), tie_word_embeddings=False,
                                      pad_token_id=0, eos_token_id=1, **sizes)
        model = AutoModel.from_config(config).eval().to(dtype)
        return Case(lambda ids: model(ids).last_hidden_state, (tokens(seq),),
                    [*model.parameters(), *model.buffers()])

    return case


GRAPHS.update({name: real_size_layer(model_type, sizes) for name, (model_type, sizes) in REAL_SIZES.items()})


# ---------------------------------------------------------------- measurements


def tensor_bytes(tensors) -> int:
    """Bytes of distinct tensors (by storage and offset: a tied weight counts once)."""
    seen, total = set(), 0
    for tensor in tensors:
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            total += tensor.numel() * tensor.element_size()
    return total


def output_tensors(value) -> list[torch.Tensor]:
    return [leaf for leaf in torch.utils._pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]


@dataclasses.dataclass
class Roofline:
    flops: int
    necessary_bytes: int  # parameters + inputs + outputs
    compute_s: float
    memory_s: float

    @property
    def seconds(self) -> float:
        return max(self.compute_s, self.memory_s)

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"


def roofline(case: Case, dtype: torch.dtype) -> Roofline:
    target = get_target("trn2")
    case.reset()
    counter = flop_counter()
    with torch.no_grad(), counter:
        outputs = case.fn(*case.args)
    inputs = [arg for arg in case.args if isinstance(arg, torch.Tensor)]
    necessary = tensor_bytes([*case.state, *inputs]) + tensor_bytes(output_tensors(outputs))
    peak = (target.tensor_bf16_tflops if dtype == torch.bfloat16 else target.tensor_fp32_tflops) * 1e12
    flops = counter.get_total_flops()
    return Roofline(flops, necessary, flops / peak, necessary / target.dma_bytes_per_s)


def lower_bound_s(report) -> float:
    """The report's lower bound: its launch cost plus its busiest engine's time (perfect overlap)."""
    return float(report.est_lower_bound_s)


@dataclasses.dataclass
class Ours:
    kernels: int
    launches: int  # one per region with launch_unit "region" (the default), one per kernel with "kernel"
    hbm_bytes: int
    est_s: float
    lower_bound_s: float
    eager_nodes: int
    graphs: int  # Dynamo graphs compiled (graph breaks make several)
    eager_reasons: list[tuple[str, int]]
    top_kernels: list[tuple[str, float, str]]  # (kernel, est seconds, bottleneck engine)
    sections: list = dataclasses.field(default_factory=list)  # every launch's SectionCosts, in launch order


def run_ours(case: Case, fusion: bool = True) -> Ours:
    torch._dynamo.reset()
    neuron_compile.reset_stats()
    case.reset()
    compiled = torch.compile(case.fn, backend="neuron")
    with torch.no_grad(), neuron_compile.config.patch(fusion=fusion), neuron_compile.record_launches() as launches:
        compiled(*case.args)
    stats = neuron_compile.stats()
    reports = [launch.report for launch in launches if launch.report is not None]
    costs = [cost for launch in launches if launch.report is not None
             for cost in launch.report.kernel_costs(launch.kernel)]
    kernels = [cost for cost in costs if cost.bottleneck != "launch"]
    top = sorted(((cost.name, float(cost.est_time_s), cost.bottleneck) for cost in kernels), key=lambda item: -item[1])
    return Ours(
        kernels=len(kernels), launches=stats["kernels_launched"],
        hbm_bytes=stats["hbm_bytes"],
        est_s=sum(float(report.est_time_s) for report in reports),
        lower_bound_s=sum(lower_bound_s(report) for report in reports),
        eager_nodes=stats["fallback_nodes"], graphs=stats["graphs_compiled"],
        eager_reasons=stats["fallback_reasons"].most_common(3),
        top_kernels=top[:3],
        sections=[section for report in reports for section in report.sections],
    )


@dataclasses.dataclass
class InductorSchedule:
    hbm_bytes: int = 0
    generated: int = 0  # SchedulerNode / FusedSchedulerNode (and other non-extern kernels)
    extern: int = 0  # ExternKernelSchedulerNode: matmuls, SDPA and other aten calls (not their MultiOutputs)
    graphs: int = 0


class _ScheduleCaptured(Exception):
    """Raised once the scheduler has fused, to skip Inductor's code generation."""


def _summarize_schedule(nodes, into: InductorSchedule) -> None:
    from torch._inductor.ir import MultiOutput
    from torch._inductor.scheduler import ExternKernelSchedulerNode, NopKernelSchedulerNode

    into.graphs += 1
    for node in nodes:
        # A MultiOutput picks one output of a multi-output extern call (SDPA): no kernel, no bytes of its own.
        if isinstance(node, NopKernelSchedulerNode) or isinstance(getattr(node, "node", None), MultiOutput):
            continue
        into.hbm_bytes += int(node.get_read_write_buffers_sizes())
        if isinstance(node, ExternKernelSchedulerNode) or node.is_extern():
            into.extern += 1
        else:
            into.generated += 1


def _captured(error: BaseException | None) -> bool:
    while error is not None:
        if isinstance(error, _ScheduleCaptured):
            return True
        error = error.__cause__ or error.__context__
    return False


def run_inductor(case: Case) -> InductorSchedule:
    """Inductor's fused schedule for ``case``: every Dynamo graph compiled by Inductor up to its scheduler's
    fusion (read from the nodes ``Scheduler.fuse_nodes`` returns, while the graph's size hints are live), then
    run eagerly."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    from torch._inductor import scheduler
    from torch._inductor.compile_fx import compile_fx

    schedule = InductorSchedule()
    original = scheduler.Scheduler.fuse_nodes

    def fuse_nodes(self, nodes):  # the first call is the graph's fusion (Scheduler.__init__); nothing runs after it
        _summarize_schedule(original(self, nodes), schedule)
        raise _ScheduleCaptured

    def backend(gm: torch.fx.GraphModule, example_inputs):
        try:
            return compile_fx(gm, example_inputs)
        except BaseException as error:
            if not _captured(error):
                raise
            return gm.forward

    torch._dynamo.reset()
    case.reset()
    scheduler.Scheduler.fuse_nodes = fuse_nodes
    try:
        # No cache may answer for the scheduler (an FX-graph or AOTAutograd cache hit skips it).
        with inductor_config.patch(fx_graph_cache=False, fx_graph_remote_cache=False), \
                functorch_config.patch(enable_autograd_cache=False), torch.no_grad():
            torch.compile(case.fn, backend=backend)(*case.args)
    finally:
        scheduler.Scheduler.fuse_nodes = original
    return schedule


def check_inductor_hook() -> str:
    """(x + 1) * 2 on a 1024x1024 fp32 tensor: one generated kernel reading 4 MiB and writing 4 MiB."""
    x = torch.ones(1024, 1024)
    schedule = run_inductor(Case(lambda t: (t + 1) * 2, (x,), []))
    want = 2 * x.numel() * x.element_size()
    ok = schedule.hbm_bytes == want and (schedule.generated, schedule.extern) == (1, 0)
    message = (f"Inductor byte hook on (x + 1) * 2, x 1024x1024 fp32: {schedule.hbm_bytes:,} bytes (want {want:,} "
               f"= 8 MiB), {schedule.generated} generated + {schedule.extern} extern kernels (want 1 + 0): "
               + ("ok" if ok else "WRONG"))
    if not ok:
        raise SystemExit(message)
    return message


# ---------------------------------------------------------------- table


@dataclasses.dataclass
class Row:
    graph: str
    hidden: int
    dtype: torch.dtype
    seq: int
    ours: Ours
    unfused: Ours
    inductor: InductorSchedule
    roof: Roofline
    seconds: float


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def format_table(rows: list[Row]) -> str:
    lines = [
        "| graph | hidden | dtype | seq | our kernels (launches) | our HBM MB | unfused MB | Inductor MB | "
        "Inductor kernels (gen+extern) | est us | lower bound us | roofline us | P+I+O MB | est/roofline | "
        "ours/Inductor bytes | ours/(P+I+O) bytes |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        ours, roof, ind = row.ours, row.roof, row.inductor
        dtype = str(row.dtype).removeprefix("torch.").replace("float32", "fp32").replace("bfloat16", "bf16")
        lines.append(
            f"| {row.graph} | {row.hidden} | {dtype} | {row.seq} | {ours.kernels} ({ours.launches}) | "
            f"{ours.hbm_bytes / MB:.1f} | "
            f"{row.unfused.hbm_bytes / MB:.1f} ({row.unfused.kernels} k) | {ind.hbm_bytes / MB:.1f} | "
            f"{ind.generated + ind.extern} ({ind.generated}+{ind.extern}) | {ours.est_s * 1e6:.1f} | "
            f"{ours.lower_bound_s * 1e6:.1f} | {roof.seconds * 1e6:.1f} ({roof.bound[0]}) | "
            f"{roof.necessary_bytes / MB:.1f} | {_ratio(ours.est_s, roof.seconds)} | "
            f"{_ratio(ours.hbm_bytes, ind.hbm_bytes)} | {_ratio(ours.hbm_bytes, roof.necessary_bytes)} |"
        )
    return "\n".join(lines)


def section_table(title: str, sections) -> list[str]:
    """A markdown table of a launch's kernels (its cost report's ``sections``): each one's share of the launch's
    estimate (how far it pushed the schedule's end past the kernels before it; the shares and the launch cost add up
    to the estimate), its start and end in the schedule, its busiest engine's time, its own roofline, HBM bytes and
    DMA busy time. diffusers_scale_bench.py prints its launches with it too."""
    lines = ["", title, "", "| kernel | share us | start us | end us | busiest engine us | its roofline us | HBM MB | "
             "DMA busy us |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for section in sections:
        busy = section.busy_s_per_engine
        lines.append(f"| {section.name} | {section.est_time_s * 1e6:.1f} | {section.start_s * 1e6:.1f} | "
                     f"{section.end_s * 1e6:.1f} | {section.lower_bound_s * 1e6:.1f} ({section.bottleneck}) | "
                     f"{section.roofline_s * 1e6:.1f} | {section.hbm_bytes / MB:.2f} | "
                     f"{busy.get('dma', 0.0) * 1e6:.1f} |")
    return lines


def format_kernels(rows: list[Row]) -> str:
    """Per kernel of each fused graph (``--kernels``, ``section_table``)."""
    lines = []
    for row in rows:
        lines += section_table(f"{row.graph} h{row.hidden} s{row.seq}, per kernel:", row.ours.sections)
    return "\n".join(lines)


def format_details(rows: list[Row]) -> str:
    lines = ["", "Where our time goes (top kernels by est time, bottleneck engine) and what ran eagerly:"]
    for row in rows:
        top = ", ".join(f"{name} {seconds * 1e6:.1f}us ({engine})" for name, seconds, engine in row.ours.top_kernels)
        eager = "; ".join(f"{count} x {reason[:75]}" for reason, count in row.ours.eager_reasons)
        lines.append(f"- {row.graph} h{row.hidden} s{row.seq}: {top or 'no kernels'}; "
                     f"{row.roof.flops / 1e9:.2f} GFLOP; graphs: ours {row.ours.graphs}, "
                     f"Inductor {row.inductor.graphs}; "
                     f"eager nodes {row.ours.eager_nodes}"
                     + (f" ({eager})" if eager else "") + f"; measured in {row.seconds:.0f} s")
    return "\n".join(lines)


def measure(graph: str, hidden: int, dtype: torch.dtype, seq: int) -> Row:
    started = time.time()
    if graph in REAL_SIZES:
        hidden = REAL_SIZES[graph][1]["hidden_size"]
    torch.manual_seed(0)
    case = GRAPHS[graph](hidden, dtype, seq)
    roof = roofline(case, dtype)
    inductor = run_inductor(case)
    log(f"    inductor scheduled ({time.time() - started:.0f} s)")
    ours = run_ours(case)
    log(f"    ours fused: {ours.kernels} kernels ({time.time() - started:.0f} s)")
    unfused = run_ours(case, fusion=False)
    return Row(graph, hidden, dtype, seq, ours, unfused, inductor, roof, time.time() - started)


def smoke() -> int:
    """The Inductor byte check and a tiny MLP through our side (fused and unfused) and Inductor's."""
    print(check_inductor_hook())
    case = GRAPHS["mlp"](128, torch.float32, 128)
    row = Row("mlp", 128, torch.float32, 128, run_ours(case), run_ours(case, fusion=False), run_inductor(case),
              roofline(case, torch.float32), 0.0)
    print(format_table([row]))
    healthy = row.ours.kernels > 0 and row.ours.hbm_bytes > 0 and row.ours.est_s > 0 and row.inductor.extern == 3
    healthy = healthy and row.unfused.kernels > row.ours.kernels and row.roof.flops == 3 * 2 * 128 * 128 * 352
    print("smoke: " + ("ok" if healthy else "WRONG"))
    return 0 if healthy else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="hidden 512 fp32, seq 128 only")
    parser.add_argument("--only", help="comma-separated graph names: " + ", ".join(GRAPHS))
    parser.add_argument("--smoke", action="store_true", help="the Inductor byte check and one tiny graph")
    parser.add_argument("--kernels", action="store_true", help="also a table per graph: each kernel's share of the "
                        "estimate, its busiest engine, roofline, HBM bytes and DMA time")
    parser.add_argument("--size", action="append", metavar="HIDDEN,SEQ",
                        help="measure this size instead (bf16 from hidden 2048 up, else fp32); repeatable")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)  # the machine is shared; the simulator's numbers do not depend on threads
    if args.smoke:
        return smoke()
    graphs = args.only.split(",") if args.only else DEFAULT_GRAPHS
    unknown = [graph for graph in graphs if graph not in GRAPHS]
    if unknown:
        parser.error(f"unknown graph(s) {unknown}: choose from {list(GRAPHS)}")
    print(check_inductor_hook())
    rows, started = [], time.time()
    sizes = QUICK_SIZES if args.quick else SIZES
    if args.size:
        try:
            pairs = [tuple(int(part) for part in size.split(",")) for size in args.size]
            sizes = [(hidden, torch.bfloat16 if hidden >= 2048 else torch.float32, seq) for hidden, seq in pairs]
        except ValueError:
            parser.error(f"--size takes HIDDEN,SEQ (two integers), got {args.size}")
    for hidden, dtype, seq in sizes:
        for graph in graphs:
            log(f"[{time.time() - started:5.0f} s] {graph} hidden {hidden} {dtype} seq {seq}")
            rows.append(measure(graph, hidden, dtype, seq))
    print()
    print(format_table(rows))
    print(format_details(rows))
    if args.kernels:
        print(format_kernels(rows))
    log(f"done in {time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

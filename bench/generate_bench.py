"""Benchmark: text generation with a static cache through backend="neuron" against eager (issue 16).

Per model: ``model.generate(ids, max_new_tokens=N, do_sample=False, cache_implementation="static",
compile_config=CompileConfig(backend="neuron", fullgraph=False, dynamic=False))`` with
``compile_config._compile_all_devices = True`` (transformers compiles the decode step only on devices it knows;
without this flag it runs CPU tensors eagerly) against eager's ``generate``; transformers runs the prefill
eagerly and compiles the decode step. Columns:

* tokens equal: the compiled generation's tokens are eager's, all of them;
* compiles: Dynamo graphs compiled (``graphs_compiled``) / compiles of our dispatch (``cache_misses``: one per
  graph and signature; recompiles of a graph are counted in the second);
* compiled steps: decode steps that ran the compiled graph, of all decode steps;
* kernels (launches) / step, est us / token: the kernels of one compiled decode step and the launches that ran them
  (one per NKI region with the default ``NEURON_COMPILE_LAUNCH_UNIT=region``; all / compiled steps) and the
  sum of their cost reports' ``est_time_s`` (trn2, our simulator's schedule);
* roofline us / token: (weight bytes + KV-cache bytes) / trn2 DMA bandwidth (``hardware.py``): every weight read
  once per token (the input embedding one row; tied weights once), and the static cache as the attention reads it
  (every layer's keys and values at the cache's full length, as a static-cache step reads them);
* eager nodes / step: ATen nodes of the compiled step left eager (with the top reason in the notes).

Models from tiny random configs (nothing downloaded), fp32; the goal row is a 4-layer Llama at hidden 1024 bf16
(heads of 64, 2 KV heads, intermediate 2816, vocab 1024) with a user-given 512-position ``StaticCache``.
Mistral and Gemma3 cache their sliding-window layers with a Python int position that Dynamo specializes on under
``dynamic=False``: their step recompiles per token (Dynamo's guard, not our dispatch) until Dynamo's recompile
limit (8), then runs eagerly.

    python bench/generate_bench.py             # five tiny models x 32 tokens, and the goal row (~15 min)
    python bench/generate_bench.py --quick     # five tiny models x 4 tokens, no goal row (~2 min)

Progress goes to stderr; the table (markdown) to stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import warnings

import torch

import neuron_compile
from neuron_compile.hardware import get_target

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=64, pad_token_id=0)
ARCHS = ["llama", "qwen3", "mistral", "gemma3_text", "phi3"]
GOAL = dict(vocab_size=1024, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=1024, tie_word_embeddings=False)
GOAL_CACHE = 512
PROMPT = 7


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclasses.dataclass
class Row:
    model: str
    equal: bool
    dynamo_graphs: int
    dispatch_compiles: int
    compiled_steps: int
    decode_steps: int
    kernels_per_step: float
    launches_per_step: float
    eager_nodes: int
    est_s: float
    roofline_s: float
    notes: str
    wall_s: float
    breakdown: str = ""  # est us per token by kernel kind, and the launch cost within it


def build(arch: str, overrides: dict, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(arch, **overrides)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval().to(dtype)


def generate(model, ids: torch.Tensor, new_tokens: int, compiled: bool, cache_len: int | None):
    from transformers import CompileConfig, StaticCache

    kwargs = dict(max_new_tokens=new_tokens, do_sample=False)
    if cache_len is None:
        kwargs["cache_implementation"] = "static"
    else:  # a static cache of a given length, passed in (the goal row's 512 positions)
        kwargs["past_key_values"] = StaticCache(config=model.config, max_cache_len=cache_len)
    if compiled:
        compile_config = CompileConfig(backend="neuron", fullgraph=False, dynamic=False)
        compile_config._compile_all_devices = True  # CPU tensors: transformers compiles only with this flag
        kwargs["compile_config"] = compile_config
    with torch.no_grad():
        return model.generate(ids, **kwargs)


def roofline_bytes(model, ids_len: int, new_tokens: int, cache_len: int | None) -> int:
    """Weights read per token (input embedding: one row; a tied weight once) + the static cache's keys and values."""
    embedding = model.get_input_embeddings().weight
    seen, weights = set(), 0
    for parameter in model.parameters():
        key = (parameter.untyped_storage().data_ptr(), parameter.storage_offset(), tuple(parameter.shape))
        if key in seen:
            continue
        seen.add(key)
        weights += parameter.numel() * parameter.element_size()
    output_embedding = model.get_output_embeddings()
    if output_embedding is None or output_embedding.weight is not embedding:  # untied: one row is gathered
        weights -= (embedding.numel() - embedding.shape[1]) * embedding.element_size()
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    length = cache_len if cache_len is not None else ids_len + new_tokens
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * length * head_dim * embedding.element_size()
    return weights + kv


def measure(name: str, arch: str, overrides: dict, dtype: torch.dtype, new_tokens: int,
            cache_len: int | None = None) -> Row:
    started = time.time()
    model = build(arch, overrides, dtype)
    ids = torch.randint(1, overrides["vocab_size"], (1, PROMPT), generator=torch.Generator().manual_seed(0))
    expected = generate(model, ids, new_tokens, compiled=False, cache_len=cache_len)
    torch._dynamo.reset()
    neuron_compile.reset_stats()
    with neuron_compile.record_launches() as launches:
        actual = generate(model, ids, new_tokens, compiled=True, cache_len=cache_len)
    stats = neuron_compile.stats()
    calls = stats["cache_hits"] + stats["cache_misses"]
    records = neuron_compile.compiled_records()[-stats["cache_misses"]:] if stats["cache_misses"] else []
    eager = max((len(record.report.eager) for record in records), default=0)
    reasons = stats["fallback_reasons"].most_common(1)
    notes = [f"{count} x {reason}" for reason, count in reasons]
    if stats["recompiles"]:
        notes.append(f"{stats['recompiles']} dispatch recompiles")
    decode_steps = actual.shape[1] - PROMPT - 1
    if stats["graphs_compiled"] > 1:
        notes.append(f"Dynamo recompiled the step per token ({stats['graphs_compiled']} graphs)")
    if calls < decode_steps:
        notes.append(f"{decode_steps - calls} steps eager (Dynamo's recompile limit)")
    reports = [(launch.kernel, launch.report) for launch in launches if launch.report is not None]
    est = sum(float(report.est_time_s) for _, report in reports)
    roofline = roofline_bytes(model, PROMPT, new_tokens, cache_len) / get_target("trn2").dma_bytes_per_s
    return Row(
        name, torch.equal(actual, expected), stats["graphs_compiled"], stats["cache_misses"], calls,
        decode_steps, kernel_count(reports) / max(calls, 1), len(launches) / max(calls, 1), eager,
        est / max(calls, 1), roofline,
        "; ".join(notes), time.time() - started, breakdown(reports, max(calls, 1)),
    )


def kernel_count(reports: list) -> int:
    """The kernels the launches ran (a region kernel runs several)."""
    return sum(1 for kernel, report in reports for cost in report.kernel_costs(kernel) if cost.bottleneck != "launch")


def breakdown(reports: list, steps: int) -> str:
    """Per token: est us by kernel kind (the name's stem: matmul, pointwise, ...: each kernel's share of its launch's
    schedule), then the launch costs."""
    kinds: dict[str, float] = {}
    for _, report in reports:
        for section in report.sections:
            kind = section.name.split("_kernel")[0]
            kinds[kind] = kinds.get(kind, 0.0) + float(section.est_time_s) / steps
    launch = sum(float(report.launch_s) for _, report in reports) / steps
    parts = [f"{kind} {seconds * 1e6:.0f}" for kind, seconds in sorted(kinds.items(), key=lambda item: -item[1])]
    return ", ".join(parts) + f" us, and kernel launches {launch * 1e6:.0f} us"


def format_table(rows: list[Row]) -> str:
    lines = [
        "| model | tokens equal | compiles (Dynamo / ours) | compiled steps | kernels (launches) / step "
        "| eager nodes / step | est us / token | roofline us / token | est / roofline | wall s | notes |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row.model} | {'yes' if row.equal else 'no'} | {row.dynamo_graphs} / {row.dispatch_compiles} "
            f"| {row.compiled_steps} of {row.decode_steps} | {row.kernels_per_step:.0f} ({row.launches_per_step:.0f}) "
            f"| {row.eager_nodes} "
            f"| {row.est_s * 1e6:.1f} | {row.roofline_s * 1e6:.2f} | {row.est_s / row.roofline_s:.1f}x "
            f"| {row.wall_s:.0f} | {row.notes} |"
        )
    lines.append("")
    lines += [f"- {row.model}: {row.breakdown}" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 new tokens per tiny model, no goal row")
    parser.add_argument("--tokens", type=int, help="new tokens per tiny model (default 32, --quick 4)")
    parser.add_argument("--goal-tokens", type=int, default=4, help="new tokens of the goal row (default 4)")
    parser.add_argument("--archs", default=",".join(ARCHS), help="comma-separated transformers model types")
    parser.add_argument("--no-goal", action="store_true", help="skip the goal row")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)  # the machine is shared; the simulator's estimates do not depend on threads
    tokens = args.tokens or (4 if args.quick else 32)
    rows, started = [], time.time()
    for arch in args.archs.split(","):
        log(f"[{time.time() - started:5.0f} s] {arch} x {tokens} tokens")
        rows.append(measure(f"{arch} (tiny, fp32)", arch, TINY, torch.float32, tokens))
    if not (args.quick or args.no_goal):
        log(f"[{time.time() - started:5.0f} s] goal: llama 4 layers, hidden 1024, bf16, cache {GOAL_CACHE}")
        rows.append(measure(f"llama 4L h1024 bf16, cache {GOAL_CACHE}", "llama", GOAL, torch.bfloat16,
                            args.goal_tokens, GOAL_CACHE))
    print(format_table(rows))
    log(f"done in {time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

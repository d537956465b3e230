"""Diffusers transformers at scale: regional against whole-model compile time, and the mid size against its roofline.

Two tables (issue 12), each row in fresh processes, caches off (``NEURON_COMPILE_CACHE=off``), random weights:

``--compile-time``: models with 8 or more repeated blocks at tiny widths (Flux: 8 double + 8 single blocks; Wan and
LTX-Video: 8 blocks). CPU seconds of the first call beyond a warm one, for ``torch.compile(model,
backend="neuron")`` on the whole model and for ``model.compile_repeated_blocks(backend="neuron", fullgraph=True,
dynamic=False)``, their ratio, Dynamo graphs each compiled, and the largest difference of the two outputs from
each other and from eager (relative to eager's largest value).

``--warm-start``: a tiny pipeline (bench/diffusers_pipelines.py, fp32) whose transformer goes through
``compile_repeated_blocks``, generated in a process with ``NEURON_COMPILE_CACHE`` set to a fresh directory (cold:
it fills the cache), then in a second process with the same directory (warm start): the first generation's CPU
seconds beyond a second generation's in each, the second process's disk-cache hits and misses, and whether both
give the same latents.

``--mid``: the mid size of the issue: hidden 1024 (8 heads of 128), 1024 image tokens and 256 text tokens, bf16,
2 blocks of each repeated kind, through ``compile_repeated_blocks``. The estimated trn2 time of a warm forward (the
simulator's cost reports summed) against the graph roofline ``max(FLOPs / TensorE peak, (parameters + inputs +
outputs) bytes / DMA bandwidth)`` (FLOPs from ``torch.utils.flop_counter.FlopCounterMode``, attention counted too:
bench/flops.py; trn2's numbers from ``neuron_compile/hardware.py``), and the error against eager.

    PYTHONPATH=. python bench/diffusers_scale_bench.py --compile-time
    PYTHONPATH=. python bench/diffusers_scale_bench.py --mid --models flux
    PYTHONPATH=. python bench/diffusers_scale_bench.py --mid --top 20   # and the 20 costliest kernels per model
    PYTHONPATH=. python bench/diffusers_scale_bench.py --mid --models flux --kernels   # each block's kernels
    PYTHONPATH=. python bench/diffusers_scale_bench.py --warm-start
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings

import torch

SEED = 0


def flux(blocks: int, hidden_heads: tuple[int, int], image: int, text: int) -> tuple:
    import diffusers

    heads, head_dim = hidden_heads
    model = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=blocks, num_single_layers=blocks, attention_head_dim=head_dim,
        num_attention_heads=heads, joint_attention_dim=heads * head_dim, pooled_projection_dim=64,
        axes_dims_rope=[head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8])
    generator = torch.Generator().manual_seed(SEED)
    return model, dict(hidden_states=torch.randn(1, image, 64, generator=generator),
                       encoder_hidden_states=torch.randn(1, text, heads * head_dim, generator=generator),
                       pooled_projections=torch.randn(1, 64, generator=generator),
                       img_ids=torch.randn(image, 3, generator=generator),
                       txt_ids=torch.randn(text, 3, generator=generator),
                       timestep=torch.tensor([1.0]))


def wan(blocks: int, hidden_heads: tuple[int, int], image: int, text: int) -> tuple:
    import diffusers

    heads, head_dim = hidden_heads
    model = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=head_dim, in_channels=16,
        out_channels=16, text_dim=heads * head_dim, freq_dim=256, ffn_dim=4 * heads * head_dim, num_layers=blocks,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=64)
    side = int(round((image // 4) ** 0.5))  # 4 latent frames of side x side patches of 2 x 2
    generator = torch.Generator().manual_seed(SEED)
    return model, dict(hidden_states=torch.randn(1, 16, 4, 2 * side, 2 * side, generator=generator),
                       encoder_hidden_states=torch.randn(1, text, heads * head_dim, generator=generator),
                       timestep=torch.tensor([500]))


def ltx(blocks: int, hidden_heads: tuple[int, int], image: int, text: int) -> tuple:
    import diffusers

    heads, head_dim = hidden_heads
    model = diffusers.LTXVideoTransformer3DModel(
        in_channels=32, out_channels=32, num_attention_heads=heads, attention_head_dim=head_dim,
        cross_attention_dim=heads * head_dim, num_layers=blocks, caption_channels=64)
    side = int(round((image // 4) ** 0.5))  # 4 latent frames of side x side
    generator = torch.Generator().manual_seed(SEED)
    return model, dict(hidden_states=torch.randn(1, image, 32, generator=generator),
                       encoder_hidden_states=torch.randn(1, text, 64, generator=generator),
                       timestep=torch.tensor([500]), encoder_attention_mask=torch.ones(1, text, dtype=torch.bool),
                       num_frames=4, height=side, width=side)


MODELS = {"flux": flux, "wan": wan, "ltx": ltx}
TINY = dict(blocks=8, hidden_heads=(2, 16), image=64, text=16)  # >= 8 blocks, tiny widths: compile time
MID = dict(blocks=2, hidden_heads=(8, 128), image=1024, text=256)  # the mid size


def built(name: str, size: dict, dtype: torch.dtype) -> tuple:
    """The model and its call's arguments in ``dtype``; parameters a class initializes to zero (adaLN-zero gates,
    zero output projections) get small random values, else a block may add nothing."""
    torch.manual_seed(SEED)
    model, kwargs = MODELS[name](**size)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.is_floating_point() and not parameter.any():
                parameter.normal_(0.0, 0.1)
    kwargs = {key: value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point()
              and key != "timestep" else value
              for key, value in kwargs.items()}
    return model.eval().to(dtype), kwargs


def sample(output) -> torch.Tensor:
    return output.sample if hasattr(output, "sample") else output[0]


def relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (actual.float() - expected.float()).abs().max().item() / expected.float().abs().max().item()


def compile_child(name: str, mode: str, blocks: str) -> dict:
    """One process: eager, then ``mode`` ("whole" or "regional"): a first (compiling) and a warm call."""
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    model, kwargs = built(name, dict(TINY, blocks=int(blocks)), torch.float32)
    with torch.no_grad():
        expected = sample(model(**kwargs))
        torch._dynamo.utils.counters.clear()
        if mode == "whole":
            call = torch.compile(model, backend="neuron")
        else:
            model.compile_repeated_blocks(backend="neuron", fullgraph=True, dynamic=False)
            call = model
        start = time.process_time()
        actual = sample(call(**kwargs))
        first = time.process_time() - start
        start = time.process_time()
        call(**kwargs)
        warm = time.process_time() - start
    torch.save(actual, os.environ["SCALE_BENCH_OUTPUT"])
    return dict(compile_s=first - warm, graphs=torch._dynamo.utils.counters["stats"]["unique_graphs"],
                error=relative(actual, expected))


def top_kernels(launches, top: int) -> list[str]:
    """The ``top`` costliest kernels of a warm call: estimated us, roofline us, bottleneck."""
    costs = [cost for launch in launches if launch.report is not None
             for cost in launch.report.kernel_costs(launch.kernel)]
    return [f"{cost.name}: {cost.est_time_s * 1e6:.1f} us (roofline {cost.roofline_s * 1e6:.1f} us, "
            f"{cost.bottleneck})" for cost in sorted(costs, key=lambda cost: -cost.est_time_s)[:top]]


def kernel_tables(launches) -> list[str]:
    """Each distinct launch of a warm call (a block class's region kernel; repeats with the same figures counted)
    as kernel_bench's per-kernel table (``--kernels``)."""
    from kernel_bench import section_table

    distinct: dict[tuple, list] = {}
    for launch in launches:
        if launch.report is not None:
            report = launch.report
            key = (launch.kernel, report.est_time_s, tuple((s.name, s.est_time_s) for s in report.sections))
            distinct.setdefault(key, []).append(report)
    lines = []
    for (kernel, est_s, _), reports in distinct.items():
        title = (f"{kernel} ({len(reports)} launches), est {est_s * 1e6:.1f} us each, launch "
                 f"{reports[0].launch_s * 1e6:.1f} us, per kernel:")
        lines += section_table(title, reports[0].sections)
    return lines


def mid_child(name: str, top: str = "0", kernels: str = "0") -> dict:
    import neuron_compile
    from neuron_compile.hardware import get_target
    from flops import flop_counter

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    model, kwargs = built(name, MID, torch.bfloat16)
    counter = flop_counter()
    with torch.no_grad(), counter:
        expected = sample(model(**kwargs))
    target = get_target("trn2")
    inputs = [value for value in kwargs.values() if isinstance(value, torch.Tensor)]
    necessary = sum(t.numel() * t.element_size() for t in [*model.parameters(), *inputs, expected])
    roofline = max(counter.get_total_flops() / (target.tensor_bf16_tflops * 1e12), necessary / target.dma_bytes_per_s)
    model.compile_repeated_blocks(backend="neuron", fullgraph=True, dynamic=False)
    with torch.no_grad():
        model(**kwargs)
        neuron_compile.reset_stats()
        with neuron_compile.record_launches() as launches:
            actual = sample(model(**kwargs))
    stats = neuron_compile.stats()
    return dict(est_s=stats["est_time_s"], roofline_s=roofline, flops=counter.get_total_flops(),
                bytes=necessary, error=relative(actual, expected), eager_nodes=stats["fallback_nodes"],
                top=top_kernels(launches, int(top)), kernels=kernel_tables(launches) if int(kernels) else [])


def warm_start_child(name: str) -> dict:
    """One process: a tiny pipeline's transformer through ``compile_repeated_blocks``, under the
    ``NEURON_COMPILE_CACHE`` the parent set; the first generation's CPU seconds beyond a second one's."""
    import diffusers_pipelines

    import neuron_compile

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    tiny = diffusers_pipelines.PIPELINES[name](torch.float32)
    tiny.pipe.transformer.compile_repeated_blocks(backend="neuron", fullgraph=True, dynamic=False)
    neuron_compile.reset_stats()
    start = time.process_time()
    latents, _ = tiny.generate()
    first = time.process_time() - start
    stats = neuron_compile.stats()
    start = time.process_time()
    tiny.generate()
    warm = time.process_time() - start
    torch.save(latents, os.environ["SCALE_BENCH_OUTPUT"])
    return dict(compile_s=first - warm, hits=stats["disk_cache_hits"], misses=stats["disk_cache_misses"],
                regions=stats["regions_compiled"])


def run_child(*arguments: str, output: str = "", cache: str = "off") -> dict:
    environment = dict(os.environ, NEURON_COMPILE_CACHE=cache, OMP_NUM_THREADS="1", SCALE_BENCH_OUTPUT=output)
    environment["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.abspath(__file__)),
                                                 environment.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, __file__, "--child", *arguments], capture_output=True, text=True,
                          env=environment, timeout=3600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        raise RuntimeError(f"{arguments}: {(done.stderr.strip().splitlines() or ['no output'])[-1]}")
    return json.loads(lines[-1])


def compile_time_table(names: list[str], scratch: str) -> None:
    print("| model | blocks | whole-model compile s | regional compile s | regional / whole | graphs whole / regional "
          "| whole vs regional (relative) | error vs eager whole / regional |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in names:
        paths = {mode: os.path.join(scratch, f"{name}_{mode}.pt") for mode in ("whole", "regional")}
        results = {mode: run_child("compile", name, mode, str(TINY["blocks"]), output=paths[mode]) for mode in paths}
        whole, regional = results["whole"], results["regional"]
        outputs = {mode: torch.load(path) for mode, path in paths.items()}
        between = relative(outputs["regional"], outputs["whole"])
        blocks = 2 * TINY["blocks"] if name == "flux" else TINY["blocks"]
        print(f"| {name} | {blocks} | {whole['compile_s']:.1f} | {regional['compile_s']:.1f} "
              f"| {regional['compile_s'] / whole['compile_s']:.2f} | {whole['graphs']} / {regional['graphs']} "
              f"| {between:.1e} | {whole['error']:.1e} / {regional['error']:.1e} |", flush=True)


def mid_table(names: list[str], top: int, kernels: bool) -> None:
    print("| model | GFLOP | necessary MB | error vs eager (relative) | eager nodes | est. trn2 ms | roofline ms "
          "| x roofline |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    kernel_lines = []
    for name in names:
        result = run_child("mid", name, str(top), str(int(kernels)))
        print(f"| {name} | {result['flops'] / 1e9:.1f} | {result['bytes'] / 1e6:.1f} | {result['error']:.1e} "
              f"| {result['eager_nodes']} | {result['est_s'] * 1e3:.3f} | {result['roofline_s'] * 1e3:.3f} "
              f"| {result['est_s'] / result['roofline_s']:.2f}x |", flush=True)
        for line in result["top"]:
            print(f"  {name} {line}", file=sys.stderr)
        kernel_lines.append("\n".join(result["kernels"]))
    print("\n".join(kernel_lines))


def warm_start_table(names: list[str], scratch: str) -> None:
    print("| pipeline | cold compile s | warm-start compile s | warm / cold | disk cache hits / misses (warm) "
          "| latents equal |")
    print("|---|---:|---:|---:|---:|---|")
    for name in names:
        cache = os.path.join(scratch, f"{name}_cache")  # a fresh directory: the first process fills it
        paths = [os.path.join(scratch, f"{name}_{side}.pt") for side in ("cold", "warm")]
        cold = run_child("warm", name, output=paths[0], cache=cache)
        warm = run_child("warm", name, output=paths[1], cache=cache)
        equal = torch.equal(torch.load(paths[0]), torch.load(paths[1]))
        print(f"| {name} | {cold['compile_s']:.1f} | {warm['compile_s']:.1f} | "
              f"{warm['compile_s'] / cold['compile_s']:.2f} | {warm['hits']} / {warm['misses']} | "
              f"{'yes' if equal else 'NO'} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile-time", action="store_true")
    parser.add_argument("--mid", action="store_true")
    parser.add_argument("--warm-start", action="store_true")
    parser.add_argument("--models", default="flux,wan,ltx")
    parser.add_argument("--blocks", type=int, default=TINY["blocks"],
                        help="--compile-time: blocks of each repeated kind (Flux: double and single each)")
    parser.add_argument("--pipelines", default="flux,ltx")
    parser.add_argument("--top", type=int, default=0, help="--mid: print the N costliest kernels of each row to stderr")
    parser.add_argument("--kernels", action="store_true", help="--mid: after the table, each block's kernels (their "
                        "share of its launch, busiest engine, roofline, HBM bytes), as kernel_bench.py --kernels")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.child:
        kind, *rest = arguments.child
        children = {"compile": compile_child, "mid": mid_child, "warm": warm_start_child}
        print(json.dumps(children[kind](*rest)))
        return
    import tempfile

    names = arguments.models.split(",")
    if arguments.compile_time:
        TINY["blocks"] = arguments.blocks
        with tempfile.TemporaryDirectory() as scratch:
            compile_time_table(names, scratch)
    if arguments.mid:
        mid_table(names, arguments.top, arguments.kernels)
    if arguments.warm_start:
        with tempfile.TemporaryDirectory() as scratch:
            warm_start_table(arguments.pipelines.split(","), scratch)


if __name__ == "__main__":
    main()

"""Whole diffusers pipelines: tiny Flux (image) and LTX (video) from bench/diffusers_pipelines.py, 2 inference
steps from a fixed generator, the transformer through ``compile_repeated_blocks(backend="neuron")`` and the VAE
decoder through ``torch.compile(backend="neuron")``, against eager.

Per pipeline and dtype, each in a fresh process: the largest difference of the final latents and of the decoded
pixels from eager's (and whether both are within the dtype's tolerance), Dynamo graphs compiled (against the
pass-through backend ``eager`` in its own process), the ATen nodes in NKI kernels vs eager (share), the eager
nodes' reasons, the wall time of eager, of the first compiled generation (compiles included) and of a warm one
(the simulator runs every kernel on the CPU), and the estimated trn2 time of the warm generation's kernels.

    PYTHONPATH=. python bench/diffusers_pipeline_bench.py
    PYTHONPATH=. python bench/diffusers_pipeline_bench.py --pipelines flux --dtypes fp32
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

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Largest difference allowed, relative to eager's largest magnitude: fp32 sums in another order; bf16 rounds every
# kernel's output to 8 bits of mantissa (the lowering tests' bf16 tolerance, a few ulps of the largest value).
TOLERANCES = {"fp32": 1e-5, "bf16": 2e-2}


def child(name: str, dtype_name: str, backend: str) -> dict:
    """One process: build, eager generation, compile, a first (compiling) and a warm compiled generation."""
    import diffusers_pipelines

    import neuron_compile

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    tiny = diffusers_pipelines.PIPELINES[name](DTYPES[dtype_name])
    start = time.perf_counter()
    expected_latents, expected_pixels = tiny.generate()
    eager_s = time.perf_counter() - start
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    neuron_compile.reset_stats()
    tiny.compile(backend)
    start = time.perf_counter()
    latents, pixels = tiny.generate()
    first_s = time.perf_counter() - start
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    stats = neuron_compile.stats()
    neuron_compile.reset_stats()
    start = time.perf_counter()
    tiny.generate()
    warm_s = time.perf_counter() - start
    warm = neuron_compile.stats()

    def error(actual, expected):
        return (actual.float() - expected.float()).abs().max().item() / expected.float().abs().max().item()

    return dict(latents=error(latents, expected_latents), pixels=error(pixels, expected_pixels), graphs=graphs,
                nki=stats["nki_nodes"], fallback=stats["fallback_nodes"],
                reasons=stats["fallback_reasons"].most_common(),
                eager_s=eager_s, first_s=first_s, warm_s=warm_s, est_s=warm["est_time_s"],
                roofline_s=warm["roofline_s"])


def run_child(name: str, dtype_name: str, backend: str) -> dict:
    environment = {**os.environ, "NEURON_COMPILE_CACHE": "off", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, __file__, "--child", name, dtype_name, backend]
    result = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=3600)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode or not lines:
        return dict(failed=(result.stderr.strip().splitlines() or ["no output"])[-1])
    return json.loads(lines[-1])


def row(name: str, dtype_name: str, ours: dict, reference: dict) -> str:
    if "failed" in ours:
        return f"| {name} | {dtype_name} | failed: {ours['failed']} |" + " |" * 9
    within = max(ours["latents"], ours["pixels"]) <= TOLERANCES[dtype_name]
    share = ours["nki"] / max(1, ours["nki"] + ours["fallback"])
    reasons = "; ".join(f"{reason} (x{count})" for reason, count in ours["reasons"]) or "none"
    return (f"| {name} | {dtype_name} | {ours['latents']:.1e} / {ours['pixels']:.1e} | {'yes' if within else 'NO'} "
            f"| {ours['graphs']}/{reference.get('graphs', '?')} | {ours['nki']}/{ours['fallback']} | {share:.1%} "
            f"| {reasons} | {ours['eager_s']:.2f} | {ours['first_s']:.1f} | {ours['warm_s']:.1f} "
            f"| {ours['est_s'] * 1e3:.2f} ({ours['roofline_s'] * 1e3:.2f}) |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipelines", default="flux,ltx")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--child", nargs=3, metavar=("PIPELINE", "DTYPE", "BACKEND"))
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    print("| pipeline | dtype | error latents / pixels (relative) | within tolerance | graphs ours/pass-through "
          "| NKI / eager nodes | NKI share | eager nodes | eager s | first compiled s | warm compiled s "
          "| est. trn2 ms (roofline) |")
    print("|---|---|---:|---|---:|---:|---:|---|---:|---:|---:|---:|")
    for name in args.pipelines.split(","):
        for dtype_name in args.dtypes.split(","):
            reference = run_child(name, dtype_name, "eager")
            print(row(name, dtype_name, run_child(name, dtype_name, "neuron"), reference), flush=True)


if __name__ == "__main__":
    main()

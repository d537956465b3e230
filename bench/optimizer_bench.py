"""AdamW alone at a training bench's model size: one compiled ``optimizer.step`` (``foreach=True``, bf16 parameters,
gradients and state, random weights and gradients) against the bytes it must move, and its most expensive kernels.

The step's HBM roofline is 14 bytes per parameter element at the DMA bandwidth: the parameter read and written, the
gradient read, both moments read and written (2 bytes each). Prints the estimate of the third (steady) step, its
lower bound (each launch's busiest engine), the roofline and the ratio, each engine's busy time, then the top
kernels. Default: the goal
point of issue 17 (a 1-layer Llama at hidden 2048, 32 heads and 4 KV heads of 64, intermediate 5632, vocab 1024).

    PYTHONPATH=. OMP_NUM_THREADS=1 NEURON_COMPILE_CACHE=off .venv/bin/python bench/optimizer_bench.py
"""

from __future__ import annotations

import argparse
import time

import torch
from train_bench import _model

import neuron_compile
from neuron_compile.hardware import get_target

GOAL_POINT = dict(vocab_size=1024, hidden_size=2048, intermediate_size=5632, num_hidden_layers=1,
                  num_attention_heads=32, num_key_value_heads=4, head_dim=64, max_position_embeddings=256)
BYTES_PER_ELEMENT = 14  # bf16: parameter read + written, gradient read, two moments read + written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=6, help="kernels to list")
    args = parser.parse_args()
    parameters = list(_model("llama", torch.bfloat16, GOAL_POINT).parameters())
    optimizer = torch.optim.AdamW(parameters, lr=1e-3, foreach=True)
    step = torch.compile(optimizer.step, backend="neuron")
    generator = torch.Generator().manual_seed(0)
    for _ in range(2):
        for parameter in parameters:
            parameter.grad = torch.randn(parameter.shape, generator=generator).to(parameter.dtype)
        step()
    started = time.perf_counter()
    with neuron_compile.record_launches() as launches:
        step()
    wall = time.perf_counter() - started
    reports = [launch for launch in launches if launch.report is not None]
    estimate = sum(launch.report.est_time_s for launch in reports)
    lower_bound = sum(launch.report.est_lower_bound_s for launch in reports)
    elements = sum(parameter.numel() for parameter in parameters)
    roofline = BYTES_PER_ELEMENT * elements / get_target().dma_bytes_per_s
    print("| parameters | est us | lower bound us | bytes roofline us | est / roofline | wall s |")
    print("|---:|---:|---:|---:|---:|---:|")
    print(f"| {elements} | {estimate * 1e6:.1f} | {lower_bound * 1e6:.1f} | {roofline * 1e6:.1f} | "
          f"{estimate / roofline:.2f}x | {wall:.1f} |")
    busy = {engine: sum(launch.report.busy_s_per_engine.get(engine, 0.0) for launch in reports)
            for engine in ("vector", "gpsimd", "scalar", "dma")}
    print("busy us per engine: " + ", ".join(f"{engine} {seconds * 1e6:.1f}" for engine, seconds in busy.items()))
    costs = [cost for launch in reports for cost in launch.report.kernel_costs(launch.kernel)]
    for cost in sorted(costs, key=lambda cost: -cost.est_time_s)[:args.top]:
        print(f"- {cost.name}: {cost.est_time_s * 1e6:.1f} us ({cost.bottleneck}; lower bound "
              f"{cost.lower_bound_s * 1e6:.1f}, roofline {cost.roofline_s * 1e6:.1f})")


if __name__ == "__main__":
    main()

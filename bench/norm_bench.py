"""Benchmark: the normalization kernels of the diffusers transformers at the mid size (issue 12), one table.

Each graph through ``torch.compile(backend="neuron")`` on the simulator, random inputs, bf16: the estimated trn2
time of a warm call (the launches' cost reports summed), the DMA engines' busy time (what a norm adds to a region
launch whose DMA pool is its bottleneck), the roofline (bytes / DMA bandwidth) and the largest difference from
eager relative to eager's largest value.

* ``qk_statistic``: Flux's q / k RMSNorm statistic alone, ``rsqrt(mean(x * x) + eps)`` over [1, 1280, 8, 128];
* ``qk_rms_norm``: the whole q / k RMSNorm with its weight (one kernel with a row epilogue), as Flux runs it;
* ``transposed_qk_rms_norm``: Gemma3's q norm, ``x * rsqrt(mean(x * x) + eps) * (1 + w)`` over the heads of
  [1, 256, 32, 64] projection rows viewed heads first (the rows of one position lie side by side in memory);
* ``layer_norm``: ``layer_norm`` over [1, 1280, 1024] (Flux's AdaLayerNorm before its modulation);
* ``wan_norm``: Wan's FP32LayerNorm and modulation, ``(layer_norm(x.float()) * (1 + scale) + shift).to(bf16)``
  over [1, 1024, 1024].

    PYTHONPATH=. python bench/norm_bench.py
"""

from __future__ import annotations

import warnings

import torch

import neuron_compile
from neuron_compile.hardware import get_target

EPS = 1e-6


def qk_statistic(x):
    return torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + EPS)


def qk_rms_norm(x, weight):
    normalized = x.float() * qk_statistic(x)
    return (normalized.to(weight.dtype) * weight).to(x.dtype)


def transposed_qk_rms_norm(x, weight):
    """Gemma3's q norm: over the heads of [batch, seq, heads, dim] projection rows viewed [batch, heads, seq, dim]."""
    heads_first = x.transpose(1, 2)
    normalized = heads_first.float() * qk_statistic(heads_first)
    return (normalized * (1.0 + weight.float())).to(x.dtype)


def layer_norm(x):
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), eps=EPS)


def wan_norm(x, scale, shift):
    normalized = torch.nn.functional.layer_norm(x.float(), (x.shape[-1],), eps=EPS)
    return (normalized * (1 + scale) + shift).to(torch.bfloat16)


def cases() -> dict:
    generator = torch.Generator().manual_seed(0)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=generator).to(dtype)

    heads = randn(1, 1280, 8, 128)
    return {
        "qk_statistic": (qk_statistic, (heads,)),
        "qk_rms_norm": (qk_rms_norm, (heads, randn(128))),
        "transposed_qk_rms_norm": (transposed_qk_rms_norm, (randn(1, 256, 32, 64), randn(64))),
        "layer_norm": (layer_norm, (randn(1, 1280, 1024),)),
        "wan_norm": (wan_norm, (randn(1, 1024, 1024), randn(1, 1, 1024, dtype=torch.float32),
                                randn(1, 1, 1024, dtype=torch.float32))),
    }


def measure(fn, inputs) -> dict:
    compiled = torch.compile(fn, backend="neuron", fullgraph=True, dynamic=False)
    compiled(*inputs)  # compile
    neuron_compile.reset_stats()
    with neuron_compile.record_launches() as launches:
        actual = compiled(*inputs)
    expected = fn(*inputs)
    target = get_target("trn2")
    moved = sum(t.numel() * t.element_size() for t in (*inputs, expected))
    error = ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()
    return dict(est_us=neuron_compile.stats()["est_time_s"] * 1e6,
                dma_us=sum(launch.report.busy_s_per_engine.get("dma", 0.0) for launch in launches) * 1e6,
                roofline_us=moved / target.dma_bytes_per_s * 1e6, error=error)


def main() -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    print("| graph | est. trn2 us | DMA busy us | roofline us | x roofline | error vs eager (relative) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, (fn, inputs) in cases().items():
        row = measure(fn, inputs)
        print(f"| {name} | {row['est_us']:.1f} | {row['dma_us']:.1f} | {row['roofline_us']:.1f} | "
              f"{row['est_us'] / row['roofline_us']:.2f}x | {row['error']:.1e} |", flush=True)


if __name__ == "__main__":
    main()

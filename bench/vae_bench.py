"""Benchmark: diffusers VAE decoders through ``torch.compile(backend="neuron")`` against their roofline (issue 12).

Per decoder and dtype: the largest difference from eager (relative to eager's largest value), ATen nodes in NKI
kernels, kernels launched, the estimated trn2 time of a warm call (the simulator's cost reports summed) and the
graph roofline ``max(FLOPs / TensorE peak, (parameters + input + output) bytes / DMA bandwidth)`` with FLOPs from
``torch.utils.flop_counter.FlopCounterMode`` (attention counted too: bench/flops.py) and trn2's numbers from
``neuron_compile/hardware.py``.

Decoders (random weights, configs built in code, nothing downloaded), a size between the pipelines' tiny ones and
the real models: Flux's two-level AutoencoderKL decoder with 128/256 channels decoding 16 x 16 x 16 latents into
32 x 32 pixels, and LTX-Video's 3-D decoder with 64/128 channels decoding 3 latent frames of 8 x 8 into 5 frames
of 16 x 16.

    PYTHONPATH=. python bench/vae_bench.py
    PYTHONPATH=. python bench/vae_bench.py --decoders flux --dtypes bf16
"""

from __future__ import annotations

import argparse
import sys
import warnings

import diffusers
import torch
from flops import flop_counter

import neuron_compile
from neuron_compile.hardware import get_target

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def flux_decoder() -> tuple[torch.nn.Module, torch.Tensor]:
    vae = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=[128, 256], layers_per_block=1,
        latent_channels=16, norm_num_groups=32, use_quant_conv=False, use_post_quant_conv=False)
    return vae.decoder, torch.randn(1, 16, 16, 16)


def ltx_decoder() -> tuple[torch.nn.Module, torch.Tensor]:
    vae = diffusers.AutoencoderKLLTXVideo(
        in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(64, 64, 128, 128),
        decoder_block_out_channels=(64, 64, 128, 128), layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1, 1), spatio_temporal_scaling=(True, False, False, False),
        decoder_spatio_temporal_scaling=(True, False, False, False),
        decoder_inject_noise=(False, False, False, False, False), upsample_residual=(False, False, False, False),
        upsample_factor=(1, 1, 1, 1), timestep_conditioning=False, patch_size=1, patch_size_t=1,
        encoder_causal=True, decoder_causal=False)
    return vae.decoder, torch.randn(1, 16, 3, 8, 8)


DECODERS = {"flux": flux_decoder, "ltx": ltx_decoder}


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def roofline_s(decoder: torch.nn.Module, latents: torch.Tensor, output: torch.Tensor) -> float:
    target = get_target("trn2")
    counter = flop_counter()
    with torch.no_grad(), counter:
        decoder(latents)
    peak = (target.tensor_bf16_tflops if latents.dtype == torch.bfloat16 else target.tensor_fp32_tflops) * 1e12
    necessary = tensor_bytes([*decoder.parameters(), latents, output])
    return max(counter.get_total_flops() / peak, necessary / target.dma_bytes_per_s)


def print_top_kernels(launches, top: int) -> None:
    """The ``top`` costliest kernels of the warm call (to stderr): estimated us, roofline us, bottleneck."""
    costs = [cost for launch in launches if launch.report is not None
             for cost in launch.report.kernel_costs(launch.kernel)]
    for cost in sorted(costs, key=lambda cost: -cost.est_time_s)[:top]:
        print(f"  {cost.name}: {cost.est_time_s * 1e6:.1f} us (roofline {cost.roofline_s * 1e6:.1f} us, "
              f"{cost.bottleneck})", file=sys.stderr)


def measure(name: str, dtype: torch.dtype, top: int = 0) -> str:
    torch.manual_seed(0)
    decoder, latents = DECODERS[name]()
    decoder, latents = decoder.eval().to(dtype), latents.to(dtype)
    with torch.no_grad():
        expected = decoder(latents)
    torch._dynamo.reset()
    compiled = torch.compile(decoder, backend="neuron")
    with torch.no_grad():
        neuron_compile.reset_stats()
        compiled(latents)
        nodes = neuron_compile.stats()
        neuron_compile.reset_stats()
        with neuron_compile.record_launches() as launches:
            actual = compiled(latents)
    stats = neuron_compile.stats()
    if top:
        print_top_kernels(launches, top)
    error = (actual.float() - expected.float()).abs().max().item() / expected.float().abs().max().item()
    roof = roofline_s(decoder, latents, expected)
    est = stats["est_time_s"]
    return (f"| {name} | {tuple(latents.shape)} -> {tuple(expected.shape)} | {str(dtype)[6:]} | {error:.1e} "
            f"| {nodes['nki_nodes']}/{nodes['fallback_nodes']} | {stats['kernels_launched']} | {est * 1e3:.3f} "
            f"| {roof * 1e3:.3f} | {est / roof:.1f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decoders", default="flux,ltx")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--top", type=int, default=0, help="print the N costliest kernels of each row to stderr")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    print("| decoder | latents -> pixels | dtype | max error (relative) | NKI / eager nodes | kernels launched "
          "| est. trn2 ms | roofline ms | x roofline |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for name in args.decoders.split(","):
        for dtype_name in args.dtypes.split(","):
            print(measure(name, DTYPES[dtype_name], args.top), flush=True)


if __name__ == "__main__":
    main()

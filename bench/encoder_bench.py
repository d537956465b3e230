"""Benchmark: ``nn.TransformerEncoderLayer`` in eval mode (its fast path: one ``aten._transformer_encoder_layer_fwd``
node per layer) through ``torch.compile(backend="neuron")`` vs eager (issue 16).

Per case (d_model 512, 8 heads, feed-forward 2048, batch 4; seq 128 and 512; fp32 and bf16; no mask or a key-padding
mask; post-norm relu and pre-norm gelu), under ``torch.no_grad()``: the max abs error against eager, the ATen nodes in
NKI kernels and eager (before the fast path was decomposed, the layer was one eager node: 0% in kernels), the kernels
of the launch, whether attention ran as the flash kernel, the estimated trn2 time (``est_time_s``) and the roofline:
max(FLOPs at TensorE peak, (weights + input + output) bytes at DMA bandwidth), FLOPs = the four projections and the
feed-forward pair (2 x tokens x (4 d^2 + 2 d ff)) plus attention's 4 x batch x S^2 x d.

    python bench/encoder_bench.py            # 16 cases
    python bench/encoder_bench.py --quick    # seq 128 only

Progress goes to stderr; the table (markdown) to stdout.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

import torch
import torch.nn as nn

import neuron_compile
from neuron_compile.hardware import get_target

D_MODEL, HEADS, FEED_FORWARD, BATCH = 512, 8, 2048, 4
SEQS = (128, 512)
VARIANTS = {"post-norm relu": {"activation": "relu", "norm_first": False},
            "pre-norm gelu": {"activation": "gelu", "norm_first": True}}


def roofline_s(seq: int, dtype: torch.dtype, layer: nn.Module) -> float:
    target = get_target("trn2")
    tokens = BATCH * seq
    flops = 2 * tokens * (4 * D_MODEL ** 2 + 2 * D_MODEL * FEED_FORWARD) + 4 * BATCH * seq * seq * D_MODEL
    itemsize = 2 if dtype == torch.bfloat16 else 4
    weights = sum(p.numel() for p in layer.parameters()) * itemsize
    peak = (target.tensor_bf16_tflops if dtype == torch.bfloat16 else target.tensor_fp32_tflops) * 1e12
    return max(flops / peak, (weights + 2 * tokens * D_MODEL * itemsize) / target.dma_bytes_per_s)


def measure(seq: int, dtype: torch.dtype, variant: str, padded: bool) -> str:
    torch.manual_seed(seq)
    layer = nn.TransformerEncoderLayer(D_MODEL, HEADS, FEED_FORWARD, dropout=0.0, batch_first=True,
                                       **VARIANTS[variant]).eval().to(dtype)
    x = torch.randn(BATCH, seq, D_MODEL).to(dtype)
    mask = None
    if padded:  # the last quarter of every other sequence is padding
        mask = torch.zeros(BATCH, seq, dtype=torch.bool)
        mask[1::2, 3 * seq // 4:] = True
    torch._dynamo.reset()
    neuron_compile.reset_stats()
    with torch.no_grad(), neuron_compile.config.patch(fallback="raise"), \
            neuron_compile.record_launches() as launches:
        got = torch.compile(layer, backend="neuron")(x, src_key_padding_mask=mask)
        want = layer(x, src_key_padding_mask=mask)
    stats = neuron_compile.stats()
    est = sum(float(launch.report.est_time_s) for launch in launches if launch.report is not None)
    kernels = [section.name for launch in launches if launch.report is not None for section in launch.report.sections]
    flash = any(name.startswith("attention_kernel") for name in kernels)
    error = float((got.float() - want.float()).nan_to_num(0.0).abs().max())
    bound = roofline_s(seq, dtype, layer)
    cells = [str(seq), "bf16" if dtype == torch.bfloat16 else "fp32", variant, "padding" if padded else "-",
             f"{error:.1e}", f"{stats['nki_nodes']} / {stats['fallback_nodes']}", str(len(kernels)),
             "yes" if flash else "no", f"{est * 1e6:.1f}", f"{bound * 1e6:.1f}", f"{est / bound:.2f}x"]
    return "| " + " | ".join(cells) + " |"


HEADER = ("| seq | dtype | layer | mask | max abs err | ATen nodes NKI / eager | kernels | flash attention | est us "
          "| roofline us | est / roofline |\n|---:|---|---|---|---:|---:|---:|---|---:|---:|---:|")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="seq 128 only")
    args = parser.parse_args(argv)
    rows = []
    started = time.time()
    for seq, dtype, variant, padded in itertools.product(SEQS[:1] if args.quick else SEQS,
                                                         (torch.float32, torch.bfloat16), VARIANTS, (False, True)):
        print(f"[{time.time() - started:6.0f} s] seq {seq} {dtype} {variant} padded {padded}", file=sys.stderr,
              flush=True)
        rows.append(measure(seq, dtype, variant, padded))
    print(HEADER)
    print("\n".join(rows))
    print(f"\n(measured in {time.time() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark: scaled-dot-product attention alone, the flash-attention kernel against the three-kernel form and the
roofline (issue 16).

For each case (batch 1, 2 heads; seq 128, 1024, 4096, 8192; head dim 64 and 128; causal or not; fp32 and bf16),
in one run: ``F.scaled_dot_product_attention`` through ``torch.compile(backend="neuron")`` with the flash kernel
(the default) and with ``config.patch(flash_attention=False)`` (scores, softmax and output as three kernels, the
scores through HBM); for each, the kernels run (one launch per region), HBM bytes (the simulator's cost reports)
and the estimated trn2 time (each launch's ``est_time_s`` summed: the launch plus its scheduled instructions).
The roofline is ``max(4 * S^2 * D * heads FLOPs / TensorE peak, (q + k + v + out) bytes / DMA bandwidth)`` with
trn2's numbers from ``neuron_compile/hardware.py`` (FLOPs as FlopCounterMode counts SDPA: causal counts the full
square). Every result is checked against eager (max abs error shown).

    python bench/attention_bench.py            # every case (the three-kernel form up to seq 4096; ~10 min)
    python bench/attention_bench.py --quick    # seq 128 and 1024 only
    python bench/attention_bench.py --seqs 1024,4096 --engines  # chosen lengths, busy time per engine
    python bench/attention_bench.py --backward # the backward instead (see below)
    python bench/attention_bench.py --backward --seqs 256 --head-dims 64 --dtypes bf16 --causal yes --heads 32 \
        --kv-heads 4 --fused-only              # the backward at the 1-layer Llama goal point's shapes
    python bench/attention_bench.py --decode   # decode steps instead (see below)
    python bench/attention_bench.py --mid --engines  # the diffusers mid size's self-attention (see below)

``--backward``: ``aten._scaled_dot_product_flash_attention_for_cpu_backward`` alone (dO, q, k, v, the forward's
output and log-sum-exp from eager), the fused backward kernel (one kernel: P and dS stay on chip) against the
separate kernels (``flash_attention=False``: P and dS through HBM) and the roofline: ``max(2.5 x the forward's FLOPs
/ TensorE peak, (q + k + v + o + dO + dq + dk + dv) bytes / DMA bandwidth)``; errors against eager's fp32 backward.

``--decode``: one decode step's attention, one query per head (16 query heads on 2 key/value heads, as the 4-layer
Llama of bench/generate_bench.py) against a static cache of 512 / 2048 / 8192 positions (``--quick``: 512 and 2048)
with transformers' cache mask (finfo.min after the position), head dim 64 and 128, fp32 and bf16: the split-key
decode form (kinds/attention_decode.py, the default) against the flash kernel's query tiles (``flash_decode=False``),
one run each; roofline ``max(4 * cache * D * heads FLOPs / TensorE peak, (q + k + v + mask + out) bytes / DMA
bandwidth)``; errors against eager in fp32.

``--mid``: the self-attention of bench/diffusers_scale_bench.py's mid size (issue 12): 8 heads of 128, bf16,
non-causal, q, k and v viewed heads-first from [batch, seq, heads, D] projections, over 1024 tokens (Wan, LTX-Video)
and 1280 (Flux: 1024 image + 256 text tokens); the forward table's columns.

Progress goes to stderr; the table (markdown) to stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
import time

import torch
import torch.nn.functional as F

import neuron_compile
from neuron_compile.errors import NeuronCompileError
from neuron_compile.hardware import get_target

SEQS = (128, 1024, 4096, 8192)
QUICK_SEQS = (128, 1024)
HEAD_DIMS = (64, 128)
HEADS = 2
MID_HEADS, MID_DEPTH, MID_SEQS = 8, 128, (1024, 1280)  # the diffusers mid size's self-attention
THREE_KERNEL_MAX_SEQ = 4096  # beyond this the three-kernel form's S x S scores make the simulation too slow here
# (at 4096 in fp32 its softmax row no longer fits SBUF: the table says so)


@dataclasses.dataclass
class Measured:
    kernels: int
    hbm_bytes: int
    est_s: float
    max_error: float
    busy_s: dict = dataclasses.field(default_factory=dict)  # busy seconds per engine, over the launches


def run(q, k, v, causal: bool, flash: bool) -> Measured:
    torch._dynamo.reset()
    neuron_compile.reset_stats()
    compiled = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                             backend="neuron")
    with neuron_compile.config.patch(flash_attention=flash, fallback="raise"), \
            neuron_compile.record_launches() as launches:
        got = compiled(q, k, v)
    stats = neuron_compile.stats()
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
    est = sum(float(launch.report.est_time_s) for launch in launches if launch.report is not None)
    kernels = sum(len(launch.report.sections) for launch in launches if launch.report is not None)
    busy: dict = {}
    for launch in launches:
        for engine, seconds in (launch.report.busy_s_per_engine if launch.report is not None else {}).items():
            busy[engine] = busy.get(engine, 0.0) + seconds
    return Measured(kernels, stats["hbm_bytes"], est, float((got.float() - want).abs().max()), busy)


ENGINES = ("scalar", "vector", "tensor", "gpsimd", "dma")


def roofline_s(seq: int, depth: int, dtype: torch.dtype, heads: int = HEADS) -> tuple[float, str, int]:
    target = get_target("trn2")
    flops = 4 * heads * seq * seq * depth
    peak = (target.tensor_bf16_tflops if dtype == torch.bfloat16 else target.tensor_fp32_tflops) * 1e12
    operand_bytes = 4 * heads * seq * depth * (2 if dtype == torch.bfloat16 else 4)
    compute, memory = flops / peak, operand_bytes / target.dma_bytes_per_s
    return max(compute, memory), "c" if compute >= memory else "m", operand_bytes


def measure(seq: int, depth: int, causal: bool, dtype: torch.dtype, engines: bool = False, mid: bool = False) -> str:
    generator = torch.Generator().manual_seed(seq + depth)
    if mid:  # [batch, seq, heads, D] projections viewed heads-first, as diffusers' attention processors do
        q, k, v = (torch.randn(1, seq, MID_HEADS, depth, generator=generator).to(dtype).transpose(1, 2)
                   for _ in range(3))
    else:
        q, k, v = (torch.randn(1, HEADS, seq, depth, generator=generator).to(dtype) for _ in range(3))
    flash = run(q, k, v, causal, flash=True)
    three = None
    if seq <= THREE_KERNEL_MAX_SEQ and not mid:
        try:
            three = run(q, k, v, causal, flash=False)
        except NeuronCompileError:  # a softmax row of S fp32 scores no longer fits SBUF
            three = "does not fit"
    bound, kind, operand_bytes = roofline_s(seq, depth, dtype, MID_HEADS if mid else HEADS)
    name = "bf16" if dtype == torch.bfloat16 else "fp32"
    cells = [str(seq), str(depth), "yes" if causal else "no", name, f"{operand_bytes / 1e6:.2f}",
             f"{flash.kernels}", f"{flash.hbm_bytes / 1e6:.2f}", f"{flash.hbm_bytes / operand_bytes:.2f}x",
             f"{flash.est_s * 1e6:.1f}", f"{bound * 1e6:.1f} ({kind})", f"{flash.est_s / bound:.2f}x"]
    if isinstance(three, str):
        cells += [three, "-", "-", "-"]
    elif three:
        cells += [f"{three.kernels}", f"{three.hbm_bytes / 1e6:.2f}", f"{three.est_s * 1e6:.1f}",
                  f"{three.est_s / flash.est_s:.2f}x"]
    else:
        cells += ["-", "-", "-", "-"]
    errors = [flash.max_error] + ([three.max_error] if isinstance(three, Measured) else [])
    cells.append(f"{max(errors):.1e}")
    if engines:
        cells.append(" / ".join(f"{flash.busy_s.get(engine, 0.0) * 1e6:.1f}" for engine in ENGINES))
    return "| " + " | ".join(cells) + " |"


HEADER = ("| seq | D | causal | dtype | q+k+v+o MB | flash kernels | flash HBM MB | flash / (q+k+v+o) | flash est us "
          "| roofline us | flash / roofline | 3-kernel kernels | 3-kernel HBM MB | 3-kernel est us "
          "| 3-kernel / flash | max abs err |\n"
          "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
BACKWARD_SEPARATE_MAX_SEQ = 4096  # the separate kernels' P and dS (S x S each) make the simulation too slow beyond


def run_backward(inputs, causal: bool, fused: bool, want) -> Measured:
    torch._dynamo.reset()
    neuron_compile.reset_stats()
    compiled = torch.compile(lambda *args: FLASH_BACKWARD(*args, 0.0, causal), backend="neuron")
    with neuron_compile.config.patch(flash_attention=fused, fallback="raise"), \
            neuron_compile.record_launches() as launches, torch.no_grad():
        got = compiled(*inputs)
    stats = neuron_compile.stats()
    est = sum(float(launch.report.est_time_s) for launch in launches if launch.report is not None)
    kernels = sum(len(launch.report.sections) for launch in launches if launch.report is not None)
    error = max(float((ours.float() - eager).abs().max()) for ours, eager in zip(got, want))
    return Measured(kernels, stats["hbm_bytes"], est, error)


def backward_inputs(seq: int, depth: int, causal: bool, dtype: torch.dtype, heads: int = HEADS,
                    kv_heads: int = HEADS):
    """(dO, q, k, v, out, logsumexp) in ``dtype`` (the log-sum-exp fp32; k and v with ``kv_heads`` heads, each
    shared by ``heads // kv_heads`` query heads) and eager's fp32 gradients."""
    generator = torch.Generator().manual_seed(seq + depth + 1)
    q, grad = (torch.randn(1, heads, seq, depth, generator=generator) for _ in range(2))
    k, v = (torch.randn(1, kv_heads, seq, depth, generator=generator) for _ in range(2))
    group = heads // kv_heads
    out, logsumexp = FLASH(q.to(dtype), k.to(dtype).repeat_interleave(group, 1), v.to(dtype).repeat_interleave(
        group, 1), is_causal=causal)[:2]
    want = FLASH_BACKWARD(grad, q, k, v, out.float(), logsumexp, 0.0, causal)
    return (grad.to(dtype), q.to(dtype), k.to(dtype), v.to(dtype), out, logsumexp), want


def measure_backward(seq: int, depth: int, causal: bool, dtype: torch.dtype, heads: int = HEADS,
                     kv_heads: int = HEADS, separate_max_seq: int = BACKWARD_SEPARATE_MAX_SEQ) -> str:
    inputs, want = backward_inputs(seq, depth, causal, dtype, heads, kv_heads)
    fused = run_backward(inputs, causal, True, want)
    separate = None
    if seq <= separate_max_seq:
        try:
            separate = run_backward(inputs, causal, False, want)
        except NeuronCompileError:  # their matmuls over 4096 fp32 keys overflow SBUF: the table says so
            separate = "does not fit"
    target = get_target("trn2")
    peak = (target.tensor_bf16_tflops if dtype == torch.bfloat16 else target.tensor_fp32_tflops) * 1e12
    operand_bytes = 4 * (heads + kv_heads) * seq * depth * (2 if dtype == torch.bfloat16 else 4)
    compute, memory = 2.5 * 4 * heads * seq * seq * depth / peak, operand_bytes / target.dma_bytes_per_s
    bound, kind = max(compute, memory), "c" if compute >= memory else "m"
    cells = [str(seq), str(depth), "yes" if causal else "no", "bf16" if dtype == torch.bfloat16 else "fp32",
             f"{operand_bytes / 1e6:.2f}", f"{fused.kernels}", f"{fused.hbm_bytes / 1e6:.2f}",
             f"{fused.hbm_bytes / operand_bytes:.2f}x", f"{fused.est_s * 1e6:.1f}", f"{bound * 1e6:.1f} ({kind})",
             f"{fused.est_s / bound:.2f}x"]
    if isinstance(separate, Measured):
        cells += [f"{separate.kernels}", f"{separate.hbm_bytes / 1e6:.2f}", f"{separate.est_s * 1e6:.1f}",
                  f"{separate.est_s / fused.est_s:.2f}x"]
    else:
        cells += [separate or "-", "-", "-", "-"]
    errors = [fused.max_error] + ([separate.max_error] if isinstance(separate, Measured) else [])
    return "| " + " | ".join(cells + [f"{max(errors):.1e}"]) + " |"


BACKWARD_HEADER = (
    "| seq | D | causal | dtype | q,k,v,o,dO,dq,dk,dv MB | fused kernels | fused HBM MB | fused / operands "
    "| fused est us | roofline us | fused / roofline | separate kernels | separate HBM MB | separate est us "
    "| separate / fused | max abs err |\n"
    "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


DECODE_CACHES = (512, 2048, 8192)
QUICK_DECODE_CACHES = (512, 2048)
DECODE_HEADS, DECODE_KV_HEADS = 16, 2


def decode_inputs(cache: int, depth: int, dtype: torch.dtype):
    """q [1, 16, 1, D], k and v [1, 2, cache, D] and transformers' static-cache mask at 3/4 of the cache."""
    generator = torch.Generator().manual_seed(cache + depth)
    q = torch.randn(1, DECODE_HEADS, 1, depth, generator=generator).to(dtype)
    k, v = (torch.randn(1, DECODE_KV_HEADS, cache, depth, generator=generator).to(dtype) for _ in range(2))
    mask = torch.zeros(1, 1, 1, cache, dtype=dtype)
    mask[..., cache * 3 // 4 + 1:] = torch.finfo(dtype).min
    return q, k, v, mask


def decode_step(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def run_decode(inputs, split: bool) -> Measured:
    torch._dynamo.reset()
    neuron_compile.reset_stats()
    with neuron_compile.config.patch(flash_decode=split, fallback="raise"), \
            neuron_compile.record_launches() as launches:
        got = torch.compile(decode_step, backend="neuron")(*inputs)
    want = decode_step(*(tensor.float() for tensor in inputs))
    est = sum(float(launch.report.est_time_s) for launch in launches if launch.report is not None)
    kernels = sum(len(launch.report.sections) for launch in launches if launch.report is not None)
    return Measured(kernels, neuron_compile.stats()["hbm_bytes"], est, float((got.float() - want).abs().max()))


def measure_decode(cache: int, depth: int, dtype: torch.dtype) -> str:
    inputs = decode_inputs(cache, depth, dtype)
    split, flash = run_decode(inputs, True), run_decode(inputs, False)
    target = get_target("trn2")
    peak = (target.tensor_bf16_tflops if dtype == torch.bfloat16 else target.tensor_fp32_tflops) * 1e12
    operand_bytes = sum(t.numel() * t.element_size() for t in inputs) + inputs[0].numel() * inputs[0].element_size()
    compute, memory = 4 * DECODE_HEADS * cache * depth / peak, operand_bytes / target.dma_bytes_per_s
    bound, kind = max(compute, memory), "c" if compute >= memory else "m"
    cells = [str(cache), str(depth), "bf16" if dtype == torch.bfloat16 else "fp32", f"{operand_bytes / 1e6:.3f}",
             f"{split.kernels}", f"{split.hbm_bytes / operand_bytes:.2f}x", f"{split.est_s * 1e6:.2f}",
             f"{flash.est_s * 1e6:.2f}", f"{flash.est_s / split.est_s:.2f}x", f"{bound * 1e6:.2f} ({kind})",
             f"{split.est_s / bound:.2f}x", f"{max(split.max_error, flash.max_error):.1e}"]
    return "| " + " | ".join(cells) + " |"


DECODE_HEADER = (
    "| cache | D | dtype | q,k,v,mask,o MB | split kernels | split HBM / operands | split est us | flash est us "
    "| flash / split | roofline us | split / roofline | max abs err |\n"
    "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def main_decode(quick: bool) -> int:
    rows, started = [], time.time()
    for cache, depth, dtype in itertools.product(QUICK_DECODE_CACHES if quick else DECODE_CACHES, HEAD_DIMS,
                                                 (torch.float32, torch.bfloat16)):
        print(f"[{time.time() - started:6.0f} s] decode: cache {cache} D {depth} {dtype}", file=sys.stderr, flush=True)
        rows.append(measure_decode(cache, depth, dtype))
    print(DECODE_HEADER)
    print("\n".join(rows))
    print(f"\n(measured in {time.time() - started:.0f} s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="seq 128 and 1024 only")
    parser.add_argument("--backward", action="store_true", help="the backward: fused kernel vs separate kernels")
    parser.add_argument("--decode", action="store_true", help="decode steps: split-key form vs flash query tiles")
    parser.add_argument("--seqs", help="comma-separated sequence lengths (instead of 128,1024,4096,8192)")
    parser.add_argument("--engines", action="store_true",
                        help="forward: add the flash kernel's busy time per engine (" + " / ".join(ENGINES) + ")")
    parser.add_argument("--head-dims", help="comma-separated head dims (instead of 64,128)")
    parser.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16")
    parser.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    parser.add_argument("--heads", type=int, default=HEADS, help="backward: query heads")
    parser.add_argument("--kv-heads", type=int, help="backward: key/value heads (grouped-query; default: --heads)")
    parser.add_argument("--fused-only", action="store_true", help="backward: skip the separate kernels")
    parser.add_argument("--mid", action="store_true", help="the diffusers mid size's self-attention (8 heads of 128, "
                        "bf16, 1024 and 1280 tokens, the flash kernel only)")
    args = parser.parse_args(argv)
    if args.decode:
        return main_decode(args.quick)
    if args.mid:
        args.seqs, args.head_dims, args.dtypes, args.causal = ",".join(map(str, MID_SEQS)), str(MID_DEPTH), "bf16", "no"
    seqs = [int(seq) for seq in args.seqs.split(",")] if args.seqs else QUICK_SEQS if args.quick else SEQS
    head_dims = [int(depth) for depth in args.head_dims.split(",")] if args.head_dims else HEAD_DIMS
    dtypes = [{"fp32": torch.float32, "bf16": torch.bfloat16}[name] for name in args.dtypes.split(",")]
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    rows = []
    started = time.time()
    for seq, depth, causal, dtype in itertools.product(seqs, head_dims, causals, dtypes):
        print(f"[{time.time() - started:6.0f} s] seq {seq} D {depth} causal {causal} {dtype}", file=sys.stderr,
              flush=True)
        rows.append(measure_backward(seq, depth, causal, dtype, args.heads, args.kv_heads or args.heads,
                                     0 if args.fused_only else BACKWARD_SEPARATE_MAX_SEQ) if args.backward else
                    measure(seq, depth, causal, dtype, args.engines, args.mid))
    header = BACKWARD_HEADER if args.backward else HEADER
    if args.engines and not args.backward:
        lines = header.split("\n")
        header = f"{lines[0]} flash busy us ({' / '.join(ENGINES)}) |\n{lines[1]}---:|"
    print(header)
    print("\n".join(rows))
    print(f"\n(measured in {time.time() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

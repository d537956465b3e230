"""`make demo`: compile a small transformer with backend="neuron", run it on the NKI simulator, check it
against eager, and print the kernels and the cost report.

Run as ``python -m neuron_compile.demo``. Exits non-zero if the compiled model disagrees with eager.
"""

from __future__ import annotations

import math
import statistics
import sys
import time

import torch
from torch import nn

import neuron_compile


class TinyDecoderBlock(nn.Module):
    """A pre-norm GPT-style block: causal self-attention and a GELU MLP, with residuals."""

    def __init__(self, dim: int = 64, heads: int = 4, hidden: int = 256):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(dim, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, dim // self.heads).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(dim // self.heads)
        causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        attn = torch.softmax(scores, dim=-1) @ v
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, dim))
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 128, dim: int = 64, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(TinyDecoderBlock(dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _section(title: str) -> None:
    print(f"\n=== {title} " + "=" * max(0, 72 - len(title)))


def median_call_seconds(call, calls: int = 5, warmups: int = 1) -> float:
    """The median wall time of ``calls`` calls of ``call()`` (after ``warmups`` more); bench/replay_bench.py too."""
    for _ in range(warmups):
        call()
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def run_model_demo() -> bool:
    torch.manual_seed(0)
    model = TinyTransformer().eval()
    tokens = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        expected = model(tokens)
        neuron_compile.reset_stats()
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="neuron")
        actual = compiled(tokens)
        actual_again = compiled(tokens)  # second call: served from the in-memory kernel cache
        stats = neuron_compile.stats()
        per_call = median_call_seconds(lambda: compiled(tokens))
        eager_per_call = median_call_seconds(lambda: model(tokens))

    _section("TinyTransformer (2 blocks, dim 64, seq 16) through torch.compile(backend='neuron')")
    max_err = (actual - expected).abs().max().item()
    ok = torch.allclose(actual, expected, rtol=1e-4, atol=1e-4) and torch.equal(actual, actual_again)
    print(f"output {tuple(actual.shape)} {actual.dtype}; max |compiled - eager| = {max_err:.3e} -> "
          f"{'MATCHES eager' if ok else 'MISMATCH'}")

    total = stats["nki_nodes"] + stats["fallback_nodes"]
    share = 100.0 * stats["nki_nodes"] / total if total else 0.0
    replay = "on" if neuron_compile.config.get().replay else "off"
    print(f"a cached call: {per_call * 1e3:.1f} ms wall on the simulator (replay {replay}: NEURON_COMPILE_REPLAY), "
          f"eager {eager_per_call * 1e3:.2f} ms: {per_call / eager_per_call:.2g}x")
    print(f"ATen nodes in NKI kernels: {stats['nki_nodes']} of {total} ({share:.0f}%); "
          f"launches: {stats['kernels_launched']} (one region kernel per NKI region and call); cache hits/misses: "
          f"{stats['cache_hits']}/{stats['cache_misses']}")
    if stats["fallback_reasons"]:
        print("ran eagerly, with the reason:")
        for reason, count in stats["fallback_reasons"].most_common():
            print(f"  {count:4d} x {reason}")

    kernels = [kernel for record in neuron_compile.compiled_records() for kernel in record.kernels]
    if kernels:
        _section(f"NKI kernels ({len(kernels)}); the first two in full")
        for kernel in kernels[:2]:
            print(f"--- {kernel.name} ---")
            print(kernel.source)
        print("others:", ", ".join(kernel.name for kernel in kernels[2:]) or "none")

    _section("Cost report (simulator cost model, trn2), summed over both calls")
    print(f"HBM bytes {stats['hbm_bytes']:,}; FLOPs {stats['flops']:,}; {stats['kernels_launched']} launches")
    print(f"estimated time {stats['est_time_s'] * 1e6:.1f} us: {stats['launch_s'] * 1e6:.1f} us of kernel launches "
          f"and {(stats['est_time_s'] - stats['launch_s']) * 1e6:.1f} us of scheduled device time (with every "
          f"kernel's engines perfectly overlapped: {(stats['est_lower_bound_s'] - stats['launch_s']) * 1e6:.1f} us); "
          f"roofline {stats['roofline_s'] * 1e6:.1f} us")
    return ok


def main() -> int:
    from neuron_compile.demo_kernels import run_demo_kernels

    _section("Hand-written NKI kernels on the simulator")
    print(run_demo_kernels())
    ok = run_model_demo()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

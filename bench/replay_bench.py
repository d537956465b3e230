"""Benchmark: what a cached call costs on the simulator with and without replay, against eager, in one process.

Issue 17's goal: a cached forward of a 2-layer Llama (hidden 256, seq 128) and a training step within 10x of eager's
wall time. Per case, the same model and inputs, wall time per call (median of ``--calls`` after two warm-up calls):
eager; ``backend="neuron"`` with ``NEURON_COMPILE_REPLAY`` off (every launch simulated in full: the kernel's Python,
its views and checks, each instruction's numpy work) and on (a launch after the first of its shapes replays the
numpy work the first recorded, runtime/simulator/replay.py). Each setting compiles its own graphs (the setting is in
the dispatch key), so the two run side by side in one process.

Cases (random weights from tiny configs built here, fp32, torch on one thread):
* forward: ``LlamaForCausalLM`` with 2 layers, hidden 256, 4 heads, seq 128, vocab 1024, under ``no_grad``;
* train step: the tiny Llama of bench/train_bench.py (2 layers, hidden 64, batch 2 x seq 32): forward with labels,
  backward, an eager AdamW step.

    PYTHONPATH=. .venv/bin/python bench/replay_bench.py --calls 9
"""

from __future__ import annotations

import argparse
import functools
import warnings

import torch

from neuron_compile import config
from neuron_compile.demo import median_call_seconds


def llama(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int, train: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    settings = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                           num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                           max_position_embeddings=256)
    model = LlamaForCausalLM(settings)
    return model.train() if train else model.eval()


def forward_case():
    """The cached forward of issue 17: (model, a call of it)."""
    model = llama(256, 2, 4, 4, 512, 1024, train=False)
    ids = torch.randint(0, 1024, (1, 128), generator=torch.Generator().manual_seed(0))

    def call(run):
        with torch.no_grad():
            run(ids)

    return model, call


def train_case():
    """A tiny training step (bench/train_bench.py's Llama): (model, a step of it)."""
    model = llama(64, 2, 4, 2, 128, 128, train=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))

    def call(run):
        run(tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return model, call


CASES = {"forward": forward_case, "train step": train_case}


def row(name: str, calls: int) -> str:
    model, call = CASES[name]()
    eager = median_call_seconds(functools.partial(call, model), calls, warmups=2)
    walls = {}
    for replay in (False, True):
        torch._dynamo.reset()
        with config.patch(replay=replay, cache_dir="off"):
            compiled = torch.compile(model, backend="neuron")
            walls[replay] = median_call_seconds(functools.partial(call, compiled), calls, warmups=2)
    off, on = walls[False], walls[True]
    return (f"| {name} | {eager * 1e3:.2f} | {off * 1e3:.1f} ({off / eager:.1f}x) | {on * 1e3:.1f} ({on / eager:.1f}x) "
            f"| {off / on:.1f}x |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=9, help="timed calls per setting (median)")
    parser.add_argument("--only", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    print("| case | eager ms | replay off ms (x eager) | replay on ms (x eager) | off / on |")
    print("|---|---:|---:|---:|---:|")
    for name in args.only.split(","):
        print(row(name, args.calls), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Causal-LM coverage: Hugging Face architectures from tiny random configs through backend="neuron" vs eager.

For each architecture: a forward pass (logits) compiled with ``torch.compile(model, backend="neuron")`` and run on
the simulator, compared with eager; the ATen nodes that ran in NKI kernels vs eagerly, and the top fallback
reason. ``--train`` adds a training step (labels, cross-entropy loss, backward) and compares every gradient (with
dropout probabilities zeroed: the kernels draw their own masks; the node counts are those of the step with
dropout on).
Nothing is downloaded: configs are built in code with random weights. Needs the ``models`` extra.

    .venv/bin/python bench/hf_causal_lm.py
    .venv/bin/python bench/hf_causal_lm.py --archs llama,gpt2 --train
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
import warnings

import torch

import neuron_compile

DEFAULT_ARCHS = "llama,mistral,qwen2,gemma,phi,gpt2,gpt_neox,falcon,opt"
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, ffn_dim=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, word_embed_proj_dim=64)


def _model(arch: str, dropout: bool = True):
    """The tiny random-weight model; ``dropout=False`` zeroes every dropout probability of its config (the same
    weights: dropout draws nothing at initialization)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(arch, **TINY)
    if not dropout:
        for name in _dropout_fields(config):
            setattr(config, name, 0.0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def _dropout_fields(config) -> list[str]:
    """The config's dropout probabilities that are not 0 (``resid_pdrop``, ``attention_dropout``, ...)."""
    return [name for name, value in vars(config).items()
            if ("dropout" in name or "pdrop" in name) and isinstance(value, float) and value > 0]


def _compiled_stats(run):
    neuron_compile.reset_stats()
    torch._dynamo.reset()
    result = run()
    return result, neuron_compile.stats()


def forward_row(arch: str, tokens: torch.Tensor) -> tuple:
    model = _model(arch).eval()
    with torch.no_grad():
        expected = model(tokens).logits
        compiled = torch.compile(model, backend="neuron")
        actual, stats = _compiled_stats(lambda: compiled(tokens).logits)
    return (actual - expected).abs().max().item(), stats


def training_row(arch: str, tokens: torch.Tensor) -> tuple:
    """(largest gradient difference from eager, stats of the compiled training step). Dropout masks are drawn on
    chip from their own stream, which cannot equal eager's: a model with dropout is compared with its
    probabilities zeroed, and the stats (nodes in kernels, eager nodes) are those of the step with dropout on."""
    model = _model(arch, dropout=False).train()
    model(tokens, labels=tokens).loss.backward()
    expected = {name: parameter.grad.clone() for name, parameter in model.named_parameters()}
    model.zero_grad()
    compiled = torch.compile(model, backend="neuron")
    _, stats = _compiled_stats(lambda: compiled(tokens, labels=tokens).loss.backward())
    error = max((parameter.grad - expected[name]).abs().max().item() for name, parameter in model.named_parameters())
    with_dropout = _model(arch).train()
    if _dropout_fields(with_dropout.config):
        compiled = torch.compile(with_dropout, backend="neuron")
        _, stats = _compiled_stats(lambda: compiled(tokens, labels=tokens).loss.backward())
    return error, stats


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archs", default=DEFAULT_ARCHS, help="comma-separated transformers model types")
    parser.add_argument("--train", action="store_true", help="also a training step (loss.backward())")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    tokens = torch.randint(0, TINY["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    modes = [("forward", forward_row)] + ([("train step", training_row)] if args.train else [])
    print("| architecture | pass | max abs error vs eager | ATen nodes in NKI | eager | top eager reason | s |")
    print("|---|---|---|---|---|---|---|")
    reasons: collections.Counter = collections.Counter()
    for arch in args.archs.split(","):
        for mode, row in modes:
            started = time.time()
            try:
                error, stats = row(arch, tokens)
            except Exception as failure:  # noqa: BLE001 - one architecture's failure is a row, not the end
                print(f"| {arch} | {mode} | failed: {type(failure).__name__}: {str(failure)[:80]} | | | | |")
                continue
            reasons.update(stats["fallback_reasons"])
            top = stats["fallback_reasons"].most_common(1)
            print(f"| {arch} | {mode} | {error:.1e} | {stats['nki_nodes']} | {stats['fallback_nodes']} | "
                  f"{top[0][0][:70] if top else '-'} | {time.time() - started:.0f} |", flush=True)
    if reasons:
        print("\nEager reasons over all rows:")
        for reason, count in reasons.most_common(10):
            print(f"  {count:4d}  {reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

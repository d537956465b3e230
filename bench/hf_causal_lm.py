"""Causal-LM coverage: Hugging Face architectures from tiny random configs through backend="neuron" vs eager.

For each architecture: a forward pass (logits) compiled with ``torch.compile(model, backend="neuron")`` and run on
the simulator, compared with eager; the ATen nodes that ran in NKI kernels vs eagerly, and the top fallback
reason. ``--train`` adds a training step (labels, cross-entropy loss, backward) and compares every gradient (with
dropout probabilities zeroed: the kernels draw their own masks; the node counts are those of the step with
dropout on).
Nothing is downloaded: configs are built in code with random weights. Needs the ``models`` extra.

``--all``: every model type transformers maps to a causal LM (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``). An
architecture first gets the shared tiny config; where that fails in eager already, its own default config shrunk
(every size field, in its sub-configs too, set to the tiny figures; token ids brought into the vocabulary; per-layer
lists cut to the layers kept). Those that still fail in eager are listed with the reason and not counted: they say
nothing about the backend. Progress goes to stderr; a summary (architectures matching eager, the NKI share of ATen
nodes, the eager nodes by reason) follows the table.

    .venv/bin/python bench/hf_causal_lm.py
    .venv/bin/python bench/hf_causal_lm.py --archs llama,gpt2 --train
    .venv/bin/python bench/hf_causal_lm.py --all
"""

from __future__ import annotations

import argparse
import collections
import signal
import sys
import time
import warnings

import torch

import neuron_compile

DEFAULT_ARCHS = "llama,mistral,qwen2,gemma,phi,gpt2,gpt_neox,falcon,opt"
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, ffn_dim=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, word_embed_proj_dim=64)
# --all: the size fields of architectures' own configs, set where a config has them (the shared tiny figures under
# the names architectures give them: layers, width, heads, experts, latent ranks)
SHRUNK = dict(
    TINY, d_model=64, n_embd=64, embed_dim=64, dim=64, n_layer=2, num_layers=2, n_layers=2, decoder_layers=2,
    encoder_layers=2, n_head=4, n_heads=4, num_heads=4, decoder_attention_heads=4, encoder_attention_heads=4,
    head_dim=16, d_head=16, d_kv=16, kv_channels=16, attention_head_size=16, d_ff=128, d_inner=128, n_inner=128,
    decoder_ffn_dim=128, encoder_ffn_dim=128, feed_forward_size=128, moe_intermediate_size=64,
    shared_expert_intermediate_size=64, num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4,
    num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
    qk_nope_head_dim=8, v_head_dim=16, n_positions=64, max_target_positions=64, max_source_positions=64,
    n_ctx=64, sliding_window=32, vocab_size_per_layer_input=128, hidden_size_per_layer_input=16,
    image_size=32, patch_size=8, num_channels=3, rotary_dim=8, attn_layer_period=2, attn_layer_offset=1,
    expert_layer_period=2, expert_layer_offset=1, full_attention_interval=2,
)
TOKEN_ID_FIELDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id",
                   "cls_token_id", "mask_token_id", "unk_token_id")
ARCH_TIME_LIMIT_S = 300  # --all: an architecture still compiling after this long is reported as timed out


def _model(arch: str, dropout: bool = True, shrunk: bool = False):
    """The tiny random-weight model; ``dropout=False`` zeroes every dropout probability of its config (the same
    weights: dropout draws nothing at initialization); ``shrunk``: the architecture's own config, shrunk."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, shrunk)
    if not dropout:
        for name in _dropout_fields(config):
            setattr(config, name, 0.0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def tiny_config(arch: str, shrunk: bool = False):
    from transformers import AutoConfig

    return shrunk_config(arch) if shrunk else AutoConfig.for_model(arch, **TINY)


def parameter_count(config) -> int:
    """Parameters of the model ``config`` builds, counted on the meta device (nothing allocated)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(parameter.numel() for parameter in model.parameters())


def shrunk_config(arch: str):
    """The architecture's default config with every size field of SHRUNK it has (its sub-configs too) set tiny."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(arch)
    _shrink(config)
    return config


def _shrink(config) -> None:
    from transformers import PretrainedConfig

    layers = {name: getattr(config, name) for name in ("num_hidden_layers", "n_layer", "num_layers")
              if isinstance(getattr(config, name, None), int)}
    for name, value in list(vars(config).items()):
        if isinstance(value, PretrainedConfig):
            _shrink(value)
        elif name in SHRUNK and isinstance(value, int) and not isinstance(value, bool):
            setattr(config, name, SHRUNK[name])
        elif name in TOKEN_ID_FIELDS and isinstance(value, int) and value >= SHRUNK["vocab_size"]:
            setattr(config, name, TOKEN_ID_FIELDS.index(name) % 3)
        elif isinstance(value, list) and value and len(value) in layers.values():
            setattr(config, name, _two_layers(value))  # one entry per layer (layer_types, block types, ...)
    if isinstance(getattr(config, "qk_rope_head_dim", None), int):  # latent attention: rotary on its rope part
        config.head_dim = config.qk_rope_head_dim
        if hasattr(config, "qk_head_dim"):
            config.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim


def _two_layers(per_layer: list) -> list:
    """Two entries of a per-layer list: the first and the first of another kind, so that a hybrid keeps an
    attention layer beside its linear or recurrent one."""
    other = next((entry for entry in per_layer if entry != per_layer[0]), per_layer[0])
    return [per_layer[0], other]


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


MAX_PARAMETERS = 20_000_000  # --all: a config this large after shrinking was not made tiny (too slow to simulate)
MATCH_TOLERANCE = 1e-4  # --all: logits within this (absolute and relative) of eager's count as matching


class ArchTimeout(Exception):
    pass


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def eager_reference(arch: str, tokens: torch.Tensor) -> tuple:
    """(model, eager logits, which config) with the first config whose forward runs eagerly with finite logits:
    the shared tiny config, else the architecture's own shrunk. Raises the last failure."""
    failure: Exception = RuntimeError("no config tried")
    for shrunk in (False, True):
        try:
            size = parameter_count(tiny_config(arch, shrunk))
            if size > MAX_PARAMETERS:
                raise ValueError(f"{size / 1e6:.0f}M parameters: the config is not tiny")
            model = _model(arch, shrunk=shrunk).eval()
            with torch.no_grad():
                logits = model(tokens).logits
            if not torch.isfinite(logits).all():
                raise ValueError("non-finite logits in eager")
            return model, logits, "own, shrunk" if shrunk else "shared"
        except Exception as error:  # noqa: BLE001 - the next config may run
            failure = error
    raise failure


def _on_alarm(signum, frame):
    raise ArchTimeout(f"over {ARCH_TIME_LIMIT_S} s")


def sweep_row(arch: str, tokens: torch.Tensor) -> dict:
    """One architecture of --all: its outcome ("eager fails", "matches", "differs", "fails", "timed out"), the
    config used, the error and the compile stats."""
    try:
        model, expected, config = eager_reference(arch, tokens)
    except Exception as failure:  # noqa: BLE001 - listed, not counted
        return {"outcome": "eager fails", "reason": f"{type(failure).__name__}: {str(failure)[:100]}"}
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(ARCH_TIME_LIMIT_S)
    try:
        with torch.no_grad():
            compiled = torch.compile(model, backend="neuron")
            actual, stats = _compiled_stats(lambda: compiled(tokens).logits)
    except ArchTimeout as failure:
        return {"outcome": "timed out", "config": config, "reason": str(failure)}
    except Exception as failure:  # noqa: BLE001 - one architecture's failure is a row, not the end
        return {"outcome": "fails", "config": config, "reason": f"{type(failure).__name__}: {str(failure)[:100]}"}
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    error = (actual.float() - expected.float()).abs().max().item()
    close = torch.allclose(actual.float(), expected.float(), rtol=MATCH_TOLERANCE, atol=MATCH_TOLERANCE)
    return {"outcome": "matches" if close else "differs", "config": config, "error": error, "stats": stats}


def run_all(tokens: torch.Tensor) -> None:
    """--all: the table (one row per architecture that runs eagerly), then the summary."""
    archs = causal_lm_types()
    rows: dict[str, dict] = {}
    print("| architecture | config | outcome | max abs error vs eager | ATen nodes in NKI | eager | top eager reason | s |")
    print("|---|---|---|---|---|---|---|---|")
    for number, arch in enumerate(archs, 1):
        started = time.time()
        row = rows[arch] = sweep_row(arch, tokens)
        row["seconds"] = time.time() - started
        print(f"[{number}/{len(archs)}] {arch}: {row['outcome']} ({row['seconds']:.0f} s)", file=sys.stderr, flush=True)
        if row["outcome"] != "eager fails":
            print(_sweep_line(arch, row), flush=True)
    _print_summary(rows)


def _sweep_line(arch: str, row: dict) -> str:
    if "stats" not in row:
        return f"| {arch} | {row['config']} | {row['outcome']}: {row['reason'][:80]} | | | | | {row['seconds']:.0f} |"
    stats = row["stats"]
    top = stats["fallback_reasons"].most_common(1)
    return (f"| {arch} | {row['config']} | {row['outcome']} | {row['error']:.1e} | {stats['nki_nodes']} | "
            f"{stats['fallback_nodes']} | {top[0][0][:70] if top else '-'} | {row['seconds']:.0f} |")


def _print_summary(rows: dict[str, dict]) -> None:
    outcomes = collections.Counter(row["outcome"] for row in rows.values())
    counted = [row for row in rows.values() if "stats" in row]
    in_nki = sum(row["stats"]["nki_nodes"] for row in counted)
    eager = sum(row["stats"]["fallback_nodes"] for row in counted)
    reasons: collections.Counter = collections.Counter()
    for row in counted:
        reasons.update(row["stats"]["fallback_reasons"])
    ran = len(rows) - outcomes["eager fails"]
    print(f"\n{len(rows)} causal-LM model types; {outcomes['eager fails']} fail in eager already (not counted); of the "
          f"{ran} that run eagerly: {outcomes['matches']} match eager, {outcomes['differs']} differ, "
          f"{outcomes['fails']} fail under the backend, {outcomes['timed out']} timed out.")
    if in_nki + eager:
        print(f"ATen nodes in NKI kernels: {in_nki} of {in_nki + eager} ({100 * in_nki / (in_nki + eager):.1f}%).")
    print("\nEager nodes by reason:")
    for reason, count in reasons.most_common(15):
        print(f"  {count:4d}  {reason}")
    print("\nFailing in eager (the reason):")
    for arch, row in rows.items():
        if row["outcome"] == "eager fails":
            print(f"  {arch}: {row['reason']}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archs", default=DEFAULT_ARCHS, help="comma-separated transformers model types")
    parser.add_argument("--train", action="store_true", help="also a training step (loss.backward())")
    parser.add_argument("--all", action="store_true", help="every causal-LM model type transformers has (forward)")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    tokens = torch.randint(0, TINY["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    if args.all:
        run_all(tokens)
        return 0
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

"""Test helper: tiny causal LMs (random weights from a config), a tokenizer built locally, an in-memory dataset,
and a transformers ``Trainer`` / TRL ``SFTTrainer`` run that records the loss of every optimizer step, eager or
with ``TrainingArguments(torch_compile=True, torch_compile_backend="neuron")``. Nothing is downloaded."""

from __future__ import annotations

import dataclasses
import os

import torch

WORDS = [f"w{index}" for index in range(60)]
SPECIAL = ["[PAD]", "[UNK]", "[BOS]", "[EOS]"]
TOKENS_PER_TEXT = 15  # + EOS: every example, and so every batch, has one shape
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
)
MODEL_TYPES = ("llama", "qwen3", "gemma3_text")


def tokenizer():
    """A word-level ``PreTrainedTokenizerFast`` over WORDS, with pad / unk / bos / eos tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocabulary = {token: index for index, token in enumerate(SPECIAL + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocabulary, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]", bos_token="[BOS]", eos_token="[EOS]"
    )


def texts(count: int, seed: int = 0) -> list[str]:
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, len(WORDS), (count, TOKENS_PER_TEXT), generator=generator)
    return [" ".join(WORDS[index] for index in row) for row in picks.tolist()]


def model(model_type: str, dtype: torch.dtype = torch.float32, seed: int = 0):
    """A tiny random-weight causal LM of ``model_type`` over the harness tokenizer's vocabulary."""
    from transformers import AutoConfig, AutoModelForCausalLM

    vocab = tokenizer()
    config = AutoConfig.for_model(
        model_type,
        vocab_size=len(vocab),
        pad_token_id=vocab.pad_token_id,
        bos_token_id=vocab.bos_token_id,
        eos_token_id=vocab.eos_token_id,
        **TINY,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).to(dtype)


def lm_dataset(count: int):
    """Tokenized examples with labels (for the plain Trainer): input_ids, attention_mask, labels."""
    from datasets import Dataset

    vocab = tokenizer()
    rows = [vocab(text + " [EOS]") for text in texts(count)]
    ids = [row["input_ids"] for row in rows]
    return Dataset.from_dict(
        {"input_ids": ids, "attention_mask": [row["attention_mask"] for row in rows], "labels": ids}
    )


def text_dataset(count: int):
    from datasets import Dataset

    return Dataset.from_dict({"text": texts(count)})


@dataclasses.dataclass
class TrainingRun:
    step_losses: list[float]  # the mean loss of each optimizer step's micro-batches, unrounded
    trainer: object


def _recording(trainer_class):
    """``trainer_class`` whose compute_loss also records each micro-batch's loss (the Trainer rounds its logs)."""

    class Recording(trainer_class):
        def compute_loss(self, model, inputs, *args, **kwargs):
            result = super().compute_loss(model, inputs, *args, **kwargs)
            loss = result[0] if isinstance(result, tuple) else result
            self.micro_losses.append(loss.detach().float().item())
            return result

    return Recording


def arguments(output_dir: str, compiled: bool, steps: int, sft: bool = False, **overrides):
    """Training arguments shared by the eager and the compiled run (AdamW, constant LR, one process, CPU)."""
    from transformers import TrainingArguments
    from trl import SFTConfig

    common = dict(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        optim="adamw_torch",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        torch_compile=compiled,
        disable_tqdm=True,
    )
    if compiled:
        common["torch_compile_backend"] = "neuron"
    common.update(overrides)
    if sft:
        return SFTConfig(**{"max_length": TOKENS_PER_TEXT + 1, "packing": False, "dataset_text_field": "text", **common})
    return TrainingArguments(**common)


def train(
    model_type: str,
    output_dir: str,
    compiled: bool,
    steps: int,
    sft: bool = False,
    dtype: torch.dtype = torch.float32,
    **overrides,
) -> TrainingRun:
    """One training run of a fresh tiny model; the same seeds, data and order whether compiled or not."""
    from transformers import DataCollatorForLanguageModeling, Trainer
    from trl import SFTTrainer

    vocab = tokenizer()
    args = arguments(
        os.path.join(output_dir, "compiled" if compiled else "eager"),
        compiled,
        steps,
        sft,
        bf16=dtype == torch.bfloat16,
        **overrides,
    )
    examples = steps * args.per_device_train_batch_size * args.gradient_accumulation_steps
    network = model(model_type, torch.float32)
    if sft:
        trainer = _recording(SFTTrainer)(
            model=network, args=args, train_dataset=text_dataset(examples), processing_class=vocab
        )
    else:
        collator = DataCollatorForLanguageModeling(vocab, mlm=False)
        trainer = _recording(Trainer)(
            model=network, args=args, train_dataset=lm_dataset(examples), data_collator=collator, processing_class=vocab
        )
    trainer.micro_losses = []
    trainer.train()
    per_step = args.gradient_accumulation_steps
    losses = trainer.micro_losses
    step_losses = [sum(losses[i : i + per_step]) / per_step for i in range(0, len(losses), per_step)]
    return TrainingRun(step_losses, trainer)


def relative_differences(ours: list[float], eager: list[float]) -> list[float]:
    return [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours, eager, strict=True)]

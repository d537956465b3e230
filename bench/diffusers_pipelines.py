"""Tiny diffusers pipelines built locally, for bench/diffusers_pipeline_bench.py: random weights, tiny configs and
tokenizers made in memory from a few words (nothing is downloaded), every component in eval mode (T5's dropout
would otherwise make two runs differ).

``PIPELINES[name](dtype) -> TinyPipeline``: the pipeline, the keyword arguments of one generation (2 inference
steps, a fixed generator) and how to compile it the way users do: the transformer's repeated blocks through
``compile_repeated_blocks(backend=..., fullgraph=True, dynamic=False)`` and the VAE decoder through
``torch.compile(backend=...)``. ``generate`` returns the final latents (read by a step-end callback) and the
decoded pixels.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import diffusers
import torch
import transformers

SEED = 0
PROMPT = "a red cat on a mat"
WORDS = ("a", "red", "blue", "cat", "dog", "on", "the", "mat", "sky", "tree")
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def clip_tokenizer(max_length: int) -> transformers.CLIPTokenizer:
    """A byte-level BPE vocabulary of the letters and a few whole words (no merges: words not listed spell out)."""
    specials = ["<|startoftext|>", "<|endoftext|>"]
    tokens = specials + list(LETTERS) + [letter + "</w>" for letter in LETTERS] + [word + "</w>" for word in WORDS]
    return transformers.CLIPTokenizer(vocab={token: index for index, token in enumerate(tokens)}, merges=[],
                                      model_max_length=max_length)


def t5_tokenizer() -> transformers.T5TokenizerFast:
    """A unigram vocabulary: T5's three specials, the listed words, then single letters (less likely)."""
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces += [("\u2581" + word, -1.0) for word in WORDS] + [(letter, -5.0) for letter in LETTERS]
    return transformers.T5TokenizerFast(vocab=pieces, extra_ids=0)


def tiny_t5_encoder(hidden: int) -> transformers.T5EncoderModel:
    return transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=64, d_model=hidden, d_kv=8, d_ff=37, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))


@dataclasses.dataclass
class TinyPipeline:
    pipe: diffusers.DiffusionPipeline
    call_kwargs: dict
    decoder: str  # the VAE's attribute that decodes latents ("decoder")

    def compile(self, backend: str) -> None:
        """What a user writes: regional compile of the transformer, the VAE decoder as a whole."""
        self.pipe.transformer.compile_repeated_blocks(backend=backend, fullgraph=True, dynamic=False)
        getattr(self.pipe.vae, self.decoder).compile(backend=backend)

    def generate(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(final latents, decoded pixels) of one generation from the fixed seed."""
        final = {}

        def keep_latents(pipe, step, timestep, tensors):
            final["latents"] = tensors["latents"]
            return tensors

        with torch.no_grad():
            output = self.pipe(**self.call_kwargs, generator=torch.Generator().manual_seed(SEED), output_type="pt",
                               callback_on_step_end=keep_latents)
        pixels = output.frames if hasattr(output, "frames") else output.images
        return final["latents"], pixels


def _finished(pipe: diffusers.DiffusionPipeline, dtype: torch.dtype) -> diffusers.DiffusionPipeline:
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(dtype)


def flux(dtype: torch.dtype) -> TinyPipeline:
    """FluxPipeline: 2 double and 2 single blocks, CLIP and T5 encoders, a two-level AutoencoderKL (16 x 16
    pixels from 8 x 8 x 4 latents, packed into 16 tokens of 16 channels)."""
    torch.manual_seed(SEED)
    transformer = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8])
    clip = transformers.CLIPTextModel(transformers.CLIPTextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=16, projection_dim=32, bos_token_id=0, eos_token_id=1, pad_token_id=1))
    vae = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=[16, 32], layers_per_block=1, latent_channels=4,
        norm_num_groups=8, sample_size=16, use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609,
        scaling_factor=1.5035)
    pipe = diffusers.FluxPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=clip,
        tokenizer=clip_tokenizer(16), text_encoder_2=tiny_t5_encoder(32), tokenizer_2=t5_tokenizer(),
        transformer=transformer)
    call_kwargs = dict(prompt=PROMPT, height=16, width=16, num_inference_steps=2, guidance_scale=3.5,
                       max_sequence_length=16)
    return TinyPipeline(_finished(pipe, dtype), call_kwargs, "decoder")


def ltx(dtype: torch.dtype) -> TinyPipeline:
    """LTXPipeline (video): one transformer block, a T5 encoder, a 3-D AutoencoderKLLTXVideo decoding 2 latent
    frames of 4 x 4 into 5 frames of 16 x 16 pixels."""
    torch.manual_seed(SEED)
    transformer = diffusers.LTXVideoTransformer3DModel(
        in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
        cross_attention_dim=16, num_layers=2, caption_channels=32, qk_norm="rms_norm_across_heads")
    vae = diffusers.AutoencoderKLLTXVideo(
        in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1, 1), spatio_temporal_scaling=(True, True, False, False),
        decoder_spatio_temporal_scaling=(True, True, False, False),
        decoder_inject_noise=(False, False, False, False, False), upsample_residual=(False, False, False, False),
        upsample_factor=(1, 1, 1, 1), timestep_conditioning=False, patch_size=1, patch_size_t=1,
        encoder_causal=True, decoder_causal=False)
    vae.use_framewise_encoding = vae.use_framewise_decoding = False
    pipe = diffusers.LTXPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=tiny_t5_encoder(32),
        tokenizer=t5_tokenizer(), transformer=transformer)
    call_kwargs = dict(prompt=PROMPT, height=32, width=32, num_frames=5, num_inference_steps=2, guidance_scale=1.0,
                       max_sequence_length=16)
    return TinyPipeline(_finished(pipe, dtype), call_kwargs, "decoder")


PIPELINES: dict[str, Callable[[torch.dtype], TinyPipeline]] = {"flux": flux, "ltx": ltx}

"""Tiny random-weight diffusers models that declare ``_repeated_blocks``, each with matching dummy inputs.

A bench helper (read by bench/diffusers_bench.py and by the diffusers tests): ``MODELS`` maps a diffusers class
name to a builder that returns ``(model, kwargs)``: the model in eval mode, built from a tiny config with random
weights (seeded), and the keyword arguments of one forward call. Nothing is downloaded. Needs diffusers.

Configs are the smallest that each class accepts: 1-2 blocks of each repeated kind, 2-4 heads, head dims of 8-16,
a few dozen to a few hundred image and text tokens, or what a class's fixed geometry demands. ``MODELS`` covers 47 of
the 48 classes with ``_repeated_blocks`` in diffusers 0.42; ``UNLISTED`` names the other one and why (it fails with a
pass-through backend too; its builder is in ``FAILING_WITH_PASS_THROUGH``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

SEED = 0


def _random(generator: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=generator)


def _built(class_name: str, **config):
    """The model with random weights; parameters a class initializes to zero (adaLN-zero gates, zero output
    projections) get small random values too, else a block may add nothing and a wrong kernel go unseen."""
    import diffusers

    torch.manual_seed(SEED)
    model = getattr(diffusers, class_name)(**config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.is_floating_point() and not parameter.any():
                parameter.normal_(0.0, 0.1)
    return model


def _flux_like(class_name: str, pooled: bool, guidance: bool, pooled_input: bool | None = None, **extra) -> tuple:
    """Flux and its relatives (Chroma, LongCat-Image, Ovis-Image): a 4x4 latent grid of 4 channels, 24 text
    tokens, rotary positions from 3-axis ids."""
    config = dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
                  num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=[4, 4, 8], **extra)
    if pooled:
        config["pooled_projection_dim"] = 32
    model = _built(class_name, **config)
    generator = torch.Generator().manual_seed(SEED)
    kwargs = dict(hidden_states=_random(generator, 1, 16, 4), encoder_hidden_states=_random(generator, 1, 24, 32),
                  img_ids=_random(generator, 16, 3), txt_ids=_random(generator, 24, 3), timestep=torch.tensor([1.0]))
    if pooled if pooled_input is None else pooled_input:
        kwargs["pooled_projections"] = _random(generator, 1, 32)
    if guidance:
        kwargs["guidance"] = torch.tensor([3.5])
    return model, kwargs


def flux():
    return _flux_like("FluxTransformer2DModel", pooled=True, guidance=False)


def chroma():
    return _flux_like("ChromaTransformer2DModel", pooled=False, guidance=False, approximator_num_channels=8,
                      approximator_hidden_dim=16, approximator_layers=1)


def longcat_image():
    return _flux_like("LongCatImageTransformer2DModel", pooled=True, guidance=True, pooled_input=False)


def ovis_image():
    return _flux_like("OvisImageTransformer2DModel", pooled=False, guidance=False, out_channels=4)


def _grid_ids(t: int, h: int, w: int, l: int) -> torch.Tensor:
    return torch.cartesian_prod(torch.arange(t), torch.arange(h), torch.arange(w), torch.arange(l)).unsqueeze(0)


def flux2():
    model = _built("Flux2Transformer2DModel", patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                   attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                   timestep_guidance_channels=256, axes_dims_rope=[4, 4, 4, 4])
    generator = torch.Generator().manual_seed(SEED)
    return model, dict(hidden_states=_random(generator, 1, 16, 4), encoder_hidden_states=_random(generator, 1, 24, 32),
                       img_ids=_grid_ids(1, 4, 4, 1), txt_ids=_grid_ids(1, 1, 1, 24), timestep=torch.tensor([1.0]),
                       guidance=torch.tensor([1.0]))


def flux3():
    model = _built("Flux3Transformer2DModel", in_channels=4, cond_in_channels=4, num_layers=1, num_single_layers=1,
                   attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32, timestep_channels=256,
                   axes_dims_rope=(4, 4, 4, 4))
    generator = torch.Generator().manual_seed(SEED)
    return model, dict(hidden_states=_random(generator, 1, 16, 4), encoder_hidden_states=_random(generator, 1, 24, 32),
                       timestep=torch.tensor([1.0]),
                       img_ids=_grid_ids(1, 4, 4, 1)[0], txt_ids=_grid_ids(1, 1, 1, 24)[0])


def hunyuan_image():
    model = _built("HunyuanImageTransformer2DModel", in_channels=4, out_channels=4, num_attention_heads=2,
                   attention_head_dim=8, num_layers=1, num_single_layers=1, num_refiner_layers=1, patch_size=(1, 1),
                   text_embed_dim=16, rope_axes_dim=(4, 4))
    generator = torch.Generator().manual_seed(SEED)
    return model, dict(hidden_states=_random(generator, 1, 4, 8, 8), timestep=torch.tensor([500.0]),
                       encoder_hidden_states=_random(generator, 1, 12, 16), encoder_attention_mask=torch.ones(1, 12))


def qwen_image():
    model = _built("QwenImageTransformer2DModel", patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                   attention_head_dim=16, num_attention_heads=4, joint_attention_dim=16, guidance_embeds=False,
                   axes_dims_rope=(8, 4, 4))
    generator = torch.Generator().manual_seed(SEED)
    return model, dict(hidden_states=_random(generator, 1, 16, 16), encoder_hidden_states=_random(generator, 1, 8, 16),
                       encoder_hidden_states_mask=torch.ones(1, 8, dtype=torch.long), timestep=torch.tensor([1.0]),
                       img_shapes=[(1, 4, 4)])


def _wan_like(class_name: str, **extra) -> tuple:
    """Wan and the models built on its block (SkyReels-V2, ChronoEdit): 2 frames of 16x16 latents, 4 channels."""
    model = _built(class_name, patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
                   out_channels=4, text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                   qk_norm="rms_norm_across_heads", rope_max_seq_len=32, **extra)
    generator = torch.Generator().manual_seed(SEED)
    return model, dict(hidden_states=_random(generator, 1, 4, 2, 16, 16),
                       encoder_hidden_states=_random(generator, 1, 12, 16), timestep=torch.tensor([500]))


def wan():
    return _wan_like("WanTransformer3DModel")


def skyreels_v2():
    return _wan_like("SkyReelsV2Transformer3DModel")


def chronoedit():
    return _wan_like("ChronoEditTransformer3DModel", rope_temporal_skip_len=8)


def anyflow():
    model = _built("AnyFlowTransformer3DModel", patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                   in_channels=4, out_channels=4, text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2,
                   cross_attn_norm=True, rope_max_seq_len=32, gate_value=0.25, deltatime_type="r")
    generator = torch.Generator().manual_seed(SEED)
    return model, dict(hidden_states=_random(generator, 1, 2, 4, 8, 8),
                       encoder_hidden_states=_random(generator, 1, 12, 16),
                       timestep=torch.tensor([[500.0, 500.0]]), r_timestep=torch.tensor([[400.0, 400.0]]))


def wan_vace():
    model = _built("WanVACETransformer3DModel", patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                   in_channels=16, out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=4,
                   cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32, vace_layers=[0, 2],
                   vace_in_channels=48)
    generator = torch.Generator().manual_seed(SEED)
    return model, dict(hidden_states=_random(generator, 1, 16, 2, 8, 8),
                       encoder_hidden_states=_random(generator, 1, 12, 32),
                       control_hidden_states=_random(generator, 1, 48, 2, 8, 8), timestep=torch.tensor([500]))


def ltx_video():
    model = _built("LTXVideoTransformer3DModel", in_channels=4, out_channels=4, num_attention_heads=2,
                   attention_head_dim=8, cross_attention_dim=16, num_layers=1, qk_norm="rms_norm_across_heads",
                   caption_channels=16)
    generator = torch.Generator().manual_seed(SEED)
    return model, dict(hidden_states=_random(generator, 1, 2 * 8 * 8, 4),
                       encoder_hidden_states=_random(generator, 1, 16, 16),
                       timestep=torch.tensor([500]), encoder_attention_mask=torch.ones(1, 16, dtype=torch.bool),
                       num_frames=2, height=8, width=8)


def hunyuan_video():
    model = _built("HunyuanVideoTransformer3DModel", in_channels=4, out_channels=4, num_attention_heads=2,
                   attention_head_dim=10, num_layers=1, num_single_layers=1, num_refiner_layers=1, patch_size=1,
                   patch_size_t=1, guidance_embeds=True, text_embed_dim=16, pooled_projection_dim=8,
                   rope_axes_dim=(2, 4, 4))
    generator = torch.Generator().manual_seed(SEED)
    return model, dict(hidden_states=_random(generator, 1, 4, 1, 8, 8), timestep=torch.tensor([500]),
                       encoder_hidden_states=_random(generator, 1, 12, 16), pooled_projections=_random(generator, 1, 8),
                       encoder_attention_mask=torch.ones(1, 12), guidance=torch.tensor([3.5]))


def ltx2_video():
    model = _built("LTX2VideoTransformer3DModel", in_channels=4, out_channels=4, patch_size=1, patch_size_t=1,
                   num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16, audio_in_channels=4,
                   audio_out_channels=4, audio_num_attention_heads=2, audio_attention_head_dim=4,
                   audio_cross_attention_dim=8, num_layers=2, qk_norm="rms_norm_across_heads", caption_channels=16,
                   rope_double_precision=False)
    generator = torch.Generator().manual_seed(SEED)
    return model, dict(hidden_states=_random(generator, 1, 2 * 8 * 8, 4),
                       audio_hidden_states=_random(generator, 1, 9, 4),
                       encoder_hidden_states=_random(generator, 1, 16, 16),
                       audio_encoder_hidden_states=_random(generator, 1, 16, 16), timestep=torch.tensor([500]),
                       encoder_attention_mask=torch.ones(1, 16, dtype=torch.bool), num_frames=2, height=8, width=8,
                       audio_num_frames=9, fps=25.0)


def motif_video():
    model = _built("MotifVideoTransformer3DModel", in_channels=33, out_channels=16, num_attention_heads=2,
                   attention_head_dim=12, num_layers=1, num_single_layers=1, num_decoder_layers=0, mlp_ratio=4.0,
                   patch_size=1, patch_size_t=1, qk_norm="rms_norm", norm_type="layer_norm", text_embed_dim=32,
                   image_embed_dim=4, rope_theta=256.0, rope_axes_dim=(4, 4, 4),
                   enable_text_cross_attention_dual=False, enable_text_cross_attention_single=False)
    generator = torch.Generator().manual_seed(SEED)
    return model, dict(hidden_states=_random(generator, 1, 33, 9, 4, 4),
                       encoder_hidden_states=_random(generator, 1, 12, 32),
                       timestep=torch.tensor([500]))


def nucleus_moe_image():
    model = _built("NucleusMoEImageTransformer2DModel", patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                   attention_head_dim=16, num_attention_heads=4, joint_attention_dim=16, axes_dims_rope=(8, 4, 4),
                   moe_enabled=False, capacity_factors=[8.0, 8.0])
    generator = torch.Generator().manual_seed(SEED)
    return model, dict(hidden_states=_random(generator, 1, 16, 16), encoder_hidden_states=_random(generator, 1, 8, 16),
                       encoder_hidden_states_mask=torch.ones(1, 8, dtype=torch.long), timestep=torch.tensor([1.0]),
                       img_shapes=[(1, 4, 4)])


def longcat_audio_dit():
    model = _built("LongCatAudioDiTTransformer", dit_dim=64, dit_depth=2, dit_heads=4, dit_text_dim=32, latent_dim=8,
                   text_conv=False)
    generator = torch.Generator().manual_seed(SEED)
    return model, dict(hidden_states=_random(generator, 1, 16, 8), encoder_hidden_states=_random(generator, 1, 10, 32),
                       encoder_attention_mask=torch.ones(1, 10, dtype=torch.bool),
                       attention_mask=torch.ones(1, 16, dtype=torch.bool), timestep=torch.ones(1))


def minimax_music3():
    model = _built("MiniMaxMusic3Transformer1DModel", in_channels=8, condition_dim=16, num_layers=2,
                   num_attention_heads=2, attention_head_dim=8, ff_inner_dim=32, rotary_dim=4, fourier_embedding_dim=8)
    generator = torch.Generator().manual_seed(SEED)
    return model, dict(hidden_states=_random(generator, 1, 8, 24), encoder_hidden_states=_random(generator, 1, 24, 16),
                       timestep=torch.full((1,), 0.5))


def bria_fibo():
    model = _built("BriaFiboTransformer2DModel", patch_size=1, in_channels=48, num_layers=1, num_single_layers=1,
                   attention_head_dim=8, num_attention_heads=2, joint_attention_dim=64, text_encoder_dim=32,
                   pooled_projection_dim=None, axes_dims_rope=[0, 4, 4])
    generator = torch.Generator().manual_seed(SEED)
    text = _random(generator, 1, 32, 64)
    return model, dict(hidden_states=_random(generator, 1, 64, 48), encoder_hidden_states=text,
                       img_ids=_random(generator, 64, 3), txt_ids=_random(generator, 32, 3),
                       timestep=torch.tensor([1.0]),
                       text_encoder_layers=[text[:, :, :32], text[:, :, :32]])


def helios():
    model = _built("HeliosTransformer3DModel", patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                   in_channels=4, out_channels=4, text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2,
                   cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_dim=(4, 4, 4),
                   has_multi_term_memory_patch=True, guidance_cross_attn=True, zero_history_timestep=True,
                   is_amplify_history=False)
    generator = torch.Generator().manual_seed(SEED)
    frames, height, width = 2, 8, 8
    return model, dict(hidden_states=_random(generator, 1, 4, frames, height, width), timestep=torch.tensor([500]),
                       encoder_hidden_states=_random(generator, 1, 12, 16), indices_hidden_states=torch.ones(1, frames),
                       indices_latents_history_short=torch.ones(1, frames - 1),
                       indices_latents_history_mid=torch.ones(1, frames - 1),
                       indices_latents_history_long=torch.ones(1, (frames - 1) * 4),
                       latents_history_short=_random(generator, 1, 4, frames - 1, height, width),
                       latents_history_mid=_random(generator, 1, 4, frames - 1, height, width),
                       latents_history_long=_random(generator, 1, 4, (frames - 1) * 4, height, width))


def hunyuan_video15():
    model = _built("HunyuanVideo15Transformer3DModel", in_channels=4, out_channels=4, num_attention_heads=2,
                   attention_head_dim=8, num_layers=2, num_refiner_layers=1, mlp_ratio=2.0, patch_size=1,
                   patch_size_t=1, text_embed_dim=16, text_embed_2_dim=8, image_embed_dim=12, rope_axes_dim=(2, 2, 4),
                   target_size=16, task_type="t2v")
    generator = torch.Generator().manual_seed(SEED)
    return model, dict(hidden_states=_random(generator, 1, 4, 1, 8, 8), timestep=torch.tensor([1.0]),
                       encoder_hidden_states=_random(generator, 1, 6, 16),
                       encoder_hidden_states_2=_random(generator, 1, 4, 8), encoder_attention_mask=torch.ones(1, 6),
                       encoder_attention_mask_2=torch.ones(1, 4), image_embeds=torch.zeros(1, 3, 12))


def krea2():
    model = _built("Krea2Transformer2DModel", in_channels=16, num_layers=2, attention_head_dim=8, num_attention_heads=4,
                   num_key_value_heads=2, intermediate_size=32, timestep_embed_dim=8, text_hidden_dim=16,
                   num_text_layers=3, text_num_attention_heads=2, text_num_key_value_heads=1, text_intermediate_size=16,
                   num_layerwise_text_blocks=1, num_refiner_text_blocks=1, axes_dims_rope=(4, 2, 2), rope_theta=1000.0,
                   norm_eps=1e-5)
    generator = torch.Generator().manual_seed(SEED)
    text_tokens, grid = 4, 2
    positions = torch.zeros(text_tokens + grid * grid, 3)
    positions[text_tokens:, 1] = torch.arange(grid).repeat_interleave(grid)
    positions[text_tokens:, 2] = torch.arange(grid).repeat(grid)
    mask = torch.ones(1, text_tokens, dtype=torch.bool)
    mask[:, -1] = False
    return model, dict(hidden_states=_random(generator, 1, grid * grid, 16),
                       encoder_hidden_states=_random(generator, 1, text_tokens, 3, 16), timestep=torch.tensor([0.5]),
                       position_ids=positions, encoder_attention_mask=mask)


def ideogram4():
    from diffusers.models.transformers import transformer_ideogram4 as ideogram

    model = _built("Ideogram4Transformer2DModel", in_channels=16, num_layers=2, attention_head_dim=8,
                   num_attention_heads=4, intermediate_size=32, adaln_dim=16, llm_features_dim=24, rope_theta=10_000,
                   mrope_section=(2, 1, 1), norm_eps=1e-5)
    generator = torch.Generator().manual_seed(SEED)
    text_tokens, image_tokens = 4, 4
    hidden = torch.zeros(1, text_tokens + image_tokens, 16)
    hidden[:, text_tokens:] = _random(generator, 1, image_tokens, 16)
    text = torch.zeros(1, text_tokens + image_tokens, 24)
    text[:, :text_tokens] = _random(generator, 1, text_tokens, 24)
    positions = torch.zeros(1, text_tokens + image_tokens, 3, dtype=torch.long)
    positions[:, :text_tokens] = torch.arange(text_tokens)[:, None]
    positions[:, text_tokens:, 0] = ideogram.IMAGE_POSITION_OFFSET
    positions[:, text_tokens:, 1] = torch.tensor([0, 0, 1, 1]) + ideogram.IMAGE_POSITION_OFFSET
    positions[:, text_tokens:, 2] = torch.tensor([0, 1, 0, 1]) + ideogram.IMAGE_POSITION_OFFSET
    indicator = torch.full((1, text_tokens + image_tokens), ideogram.OUTPUT_IMAGE_INDICATOR, dtype=torch.long)
    indicator[:, :text_tokens] = ideogram.LLM_TOKEN_INDICATOR
    return model, dict(hidden_states=hidden, encoder_hidden_states=text, timestep=torch.tensor([0.5]),
                       position_ids=positions, segment_ids=torch.ones(1, text_tokens + image_tokens, dtype=torch.long),
                       indicator=indicator)


def stable_audio3():
    model = _built("StableAudio3DiTModel", io_channels=8, patch_size=1, embed_dim=32, depth=2, num_heads=4,
                   cond_token_dim=16, global_cond_dim=12, local_add_cond_dim=5, timestep_features_dim=16, ff_mult=2,
                   num_memory_tokens=3, use_differential_attention=False)
    generator = torch.Generator().manual_seed(SEED)
    return model, dict(hidden_states=_random(generator, 1, 8, 16), timestep=torch.tensor([0.3]),
                       encoder_hidden_states=_random(generator, 1, 4, 16),
                       global_hidden_states=_random(generator, 1, 12))


def joy_image_edit():
    model = _built("JoyImageEditTransformer3DModel", patch_size=[1, 2, 2], in_channels=16, hidden_size=32,
                   num_attention_heads=2, text_dim=16, num_layers=2, rope_dim_list=[4, 6, 6], theta=256)
    generator = torch.Generator().manual_seed(SEED)
    return model, dict(hidden_states=_random(generator, 1, 16, 1, 4, 4),
                       encoder_hidden_states=_random(generator, 1, 12, 16),
                       timestep=torch.tensor([1.0]))


def glm_image():
    model = _built("GlmImageTransformer2DModel", patch_size=2, in_channels=4, out_channels=4, num_layers=1,
                   attention_head_dim=8, num_attention_heads=2, text_embed_dim=32, time_embed_dim=16, condition_dim=8,
                   prior_vq_quantizer_codebook_size=64)
    generator = torch.Generator().manual_seed(SEED)
    return model, dict(hidden_states=_random(generator, 1, 4, 8, 8),
                       encoder_hidden_states=_random(generator, 1, 12, 32),
                       prior_token_id=torch.tensor([3]), prior_token_drop=torch.zeros(1, dtype=torch.bool),
                       timestep=torch.tensor([500]), target_size=torch.tensor([[8.0, 8.0]]),
                       crop_coords=torch.tensor([[0.0, 0.0]]))


def ernie_image():
    model = _built("ErnieImageTransformer2DModel", hidden_size=16, num_attention_heads=1, num_layers=1,
                   ffn_hidden_size=16, in_channels=16, out_channels=16, patch_size=1, text_in_dim=16, rope_theta=256,
                   rope_axes_dim=(8, 4, 4), eps=1e-6, qk_layernorm=True)
    generator = torch.Generator().manual_seed(SEED)
    return model, dict(hidden_states=_random(generator, 1, 16, 8, 8), timestep=torch.tensor([1.0]),
                       text_bth=_random(generator, 1, 16, 16), text_lens=torch.tensor([16]))


def z_image():
    model = _built("ZImageTransformer2DModel", all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=16,
                   n_layers=1, n_refiner_layers=1, n_heads=1, n_kv_heads=2, qk_norm=True, cap_feat_dim=16,
                   rope_theta=256.0, t_scale=1000.0, axes_dims=[8, 4, 4], axes_lens=[256, 32, 32])
    generator = torch.Generator().manual_seed(SEED)
    return model, dict(x=[_random(generator, 16, 1, 8, 8)], cap_feats=[_random(generator, 16, 16)],
                       t=torch.tensor([0.5]))


def unet_2d_condition():
    model = _built("UNet2DConditionModel", block_out_channels=(8, 16), norm_num_groups=4, down_block_types=(
        "CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=8, attention_head_dim=2, out_channels=4, in_channels=4, layers_per_block=1, sample_size=16)
    generator = torch.Generator().manual_seed(SEED)
    return model, dict(sample=_random(generator, 1, 4, 16, 16), timestep=torch.tensor([10]),
                       encoder_hidden_states=_random(generator, 1, 4, 8))


def _kandinsky_inputs(generator: torch.Generator) -> dict:
    """A (B, T, H, W, C) video latent of 2 frames of 4 x 4 (2 x 2 patches of 2 x 2), 8 text tokens."""
    return dict(hidden_states=_random(generator, 1, 2, 4, 4, 4), encoder_hidden_states=_random(generator, 1, 8, 16),
                timestep=torch.tensor([500.0]), pooled_projections=_random(generator, 1, 8))


def kandinsky5():
    model = _built("Kandinsky5Transformer3DModel", in_visual_dim=4, in_text_dim=16, in_text_dim2=8, time_dim=16,
                   out_visual_dim=4, patch_size=(1, 2, 2), model_dim=32, ff_dim=64, num_text_blocks=1,
                   num_visual_blocks=2, axes_dims=(4, 6, 6))
    generator = torch.Generator().manual_seed(SEED)
    return model, dict(**_kandinsky_inputs(generator), text_rope_pos=torch.arange(8),
                       visual_rope_pos=[torch.arange(2), torch.arange(2), torch.arange(2)])


def kandinsky6():
    model = _built("Kandinsky6Transformer3DModel", in_visual_dim=4, out_visual_dim=4, in_text_dim=16, in_text_dim2=8,
                   time_dim=16, patch_size=(1, 2, 2), model_dim=32, ff_dim=64, num_text_blocks=1, num_visual_blocks=1,
                   axes_dims=(4, 6, 6), visual_cond=False, in_audio_dim=4, out_audio_dim=4, model_dim_a=16,
                   time_dim_a=16, ff_dim_a=32, axes_dims_a=(8,))
    generator = torch.Generator().manual_seed(SEED)
    return model, dict(**_kandinsky_inputs(generator), audio_hidden_states=_random(generator, 1, 6, 4))


def dreamlite_unet():
    model = _built("DreamLiteUNetModel", block_out_channels=(16, 32, 32), norm_num_groups=4, cross_attention_dim=16,
                   attention_head_dim=8, layers_per_block=1, sample_size=16, in_channels=4, out_channels=4, ff_mult=2)
    generator = torch.Generator().manual_seed(SEED)
    return model, dict(sample=_random(generator, 1, 4, 16, 16), timestep=torch.tensor([10]),
                       encoder_hidden_states=_random(generator, 1, 6, 16))


def sana_wm():
    model = _built("SanaWMTransformer3DModel", in_channels=4, num_layers=2, hidden_size=32, num_attention_heads=2,
                   softmax_every_n=2, linear_head_dim=16, chunk_plucker_channels=8, chunk_plucker_post_attn_blocks=2,
                   image_size=64, caption_channels=16, mlp_ratio=2.0, mixed_precision="fp32", fp32_attention=False)
    generator = torch.Generator().manual_seed(SEED)
    frames = 2
    # Camera conditions per frame: a flattened 4x4 camera-to-world matrix (identity: a still camera), then the
    # intrinsics fx, fy, cx, cy of a 32 x 32 image.
    camera = torch.cat([torch.eye(4).reshape(1, 1, 16), torch.tensor([[[32.0, 32.0, 16.0, 16.0]]])], -1)
    return model, dict(hidden_states=_random(generator, 1, 4, frames, 4, 4), timestep=torch.full((1, 1, frames), 500.0),
                       encoder_hidden_states=_random(generator, 1, 1, 8, 16), encoder_attention_mask=torch.ones(1, 8),
                       camera_conditions=camera.expand(1, frames, 20),
                       chunk_plucker=_random(generator, 1, 8, frames, 4, 4))


def sana_wm_refiner():
    model = _built("SanaWMLTX2RefinerTransformer3DModel", in_channels=4, out_channels=4, num_attention_heads=2,
                   attention_head_dim=8, cross_attention_dim=16, audio_in_channels=4, audio_out_channels=4,
                   audio_num_attention_heads=2, audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=2,
                   caption_channels=16, rope_double_precision=False)
    generator = torch.Generator().manual_seed(SEED)
    tokens = 2 * 4 * 4  # one refined block of 2 latent frames of 4 x 4, at absolute frames 0 and 1
    rotary = model.build_rotary_emb_for_absolute_positions(1, [0, 1], 4, 4, torch.device("cpu"), 25.0)
    return model, dict(hidden_states=_random(generator, 1, tokens, 4),
                       encoder_hidden_states=_random(generator, 1, 8, 16), timestep=torch.full((1, tokens), 500.0),
                       video_rotary_emb=rotary,
                       encoder_attention_mask=torch.ones(1, 8))


def kandinsky6_sr():
    # NABLA groups the token grid into 8 x 8 blocks: 2 frames of 8 x 8 patches (16 x 16 latents), 128 tokens.
    model = _built("Kandinsky6SRTransformer3DModel", in_visual_dim=4, out_visual_dim=4, time_dim=16,
                   patch_size=(1, 2, 2), model_dim=24, ff_dim=32, num_visual_blocks=2, axes_dims=(4, 4, 4))
    generator = torch.Generator().manual_seed(SEED)
    # The channels are the noisy latent, the anchor latent and the anchor mask: 2 x 4 + 1.
    return model, dict(hidden_states=_random(generator, 1, 2, 16, 16, 9), timestep=torch.tensor([500.0]))


def bria_fibo2():
    model = _built("BriaFibo2Transformer2DModel", in_channels=4, patch_size=2, dim=32, n_layers=2, n_refiner_layers=1,
                   n_heads=2, cap_feat_dim=24, injection_layer_ids=(1,), perceiver_num_layers=1,
                   min_num_gist_tokens=4, max_num_gist_tokens=8, gist_step=4, gist_min_text_len=4,
                   gist_max_text_len=16, axes_dims=(4, 6, 6), axes_lens=(16, 16, 16))
    generator = torch.Generator().manual_seed(SEED)
    # The text features are stacked bundles: the perceiver's first, then one per injection block.
    return model, dict(hidden_states=_random(generator, 1, 4, 8, 8), timestep=torch.tensor([0.5]),
                       encoder_hidden_states=_random(generator, 1, 2, 6, 24))


def joy_image_edit_plus():
    model = _built("JoyImageEditPlusTransformer3DModel", patch_size=[1, 2, 2], in_channels=16, hidden_size=32,
                   num_attention_heads=2, text_dim=16, num_layers=2, rope_dim_list=[4, 6, 6], theta=256)
    generator = torch.Generator().manual_seed(SEED)
    # Packed patches of (16 channels, 1, 2, 2): the target's (t, h, w) = (1, 2, 2) grid of them, then a reference's.
    return model, dict(hidden_states=_random(generator, 1, 8, 16, 1, 2, 2),
                       encoder_hidden_states=_random(generator, 1, 12, 16), timestep=torch.tensor([1.0]),
                       shape_list=[[(1, 2, 2), (1, 2, 2)]])


def anyflow_far():
    model = _built("AnyFlowFARTransformer3DModel", patch_size=(1, 2, 2), compressed_patch_size=(1, 4, 4),
                   full_chunk_limit=3, num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
                   text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True, rope_max_seq_len=32,
                   gate_value=0.25, deltatime_type="r")
    generator = torch.Generator().manual_seed(SEED)
    # Two chunks of 2 frames of 16 x 16 latents. The block-causal mask is built outside forward, as under
    # torch.compile the model needs (building it inside breaks the graph).
    chunks, height, width = [2, 2], 16, 16
    mask = model.build_attention_mask(chunk_partition=chunks, height=height, width=width, device=torch.device("cpu"))
    return model, dict(hidden_states=_random(generator, 1, sum(chunks), 4, height, width),
                       timestep=torch.full((1, sum(chunks)), 500.0), r_timestep=torch.full((1, sum(chunks)), 250.0),
                       encoder_hidden_states=_random(generator, 1, 12, 16), chunk_partition=chunks,
                       attention_mask=mask)


def qwen_image21():
    model = _built("QwenImage21Transformer2DModel", patch_size=1, in_channels=4, out_channels=4, num_layers=2,
                   attention_head_dim=16, num_attention_heads=2, context_in_dim=8, mlp_ratio=2,
                   axes_dims_rope=(4, 6, 6))
    generator = torch.Generator().manual_seed(SEED)
    # 6 text tokens, then the target image of 4 x 4 latent tokens; the vision-language encoder's sequence holds
    # one image slot per 2 x 2 group of them after the text.
    text, height, width = 6, 4, 4
    image_slots = torch.arange(text + height * width // 4).unsqueeze(0) >= text
    return model, dict(hidden_states=_random(generator, 1, height * width, 4),
                       encoder_hidden_states=_random(generator, 1, text, 8),
                       encoder_hidden_states_mask=torch.ones(1, text, dtype=torch.long), timestep=torch.tensor([1.0]),
                       img_shapes=[[(1, height, width)]], img_mask=image_slots)


def _packed_minimax_h3_layout(text: int, audio: int, video: int) -> dict:
    """One packed MiniMax-H3 sequence, text rows then audio rows then video rows: each row's modality tag (0 video,
    1 text, 2 audio), its timestep (the audio rows their own), its (t, h, w) rotary position (video on a 4 x 2 grid)."""
    length = text + audio + video
    text_rows, audio_rows = torch.arange(text), torch.arange(text, text + audio)
    video_rows = torch.arange(text + audio, length)
    tags = torch.zeros(length, dtype=torch.long)
    tags[text_rows], tags[audio_rows] = 1, 2
    timestep_of_row = torch.zeros(length, dtype=torch.long)
    timestep_of_row[audio_rows] = 1
    positions = torch.zeros(length, 3)
    positions[:, 0] = torch.arange(length, dtype=torch.float32)
    positions[video_rows, 1] = (torch.arange(video) // 2 % 4).float()
    positions[video_rows, 2] = (torch.arange(video) % 2).float()
    return dict(timestep=torch.tensor([0.7, 0.3]), timestep_indices=timestep_of_row, token_tags=tags,
                position_ids=positions, video_indices=video_rows, audio_indices=audio_rows, text_indices=text_rows)


def minimax_h3():
    # Heads x head dim (32) differ from the hidden size (24), as in the released model; the rotary covers part of
    # each head.
    model = _built("MiniMaxH3Transformer3DModel", num_attention_heads=2, attention_head_dim=16, hidden_size=24,
                   num_layers=2, num_refiner_layers=1, ffn_dim=32, in_channels=4, audio_in_channels=6,
                   patch_size=(1, 2, 2), text_dim=8, freq_dim=8, time_embed_hidden_dim=24, time_embed_dim=16,
                   rope_freq_dim=2)
    generator = torch.Generator().manual_seed(SEED)
    text, audio, video = 6, 8, 16
    return model, dict(hidden_states=_random(generator, 1, video, 16),
                       audio_hidden_states=_random(generator, 1, audio, 6),
                       encoder_hidden_states=_random(generator, 1, text, 8),
                       **_packed_minimax_h3_layout(text, audio, video))


def cosmos3_omni():
    model = _built("Cosmos3OmniTransformer", head_dim=8, hidden_size=32, intermediate_size=48, latent_channel=4,
                   latent_patch_size=1, num_attention_heads=4, num_hidden_layers=2, num_key_value_heads=2,
                   patch_latent_dim=4, rope_axes_dim=[2, 1, 1], rope_theta=1e4, vocab_size=32)
    generator = torch.Generator().manual_seed(SEED)
    # One packed sequence: 8 text tokens, then one noisy frame of 4 x 4 latent tokens. Rotary positions (t, h, w):
    # the text counts up on all three axes, the frame sits at the next t on its own rows and columns.
    text, height, width = 8, 4, 4
    length = text + height * width
    rows, columns = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    positions = torch.cat([torch.arange(text).expand(3, text),
                           torch.stack([torch.full((height * width,), text), rows.flatten(), columns.flatten()])], 1)
    vision_rows = torch.arange(text, length)
    return model, dict(input_ids=torch.randint(0, 32, (text,), generator=generator), text_indexes=torch.arange(text),
                       position_ids=positions, und_len=text, sequence_length=length,
                       vision_tokens=[_random(generator, 1, 4, 1, height, width)],
                       vision_token_shapes=[(1, height, width)], vision_sequence_indexes=vision_rows,
                       vision_mse_loss_indexes=vision_rows, vision_timesteps=torch.full((height * width,), 500.0),
                       vision_noisy_frame_indexes=[torch.tensor([0])])


def wan_animate():
    # The face video's 77 frames become the motion features of 20 latent frames (+ 1 reference frame): the frame
    # count is fixed, so the frames are kept to 4 x 4 latents (2 x 2 patches), 84 tokens.
    model = _built("WanAnimateTransformer3DModel", patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                   in_channels=12, latent_channels=4, out_channels=4, text_dim=16, freq_dim=256, ffn_dim=32,
                   num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads", image_dim=16,
                   rope_max_seq_len=32, motion_encoder_channel_sizes={"4": 16, "8": 16, "16": 16},
                   motion_encoder_size=16, motion_style_dim=8, motion_dim=4, motion_encoder_dim=16,
                   face_encoder_hidden_dim=16, face_encoder_num_heads=2, inject_face_latents_blocks=2)
    generator = torch.Generator().manual_seed(SEED)
    frames, height, width = 20, 4, 4
    # The latent channels: the noisy latent, the reference latent and a 4-channel mask (2 x 4 + 4).
    return model, dict(hidden_states=_random(generator, 1, 12, frames + 1, height, width), timestep=torch.tensor([500]),
                       encoder_hidden_states=_random(generator, 1, 12, 16),
                       encoder_hidden_states_image=_random(generator, 1, 12, 16),
                       pose_hidden_states=_random(generator, 1, 4, frames, height, width),
                       face_pixel_values=_random(generator, 1, 3, 77, 16, 16))


def _wan_animate2_pass(generator: torch.Generator, frames: int, kv_cache, mode: str) -> dict:
    """One pass over 8 x 8 latents (4 x 4 patches) of `frames` frames: 16 latent and 20 condition channels, 8 text
    tokens, 4 CLIP image tokens (the image projection's width is fixed at 1280)."""
    return dict(hidden_states=[_random(generator, 16, frames, 8, 8)], timestep=torch.tensor([500.0]),
                encoder_hidden_states=[_random(generator, 8, 32)],
                condition_latents=[_random(generator, 20, frames, 8, 8)],
                encoder_hidden_states_image=_random(generator, 1, 4, 1280), kv_cache=kv_cache, kv_cache_mode=mode,
                seq_len=frames * 16)


def wan_animate2():
    """A denoising step: the reference pass (2 latent frames) fills the KV cache eagerly here, then the step over the
    generation stream (3 frames: the reference image's slot first) attends to it under the block mask of a
    5-frame 64 x 64 segment."""
    from diffusers.models.transformers.transformer_wan_animate_2 import WanAnimate2KVCache

    model = _built("WanAnimate2Transformer3DModel", patch_size=(1, 2, 2), text_len=16, in_dim=36, dim=32, ffn_dim=64,
                   freq_dim=64, text_dim=32, out_dim=16, num_heads=2, num_layers=2, cross_attn_norm=True,
                   use_img_emb=True)
    generator = torch.Generator().manual_seed(SEED)
    cache = WanAnimate2KVCache(2)
    reference_grid = torch.tensor([[2, 4, 4]])
    with torch.no_grad():
        model(**_wan_animate2_pass(generator, 2, cache, "extract"), offset_grid_sizes=reference_grid)
    return model, dict(**_wan_animate2_pass(generator, 3, cache, "cached"), reference_grid_sizes=reference_grid,
                       origin_len=5, origin_area=[64, 64])


def autoencoder_minimax_h3():
    # The released clip length (17) and token drop (3) fix the frame count: 17 n + 5 pixel frames, here 22 (7 latent
    # frames); the repeated blocks are its ViT decoder's. One encode-decode round trip of 16 x 16 pixels.
    model = _built("AutoencoderKLMiniMaxH3", in_channels=3, out_channels=3, latent_channels=4,
                   block_out_channels=(8, 16), layers_per_block=1, spatial_downsample_factors=(2, 2),
                   temporal_downsample_factors=(2, 2), norm_num_groups=8, decoder_num_layers=2,
                   decoder_num_attention_heads=2, decoder_attention_head_dim=8, decoder_num_register_tokens=2,
                   decoder_ffn_mult=2, clip_length=17, token_drop=3,
                   latents_mean=(0.0,) * 4, latents_std=(1.0,) * 4)
    generator = torch.Generator().manual_seed(SEED)
    return model, dict(sample=_random(generator, 1, 3, 22, 16, 16))


# A protein of 16 residues seen through the fewest features: noisy backbone coordinates and local latents, token
# types, the two times, pairwise distances (features a model is configured to read but that are absent are zero).
PROTEIN_FEATURES = dict(feats_seq=("xt_bb_ca", "xt_local_latents", "token_type"),
                        feats_cond_seq=("time_emb_bb_ca", "time_emb_local_latents"),
                        feats_pair_repr=("xt_bb_ca_pair_dists",))


def rfd4_proteina_transformer():
    model = _built("RFD4ProteinaTransformer", nlayers=2, token_dim=32, nheads=2, dim_cond=16, pair_repr_dim=16,
                   latent_dim=8, t_emb_dim=16, tri_mult_c=8, num_sequence_classes=24, **PROTEIN_FEATURES)
    generator = torch.Generator().manual_seed(SEED)
    residues = 16
    return model, dict(bb_ca=_random(generator, 1, residues, 3), local_latents=_random(generator, 1, residues, 8),
                       bb_ca_time=torch.tensor([0.4]), local_latents_time=torch.tensor([0.6]),
                       padding_mask=torch.ones(1, residues, dtype=torch.bool),
                       token_type=torch.randint(0, 7, (1, residues), generator=generator),
                       conditioning=dict(is_in_context_conditioning=torch.zeros(1, residues, dtype=torch.bool),
                                         supports_local_latent=torch.ones(1, residues, dtype=torch.bool)))


def rfd4_proteina_autoencoder():
    # Its forward is the decoder: latents and backbone positions to atom37 coordinates. The residue vocabulary (24
    # types here) comes with two tables, drawn at random: the atom slots of each residue type and the residue types
    # each token type may decode to.
    tables = torch.Generator().manual_seed(SEED)
    residue_types, token_types = 24, 7
    atom_slots = torch.rand(residue_types, 37, generator=tables) < 0.5
    allowed = torch.rand(token_types, residue_types, generator=tables) < 0.5
    model = _built("RFD4ProteinaAutoencoder", atom37_mask=atom_slots.tolist(), allowed_residue_types=allowed.tolist(),
                   latent_dim=8, n_residue_types=residue_types, num_token_types=token_types, nlayers=2, token_dim=32,
                   nheads=2, dim_cond=16, pair_repr_dim=16)
    generator = torch.Generator().manual_seed(SEED)
    residues = 16
    return model, dict(z_latent=_random(generator, 1, residues, 8), ca_coors_nm=_random(generator, 1, residues, 3),
                       padding_mask=torch.ones(1, residues, dtype=torch.bool),
                       token_type=torch.randint(0, token_types, (1, residues), generator=generator),
                       conditioning=dict(is_in_context_conditioning=torch.zeros(1, residues, dtype=torch.bool),
                                         supports_local_latent=torch.ones(1, residues, dtype=torch.bool)))


MODELS: dict[str, Callable[[], tuple]] = {
    "FluxTransformer2DModel": flux,
    "Flux2Transformer2DModel": flux2,
    "ChromaTransformer2DModel": chroma,
    "LongCatImageTransformer2DModel": longcat_image,
    "OvisImageTransformer2DModel": ovis_image,
    "Flux3Transformer2DModel": flux3,
    "HunyuanImageTransformer2DModel": hunyuan_image,
    "QwenImageTransformer2DModel": qwen_image,
    "WanTransformer3DModel": wan,
    "SkyReelsV2Transformer3DModel": skyreels_v2,
    "ChronoEditTransformer3DModel": chronoedit,
    "AnyFlowTransformer3DModel": anyflow,
    "WanVACETransformer3DModel": wan_vace,
    "LTXVideoTransformer3DModel": ltx_video,
    "LTX2VideoTransformer3DModel": ltx2_video,
    "MotifVideoTransformer3DModel": motif_video,
    "NucleusMoEImageTransformer2DModel": nucleus_moe_image,
    "LongCatAudioDiTTransformer": longcat_audio_dit,
    "MiniMaxMusic3Transformer1DModel": minimax_music3,
    "BriaFiboTransformer2DModel": bria_fibo,
    "HunyuanVideoTransformer3DModel": hunyuan_video,
    "HeliosTransformer3DModel": helios,
    "HunyuanVideo15Transformer3DModel": hunyuan_video15,
    "Krea2Transformer2DModel": krea2,
    "Ideogram4Transformer2DModel": ideogram4,
    "StableAudio3DiTModel": stable_audio3,
    "JoyImageEditTransformer3DModel": joy_image_edit,
    "GlmImageTransformer2DModel": glm_image,
    "ErnieImageTransformer2DModel": ernie_image,
    "ZImageTransformer2DModel": z_image,
    "UNet2DConditionModel": unet_2d_condition,
    "Kandinsky5Transformer3DModel": kandinsky5,
    "Kandinsky6Transformer3DModel": kandinsky6,
    "DreamLiteUNetModel": dreamlite_unet,
    "SanaWMTransformer3DModel": sana_wm,
    "SanaWMLTX2RefinerTransformer3DModel": sana_wm_refiner,
    "Kandinsky6SRTransformer3DModel": kandinsky6_sr,
    "BriaFibo2Transformer2DModel": bria_fibo2,
    "JoyImageEditPlusTransformer3DModel": joy_image_edit_plus,
    "AnyFlowFARTransformer3DModel": anyflow_far,
    "QwenImage21Transformer2DModel": qwen_image21,
    "MiniMaxH3Transformer3DModel": minimax_h3,
    "Cosmos3OmniTransformer": cosmos3_omni,
    "WanAnimateTransformer3DModel": wan_animate,
    "AutoencoderKLMiniMaxH3": autoencoder_minimax_h3,
    "RFD4ProteinaTransformer": rfd4_proteina_transformer,
    "RFD4ProteinaAutoencoder": rfd4_proteina_autoencoder,
}


# Classes that fail with Dynamo's pass-through backend too (``compile_repeated_blocks(backend="eager",
# fullgraph=True)``): not ours to fix. Each keeps a builder, so ``diffusers_bench.py --only`` shows the failure.
FAILING_WITH_PASS_THROUGH: dict[str, Callable[[], tuple]] = {
    "WanAnimate2Transformer3DModel": wan_animate2,
}

UNLISTED: dict[str, str] = {
    "WanAnimate2Transformer3DModel": "fails with the pass-through backend too: its block's rotary (`rope_apply`) "
    "iterates `grid_sizes.tolist()` and slices by those values, so Dynamo's full graph stops on a data-dependent "
    "guard (`GuardOnDataDependentSymNode: Could not guard on data-dependent expression 4*u4 < 2`), in the reference "
    "pass and in the cached denoising step alike",
}


def builder(class_name: str) -> Callable[[], tuple]:
    """The builder of a class in ``MODELS`` or in ``FAILING_WITH_PASS_THROUGH``."""
    return MODELS.get(class_name) or FAILING_WITH_PASS_THROUGH[class_name]


def first_output(output) -> torch.Tensor:
    """The sample tensor of a model's output (``.sample``, an output dataclass's first field, a tuple's first item,
    or a list of per-item tensors)."""
    if hasattr(output, "sample"):
        output = output.sample
    elif hasattr(output, "to_tuple"):  # an output dataclass without a sample field: its first field that is set
        output = output.to_tuple()
    if isinstance(output, tuple | list):
        output = output[0]
    if isinstance(output, list):
        output = torch.stack(output)
    return output

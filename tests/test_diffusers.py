"""Diffusers transformers through ``compile_repeated_blocks(backend="neuron")``: tiny random-weight models against
eager, one compile per block class (as diffusers' own regional-compile tests demand: ``recompile_limit=1``)."""

from __future__ import annotations

import pytest
import torch

import neuron_compile

diffusers = pytest.importorskip("diffusers")


def regional(model, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(eager output, output with the repeated blocks compiled by our backend, our stats), one compile per block
    class: a second instance of a block class that recompiled would raise."""
    with torch.no_grad():
        expected = model(**kwargs)[0]
        torch._dynamo.reset()
        neuron_compile.reset_stats()
        model.compile_repeated_blocks(backend="neuron", fullgraph=True, dynamic=False)
        with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
            actual = model(**kwargs)[0]
    torch._dynamo.reset()
    return expected, actual, neuron_compile.stats()


def tiny_flux():
    torch.manual_seed(0)
    model = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=2, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8]).eval()
    generator = torch.Generator().manual_seed(0)
    image_ids = torch.cartesian_prod(torch.zeros(1), torch.arange(4.0), torch.arange(4.0))
    kwargs = dict(hidden_states=torch.randn(1, 16, 4, generator=generator),
                  encoder_hidden_states=torch.randn(1, 8, 32, generator=generator),
                  pooled_projections=torch.randn(1, 32, generator=generator), img_ids=image_ids,
                  txt_ids=torch.zeros(8, 3), timestep=torch.tensor([0.5]))
    return model, kwargs


def test_flux_blocks_compiled_per_class_match_eager():
    expected, actual, stats = regional(*tiny_flux())
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert stats["graphs_compiled"] == 2  # FluxTransformerBlock (two instances: one compile), the single block
    assert stats["fallback_nodes"] == 0 and stats["nki_nodes"] > 200


def test_vae_decoder_compiled_matches_eager():
    # A two-level AutoencoderKL decoder (its mid-block attention makes the rest channels last): stride-1
    # convolutions, group norms, silu, the nearest upsampler and attention, all in kernels.
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=[4, 8], layers_per_block=1, latent_channels=4,
        norm_num_groups=2, sample_size=4).eval()
    latents = torch.randn(1, 4, 2, 2, generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    neuron_compile.reset_stats()
    with torch.no_grad():
        expected = vae.decoder(latents)
        actual = torch.compile(vae.decoder, backend="neuron")(latents)
    torch._dynamo.reset()
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    stats = neuron_compile.stats()
    assert stats["graphs_compiled"] == 1 and stats["fallback_nodes"] == 0 and stats["nki_nodes"] > 100


@pytest.mark.slow
def test_qwen_image_rotary_runs_as_real_pairs():
    torch.manual_seed(0)
    model = diffusers.QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=4,
        joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(8, 4, 4)).eval()
    generator = torch.Generator().manual_seed(0)
    kwargs = dict(hidden_states=torch.randn(1, 16, 16, generator=generator),
                  encoder_hidden_states=torch.randn(1, 8, 16, generator=generator),
                  encoder_hidden_states_mask=torch.ones(1, 8, dtype=torch.long), timestep=torch.tensor([1.0]),
                  img_shapes=[(1, 4, 4)])
    expected, actual, stats = regional(model, kwargs)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    # The complex frequencies (image and text) enter the region as fp32 pairs: nothing runs eagerly.
    assert stats["fallback_nodes"] == 0 and stats["graphs_compiled"] == 1


@pytest.mark.slow
def test_wan_interleaved_rotary_runs_in_kernels():
    torch.manual_seed(0)
    model = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32).eval()
    generator = torch.Generator().manual_seed(0)
    kwargs = dict(hidden_states=torch.randn(1, 4, 2, 8, 8, generator=generator),
                  encoder_hidden_states=torch.randn(1, 12, 16, generator=generator), timestep=torch.tensor([500]))
    expected, actual, stats = regional(model, kwargs)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert stats["graphs_compiled"] == 1 and stats["fallback_nodes"] == 0  # slice_scatter with step 2 included


@pytest.mark.slow
def test_kandinsky6_sr_flex_attention_runs_in_kernels():
    # NABLA's sparse attention through flex_attention: the reference's dense attention in kernels (its block lists,
    # sorted on the block statistics, are not read by the reference and go), as eager computes it.
    torch.manual_seed(0)
    model = diffusers.Kandinsky6SRTransformer3DModel(
        in_visual_dim=4, out_visual_dim=4, time_dim=16, patch_size=(1, 2, 2), model_dim=24, ff_dim=32,
        num_visual_blocks=2, axes_dims=(4, 4, 4)).eval()
    generator = torch.Generator().manual_seed(0)
    # 2 frames of 8 x 8 patches: NABLA's token grid must be a multiple of its 8 x 8 blocks
    kwargs = dict(hidden_states=torch.randn(1, 2, 16, 16, 9, generator=generator), timestep=torch.tensor([500.0]))
    expected, actual, stats = regional(model, kwargs)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert stats["graphs_compiled"] == 1 and stats["fallback_nodes"] == 0

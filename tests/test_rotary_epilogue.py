"""A q / k projection whose rotary embedding runs in its own epilogue (kinds/matmul_rotary.py, the rule in
kinds/rotary_epilogue_rule.py, the driver passes/rotary_epilogues.py): ``x * cos + rotate_half(x) * sin`` computed on
the projection's output tiles of whole heads, rotate_half a read of the same tile at +-head_dim/2, cos and sin per
position and column within the head. Against eager, and bit for bit against the separate concat kernel it
replaces; a layout the epilogue refuses keeps the concat kernel and says why."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowering_harness import check_against_eager, compile_and_run, random_tensor, trace
from neuron_compile import ir
from neuron_compile.hardware import get_target
from neuron_compile.kinds.matmul_rotary import whole_heads
from neuron_compile.lowering import lower_graph
from neuron_compile.passes import fusion
from neuron_compile.passes.fusion import fuse


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def cos_sin(positions, inv_freq, dtype):
    """Llama's rotary angles for ``positions`` ([batch, seq], whole numbers as floats: an int64 graph input has no
    proved range), as transformers computes them."""
    freqs = positions[:, :, None].float() * inv_freq[None, None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotated_projections(heads: int, kv_heads: int, head_dim: int):
    """q and k projected from ``x`` ([batch, seq, hidden]), split into heads, rotated (Llama's attention up to the
    scores)."""
    def fn(x, wq, wk, positions, inv_freq):
        batch, seq, _ = x.shape
        q = (x @ wq).view(batch, seq, heads, head_dim).transpose(1, 2)
        k = (x @ wk).view(batch, seq, kv_heads, head_dim).transpose(1, 2)
        cos, sin = cos_sin(positions, inv_freq, x.dtype)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    return fn


def rms_norm(x, weight):
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return weight * (x.float() * torch.rsqrt(variance + 1e-6)).to(x.dtype)


def normed_rotated_projections(heads: int, kv_heads: int, head_dim: int, normed_k_too: bool = False,
                               transposed: bool = False):
    """Qwen3's attention up to the scores: q and k normed per head (an RMSNorm over head_dim) before the rotary;
    ``normed_k_too``: the normed k is returned as well; ``transposed``: normed after the heads' transpose, over
    [batch, heads, seq, head_dim], with a (1 + weight) (Gemma3's)."""
    def norm(x, weight):
        return rms_norm(x.transpose(1, 2), 1 + weight) if transposed else rms_norm(x, weight).transpose(1, 2)

    def fn(x, wq, wk, positions, inv_freq, q_weight, k_weight):
        batch, seq, _ = x.shape
        q = norm((x @ wq).view(batch, seq, heads, head_dim), q_weight)
        k = norm((x @ wk).view(batch, seq, kv_heads, head_dim), k_weight)
        cos, sin = cos_sin(positions, inv_freq, x.dtype)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        rotated = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        return (*rotated, k) if normed_k_too else rotated

    return fn


def rotary_inputs(seq, heads, kv_heads, head_dim, dtype, hidden=96, first_position=0):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    positions = (first_position + torch.randperm(seq, generator=torch.Generator().manual_seed(seq)))[None].float()
    return [random_tensor((1, seq, hidden), dtype, seed=0),
            random_tensor((hidden, heads * head_dim), dtype, seed=1) / hidden ** 0.5,
            random_tensor((hidden, kv_heads * head_dim), dtype, seed=2) / hidden ** 0.5, positions, inv_freq]


def _rotary_decisions(decisions) -> list[str]:
    return [decision for decision in decisions if "(a rotary): " in decision and "concat, not" not in decision]


def _fused(fn, *inputs):
    lowered = lower_graph(trace(fn, *inputs))
    return fuse(lowered.nodes, {value.buffer for value in lowered.outputs}, target=get_target("trn2"))


@pytest.mark.slow  # ~10 s an example; the fused / separate and layout tests below are the fast smoke tests
@settings(max_examples=10, deadline=None)
@given(seq=st.sampled_from([1, 127, 128, 129, 300]), head_dim=st.sampled_from([64, 128]),
       heads=st.sampled_from([1, 3, 8, 12]), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_the_rotary_in_the_projections_matches_eager(seq, head_dim, heads, dtype):
    """Heads that fill an N tile (8 of 64) and do not (3, 12: a ragged last tile), positions not 0..n-1."""
    check_rotated_in_projections(seq, heads, 1, head_dim, dtype, first_position=17)


def check_rotated_in_projections(seq, heads, kv_heads, head_dim, dtype, first_position=0):
    """Llama's q and k rotated (``rotated_projections``) against eager, every rotary in its projection."""
    inputs = rotary_inputs(seq, heads, kv_heads, head_dim, dtype, first_position=first_position)
    region = check_against_eager(rotated_projections(heads, kv_heads, head_dim), *inputs)
    decisions = _rotary_decisions(region.fusion_decisions)
    assert decisions and all(decision.endswith(": fused") for decision in decisions), decisions


@pytest.mark.parametrize("seq, heads, kv_heads, head_dim, dtype", [
    (129, 8, 2, 64, torch.bfloat16), (300, 4, 2, 128, torch.float32), (1, 32, 4, 64, torch.bfloat16)])
def test_the_fused_kernels_give_the_separate_rotary(monkeypatch, seq, heads, kv_heads, head_dim, dtype):
    """Bit for bit: the same instructions on the same values as the concat kernels."""
    fn, inputs = rotated_projections(heads, kv_heads, head_dim), rotary_inputs(seq, heads, kv_heads, head_dim, dtype)
    region, fused = compile_and_run(fn, *inputs)
    assert [decision.endswith(": fused") for decision in _rotary_decisions(region.fusion_decisions)] == [True, True]
    monkeypatch.setattr(fusion, "fold_rotary_epilogues", lambda kernels, *args: (kernels, args[-1]))
    region, apart = compile_and_run(fn, *inputs)
    assert not _rotary_decisions(region.fusion_decisions)
    assert all(torch.equal(one, other) for one, other in zip(fused, apart, strict=True))


def test_the_projections_store_only_the_rotated_heads():
    fn = rotated_projections(32, 4, 64)
    result = _fused(fn, *rotary_inputs(256, 32, 4, 64, torch.bfloat16, hidden=256))
    rotated = [kernel for kernel in result.kernels if isinstance(kernel, ir.MatMulRotary)]
    assert len(rotated) == 2 and not any(entry.store_source for kernel in rotated for entry in kernel.rotaries)
    assert not any(isinstance(kernel, ir.MatMul) for kernel in result.kernels)


def test_a_projection_read_elsewhere_is_still_stored():
    """k also returned unrotated (a cache of keys before the rotary): the projection stores it beside the rotary."""
    rotate = rotated_projections(4, 2, 64)

    def fn(x, wq, wk, positions, inv_freq):
        q, k = rotate(x, wq, wk, positions, inv_freq)
        return q, k, x @ wk

    region = check_against_eager(fn, *rotary_inputs(129, 4, 2, 64, torch.float32))
    assert [d.endswith(": fused") for d in _rotary_decisions(region.fusion_decisions)] == [True, True]


def test_heads_stored_in_another_layout_are_stored_part_by_part():
    """q and k made contiguous over [batch, heads, seq, head_dim]: the rotated heads are not laid out as the product,
    so each part goes to HBM through its own access pattern."""
    rotate = rotated_projections(4, 2, 64)

    def fn(x, wq, wk, positions, inv_freq):
        return tuple(rotated.contiguous() for rotated in rotate(x, wq, wk, positions, inv_freq))

    inputs = rotary_inputs(129, 4, 2, 64, torch.float32)
    region = check_against_eager(fn, *inputs)
    assert [d.endswith(": fused") for d in _rotary_decisions(region.fusion_decisions)] == [True, True]
    rotated = [kernel for kernel in _fused(fn, *inputs).kernels if isinstance(kernel, ir.MatMulRotary)]
    assert len(rotated) == 2 and not any(whole_heads(kernel, entry) for kernel in rotated for entry in kernel.rotaries)


@pytest.mark.parametrize("shared_positions", [False, True])
def test_a_batch_of_sequences(shared_positions):
    """Two sequences through a linear: M is batch x sequence. Positions per sequence (cos and sin [2, seq, d]) walk
    the rows as M does: fused. Positions shared by the batch (cos and sin repeat every sequence) do not: the concat
    stays, and the decisions say why."""
    inputs = rotary_inputs(24, 4, 2, 64, torch.float32)
    inputs[0] = random_tensor((2, 24, 96), torch.float32, seed=7)
    inputs[3] = inputs[3] if shared_positions else torch.cat([inputs[3], inputs[3] + 24])
    region = check_against_eager(rotated_projections(4, 2, 64), *inputs)
    decisions = _rotary_decisions(region.fusion_decisions)
    if shared_positions:
        assert decisions and all("do not walk its rows" in decision for decision in decisions), decisions
    else:
        assert [decision.endswith(": fused") for decision in decisions] == [True, True], decisions


def test_heads_no_tile_holds_keep_the_concat_and_say_why():
    """Heads of 640 columns: no N tile (at most 512, one PSUM bank of fp32) holds one whole, so both rotaries stay
    their own kernels and the decisions name the rule. (Heads of 96 rotate in N tiles of 480:
    tests/test_rotary_whole_heads.py.)"""
    fn, inputs = rotated_projections(2, 1, 640), rotary_inputs(3, 2, 1, 640, torch.float32)
    region = check_against_eager(fn, *inputs)
    decisions = _rotary_decisions(region.fusion_decisions)
    assert decisions and all("no N tile of at most 512 columns holds a whole head of 640" in decision
                             for decision in decisions), decisions
    assert sum(isinstance(kernel, ir.Concat) for kernel in _fused(fn, *inputs).kernels) == 3  # q's, k's, the angles'


def _norm_weights(head_dim, dtype):
    return [random_tensor((head_dim,), dtype, seed=5), random_tensor((head_dim,), dtype, seed=6)]


@pytest.mark.slow  # ~5 s an example; test_the_per_head_norm_in_the_projection_gives_the_separate_kernels is fast
@settings(max_examples=6, deadline=None)
@given(seq=st.sampled_from([1, 127, 128, 129, 300]), head_dim=st.sampled_from([64, 128]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), transposed=st.booleans())
def test_a_per_head_norm_and_the_rotary_in_the_projections_match_eager(seq, head_dim, dtype, transposed):
    """Qwen3's and Gemma3's q / k norms: each head's RMSNorm on the tile's heads, then the rotary, the normed heads
    on chip."""
    inputs = rotary_inputs(seq, 8, 2, head_dim, dtype, first_position=5) + _norm_weights(head_dim, dtype)
    region = check_against_eager(normed_rotated_projections(8, 2, head_dim, transposed=transposed), *inputs)
    decisions = _rotary_decisions(region.fusion_decisions)
    assert [decision.endswith(": fused") and " through " in decision for decision in decisions] == [True, True]


@pytest.mark.parametrize("transposed", [False, True])
def test_the_per_head_norm_in_the_projection_gives_the_separate_kernels(monkeypatch, transposed):
    fn = normed_rotated_projections(8, 2, 64, transposed=transposed)
    inputs = rotary_inputs(129, 8, 2, 64, torch.bfloat16) + _norm_weights(64, torch.bfloat16)
    _, fused = compile_and_run(fn, *inputs)
    monkeypatch.setattr(fusion, "fold_rotary_epilogues", lambda kernels, *args: (kernels, args[-1]))
    _, apart = compile_and_run(fn, *inputs)
    assert all(torch.equal(one, other) for one, other in zip(fused, apart, strict=True))


def test_normed_heads_read_elsewhere_keep_the_norm_and_say_why():
    """The normed k also returned (before its rotary): the norm stays its kernel, the rotary its own."""
    fn = normed_rotated_projections(4, 2, 64, normed_k_too=True)
    inputs = rotary_inputs(129, 4, 2, 64, torch.float32) + _norm_weights(64, torch.float32)
    region = check_against_eager(fn, *inputs)
    decisions = _rotary_decisions(region.fusion_decisions)
    assert any("normed heads are read outside" in decision for decision in decisions), decisions


@settings(max_examples=4, deadline=None)
@given(seq=st.sampled_from([1, 127, 128, 129, 300]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       normed=st.booleans())
def test_heads_of_256_rotate_in_the_projections_and_match_eager(seq, dtype, normed):
    """Gemma3-4B's heads of 256 columns, two to a 512-column N tile (q's two tiles, k's one), with and without the
    per-head norm before the rotary."""
    inputs = rotary_inputs(seq, 4, 2, 256, dtype, first_position=3)
    fn = rotated_projections(4, 2, 256)
    if normed:
        fn, inputs = normed_rotated_projections(4, 2, 256), inputs + _norm_weights(256, dtype)
    region = check_against_eager(fn, *inputs)
    decisions = _rotary_decisions(region.fusion_decisions)
    assert decisions and all(decision.endswith(": fused") for decision in decisions), decisions
    assert all((" through " in decision) == normed for decision in decisions), decisions

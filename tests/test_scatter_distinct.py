"""The scatter form whose tile elements cannot collide (kinds/scatter_distinct.py) vs eager: a static KV-cache
update (index_copy_ / index_put of one position for every batch and head), written in place through the backend,
positions at the cache's edges and outside it, a second step seeing the first's rows, and model.generate with a
static cache."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lowering_harness import check_against_eager, compile_with_backend, random_tensor, trace

import neuron_compile
from neuron_compile.pipeline import compile_region

CACHE = 256
DISTINCT = "vector_offset=offsets[0:rows, 0:1]"  # the form's one indirect write
COLLISION_SEARCH = "same[0:rows, 0:rows]"  # what the collision-resolving form computes


def cache_update(cache, position, new):
    return cache.index_copy(2, position, new)


def scatter_source(region) -> str:
    (kernel,) = [kernel for kernel in region.kernels if kernel.name.startswith("scatter_kernel")]
    return kernel.source


@pytest.mark.parametrize("position", [0, 1, 127, 128, 255])
@pytest.mark.parametrize("batch, kv_heads, dtype", [(1, 1, torch.float32), (2, 3, torch.bfloat16),
                                                    (2, 1, torch.bfloat16), (1, 4, torch.float32)])
def test_one_position_of_a_static_cache_matches_eager(position, batch, kv_heads, dtype):
    cache = random_tensor((batch, kv_heads, CACHE, 8), dtype, seed=1)
    new = random_tensor((batch, kv_heads, 1, 8), dtype, seed=2)
    region = check_against_eager(cache_update, cache, torch.tensor([position]), new)
    source = scatter_source(region)
    assert DISTINCT in source and COLLISION_SEARCH not in source
    widest = max(batch, kv_heads)  # the widest dim before the row goes on partitions: one tile of it
    assert f"rows = min({widest}, {widest} - p0)" in source


def put_at(cache, position, new):
    return torch.ops.aten.index_put(cache, [None, None, position], new)  # cache[:, :, position] = new, wrapping


def test_index_put_wraps_a_negative_position_like_eager():
    cache, new = random_tensor((2, 3, CACHE, 8), seed=3), random_tensor((2, 3, 1, 8), seed=4)
    for position in (-1, -CACHE, 5):
        region = check_against_eager(put_at, cache, torch.tensor([position]), new)
        assert DISTINCT in scatter_source(region)


def test_two_indices_of_one_element_each():
    """cache[:, h, p] = v: both indices checked (either one out of range fails the write), both wrapped."""
    cache, new = random_tensor((4, 6, 10, 8), seed=18), random_tensor((4, 1, 8), seed=19)

    def put(c, h, p, v):
        return torch.ops.aten.index_put(c, [None, h, p], v)

    for head, position in ((-2, 7), (0, -10), (5, 9)):
        region = check_against_eager(put, cache, torch.tensor([head]), torch.tensor([position]), new)
        assert DISTINCT in scatter_source(region) and "outside[0:rows, 0:1]" in scatter_source(region)
    for head, position in ((6, 0), (0, 10), (-7, 0)):
        with pytest.raises(Exception, match="err_tensor_access_out_of_bound"):
            region(cache, torch.tensor([head]), torch.tensor([position]), new)


def test_a_number_written_at_one_position():
    cache = random_tensor((2, 5, 16, 8), seed=5)
    region = check_against_eager(lambda c, p: c.index_fill(2, p, -0.0), cache, torch.tensor([-3]))
    assert DISTINCT in scatter_source(region)


@settings(max_examples=12, deadline=None)
@given(heads=st.sampled_from([1, 2, 127, 128, 129]), depth=st.sampled_from([1, 3, 64]),
       keys=st.sampled_from([1, 5, 130]), transposed=st.booleans(), data=st.data())
def test_random_single_position_writes(heads, depth, keys, transposed, data):
    """Any width of heads (tiles of 128, a ragged last one), any row width, caches stored [B, S, H, D] too."""
    position = data.draw(st.integers(0, keys - 1))
    shape = (1, keys, heads, depth) if transposed else (1, heads, keys, depth)
    cache = random_tensor(shape, seed=6)
    if transposed:
        cache = cache.transpose(1, 2)
    new = random_tensor((1, heads, 1, depth), seed=7)
    region = check_against_eager(cache_update, cache, torch.tensor([position]), new)
    assert DISTINCT in scatter_source(region)


def test_several_positions_keep_the_collision_form():
    # a prefill writes several positions: two may be equal, so the last one must win (the collision search)
    cache, new = random_tensor((1, 2, 16, 8), seed=8), random_tensor((1, 2, 3, 8), seed=9)
    region = check_against_eager(cache_update, cache, torch.tensor([4, 4, 9]), new)
    assert COLLISION_SEARCH in scatter_source(region)


@pytest.mark.parametrize("position", [CACHE, -1, 2**31 - 1, -(2**27), -(2**31)])
def test_a_position_outside_the_cache_raises_never_writes_elsewhere(position):
    """-2^27 * 8 + 2^30 = 0 would land inside the cache if the redirect added 2^30 to an address it kept."""
    cache, new = random_tensor((1, 2, CACHE, 8), seed=10), random_tensor((1, 2, 1, 8), seed=11)
    index = torch.tensor([position])
    with pytest.raises((IndexError, RuntimeError)) as eager:
        cache_update(cache, index, new)
    mine = cache.clone()
    torch._dynamo.reset()
    compiled = torch.compile(lambda c, p, v: c.index_copy_(2, p, v), backend="neuron", options={"fallback": "silent"})
    with pytest.raises(type(eager.value), match=re.escape(str(eager.value))):  # eager's own error, via the fallback
        compiled(mine, index, new)
    assert torch.equal(mine, cache)  # nothing written into the caller's cache
    region = compile_region(trace(cache_update, cache, torch.tensor([0]), new), [cache, index, new])
    assert DISTINCT in scatter_source(region)
    with pytest.raises(Exception, match="err_tensor_access_out_of_bound"):  # the kernel itself never writes
        region(cache, index, new)


def test_decode_steps_write_the_callers_cache_and_see_the_last_steps_rows():
    """Two steps of update-then-attend through the backend: after each call the caller's caches hold the new
    rows, and the second call's attention reads the first call's."""
    def step(k_cache, v_cache, k, v, q, position):
        k_cache.index_copy_(2, position, k)
        v_cache.index_copy_(2, position, v)
        mask = (torch.arange(k_cache.shape[2]) <= position).view(1, 1, 1, -1)
        return torch.nn.functional.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask,
                                                                enable_gqa=True)

    caches = [random_tensor((2, 2, 32, 16), seed=seed) for seed in (12, 13)]
    eager_caches, compiled_caches = [c.clone() for c in caches], [c.clone() for c in caches]
    torch._dynamo.reset()
    neuron_compile.reset_stats()
    compiled = torch.compile(step, backend="neuron")
    for position in (30, 31):
        k, v = (random_tensor((2, 2, 1, 16), seed=position + s) for s in (0, 1))
        q = random_tensor((2, 4, 1, 16), seed=position + 2)
        want = step(*eager_caches, k, v, q, torch.tensor([position]))
        with neuron_compile.config.patch(fallback="raise"):
            got = compiled(*compiled_caches, k, v, q, torch.tensor([position]))
        torch.testing.assert_close(got, want)
        for mine, theirs in zip(compiled_caches, eager_caches):
            assert torch.equal(mine, theirs)
    stats = neuron_compile.stats()
    assert stats["fallback_nodes"] == 0 and stats["graphs_compiled"] == 1, stats


@pytest.mark.slow
def test_generate_with_a_static_cache_gives_eagers_tokens_for_a_batch_of_two():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                                      max_position_embeddings=64, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(1, 128, (2, 5), generator=torch.Generator().manual_seed(1))
    kwargs = dict(max_new_tokens=4, do_sample=False, cache_implementation="static")
    compile_config = transformers.CompileConfig(backend="neuron", fullgraph=False, dynamic=False)
    compile_config._compile_all_devices = True
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = model.generate(ids, **kwargs)
        torch._dynamo.reset()
        neuron_compile.reset_stats()
        actual = model.generate(ids, compile_config=compile_config, **kwargs)
    assert torch.equal(actual, expected), (actual.tolist(), expected.tolist())
    assert neuron_compile.stats()["fallback_nodes"] == 0


@pytest.mark.parametrize("shape, loop, pattern", [((2, 3, 40, 8), "", "[[8, 240], [1, 8]]"),
                                                  ((1, 4, 256, 64), "", "[[64, 1024], [1, 64]]"),
                                                  ((3, 30000, 2), "for c0 in range(3)", "[[2, 30000], [1, 2]]")])
def test_the_copy_of_a_contiguous_cache_merges_its_rows(shape, loop, pattern):
    """out = self before the write: one DMA over the rows both layouts step over as one (the last dim, each row's
    run, as it is), each count within an access pattern's 16 bits (3 x 30000 rows: 3 DMAs of 30000)."""
    cache = random_tensor(shape, seed=14)
    new = random_tensor(shape[:1] + (1,) + shape[2:], seed=15)
    region = check_against_eager(lambda c, p, v: c.index_copy(1, p, v), cache, torch.tensor([shape[1] - 1]), new)
    prelude = scatter_source(region).split("for o0 in")[0]
    assert prelude.count("nisa.dma_copy(") == 1 and f"scatter_1.ap({pattern}, offset=" in prelude
    assert ("for c0" in prelude) == bool(loop) and loop in prelude


def test_the_copy_of_a_strided_cache_keeps_its_loops():
    cache = random_tensor((4, 2, 16, 8), seed=16).transpose(0, 1)  # heads outermost in memory, batch inside
    new = random_tensor((2, 4, 1, 8), seed=17)
    region = check_against_eager(cache_update, cache, torch.tensor([3]), new)
    assert "for c0 in range(2)" in scatter_source(region).split("for o0 in")[0]

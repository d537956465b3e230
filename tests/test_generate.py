"""Text generation through backend="neuron": ``model.generate`` with a static cache gives eager's tokens.

transformers compiles only the decode step (the prefill runs eagerly) and, on a device it does not know (CPU
here), only when ``compile_config._compile_all_devices`` is set. Each test counts the compiles (one for the decode
step, none per token), the ATen nodes left eager in the compiled step (none: the cache-position arithmetic on
the integer graph inputs is lowered under the input-range guard) and the kernels each step launches.

Models from tiny random configs, nothing downloaded. Mistral and Gemma3 use sliding-window cache layers, which
keep a Python int position (``StaticSlidingWindowLayer.cumulative_length_int``) that Dynamo specializes on with
``dynamic=False``: Dynamo recompiles their step per token (until its recompile limit, then runs it eagerly). That
is transformers' and Dynamo's doing, not this backend's dispatch, which never recompiles here.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import neuron_compile

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=64, pad_token_id=0)
SLIDING_WINDOW_CACHES = {"mistral", "gemma3_text"}


def _model(arch: str):
    config = transformers.AutoConfig.for_model(arch, **TINY)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def _generate(model, ids: torch.Tensor, new_tokens: int, compiled: bool) -> torch.Tensor:
    kwargs = dict(max_new_tokens=new_tokens, do_sample=False, cache_implementation="static")
    if compiled:
        compile_config = transformers.CompileConfig(backend="neuron", fullgraph=False, dynamic=False)
        compile_config._compile_all_devices = True  # transformers compiles the step on CPU tensors only with this
        kwargs["compile_config"] = compile_config
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(ids, **kwargs)


def _generate_both(arch: str, new_tokens: int):
    model = _model(arch)
    ids = torch.randint(1, TINY["vocab_size"], (1, 7), generator=torch.Generator().manual_seed(0))
    expected = _generate(model, ids, new_tokens, compiled=False)
    torch._dynamo.reset()
    neuron_compile.reset_stats()
    with neuron_compile.record_launches() as launches:
        actual = _generate(model, ids, new_tokens, compiled=True)
    return expected, actual, neuron_compile.stats(), launches


def _check(arch: str, new_tokens: int) -> None:
    expected, actual, stats, launches = _generate_both(arch, new_tokens)
    assert torch.equal(actual, expected), (actual.tolist(), expected.tolist())
    decode_steps = actual.shape[1] - 7 - 1  # the first new token comes from the eager prefill
    calls = stats["cache_hits"] + stats["cache_misses"]  # compiled decode steps (dispatch lookups)
    assert stats["fallback_nodes"] == 0, stats["fallback_reasons"]  # the whole compiled step in kernels
    assert stats["recompiles"] == 0 and stats["region_compile_failures"] == stats["region_run_failures"] == 0
    assert len(launches) == stats["kernels_launched"] and stats["kernels_launched"] % calls == 0  # same per step
    if arch not in SLIDING_WINDOW_CACHES:
        assert stats["graphs_compiled"] == 1 and stats["cache_misses"] == 1  # one compile: the decode step
        assert calls == decode_steps
    else:
        assert 1 <= calls <= decode_steps


def test_llama_generates_eagers_tokens_with_one_compile_and_no_eager_node():
    _check("llama", 4)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral", "gemma3_text", "phi3"])
def test_generate_32_tokens_equal_eager(arch):
    _check(arch, 32)

"""Shape bucketing (passes/bucket.py): padded calls equal eager's on the unpadded shapes, one compile per bucket,
and graphs where padding would change results are declined with a reason that explain shows."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import neuron_compile
from neuron_compile import explain
from neuron_compile.observation import observe

BUCKET = 16


class CausalBlock(torch.nn.Module):
    """Attention with a causal mask, a projection, a layer norm and a softmax over the features: every op keeps
    positions apart."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.qkv, self.out, self.norm = torch.nn.Linear(32, 96), torch.nn.Linear(32, 32), torch.nn.LayerNorm(32)

    def forward(self, x):
        batch, length, _ = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, 2, 16).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.norm(self.out(attended.transpose(1, 2).reshape(batch, length, 32))).softmax(-1)


@pytest.fixture(scope="module")
def causal_block():
    model = CausalBlock().eval()
    return model, torch.compile(model, backend="neuron", dynamic=True)


def run_bucketed(compiled, x):
    with torch.no_grad(), neuron_compile.config.patch(bucket=BUCKET, cache_dir="off"):
        return compiled(x)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(length=st.integers(1, 40))
def test_padded_results_equal_eager_on_the_unpadded_shape(causal_block, length):
    model, compiled = causal_block
    x = torch.randn(1, length, 32)
    result = run_bucketed(compiled, x)
    assert result.shape == (1, length, 32) and result.is_contiguous()
    torch.testing.assert_close(result, model(x))


def test_one_compile_per_bucket(causal_block):
    model, compiled = causal_block
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="neuron", dynamic=True)
    neuron_compile.reset_stats()
    lengths = (5, 7, 16, 17, 30, 32, 3)
    for length in lengths:
        x = torch.randn(1, length, 32)
        torch.testing.assert_close(run_bucketed(compiled, x), model(x))
    counts = neuron_compile.stats()
    assert (counts["cache_misses"], counts["cache_hits"]) == (2, len(lengths) - 2)  # buckets 16 and 32
    bucketing = neuron_compile.last_compiled().bucketing
    assert bucketing.startswith("pads s") and bucketing.endswith(f"to multiples of {BUCKET}"), bucketing


def sum_over_length(x):
    return x.sum(1) * 2


def uncausal_attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)


def interleaving_view(x):
    return x.view(4, -1).relu()


def last_column(x):
    return x[:, -1:] * 2  # the last real column, not the last padded one


@pytest.mark.parametrize(("function", "shapes", "reason"), [
    (sum_over_length, [(2, 7)], "aten.sum.dim_IntList reduces over the padded dim"),
    (uncausal_attention, [(1, 2, 7, 16)] * 3, "attends over the padded key positions without a causal mask"),
    (interleaving_view, [(7, 4)], "interleaves padded positions"),
    (last_column, [(2, 7)], "starts at a position counted from the end of the padded dim"),
])
def test_declined_with_a_reason_and_results_stay_eager_equal(function, shapes, reason):
    torch._dynamo.reset()
    compiled = torch.compile(function, backend="neuron", dynamic=True)
    inputs = [torch.randn(shape) for shape in shapes]
    with neuron_compile.config.patch(bucket=BUCKET, cache_dir="off"):
        torch.testing.assert_close(compiled(*inputs), function(*inputs))
    assert reason in neuron_compile.last_compiled().bucketing


def test_explain_shows_what_bucketing_declined():
    with observe() as observation, neuron_compile.config.patch(bucket=BUCKET, cache_dir="off"):
        torch.compile(sum_over_length, backend="neuron", dynamic=True)(torch.randn(2, 7))
    text = explain.explain_text(observation)
    assert "bucketing: " in text and "declined: " in text and "reduces over the padded dim" in text


def test_static_graphs_and_training_graphs_are_not_bucketed():
    torch._dynamo.reset()
    weight = torch.randn(4, requires_grad=True)
    compiled = torch.compile(lambda x: (x * weight).sum(), backend="neuron", dynamic=True)
    with neuron_compile.config.patch(bucket=BUCKET, cache_dir="off"):
        compiled(torch.randn(5, 4)).backward()
    assert neuron_compile.last_compiled().bucketing == ""

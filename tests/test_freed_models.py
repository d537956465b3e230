"""What the hit path keeps (runtime/kept.py) lives no longer than the model it serves: a freed model frees its weights,
as it does under eager or Inductor, also when the next model of the same class reuses the compiled graph (a loop
over checkpoints); and a weight's old memory stays held while a column-major copy made from it may be reused, so a
weight swapped in two steps cannot come back at its old address and be taken for the copied one. A graph started
warm from its record (runtime/warm_start.py, aot_autograd skipped) frees them too."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hit_path_models import MLP
from torch.multiprocessing.reductions import StorageWeakRef

from neuron_compile import config

CALLS = 5  # past the direct hit's memo (runtime/direct_hit.py): every kept thing is made by then


@pytest.fixture(autouse=True)
def settings():
    with config.patch(cache_dir="off", fallback="raise"), torch.no_grad():
        yield


class PartlyEager(torch.nn.Module):
    """A Linear and an op we do not lower: the graph runs through its region module, not the direct hit."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 24)

    def forward(self, x):
        return torch.special.zeta(self.linear(x).abs() + 2.0, torch.tensor(3.0))


def tiny_llama():
    transformers = pytest.importorskip("transformers")
    model_config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(model_config).eval()


MODELS = {
    "one region (direct hit)": (MLP, lambda: torch.randn(12, 16)),
    "an eager op (region module)": (PartlyEager, lambda: torch.randn(12, 16)),
    "tiny Llama (rotary buffer, value guards)": (tiny_llama, lambda: torch.randint(0, 96, (1, 10))),
}


def storages_of(model: torch.nn.Module) -> list[StorageWeakRef]:
    return [StorageWeakRef(tensor.untyped_storage()) for tensor in [*model.parameters(), *model.buffers()]]


def run(compiled, model, x) -> None:
    for _ in range(CALLS):
        expected, got = model(x), compiled(x)
        if hasattr(expected, "logits"):
            expected, got = expected.logits, got.logits
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", MODELS, ids=list(MODELS))
def test_models_compiled_one_after_another_free_their_weights(name):
    make_model, make_input = MODELS[name]
    torch.manual_seed(0)
    freed = []
    for _ in range(3):  # one compiled graph serves the later models: what it keeps must not hold the earlier ones
        model = make_model()
        compiled = torch.compile(model, backend="neuron")
        run(compiled, model, make_input())
        freed.append(storages_of(model))
        del model, compiled
        gc.collect()
        assert all(storage.expired() for storages in freed for storage in storages)


def test_a_weight_swapped_in_two_steps_is_not_taken_for_its_copy():
    torch.manual_seed(0)
    model, x = MLP().eval(), torch.randn(12, 16)
    compiled = torch.compile(model, backend="neuron")
    run(compiled, model, x)
    weight = model.up.weight  # read through a column-major copy (tests/hit_path_models.py)
    old_memory = StorageWeakRef(weight.untyped_storage())
    weight.data = torch.empty(0)
    gc.collect()
    # Held while the copy made from it may serve: no new tensor can come at its address with the weight's version.
    assert not old_memory.expired()
    weight.data = torch.randn(24, 16)
    run(compiled, model, x)
    gc.collect()
    assert old_memory.expired()  # and let go once the calls have remade the copy


# Three MLPs compiled in turn, in a process of its own over a given cache: which were freed, and the counters.
MODELS_IN_TURN = """
import gc, json, sys, torch
sys.path.insert(0, sys.argv[1])
from hit_path_models import MLP
from torch.multiprocessing.reductions import StorageWeakRef
import neuron_compile
freed = []
with torch.no_grad():
    for seed in range(3):
        torch.manual_seed(seed)
        model, x = MLP().eval(), torch.randn(12, 16)
        compiled = torch.compile(model, backend="neuron")
        for _ in range(5):
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
        freed.append([StorageWeakRef(p.untyped_storage()) for p in model.parameters()])
        del model, compiled
        gc.collect()
print(json.dumps({"freed": [all(s.expired() for s in f) for f in freed], "stats": neuron_compile.stats()}))
"""


def test_a_graph_started_warm_frees_the_models_it_served(tmp_path):
    tests = Path(__file__).parent
    env = {**os.environ, "NEURON_COMPILE_CACHE": str(tmp_path), "PYTHONPATH": str(tests.parent), "OMP_NUM_THREADS": "1"}
    runs = []
    for _ in ("fills the cache", "starts warm from it"):
        done = subprocess.run([sys.executable, "-c", MODELS_IN_TURN, str(tests)], env=env, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert runs[1]["stats"]["aot_autograd_skipped"] == 1  # the second process took the warm path
    assert [run["freed"] for run in runs] == [[True] * 3] * 2

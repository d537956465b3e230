"""The warm start without aot_autograd (runtime/warm_key.py, warm_record.py, warm_start.py).

In separate processes over one cache (tests/warm_start_child.py): a graph that is one NKI region runs from its record
in a new process with eager's answer and the first process's bits, and aot_autograd does not trace it (also one that
writes a cache input, as a decode step does); a call outside the record compiles the usual way; every refused case
(an output viewing an input or an intermediate, training, dynamic shapes, the switch off) gives eager's answer with
aot_autograd traced; a damaged or
edited record is a miss, never a crash or another answer; ``generate()`` with a static cache gives eager's tokens in
a second process. In this process: what changes the key, and the refusals no small graph reaches.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from neuron_compile.config import Config
from neuron_compile.runtime import disk_cache
from neuron_compile.runtime.warm_key import WARM_WHAT, Refusal, refusal_of_inputs, warm_key_parts
from neuron_compile.runtime.warm_candidate import aot_refusal

CHILD = Path(__file__).with_name("warm_start_child.py")
ROOT = Path(__file__).resolve().parent.parent
TOLERANCE = 1e-5
ACCEPTED = ("accepted", "constant_and_order", "cache_write", "cache_write_with_grad", "metadata_mutation")
FAST_ACCEPTED = ("accepted", "constant_and_order", "cache_write")  # the others run with the slow tests
REFUSED = ("alias_input", "alias_intermediate", "training", "dynamic")


def run_child(cache_dir: Path, case: str, **environment: str) -> dict:
    env = {**os.environ, "NEURON_COMPILE_CACHE": str(cache_dir), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           **environment}
    done = subprocess.run([sys.executable, str(CHILD), case], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cold(tmp_path_factory) -> tuple[Path, dict]:
    """A cache filled by one process that ran every case, and that process's results."""
    cache = tmp_path_factory.mktemp("warm_cache")
    return cache, run_child(cache, "all")


def records(cache: Path) -> list[Path]:
    """The warm-start records' entry files under ``cache``."""
    return [path for path in cache.rglob(f"*{disk_cache.ENTRY_SUFFIX}")
            if json.loads(path.read_text())["parts"]["what"] == WARM_WHAT]


def test_the_first_process_writes_records_for_the_accepted_graphs_only(cold):
    cache, results = cold
    written = {case: result["stats"]["warm_records_written"] for case, result in results.items()}
    assert written == {"bounds": 1, **{case: 1 for case in ACCEPTED}, **{case: 0 for case in REFUSED}}
    assert all(max(result["differences"]) <= TOLERANCE for result in results.values())
    assert all(result["aot_traces"] == 1 and result["stats"]["aot_autograd_skipped"] == 0
               for result in results.values())
    assert len(records(cache)) == len(ACCEPTED) + 1


@pytest.mark.parametrize("case", [pytest.param(case, marks=[] if case in FAST_ACCEPTED else pytest.mark.slow)
                                  for case in ACCEPTED])
def test_a_warm_process_skips_aot_autograd_with_the_same_answer(cold, case):
    """The same outputs, bit for bit, as the first process; eager's answer; the inputs written (a cache) equal to
    eager's, with the version counters the first process left (aot_autograd's wrapper bumps a cache it sees written
    under grad, and a warm start does too); the same stats; and none of the compiler imported, which the first
    process needed."""
    cache, results = cold
    warm = run_child(cache, case)[case]
    assert warm["aot_traces"] == 0 and warm["stats"]["aot_autograd_skipped"] == 1, warm
    assert warm["compiler_imported"] == [] and "neuron_compile.pipeline" in results[case]["compiler_imported"]
    assert warm["outputs"] == results[case]["outputs"] and warm["versions"] == results[case]["versions"]
    assert max(warm["differences"]) <= TOLERANCE
    same = ("graphs_compiled", "regions_compiled", "nki_nodes", "fallback_nodes", "kernels_launched", "cache_hits",
            "cache_misses", "weight_copies", "hbm_bytes", "flops")
    assert {name: warm["stats"][name] for name in same} == {name: results[case]["stats"][name] for name in same}
    assert warm["stats"]["disk_cache_hits"] == 1 and warm["stats"]["disk_cache_corrupt"] == 0


def test_a_region_that_fails_in_a_warm_process_runs_dynamos_graph_eagerly(cold):
    """The region's fallback in a warm start is Dynamo's graph run eagerly, its outputs put in the region's order
    (this case's region has a constant input and returns its outputs in another order than the graph)."""
    cache, _ = cold
    warm = run_child(cache, "constant_and_order", WARM_CHILD_FAIL_LAUNCH="1")["constant_and_order"]
    assert warm["stats"]["aot_autograd_skipped"] == 1 and warm["aot_traces"] == 0
    assert warm["stats"]["region_run_failures"] == 1 and warm["stats"]["kernels_launched"] == 0
    assert max(warm["differences"]) == 0.0  # eager's own answer


def test_a_call_outside_the_record_compiles_the_usual_way(cold):
    """The second call's integers leave the first call's bound: another dispatch key, which needs aot_autograd's
    graph; it is traced then, and the answer is eager's exactly."""
    cache, results = cold
    warm = run_child(cache, "bounds")["bounds"]
    assert warm["stats"]["aot_autograd_skipped"] == 1 and warm["aot_traces"] == 1
    assert max(warm["differences"]) == 0.0 and warm["outputs"] == results["bounds"]["outputs"]


@pytest.mark.parametrize("case", [pytest.param(case, marks=[] if case == "alias_intermediate" else pytest.mark.slow)
                                  for case in REFUSED])
def test_refused_graphs_trace_with_aot_autograd_and_give_eagers_answer(cold, case):
    cache, results = cold
    warm = run_child(cache, case)[case]
    assert warm["aot_traces"] == 1 and warm["stats"]["aot_autograd_skipped"] == 0
    assert warm["stats"]["warm_records_written"] == 0
    assert max(warm["differences"]) <= TOLERANCE and warm["outputs"] == results[case]["outputs"]


@pytest.mark.slow
def test_the_switch_turns_the_fast_path_off(cold):
    cache, _ = cold
    warm = run_child(cache, "accepted", NEURON_COMPILE_WARM_START="0")["accepted"]
    assert warm["aot_traces"] == 1 and warm["stats"]["aot_autograd_skipped"] == 0


def rewrite_payload(path: Path, change) -> None:
    """Edit a record's payload and give the entry a valid checksum again (as someone who can write into the folder
    can)."""
    entry = json.loads(path.read_text())
    change(entry["payload"])
    entry["checksum"] = hashlib.sha256(disk_cache.canonical_json(entry["payload"]).encode()).hexdigest()
    path.write_text(json.dumps(entry))


def delete_region_entry(path: Path) -> None:
    region_key = json.loads(path.read_text())["payload"]["region_key"]
    (path.parent.parent / region_key[:2] / f"{region_key}{disk_cache.ENTRY_SUFFIX}").unlink()


FAST_DAMAGES = ("garbage", "a missing region", "another signature", "outputs swapped")  # the others run with the slow tests
def is_accepted_record(payload: dict) -> bool:
    """The record of the ``accepted`` case: five arguments (x and four weights), the region's outputs in order."""
    return payload["inputs"] == 5 and payload["outputs"] == [0, 1] and all(isinstance(source, int)
                                                                           for source in payload["sources"])


DAMAGES = {
    "truncated": lambda path: path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2]),
    "garbage": lambda path: path.write_bytes(os.urandom(512)),
    "a field of another type": lambda path: rewrite_payload(path, lambda payload: payload.update(inputs="4")),
    "a position out of range": lambda path: rewrite_payload(path, lambda payload: payload.update(column_major=[99])),
    "an unknown field": lambda path: rewrite_payload(path, lambda payload: payload.update(extra=1)),
    "a missing region": lambda path: rewrite_payload(path, lambda payload: payload.update(region_key="0" * 40)),
    "the region entry deleted": delete_region_entry,
    "another signature": lambda path: rewrite_payload(path, lambda payload: payload.update(signature="()")),
    "outputs swapped": lambda path: rewrite_payload(path, lambda payload: payload.update(outputs=[1, 0])),
    "a constant added": lambda path: rewrite_payload(path, lambda payload: payload["sources"].append(
        {"dtype": "float32", "shape": [1], "values": [2.0]})),
}


@pytest.mark.parametrize("damage", [pytest.param(damage, marks=[] if damage in FAST_DAMAGES else pytest.mark.slow)
                                    for damage in DAMAGES])
def test_a_damaged_or_edited_record_is_a_miss(cold, tmp_path, damage):
    cache, results = cold
    copy = tmp_path / "cache"
    shutil.copytree(cache, copy)
    (record,) = [path for path in records(copy) if is_accepted_record(json.loads(path.read_text())["payload"])]
    DAMAGES[damage](record)
    warm = run_child(copy, "accepted")["accepted"]
    assert warm["aot_traces"] == 1  # traced: the record was not used, or its first call did not fit it
    assert warm["outputs"] == results["accepted"]["outputs"] and max(warm["differences"]) <= TOLERANCE


@pytest.mark.slow
def test_generate_with_a_static_cache_gives_eagers_tokens_in_a_second_process(tmp_path):
    """The decode step writes the static cache in place (``index_copy_``), a write aot_autograd keeps in its graph:
    the second process runs the step from its record, and both give eager's tokens."""
    first = run_child(tmp_path, "generate")["generate"]
    second = run_child(tmp_path, "generate")["generate"]
    assert first["equal"] and second["equal"] and first["tokens"] == second["tokens"]
    assert first["stats"]["warm_records_written"] == 1 and first["stats"]["aot_autograd_skipped"] == 0
    assert second["stats"]["aot_autograd_skipped"] == 1 and second["aot_traces"] == 0, second


# ---------------------------------------------------------------- the key, in this process


def dynamo_graph(function, *args, grad: bool = False):
    """Dynamo's graph of ``function`` on ``args`` and its example inputs, captured by a pass-through backend."""
    captured = []

    def capture(gm, example_inputs):
        captured.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    with torch.set_grad_enabled(grad):
        torch.compile(function, backend=capture)(*args)
    return captured[0]


def key_of(function, *args, grad: bool = False, config: Config | None = None) -> str:
    gm, example_inputs = dynamo_graph(function, *args, grad=grad)
    with torch.set_grad_enabled(grad):
        parts = warm_key_parts(gm, example_inputs, config or Config(cache_dir="cache"))
    assert not isinstance(parts, Refusal), parts
    return disk_cache.key_of(parts)


def scaled(x):
    return torch.softmax(x * 2.0, dim=-1)


def test_the_key_changes_with_what_aot_autograd_reads():
    x = torch.randn(8, 16)
    base = key_of(scaled, x)
    assert key_of(scaled, torch.randn(8, 16)) == base  # values of inputs are not in the key
    assert key_of(lambda x: torch.softmax(x * 3.0, dim=-1), x) != base  # another model
    assert key_of(lambda x: torch.softmax(x * 2.0, dim=0), x) != base
    assert key_of(scaled, x.to(torch.bfloat16)) != base  # dtype
    assert key_of(scaled, x.t().contiguous().t()) != base  # strides
    assert key_of(scaled, torch.randn(9, 16)[1:]) != base  # storage offset
    assert key_of(scaled, x.clone().requires_grad_()) != base  # requires_grad (grad off: still inference)
    assert key_of(scaled, x, grad=True) != base  # grad mode
    assert key_of(scaled, x, config=Config(cache_dir="cache", fusion=False)) != base  # a config that changes kernels
    assert key_of(scaled, x, config=Config(cache_dir="cache", fallback="raise")) == base  # one that does not


def test_the_key_holds_constants_by_value():
    x = torch.randn(4)
    one = key_of(lambda x: x + torch.tensor([1.0, 2.0, 3.0, 4.0]), x)
    other = key_of(lambda x: x + torch.tensor([1.0, 2.0, 3.0, 4.5]), x)
    assert one != other


class Marked(torch.Tensor):
    """A tensor subclass (aot_autograd flattens subclasses into their inner tensors)."""


def test_what_the_key_refuses():
    x = torch.randn(8, 16)
    gm, example_inputs = dynamo_graph(scaled, x)
    assert "off" in str(warm_key_parts(gm, example_inputs, Config(cache_dir="off")))
    assert "WARM_START" in str(warm_key_parts(gm, example_inputs, Config(cache_dir="cache", warm_start=False)))
    assert "dump" in str(warm_key_parts(gm, example_inputs, Config(cache_dir="cache", dump_dir="dump")))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert "autocast" in str(warm_key_parts(gm, example_inputs, Config(cache_dir="cache")))
    with torch.enable_grad():
        trained = [example_inputs[0].clone().requires_grad_()]
        assert "training" in str(warm_key_parts(gm, trained, Config(cache_dir="cache")))
    (value,) = example_inputs
    assert "two positions" in str(refusal_of_inputs([value, value]))
    assert "not a plain tensor" in str(refusal_of_inputs([torch.ones(2).as_subclass(Marked)]))
    assert "not a plain tensor" in str(refusal_of_inputs([3]))


def input_facts(mutates_data=False, mutates_metadata=False, mutation_type=None):
    from torch._functorch._aot_autograd.schemas import MutationType

    return types.SimpleNamespace(mutates_data=mutates_data, mutates_metadata=mutates_metadata,
                                 mutates_storage_metadata=False, mutation_inductor_storage_resize=False,
                                 mutation_type=mutation_type or MutationType.NOT_MUTATED)


def aot_facts(**changes):
    """A stand-in for aot_autograd's ``ViewAndMutationMeta`` of an inference graph with one input and one output,
    nothing mutated or aliased, with ``changes``."""
    from torch._functorch._aot_autograd.schemas import OutputType, PlainTensorMeta

    facts = dict(
        input_info=[input_facts()], output_info=[types.SimpleNamespace(output_type=OutputType.non_alias)],
        num_intermediate_bases=0, tokens={}, num_graphsafe_rng_states=0, num_mutated_inp_runtime_indices=0,
        subclass_inp_meta=[PlainTensorMeta(0)], subclass_fw_graph_out_meta=[PlainTensorMeta(0)])
    return types.SimpleNamespace(**{**facts, **changes})


def test_what_aot_autograds_facts_refuse():
    from torch._functorch._aot_autograd.schemas import MutationType, OutputType

    aten = torch.fx.symbolic_trace(lambda x: x * 2)
    assert aot_refusal(aot_facts(), aten, 1) is None
    kept_write = input_facts(mutates_data=True, mutation_type=MutationType.MUTATED_IN_GRAPH)
    assert aot_refusal(aot_facts(input_info=[kept_write]), aten, 1) is None  # a cache written in aot's graph
    assert "outside" in aot_refusal(aot_facts(input_info=[input_facts(
        mutates_data=True, mutation_type=MutationType.MUTATED_OUT_GRAPH)]), aten, 1)
    assert "metadata" in aot_refusal(aot_facts(input_info=[input_facts(
        mutates_metadata=True, mutation_type=MutationType.MUTATED_OUT_GRAPH)]), aten, 1)
    assert "applies" in aot_refusal(aot_facts(input_info=[kept_write], num_mutated_inp_runtime_indices=1), aten, 1)
    assert "aliases" in aot_refusal(aot_facts(output_info=[types.SimpleNamespace(
        output_type=OutputType.alias_of_intermediate)]), aten, 1)
    assert "aliases" in aot_refusal(aot_facts(num_intermediate_bases=1), aten, 1)
    assert "tokens" in aot_refusal(aot_facts(tokens={"token": torch.ones(0)}), aten, 1)
    assert "subclass" in aot_refusal(aot_facts(subclass_inp_meta=[object()]), aten, 1)
    assert "inputs" in aot_refusal(aot_facts(), aten, 2)  # aot_autograd lifted or deduplicated an input
    assert "not available" in aot_refusal(None, aten, 1)

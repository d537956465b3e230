"""Distributed graphs: torch.distributed functional collectives as collective kernels (nki.collectives) run by
the simulator across gloo processes; tensor parallel and FSDP2 runs of a tiny Llama compiled with
backend="neuron" against single-process eager; the communication cost model; the simulator's collective rules."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import distributed_harness  # noqa: E402

from neuron_compile.runtime import simulator as nki  # noqa: E402
from neuron_compile.runtime.simulator import comm_cost  # noqa: E402
from neuron_compile.runtime.simulator import collectives as ncc  # noqa: E402

needs_gloo = pytest.mark.skipif(not distributed_harness.gloo_available(), reason="torch.distributed gloo unavailable")
WORLD = 2


@needs_gloo
def test_collective_graphs_on_two_ranks_run_collective_kernels():
    results = distributed_harness.run_ranks(distributed_harness.smoke, WORLD)
    eagers = [result["all_reduce"]["eager"] for result in results]
    # the reduction is real: both ranks hold the sum of both ranks' inputs, which differ
    torch.testing.assert_close(eagers[0], eagers[1], rtol=0, atol=0)
    for result in results:
        single = result["all_reduce"]
        torch.testing.assert_close(single["compiled"], single["eager"], rtol=0, atol=0)
        stats = single["stats"]
        assert stats["fallback_nodes"] == 0, stats["fallback_reasons"]
        assert stats["collectives"] == 1
        assert stats["collective_bytes"] == 8 * 32 * 4
        assert stats["est_comm_s"] == pytest.approx(comm_cost.collective_time_s("all_reduce", WORLD, 1024, 1024))
        text = "\n".join(single["sources"])
        assert "import nki.collectives as ncc" in text
        assert "ncc.all_reduce(" in text and "replica_group=ncc.ReplicaGroup([[0, 1]])" in text
        # relu(all_reduce(x * 2) + 1): every kernel reads the reduction or feeds it, so nothing hides it
        assert stats["est_comm_overlap_s"] == 0.0
        _check_every_collective(result["every"])
        _check_overlap(result["overlap"])
        _check_tensor_parallel_and_fsdp(result)
        _check_in_graph_fsdp(result["in_graph_fsdp"])
        _check_one_rank_group(result["one_rank"])
        # the cache key names the group's ranks: the graph's group name alone is the same for any world size
        assert result["groups"] == [f"{result['group_name']}: {list(range(WORLD))}"]


def _check_one_rank_group(result: dict) -> None:
    """A group of one rank (a mesh dim of size 1): every collective is the identity, lowered as a pointwise copy."""
    for compiled, eager in zip(result["compiled"], result["eager"], strict=True):
        torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    stats = result["stats"]
    assert stats["fallback_nodes"] == 0, stats["fallback_reasons"]
    assert stats["collectives"] == 0 and stats["est_comm_s"] == 0


def _check_tensor_parallel_and_fsdp(result: dict) -> None:
    """The transformers-free TP forward and FSDP2 step (the slow tests run them on a Llama)."""
    tensor_parallel = result["tensor_parallel"]
    torch.testing.assert_close(tensor_parallel["compiled"], tensor_parallel["expected"], rtol=1e-5, atol=1e-6)
    stats = tensor_parallel["stats"]
    assert stats["fallback_nodes"] == 0, stats["fallback_reasons"]
    assert stats["collectives"] == 1  # the row-parallel down projection's all_reduce, as a collective kernel
    fsdp = result["fsdp"]
    assert fsdp["stats"]["fallback_nodes"] == 0 and fsdp["stats"]["nki_nodes"] > 0, fsdp["stats"]
    for key, expected in fsdp["gradients"]["single"].items():
        error = (fsdp["gradients"]["fsdp"][key] - expected).abs().max() / expected.abs().max()
        assert error < 2e-6, (key, float(error))  # fp32 rounding of sums in another order


def _check_in_graph_fsdp(runs: dict) -> None:
    """Two AdamW steps of two MLP blocks sharded by fully_shard_in_graph and compiled whole: single-process losses
    and parameters, every parameter's all-gather and gradient reduce-scatter a collective kernel, and with
    reshard_after_forward the backward gathering again the three weights it reads (not the first block's up
    projection, whose input needs no gradient, nor any bias)."""
    parameters_per_step = 8
    for reshard, regathered in ((False, 0), (True, 3)):
        result = runs[reshard]
        np.testing.assert_allclose(result["losses"]["sharded"], result["losses"]["single"], rtol=1e-5)
        sharded, single = result["parameters"]["sharded"], result["parameters"]["single"]
        assert sorted(sharded) == sorted(single)  # the unsharded names: a checkpoint loads into the plain model
        for key, expected in single.items():
            torch.testing.assert_close(sharded[key], expected, rtol=0, atol=1e-5)
        stats = result["stats"]
        assert stats["fallback_nodes"] == 0, stats["fallback_reasons"]
        assert stats["collectives"] == 2 * (2 * parameters_per_step + regathered)
        assert 0 < stats["est_comm_overlap_s"] <= stats["est_comm_s"]


def _check_overlap(result: dict) -> None:
    """An all_reduce beside a matmul that does not read it: the schedule runs the matmul while the collective is on
    the links, and the launch's estimate holds only the communication nothing hid."""
    for compiled, eager in zip(result["compiled"], result["eager"], strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-4)
    stats = result["stats"]
    assert stats["fallback_nodes"] == 0, stats["fallback_reasons"]
    assert stats["est_comm_s"] == pytest.approx(comm_cost.collective_time_s("all_reduce", WORLD, 128 * 512 * 4,
                                                                            128 * 512 * 4))
    assert 0 < stats["est_comm_overlap_s"] < stats["est_comm_s"]
    (report,) = [report for report in result["reports"] if report is not None and report.collectives]
    assert report.comm_exposed_s == pytest.approx(report.est_comm_s - report.comm_overlap_s)
    assert report.device_time_s >= report.busy_s_per_engine["collective"]  # the collective's time is in the schedule


def _check_every_collective(result: dict) -> None:
    """all_reduce (sum, avg, max), all_gather, reduce_scatter of a staged non-contiguous view and all_to_all in one
    graph: eager's values exactly (each rank sums the same two numbers in the same order), every node in kernels."""
    for compiled, eager in zip(result["compiled"], result["eager"], strict=True):
        torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    stats = result["stats"]
    assert stats["fallback_nodes"] == 0, stats["fallback_reasons"]
    assert stats["collectives"] == 6
    rows, columns, item = 4 * WORLD, 6, result["eager"][0].element_size()
    # inputs: x-sized for the all_reduces, the all_gather and the all_to_all; the gathered tensor for reduce_scatter
    assert stats["collective_bytes"] == (5 + WORLD) * rows * columns * item


@needs_gloo
@pytest.mark.slow
def test_uneven_all_to_all_runs_eagerly_with_its_reason_and_a_collective_rule_names_the_sizes():
    results = distributed_harness.run_ranks(distributed_harness.uneven_all_to_all_graph, WORLD)
    for result in results:
        torch.testing.assert_close(result["compiled"], result["eager"], rtol=0, atol=0)
        reasons = result["stats"]["fallback_reasons"]
        assert any("uneven splits" in reason for reason in reasons), reasons
        # the wait stays eager with its collective: a kernel reading the result without it read unfinished data
        assert any("wait_tensor" in reason and "runs eagerly" in reason for reason in reasons), reasons
        assert result["stats"]["collectives"] == 0
    errors = distributed_harness.run_ranks(distributed_harness.mismatched_all_gather, WORLD)
    assert all("err_collective_shape" in error and "16" in error for error in errors), errors


@needs_gloo
@pytest.mark.slow
def test_every_collective_in_bfloat16_matches_eager():
    for result in distributed_harness.run_ranks(distributed_harness.every_collective_graph, WORLD, torch.bfloat16):
        _check_every_collective(result)


@needs_gloo
@pytest.mark.slow
def test_tensor_parallel_llama_logits_match_single_process_eager():
    results = distributed_harness.run_ranks(distributed_harness.tensor_parallel_llama, WORLD)
    for result in results:
        # fp32 sums in another order (kernels, and the row-parallel partial sums added across ranks)
        torch.testing.assert_close(result["logits"], result["expected"], rtol=1e-5, atol=1e-5)
        stats = result["stats"]
        assert stats["fallback_nodes"] == 0, stats["fallback_reasons"]
        # a row-parallel o_proj and down_proj per layer each end in an all_reduce of the [2, 12, 64] output
        layers = distributed_harness.TINY_LLAMA["num_hidden_layers"]
        assert stats["collectives"] == 2 * layers
        assert stats["collective_bytes"] == 2 * layers * 2 * 12 * 64 * 4
        assert stats["est_comm_s"] > 0


@needs_gloo
@pytest.mark.slow
def test_sequence_parallel_llama_logits_match_single_process_eager():
    """Sequence parallel between the blocks: all-gathers before attention and the MLP, reduce-scatters after
    them, all collective kernels; the one eager node is the sharded embedding's int64 index_put (it zeroes the
    token ids other ranks hold), so the non-collective ATen nodes are >= 99% in NKI."""
    results = distributed_harness.run_ranks(distributed_harness.tensor_parallel_llama, WORLD, True)
    for result in results:
        torch.testing.assert_close(result["logits"], result["expected"], rtol=1e-5, atol=1e-5)
        stats = result["stats"]
        assert set(stats["fallback_reasons"]) <= {"aten.index_put.default: aten.index_put.default: self dtype "
                                                  "(only float32, bfloat16)"}, stats["fallback_reasons"]
        assert stats["fallback_nodes"] <= 1
        layers = distributed_harness.TINY_LLAMA["num_hidden_layers"]
        assert stats["collectives"] >= 4 * layers  # a gather and a scatter around attention and the MLP
        assert stats["nki_nodes"] >= 0.99 * (stats["nki_nodes"] + stats["fallback_nodes"])


@needs_gloo
@pytest.mark.slow
def test_tensor_parallel_llama_backward_matches_single_process_eager():
    results = distributed_harness.run_ranks(distributed_harness.tensor_parallel_llama_gradients, WORLD)
    for result in results:
        assert result["loss"] == pytest.approx(result["expected"], rel=1e-6)
        for name, expected in result["expected_gradients"].items():
            error = (result["gradients"][name] - expected).abs().max() / expected.abs().max()
            assert error < 2e-6, (name, float(error))  # fp32 rounding of sums in another order
        stats = result["stats"]
        assert stats["fallback_nodes"] == 0, stats["fallback_reasons"]
        # forward: 2 per layer (row-parallel outputs); backward: the gradients of the column-parallel inputs
        assert stats["collectives"] > 2 * distributed_harness.TINY_LLAMA["num_hidden_layers"]


@needs_gloo
@pytest.mark.slow
def test_fsdp2_training_with_compiled_layers_matches_eager():
    results = distributed_harness.run_ranks(distributed_harness.fsdp_llama_training, WORLD, 10)
    for result in results:
        losses = result["losses"]
        assert len(losses["neuron"]) == 10
        np.testing.assert_allclose(losses["neuron"][:3], losses["single"][:3], rtol=1e-6)
        np.testing.assert_allclose(losses["neuron"], losses["single"], rtol=1e-4)  # see the DDP test
        assert result["stats"]["fallback_nodes"] == 0, result["stats"]["fallback_reasons"]
        assert result["stats"]["kernels_launched"] > 0
        gradients = result["first_gradients"]
        for name, expected in gradients["single"].items():
            error = (gradients["neuron"][name] - expected).abs().max() / expected.abs().max()
            assert error < 2e-6, (name, float(error))  # fp32 rounding of sums in another order
        # AdamW's first steps divide each gradient by its own magnitude, so the rounding noise of gradients near
        # zero moves parameters by up to ~1e-5 (eager FSDP2 itself differs from one process by as much)
        parameters = result["parameters"]
        for name, expected in parameters["single"].items():
            torch.testing.assert_close(parameters["neuron"][name], expected, rtol=0, atol=1e-4)


@needs_gloo
@pytest.mark.slow
def test_in_graph_fsdp_training_matches_single_process_with_collectives_in_kernels():
    """fully_shard_in_graph on the tiny Llama with tied embeddings, compiled whole: 10 AdamW steps follow one
    process training on the whole batch, every all-gather and reduce-scatter a collective kernel, no eager node."""
    results = distributed_harness.run_ranks(distributed_harness.in_graph_fsdp_llama_training, WORLD)
    for result in results:
        losses = result["losses"]
        assert len(losses["neuron"]) == 10
        np.testing.assert_allclose(losses["neuron"][:3], losses["single"][:3], rtol=1e-6)
        np.testing.assert_allclose(losses["neuron"], losses["single"], rtol=1e-4)  # the trainer tests' fp32 bound
        stats = result["stats"]
        assert stats["fallback_nodes"] == 0, stats["fallback_reasons"]
        parameters = len(result["first_gradients"]["single"])  # the tied embedding counts once
        assert stats["collectives"] >= 10 * 2 * parameters  # a gather and a reduce-scatter per parameter and step
        gradients = result["first_gradients"]
        assert sorted(gradients["neuron"]) == sorted(gradients["single"])
        for name, expected in gradients["single"].items():
            error = (gradients["neuron"][name] - expected).abs().max() / expected.abs().max()
            assert error < 2e-6, (name, float(error))  # fp32 rounding of sums in another order
        sharded, single = result["parameters"]["neuron"], result["parameters"]["single"]
        assert sorted(sharded) == sorted(single)
        assert torch.equal(sharded["lm_head.weight"], sharded["model.embed_tokens.weight"])  # still tied


@needs_gloo
@pytest.mark.slow
def test_ddp_training_compiled_whole_matches_single_process():
    """DDP compiled as a whole: Dynamo's DDP optimizer splits the graph at the gradient buckets, every piece is
    ours, and 10 AdamW steps follow one process training on the whole batch."""
    results = distributed_harness.run_ranks(distributed_harness.ddp_llama_training, WORLD)
    for result in results:
        losses = result["losses"]
        assert len(losses["neuron"]) == 10
        # the first steps agree to fp32 rounding; AdamW at lr 1e-2 then amplifies the kernels' other summation
        # order (1.3e-5 relative by step 10 here), the trainer tests' fp32 bound is 1e-4
        np.testing.assert_allclose(losses["neuron"][:3], losses["single"][:3], rtol=1e-6)
        np.testing.assert_allclose(losses["neuron"], losses["eager"], rtol=1e-4)
        np.testing.assert_allclose(losses["neuron"], losses["single"], rtol=1e-4)
        assert result["stats"]["fallback_nodes"] == 0, result["stats"]["fallback_reasons"]
        assert result["graphs"] > 2  # forward and backward of more than one bucket's piece
        gradients = result["first_gradients"]
        for name, expected in gradients["single"].items():
            error = (gradients["neuron"][name] - expected).abs().max() / expected.abs().max()
            assert error < 2e-6, (name, float(error))  # fp32 rounding of sums in another order


@needs_gloo
@pytest.mark.slow
def test_ddp_gradient_all_reduces_run_as_collective_kernels_under_compiled_autograd():
    """With compiled autograd and Dynamo's python reducer, DDP's gradient all-reduces are functional collectives in
    the compiled backward: they run as collective kernels, beside the backward's other kernels."""
    results = distributed_harness.run_ranks(distributed_harness.ddp_compiled_autograd_training, WORLD)
    parameters = len(results[0]["first_gradients"]["single"])
    for result in results:
        losses = result["losses"]
        np.testing.assert_allclose(losses["neuron"], losses["single"], rtol=1e-5)
        stats = result["stats"]
        assert stats["fallback_nodes"] == 0, stats["fallback_reasons"]
        assert stats["collectives"] == 3 * parameters  # one all_reduce per gradient per step, all in kernels
        assert 0 < stats["est_comm_overlap_s"] <= stats["est_comm_s"]
        gradients = result["first_gradients"]
        for name, expected in gradients["single"].items():
            error = (gradients["neuron"][name] - expected).abs().max() / expected.abs().max()
            assert error < 2e-6, (name, float(error))


def test_ring_model_follows_its_formula():
    megabyte = 1 << 20
    latency, bandwidth = comm_cost.STEP_LATENCY_S, comm_cost.LINK_BYTES_PER_S
    assert comm_cost.collective_time_s("all_reduce", 1, megabyte, megabyte) == 0.0
    assert comm_cost.collective_time_s("all_reduce", 4, megabyte, megabyte) == pytest.approx(
        2 * 3 / 4 * megabyte / bandwidth + 6 * latency)
    assert comm_cost.collective_time_s("all_gather", 4, megabyte, 4 * megabyte) == pytest.approx(
        3 / 4 * 4 * megabyte / bandwidth + 3 * latency)
    assert comm_cost.collective_time_s("reduce_scatter", 2, megabyte, megabyte // 2) == pytest.approx(
        1 / 2 * megabyte / bandwidth + latency)
    with pytest.raises(ValueError, match="comm_unknown_collective"):
        comm_cost.collective_time_s("broadcast", 2, 1, 1)


def _record(name: str, engine: str, reads: tuple, writes: tuple, **attrs):
    from neuron_compile.runtime.simulator.trace import InstructionRecord, OperandInfo

    operand = OperandInfo("dst", "sbuf", (128, 512), "float32", 4, 128, 512, 4)
    return InstructionRecord(name, engine, operand, (operand,), attrs=attrs, reads=reads, writes=writes)


def test_collective_runs_beside_independent_compute_and_delays_only_its_readers():
    from neuron_compile.runtime.simulator import cost
    from neuron_compile.runtime.simulator.trace import Region

    def tile(memory):
        return Region(memory, (0, 128), (0, 2048))

    collective = _record("collective_all_reduce", "collective", (tile(1),), (tile(2),), collective="all_reduce",
                         ranks=4, input_bytes=1 << 20, output_bytes=1 << 20)
    independent = [_record("activation", "scalar", (tile(3),), (tile(3),)) for _ in range(4)]
    reader = _record("tensor_tensor", "vector", (tile(2), tile(3)), (tile(4),))
    report = cost.cost_report([collective, *independent, reader])
    comm_s = comm_cost.collective_time_s("all_reduce", 4, 1 << 20, 1 << 20)
    compute_s = report.busy_s_per_engine["scalar"]
    assert report.est_comm_s == pytest.approx(comm_s)
    assert 0 < compute_s < comm_s
    assert report.comm_overlap_s == pytest.approx(compute_s)  # all of the independent work hides under it
    assert report.device_time_s > comm_s  # its reader waited for it
    assert "communication" in report.format() and "overlapped compute" in report.format()
    # without the reader the launch ends with the collective: the same compute hides under it
    alone = cost.cost_report([collective, *independent])
    assert alone.comm_overlap_s == pytest.approx(compute_s)


def _all_reduce_kernel(x):
    out = nki.language.ndarray(x.shape, dtype=x.dtype, buffer=nki.language.shared_hbm)
    ncc.all_reduce(srcs=[x], dsts=[out], replica_group=ncc.ReplicaGroup([[0, 1]]), op=nki.language.add)
    return out


def test_collective_without_a_process_group_is_a_named_error():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        pytest.skip("this process is part of a torch.distributed job")
    with pytest.raises(nki.NkiValidationError, match="err_collective_no_process_group"):
        nki.run_kernel(_all_reduce_kernel, [np.ones(8, np.float32)])


def test_collective_rejects_an_operator_nki_does_not_reduce_with():
    def kernel(x):
        out = nki.language.ndarray(x.shape, dtype=x.dtype, buffer=nki.language.shared_hbm)
        ncc.all_reduce(srcs=[x], dsts=[out], replica_group=ncc.ReplicaGroup([[0, 1]]), op=nki.language.multiply)
        return out

    with pytest.raises(nki.NkiValidationError, match="err_collective_op"):
        nki.run_kernel(kernel, [np.ones(8, np.float32)])


@pytest.fixture
def one_rank_group(tmp_path):
    """torch.distributed over this process alone (gloo, a FileStore), torn down after the test."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@needs_gloo
def test_fully_shard_in_graph_refuses_a_2d_mesh_and_parameters_already_sharded(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from neuron_compile.in_graph_fsdp import fully_shard_in_graph

    with pytest.raises(ValueError, match="1-D mesh, got a 2-D one"):
        fully_shard_in_graph(distributed_harness.TwoLayerMLP(), init_device_mesh("cpu", (1, 1)))
    model = distributed_harness.TwoLayerMLP()
    mesh = init_device_mesh("cpu", (1,))
    model.up.weight = torch.nn.Parameter(distribute_tensor(model.up.weight.detach(), mesh, [Shard(0)]))
    with pytest.raises(ValueError, match="'weight' of Linear is already a DTensor"):
        fully_shard_in_graph(model, mesh)
    twice = fully_shard_in_graph(distributed_harness.TwoLayerMLP(), mesh)
    with pytest.raises(ValueError, match="already a DTensor"):  # its shards are DTensors: sharding again is refused
        fully_shard_in_graph(twice, mesh)


class Block(torch.nn.Module):
    """A layer Dynamo traces (an nn.Linear alone is torch's own module, left to eager by Dynamo)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.linear(x))


@needs_gloo
def test_a_whole_fully_shard_model_warns_that_nothing_compiles_and_compiled_layers_do_not(one_rank_group):
    import warnings

    from torch.distributed.fsdp import fully_shard

    import neuron_compile

    torch._dynamo.reset()  # clears Dynamo's callbacks: the backend installs its check again when it registers
    neuron_compile.backend.register()
    neuron_compile.reset_stats()
    whole = torch.nn.Sequential(Block(), Block())
    fully_shard(whole)
    with pytest.warns(neuron_compile.NeuronCompileWarning, match="graph at FSDP2's hooks .*fsdp.*fully_shard_in_graph"):
        torch.compile(whole, backend="neuron")(torch.randn(2, 8)).sum().backward()

    torch._dynamo.reset()
    layered = torch.nn.Sequential(Block(), Block())
    for layer in layered:
        fully_shard(layer)
        layer.compile(backend="neuron")
    fully_shard(layered)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layered(torch.randn(2, 8)).sum().backward()
    assert not [w for w in caught if "FSDP2's hooks" in str(w.message)]
    assert neuron_compile.stats()["graphs_compiled"] > 0


def test_graph_breaks_after_dynamo_reset_are_all_checked_even_when_more_than_before():
    """The FSDP2 check's bookkeeping (untraced_fsdp.unchecked): a list that ``torch._dynamo.reset()`` emptied and
    Dynamo refilled past the old count before the next look is read from its start, not from the old count."""
    from neuron_compile.untraced_fsdp import unchecked

    reasons = [object() for _ in range(3)]
    assert unchecked(reasons) == reasons
    reasons.append(later := object())
    assert unchecked(reasons) == [later]
    assert unchecked(reasons) == []
    reasons[:] = [object() for _ in range(6)]  # a reset, then six breaks
    assert unchecked(reasons) == reasons

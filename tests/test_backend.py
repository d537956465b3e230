"""The backend end to end: registration, options, fallback modes, graph breaks, dynamic shapes, mutations,
training graphs. Results are compared with eager PyTorch.

Two ways to place ops: ``all_eager`` rejects every op (results must then be bit-identical to eager), and
``fake_regions`` accepts common pointwise / matmul ops and compiles each region into a stand-in CompiledRegion
that runs the region's ATen graph eagerly — it exercises the region wiring (inputs, tuple outputs, stats,
records) without depending on the kernel pipeline, and is also bit-identical to eager.
"""

import importlib.util
import operator
import subprocess
import sys
import textwrap
import types
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from random_programs import programs, run_program
from torch import nn

import neuron_compile
from neuron_compile import pipeline
from neuron_compile.passes import partition
from neuron_compile.runtime import compiled_graph, graph_records, region_module

aten = torch.ops.aten
FAKE_SUPPORTED = {
    aten.add,
    aten.mul,
    aten.relu,
    aten.mm,
    aten.addmm,
    aten.t,
    aten.cos,
    aten.sum,
    aten.threshold_backward,
    aten.exp,
}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    neuron_compile.reset_stats()
    graph_records.clear_records()
    yield
    torch._dynamo.reset()


def _fake_unsupported_reason(node):
    packet = getattr(node.target, "overloadpacket", None)
    return None if packet in FAKE_SUPPORTED else f"no fake lowering for {node.target}"


class EagerRegion:
    """Stands in for pipeline's CompiledRegion: runs the region's ATen graph eagerly."""

    def __init__(self, gm, example_inputs):
        self.gm = gm
        self.nki_nodes = sum(
            node.op == "call_function" and node.target is not operator.getitem for node in gm.graph.nodes
        )
        self.kernels = [types.SimpleNamespace(name="kernel_0", source=f"# {len(example_inputs)} inputs\n{gm.code}")]
        self.fusion_decisions = ["fused mul into add: matching index"]

    def __call__(self, *tensors):
        return tuple(self.gm(*tensors))


@pytest.fixture
def all_eager(monkeypatch):
    monkeypatch.setattr(partition, "registry_unsupported_reason", lambda target=None: lambda node: "test: everything eager")


@pytest.fixture
def fake_regions(monkeypatch):
    """Yields the list of example-input shapes each compile_region call received."""
    seen_shapes = []

    def compile_region(gm, example_inputs, config, on_pass=None):
        seen_shapes.append([tuple(tensor.shape) for tensor in example_inputs])
        return EagerRegion(gm, example_inputs)

    monkeypatch.setattr(partition, "registry_unsupported_reason", lambda target=None: _fake_unsupported_reason)
    monkeypatch.setattr(compiled_graph, "compile_region", compile_region)
    return seen_shapes


def failing_compile(gm, example_inputs, config):
    raise RuntimeError("tile plan exceeds PSUM bank (2048 bytes)")


def pointwise(x, y):
    return torch.relu(x * y + x).sin()


def test_entry_point_serves_neuron_without_importing_us():
    script = textwrap.dedent("""
        import sys, torch
        assert "neuron_compile" not in sys.modules
        fn = torch.compile(lambda x: torch.sin(x) + 1, backend="neuron")  # loads us through the entry point
        x = torch.randn(8)
        # Default fp32 tolerance: with lowerings, sin runs on the simulator and may differ from ATen by an ulp.
        torch.testing.assert_close(fn(x), torch.sin(x) + 1)
        import neuron_compile
        assert neuron_compile.stats()["graphs_compiled"] == 1, neuron_compile.stats()
        print("ok", neuron_compile.backend_name)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["ok", "neuron"]


def test_both_names_are_listed():
    assert {"neuron", "neuron_compile"} <= set(torch._dynamo.list_backends())


def test_unknown_option_is_an_error_naming_the_key():
    fn = torch.compile(pointwise, backend="neuron", options={"fallbak": "raise"})
    with pytest.raises(Exception, match=r"unknown neuron_compile option\(s\) \['fallbak'\]: valid options are"):
        fn(torch.randn(4), torch.randn(4))


def test_unknown_mode_is_an_error():
    fn = torch.compile(pointwise, backend="neuron", mode="turbo")
    with pytest.raises(Exception, match="torch.compile mode 'turbo' is not one of"):
        fn(torch.randn(4), torch.randn(4))


def test_all_eager_is_exact_and_counts_fallbacks(all_eager):
    x, y = torch.randn(5, 7), torch.randn(5, 7)
    torch.testing.assert_close(torch.compile(pointwise, backend="neuron")(x, y), pointwise(x, y), rtol=0, atol=0)
    counters = neuron_compile.stats()
    assert (counters["graphs_compiled"], counters["regions_compiled"], counters["nki_nodes"]) == (1, 0, 0)
    assert counters["fallback_nodes"] == 4  # mul, add, relu, sin
    assert counters["fallback_reasons"]["aten.sin.default: test: everything eager"] == 1


def test_regions_are_compiled_counted_and_recorded(fake_regions):
    x, y = torch.randn(5, 7), torch.randn(5, 7)
    torch.testing.assert_close(torch.compile(pointwise, backend="neuron")(x, y), pointwise(x, y), rtol=0, atol=0)
    counters = neuron_compile.stats()
    assert (counters["regions_compiled"], counters["nki_nodes"], counters["fallback_nodes"]) == (1, 3, 1)
    assert counters["fallback_reasons"] == {"aten.sin.default: no fake lowering for aten.sin.default": 1}
    record = neuron_compile.last_compiled()
    assert record.kind == "inference"
    assert "aten.mul.Tensor" in record.aten_graph and "nki_region_0" in record.partitioned_graph
    assert [kernel.region for kernel in record.kernels] == ["nki_region_0"]
    assert "nki_region_0" in str(record) and "== kernel kernel_0 (nki_region_0) ==" in str(record)
    assert record.fusion_decisions == {"nki_region_0": ["fused mul into add: matching index"]}
    assert "== fusion decisions (nki_region_0) ==\nfused mul into add: matching index" in str(record)


@pytest.fixture
def failing_regions(fake_regions, monkeypatch):
    monkeypatch.setattr(compiled_graph, "compile_region", failing_compile)


def test_fallback_warn_names_region_ops_and_cause(failing_regions):
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    with pytest.warns(
        neuron_compile.NeuronCompileWarning,
        match=r"NKI region nki_region_0 \(aten.mul.Tensor, aten.add.Tensor, aten.relu.default\) of "
        r"the inference graph could not be compiled: RuntimeError: tile plan exceeds PSUM bank",
    ):
        out = torch.compile(pointwise, backend="neuron")(x, y)
    torch.testing.assert_close(out, pointwise(x, y), rtol=0, atol=0)
    counters = neuron_compile.stats()
    assert (counters["region_compile_failures"], counters["regions_compiled"], counters["fallback_nodes"]) == (1, 0, 4)
    assert "tile plan exceeds PSUM bank" in neuron_compile.last_compiled().failures[0]


def test_fallback_raise(failing_regions):
    fn = torch.compile(pointwise, backend="neuron", options={"fallback": "raise"})
    with pytest.raises(
        neuron_compile.NeuronCompileError,
        match=r"nki_region_0 .*tile plan exceeds PSUM bank.*"
        r"NEURON_COMPILE_FALLBACK=raise",
    ):
        fn(torch.randn(4), torch.randn(4))


def test_fallback_raise_from_environment(failing_regions, monkeypatch):
    monkeypatch.setenv("NEURON_COMPILE_FALLBACK", "raise")
    with pytest.raises(neuron_compile.NeuronCompileError):
        torch.compile(pointwise, backend="neuron")(torch.randn(4), torch.randn(4))


def test_fallback_silent(failing_regions):
    x, y = torch.randn(4), torch.randn(4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with neuron_compile.config.patch(fallback="silent"):
            out = torch.compile(pointwise, backend="neuron")(x, y)
    torch.testing.assert_close(out, pointwise(x, y), rtol=0, atol=0)


def test_region_failing_at_run_time_falls_back_once(fake_regions, monkeypatch):
    class BrokenAtRunTime(EagerRegion):
        def __call__(self, *tensors):
            raise ValueError("simulator: partition dim 129 > 128")

    monkeypatch.setattr(compiled_graph, "compile_region", lambda gm, inputs, config: BrokenAtRunTime(gm, inputs))
    fn = torch.compile(pointwise, backend="neuron")
    x, y = torch.randn(4), torch.randn(4)
    with pytest.warns(
        neuron_compile.NeuronCompileWarning,
        match=r"nki_region_0 \(aten.mul.Tensor, aten.add.Tensor, aten.relu.default\) of the inference graph failed "
        r"when run: ValueError: simulator",
    ):
        torch.testing.assert_close(fn(x, y), pointwise(x, y), rtol=0, atol=0)
    counters = neuron_compile.stats()
    assert (counters["region_run_failures"], counters["fallback_nodes"]) == (1, 4)  # sin, then the region's 3
    assert counters["fallback_reasons"]["aten.relu.default: its region failed when run (ValueError)"] == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the region is now eager: no second warning
        torch.testing.assert_close(fn(x, y), pointwise(x, y), rtol=0, atol=0)


def test_region_with_wrong_output_shape_is_caught(fake_regions, monkeypatch):
    class WrongShape(EagerRegion):
        def __call__(self, *tensors):
            return tuple(out.reshape(-1)[:1] for out in self.gm(*tensors))

    monkeypatch.setattr(compiled_graph, "compile_region", lambda gm, inputs, config: WrongShape(gm, inputs))
    x, y = torch.randn(2, 3), torch.randn(2, 3)
    with pytest.raises(
        neuron_compile.NeuronCompileError,
        match=r"output 0: expected shape \(2, 3\) dtype "
        r"torch.float32, got shape \(1,\)",
    ):
        torch.compile(pointwise, backend="neuron", options={"fallback": "raise"})(x, y)


def test_graph_break_gives_two_graphs(fake_regions):
    def broken(x):
        y = torch.relu(x) * 2
        torch._dynamo.graph_break()
        return torch.sin(y) + 1

    x = torch.randn(6)
    torch.testing.assert_close(torch.compile(broken, backend="neuron")(x), broken(x), rtol=0, atol=0)
    assert neuron_compile.stats()["graphs_compiled"] == 2
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2


def test_dynamic_shapes_specialize_per_signature(fake_regions):
    fn = torch.compile(pointwise, backend="neuron", dynamic=True)
    for rows in (3, 5, 7, 5, 3):
        x, y = torch.randn(rows, 4), torch.randn(rows, 4)
        torch.testing.assert_close(fn(x, y), pointwise(x, y), rtol=0, atol=0)
    counters = neuron_compile.stats()
    assert counters["graphs_compiled"] == 1  # one symbolic graph from Dynamo
    assert (counters["cache_misses"], counters["recompiles"], counters["cache_hits"]) == (3, 2, 2)
    assert counters["regions_compiled"] == 3  # one region per concrete signature
    # Each region was compiled with plain-int shapes of its own call.
    assert fake_regions == [[(rows, 4), (rows, 4)] for rows in (3, 5, 7)]
    assert all(type(dim) is int for shapes in fake_regions for shape in shapes for dim in shape)


def test_dynamic_shapes_through_the_real_pipeline(lowerings):
    fn = torch.compile(pointwise, backend="neuron", dynamic=True)
    for rows in (3, 130, 3):  # 130: more rows than the 128 partitions, a ragged second tile
        x, y = torch.randn(rows, 4), torch.randn(rows, 4)
        torch.testing.assert_close(fn(x, y), pointwise(x, y), **LOWERED_TOLERANCE)
    counters = neuron_compile.stats()
    assert (counters["graphs_compiled"], counters["cache_misses"], counters["cache_hits"]) == (1, 2, 1)
    check_kernels_ran("lowerings")


def test_mark_dynamic(fake_regions):
    x = torch.randn(6, 4)
    torch._dynamo.mark_dynamic(x, 0)
    fn = torch.compile(pointwise, backend="neuron")
    torch.testing.assert_close(fn(x, x), pointwise(x, x), rtol=0, atol=0)
    z = torch.randn(9, 4)
    torch.testing.assert_close(fn(z, z), pointwise(z, z), rtol=0, atol=0)
    assert (neuron_compile.stats()["graphs_compiled"], neuron_compile.stats()["recompiles"]) == (1, 1)


def test_input_mutation_is_preserved(fake_regions):
    def bump(x):
        x.add_(1)
        return x * 2

    compiled_input, eager_input = torch.randn(5), None
    eager_input = compiled_input.clone()
    out = torch.compile(bump, backend="neuron")(compiled_input)
    torch.testing.assert_close(out, bump(eager_input), rtol=0, atol=0)
    torch.testing.assert_close(compiled_input, eager_input, rtol=0, atol=0)


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(3))

    def forward(self, x):
        self.calls.add_(x.sum())
        return x * self.calls


def test_buffer_mutation_in_module(fake_regions):
    compiled_model, eager_model = Counter(), Counter()
    fn = torch.compile(compiled_model, backend="neuron")
    for _ in range(3):
        x = torch.randn(3)
        torch.testing.assert_close(fn(x), eager_model(x), rtol=0, atol=0)
    torch.testing.assert_close(compiled_model.calls, eager_model.calls, rtol=0, atol=0)


# With the real lowerings, regions run as NKI kernels on the simulator: fp32 arithmetic, but matmuls accumulate
# K in PSUM tiles and reductions run in a different order than ATen's CPU kernels. Each reordered fp32 sum of K
# terms is off by at most ~K ulp (K <= 64 here: ~8e-6 relative); a training step chains a few of them, so 1e-4
# relative (and 1e-5 absolute, for gradients near zero) leaves margin without hiding a wrong kernel. Transcendental
# functions (exp, tanh, sigmoid) are numpy's fp32 ones, a few ulp from ATen's; chains of <= 6 stay well inside.
LOWERED_TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}
EXACT = {"rtol": 0.0, "atol": 0.0}
PLACEMENTS = ["all_eager", "fake_regions", "lowerings"]


@pytest.fixture
def lowerings():
    """No stand-ins: the lowering registry and kernel pipeline decide (all eager while they do not exist)."""


def tolerance_for(placement):
    return EXACT if placement != "lowerings" else LOWERED_TOLERANCE


def assert_gradient_is_meaningful(grad, name):
    """A gradient within a few atol of zero would pass any comparison: the loss must reach the parameter."""
    assert grad.abs().max() > 10 * LOWERED_TOLERANCE["atol"], f"{name}: gradient {grad.abs().max():.2e} is noise"


def check_kernels_ran(placement):
    """With the real pipeline present, the lowerings placement must have run NKI kernels, not only eager."""
    if placement == "lowerings" and importlib.util.find_spec("neuron_compile.pipeline") is not None:
        assert neuron_compile.stats()["kernels_launched"] > 0, neuron_compile.stats()["fallback_reasons"]


def _train_step_matches(model_factory, inputs, tolerance):
    torch.manual_seed(0)
    eager_model = model_factory()
    compiled_model = model_factory()
    compiled_model.load_state_dict(eager_model.state_dict())
    eager_out = eager_model(*inputs)
    # A random projection as the loss: every parameter gets an O(1) gradient. (A loss such as mean(out**2) of a
    # layer-normed output is constant, and its gradients are rounding noise that no tolerance can compare.)
    projection = torch.randn_like(eager_out)
    (eager_out * projection).sum().backward()
    compiled_out = torch.compile(compiled_model, backend="neuron")(*inputs)
    (compiled_out * projection).sum().backward()
    torch.testing.assert_close(compiled_out, eager_out, **tolerance)
    for (name, eager_param), compiled_param in zip(
        eager_model.named_parameters(), compiled_model.parameters(), strict=True
    ):
        assert_gradient_is_meaningful(eager_param.grad, name)
        torch.testing.assert_close(compiled_param.grad, eager_param.grad, **tolerance, msg=name)


def mlp():
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_mlp_forward_backward(placement, request):
    request.getfixturevalue(placement)
    _train_step_matches(mlp, (torch.randn(4, 16),), tolerance_for(placement))
    check_kernels_ran(placement)
    counters = neuron_compile.stats()
    assert counters["graphs_compiled"] == 2  # forward and backward
    kinds = [record.kind for record in neuron_compile.compiled_records()]
    assert kinds == ["forward", "backward"]
    if placement == "fake_regions":
        assert counters["regions_compiled"] >= 2 and counters["nki_nodes"] > 0


def encoder_layer():
    return nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_transformer_encoder_layer_forward_backward(placement, request):
    request.getfixturevalue(placement)
    _train_step_matches(encoder_layer, (torch.randn(2, 5, 16),), tolerance_for(placement))
    check_kernels_ran(placement)
    assert neuron_compile.stats()["graphs_compiled"] == 2


def test_config_is_part_of_the_dispatch_key(fake_regions):
    fn = torch.compile(pointwise, backend="neuron")
    x, y = torch.randn(4), torch.randn(4)
    fn(x, y)
    with neuron_compile.config.patch(target="trn1"):
        torch.testing.assert_close(fn(x, y), pointwise(x, y), rtol=0, atol=0)
    fn(x, y)
    counters = neuron_compile.stats()
    assert (counters["cache_misses"], counters["cache_hits"], counters["graphs_compiled"]) == (2, 1, 1)
    assert [record.key.config.target for record in neuron_compile.compiled_records()] == ["trn2", "trn1"]


def test_dump_dir_receives_one_folder_per_compile(fake_regions, tmp_path):
    x, y = torch.randn(4), torch.randn(4)
    torch.compile(pointwise, backend="neuron", options={"dump_dir": str(tmp_path)})(x, y)
    (graph,) = [path for path in tmp_path.iterdir() if path.is_dir()]
    (dumped,) = [path for path in graph.iterdir() if path.is_dir()]
    assert graph.name.startswith("graph_") and (graph / "dynamo_fx.txt").is_file()
    assert dumped.name.startswith("inference-")
    assert (dumped / "record.txt").read_text() == str(neuron_compile.last_compiled()) + "\n"
    partition = (dumped / "partition.txt").read_text()
    assert "nki_region_0" in partition and "eager: no fake lowering for aten.sin.default" in partition
    assert f"{graph.name}/{dumped.name}" in (tmp_path / "index.txt").read_text()


def test_recompile_storm_is_logged(fake_regions, caplog):
    fn = torch.compile(pointwise, backend="neuron", dynamic=True, options={"recompile_warn": 2})
    with caplog.at_level("WARNING", logger="neuron_compile"):
        for rows in (2, 3, 4):
            fn(torch.randn(rows), torch.randn(rows))
    storm = [message for message in caplog.messages if "shape signatures" in message]
    assert len(storm) == 1 and "compiled for 2 shape signatures (recompile_warn=2)" in storm[0]


def test_neuron_name_taken_by_another_package_registers_the_alias():
    script = textwrap.dedent("""
        import logging, torch
        logging.basicConfig(level=logging.WARNING)

        def other_vendor_backend(gm, example_inputs):
            return gm

        torch._dynamo.register_backend(other_vendor_backend, name="neuron")
        import neuron_compile
        assert neuron_compile.backend_name == "neuron_compile"
        x = torch.randn(4)
        torch.testing.assert_close(torch.compile(lambda t: t * 3, backend="neuron_compile")(x), x * 3)
        assert neuron_compile.stats()["graphs_compiled"] == 1
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["ok"]
    assert "backend 'neuron' is served by __main__; use backend='neuron_compile'" in done.stderr


def test_dynamic_training_steps_match_eager(fake_regions):
    torch.manual_seed(0)
    eager_model, compiled_model = mlp(), mlp()
    compiled_model.load_state_dict(eager_model.state_dict())
    compiled = torch.compile(compiled_model, backend="neuron", dynamic=True)
    for batch in (3, 6, 3):
        x = torch.randn(batch, 16)
        torch.testing.assert_close(compiled(x), eager_model(x), rtol=0, atol=0)
        eager_model(x).sum().backward()
        compiled(x).sum().backward()
        for eager_param, compiled_param in zip(eager_model.parameters(), compiled_model.parameters(), strict=True):
            torch.testing.assert_close(compiled_param.grad, eager_param.grad, rtol=0, atol=0)
    counters = neuron_compile.stats()
    assert counters["graphs_compiled"] == 2  # one symbolic forward, one symbolic backward
    assert all(type(dim) is int for shapes in fake_regions for shape in shapes for dim in shape)


def test_front_end_failure_runs_the_whole_graph_eagerly(monkeypatch):
    def broken_partition(gm, target=None):
        raise IndexError("partitioner bug")

    monkeypatch.setattr(pipeline, "partition_graph", broken_partition)
    x, y = torch.randn(3), torch.randn(3)
    fn = torch.compile(pointwise, backend="neuron")
    with pytest.warns(
        neuron_compile.NeuronCompileWarning,
        match=r"the inference graph \w+ could not be specialized "
        r"or partitioned: IndexError: partitioner bug",
    ):
        torch.testing.assert_close(fn(x, y), pointwise(x, y), rtol=0, atol=0)
    assert neuron_compile.stats()["fallback_nodes"] == 4
    torch._dynamo.reset()
    with pytest.raises(neuron_compile.NeuronCompileError, match="partitioner bug"):
        torch.compile(pointwise, backend="neuron", options={"fallback": "raise"})(x, y)


def tiny_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize("placement", ["all_eager", "lowerings"])
def test_tiny_llama_training_step(placement, request):
    """Embedding, RMSNorm, rotary, GQA attention, SwiGLU and cross-entropy, forward and backward."""
    request.getfixturevalue(placement)
    tolerance = tolerance_for(placement)
    torch.manual_seed(0)
    eager_model, compiled_model = tiny_llama(), tiny_llama()
    compiled_model.load_state_dict(eager_model.state_dict())
    tokens = torch.randint(0, 64, (2, 7))
    eager_loss = eager_model(tokens, labels=tokens).loss
    compiled_loss = torch.compile(compiled_model, backend="neuron")(tokens, labels=tokens).loss
    eager_loss.backward()
    compiled_loss.backward()
    torch.testing.assert_close(compiled_loss, eager_loss, **tolerance)
    for (name, eager_param), compiled_param in zip(
        eager_model.named_parameters(), compiled_model.parameters(), strict=True
    ):
        assert_gradient_is_meaningful(eager_param.grad, name)
        torch.testing.assert_close(compiled_param.grad, eager_param.grad, **tolerance, msg=name)
    assert neuron_compile.stats()["graphs_compiled"] == 2
    check_kernels_ran(placement)


def test_long_regions_are_named_by_their_first_ops():
    ops = [f"aten.op{index}.default" for index in range(10)]
    assert region_module.describe_region("nki_region_3", ops) == (
        "NKI region nki_region_3 (" + ", ".join(ops[:8]) + " and 2 more)"
    )


@pytest.mark.parametrize("placement", ["all_eager", "lowerings"])
def test_batch_norm_training_updates_running_stats(placement, request):
    """A training graph that mutates module buffers (running mean / var) as well as computing gradients."""
    request.getfixturevalue(placement)
    tolerance = tolerance_for(placement)
    torch.manual_seed(0)
    eager_model, compiled_model = nn.BatchNorm1d(6), nn.BatchNorm1d(6)
    compiled = torch.compile(compiled_model, backend="neuron")
    for _ in range(2):
        x = torch.randn(8, 6)
        projection = torch.randn(8, 6)
        eager_out, compiled_out = eager_model(x), compiled(x)
        (eager_out * projection).sum().backward()
        (compiled_out * projection).sum().backward()
        torch.testing.assert_close(compiled_out, eager_out, **tolerance)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(compiled_model, name), getattr(eager_model, name), **tolerance, msg=name)
    for name in ("weight", "bias"):
        grad = getattr(eager_model, name).grad
        assert_gradient_is_meaningful(grad, name)
        torch.testing.assert_close(getattr(compiled_model, name).grad, grad, **tolerance, msg=name)


def test_every_stats_key_is_documented():
    documented = neuron_compile.__doc__
    missing = [key for key in neuron_compile.stats() if f"``{key}``" not in documented]
    assert not missing, f"stats keys missing from the neuron_compile docstring: {missing}"


@settings(max_examples=10, deadline=None, derandomize=True)
@given(
    program=programs(max_size=6),
    rows=st.sampled_from([1, 3, 127, 129]),
    cols=st.sampled_from([1, 5, 64]),
    reduce=st.booleans(),
)
def test_random_pointwise_graphs_through_the_real_pipeline(program, rows, cols, reduce):
    """Random DAGs of pointwise ops (plus an optional row sum) on ragged shapes, end to end, vs eager."""

    def random_graph(a, b):
        values = run_program(program, a, b)
        return values[-1].sum(-1) if reduce else values[-1]

    torch._dynamo.reset()
    neuron_compile.reset_stats()
    x, y = torch.randn(rows, cols), torch.randn(rows, cols)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", neuron_compile.NeuronCompileWarning)  # fallbacks are allowed, wrong is not
        got = torch.compile(random_graph, backend="neuron")(x, y)
    torch.testing.assert_close(got, random_graph(x, y), **LOWERED_TOLERANCE)
    check_kernels_ran("lowerings")


def test_graph_aot_autograd_cannot_trace_runs_eagerly_with_a_reason():
    # take of a 0-d tensor with a 0-d index is data-dependent while tracing to ATen (DataDependentOutputException).
    x, index = torch.tensor(1.5), torch.tensor(0)

    def fn(t):
        return torch.take(t, index) * 2.0

    out = torch.compile(fn, backend="neuron", options={"fallback": "silent"})(x)
    assert torch.equal(out, fn(x))
    reasons = neuron_compile.stats()["fallback_reasons"]
    assert any("could not be traced to ATen" in reason for reason in reasons), reasons
    torch._dynamo.reset()
    with pytest.raises(Exception, match="aot_autograd could not trace the graph"):
        torch.compile(fn, backend="neuron", options={"fallback": "raise"})(x)


def test_dynamo_restart_is_not_a_failed_trace():
    # A float argument that changes between calls becomes a symbolic float; aot_autograd's pass that turns it into
    # a tensor asks Dynamo to retrace with it specialized (TensorifyScalarRestartAnalysis). That must reach
    # Dynamo: caught as a failed trace it used to run the whole graph eagerly (an error under fallback=raise).
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, exponent: x.abs().pow(exponent), backend="neuron")
    x = torch.randn(8)
    neuron_compile.reset_stats()
    with neuron_compile.config.patch(fallback="raise", cache_dir="off"):
        for exponent in (2.5, 3.5):
            torch.testing.assert_close(compiled(x, exponent), x.abs().pow(exponent))
    assert not [reason for reason in neuron_compile.stats()["fallback_reasons"] if "could not be traced" in reason]

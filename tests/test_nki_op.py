"""Hand-written kernels as torch operators (neuron_compile/nki_op.py, user_kernels.py, runtime/user_region.py):
eager on the simulator, compiled with our backend as a region of its own, under aot_eager and Inductor, in a
training step with a backward registered (a torch function, and a kernel), and the error for a kernel whose
outputs disagree with the declared spec."""

from __future__ import annotations

import types

import pytest
import torch

import neuron_compile
from neuron_compile.errors import NeuronCompileError
from neuron_compile.passes.partition import partition_graph
from neuron_compile.runtime import simulator as nki
from neuron_compile.runtime.launcher import DeviceLauncher, LauncherError
from neuron_compile.runtime.simulator import isa as nisa
from neuron_compile.runtime.simulator import language as nl

ROWS, COLS = 6, 32


@nki.jit
def scale_columns_kernel(x, weight):
    """out = x * weight for x [rows <= 128, cols], weight [cols] broadcast over the rows."""
    rows, cols = x.shape
    out = nl.ndarray((rows, cols), dtype=x.dtype, buffer=nl.shared_hbm)
    x_tile = nl.ndarray((rows, cols), dtype=x.dtype, buffer=nl.sbuf)
    weight_tile = nl.ndarray((rows, cols), dtype=weight.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=x_tile, src=x)
    nisa.dma_copy(dst=weight_tile, src=weight.ap([[0, rows], [1, cols]], 0))
    product = nl.ndarray((rows, cols), dtype=x.dtype, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=product, data1=x_tile, data2=weight_tile, op=nl.multiply)
    nisa.dma_copy(dst=out, src=product)
    return out


@nki.jit
def first_half_kernel(x, weight):
    """Returns only the first half of the columns: disagrees with a spec declaring x's shape."""
    rows, cols = x.shape
    out = nl.ndarray((rows, cols // 2), dtype=x.dtype, buffer=nl.shared_hbm)
    x_tile = nl.ndarray((rows, cols // 2), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=x_tile, src=x[:, : cols // 2])
    nisa.dma_copy(dst=out, src=x_tile)
    return out


def _same_as_x(x, weight):
    return x.shape, x.dtype


def _scale_backward_in_torch(grad, x, weight):
    return grad * weight, (grad * x).sum(0)


scale_columns = neuron_compile.nki_op(scale_columns_kernel, out=_same_as_x, name="nkiop_tests::scale_columns",
                                      backward=_scale_backward_in_torch)
scale_columns_plain = neuron_compile.nki_op(scale_columns_kernel, out=_same_as_x,
                                            name="nkiop_tests::scale_columns_plain")


def _scale_backward_with_kernel(grad, x, weight):
    # d(x * w)/dx is grad * w: the forward kernel itself, launched on the gradient.
    return scale_columns_plain(grad.contiguous(), weight), (grad * x).sum(0)


scale_columns_kernel_backward = neuron_compile.nki_op(
    scale_columns_kernel, out=_same_as_x, name="nkiop_tests::scale_columns_kb", backward=_scale_backward_with_kernel
)
wrong_shape = neuron_compile.nki_op(first_half_kernel, out=_same_as_x, name="nkiop_tests::wrong_shape")


def _inputs(requires_grad=False):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, COLS, generator=generator, requires_grad=requires_grad)
    weight = torch.randn(COLS, generator=generator, requires_grad=requires_grad)
    return x, weight


def _model(op):
    def model(x, weight):
        # Generated kernels before and after the user kernel: the user kernel cuts the region in two.
        return torch.tanh(op(x * 2.0, weight) + 1.0)

    return model


def _reference(x, weight):
    return torch.tanh(x * 2.0 * weight + 1.0)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    neuron_compile.reset_stats()
    yield
    torch._dynamo.reset()


def test_eager_runs_the_kernel_on_the_simulator_and_counts_it():
    x, weight = _inputs()
    with neuron_compile.record_launches() as launches:
        result = scale_columns(x, weight)
    torch.testing.assert_close(result, x * weight, rtol=0, atol=0)
    assert [launch.kernel for launch in launches] == ["nkiop_tests_scale_columns"]
    assert neuron_compile.stats()["kernels_launched"] == 1 and neuron_compile.stats()["est_time_s"] > 0


def test_partitioner_gives_the_user_kernel_a_region_of_its_own():
    x, weight = _inputs()
    gm = torch.fx.experimental.proxy_tensor.make_fx(_model(scale_columns))(x, weight)
    report = partition_graph(gm).report
    user = [placement for placement in report.placements if placement.op.startswith("nkiop_tests.")]
    assert len(user) == 1 and user[0].region is not None
    assert [placement.op for placement in report.regions[user[0].region]] == [user[0].op]
    assert not report.eager and len(report.regions) == 3  # mul | user kernel | add, tanh


def test_compiled_with_neuron_one_graph_no_fallback_and_the_kernel_in_the_cost_report():
    x, weight = _inputs()
    compiled = torch.compile(_model(scale_columns), backend="neuron", fullgraph=True)
    with neuron_compile.config.patch(fallback="raise"), neuron_compile.record_launches() as launches:
        result = compiled(x, weight)
    torch.testing.assert_close(result, _reference(x, weight))
    stats = neuron_compile.stats()
    assert stats["fallback_nodes"] == 0 and stats["region_run_failures"] == 0
    user = [launch for launch in launches if launch.kernel == "nkiop_tests_scale_columns"]
    assert len(user) == 1 and user[0].report.est_time_s > 0
    assert len(launches) == 3 and stats["kernels_launched"] == 3  # the two generated regions and the user kernel
    record = neuron_compile.last_compiled()
    assert "scale_columns_kernel" in {k.name: k.source for k in record.kernels}["nkiop_tests_scale_columns"]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_other_backends_run_it(backend):
    x, weight = _inputs()
    compiled = torch.compile(lambda x, weight: scale_columns(x, weight), backend=backend, fullgraph=True)
    with neuron_compile.record_launches() as launches:
        result = compiled(x, weight)
    torch.testing.assert_close(result, x * weight, rtol=0, atol=0)
    assert [launch.kernel for launch in launches] == ["nkiop_tests_scale_columns"]


@pytest.mark.parametrize("op", [scale_columns, scale_columns_kernel_backward],
                         ids=["torch_backward", "kernel_backward"])
def test_training_step_matches_eager_gradients(op):
    x, weight = _inputs(requires_grad=True)
    expected_x, expected_weight = _inputs(requires_grad=True)
    _reference(expected_x, expected_weight).square().sum().backward()
    compiled = torch.compile(_model(op), backend="neuron", fullgraph=True)
    with neuron_compile.config.patch(fallback="raise"), neuron_compile.record_launches() as launches:
        compiled(x, weight).square().sum().backward()
    torch.testing.assert_close(x.grad, expected_x.grad)
    torch.testing.assert_close(weight.grad, expected_weight.grad)
    kernels = [launch.kernel for launch in launches]
    assert op.user_kernel.launch_name in kernels
    if op is scale_columns_kernel_backward:  # the backward graph launches the backward kernel too
        assert "nkiop_tests_scale_columns_plain" in kernels
    assert neuron_compile.stats()["fallback_nodes"] == 0


def test_outputs_disagreeing_with_the_declared_spec_name_both():
    x, weight = _inputs()
    message = r"nki_op nkiop_tests::wrong_shape output 0: declared shape \[6, 32\] dtype torch.float32, " \
              r"the kernel returned shape \[6, 16\]"
    with pytest.raises(neuron_compile.NkiOpSpecError, match=message):
        wrong_shape(x, weight)
    compiled = torch.compile(lambda x, weight: wrong_shape(x, weight) + 1.0, backend="neuron", fullgraph=True)
    with neuron_compile.config.patch(fallback="raise"), pytest.raises(neuron_compile.NeuronCompileError,
                                                                      match=message):
        compiled(x, weight)


def test_eager_launch_goes_through_the_configured_launcher():
    # launcher=device on a host without one: the launcher's own error, naming what is missing.
    x, weight = _inputs()
    with neuron_compile.config.patch(launcher="device"), pytest.raises(LauncherError, match="cannot run here"):
        scale_columns(x, weight)


scale_columns_chosen = neuron_compile.nki_op(scale_columns_kernel, out=_same_as_x, name="nkiop_tests::scale_chosen")


def _rows_times_columns(x, weight):
    """The kernel's arguments where aten.mul multiplies a [rows, cols] fp32 tensor by a [cols] one, else None."""
    if not (isinstance(x, torch.fx.Node) and isinstance(weight, torch.fx.Node)):
        return None
    x_value, weight_value = x.meta["val"], weight.meta["val"]
    fits = x_value.dim() == 2 and weight_value.dim() == 1 and x_value.shape[1] == weight_value.shape[0]
    return (x, weight) if fits and x_value.dtype == weight_value.dtype == torch.float32 else None


def test_an_explicit_choice_launches_the_kernel_for_an_aten_op():
    x, weight = _inputs()
    compiled = torch.compile(lambda x, weight: torch.tanh(x * weight) * 3.0, backend="neuron", fullgraph=True)
    with neuron_compile.record_launches() as launches:
        compiled(x, weight)
    assert "nkiop_tests_scale_chosen" not in [launch.kernel for launch in launches]  # not registered yet: ours

    scale_columns_chosen.choose_for(torch.ops.aten.mul.Tensor, _rows_times_columns)
    torch._dynamo.reset()
    try:
        with neuron_compile.config.patch(fallback="raise"), neuron_compile.record_launches() as launches:
            result = compiled(x, weight)
    finally:
        scale_columns_chosen.forget_choices()  # process-wide: later tests' graphs must not pick it up
    torch.testing.assert_close(result, torch.tanh(x * weight) * 3.0)
    # The mul by a scalar is not [rows, cols] x [cols]: select declines it, and our lowering keeps it.
    assert [launch.kernel for launch in launches].count("nkiop_tests_scale_chosen") == 1
    decisions = [text for texts in neuron_compile.last_compiled().fusion_decisions.values() for text in texts]
    assert any("nkiop_tests::scale_chosen, chosen for aten.mul.Tensor" in text for text in decisions)


def _swapped(x, weight):
    return (weight, x) if isinstance(x, torch.fx.Node) and isinstance(weight, torch.fx.Node) else None


def test_a_choice_whose_spec_differs_from_the_aten_op_is_an_error():
    x, weight = _inputs()
    # The spec declares the first argument's shape, [32] here; the mul gives [6, 32].
    wrong_shape.choose_for(torch.ops.aten.mul.Tensor, _swapped)
    compiled = torch.compile(lambda x, weight: x * weight, backend="neuron", fullgraph=True)
    message = r"nki_op nkiop_tests::wrong_shape chosen for aten.mul.Tensor \(mul\): its declared outputs shape " \
              r"\[32\] dtype torch.float32 differ from the op's shape \[6, 32\]"
    try:
        with neuron_compile.config.patch(fallback="raise"), pytest.raises(NeuronCompileError, match=message):
            compiled(x, weight)
    finally:
        wrong_shape.forget_choices()


def test_the_device_launcher_calls_the_kernel_with_device_tensors_and_keeps_its_dtypes():
    # A stand-in for the real nki.jit kernel on a device: it receives torch tensors, returns a torch tensor.
    received = []

    def device_kernel(x, weight):
        received.append((x.device.type, tuple(x.shape)))
        return (x * weight).to(torch.bfloat16)

    launcher = DeviceLauncher(nki_module=types.ModuleType("nki"), device="cpu")
    x, weight = _inputs()
    outputs, report = launcher.launch_function(device_kernel, [x, weight])
    assert received == [("cpu", (ROWS, COLS))] and report is None
    assert outputs[0].dtype == torch.bfloat16  # as the kernel returned it: the spec check then sees the truth
    torch.testing.assert_close(outputs[0], (x * weight).to(torch.bfloat16))

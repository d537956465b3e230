"""The launcher seam (runtime/launcher.py): what the simulator launcher hands back to torch, the device launcher
driven by a stand-in ``nki`` module that records its calls, and which launcher the config selects."""

from __future__ import annotations

import inspect
import linecache
import sys
import types

import pytest
import torch

from neuron_compile import pipeline
from neuron_compile.config import Config
from neuron_compile.errors import NeuronCompileError
from neuron_compile.runtime import launcher, simulator, stats

aten = torch.ops.aten


def _region(fn, *inputs, launcher_name="simulator", launch_unit="region"):
    config = Config(launcher=launcher_name, launch_unit=launch_unit)
    return pipeline.compile_region(torch.fx.symbolic_trace(fn), list(inputs), config)


def _matmul_then_sum(x, w):
    """Two kernels (a matmul, then a reduction reading its output): the device path passes a kernel's output on."""
    h = aten.mm.default(x, w)
    s = aten.sum.dim_IntList(h, [0])
    return aten.add.Tensor(h, s), s


def _matmul_inputs():
    generator = torch.Generator().manual_seed(0)
    return torch.randn(8, 16, generator=generator), torch.randn(16, 4, generator=generator)


# ------------------------------------------------------------------------------------------------ simulator
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_simulator_outputs_own_resizable_storage(dtype):
    x, y = torch.randn(4, 8, dtype=dtype), torch.randn(4, 8, dtype=dtype)
    region = _region(lambda a, b: (aten.add.Tensor(aten.mul.Tensor(a, b), 1.0), aten.gt.Tensor(a, b)), x, y)
    assert isinstance(region.launcher, launcher.SimulatorLauncher)
    total, greater = region(x, y)
    torch.testing.assert_close(total, x * y + 1)
    assert torch.equal(greater, x > y) and greater.dtype == torch.bool
    for output in (total, greater):  # FSDP2 frees a parameter's memory this way
        output.untyped_storage().resize_(0)
        assert output.untyped_storage().nbytes() == 0
    for tensor in (x, y):  # the inputs too: reading them must not pin their storage (Tensor.numpy() would)
        tensor.untyped_storage().resize_(0)


def test_simulator_launcher_outputs_are_torch_allocated():
    x, w = _matmul_inputs()
    region = _region(_matmul_then_sum, x, w, launch_unit="kernel")
    kernel = region.launched[0]  # the matmul, reading the flat x and w
    arguments = {"x": x.reshape(-1), "w": w.reshape(-1)}
    outputs, report = region.launcher.launch(kernel, [arguments[name] for name in kernel.source.parameters])
    assert report is not None and report.flops > 0
    (output,) = outputs
    assert type(output) is torch.Tensor and output.dtype == torch.float32
    torch.testing.assert_close(output.reshape(8, 4), x @ w)
    output.untyped_storage().resize_(0)
    for result in region(x, w):  # the matmul's output was also the reduction kernel's argument
        result.untyped_storage().resize_(0)


def test_outputs_reading_one_buffer_stay_views_of_it():
    x = torch.randn(4, 6)

    def two_views(a):
        doubled = aten.mul.Tensor(a, 2.0)
        return doubled, aten.t.default(doubled)

    first, second = _region(two_views, x)(x)
    assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
    assert second.stride() == (1, 6) and torch.equal(second, (x * 2).t())


def test_in_place_op_on_a_result_does_not_change_a_later_call():
    x, w = _matmul_inputs()
    region = _region(_matmul_then_sum, x, w)
    expected = [tensor.clone() for tensor in _matmul_then_sum(x, w)]
    first = region(x, w)
    for tensor in first:
        tensor.add_(100.0)  # a Trainer writing into an output in place
    second = region(x, w)
    for got, want in zip(second, expected):
        torch.testing.assert_close(got, want)
    for tensor in second:
        tensor.mul_(0.0)
    third = region(x, w)
    for got, mutated, want in zip(third, first, expected):
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(mutated, want + 100.0)  # the earlier result is its own memory too


@pytest.mark.parametrize("launch_unit,launches", [("region", 1), ("kernel", 2)])
def test_simulator_launch_adds_cost_figures_to_stats(launch_unit, launches):
    x, w = _matmul_inputs()
    region = _region(_matmul_then_sum, x, w, launch_unit=launch_unit)
    assert len(region.kernels) == 2 and len(region.launched) == launches
    before = stats.snapshot()
    region(x, w)
    after = stats.snapshot()
    assert after["kernels_launched"] - before["kernels_launched"] == launches
    assert after["hbm_bytes"] > before["hbm_bytes"] and after["flops"] > before["flops"]
    assert after["est_time_s"] > before["est_time_s"] and after["roofline_s"] > before["roofline_s"]


# ------------------------------------------------------------------------------------------------ device (stand-in)
class StandInKernel:
    """What the stand-in's ``nki.jit`` returns: records each launch, then runs the kernel body (bound to the
    simulator's nl / nisa by the stand-in) and returns torch tensors, as ``nki.jit`` does on a device."""

    def __init__(self, nki_module: StandInNki, fn):
        self.nki, self.fn = nki_module, fn

    def __call__(self, *tensors):
        self.nki.launches.append((self.fn.__name__, tensors))
        return simulator.jit(self.fn)(*tensors)


class StandInNki(types.ModuleType):
    """A stand-in for the real ``nki`` package: ``jit`` records the kernel function and the source it reads."""

    def __init__(self):
        super().__init__("nki")
        self.language, self.isa = simulator.language, simulator.isa
        self.jitted: list = []  # (function, inspect.getsource text, the whole file's text)
        self.launches: list = []  # (kernel name, tensors)

    def jit(self, fn=None, **options):
        if fn is None:
            return lambda f: self.jit(f, **options)
        file_text = "".join(linecache.getlines(fn.__code__.co_filename))
        self.jitted.append((fn, inspect.getsource(fn), file_text))  # the real nki.jit parses the source
        return StandInKernel(self, fn)


@pytest.mark.parametrize("launch_unit,names", [
    ("region", ["region_kernel"]), ("kernel", ["matmul_kernel_0", "reduction_kernel_1"]),
])
def test_device_launcher_hands_the_same_source_to_nki_jit(launch_unit, names):
    x, w = _matmul_inputs()
    simulated = _region(_matmul_then_sum, x, w, launch_unit=launch_unit)
    expected = simulated(x, w)
    modules_before = {name: sys.modules.get(name) for name in ("nki", "nki.language", "nki.isa")}
    stand_in = StandInNki()
    on_device = simulated.with_launcher(launcher.DeviceLauncher(nki_module=stand_in, device="cpu"))
    assert [fn.__name__ for fn, _, _ in stand_in.jitted] == names  # loaded through nki.jit, in order
    for (fn, function_text, file_text), source, loaded in zip(stand_in.jitted, simulated.launch_sources,
                                                              simulated.launched, strict=True):
        assert file_text == source.source and function_text in source.source
        assert fn.__globals__["nki"] is stand_in and fn.__globals__["nl"] is stand_in.language
        simulator_text = "".join(linecache.getlines(loaded.function.fn.__code__.co_filename))
        assert simulator_text == source.source  # the text the simulator ran
    before = stats.snapshot()
    outputs = on_device(x, w)
    after = stats.snapshot()
    assert [name for name, _ in stand_in.launches] == names
    for (_, tensors), source in zip(stand_in.launches, simulated.launch_sources, strict=True):
        assert len(tensors) == len(source.parameters)
        assert all(type(t) is torch.Tensor and t.device.type == "cpu" and t.dim() == 1 for t in tensors)
    for got, want in zip(outputs, expected):
        assert type(got) is torch.Tensor
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        got.untyped_storage().resize_(0)  # copied into torch-allocated memory on the way back
    assert after["kernels_launched"] - before["kernels_launched"] == len(names)
    assert after["hbm_bytes"] == before["hbm_bytes"] and after["flops"] == before["flops"]  # no cost model
    assert {name: sys.modules.get(name) for name in modules_before} == modules_before  # nothing left behind


def test_device_launcher_refuses_a_kernel_returning_the_wrong_count():
    x, w = _matmul_inputs()
    stand_in = StandInNki()
    region = _region(_matmul_then_sum, x, w, launch_unit="kernel")
    region = region.with_launcher(launcher.DeviceLauncher(nki_module=stand_in, device="cpu"))
    broken = launcher.LoadedKernel(region.launched[0].source, lambda *tensors: ())
    arguments = {"x": x.reshape(-1), "w": w.reshape(-1)}
    with pytest.raises(launcher.LauncherError, match=r"returned 0 tensors on the device, expected 1"):
        region.launcher.launch(broken, [arguments[name] for name in broken.source.parameters])


# ------------------------------------------------------------------------------------------------ selection
def test_auto_picks_the_device_only_with_real_nki_and_a_device():
    assert launcher.resolve_launcher("auto", real_nki=True, device=True) == "device"
    assert launcher.resolve_launcher("auto", real_nki=True, device=False) == "simulator"
    assert launcher.resolve_launcher("auto", real_nki=False, device=True) == "simulator"
    assert launcher.resolve_launcher("simulator", real_nki=True, device=True) == "simulator"
    with pytest.raises(ValueError, match=r"launcher must be one of \['auto', 'simulator', 'device'\], got 'tpu'"):
        launcher.resolve_launcher("tpu", real_nki=True, device=True)


def test_auto_picks_the_simulator_here(monkeypatch):
    if launcher.real_nki_available() and launcher.neuron_device_present():
        pytest.skip("a Neuron host: auto picks the device here")
    monkeypatch.delenv("NEURON_COMPILE_LAUNCHER", raising=False)
    assert isinstance(launcher.select_launcher(Config()), launcher.SimulatorLauncher)
    assert isinstance(launcher.select_launcher(), launcher.SimulatorLauncher)
    x = torch.randn(3, 5)
    region = pipeline.compile_region(torch.fx.symbolic_trace(lambda a: aten.exp.default(a)), [x])
    assert isinstance(region.launcher, launcher.SimulatorLauncher)


def test_simulator_launcher_takes_the_configured_target():
    assert launcher.select_launcher(Config(launcher="simulator", target="trn1")).target.name == "trn1"


def test_device_here_fails_naming_what_is_missing(monkeypatch):
    if launcher.real_nki_available() and launcher.neuron_device_present():
        pytest.skip("a Neuron host: the device launcher works here")
    with pytest.raises(launcher.LauncherError, match=r"launcher 'device' .*cannot run here: .*"
                                                     r"(nki package is not importable|no Neuron device found)"):
        launcher.select_launcher(Config(launcher="device"))
    monkeypatch.setenv("NEURON_COMPILE_LAUNCHER", "device")
    with pytest.raises(launcher.LauncherError, match=r"launcher 'device'"):
        launcher.select_launcher()


def test_device_here_through_the_backend_is_a_clear_error():
    if launcher.real_nki_available() and launcher.neuron_device_present():
        pytest.skip("a Neuron host: the device launcher works here")
    torch._dynamo.reset()
    fn = torch.compile(lambda a: torch.exp(a) + 1, backend="neuron",
                       options={"launcher": "device", "fallback": "raise"})
    with pytest.raises(NeuronCompileError, match=r"LauncherError: launcher 'device' .*cannot run here"):
        fn(torch.randn(4, 4))
    torch._dynamo.reset()

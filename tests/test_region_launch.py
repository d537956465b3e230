"""One launch per region (codegen/region_text.py, Config.launch_unit): the region kernel gives bit for bit what
launching each kernel gives, its cost report splits into one section per kernel, its schedule is never longer
than the kernels' one after the other, and its module is a standalone NKI module."""

from __future__ import annotations

import ast
import json
import math
import re
import textwrap

import numpy as np
import pytest
import torch

from neuron_compile import cli, config, hardware, pipeline
from neuron_compile.config import Config
from neuron_compile.rendered_region import RenderedRegion
from neuron_compile.runtime import stats

aten = torch.ops.aten


def _region(fn, inputs, launch_unit):
    gm = torch.fx.symbolic_trace(fn)
    return pipeline.compile_region(gm, list(inputs), Config(launcher="simulator", launch_unit=launch_unit,
                                                            cache_dir="off"))


def _mlp_softmax(x, w, b):
    hidden = aten.relu.default(aten.addmm.default(b, x, w))
    return aten._softmax.default(hidden, -1, False), aten.sum.dim_IntList(hidden, [0])


def _norm_and_rotate(x, weight):
    """rms norm, then a rotate-half: several kernels with intermediates between them."""
    variance = aten.mean.dim(aten.mul.Tensor(x, x), [-1], True)
    normed = aten.mul.Tensor(aten.mul.Tensor(x, aten.rsqrt.default(aten.add.Tensor(variance, 1e-6))), weight)
    first, second = aten.slice.Tensor(normed, -1, 0, 128), aten.slice.Tensor(normed, -1, 128, 256)
    rotated = aten.cat.default([aten.neg.default(second), first], -1)
    return aten.add.Tensor(aten.mul.Tensor(normed, 0.5), rotated), normed


def _write_into_cache(cache, values, index):
    """A mutation (index_copy_ into a graph input) next to a computed output, as a static KV cache does."""
    scaled = aten.mul.Tensor(values, 2.0)
    updated = aten.index_copy.default(cache, 0, index, scaled)
    aten.copy_.default(cache, updated)
    return aten.sum.dim_IntList(updated, [1]), aten.t.default(updated)


def _randn(generator, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=generator).to(dtype)


def _inputs(case):
    """The case's inputs, the same values on every call."""
    generator = torch.Generator().manual_seed(0)
    if case == "mlp_softmax":
        return [_randn(generator, 96, 64), _randn(generator, 64, 136), _randn(generator, 136)]
    if case == "norm_rotate_bf16":
        return [_randn(generator, 130, 256, dtype=torch.bfloat16), _randn(generator, 256, dtype=torch.bfloat16)]
    return [_randn(generator, 16, 24), _randn(generator, 3, 24), torch.tensor([5, 0, 11])]


CASES = {
    "mlp_softmax": (_mlp_softmax, lambda: _inputs("mlp_softmax")),
    "norm_rotate_bf16": (_norm_and_rotate, lambda: _inputs("norm_rotate_bf16")),
    "cache_write": (_write_into_cache, lambda: _inputs("cache_write")),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_region_launch_equals_one_launch_per_kernel_bit_for_bit(case):
    fn, make_inputs = CASES[case]
    per_kernel_inputs = make_inputs()
    region_inputs = [tensor.clone() for tensor in per_kernel_inputs]
    per_kernel = _region(fn, per_kernel_inputs, "kernel")
    region = _region(fn, region_inputs, "region")
    assert len(region.kernels) >= 2 and len(region.launched) == 1
    assert [source.name for source in region.launch_sources] == [pipeline.REGION_KERNEL_NAME]
    assert [kernel.name for kernel in region.kernels] == [kernel.name for kernel in per_kernel.kernels]
    expected, got = per_kernel(*per_kernel_inputs), region(*region_inputs)
    for want, have in zip(expected, got, strict=True):
        assert have.dtype == want.dtype and have.shape == want.shape and have.stride() == want.stride()
        assert torch.equal(have, want)
    for want, have in zip(per_kernel_inputs, region_inputs, strict=True):  # the mutated input too
        assert torch.equal(have, want)
    eager_inputs = make_inputs()
    for want, have in zip(fn(*eager_inputs), got, strict=True):  # and both are eager's answer
        torch.testing.assert_close(have, want, rtol=2e-2, atol=2e-2)


def _launch_reports(region, inputs):
    with stats.record_launches() as launches:
        region(*inputs)
    return [launch.report for launch in launches]


@pytest.mark.parametrize("case", ["mlp_softmax", "norm_rotate_bf16"])
def test_region_report_has_a_section_per_kernel_and_costs_no_more(case):
    fn, make_inputs = CASES[case]
    inputs = make_inputs()
    per_kernel = _launch_reports(_region(fn, inputs, "kernel"), inputs)
    region = _region(fn, inputs, "region")
    (report,) = _launch_reports(region, inputs)
    assert [section.name for section in report.sections] == [kernel.name for kernel in region.kernels]
    # The same instructions and bytes, one launch cost instead of one per kernel, and a schedule no longer than
    # the kernels' schedules one after the other (they may overlap, never slow down).
    assert sum(section.instructions for section in report.sections) == sum(
        sum(r.instructions_per_engine.values()) for r in per_kernel)
    assert report.hbm_bytes == sum(r.hbm_bytes for r in per_kernel)
    assert report.flops == sum(r.flops for r in per_kernel)
    assert report.launch_s == per_kernel[0].launch_s
    assert report.device_time_s <= sum(r.device_time_s for r in per_kernel) * (1 + 1e-9)
    assert report.est_time_s < sum(r.est_time_s for r in per_kernel)
    # Sections add up to the launch: each is how far it pushed the schedule's end.
    assert math.isclose(sum(section.est_time_s for section in report.sections), report.device_time_s, rel_tol=1e-9)
    costs = report.kernel_costs("region_kernel", scope="r.")
    assert math.isclose(sum(cost.est_time_s for cost in costs), report.est_time_s, rel_tol=1e-9)
    assert [cost.name for cost in costs] == ["region_kernel launch", *(f"r.{s.name}" for s in report.sections)]
    for section, alone in zip(report.sections, per_kernel, strict=True):
        assert section.hbm_bytes == alone.hbm_bytes and section.flops == alone.flops
        assert section.start_s <= section.end_s <= report.device_time_s * (1 + 1e-9)


def test_a_single_kernel_region_launches_that_kernel():
    x = torch.randn(8, 8)
    region = _region(lambda a: aten.mul.Tensor(a, 3.0), [x], "region")
    assert len(region.kernels) == 1 and region.launch_sources == region.kernels
    (report,) = _launch_reports(region, [x])
    assert len(report.sections) == 1
    assert report.kernel_costs(region.kernels[0].name)[0].est_time_s == report.est_time_s


def test_region_kernel_module_reads_like_a_kernel_and_survives_the_disk_cache_format():
    fn, make_inputs = CASES["cache_write"]
    region = _region(fn, make_inputs(), "region")
    (source,) = region.launch_sources
    tree = ast.parse(source.source)
    functions = [node for node in tree.body if isinstance(node, ast.FunctionDef)]
    assert [function.name for function in functions] == [*(k.name for k in region.kernels), "region_kernel"]
    jitted = [f.name for f in functions if any(ast.unparse(d) == "nki.jit" for d in f.decorator_list)]
    assert jitted == ["region_kernel"]  # subkernels must not be nki.jit-decorated
    assert source.source.count("buffer=nl.shared_hbm") == len(source.outputs)
    rendered = pipeline.run_passes("region", torch.fx.symbolic_trace(fn), pipeline.PassContext(
        Config(launch_unit="region"), hardware.configured_target(None), make_inputs(), []), through="render")
    assert RenderedRegion.from_data(json.loads(json.dumps(rendered.to_data()))) == rendered
    assert rendered.launch is not None and rendered.launch.source == source.source


def test_region_kernel_module_runs_standalone_under_simulate(tmp_path, capsys):
    fn, make_inputs = CASES["mlp_softmax"]
    inputs = make_inputs()
    region = _region(fn, inputs, "region")
    (source,) = region.launch_sources
    expected = region(*inputs)
    script = tmp_path / "region_module.py"
    arguments = {buffer.name: tensor for buffer, tensor in zip(region.inputs, inputs, strict=True)}
    values = {name: arguments[name].reshape(-1).tolist() for name in source.parameters}
    script.write_text(source.source + textwrap.dedent(f"""

        import json
        import numpy as np

        VALUES = {values!r}
        outputs = region_kernel(*(np.asarray(VALUES[name], dtype=np.float32) for name in {list(source.parameters)!r}))
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        print(json.dumps([np.asarray(output).tolist() for output in outputs]))
        """))
    assert cli.main(["simulate", str(script)]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    softmax, column_sum = expected
    assert len(printed) == len(source.outputs) == 2
    np.testing.assert_array_equal(np.asarray(printed[0], dtype=np.float32).reshape(softmax.shape), softmax.numpy())
    np.testing.assert_array_equal(np.asarray(printed[1], dtype=np.float32).reshape(column_sum.shape),
                                  column_sum.numpy())


def test_launch_unit_reaches_the_backend():
    def model(x, w):
        return torch.softmax(x @ w, -1) + 1

    x, w = torch.randn(32, 48), torch.randn(48, 40)
    launched = {}
    for unit in ("region", "kernel"):
        torch._dynamo.reset()
        before = stats.snapshot()["kernels_launched"]
        with config.patch(launch_unit=unit, cache_dir="off"):
            result = torch.compile(model, backend="neuron")(x, w)
        launched[unit] = stats.snapshot()["kernels_launched"] - before
        torch.testing.assert_close(result, model(x, w), rtol=1e-5, atol=1e-5)
    assert launched == {"region": 1, "kernel": 2}


def test_profile_page_lists_a_region_kernels_kernels():
    from neuron_compile import profile_page

    fn, make_inputs = CASES["mlp_softmax"]
    inputs = make_inputs()
    region = _region(fn, inputs, "region")
    (report,) = _launch_reports(region, inputs)
    table = profile_page.sections_html(report)
    rows = re.findall(r"<tr><td>(\w+)</td>", table)
    assert rows == [kernel.name for kernel in region.kernels]
    assert profile_page.sections_html(_launch_reports(_region(fn, inputs, "kernel"), inputs)[0]) == ""


def test_explain_ranks_a_region_kernels_kernels_and_its_launch_cost():
    from neuron_compile import explain
    from neuron_compile.observation import observe

    def model(x, w):
        return torch.softmax(x @ w, -1).sum(0)

    x, w = torch.randn(32, 48), torch.randn(48, 40)
    with config.patch(cache_dir="off"), observe() as observation:
        torch.compile(model, backend="neuron")(x, w)
    (record,) = observation.records
    assert [kernel.name for kernel in record.region_kernels] == ["region_kernel"]
    names = [kernel.name for kernel in record.kernels]
    assert len(names) >= 2 and "region_kernel" not in names
    lines = explain.kernel_lines(observation)
    assert lines[0].startswith(f"== kernels by estimated time: {len(names)} kernel(s), 1 launch(es)")
    rows = [line.split() for line in lines[2:]]
    labels = {row[3] for row in rows}
    assert labels == {f"nki_region_0.{name}" for name in names} | {"nki_region_0.region_kernel"}
    (launch_row,) = [row for row in rows if row[-1] == "launch"]
    assert float(launch_row[-6]) == pytest.approx(5.0)  # the launch cost, once


def test_a_region_whose_outputs_are_all_empty_launches_without_a_region_kernel():
    """unfold of a batch of 0: the region's kernels write only scratch, its one output is empty (no kernel
    writes it). It used to fail to render as a region kernel with nothing to return and ran eagerly."""
    from lowering_harness import check_through_backend

    x = torch.randn(0, 1, 5, 5)
    check_through_backend(lambda t: torch.nn.functional.unfold(t, 2, 1, 0, 1), x)

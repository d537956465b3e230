"""The kernel-kind registry and the pass list: every IR node type has a complete kind, unknown ones are refused,
and the dump shows the IR after every pass."""

from __future__ import annotations

import dataclasses
import typing

import pytest
import torch
from lowering_harness import trace

import neuron_compile
from neuron_compile import ir, kinds, pipeline
from neuron_compile.kind_registry import KernelKind


def test_every_ir_node_type_has_a_complete_kind():
    node_types = set(typing.get_args(ir.Node))
    assert node_types == set(kinds.registered_node_types())
    for kind_module in kinds.KINDS:
        kind_classes = [value for value in vars(kind_module).values()
                        if isinstance(value, type) and issubclass(value, KernelKind) and value.__module__ ==
                        kind_module.__name__]
        assert kind_classes, f"{kind_module.__name__} defines no kind"
        for kind_class in kind_classes:
            # A planner and a renderer of its own, and a fusion rule: a refusal, or epilogue / prologue rules.
            assert kind_class.plan is not KernelKind.plan, kind_class
            assert kind_class.render is not KernelKind.render, kind_class
            fuses = (kind_class.refusal is not None or kind_class.epilogue_reason is not KernelKind.epilogue_reason
                     or kind_class.prologue_reason is not KernelKind.prologue_reason)
            assert fuses, f"{kind_class.__name__} states no fusion rule"


def test_an_unknown_node_type_is_refused_by_name():
    @dataclasses.dataclass(frozen=True)
    class Attention:
        name: str = "attention_1"
        domain: tuple = (4,)
        stores: tuple = ()

    with pytest.raises(kinds.UnknownKernelKind, match="Attention"):
        kinds.kind_of(Attention())
    with pytest.raises(kinds.UnknownKernelKind):
        kinds.loads(Attention())


def test_passes_are_one_named_list_in_pipeline_order():
    assert [step.name for step in pipeline.PASSES] == [
        "specialize", "bound inputs", "complex pairs", "flex attention", "attention pattern", "split projections",
        "partition", "lower", "guard ranges", "fuse", "plan tiles", "render", "load"]
    assert {step.level for step in pipeline.PASSES} == {"graph", "region"}


def test_compile_region_reports_every_region_pass():
    seen = []
    x = torch.randn(130, 33)
    gm = trace(lambda a: torch.softmax(a * 2.0, -1), x)
    region = pipeline.compile_region(gm, [x], on_pass=lambda name, text: seen.append((name, text)))
    assert [name for name, _ in seen] == ["lower", "guard ranges", "fuse", "plan tiles", "render", "load"]
    texts = dict(seen)
    assert "RowNormalize" in texts["lower"] and "row_normalize" in texts["plan tiles"]
    assert "@nki.jit" in texts["render"]
    torch.testing.assert_close(region(x)[0], torch.softmax(x * 2.0, -1))


def test_dump_dir_holds_the_ir_after_every_pass(tmp_path, monkeypatch):
    monkeypatch.setenv("NEURON_COMPILE_DUMP", str(tmp_path))
    torch._dynamo.reset()
    with neuron_compile.config.patch(dump_dir=str(tmp_path)):
        compiled = torch.compile(lambda a: torch.relu(a) + 1.0, backend="neuron")
        x = torch.randn(8, 16)
        torch.testing.assert_close(compiled(x), torch.relu(x) + 1.0)
    (dump,) = tmp_path.glob("graph_*/*/record.txt")
    text = dump.read_text()
    for name in ("specialize", "bound inputs", "complex pairs", "flex attention", "attention pattern",
                 "split projections", "partition", "lower", "guard ranges", "fuse", "plan tiles", "render", "load"):
        assert f"== after pass {name}" in text, name
    passes = sorted(path.name for path in (dump.parent / "passes").iterdir())
    assert passes[:8] == ["00-specialize.txt", "01-bound_inputs.txt", "02-complex_pairs.txt",
                          "03-flex_attention.txt", "04-attention_pattern.txt", "05-split_projections.txt",
                          "06-partition.txt", "07-lower.nki_region_0.txt"]
    assert len(passes) == 13

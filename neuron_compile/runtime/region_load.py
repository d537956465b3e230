"""Load stage: a rendered region (``RenderedRegion``: its kernel sources and launch metadata) -> a ``CompiledRegion``
whose kernels the configured launcher has loaded.

The pipeline's last pass (pipeline.PASSES "load") and the whole of a disk hit's or a warm start's work on a stored
region (runtime/warm_start.py). It imports no lowering, fusion, tiling or rendering code, so a warm start, which
loads stored kernels only, never imports the compiler.
"""

from __future__ import annotations

from neuron_compile.hardware import Target, configured_target
from neuron_compile.rendered_region import RenderedRegion
from neuron_compile.runtime.launcher import select_launcher
from neuron_compile.runtime.region import CompiledRegion


def load_region(rendered: RenderedRegion, config, target: Target) -> CompiledRegion:
    """``rendered``'s kernels loaded by the launcher ``config`` selects (raises ``ValueError`` for a kernel text the
    launcher does not execute: codegen/kernel_check.py)."""
    launcher = select_launcher(config, target)
    launched = [rendered.launch] if rendered.launch is not None else list(rendered.sources)
    return CompiledRegion(
        list(rendered.inputs), list(rendered.sources), list(rendered.outputs), rendered.aten_nodes, target,
        list(rendered.decisions), dict(rendered.buffers), list(rendered.mutations), list(rendered.output_dtypes),
        launcher=launcher, launched=[launcher.load(source) for source in launched],
    )


def load_stored_region(payload: dict, config) -> CompiledRegion:
    """A region's stored payload (a ``RenderedRegion``'s data, from the on-disk cache) loaded: what a disk hit in
    ``pipeline.compile_region`` does. Raises ``ValueError`` on a payload ``from_data`` refuses or a kernel text the
    launcher does not execute."""
    return load_region(RenderedRegion.from_data(payload), config, configured_target(config))

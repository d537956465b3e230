"""CLI stage: what one script run compiled and launched (for ``neuron-compile explain``, ``dump`` and ``profile``).

Input: a ``with observe():`` block around the run. Output: an ``Observation``: the Dynamo graphs the backend
received and why each ended, graph breaks and recompiles (runtime/compile_events.py), the ATen graphs' compile
records, the eager fallbacks counted during the block (by "<op>: <reason>"), every kernel launch with its cost
report, and, with ``keep_traces``, each simulator launch's instruction trace (for the profile's timelines).
The block starts a fresh session, as a new process would: Dynamo's state is reset (``torch._dynamo.reset()``: its
compiled code and what it learned about shapes) and earlier compile events and records are forgotten.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Iterator

import torch

from neuron_compile.runtime import compile_events, stats
from neuron_compile.runtime.graph_records import clear_records, compiled_records, forget_dumped

TRACES_KEPT = 2000  # simulator runs whose instruction traces a profile keeps (the first launches: one per kernel)


@dataclasses.dataclass
class Observation:
    events: list = dataclasses.field(default_factory=list)  # compile_events.DynamoGraphEvent
    graph_breaks: list = dataclasses.field(default_factory=list)  # compile_events.GraphBreak
    recompiles: list = dataclasses.field(default_factory=list)  # compile_events.Recompile
    frame_names: dict = dataclasses.field(default_factory=dict)  # Dynamo compile id -> function name
    records: list = dataclasses.field(default_factory=list)  # graph_records.CompiledGraphRecord
    fallback_reasons: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    launches: list = dataclasses.field(default_factory=list)  # stats.Launch
    runs: list = dataclasses.field(default_factory=list)  # simulator KernelRun (with keep_traces), the first ones
    run_by_report: dict = dataclasses.field(default_factory=dict)  # id(its cost report) -> KernelRun

    def keep_run(self, run) -> None:
        """A launch hook: keep the first TRACES_KEPT simulator runs (a long training loop would keep them all)."""
        if len(self.runs) < TRACES_KEPT:
            self.runs.append(run)

    def kernel_label(self, launch) -> str:
        """``graph_001 inference nki_region_0.matmul_kernel_0``: where a launched kernel came from."""
        source = getattr(launch.source, "source", None)
        for record in self.records:
            for kernel in [*record.kernels, *record.region_kernels]:
                if kernel.name == launch.kernel and (source is None or kernel.source == source):
                    return f"graph_{record.dynamo_graph:03d} {record.kind} {kernel.region}.{kernel.name}"
        return launch.kernel

    def trace_of(self, launch):
        """The simulator run (instruction trace) behind ``launch``: the run whose cost report it carries (None past
        the first TRACES_KEPT launches)."""
        if launch.report is None:
            return None
        if not self.run_by_report:  # KernelRun.report is cached on first use: the launch carries that same object
            self.run_by_report = {id(run.__dict__["report"]): run for run in self.runs if "report" in run.__dict__}
        return self.run_by_report.get(id(launch.report))


@contextlib.contextmanager
def observe(keep_traces: bool = False) -> Iterator[Observation]:
    """Collect an ``Observation`` of everything compiled and launched inside the block (see the module doc)."""
    from neuron_compile.runtime import simulator  # the CLI's simulate command loads it the same way

    torch._dynamo.reset()
    compile_events.clear()
    clear_records()
    forget_dumped()
    before = collections.Counter(stats.snapshot()["fallback_reasons"])
    observation = Observation()
    if keep_traces:
        simulator.launch_hooks.append(observation.keep_run)
    try:
        with stats.record_launches() as launches:
            yield observation
    finally:
        if keep_traces:
            simulator.launch_hooks.remove(observation.keep_run)
        observation.launches = list(launches)
        observation.events = compile_events.dynamo_graphs()
        observation.graph_breaks = compile_events.graph_breaks()
        observation.recompiles = compile_events.recompiles()
        observation.frame_names = compile_events.frame_names()
        observation.records = compiled_records()
        observation.fallback_reasons = collections.Counter(stats.snapshot()["fallback_reasons"]) - before

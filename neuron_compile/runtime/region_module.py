"""Runtime stage: ``RegionModule``, the submodule that runs one NKI region of a partitioned graph through its compiled
region, and the fallback policy it and the compile apply (``Config.fallback``: raise, warn or silent).

Input: a compiled region (runtime/region.py, or a user kernel's: runtime/user_region.py), the region's eager
submodule, eager's output metadata and the graph's ``CompiledGraphRecord``. Output: the region's outputs; on a
run-time failure, eager's, after the policy said so. Used by a compile (runtime/compiled_graph.py) and a warm start
(runtime/warm_start.py) alike.
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.fx

from neuron_compile.config import Config
from neuron_compile.errors import NeuronCompileError, NeuronCompileWarning
from neuron_compile.runtime import compile_events, dump, stats, trace_artifacts
from neuron_compile.runtime.graph_records import CompiledGraphRecord

log = logging.getLogger(__name__)
OPS_NAMED = 8  # a message names at most this many of a region's ops


def apply_fallback(config: Config, message: str, cause: BaseException) -> None:
    """Apply the fallback policy to a region failure: raise, warn or stay silent (the caller then runs eagerly)."""
    if config.fallback == "raise":
        raise NeuronCompileError(f"{message} (NEURON_COMPILE_FALLBACK=raise)") from cause
    if config.fallback == "warn":
        warnings.warn(f"{message}; running it eagerly", NeuronCompileWarning, stacklevel=3)
    log.debug("%s", message)


def describe_region(name: str, ops: list[str]) -> str:
    """``nki_region_0 (aten.mm.default, aten.add.Tensor)``: the region and its distinct ops, for messages."""
    shown = ", ".join(ops[:OPS_NAMED])
    more = f" and {len(ops) - OPS_NAMED} more" if len(ops) > OPS_NAMED else ""
    return f"NKI region {name} ({shown}{more})"


def count_region_fallback(ops: list[str], reason: str) -> None:
    for op in ops:
        # getitem and other glue are not compute; torch.distributed's functional collectives are (collective
        # kernels), and so are higher-order ops (flex attention) left eager
        if op.startswith(("aten.", "prims.", "_c10d_functional.", "higher_order.")):
            stats.add_fallback(op, reason)


def _check_outputs(outputs, expected: list, region: str) -> None:
    """A region's outputs must have eager's shapes and dtypes; anything else is a kernel bug, caught here."""
    if len(outputs) != len(expected):
        raise NeuronCompileError(f"region {region} returned {len(outputs)} outputs, eager returns {len(expected)}")
    for index, (got, want) in enumerate(zip(outputs, expected, strict=True)):
        if isinstance(want, torch.Tensor) and (tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype):
            raise NeuronCompileError(
                f"region {region} output {index}: expected shape {tuple(want.shape)} dtype {want.dtype}, "
                f"got shape {tuple(got.shape)} dtype {got.dtype}"
            )


class RegionModule(torch.nn.Module):
    """Runs one NKI region through its CompiledRegion; on a run-time failure, falls back to the eager submodule."""

    def __init__(self, name: str, compiled, eager: torch.fx.GraphModule, expected: list, record: CompiledGraphRecord):
        super().__init__()
        self.region_name, self.compiled, self.eager, self.expected, self.record = (
            name,
            compiled,
            eager,
            expected,
            record,
        )
        self.node_ops = [placement.op for placement in record.report.regions[name]]  # one entry per node
        # Whether the first launch's cost reports are still to be written: with a dump folder or a structured trace
        # (decided with the record's pass dumps, at compile time)
        self.costs_pending = bool(record.key.config.dump_dir) or trace_artifacts.enabled()
        # Whether the outputs' shapes and dtypes were checked once and are fixed by the region's launch plan (a
        # CompiledRegion's are: its layouts and dtypes are constants), so later calls need not check them again.
        self.outputs_checked = False

    def __call__(self, *tensors):
        # Not nn.Module's: nothing registers hooks on this internal module, and its hook dispatch would cost every
        # call.
        if self.costs_pending:
            return self.forward(*tensors)
        return self.run(*tensors)

    def _check(self, outputs) -> None:
        _check_outputs(outputs, self.expected, self.region_name)
        self.outputs_checked = bool(getattr(self.compiled, "outputs_planned", False))

    def forward(self, *tensors):
        if self.compiled is None:
            return self.eager(*tensors)
        if self.costs_pending:
            dump_dir = self.record.key.config.dump_dir
            self.costs_pending = False  # the first launch's reports: later launches of a kernel cost the same
            with stats.record_launches() as launches:
                outputs = self.run(*tensors)
            mine = {kernel.name for kernel in [*self.record.kernels, *self.record.region_kernels]
                    if kernel.region == self.region_name}
            reports = {f"{self.region_name}.{launch.kernel}": launch.report for launch in launches
                       if launch.kernel in mine}
            if dump_dir:
                dump.write_costs(dump_dir, self.record, reports)
            trace_artifacts.emit_costs(self.record, self.region_name, reports,
                                       compile_events.compile_id_of(self.record.dynamo_graph))
            return outputs
        return self.run(*tensors)

    def run(self, *tensors):
        """The compiled region on ``tensors``; on a failure, Config.fallback decides and the eager submodule runs."""
        if self.compiled is None:
            return self.eager(*tensors)
        try:
            if self.outputs_checked:
                return tuple(self.compiled(*tensors))
            if getattr(self.compiled, "mutations", None):
                # The region writes graph inputs: check its outputs before it does, so that an eager rerun
                # after a failure reads the inputs unchanged.
                return tuple(self.compiled(*tensors, validate=self._check))
            outputs = tuple(self.compiled(*tensors))
            self._check(outputs)
            return outputs
        except Exception as error:  # noqa: BLE001 -- any kernel failure falls back, per Config.fallback
            return self.fall_back_from(error, tensors)

    def fall_back_from(self, error: Exception, tensors) -> tuple:
        """After the compiled region failed on ``tensors``: what Config.fallback says, then this call and every later
        one run the eager submodule (the failure would repeat)."""
        message = (
            f"{describe_region(self.region_name, self.record.report.region_ops(self.region_name))} of the "
            f"{self.record.kind} graph failed when run: {type(error).__name__}: {error}"
        )
        apply_fallback(self.record.key.config, message, error)
        self.compiled = None  # later calls go straight to eager: the failure would repeat
        stats.add(region_run_failures=1)
        count_region_fallback(self.node_ops, f"its region failed when run ({type(error).__name__})")
        self.record.failures.append(message)
        return self.eager(*tensors)

    @property
    def settled(self) -> bool:
        """Whether a call may go straight to the compiled region's ``prepare`` / ``finish`` (runtime/direct_hit.py):
        it is compiled and has not failed, its outputs were checked once and are fixed by its plan, and its first
        launch's cost reports are written."""
        return self.compiled is not None and self.outputs_checked and not self.costs_pending


def read_attributes_directly(top: torch.fx.GraphModule) -> None:
    """Put the regions and constants ``top``'s code reads (``self.nki_region_0``, ``self._tensor_constant0``) in its
    instance dict too, where an attribute read finds them before ``nn.Module.__getattr__`` (a microsecond a read,
    on every call); they stay registered as submodules and buffers, and nothing assigns them again."""
    for node in top.graph.nodes:
        if node.op in ("call_module", "get_attr") and "." not in node.target:
            top.__dict__[node.target] = getattr(top, node.target)

"""Runtime stage: the records of what each graph compile produced, for ``neuron_compile.last_compiled()``, the dump
folder and the CLI.

Input: a compile's facts (made by runtime/compiled_graph.py, or by a warm start: runtime/warm_start.py). Output:
``CompiledGraphRecord`` (ATen graph, partition report, kernel sources, pass dumps), kept in a bounded list; with a
dump folder, each record is written there (runtime/dump.py) and the folder's index refreshed.
"""

from __future__ import annotations

import collections
import dataclasses
import threading

from neuron_compile.passes.partition import PartitionReport
from neuron_compile.runtime import compile_events, dump
from neuron_compile.runtime.cache import GraphKey

RECORDS_KEPT = 64


@dataclasses.dataclass(frozen=True)
class KernelRecord:
    region: str
    name: str
    source: str
    parameters: tuple[tuple[str, int, str], ...] = ()  # (buffer, elements, dtype) per kernel parameter, in order


@dataclasses.dataclass
class CompiledGraphRecord:
    """What one compile produced: enough to print every stage for the dump CLI."""

    kind: str  # "forward" | "backward" | "inference"
    key: GraphKey
    aten_graph: str  # the specialized ATen graph, as FX text
    partitioned_graph: str  # the top-level graph after partitioning (regions appear as call_module)
    report: PartitionReport
    kernels: list[KernelRecord] = dataclasses.field(default_factory=list)
    # Per region launched as one kernel, that region kernel (it calls the region's kernels in order).
    region_kernels: list[KernelRecord] = dataclasses.field(default_factory=list)
    failures: list[str] = dataclasses.field(default_factory=list)  # one message per region that fell back
    # Per region, the fusion pass's decisions (why nodes were or were not fused), when the region reports them.
    fusion_decisions: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    # With a dump directory: (pass name, region or "" for a graph pass, the pass's output as text), in pass order.
    pass_dumps: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)
    dynamo_graph: int = -1  # the index of the Dynamo graph this ATen graph came from (compile_events), -1: unknown
    bucketing: str = ""  # with Config.bucket: the dims padded and the ones declined, with reasons (passes/bucket.py)

    def __str__(self) -> str:
        parts = [
            f"== {self.kind} graph {self.key.graph_hash} ==",
            self.aten_graph,
            "== partition ==",
            str(self.report),
            "== partitioned graph ==",
            self.partitioned_graph,
        ]
        parts += [f"!! {failure}" for failure in self.failures]
        parts += [f"== bucketing: {self.bucketing}"] if self.bucketing else []
        for region, decisions in self.fusion_decisions.items():
            parts += [f"== fusion decisions ({region}) ==", *decisions]
        for kernel in [*self.kernels, *self.region_kernels]:
            parts += [f"== kernel {kernel.name} ({kernel.region}) ==", kernel.source]
        for name, region, text in self.pass_dumps:
            parts += [f"== after pass {name}" + (f" ({region})" if region else "") + " ==", text]
        return "\n".join(parts)


_records: collections.deque[CompiledGraphRecord] = collections.deque(maxlen=RECORDS_KEPT)
_records_lock = threading.Lock()


def last_compiled() -> CompiledGraphRecord | None:
    """The record of the most recent graph compile (None before the first)."""
    with _records_lock:
        return _records[-1] if _records else None


def clear_records() -> None:
    """Forget the compile records (the compiled graphs themselves stay cached)."""
    with _records_lock:
        _records.clear()


def keep_record(record: CompiledGraphRecord) -> None:
    """Keep ``record`` among the compile records (a warm start's, made without a compile: runtime/warm_start.py)."""
    with _records_lock:
        _records.append(record)


def compiled_records() -> list[CompiledGraphRecord]:
    """The records of the most recent compiles, oldest first (at most RECORDS_KEPT)."""
    with _records_lock:
        return list(_records)


# Records written to a dump folder, by folder: the index lists them all (compiled_records keeps the latest only).
_dumped: dict[str, list[CompiledGraphRecord]] = {}


def refresh_dump_index(dump_dir: str) -> str:
    """Rewrite the dump folder's index from the Dynamo graphs, the records dumped there, graph breaks and
    recompiles since the last ``compile_events.clear()``; returns the index's path."""
    with _records_lock:
        records = list(_dumped.get(dump_dir, []))
    data = dump.index_data(compile_events.dynamo_graphs(), records, compile_events.graph_breaks(),
                           compile_events.recompiles(), dump_dir, compile_events.frame_names())
    return dump.write_index(dump_dir, data)


def dump_record(record: CompiledGraphRecord, dump_dir: str) -> str:
    """Write ``record``'s folder under ``dump_dir`` (runtime/dump.py) and refresh the index; returns the folder."""
    folder = dump.write_record(dump_dir, record)
    with _records_lock:
        _dumped.setdefault(dump_dir, []).append(record)
    refresh_dump_index(dump_dir)
    return folder


def forget_dumped() -> None:
    """Forget which records were dumped (the CLI starts each run with an empty index)."""
    with _records_lock:
        _dumped.clear()


def kernel_records(region_name: str, region, launched: bool = False) -> list[KernelRecord]:
    """One KernelRecord per kernel of a compiled region (``launched``: per region kernel it launches instead of
    its kernels, none when it launches each kernel), with its parameters' sizes and dtypes."""
    kernels = list(region.kernels)
    if launched:
        kernels = [source for source in getattr(region, "launch_sources", []) if source not in kernels]
    buffers = {buffer.name: buffer for buffer in getattr(region, "inputs", [])}
    buffers.update(getattr(region, "buffers", {}) or {})
    for kernel in kernels:
        buffers.update({buffer.name: buffer for buffer in getattr(kernel, "outputs", ())})
    records = []
    for kernel in kernels:
        parameters = tuple((name, buffers[name].layout.span(), buffers[name].dtype)
                           for name in getattr(kernel, "parameters", ()) if name in buffers)
        records.append(KernelRecord(region_name, kernel.name, kernel.source, parameters))
    return records

"""Runtime stage (debug artifacts): our compile stages as torch structured-trace artifacts, for tlparse.

Input: an ATen graph's compile record (runtime/compiled_graph.py) and the Dynamo compile id it belongs to; a
region's first-launch cost reports. Output: ``torch._logging.trace_structured`` artifacts named
``neuron_compile_<kind>_<file>`` whose payloads are the files the dump folder holds (runtime/dump.py: the ATen
graph, each pass's output, partition, fusion, tile plans, kernel sources, costs), logged under the Dynamo compile
id, so that ``TORCH_TRACE=DIR`` and tlparse show our graphs and kernels next to Dynamo's and aot_autograd's.
Nothing is built unless structured tracing is on (``TORCH_TRACE`` set).
"""

from __future__ import annotations

import contextlib
import os

import torch

from neuron_compile.runtime import dump

PREFIX = "neuron_compile"


def enabled() -> bool:
    """Structured tracing is on: torch writes it where ``TORCH_TRACE`` points."""
    return bool(os.environ.get("TORCH_TRACE"))


def artifact_name(kind: str, relative: str) -> str:
    """``neuron_compile_inference_passes_02-lower.nki_region_0`` from a dump file's relative path."""
    stem = relative.removesuffix(".txt").replace("/", "_")
    return f"{PREFIX}_{kind}_{stem}"


def under_compile_id(compile_id):
    """Log inside Dynamo's compile context for ``compile_id`` (attempt 0), as Dynamo's own artifacts of that frame
    are: our graphs compile at their first call, after Dynamo's context has ended, and tlparse groups artifacts by
    frame, compile and attempt. Inside a live compile context (or without an id), log as things are."""
    if compile_id is None or torch._guards.CompileContext.try_get() is not None:
        return contextlib.nullcontext()
    return torch._guards.compile_context(torch._guards.CompileContext(compile_id))


def emit(name: str, text: str, compile_id=None) -> None:
    with under_compile_id(compile_id):
        torch._logging.trace_structured(
            "artifact",
            metadata_fn=lambda: {"name": name, "encoding": "string"},
            payload_fn=lambda: text,
            compile_id=compile_id,
        )


def emit_record(record, compile_id=None) -> None:
    """Every file of the record's dump folder (record.txt aside: it repeats the rest) as one artifact each."""
    if not enabled():
        return
    for relative, text in dump.record_files(record).items():
        if relative != "record.txt":
            emit(artifact_name(record.kind, relative), text, compile_id)


def emit_costs(record, region: str, reports: dict, compile_id=None) -> None:
    if not enabled():
        return
    text = "\n".join(f"== {dump.format_cost_line(name, report)}\n{report.format()}"
                     for name, report in reports.items() if report is not None)
    emit(artifact_name(record.kind, f"costs.{region}"), text + "\n", compile_id)

"""Runtime stage (debug record): the Dynamo graphs the backend received, graph breaks and recompiles.

Input: each Dynamo FX graph handed to the backend (``record_dynamo_graph``: its compile id, the function it came
from, the graph's text and why Dynamo ended it: a graph break with the user's source line, or the end of the
frame), and Dynamo's own bookkeeping read afterwards (``torch._dynamo.utils.graph_break_reasons`` and the
compilation metrics, whose ``recompile_reason`` is the guard that failed). Output: ``DynamoGraphEvent`` records
(process-wide, oldest first), ``graph_breaks()`` and ``recompiles()``. The dump (runtime/dump.py) and
``neuron-compile explain`` read these; nothing here changes what is compiled.
"""

from __future__ import annotations

import dataclasses
import threading

import torch

EVENTS_KEPT = 4096


@dataclasses.dataclass(frozen=True)
class SourceLine:
    filename: str
    lineno: int
    line: str

    def __str__(self) -> str:
        return f"{self.filename}:{self.lineno}: {self.line}".rstrip(": ")


@dataclasses.dataclass(frozen=True)
class DynamoGraphEvent:
    index: int  # order of arrival in this process (since the last clear())
    compile_id: str  # Dynamo's "frame/attempt" id: attempt > 0 is a recompile of that frame
    function: str  # the compiled function's name (Dynamo's resume functions: torch_dynamo_resume_in_...)
    fx_graph: str  # the Dynamo (torch-level) FX graph, as code
    graph_break: bool  # the graph ended at a graph break (else at the end of the frame)
    reason: str  # why the graph ended, shortened (short_reason)
    source: SourceLine | None  # the user's line where it ended
    # Dynamo's CompileId object, for logging our artifacts under it (runtime/trace_artifacts.py)
    compile_id_object: object = dataclasses.field(default=None, compare=False, repr=False)


@dataclasses.dataclass(frozen=True)
class GraphBreak:
    reason: str
    source: SourceLine | None
    count: int


@dataclasses.dataclass(frozen=True)
class Recompile:
    compile_id: str
    function: str
    location: str  # file:line of the function
    guard: str  # the guard that failed (Dynamo's recompile reason)


_events: list[DynamoGraphEvent] = []
_lock = threading.Lock()
# Where the current session started in Dynamo's own records (clear() moves it): the graph-break reasons list's
# length, and the compilation-metrics records already there.
_session = {"breaks": 0, "metrics": frozenset()}


def short_reason(text: str) -> str:
    """Dynamo's graph-break message without the developer context and the web link (the dump must read offline):
    its first line and its explanation and hint lines."""
    kept = []
    for line in str(text).splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith(("Developer debug context", "For more details")):
            continue
        kept.append(stripped)
    return " | ".join(kept) if kept else str(text).strip()


def user_line(stack) -> SourceLine | None:
    """The innermost frame of a Dynamo user stack (a list of traceback.FrameSummary), or None."""
    if not stack:
        return None
    frame = stack[-1]
    return SourceLine(frame.filename, int(frame.lineno or 0), (frame.line or "").strip())


def current_compile_id():
    """Dynamo's CompileId of the frame being compiled (None outside a compile)."""
    return torch._guards.CompileContext.current_compile_id()


def compile_id_of(index: int):
    """The Dynamo CompileId of the graph with event index ``index`` (None if unknown or forgotten)."""
    with _lock:
        for event in reversed(_events):
            if event.index == index:
                return event.compile_id_object
    return None


def record_dynamo_graph(gm: torch.fx.GraphModule, keep_graph: bool = True) -> DynamoGraphEvent:
    """Note one Dynamo graph as the backend receives it; returns its event (``index`` numbers the dump folder).
    ``keep_graph``: keep the graph's text (for a dump; without one only the short facts are kept)."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    graph_break = bool(getattr(reason, "graph_break", False))
    code = (gm.code if hasattr(gm, "code") else str(gm.graph)) if keep_graph else ""
    compile_id = current_compile_id()
    with _lock:
        index = _events[-1].index + 1 if _events else 0
        event = DynamoGraphEvent(
            index=index,
            compile_id=str(compile_id) if compile_id is not None else "?",
            function=_function_name(gm),
            fx_graph=code,
            graph_break=graph_break,
            reason=short_reason(getattr(reason, "reason", "")) if reason is not None else "",
            source=user_line(getattr(reason, "user_stack", None)) if graph_break else None,
            compile_id_object=compile_id,
        )
        _events.append(event)
        del _events[:-EVENTS_KEPT]
    return event


def _function_name(gm: torch.fx.GraphModule) -> str:
    """The user function a Dynamo graph came from (its first node's stack), else the GraphModule's class name."""
    for node in gm.graph.nodes:
        stack = node.meta.get("stack_trace")
        if stack:
            lines = [line.strip() for line in stack.strip().splitlines() if line.strip().startswith("File ")]
            if lines:
                return lines[-1].rsplit(" in ", 1)[-1]
    return type(gm).__name__


def dynamo_graphs() -> list[DynamoGraphEvent]:
    with _lock:
        return list(_events)


def clear() -> None:
    """Start a new session: forget the Dynamo graphs, and report only graph breaks and recompiles from now on."""
    with _lock:
        _events.clear()
        _session["breaks"] = len(torch._dynamo.utils.graph_break_reasons)
        _session["metrics"] = frozenset(id(metrics) for metrics in torch._dynamo.utils.get_compilation_metrics())


def graph_breaks() -> list[GraphBreak]:
    """Graph breaks Dynamo reported this session, one per (reason, source line), with how often it broke."""
    counts: dict[tuple[str, SourceLine | None], int] = {}
    reasons = torch._dynamo.utils.graph_break_reasons
    start = _session["breaks"] if len(reasons) >= _session["breaks"] else 0  # torch._dynamo.reset() empties it
    for reason in reasons[start:]:
        if not getattr(reason, "graph_break", True):
            continue
        key = (short_reason(reason.reason), user_line(reason.user_stack))
        counts[key] = counts.get(key, 0) + 1
    return [GraphBreak(reason, source, count) for (reason, source), count in counts.items()]


def recompiles() -> list[Recompile]:
    """Dynamo's recompiles this session: the frame, its function and the guard that failed."""
    found = []
    for metrics in torch._dynamo.utils.get_compilation_metrics():
        if id(metrics) in _session["metrics"] or not getattr(metrics, "recompile_reason", None):
            continue
        location = f"{metrics.co_filename}:{metrics.co_firstlineno}"
        found.append(Recompile(str(metrics.compile_id), str(metrics.co_name), location, metrics.recompile_reason))
    return found


def frame_names() -> dict[str, str]:
    """Dynamo compile id -> the compiled function's name, from the compilation metrics (this session)."""
    return {str(metrics.compile_id): str(metrics.co_name) for metrics in torch._dynamo.utils.get_compilation_metrics()
            if id(metrics) not in _session["metrics"]}

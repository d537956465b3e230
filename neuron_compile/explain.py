"""CLI stage: ``neuron-compile explain``'s report. Input: an ``Observation`` of one script run (observation.py).
Output: text, in the order a user acts on it: graph breaks with their reasons and source lines; recompiles with the
guard that failed (Dynamo's) and the graphs compiled for several shape signatures (ours); the graphs compiled; eager
fallbacks grouped by reason with counts; kernels ranked by estimated time (from each launch's cost report) with
their bottleneck engine and their distance from the roofline.
"""

from __future__ import annotations

import collections
import dataclasses

KERNELS_SHOWN = 20


@dataclasses.dataclass
class KernelTotal:
    label: str
    launches: int = 0
    est_s: float = 0.0
    lower_bound_s: float = 0.0
    roofline_s: float = 0.0
    bottleneck: str = "?"


def graph_break_lines(observation) -> list[str]:
    lines = [f"== graph breaks: {sum(b.count for b in observation.graph_breaks)}"]
    for found in observation.graph_breaks:
        where = str(found.source) if found.source is not None else "(source line unknown)"
        lines += [f"  {where}  ({found.count}x)", *(f"    {part}" for part in found.reason.split(" | "))]
    if not observation.graph_breaks:
        lines.append("  none: each compiled function is one graph")
    return lines


def recompile_lines(observation) -> list[str]:
    lines = [f"== recompiles: {len(observation.recompiles)} by Dynamo"]
    for recompile in observation.recompiles:
        lines += [f"  {recompile.compile_id} {recompile.function} ({recompile.location})",
                  f"    guard failed: {recompile.guard}"]
    signatures: dict[tuple[str, str], list] = collections.defaultdict(list)
    for record in observation.records:
        signatures[(record.kind, record.key.graph_hash)].append(record)
    for (kind, graph_hash), records in signatures.items():
        if len(records) > 1:
            shapes = "; ".join(_shapes(record) for record in records[:4])
            lines.append(f"  neuron_compile: the {kind} graph {graph_hash} was compiled for {len(records)} shape "
                         f"signatures ({shapes}{'; ...' if len(records) > 4 else ''})")
    if len(lines) > 1:
        lines.append("  (each new shape compiles new kernels: torch.compile(..., dynamic=False), or pad inputs to a "
                     "few sizes)")
    return lines


def _shapes(record) -> str:
    return ", ".join("x".join(map(str, getattr(arg, "shape", ()))) or "scalar" for arg in record.key.inputs[:3])


def graph_lines(observation) -> list[str]:
    kernels = sum(len(record.kernels) for record in observation.records)
    lines = [f"== graphs: {len(observation.events)} Dynamo graph(s), {len(observation.records)} ATen graph "
             f"compile(s), {kernels} kernel(s)"]
    for event in observation.events:
        function = observation.frame_names.get(event.compile_id, event.function)
        ending = f"graph break at {event.source}" if event.graph_break else "end of frame"
        lines.append(f"  graph_{event.index:03d} {function} (compile id {event.compile_id}), ended by {ending}")
        for record in observation.records:
            if record.dynamo_graph == event.index:
                lines.append(f"    {record.kind}: {len(record.report.regions)} NKI region(s), "
                             f"{len(record.report.eager)} eager op(s), {len(record.kernels)} kernel(s)")
                lines += [f"    !! {failure}" for failure in record.failures]
                lines += [f"    bucketing: {record.bucketing}"] if record.bucketing else []
    return lines


def fallback_lines(observation) -> list[str]:
    by_reason: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for key, count in observation.fallback_reasons.items():
        op, _, reason = key.partition(": ")
        by_reason[reason][op] += count
    total = sum(observation.fallback_reasons.values())
    lines = [f"== eager fallbacks: {total} ATen node(s)"]
    ranked = sorted(by_reason.items(), key=lambda item: (-sum(item[1].values()), item[0]))
    for reason, ops in ranked:
        named = ", ".join(f"{op} x{count}" if count > 1 else op for op, count in ops.most_common())
        lines.append(f"  {sum(ops.values()):4d}  {reason}: {named}")
    if not ranked:
        lines.append("  none: every ATen node ran in an NKI kernel")
    return lines


def kernel_totals(observation) -> list[KernelTotal]:
    """Per kernel (its label), the launches and summed cost figures, highest estimated time first."""
    totals: dict[str, KernelTotal] = {}
    for launch in observation.launches:
        label = observation.kernel_label(launch)
        if launch.report is None:
            totals.setdefault(label, KernelTotal(label)).launches += 1
            continue
        # A region kernel's launch counts once for each kernel it ran (and once for its launch cost).
        for cost in launch.report.kernel_costs(label, scope=label.rpartition(".")[0] + "."):
            total = totals.setdefault(cost.name, KernelTotal(cost.name))
            total.launches += 1
            total.est_s += cost.est_time_s
            total.lower_bound_s += cost.lower_bound_s
            total.roofline_s += cost.roofline_s
            total.bottleneck = cost.bottleneck
    return sorted(totals.values(), key=lambda total: (-total.est_s, total.label))


def kernel_lines(observation, shown: int = KERNELS_SHOWN) -> list[str]:
    totals = kernel_totals(observation)
    overall = sum(total.est_s for total in totals)
    kernels = sum(1 for total in totals if total.bottleneck != "launch")
    lines = [f"== kernels by estimated time: {kernels} kernel(s), {len(observation.launches)} launch(es), "
             f"{overall * 1e6:.1f} us in all (trn cost model)"]
    if not totals:
        return [*lines, "  no kernel was launched"]
    width = max(len(total.label) for total in totals[:shown])
    lines.append(f"  {'#':>3}  {'kernel':<{width}}  {'launches':>8}  {'est us':>9}  {'share':>6}  "
                 f"{'lower bd':>9}  {'roofline':>9}  {'x roof':>7}  bottleneck")
    for rank, total in enumerate(totals[:shown], 1):
        share = total.est_s / overall if overall else 0.0
        over = f"{total.est_s / total.roofline_s:7.1f}" if total.roofline_s else f"{'-':>7}"
        lines.append(f"  {rank:>3}  {total.label:<{width}}  {total.launches:>8}  {total.est_s * 1e6:>9.2f}  "
                     f"{share:>6.1%}  {total.lower_bound_s * 1e6:>9.2f}  {total.roofline_s * 1e6:>9.2f}  {over}  "
                     f"{total.bottleneck}")
    if len(totals) > shown:
        lines.append(f"  ... {len(totals) - shown} more")
    return lines


def explain_text(observation, top: int = KERNELS_SHOWN) -> str:
    sections = [graph_break_lines(observation), recompile_lines(observation), graph_lines(observation),
                fallback_lines(observation), kernel_lines(observation, top)]
    return "\n".join("\n".join(section) for section in sections) + "\n"

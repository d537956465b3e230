"""CLI stage: ``neuron-compile profile``'s page. Input: an ``Observation`` of one script run, with the simulator's
instruction traces (observation.py, ``keep_traces=True``). Output: one self-contained HTML page (inline CSS and SVG;
no script, no font, no link, nothing fetched):

* a summary: launches, kernels, estimated time against the roofline;
* per ATen graph, its kernels in launch order, each a bar of its estimated time with its lower bound and roofline;
* per kernel (its first launch), the cost model's schedule (runtime/simulator/schedule.py) as a timeline with one
  lane per queue: TensorE, VectorE, ScalarE, GpSimd, the sync engine, and the DMA queues (loads to SBUF, stores to
  HBM, other copies); with lnc=2 a lane per core and queue. Each instruction is a box from its start to its end
  (boxes closer than a pixel merge; a box's tooltip names its instructions); beside it, its time against its
  roofline and lower bound, and its cost report.
"""

from __future__ import annotations

import collections
import dataclasses
import html

WIDTH = 960  # timeline width in pixels
LANE_HEIGHT = 20
LABEL_WIDTH = 150
LANES = (  # (queue, label) in the order a Neuron profile shows them
    ("tensor", "TensorE"), ("vector", "VectorE"), ("scalar", "ScalarE"), ("gpsimd", "GpSimd"), ("sync", "Sync"),
    ("dma_load", "DMA load (to SBUF)"), ("dma_store", "DMA store (to HBM)"), ("dma_copy", "DMA copy"),
    ("collective", "Collectives (links)"),
)
LANE_LABELS = dict(LANES)

STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #1d2430; background: #fff; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 18px; margin: 28px 0 8px; border-bottom: 1px solid #ccd;
padding-bottom: 4px; } h3 { font-size: 15px; margin: 22px 0 6px; font-family: ui-monospace, monospace; }
.note { color: #5a6473; } table { border-collapse: collapse; margin: 6px 0; }
td, th { padding: 2px 10px 2px 0; text-align: left; vertical-align: middle; } th { color: #5a6473; font-weight: 600; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.bar { position: relative; height: 14px; background: #eef0f4; width: 360px; }
.bar .est { position: absolute; left: 0; top: 0; bottom: 0; background: #4a78c2; }
.bar .bound { position: absolute; top: -2px; bottom: -2px; width: 2px; background: #e08a1e; }
.bar .roof { position: absolute; top: -2px; bottom: -2px; width: 2px; background: #2a9d57; }
.legend span { display: inline-block; margin-right: 14px; } .swatch { display: inline-block; width: 10px;
height: 10px; margin-right: 4px; vertical-align: -1px; }
svg text { font: 11px system-ui, sans-serif; fill: #1d2430; } svg .axis { stroke: #c4c9d2; stroke-width: 1; }
svg .lane { fill: #f6f7f9; } .q-tensor { fill: #4a78c2; } .q-vector { fill: #2a9d57; } .q-scalar { fill: #d9a21b; }
.q-gpsimd { fill: #9b59b6; } .q-sync { fill: #7f8c8d; } .q-dma_load { fill: #d35454; } .q-dma_store { fill: #e67e22; }
.q-dma_copy { fill: #8e5b3c; } .q-collective { fill: #16a3a3; }
pre { background: #f6f7f9; padding: 8px; font-size: 12px; overflow-x: auto; }
section.kernel { border-top: 1px solid #e3e6eb; margin-top: 18px; }
"""


@dataclasses.dataclass
class KernelView:
    label: str
    launches: list = dataclasses.field(default_factory=list)  # stats.Launch, in order
    run: object = None  # the first launch's simulator run (trace), None without one


def us(seconds: float) -> str:
    return f"{seconds * 1e6:.2f} us"


def kernel_views(observation) -> dict[str, KernelView]:
    views: dict[str, KernelView] = {}
    for launch in observation.launches:
        view = views.setdefault(observation.kernel_label(launch), KernelView(observation.kernel_label(launch)))
        view.launches.append(launch)
        if view.run is None:
            view.run = observation.trace_of(launch)
    return views


def graph_of(label: str) -> str:
    """``graph_001 inference`` from ``graph_001 inference nki_region_0.matmul_kernel_0``."""
    return " ".join(label.split(" ")[:2]) if label.startswith("graph_") else "other kernels"


def time_bar(report, scale_s: float) -> str:
    """A bar of the estimated time, with ticks at the lower bound (orange) and the roofline (green)."""
    if report is None or scale_s <= 0:
        return '<div class="bar"></div>'

    def percent(seconds: float) -> float:
        return min(100.0, 100.0 * seconds / scale_s)

    return (f'<div class="bar" title="est {us(report.est_time_s)}, lower bound {us(report.est_lower_bound_s)}, '
            f'roofline {us(report.roofline_s)}"><div class="est" style="width:{percent(report.est_time_s):.2f}%">'
            f'</div><div class="bound" style="left:{percent(report.est_lower_bound_s):.2f}%"></div>'
            f'<div class="roof" style="left:{percent(report.roofline_s):.2f}%"></div></div>')


def lane_boxes(trace, timings) -> dict[tuple[int, str], list[tuple[float, float, list[str]]]]:
    """Per (core, queue), the instructions' (start ns, end ns, names), in start order."""
    lanes: dict[tuple[int, str], list] = collections.defaultdict(list)
    for record, timing in zip(trace, timings):
        lanes[(record.program, timing.queue)].append((timing.start_ns, timing.end_ns, [record.name]))
    return {key: sorted(boxes, key=lambda box: box[0]) for key, boxes in lanes.items()}


def merge_boxes(boxes, ns_per_px: float) -> list[tuple[float, float, list[str]]]:
    """Boxes of one lane with those closer than a pixel merged (a long kernel's thousands of instructions stay
    a few hundred boxes)."""
    merged: list[tuple[float, float, list[str]]] = []
    for start, end, names in boxes:
        if merged and start - merged[-1][1] < ns_per_px:
            first, last, joined = merged[-1]
            merged[-1] = (first, max(last, end), joined + names)
        else:
            merged.append((start, end, list(names)))
    return merged


def box_title(start: float, end: float, names: list[str]) -> str:
    counts = collections.Counter(names)
    what = ", ".join(f"{name} x{count}" if count > 1 else name for name, count in counts.most_common(4))
    more = f" and {len(counts) - 4} more kinds" if len(counts) > 4 else ""
    return f"{what}{more}: {start / 1e3:.3f} - {end / 1e3:.3f} us"


def lane_order(keys) -> list[tuple[int, str]]:
    rank = {queue: index for index, (queue, _) in enumerate(LANES)}
    return sorted(keys, key=lambda key: (key[0], rank.get(key[1], len(rank)), key[1]))


def timeline_svg(run, target=None) -> str:
    """The schedule of one launch as an SVG timeline: a lane per (core, queue), a time axis in microseconds."""
    from neuron_compile.runtime.simulator import cost

    plan = cost.launch_schedule(run.trace, target if target is not None else run.target)
    lanes = lane_boxes(run.trace, plan.timings)
    span = max(plan.makespan_ns, 1.0)
    ns_per_px = span / WIDTH
    keys = lane_order(lanes)
    cores = len({core for core, _ in keys})
    height = LANE_HEIGHT * len(keys) + 24
    parts = [f'<svg class="timeline" width="{LABEL_WIDTH + WIDTH + 50}" height="{height}" role="img" '
             f'aria-label="engine timeline">']
    for row, (core, queue) in enumerate(keys):
        y = row * LANE_HEIGHT
        label = LANE_LABELS.get(queue, queue) + (f" (core {core})" if cores > 1 else "")
        parts.append(f'<g class="lane-row" data-queue="{html.escape(queue)}"><rect class="lane" x="{LABEL_WIDTH}" '
                     f'y="{y + 2}" width="{WIDTH}" height="{LANE_HEIGHT - 4}"/>'
                     f'<text x="4" y="{y + LANE_HEIGHT - 6}">{html.escape(label)}</text>')
        for start, end, names in merge_boxes(lanes[(core, queue)], ns_per_px):
            x = LABEL_WIDTH + start / ns_per_px
            width = max(1.0, (end - start) / ns_per_px)
            title = html.escape(box_title(start, end, names))
            parts.append(f'<rect class="q-{html.escape(queue)}" x="{x:.1f}" y="{y + 3}" width="{width:.1f}" '
                         f'height="{LANE_HEIGHT - 6}"><title>{title}</title></rect>')
        parts.append("</g>")
    parts += _axis(len(keys) * LANE_HEIGHT, span)
    parts.append("</svg>")
    return "".join(parts)


def _axis(y: float, span_ns: float) -> list[str]:
    step = _tick_step(span_ns)
    parts = [f'<line class="axis" x1="{LABEL_WIDTH}" y1="{y + 2}" x2="{LABEL_WIDTH + WIDTH}" y2="{y + 2}"/>']
    tick = 0.0
    while tick <= span_ns + 1e-9:
        x = LABEL_WIDTH + tick * WIDTH / span_ns
        parts.append(f'<line class="axis" x1="{x:.1f}" y1="{y}" x2="{x:.1f}" y2="{y + 6}"/>'
                     f'<text x="{x + 2:.1f}" y="{y + 18}">{tick / 1e3:g} us</text>')
        tick += step
    return parts


def _tick_step(span_ns: float) -> float:
    """A round tick step (1, 2 or 5 times a power of ten ns) giving 5 to 10 ticks."""
    step = 1.0
    while span_ns / step > 10:
        for factor in (2.0, 2.5, 2.0):
            step *= factor
            if span_ns / step <= 10:
                break
    return step


def summary_html(observation, views: dict[str, KernelView]) -> str:
    reports = [launch.report for launch in observation.launches if launch.report is not None]
    est = sum(report.est_time_s for report in reports)
    roof = sum(report.roofline_s for report in reports)
    bound = sum(report.est_lower_bound_s for report in reports)
    launch_cost = sum(report.launch_s for report in reports)
    fallbacks = sum(observation.fallback_reasons.values())
    return (f'<p>{len(observation.launches)} kernel launch(es) of {len(views)} kernel(s) in '
            f'{len(observation.records)} ATen graph compile(s); '
            f'{sum(found.count for found in observation.graph_breaks)} graph break(s), '
            f'{fallbacks} eager ATen node(s).</p>'
            f'<table><tr><th>estimated time</th><td class="num">{us(est)}</td><td class="note">launch costs '
            f'{us(launch_cost)} + the engines\' schedules</td></tr>'
            f'<tr><th>lower bound</th><td class="num">{us(bound)}</td><td class="note">every kernel\'s engines '
            f'perfectly overlapped</td></tr>'
            f'<tr><th>roofline</th><td class="num">{us(roof)}</td><td class="note">max(FLOPs / TensorE peak, HBM bytes '
            f'/ bandwidth) per launch</td></tr></table>'
            '<p class="legend"><span><span class="swatch" style="background:#4a78c2"></span>estimated time</span>'
            '<span><span class="swatch" style="background:#e08a1e"></span>lower bound</span>'
            '<span><span class="swatch" style="background:#2a9d57"></span>roofline</span></p>')


def graphs_html(views: dict[str, KernelView]) -> str:
    """Per graph, its kernels in first-launch order with their estimated time as bars on one scale."""
    by_graph: dict[str, list[KernelView]] = collections.defaultdict(list)
    for view in views.values():
        by_graph[graph_of(view.label)].append(view)
    parts = ['<h2>Graphs: kernels in launch order</h2>']
    for graph, members in by_graph.items():
        scale = max((view.launches[0].report.est_time_s for view in members if view.launches[0].report), default=0)
        parts.append(f'<h3>{html.escape(graph)}</h3><table class="graph" data-graph="{html.escape(graph)}">'
                     '<tr><th>#</th><th>kernel</th><th>launches</th><th>est / launch</th><th></th><th>bottleneck</th>'
                     '</tr>')
        for number, view in enumerate(members, 1):
            report = view.launches[0].report
            name = view.label.split(" ")[-1]
            parts.append(f'<tr><td class="num">{number}</td><td><a href="#{anchor(view.label)}">{html.escape(name)}'
                         f'</a></td><td class="num">{len(view.launches)}</td>'
                         f'<td class="num">{us(report.est_time_s) if report else "-"}</td>'
                         f'<td>{time_bar(report, scale)}</td><td>{html.escape(report.bottleneck if report else "-")}'
                         '</td></tr>')
        parts.append('</table>')
    return "".join(parts)


def anchor(label: str) -> str:
    return "k-" + "".join(char if char.isalnum() else "-" for char in label)


def sections_html(report) -> str:
    """A region kernel's kernels, each with its span in the launch's schedule and its share of the time."""
    if len(report.sections) <= 1:
        return ""
    rows = "".join(
        f'<tr><td>{html.escape(section.name)}</td><td class="num">{us(section.start_s)}</td>'
        f'<td class="num">{us(section.end_s)}</td><td class="num">{us(section.est_time_s)}</td>'
        f'<td class="num">{us(section.lower_bound_s)}</td><td>{html.escape(section.bottleneck)}</td></tr>'
        for section in report.sections
    )
    return (f'<p>{len(report.sections)} kernels in this launch, in call order; each one\'s share is how far it '
            'pushed the end of the schedule (the rest of its time overlaps the kernels before it).</p>'
            '<table class="sections"><tr><th>kernel</th><th>starts</th><th>ends</th><th>share</th>'
            f'<th>lower bound</th><th>bottleneck</th></tr>{rows}</table>')


def kernel_html(view: KernelView) -> str:
    report = view.launches[0].report
    parts = [f'<section class="kernel" id="{anchor(view.label)}" data-kernel="{html.escape(view.label)}">'
             f'<h3>{html.escape(view.label)}</h3>']
    if report is None:
        return "".join([*parts, '<p class="note">no cost report (launched on a device)</p></section>'])
    ratio = f"{report.est_time_s / report.roofline_s:.1f}x the roofline" if report.roofline_s else "no roofline"
    parts.append(f'<p>{len(view.launches)} launch(es); first launch: estimated {us(report.est_time_s)} '
                 f'(launch {us(report.launch_s)} + schedule {us(report.device_time_s)}), lower bound '
                 f'{us(report.est_lower_bound_s)}, roofline {us(report.roofline_s)} ({ratio}); bottleneck '
                 f'<b>{html.escape(report.bottleneck)}</b>; HBM {report.hbm_bytes} bytes, {report.flops} FLOPs.</p>')
    parts.append(time_bar(report, max(report.est_time_s, report.roofline_s)))
    parts.append(sections_html(report))
    if view.run is not None and view.run.trace:
        parts.append(f'<p class="note">the schedule of the first launch ({len(view.run.trace)} instructions, '
                     f'{us(report.device_time_s)}; the launch cost is not drawn)</p>')
        parts.append(timeline_svg(view.run))
    parts.append(f'<details><summary>cost report</summary><pre>{html.escape(report.format())}</pre></details>')
    parts.append('</section>')
    return "".join(parts)


def profile_html(observation, title: str = "profile") -> str:
    """The whole page (see the module docstring)."""
    views = kernel_views(observation)
    body = [f'<h1>neuron-compile profile: {html.escape(title)}</h1>',
            '<p class="note">Times are the simulator\'s trn cost model estimates, not measurements.</p>',
            summary_html(observation, views)]
    if views:
        body.append(graphs_html(views))
        body.append('<h2>Kernels: engine timelines</h2>')
        legend = "".join(f'<span><svg width="10" height="10"><rect class="q-{queue}" width="10" height="10"/></svg> '
                         f'{html.escape(label)}</span>' for queue, label in LANES)
        body.append(f'<p class="legend">{legend}</p>')
        body += [kernel_html(view) for view in views.values()]  # in first-launch order, as the graph tables
    else:
        body.append('<p>No kernel was launched: nothing was compiled with backend="neuron", or every op ran '
                    'eagerly.</p>')
    return ('<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            f'<title>neuron-compile profile: {html.escape(title)}</title><style>{STYLE}</style></head>'
            f'<body>{"".join(body)}</body></html>\n')

"""Runtime stage (debug artifacts): the dump folder that ``NEURON_COMPILE_DUMP`` and ``neuron-compile dump`` write.

Input: the Dynamo graphs the backend received (runtime/compile_events.py), each ATen graph's compile record
(runtime/compiled_graph.py: the IR after every pass of ``pipeline.PASSES``, the partition, fusion decisions,
kernel sources), the cost reports of the kernels' first launches, and Dynamo's graph breaks and recompiles.
Output, under the dump folder (every file written atomically: temp file + rename)::

    index.txt, index.json            graphs, recompiles and graph breaks with their reasons
    graph_000/dynamo_fx.txt          the Dynamo (torch-level) FX graph, and why it ended
    graph_000/<kind>-<hash>-<sig>/   one ATen graph (forward, backward, inference) for one call signature:
        aten_graph.txt               after decompositions, specialized to the signature
        passes/NN-<pass>[.<region>].txt   the output of every pass, in order
        partition.txt                NKI regions and eager ops with their reasons, the partitioned graph
        fusion.txt                   per region, the fusion groups and why others were not fused
        tile_plans.txt               per kernel, its tile plan
        kernels/<region>.<kernel>.py each kernel as a standalone module: ``neuron-compile simulate --report``
                                     runs it on made-up inputs of its parameters' sizes and dtypes
        costs.txt                    each kernel's cost report from its first launch
        record.txt                   all of the above in one file
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile

KERNEL_MAIN = '''

if __name__ == "__main__":
    # A standalone launch on made-up inputs (floats: standard normal; integers and bools: zeros), one flat HBM
    # tensor per parameter as the compiled graph passes them: `neuron-compile simulate --report {file}`.
    import numpy as np

    rng = np.random.default_rng(0)
    arguments = [
{arguments}
    ]
    outputs = {name}(*arguments)
    outputs = outputs if isinstance(outputs, (tuple, list)) else [outputs]
    print("{name}:", ", ".join(f"{{np.asarray(out).dtype}}{{list(np.asarray(out).shape)}}" for out in outputs))
'''


def write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically (a reader never sees half a file), creating its folder."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=folder, delete=False, suffix=".tmp") as handle:
        handle.write(text)
    os.replace(handle.name, path)


def safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "_"


def dynamo_folder(dump_dir: str, dynamo_graph: int) -> str:
    return os.path.join(dump_dir, f"graph_{dynamo_graph:03d}" if dynamo_graph >= 0 else "graph_unknown")


def record_folder(dump_dir: str, record) -> str:
    """The folder of one ATen graph compile: under its Dynamo graph, by kind, graph hash and signature."""
    signature = hashlib.sha256(repr(record.key).encode()).hexdigest()[:12]
    name = f"{record.kind}-{record.key.graph_hash}-{signature}"
    return os.path.join(dynamo_folder(dump_dir, record.dynamo_graph), name)


def write_dynamo_graph(dump_dir: str, event) -> str:
    ending = "a graph break" if event.graph_break else "the end of the frame"
    lines = [f"# Dynamo graph {event.index} (compile id {event.compile_id}), ended by {ending}"]
    if event.reason:
        lines.append(f"# reason: {event.reason}")
    if event.source is not None:
        lines.append(f"# at {event.source}")
    path = os.path.join(dynamo_folder(dump_dir, event.index), "dynamo_fx.txt")
    write_text(path, "\n".join(lines) + "\n" + event.fx_graph.strip() + "\n")
    return path


def standalone_kernel(kernel) -> str:
    """A kernel's source plus a ``__main__`` block that launches it on made-up inputs of its parameters'
    sizes and dtypes (``kernel.parameters``: (name, elements, dtype) per parameter)."""
    lines = []
    for name, elements, dtype in kernel.parameters:
        if dtype in ("float32", "bfloat16"):
            value = f"rng.standard_normal({elements}).astype(np.float32)"
            value += ".astype(nl.bfloat16)" if dtype == "bfloat16" else ""
        else:
            value = f"np.zeros({elements}, dtype=np.{'uint8' if dtype == 'bool' else dtype})"
        lines.append(f"        {value},  # {name}: {dtype}[{elements}]")
    file = f"{safe_name(kernel.region)}.{safe_name(kernel.name)}.py"
    return kernel.source.rstrip() + "\n" + KERNEL_MAIN.format(arguments="\n".join(lines), name=kernel.name, file=file)


def _pass_files(record) -> dict[str, str]:
    files = {}
    for number, (name, region, text) in enumerate(record.pass_dumps):
        suffix = f".{safe_name(region)}" if region else ""
        files[f"passes/{number:02d}-{safe_name(name)}{suffix}.txt"] = text.rstrip() + "\n"
    return files


def _section(title: str, body: str) -> str:
    return f"== {title} ==\n{body.rstrip()}\n"


def record_files(record) -> dict[str, str]:
    """The files of one ATen graph's folder, by relative path (costs.txt is written at the first launch)."""
    partition = [_section("partition (NKI regions, eager ops with reasons)", str(record.report)),
                 _section("partitioned graph", record.partitioned_graph)]
    if record.failures:
        partition.append(_section("regions that fell back to eager", "\n".join(record.failures)))
    # The fuse pass's output: its decisions (what fused, and why the rest did not), then the fused kernels.
    fusion = [_section(f"fusion groups and decisions ({region})", text)
              for name, region, text in record.pass_dumps if name == "fuse"]
    fusion = fusion or [_section(f"fusion decisions ({region})", "\n".join(decisions))
                        for region, decisions in record.fusion_decisions.items()]
    plans = [_section(f"tile plans ({region})", text)
             for name, region, text in record.pass_dumps if name == "plan tiles"]
    files = {
        "aten_graph.txt": record.aten_graph.rstrip() + "\n",
        "partition.txt": "\n".join(partition),
        "fusion.txt": "\n".join(fusion) or "(no NKI region)\n",
        "tile_plans.txt": "\n".join(plans) or "(no NKI region)\n",
        "record.txt": str(record) + "\n",
        **_pass_files(record),
    }
    for kernel in [*record.kernels, *record.region_kernels]:
        files[f"kernels/{safe_name(kernel.region)}.{safe_name(kernel.name)}.py"] = standalone_kernel(kernel)
    return files


def write_record(dump_dir: str, record) -> str:
    """Write one ATen graph's folder; returns it."""
    folder = record_folder(dump_dir, record)
    for relative, text in record_files(record).items():
        write_text(os.path.join(folder, relative), text)
    return folder


def format_cost_line(name: str, report) -> str:
    return (f"{name}: est {report.est_time_s * 1e6:.2f} us (lower bound {report.est_lower_bound_s * 1e6:.2f} us, "
            f"roofline {report.roofline_s * 1e6:.2f} us), bottleneck {report.bottleneck}")


def write_costs(dump_dir: str, record, reports: dict[str, object]) -> str:
    """Write (or extend) the graph's costs.txt with the cost report of each kernel in ``reports`` (name ->
    CostReport, from one launch)."""
    path = os.path.join(record_folder(dump_dir, record), "costs.txt")
    existing = open(path).read() if os.path.exists(path) else ""
    blocks = [existing.rstrip()] if existing else []
    for name, report in reports.items():
        if report is not None:
            blocks.append(f"== {format_cost_line(name, report)}\n{report.format()}")
    write_text(path, "\n".join(blocks) + "\n")
    return path


def index_data(events, records, graph_breaks, recompiles, dump_dir: str, names: dict | None = None) -> dict:
    """The index as JSON-ready data: Dynamo graphs with their ATen graphs, recompiles, graph breaks (``names``:
    compile id -> the compiled function's name, where Dynamo's metrics know it better than the graph)."""
    graphs = []
    for event in events:
        aten = [record for record in records if record.dynamo_graph == event.index]
        graphs.append({
            "index": event.index, "compile_id": event.compile_id,
            "function": (names or {}).get(event.compile_id, event.function),
            "folder": os.path.relpath(dynamo_folder(dump_dir, event.index), dump_dir),
            "ended_by": "graph break" if event.graph_break else "end of frame", "reason": event.reason,
            "source": str(event.source) if event.source else None,
            "aten_graphs": [{
                "kind": record.kind, "graph_hash": record.key.graph_hash,
                "folder": os.path.relpath(record_folder(dump_dir, record), dump_dir),
                "nki_regions": len(record.report.regions), "eager_ops": len(record.report.eager),
                "kernels": [f"{kernel.region}.{kernel.name}" for kernel in record.kernels],
                "region_kernels": [f"{kernel.region}.{kernel.name}" for kernel in record.region_kernels],
                "failures": list(record.failures),
            } for record in aten],
        })
    return {
        "graphs": graphs,
        "recompiles": [{"compile_id": r.compile_id, "function": r.function, "location": r.location,
                        "guard": r.guard} for r in recompiles],
        "graph_breaks": [{"reason": b.reason, "source": str(b.source) if b.source else None, "count": b.count}
                         for b in graph_breaks],
    }


def index_text(data: dict) -> str:
    lines = [f"{len(data['graphs'])} Dynamo graph(s)"]
    for graph in data["graphs"]:
        lines.append(f"  {graph['folder']}: {graph['function']} (compile id {graph['compile_id']}), "
                     f"ended by {graph['ended_by']}" + (f" at {graph['source']}" if graph["source"] else ""))
        for aten in graph["aten_graphs"]:
            lines.append(f"    {aten['folder']}: {aten['kind']}, {aten['nki_regions']} NKI region(s), "
                         f"{aten['eager_ops']} eager op(s), {len(aten['kernels'])} kernel(s)")
    lines.append(f"{len(data['recompiles'])} recompile(s)")
    lines += [f"  {r['compile_id']} {r['function']} ({r['location']}): guard failed: {r['guard']}"
              for r in data["recompiles"]]
    breaks = data["graph_breaks"]
    lines.append(f"{sum(b['count'] for b in breaks)} graph break(s) at {len(breaks)} place(s)")
    lines += [f"  {b['source'] or '(unknown line)'} ({b['count']}x): {b['reason']}" for b in data["graph_breaks"]]
    return "\n".join(lines) + "\n"


def write_index(dump_dir: str, data: dict) -> str:
    write_text(os.path.join(dump_dir, "index.json"), json.dumps(data, indent=1) + "\n")
    path = os.path.join(dump_dir, "index.txt")
    write_text(path, index_text(data))
    return path

"""Our stages in torch's structured trace: a script run with TORCH_TRACE (a new process: torch sets the trace up
when it is imported) logs, under the Dynamo compile id, one artifact per file of the dump folder (ATen graph,
passes, partition, fusion, tile plans, kernel sources, costs) — what tlparse renders next to Dynamo's graphs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import torch

    def f(x, w):
        return torch.relu(x @ w) + 1.0

    x, w = torch.randn(8, 16), torch.randn(16, 32)
    torch.testing.assert_close(torch.compile(f, backend="neuron")(x, w), f(x, w))
    """
)


def test_torch_trace_holds_our_stages_under_the_dynamo_compile_id(tmp_path):
    script = tmp_path / "traced.py"
    script.write_text(SCRIPT)
    trace_dir = tmp_path / "trace"
    environ = {**os.environ, "TORCH_TRACE": str(trace_dir)}
    completed = subprocess.run([sys.executable, str(script)], env=environ, capture_output=True, text=True,
                               timeout=300, check=False)
    assert completed.returncode == 0, completed.stderr
    artifacts = {}
    for log in trace_dir.iterdir():
        for line in log.read_text().splitlines():  # "<glog prefix>] {metadata}", then payload lines that start "\t"
            if line.startswith("\t") or "] {" not in line:
                continue
            record = json.loads(line.split("] ", 1)[1])
            name = record.get("artifact", {}).get("name", "")
            if name.startswith("neuron_compile_"):
                artifacts[name] = (record.get("frame_id"), record.get("frame_compile_id"), record.get("attempt"))
    names = set(artifacts)
    expected = {
        "neuron_compile_inference_aten_graph", "neuron_compile_inference_partition", "neuron_compile_inference_fusion",
        "neuron_compile_inference_tile_plans", "neuron_compile_inference_passes_05-lower.nki_region_0",
        "neuron_compile_inference_passes_09-render.nki_region_0",
        "neuron_compile_inference_kernels_nki_region_0.matmul_kernel_0.py",
        "neuron_compile_inference_costs.nki_region_0",
    }
    assert expected <= names, sorted(names)
    # frame 0, its first compile, attempt 0: where tlparse files Dynamo's own graph of that frame
    assert set(artifacts.values()) == {(0, 0, 0)}

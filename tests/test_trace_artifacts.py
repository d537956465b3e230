"""Our stages in torch's structured trace: a script run with TORCH_TRACE (a new process: torch sets the trace up
when it is imported) logs, under the Dynamo compile id, one artifact per file of the dump folder (ATen graph,
passes, partition, fusion, tile plans, kernel sources, costs) — what tlparse renders next to Dynamo's graphs, which
tlparse itself (the test extra; skipped where it is not installed) shows under the frame's compile."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent(
    """
    import torch

    def f(x, w):
        return torch.relu(x @ w) + 1.0

    x, w = torch.randn(8, 16), torch.randn(16, 32)
    torch.testing.assert_close(torch.compile(f, backend="neuron")(x, w), f(x, w))
    """
)


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("traced")
    script = folder / "traced.py"
    script.write_text(SCRIPT)
    environ = {**os.environ, "TORCH_TRACE": str(folder / "trace")}
    completed = subprocess.run([sys.executable, str(script)], env=environ, capture_output=True, text=True,
                               timeout=300, check=False)
    assert completed.returncode == 0, completed.stderr
    return folder / "trace"


EXPECTED = {
    "neuron_compile_inference_aten_graph", "neuron_compile_inference_partition", "neuron_compile_inference_fusion",
    "neuron_compile_inference_tile_plans", "neuron_compile_inference_passes_07-lower.nki_region_0",
    "neuron_compile_inference_passes_11-render.nki_region_0",
    "neuron_compile_inference_kernels_nki_region_0.matmul_kernel_0.py",
    "neuron_compile_inference_costs.nki_region_0",
}


def test_torch_trace_holds_our_stages_under_the_dynamo_compile_id(trace_dir):
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
    assert EXPECTED <= names, sorted(names)
    # frame 0, its first compile, attempt 0: where tlparse files Dynamo's own graph of that frame
    assert set(artifacts.values()) == {(0, 0, 0)}


TLPARSE = shutil.which("tlparse") or shutil.which("tlparse", path=str(Path(sys.executable).parent))


@pytest.mark.skipif(TLPARSE is None, reason="tlparse is not installed (pip install tlparse: the test extra)")
def test_tlparse_shows_our_stages_beside_dynamos_graph(trace_dir, tmp_path):
    out = tmp_path / "tlparse"
    completed = subprocess.run([TLPARSE, *map(str, trace_dir.iterdir()), "-o", str(out), "--no-browser"],
                               capture_output=True, text=True, timeout=120, check=False)
    assert completed.returncode == 0, completed.stderr
    # tlparse files each artifact of frame 0's first compile in its folder, "<name>_<index>.txt", beside Dynamo's
    shown = {path.stem.rsplit("_", 1)[0] for path in (out / "-_0_0_0").iterdir()}
    assert EXPECTED <= shown and "dynamo_output_graph" in shown, sorted(shown)
    index = (out / "index.html").read_text()
    assert all(f"-_0_0_0/{name}_" in index for name in EXPECTED)

"""bench/diffusers_pipeline_bench.py in a subprocess (bench scripts are never imported by tests): whole tiny Flux and
LTX pipelines (text encoders, 2 denoising steps, VAE decode) with the transformer's blocks and the VAE decoder
compiled by our backend give eager's latents and pixels within the dtype's tolerance, compile as many graphs as the
pass-through backend, and run every ATen node in NKI kernels. Slow: two fresh processes per row, each building
the pipeline and compiling it (about a minute)."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def bench_row(pipeline: str, dtype: str) -> list[str]:
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "diffusers_pipeline_bench.py"), "--pipelines",
                             pipeline, "--dtypes", dtype], cwd=ROOT, env=environment, capture_output=True, text=True,
                            timeout=1200)
    assert result.returncode == 0, result.stdout + result.stderr
    (row,) = [line for line in result.stdout.splitlines() if line.startswith(f"| {pipeline} | {dtype} |")]
    return [cell.strip() for cell in row.strip("|").split("|")]


@pytest.mark.slow
@pytest.mark.parametrize("pipeline", ["flux", "ltx"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_pipeline_gives_eager_image_with_every_node_in_kernels(pipeline, dtype):
    pytest.importorskip("diffusers")
    cells = bench_row(pipeline, dtype)
    assert cells[3] == "yes", cells  # latents and pixels within the dtype's tolerance of eager's
    ours, pass_through = cells[4].split("/")
    assert ours == pass_through, cells  # no graph beyond what Dynamo hands a pass-through backend
    nki, eager = cells[5].split("/")
    assert int(nki) > 300 and eager == "0" and cells[7] == "none", cells

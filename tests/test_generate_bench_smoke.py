"""bench/generate_bench.py in a subprocess (bench scripts are never imported by tests): one tiny Llama row of 3 new
tokens prints tokens equal, one compile, every compiled step and no eager node. Slow: a model build, an eager and a
compiled generation in a fresh process."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_generate_bench_quick_row():
    pytest.importorskip("transformers")
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "generate_bench.py"), "--quick", "--archs", "llama",
                             "--tokens", "3"], cwd=ROOT, env=environment, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    (row,) = [line for line in result.stdout.splitlines() if line.startswith("| llama (tiny, fp32) |")]
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[1:4] == ["yes", "1 / 1", "2 of 2"], row  # tokens equal, one compile, both decode steps compiled
    kernels, launches = cells[4].split()
    assert int(kernels) > 1 and launches == "(1)" and cells[5] == "0", row  # one launch per step, no eager node

"""bench/kernel_bench.py --smoke in a subprocess (bench scripts are never imported by tests): the Inductor byte
hook gives 8 MiB for (x + 1) * 2 on a 1024x1024 fp32 tensor, and a tiny MLP goes through our side fused and
unfused and through Inductor's scheduler with sane figures."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_kernel_bench_smoke():
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "kernel_bench.py"), "--smoke"], cwd=ROOT,
                            env=environment, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "8,388,608 bytes (want 8,388,608 = 8 MiB), 1 generated + 0 extern kernels (want 1 + 0): ok" in result.stdout
    assert "| mlp | 128 | fp32 | 128 |" in result.stdout
    assert result.stdout.rstrip().endswith("smoke: ok"), result.stdout

"""Benchmark: wall time of the NKI simulator against plain numpy doing the same math, in the same run.

Cases: a 2048^3 bf16 tiled matmul (neuron_compile.demo_kernels.matmul_kernel) and a 4096x4096 fp32 row
softmax (demo_kernels.softmax_kernel). numpy does the same arithmetic the kernel asks for (fp32 math on the
bf16 inputs, the output rounded to bf16; the softmax's max / exp / sum / reciprocal / multiply). Each
simulator output is checked against numpy before it is timed. Prints one table: name, simulator seconds,
numpy seconds, their ratio, and the cost model's estimated device time. The goal is a ratio under 3.

    python bench/simulator_bench.py [--repeat N] [--blas-threads N] [--profile] [--results bench/RESULTS.md]

``--blas-threads`` pins OpenBLAS/OpenMP threads (it must be applied before numpy is imported, hence the early
argv scan): the simulator issues one small matmul per 128x128x512 tile, and a multithreaded BLAS on an
oversubscribed machine makes those much slower than one big numpy matmul. ``--profile`` adds the simulator's
top functions by own time (cProfile). ``--results`` writes the table and the command that produced it into the
"Simulator vs numpy" section of that markdown file, replacing the block of the same command and leaving the
others (and the file's other sections) alone.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import re
import sys
import time
from collections.abc import Callable


def _pin_blas_threads(argv: list[str]) -> None:
    for i, arg in enumerate(argv):
        value = arg.split("=", 1)[1] if arg.startswith("--blas-threads=") else None
        if arg == "--blas-threads" and i + 1 < len(argv):
            value = argv[i + 1]
        if value is not None:
            for variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
                os.environ[variable] = value


_pin_blas_threads(sys.argv[1:])

import ml_dtypes  # noqa: E402 - after the BLAS thread pinning
import numpy as np  # noqa: E402

from neuron_compile.demo_kernels import matmul_kernel, numpy_softmax, softmax_kernel  # noqa: E402
from neuron_compile.runtime import simulator  # noqa: E402

SECTION = "## Simulator vs numpy"
NOTE = (
    "Wall time, best of the runs, numpy and the simulator in the same process; \"est. device time\" is the cost "
    "model's estimate for trn2. numpy does the matmul as one 2048^3 GEMM, the simulator as 1024 tile GEMMs of "
    "128x128x512: on a machine with more runnable threads than cores, multithreaded BLAS slows the small GEMMs "
    "far more than the big one, so compare with `--blas-threads 1` there."
)


def numpy_matmul(lhsT: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    return (lhsT.astype(np.float32).T @ rhs.astype(np.float32)).astype(ml_dtypes.bfloat16)


def cases(rng: np.random.Generator) -> list[tuple[str, object, tuple, Callable, float]]:
    lhsT = rng.standard_normal((2048, 2048), dtype=np.float32).astype(ml_dtypes.bfloat16)
    rhs = rng.standard_normal((2048, 2048), dtype=np.float32).astype(ml_dtypes.bfloat16)
    x = rng.standard_normal((4096, 4096), dtype=np.float32)
    return [
        # bf16 output: numpy and the kernel may round a value to neighbouring bf16 numbers (one ulp, 2^-7)
        ("matmul 2048^3 bf16", matmul_kernel, (lhsT, rhs), numpy_matmul, 2**-7),
        ("softmax 4096x4096 fp32", softmax_kernel, (x,), numpy_softmax, 1e-5),
    ]


def best_time(fn: Callable[[], object], repeat: int) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def first_output(run) -> np.ndarray:
    outputs = run.outputs
    return np.asarray(outputs[0] if isinstance(outputs, (tuple, list)) else outputs)


def check(name: str, got: np.ndarray, want: np.ndarray, tolerance: float) -> None:
    got, want = got.astype(np.float32), want.astype(np.float32)
    error = float(np.max(np.abs(got - want) / (1.0 + np.abs(want))))
    if error > tolerance:
        raise SystemExit(f"{name}: simulator output differs from numpy by {error:.3e} (tolerance {tolerance:.0e})")


def profile_text(fn: Callable[[], object], top: int = 15) -> str:
    profiler = cProfile.Profile()
    profiler.runcall(fn)
    stream = io.StringIO()
    pstats.Stats(profiler, stream=stream).strip_dirs().sort_stats("tottime").print_stats(top)
    return stream.getvalue()


def format_table(rows: list[tuple[str, float, float, float]]) -> str:
    lines = [
        "| case | simulator s | numpy s | ratio | est. device time |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, sim_s, numpy_s, est_s in rows:
        lines.append(f"| {name} | {sim_s:.3f} | {numpy_s:.3f} | {sim_s / numpy_s:.1f}x | {est_s * 1e6:.1f} us |")
    return "\n".join(lines)


def write_results(path: str, table: str, command: str) -> None:
    """Put ``table`` under its ``command`` in the "Simulator vs numpy" section of ``path``: the block of the
    same command is replaced, other commands' blocks and other sections are kept."""
    try:
        with open(path) as file:
            text = file.read()
    except FileNotFoundError:
        text = "# Benchmark results\n"
    section = re.compile(rf"^{re.escape(SECTION)}\n(.*?)(?=^## |\Z)", re.S | re.M)
    found = section.search(text)
    blocks = dict(re.findall(r"^Command: `([^`]*)`\n\n(.*?)(?=^Command: |\Z)", found.group(1), re.S | re.M)
                  ) if found else {}  # the note above the blocks is not in any block, and is rewritten
    blocks[command] = table + "\n"
    body = "".join(f"Command: `{cmd}`\n\n{block.strip()}\n\n" for cmd, block in blocks.items())
    new_section = f"{SECTION}\n\n{NOTE}\n\n{body}"
    if found:
        text = text[: found.start()] + new_section + text[found.end():]
    else:
        text = text.rstrip("\n") + "\n\n" + new_section
    with open(path, "w") as file:
        file.write(text.rstrip("\n") + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per timing; the best is kept")
    parser.add_argument("--blas-threads", help="OpenBLAS/OpenMP threads for numpy and the simulator alike")
    parser.add_argument("--profile", action="store_true", help="print where the simulator's time goes")
    parser.add_argument("--results", help="markdown file whose 'Simulator vs numpy' section to rewrite")
    args = parser.parse_args(argv)

    rows, profiles = [], []
    for name, kernel, inputs, reference, tolerance in cases(np.random.default_rng(0)):
        numpy_s, want = best_time(lambda: reference(*inputs), args.repeat)
        sim_s, run = best_time(lambda: simulator.run_kernel(kernel, inputs), args.repeat)
        check(name, first_output(run), want, tolerance)
        rows.append((name, sim_s, numpy_s, run.report.est_time_s))
        if args.profile:
            profiles.append(f"--- {name}: simulator, top functions by own time\n"
                            + profile_text(lambda: simulator.run_kernel(kernel, inputs)))
    table = format_table(rows)
    print(table)
    for text in profiles:
        print(text)
    if args.results:
        command = "python bench/simulator_bench.py" + (f" --repeat {args.repeat}" if args.repeat != 3 else "")
        command += f" --blas-threads {args.blas_threads}" if args.blas_threads else ""
        write_results(args.results, table, command)
    return 0


if __name__ == "__main__":
    sys.exit(main())

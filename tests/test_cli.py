"""`neuron-compile simulate`: a tutorial-style NKI script (plain `import nki`) written to tmp_path runs
unchanged on the simulator, in-process through main() and as the installed console script; its printed
result is checked against numpy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from neuron_compile import cli
from neuron_compile.runtime import simulator

# Written against the public NKI docs only: nothing here knows about neuron_compile.
ADD_SCRIPT = textwrap.dedent(
    """
    import json
    import sys

    import numpy as np

    import nki
    import nki.isa as nisa
    import nki.language as nl


    @nki.jit
    def add_kernel(a, b):
        rows, cols = a.shape
        out = nl.ndarray((rows, cols), dtype=a.dtype, buffer=nl.shared_hbm)
        for r in nl.affine_range(rows // 128):
            a_tile = nl.ndarray((128, cols), dtype=a.dtype, buffer=nl.sbuf)
            b_tile = nl.ndarray((128, cols), dtype=b.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=a_tile, src=a[r * 128:(r + 1) * 128, :])
            nisa.dma_copy(dst=b_tile, src=b[r * 128:(r + 1) * 128, :])
            sum_tile = nl.ndarray((128, cols), dtype=a.dtype, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=sum_tile, data1=a_tile, data2=b_tile, op=nl.add)
            nisa.dma_copy(dst=out[r * 128:(r + 1) * 128, :], src=sum_tile)
        return out


    rows, cols, seed = (int(arg) for arg in sys.argv[1:4])
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((rows, cols), dtype=np.float32)
    b = rng.standard_normal((rows, cols), dtype=np.float32)
    print(json.dumps(np.asarray(add_kernel(a, b)).tolist()))
    """
)


# The public docs' quick-start shape: nl.load / nl.add / nl.store wrappers, launched through nki.simulate.
WRAPPER_SCRIPT = textwrap.dedent(
    """
    import json
    import sys

    import numpy as np

    import nki
    import nki.language as nl


    @nki.jit
    def add_kernel(a_ptr, b_ptr):
        a = nl.load(a_ptr)
        b = nl.load(b_ptr)
        out = nl.ndarray(a_ptr.shape, dtype=a_ptr.dtype, buffer=nl.shared_hbm)
        nl.store(out, value=nl.add(a, b))
        return out


    rows, cols, seed = (int(arg) for arg in sys.argv[1:4])
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((rows, cols), dtype=np.float32)
    b = rng.standard_normal((rows, cols), dtype=np.float32)
    print(json.dumps(np.asarray(nki.simulate(add_kernel)(a, b)).tolist()))
    """
)


def expected_sum(rows: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((rows, cols), dtype=np.float32)
    b = rng.standard_normal((rows, cols), dtype=np.float32)
    return a + b


@pytest.fixture
def add_script(tmp_path):
    path = tmp_path / "add_kernel.py"
    path.write_text(ADD_SCRIPT)
    return str(path)


def first_line_array(stdout: str) -> np.ndarray:
    return np.array(json.loads(stdout.splitlines()[0]), dtype=np.float32)


def test_simulate_runs_script_unchanged_and_prints_nothing_extra(add_script, capsys):
    nki_before = sys.modules.get("nki")
    argv_before, path_before = sys.argv[:], sys.path[:]
    hooks_before = list(simulator.launch_hooks)

    assert cli.main(["simulate", add_script, "256", "64", "3"]) == 0

    stdout = capsys.readouterr().out
    assert len(stdout.splitlines()) == 1  # only the script's own print
    np.testing.assert_array_equal(first_line_array(stdout), expected_sum(256, 64, 3))  # fp32 add is exact
    # nothing left behind: argv, sys.path, the nki alias and the report hook are all restored
    assert (sys.argv, sys.path) == (argv_before, path_before)
    assert sys.modules.get("nki") is nki_before
    assert simulator.launch_hooks == hooks_before


def test_simulate_report_prints_each_launch(add_script, capsys):
    target_before = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE")
    assert cli.main(["simulate", "--report", "--target", "trn1", add_script, "256", "512", "1"]) == 0
    stdout = capsys.readouterr().out
    np.testing.assert_array_equal(first_line_array(stdout), expected_sum(256, 512, 1))
    report = stdout.split("\n", 1)[1]
    assert report.startswith("== launch 1\ncost report (trn1): 8 instructions")  # 2 row tiles x (3 DMAs + 1 add)
    assert "HBM read 1.00 MiB, written 0.50 MiB" in report  # a and b read, the sum written: 256 x 512 fp32 each
    assert os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE") == target_before  # --target only for the run


def test_simulate_runs_language_wrapper_script(tmp_path, capsys):
    script = tmp_path / "quickstart.py"
    script.write_text(WRAPPER_SCRIPT)
    assert cli.main(["simulate", "--report", str(script), "128", "40", "5"]) == 0
    stdout = capsys.readouterr().out
    np.testing.assert_array_equal(first_line_array(stdout), expected_sum(128, 40, 5))
    assert "== launch 1\ncost report (" in stdout


def test_simulate_report_totals_several_launches(tmp_path, capsys):
    script = tmp_path / "twice.py"
    script.write_text(ADD_SCRIPT.replace("print(json.dumps(", "add_kernel(a, b)\nprint(json.dumps("))
    assert cli.main(["simulate", "--report", str(script), "128", "16", "0"]) == 0
    stdout = capsys.readouterr().out
    assert "== launch 2" in stdout
    assert "== total of 2 launches" in stdout and "2 launches" in stdout


def test_script_imports_its_sibling_modules(tmp_path, capsys):
    (tmp_path / "kernels.py").write_text(ADD_SCRIPT.split("rows, cols, seed")[0])  # the kernel, as a module
    script = tmp_path / "main.py"
    script.write_text(
        "import json, sys\nimport numpy as np\nfrom kernels import add_kernel\n"
        "a = np.arange(128 * 8, dtype=np.float32).reshape(128, 8)\n"
        "print(json.dumps(np.asarray(add_kernel(a, a)).tolist()))\n"
    )
    assert cli.main(["simulate", "--force-simulator", str(script)]) == 0
    a = np.arange(128 * 8, dtype=np.float32).reshape(128, 8)
    np.testing.assert_array_equal(first_line_array(capsys.readouterr().out), a + a)
    assert "kernels" not in sys.modules  # the script's own modules do not outlive the run


def test_script_exit_status_is_returned(tmp_path, capsys):
    script = tmp_path / "exits.py"
    script.write_text("import sys\nprint(sys.argv[1:])\nsys.exit(int(sys.argv[1]))\n")
    assert cli.main(["simulate", str(script), "3", "--not-an-option-of-ours"]) == 3
    assert capsys.readouterr().out == "['3', '--not-an-option-of-ours']\n"


def test_missing_script_names_the_path(tmp_path, capsys):
    missing = tmp_path / "nope.py"
    assert cli.main(["simulate", str(missing)]) == 2
    assert f"no such script: {missing}" in capsys.readouterr().err


def test_no_subcommand_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([])
    assert exit_info.value.code == 2
    assert "COMMAND" in capsys.readouterr().err


def test_console_script_subprocess(add_script):
    console_script = os.path.join(os.path.dirname(sys.executable), "neuron-compile")
    if not os.path.exists(console_script):
        pytest.skip(f"console script not installed next to {sys.executable}")
    completed = subprocess.run(
        [console_script, "simulate", "--report", add_script, "128", "48", "7"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert completed.returncode == 0, completed.stderr
    np.testing.assert_array_equal(first_line_array(completed.stdout), expected_sum(128, 48, 7))
    assert "cost report" in completed.stdout

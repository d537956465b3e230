"""The ``neuron-compile`` command. Input: a command line; output: the subcommand's effect and exit status.

Subcommands:

``neuron-compile simulate [--report] [--target T] SCRIPT.py [ARGS...]``
    Run SCRIPT.py as ``__main__`` with ``sys.argv = [SCRIPT.py, *ARGS]``, on the built-in NKI simulator: when
    the real ``nki`` package is not importable (or with ``--force-simulator``), ``import nki`` inside the
    script resolves to ``neuron_compile.runtime.simulator``, so a kernel written against the public NKI docs
    runs unchanged. Prints nothing of its own unless ``--report`` is given; then, after the script, the cost
    report of every kernel it launched (and their total when there are several).

Each subcommand is one ``register_<name>(subparsers)`` function that adds its parser and sets ``handler``;
adding one (dump, explain, cache) means writing that function and listing it in ``SUBCOMMANDS``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import runpy
import sys
from collections.abc import Callable, Iterator, Sequence


def register_simulate(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "simulate",
        help="run an NKI kernel script on the built-in simulator",
        description="Run SCRIPT.py as __main__ with `import nki` bound to the built-in NKI simulator.",
    )
    parser.add_argument("--report", action="store_true", help="print the cost report of every kernel launched")
    parser.add_argument("--target", help="trn1 | trn2 | trn3 (sets NEURON_PLATFORM_TARGET_OVERRIDE for the run)")
    parser.add_argument(
        "--force-simulator", action="store_true", help="use the simulator even if the real nki is installed"
    )
    parser.add_argument("script", help="the Python script to run")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    parser.set_defaults(handler=run_simulate)


SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [register_simulate]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="neuron-compile", description="neuron_compile tools")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for register in SUBCOMMANDS:
        register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


# ---------------------------------------------------------------------------------------------------------
# simulate
# ---------------------------------------------------------------------------------------------------------


def real_nki_available() -> bool:
    return importlib.util.find_spec("nki") is not None


@contextlib.contextmanager
def _script_environment(script: str, script_args: Sequence[str], target: str | None) -> Iterator[None]:
    """sys.argv, sys.path[0] and the target override as ``python SCRIPT.py ARGS`` would see them, restored
    afterwards so that ``main`` can be called repeatedly in one process (tests do)."""
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    saved_target = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE")
    modules_before = set(sys.modules)
    script_dir = os.path.dirname(os.path.abspath(script))
    sys.argv = [script, *script_args]
    sys.path.insert(0, script_dir)
    if target:
        os.environ["NEURON_PLATFORM_TARGET_OVERRIDE"] = target
    try:
        yield
    finally:
        sys.argv[:] = saved_argv
        sys.path[:] = saved_path
        if saved_target is None:
            os.environ.pop("NEURON_PLATFORM_TARGET_OVERRIDE", None)
        else:
            os.environ["NEURON_PLATFORM_TARGET_OVERRIDE"] = saved_target
        _forget_script_modules(script_dir, set(sys.modules) - modules_before)


def _forget_script_modules(script_dir: str, new_modules: set[str]) -> None:
    """Drop the modules the script imported from its own directory, so that a second run in this process
    (main() called again) imports the script's siblings afresh instead of reusing stale ones."""
    for name in new_modules:
        path = getattr(sys.modules.get(name), "__file__", None) or ""
        if os.path.abspath(path).startswith(script_dir + os.sep):
            del sys.modules[name]


@contextlib.contextmanager
def _collect_launches(simulator, runs: list) -> Iterator[None]:
    simulator.launch_hooks.append(runs.append)
    try:
        yield
    finally:
        simulator.launch_hooks.remove(runs.append)


def _launch_title(run, index: int) -> str:
    name = getattr(run, "kernel_name", None) or getattr(run, "name", None)
    return f"== launch {index}: {name}" if isinstance(name, str) and name else f"== launch {index}"


def format_launch_reports(runs: Sequence) -> str:
    """The cost report of each launch, then the total of all of them."""
    from neuron_compile.runtime.simulator import cost

    reports = [run.report for run in runs]
    blocks = [f"{_launch_title(run, i + 1)}\n{report.format()}" for i, (run, report) in enumerate(zip(runs, reports))]
    if len(reports) > 1:
        blocks.append(f"== total of {len(reports)} launches\n{cost.sum_reports(reports).format()}")
    if not reports:
        blocks.append("== no kernel was launched")
    return "\n".join(blocks)


def run_simulate(args: argparse.Namespace) -> int:
    if not os.path.isfile(args.script):
        print(f"neuron-compile simulate: no such script: {args.script}", file=sys.stderr)
        return 2
    from neuron_compile.runtime import simulator

    use_simulator = args.force_simulator or not real_nki_available()
    runs: list = []
    status = 0
    with contextlib.ExitStack() as stack:
        stack.enter_context(_script_environment(args.script, args.script_args, args.target))
        if use_simulator:
            stack.enter_context(simulator.nki_import_alias())
        if args.report:
            stack.enter_context(_collect_launches(simulator, runs))
        try:
            runpy.run_path(args.script, run_name="__main__")
        except SystemExit as exit_request:  # the script's own sys.exit(): keep its status, still report
            status = _exit_status(exit_request.code)
    if args.report:
        sys.stdout.flush()
        print(format_launch_reports(runs))
    return status


def _exit_status(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # sys.exit("message") prints the message and exits 1, as Python does
    return 1


if __name__ == "__main__":
    sys.exit(main())

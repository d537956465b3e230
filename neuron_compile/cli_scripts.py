"""CLI stage: the ``neuron-compile`` subcommands that run a user's torch script and report on its compiles.

Input: a parsed command line (``SCRIPT.py [ARGS]`` plus our options). Output: the report, and the exit status:
the script's own (1 when it raised, with its traceback shown), or 2 for a usage error (no such script, a bad
``NEURON_COMPILE_*`` value, an output path that cannot be used), each message saying what to do.

``dump SCRIPT.py [ARGS] --out DIR``
    Run the script with ``NEURON_COMPILE_DUMP=DIR``: every stage of every graph, and an index (runtime/dump.py).
``explain SCRIPT.py [ARGS]``
    Run the script and print graph breaks, recompiles, eager fallbacks and kernels by time (explain.py).
``profile SCRIPT.py [ARGS] --out report.html``
    Run the script and write one self-contained HTML page: per kernel, the cost model's engine timeline
    (profile_page.py).

Options of ours go before SCRIPT; ``--out`` may also come last (``dump train.py --epochs 1 --out dump/``), unless
the script itself takes ``--out`` (then put ours before SCRIPT).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import sys
from collections.abc import Iterator

from neuron_compile import script_runner


def _add_script_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("script", metavar="SCRIPT.py", help="the Python script to run (as `python SCRIPT.py ARGS`)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments for the script")


def register_dump(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "dump", help="run a script and write every compile stage of every graph to a folder",
        description="Run SCRIPT.py with dumping on (NEURON_COMPILE_DUMP=DIR): per Dynamo graph its FX graph; per "
                    "ATen graph the graph after decompositions, the IR after every pass, the partition (NKI regions "
                    "and eager ops with reasons), fusion groups and decisions, tile plans, every kernel as a "
                    "standalone module (`neuron-compile simulate --report DIR/graph_000/.../kernels/X.py` runs it) "
                    "and its cost report; plus DIR/index.txt and index.json: graphs, recompiles, graph breaks.",
        epilog="exit status: the script's (1 if it raised); 2: usage error. --out may also follow the script's "
               "arguments.")
    parser.add_argument("--out", metavar="DIR", help="the dump folder (required; a previous dump there is replaced)")
    _add_script_arguments(parser)
    parser.set_defaults(handler=run_dump)


def register_explain(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "explain", help="run a script and explain its graph breaks, recompiles, eager fallbacks and slowest kernels",
        description="Run SCRIPT.py, then print: graph breaks with reasons and source lines; recompiles with the "
                    "guard that failed; eager fallbacks grouped by reason; kernels ranked by estimated time with "
                    "their bottleneck engine (the simulator's trn cost model).",
        epilog="exit status: the script's (1 if it raised; the report is still printed); 2: usage error.")
    parser.add_argument("--top", type=int, default=20, metavar="N", help="kernels listed (default 20)")
    _add_script_arguments(parser)
    parser.set_defaults(handler=run_explain)


def register_profile(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "profile", help="run a script and write an HTML page with each kernel's engine timeline",
        description="Run SCRIPT.py and write one self-contained HTML page (no network, no scripts): per graph its "
                    "kernels in launch order; per kernel the cost model's schedule as a timeline with one lane per "
                    "engine queue (TensorE, VectorE, ScalarE, GpSimd, DMA queues) and its time against the roofline.",
        epilog="exit status: the script's (1 if it raised; the page is still written); 2: usage error. --out may "
               "also follow the script's arguments.")
    parser.add_argument("--out", metavar="FILE", help="the HTML file to write (default: profile.html)")
    _add_script_arguments(parser)
    parser.set_defaults(handler=run_profile)


SCRIPT_SUBCOMMANDS = [register_dump, register_explain, register_profile]


def split_trailing_out(args: argparse.Namespace) -> None:
    """Take a trailing ``--out X`` / ``--out=X`` off the script's arguments when ``--out`` was not given before
    SCRIPT (the synopsis ``dump SCRIPT.py ARGS --out DIR``)."""
    if args.out is not None:
        return
    rest = list(args.script_args)
    if len(rest) >= 2 and rest[-2] == "--out":
        args.out, args.script_args = rest[-1], rest[:-2]
    elif rest and rest[-1].startswith("--out="):
        args.out, args.script_args = rest[-1].split("=", 1)[1], rest[:-1]


def usage_error(command: str, message: str) -> int:
    print(f"neuron-compile {command}: {message}", file=sys.stderr)
    return script_runner.EXIT_USAGE


def check_run(args: argparse.Namespace, command: str) -> int | None:
    """None when the script exists and the NEURON_COMPILE_* configuration is valid; else the usage error's status."""
    problem = script_runner.check_script(args.script, f"neuron-compile {command}")
    if problem:
        print(problem, file=sys.stderr)
        return script_runner.EXIT_USAGE
    from neuron_compile import config

    try:
        config.get()
    except ValueError as error:
        return usage_error(command, f"{error}; fix or unset the variable")
    return None


def prepare_dump_folder(folder: str) -> str | None:
    """Make ``folder`` ready for a dump: created if missing, a previous dump's files removed; an error message if
    it holds anything else (we never delete files we did not write)."""
    if os.path.exists(folder) and not os.path.isdir(folder):
        return f"--out {folder} is a file; give a folder"
    os.makedirs(folder, exist_ok=True)
    entries = os.listdir(folder)
    ours = [name for name in entries if name.startswith("graph_") or name in ("index.txt", "index.json")]
    if len(ours) != len(entries) or (entries and "index.json" not in entries):
        return f"--out {folder} is not empty and not a previous dump; choose a new or empty folder"
    for name in ours:
        path = os.path.join(folder, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    return None


@contextlib.contextmanager
def dump_progress() -> Iterator[None]:
    """Progress on stderr while a dump runs: the backend's line for each graph folder it writes."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.INFO)
    handler.addFilter(lambda record: record.getMessage().startswith("neuron_compile: dumped"))
    logger = logging.getLogger("neuron_compile")
    level = logger.level
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def run_dump(args: argparse.Namespace) -> int:
    split_trailing_out(args)
    if not args.out:
        return usage_error("dump", "--out DIR is required: the folder to write the dump to")
    failed = check_run(args, "dump")
    if failed is not None:
        return failed
    problem = prepare_dump_folder(args.out)
    if problem:
        return usage_error("dump", problem)
    from neuron_compile.observation import observe
    from neuron_compile.runtime.graph_records import refresh_dump_index

    folder = os.path.abspath(args.out)
    with observe() as observation, script_runner.script_environment(
            args.script, args.script_args, environ={"NEURON_COMPILE_DUMP": folder}), dump_progress():
        status = script_runner.run_script(args.script, args.script_args, "neuron-compile dump")
    index = refresh_dump_index(folder)
    kernels = sum(len(record.kernels) for record in observation.records)
    print(f"neuron-compile dump: {len(observation.events)} Dynamo graph(s), {len(observation.records)} ATen graph "
          f"compile(s), {kernels} kernel(s), {sum(b.count for b in observation.graph_breaks)} graph break(s), "
          f"{len(observation.recompiles)} recompile(s) -> {args.out} "
          f"(start at {os.path.join(args.out, os.path.basename(index))})",
          file=sys.stderr)
    return status


def run_explain(args: argparse.Namespace) -> int:
    failed = check_run(args, "explain")
    if failed is not None:
        return failed
    from neuron_compile.explain import explain_text
    from neuron_compile.observation import observe

    with observe() as observation, script_runner.script_environment(args.script, args.script_args):
        status = script_runner.run_script(args.script, args.script_args, "neuron-compile explain")
    sys.stdout.flush()
    print(f"neuron-compile explain: {args.script}" + (f" (exit status {status})" if status else ""))
    print(explain_text(observation, top=args.top), end="")
    return status


def run_profile(args: argparse.Namespace) -> int:
    split_trailing_out(args)
    out = args.out or "profile.html"
    failed = check_run(args, "profile")
    if failed is not None:
        return failed
    if os.path.isdir(out) or not os.path.isdir(os.path.dirname(os.path.abspath(out))):
        return usage_error("profile", f"--out {out}: give an HTML file path in an existing folder")
    from neuron_compile.observation import observe
    from neuron_compile.profile_page import profile_html

    with observe(keep_traces=True) as observation, script_runner.script_environment(args.script, args.script_args):
        status = script_runner.run_script(args.script, args.script_args, "neuron-compile profile")
    with open(out, "w") as handle:
        handle.write(profile_html(observation, title=os.path.basename(args.script)))
    print(f"neuron-compile profile: {len(observation.launches)} launch(es) -> {out}", file=sys.stderr)
    return status

"""The ``neuron-compile`` command. Input: a command line; output: the subcommand's effect and exit status.

Subcommands:

``neuron-compile simulate [--report] [--target T] SCRIPT.py [ARGS...]``
    Run SCRIPT.py as ``__main__`` with ``sys.argv = [SCRIPT.py, *ARGS]``, on the built-in NKI simulator: when
    the real ``nki`` package is not importable (or with ``--force-simulator``), ``import nki`` inside the
    script resolves to ``neuron_compile.runtime.simulator``, so a kernel written against the public NKI docs
    runs unchanged. Prints nothing of its own unless ``--report`` is given; then, after the script, the cost
    report of every kernel it launched (and their total when there are several).

``neuron-compile cache [--dir DIR] ls | show KEY | verify [--delete] | clear | stats``
    The on-disk compile cache (``NEURON_COMPILE_CACHE``, or ``--dir``): ``ls`` one line per entry (key, size,
    last use, target, kernels, ops), most recently used first; ``show`` an entry's key parts and kernels (tile
    plan and source) by key or unique key prefix; ``verify`` every entry that a lookup would reject, with the
    reason (exit status 1 if there is one; ``--delete`` removes them); ``clear`` deletes every entry; ``stats``
    the folder, entry count, bytes and bound. Exit status 2: the cache is off, or no / several entries match KEY.

``neuron-compile dump | explain | profile SCRIPT.py [ARGS...]``
    Run a torch script and report on what it compiled: every stage to a folder, a text explanation, an HTML
    timeline page (cli_scripts.py).

Exit status: the script's own (1 when it raised: its traceback is printed), 2 for usage errors.

Each subcommand is one ``register_<name>(subparsers)`` function that adds its parser and sets ``handler``;
adding one means writing that function and listing it in ``SUBCOMMANDS``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import sys
import time
from collections.abc import Callable, Iterator, Sequence

from neuron_compile import cli_scripts, script_runner


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


def register_cache(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "cache",
        help="list, show, verify or clear the on-disk compile cache",
        description="Inspect the on-disk compile cache (NEURON_COMPILE_CACHE; default ~/.cache/neuron_compile).",
    )
    parser.add_argument("--dir", help="the cache folder (default: the one NEURON_COMPILE_CACHE names)")
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    actions.add_parser("ls", help="one line per entry, most recently used first")
    show = actions.add_parser("show", help="an entry's key parts, fusion decisions and kernels")
    show.add_argument("key", help="the key, or a prefix of it that only one entry has")
    verify = actions.add_parser("verify", help="report the entries a lookup would reject (exit 1 if any)")
    verify.add_argument("--delete", action="store_true", help="remove the entries that fail")
    actions.add_parser("clear", help="delete every entry")
    actions.add_parser("stats", help="the folder, entries, bytes and bound")
    parser.set_defaults(handler=run_cache)


SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    *cli_scripts.SCRIPT_SUBCOMMANDS, register_simulate, register_cache,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="neuron-compile", description="neuron_compile tools: run a torch script and see what torch.compile("
        "backend='neuron') made of it (dump, explain, profile), run NKI kernels on the simulator, inspect the cache.",
        epilog="`neuron-compile COMMAND --help` describes each command. Exit status: the script's own (1 if it "
               "raised), 2 for a usage error.")
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
    problem = script_runner.check_script(args.script, "neuron-compile simulate")
    if problem:
        print(problem, file=sys.stderr)
        return script_runner.EXIT_USAGE
    from neuron_compile.runtime import simulator

    use_simulator = args.force_simulator or not real_nki_available()
    runs: list = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(script_runner.script_environment(args.script, args.script_args, args.target))
        if use_simulator:
            stack.enter_context(simulator.nki_import_alias())
        if args.report:
            stack.enter_context(_collect_launches(simulator, runs))
        status = script_runner.run_script(args.script, args.script_args, "neuron-compile simulate")
    if args.report:
        sys.stdout.flush()
        print(format_launch_reports(runs))
    return status


# ---------------------------------------------------------------------------------------------------------
# cache
# ---------------------------------------------------------------------------------------------------------


def _open_cache_for_cli(directory: str | None):
    from neuron_compile import config
    from neuron_compile.runtime import disk_cache

    settings = config.get()
    root = disk_cache.cache_root(directory if directory is not None else settings.cache_dir)
    return None if root is None else disk_cache.DiskCache(root, settings.cache_size)


def _size_text(size: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if size >= scale:
            return f"{size / scale:.1f}{unit}"
    return f"{size}B"


def _time_text(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(seconds))


def _entry_summary(entry: dict) -> str:
    """One line about an entry: a region's target, kernels and ops, or whose first-launch cost report it is."""
    from neuron_compile.runtime import report_cache, signed_code

    payload, parts = entry["payload"], entry["parts"]
    if parts.get("what") == report_cache.WHAT:
        return f"{parts.get('target', '?'):5} cost report of {parts.get('kernel')} ({', '.join(parts['arguments'])})"
    if parts.get("what") == signed_code.WHAT:
        return f"{'':5} compiled code of {parts.get('filename')}, signed by {parts.get('signer')}"
    ops = payload.get("ops", [])
    return (f"{parts.get('target', '?'):5} {len(payload.get('kernels', [])):3d} kernels  "
            + ", ".join(op.removeprefix("aten.") for op in ops[:6]) + (" ..." if len(ops) > 6 else ""))


def _cache_ls(cache) -> int:
    infos = sorted(cache.entries(), key=lambda info: info.last_used, reverse=True)
    for info in infos:
        try:
            summary = _entry_summary(cache.read(info.key))
        except (OSError, ValueError) as error:
            summary = f"unusable: {error}"
        print(f"{info.key[:16]}  {_size_text(info.size):>7}  {_time_text(info.last_used)}  {summary}")
    print(f"{len(infos)} entries in {cache.root}")
    return 0


def _cache_show(cache, prefix: str) -> int:
    keys = cache.resolve(prefix)
    if len(keys) != 1:
        found = "no entry" if not keys else f"{len(keys)} entries ({', '.join(key[:16] for key in keys[:5])})"
        print(f"neuron-compile cache show: {found} with a key starting {prefix!r} in {cache.root}; "
              "`neuron-compile cache ls` lists the keys", file=sys.stderr)
        return 2
    from neuron_compile.runtime import disk_cache

    try:
        entry = cache.read(keys[0])
    except (OSError, ValueError) as error:
        print(f"entry {keys[0]} is unusable (a lookup treats it as a miss): {error}", file=sys.stderr)
        return 1
    payload = entry["payload"]
    print(disk_cache.key_record_text(keys[0], entry["parts"]), end="")
    if "tag" in payload:  # a kernel text's compiled code (runtime/signed_code.py)
        print(f"compiled code: {len(payload['code'])} base64 characters, tag {payload['tag']}")
        return 0
    if "report" in payload:  # a kernel's first-launch cost report (runtime/report_cache.py)
        from neuron_compile.runtime.simulator.report import report_from_data

        print(report_from_data(payload["report"]).format())
        return 0
    print(f"aten nodes: {payload.get('aten_nodes')}")
    print("fusion decisions:", *(f"  {decision}" for decision in payload.get("decisions", [])), sep="\n")
    for kernel in payload.get("kernels", []):
        print(f"== kernel {kernel['name']}: {kernel['plan']}\n{kernel['source']}")
    return 0


def _check_cached_entry(entry: dict) -> None:
    """A region entry's payload must decode and its kernel texts stay inside what the launcher executes; a compiled
    code entry this user's key signed must carry a tag the key made."""
    from neuron_compile import rendered_region
    from neuron_compile.runtime import disk_cache, signed_code

    if entry["parts"].get("what") == disk_cache.REGION_WHAT:
        rendered_region.check_stored(entry["payload"])
    elif entry["parts"].get("what") == signed_code.WHAT:
        signed_code.check_stored(entry["parts"], entry["payload"])


def _cache_verify(cache, delete: bool) -> int:
    problems = cache.verify(_check_cached_entry)
    for key, problem in problems:
        print(f"{key}: {problem}" + (" (deleted)" if delete else ""))
        if delete:
            cache.remove(key)
    print(f"{len(cache.entries()) + (len(problems) if delete else 0)} entries checked, {len(problems)} unusable")
    return 1 if problems else 0


def _cache_stats(cache) -> int:
    infos = cache.entries()
    bound = _size_text(cache.max_bytes) if cache.max_bytes else "unbounded"
    print(f"folder: {cache.root}")
    print(f"entries: {len(infos)}")
    print(f"bytes: {sum(info.size for info in infos)} ({_size_text(sum(info.size for info in infos))}), bound {bound}")
    if infos:
        print(f"least recently used: {_time_text(min(info.last_used for info in infos))}")
        print(f"most recently used: {_time_text(max(info.last_used for info in infos))}")
    return 0


def run_cache(args: argparse.Namespace) -> int:
    cache = _open_cache_for_cli(args.dir)
    if cache is None:
        print("neuron-compile cache: the cache is off (NEURON_COMPILE_CACHE=off); pass --dir DIR to inspect a "
              "folder", file=sys.stderr)
        return 2
    if args.action == "ls":
        return _cache_ls(cache)
    if args.action == "show":
        return _cache_show(cache, args.key)
    if args.action == "verify":
        return _cache_verify(cache, args.delete)
    if args.action == "clear":
        print(f"deleted {cache.clear()} entries from {cache.root}")
        return 0
    return _cache_stats(cache)


if __name__ == "__main__":
    sys.exit(main())

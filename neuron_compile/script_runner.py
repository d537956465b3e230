"""CLI stage: run a user's script as ``python SCRIPT.py ARGS`` would, inside the ``neuron-compile`` process.

Input: a script path, its arguments, and optionally a target override. Output: the script's exit status: its own
``sys.exit`` code; 1 when it raises (its traceback is printed to stderr, starting at the script's own frames, not
at ours); 130 on Ctrl-C. ``sys.argv``, ``sys.path[0]`` and ``NEURON_PLATFORM_TARGET_OVERRIDE`` are set for the
run and restored afterwards, and the modules the script imported from its own folder are forgotten, so that the
command can run several scripts in one process (the tests do).
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
import traceback
from collections.abc import Iterator, Mapping, Sequence

EXIT_SCRIPT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


@contextlib.contextmanager
def script_environment(script: str, script_args: Sequence[str], target: str | None = None,
                       environ: Mapping[str, str] | None = None) -> Iterator[None]:
    """sys.argv, sys.path[0], the target override and ``environ`` (extra environment variables) as
    ``python SCRIPT.py ARGS`` would see them, restored afterwards."""
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    extra = dict(environ or {})
    if target:
        extra["NEURON_PLATFORM_TARGET_OVERRIDE"] = target
    saved_environ = {name: os.environ.get(name) for name in extra}
    modules_before = set(sys.modules)
    script_dir = os.path.dirname(os.path.abspath(script))
    sys.argv = [script, *script_args]
    sys.path.insert(0, script_dir)
    os.environ.update(extra)
    try:
        yield
    finally:
        sys.argv[:] = saved_argv
        sys.path[:] = saved_path
        for name, value in saved_environ.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        forget_script_modules(script_dir, set(sys.modules) - modules_before)


def forget_script_modules(script_dir: str, new_modules: set[str]) -> None:
    """Drop the modules the script imported from its own directory, so that a second run in this process
    imports the script's siblings afresh instead of reusing stale ones."""
    for name in new_modules:
        path = getattr(sys.modules.get(name), "__file__", None) or ""
        if os.path.abspath(path).startswith(script_dir + os.sep):
            del sys.modules[name]


def exit_status(code) -> int:
    """The process status ``sys.exit(code)`` gives: None is 0, an int itself, anything else is printed, 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def script_traceback(error: BaseException, script: str) -> str:
    """The traceback of ``error`` from the script's first frame on (runpy's and the CLI's frames dropped)."""
    summary = traceback.TracebackException.from_exception(error)
    script_path = os.path.abspath(script)
    frames = list(summary.stack)
    first = next((i for i, frame in enumerate(frames) if os.path.abspath(frame.filename) == script_path), 0)
    summary.stack = traceback.StackSummary.from_list(frames[first:])
    return "".join(summary.format())


def run_script(script: str, script_args: Sequence[str], command: str) -> int:
    """Run ``script`` as ``__main__`` (inside whatever ``script_environment`` the caller set up); its status.
    A raised exception prints the script's traceback and ``command``'s note, and gives EXIT_SCRIPT_FAILED."""
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_request:  # the script's own sys.exit(): keep its status
        return exit_status(exit_request.code)
    except KeyboardInterrupt:
        print(f"{command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as error:  # noqa: BLE001 -- the user's script failed: show its traceback, report status 1
        sys.stdout.flush()
        print(script_traceback(error, script), end="", file=sys.stderr)
        print(f"{command}: {script} raised {type(error).__name__} (exit status {EXIT_SCRIPT_FAILED}); "
              "the traceback above is the script's own", file=sys.stderr)
        return EXIT_SCRIPT_FAILED
    return 0


def check_script(script: str, command: str) -> str | None:
    """None when ``script`` is a readable file; else the message to print (with what to do) for EXIT_USAGE."""
    if not os.path.isfile(script):
        hint = " (a folder: name the .py file inside it)" if os.path.isdir(script) else ""
        return (f"{command}: no such script: {script}{hint}; give the path of a Python file, "
                f"e.g. `{command} train.py --epochs 1`")
    return None

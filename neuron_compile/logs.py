"""Logging: our log topics, registered with ``torch._logging`` so that torch's log controls reach them.

Input: the ``logs`` setting (``NEURON_COMPILE_LOGS`` / ``options={"logs": ...}``): topics separated by commas,
each optionally prefixed ``+`` (debug) or ``-`` (errors only), as ``TORCH_LOGS`` spells them. Output: the levels
of our module loggers, and a stderr handler when nothing else would print their records.

Every module logs through ``logging.getLogger(__name__)``, so a topic is a set of module loggers under
``neuron_compile``. Three ways to turn them on:

* ``NEURON_COMPILE_LOGS="+dispatch,cache"``: our topics (below), read when the backend compiles a graph;
* ``TORCH_LOGS="+neuron_compile"`` (or a module: ``+neuron_compile.runtime.disk_cache``), next to torch's own
  topics (``TORCH_LOGS="+neuron_compile,recompiles"``). ``TORCH_LOGS`` is parsed when torch is imported, before
  this package registers anything, so it takes module names, not our topic names;
* ``torch._logging.set_logs(modules={"neuron_compile": logging.DEBUG})``, or a module name as for ``TORCH_LOGS``.
"""

from __future__ import annotations

import logging
import sys

import torch._logging

ROOT = "neuron_compile"
# Topic -> the module loggers it covers.
TOPICS: dict[str, tuple[str, ...]] = {
    "all": (ROOT,),
    "backend": ("neuron_compile.backend", "neuron_compile.trace_compile"),  # Dynamo graphs handed to us, aot_autograd fallbacks
    # signature misses, recompiles, region fallbacks
    "dispatch": ("neuron_compile.runtime.compiled_graph", "neuron_compile.runtime.region_module"),
    "partition": ("neuron_compile.passes.partition",),  # NKI regions vs eager nodes
    # on-disk cache hits, misses, damaged entries (kernels and first-launch cost reports)
    # and warm starts from warm-start records (written, used, refused)
    "cache": ("neuron_compile.runtime.disk_cache", "neuron_compile.runtime.report_cache",
              "neuron_compile.runtime.warm_candidate", "neuron_compile.runtime.warm_start"),
    "bucket": ("neuron_compile.passes.bucket",),  # shape bucketing: dims padded, graphs declined and why
}
LEVELS = {"+": logging.DEBUG, "-": logging.ERROR}
VALID = f"a comma-separated list of {sorted(TOPICS)}, each optionally prefixed + (debug) or - (errors only)"
HANDLER_NAME = "neuron_compile.logs"


def parse(setting: str, source: str = "logs") -> dict[str, int]:
    """Logger name -> level for ``setting`` (``"+dispatch,cache"``); a ValueError names ``source`` and the topics."""
    levels: dict[str, int] = {}
    for item in (part.strip() for part in setting.split(",")):
        if not item:
            continue
        level = LEVELS.get(item[0], logging.INFO)
        topic = item[1:] if item[0] in LEVELS else item
        if topic not in TOPICS:
            raise ValueError(f"{source} must be {VALID}, got {setting!r} (unknown topic {topic!r})")
        levels.update(dict.fromkeys(TOPICS[topic], level))
    return levels


def register() -> None:
    """Make ``neuron_compile`` a log of ``torch._logging`` (``set_logs(modules={"neuron_compile": ...})`` and its
    handlers, as for torch's own logs); idempotent. The topics are not registered as logs of their own: torch would
    give a topic's module logger a handler of its own besides its parent's, and print each record twice."""
    torch._logging._internal.register_log(ROOT, [ROOT])  # noqa: SLF001 -- the registry has no public alias


_applied: list[str] = []  # the last setting applied: a compile per graph re-applies nothing


def apply(setting: str) -> None:
    """Set our loggers' levels from ``setting`` (empty: leave them as torch or the user set them)."""
    if not setting or _applied[-1:] == [setting]:
        return
    for name, level in parse(setting).items():
        logging.getLogger(name).setLevel(level)
    root = logging.getLogger(ROOT)
    if not root.hasHandlers():  # no handler anywhere up the chain: Python would print warnings only
        handler = logging.StreamHandler(sys.stderr)
        handler.set_name(HANDLER_NAME)
        handler.setFormatter(logging.Formatter("[%(name)s] %(levelname)s: %(message)s"))
        root.addHandler(handler)
    _applied[:] = [setting]


def forget_applied() -> None:
    """Apply the next setting even if it equals the last one (after the levels were changed elsewhere)."""
    _applied.clear()

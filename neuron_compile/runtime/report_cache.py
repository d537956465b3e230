"""Runtime stage: first-launch cost reports kept in the on-disk cache, so a warm start does not trace and schedule
each kernel's first launch again.

Input: a kernel's source text and its launch's argument signature (the target's name, each argument's shape and
numpy dtype), and on a miss the report of a traced launch. Output: the stored ``CostReport``, or None.

A generated kernel's trace is a function of its text and that signature (runtime/launcher.py ``LoadedKernel``), and
its report a function of the trace, the target's numbers and the cost model. So the key is the text's hash, the
signature and ``cost_model_fingerprint()``: a hash of the simulator package (the instructions it records and the
cost model and schedule that price them) and of hardware.py (the targets' numbers). A change to any of them is a
new key; a compiler change that leaves a kernel's text and the cost model alone keeps the kernel's report. Entries
are JSON in the ``DiskCache`` (runtime/disk_cache.py: atomic writes, an unusable entry is a miss), never pickle.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path

from neuron_compile import hardware
from neuron_compile.config import Config
from neuron_compile.runtime import disk_cache, simulator
from neuron_compile.runtime.simulator.cost import CostReport
from neuron_compile.runtime.simulator.report import report_data, report_from_data

log = logging.getLogger(__name__)

FORMAT = 1  # of a report entry's key parts and payload
WHAT = "cost report"  # a report entry's ``what`` key part (a region's is "nki region")


@functools.cache
def cost_model_fingerprint() -> str:
    """A hash of what a launch's report is made by: the simulator package's sources and hardware.py."""
    package = Path(simulator.__file__).resolve().parent
    digest = hashlib.sha256()
    for path in [*sorted(package.rglob("*.py")), Path(hardware.__file__).resolve()]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def report_key_parts(kernel_name: str, kernel_text: str, signature: tuple) -> dict:
    """The parts of a report's key; ``signature``: (target name, (shape, numpy dtype) per argument)."""
    target, *arguments = signature
    return {
        "format": FORMAT,
        "what": WHAT,
        "kernel": kernel_name,
        "kernel text": hashlib.sha256(kernel_text.encode()).hexdigest(),
        "arguments": [f"{dtype}{list(shape)}" for shape, dtype in arguments],
        "target": target,
        "cost model": cost_model_fingerprint(),
    }


class ReportCache:
    """First-launch reports in one ``DiskCache`` folder (see the module docstring)."""

    def __init__(self, cache: disk_cache.DiskCache):
        self.cache = cache

    def lookup(self, kernel_name: str, kernel_text: str, signature: tuple) -> CostReport | None:
        """The stored report, or None (absent or unusable: each a miss)."""
        payload = self.cache.lookup(disk_cache.key_of(report_key_parts(kernel_name, kernel_text, signature)))
        if payload is None:
            return None
        try:
            return report_from_data(payload.get("report"))
        except (ValueError, TypeError) as error:
            log.warning("neuron_compile: a stored cost report of %s is unusable (%s); tracing the launch",
                                   kernel_name, error)
            return None

    def store(self, kernel_name: str, kernel_text: str, signature: tuple, report: CostReport) -> None:
        """Keep ``report`` (one with collective calls is not kept: it names one run's process group)."""
        if report.collectives:
            return
        parts = report_key_parts(kernel_name, kernel_text, signature)
        self.cache.store(disk_cache.key_of(parts), parts, {"report": report_data(report)})


def open_report_cache(config: Config | None) -> ReportCache | None:
    """The reports of ``config``'s cache folder; None when the cache is off."""
    cache = disk_cache.open_cache(config)
    return ReportCache(cache) if cache is not None else None

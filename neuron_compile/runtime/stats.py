"""Runtime stage: the counters behind ``neuron_compile.stats()``.

One process-wide ``Stats`` object. The backend counts graphs, cache hits and misses and ATen nodes (in NKI
kernels vs eager, with a per-op Counter of fallback reasons); the kernel launcher adds kernels launched and
the simulator's cost-model figures for every launch. ``reset_stats()`` zeroes everything. ``record_launches()``
collects each launch's kernel name and cost report inside a ``with`` block (the per-kernel view the sums hide).

What every cache hit counts (the hit, each launch and its report's figures) is deferred: appended to a list (one
atomic operation in CPython, no lock) and added to the counters when they are read, or when the list grows long.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
from collections.abc import Iterator


@dataclasses.dataclass
class Stats:
    graphs_compiled: int = 0  # Dynamo graphs handed to the backend (each forward/backward/inference graph)
    regions_compiled: int = 0  # NKI regions compiled (one per region per shape signature)
    region_compile_failures: int = 0  # regions that failed to compile and fell back to eager
    region_run_failures: int = 0  # compiled regions that failed when run and fell back to eager from then on
    recompiles: int = 0  # new shape signatures after the first, per compiled graph
    cache_hits: int = 0  # calls served by an already-compiled shape signature
    cache_misses: int = 0  # calls that had to compile a new shape signature
    # The on-disk cache (runtime/disk_cache.py): regions loaded from it / compiled and written to it; entries found
    # unusable (truncated, garbage, another format: each also a miss); entries deleted to keep it under its bound.
    disk_cache_hits: int = 0
    disk_cache_misses: int = 0
    disk_cache_corrupt: int = 0
    disk_cache_evictions: int = 0
    # Dynamo graphs a warm start ran from their warm-start record, without aot_autograd (runtime/warm_start.py), and
    # records written for later processes
    aot_autograd_skipped: int = 0
    warm_records_written: int = 0
    kernels_launched: int = 0
    # Column-major weight copies made for inference graphs (runtime/weight_layouts.py): count and bytes.
    weight_copies: int = 0
    weight_copy_bytes: int = 0
    nki_nodes: int = 0  # ATen nodes placed in NKI regions (counted at compile time, per signature)
    fallback_nodes: int = 0  # ATen nodes executed eagerly (counted at compile time, per signature)
    fallback_reasons: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    hbm_bytes: int = 0  # HBM bytes read + written by launched kernels (simulator cost model)
    flops: int = 0
    est_time_s: float = 0.0  # estimated time: launch costs plus each kernel's scheduled device time
    est_lower_bound_s: float = 0.0  # launch costs plus each kernel's busiest engine (perfect overlap)
    launch_s: float = 0.0  # the launch costs alone (a NEFF boundary per kernel)
    roofline_s: float = 0.0  # max(FLOPs / TensorE peak, HBM bytes / bandwidth), summed over launches
    # nki.collectives calls in launched kernels, the bytes of their inputs on this rank, their estimated time on
    # the trn2 links (a ring model, runtime/simulator/comm_cost.py) and the part of it compute ran alongside;
    # est_time_s includes the rest (est_comm_s - est_comm_overlap_s: communication nothing hid)
    collectives: int = 0
    collective_bytes: int = 0
    est_comm_s: float = 0.0
    est_comm_overlap_s: float = 0.0

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["fallback_reasons"] = collections.Counter(self.fallback_reasons)
        return out


@dataclasses.dataclass(frozen=True)
class Launch:
    kernel: str  # the kernel's name (its KernelSource.name)
    report: object  # the launcher's cost report (the simulator's CostReport), None without a cost model
    source: object = None  # the KernelSource launched (its text tells apart kernels of one name in several graphs)


_lock = threading.Lock()
_stats = Stats()
_recorders: list[list[Launch]] = []
COUNTS_KEPT = 1024  # launch_counts' memo: reports whose counters are kept
_counts_by_report: dict[int, tuple[object, tuple]] = {}
# Counted but not yet added: CACHE_HIT for a hit, a launch's report (or NO_REPORT) for a launch.
_deferred: list = []
DEFERRED_KEPT = 4096  # folded into the counters at this length, so an unread process does not grow it
CACHE_HIT, NO_REPORT = object(), object()


def add(**counts) -> None:
    """Add to counters by name, e.g. ``add(kernels_launched=1, hbm_bytes=4096)``."""
    with _lock:
        for name, value in counts.items():
            setattr(_stats, name, getattr(_stats, name) + value)


def add_fallback(op: str, reason: str, count: int = 1) -> None:
    """Count ``count`` eager ATen nodes of ``op`` (e.g. "aten.sort.default") that fell back for ``reason``."""
    with _lock:
        _stats.fallback_nodes += count
        _stats.fallback_reasons[f"{op}: {reason}"] += count


def add_launch(kernel: str, report: object, source: object = None) -> None:
    """Hand one launch to every active ``record_launches()`` block."""
    if not _recorders:  # read without the lock: a block entered while this launch runs may or may not see it
        return
    with _lock:
        for recorder in _recorders:
            recorder.append(Launch(kernel, report, source))


@contextlib.contextmanager
def record_launches() -> Iterator[list[Launch]]:
    """Inside the block, every kernel launch (any thread) is appended to the yielded list as a ``Launch``."""
    recorder: list[Launch] = []
    with _lock:
        _recorders.append(recorder)
    try:
        yield recorder
    finally:
        with _lock:
            # by identity: a nested block's list can equal this one (the same launches), and list.remove compares
            _recorders[:] = [other for other in _recorders if other is not recorder]


def snapshot() -> dict:
    with _lock:
        _fold_deferred()
        return _stats.as_dict()


def reset() -> None:
    global _stats
    with _lock:
        del _deferred[:]  # counted before the reset
        _stats = Stats()


def count_hit() -> None:
    """One cache hit (deferred: see the module docstring)."""
    _deferred.append(CACHE_HIT)
    if len(_deferred) >= DEFERRED_KEPT:
        _fold_now()


def count_launch(kernel: str, report: object, source: object = None) -> None:
    """One kernel launch: handed to the recorders, counted, and its cost-model figures summed (a launcher without
    a cost model, the device, gives no report); deferred, as a cache hit calls this for every launch."""
    if _recorders:  # read without the lock, as add_launch does
        add_launch(kernel, report, source)
    _deferred.append(NO_REPORT if report is None else report)
    if len(_deferred) >= DEFERRED_KEPT:
        _fold_now()


def pending() -> int:
    """Hits and launches counted but not yet added to the counters (fewer than ``DEFERRED_KEPT``)."""
    return len(_deferred)


def _fold_now() -> None:
    with _lock:
        _fold_deferred()


def _fold_deferred() -> None:
    """Add the deferred hits and launches to the counters (the caller holds the lock). Items appended meanwhile
    by other threads land after the ones taken here and stay for the next fold."""
    taken = _deferred[:]
    del _deferred[:len(taken)]
    # Counted per distinct item first (a hit path launches the same kernels with the same reports on every call):
    # one pass of C-level counting, then each report's counters added once, times its launches.
    times = collections.Counter(map(id, taken))
    items = {id(item): item for item in taken}
    for key, count in times.items():
        item = items[key]
        if item is CACHE_HIT:
            _stats.cache_hits += count
            continue
        _stats.kernels_launched += count
        if item is not NO_REPORT:
            for name, value in launch_counts(item):
                setattr(_stats, name, getattr(_stats, name) + value * count)


def launch_counts(report) -> tuple[tuple[str, int | float], ...]:
    """The counters one launch adds, from its cost report; the same report object (the launcher reuses a kernel's
    first report for identical launches) gives the tuple computed the first time."""
    cached = _counts_by_report.get(id(report))
    if cached is not None and cached[0] is report:
        return cached[1]
    counts = (
        ("hbm_bytes", int(report.hbm_bytes_read + report.hbm_bytes_written)), ("flops", int(report.flops)),
        ("est_time_s", float(report.est_time_s)), ("roofline_s", float(report.roofline_s)),
        ("launch_s", float(report.launch_s)), ("est_lower_bound_s", float(report.est_lower_bound_s)),
        ("collectives", len(getattr(report, "collectives", ()))),
        ("collective_bytes", int(getattr(report, "collective_bytes", 0))),
        ("est_comm_s", float(getattr(report, "est_comm_s", 0.0))),
        ("est_comm_overlap_s", float(getattr(report, "comm_overlap_s", 0.0))),
    )
    if len(_counts_by_report) >= COUNTS_KEPT:
        _counts_by_report.clear()
    _counts_by_report[id(report)] = (report, counts)  # the report is kept: its id cannot be reused meanwhile
    return counts

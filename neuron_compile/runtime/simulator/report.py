"""Simulator stage: the cost model's result. Input: the figures cost.py computes for one launch (or several).
Output: a ``CostReport`` (engines, bytes, FLOPs, the schedule's time and its lower bound, the roofline), its
readable table (``format``), ``sum_reports`` for launches run one after the other, and ``report_data`` /
``report_from_data``: a report as plain JSON data and back, exactly (the on-disk cache keeps first-launch reports).
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Iterable
from dataclasses import dataclass, field

# "collective": the collective-communication engines that run nki.collectives calls over the chip links (a queue of
# their own: compute goes on while a collective is in flight, and waits only where it reads the result).
ENGINES = ("tensor", "vector", "scalar", "gpsimd", "dma", "sync", "collective")


@dataclass(frozen=True)
class SectionCost:
    """One kernel's share of a launch: the instructions issued from one subkernel of a region kernel (or the
    whole of a plain kernel). ``est_time_s`` is how far the section pushed the launch's end past the sections
    before it (so the sections of a launch add up to its device time, and a kernel hidden under its predecessor
    costs little); ``start_s``/``end_s`` are its first start and last end in the launch's schedule."""

    name: str
    est_time_s: float
    busy_s_per_engine: dict[str, float]
    hbm_bytes: int
    flops: int
    instructions: int
    start_s: float
    end_s: float
    roofline_s: float = 0.0  # max(its FLOPs / TensorE peak, its HBM bytes / bandwidth)

    @property
    def bottleneck(self) -> str:
        """The engine this section kept busiest."""
        if not self.busy_s_per_engine:
            return "none"
        return max(self.busy_s_per_engine, key=self.busy_s_per_engine.get)

    @property
    def lower_bound_s(self) -> float:
        """Its busiest engine's time: what it would take, alone, with every engine perfectly overlapped."""
        return max(self.busy_s_per_engine.values(), default=0.0)


@dataclass(frozen=True)
class KernelCost:
    """One kernel's figures within a launch (``CostReport.kernel_costs``): what explain and the benches rank."""

    name: str
    est_time_s: float
    lower_bound_s: float
    roofline_s: float
    bottleneck: str


@dataclass(frozen=True)
class CostReport:
    """The cost of one kernel launch (or, from sum_reports, of several run one after the other).

    ``est_time_s`` = ``launch_s`` (the fixed cost of a kernel launch, a NEFF boundary) + ``device_time_s``
    (the makespan of the instruction schedule, schedule.py). ``est_lower_bound_s`` = ``launch_s`` + the busy
    time of the busiest engine of the busiest core: what the launch would take were every engine perfectly
    overlapped. ``serial_time_s``: every instruction one after another with its fixed costs, no overlap at all.
    ``utilization = roofline_s / device_time_s``.

    ``cycles_per_engine['dma']`` is in nanoseconds of DMA-pool occupancy (the DMA engines have no clock of
    their own in this model), ``cycles_per_engine['collective']`` in nanoseconds on the chip links. ``time_per_instruction`` is busy seconds by instruction name, for explaining
    where the time goes; ``wait_s_per_queue`` the time each queue sat waiting on a dependency; ``unmodeled``
    names instructions costed by a fallback formula. ``cores`` is 2 for an lnc=2 launch. ``sections``: one
    ``SectionCost`` per kernel the launch ran, in order of first instruction (one for a plain kernel).
    """

    target: str
    instructions_per_engine: dict[str, int]
    cycles_per_engine: dict[str, float]
    busy_s_per_engine: dict[str, float]
    hbm_bytes_read: int
    hbm_bytes_written: int
    flops: int
    est_time_s: float
    serial_time_s: float
    roofline_s: float
    utilization: float
    roofline_compute_s: float = 0.0  # FLOPs / TensorE peak (of all the launch's cores)
    roofline_memory_s: float = 0.0  # HBM bytes / HBM bandwidth (of all the launch's cores)
    time_per_instruction: dict[str, float] = field(default_factory=dict)
    unmodeled: tuple[str, ...] = ()
    launches: int = 1
    est_lower_bound_s: float = 0.0
    device_time_s: float = 0.0
    launch_s: float = 0.0
    wait_s_per_queue: dict[str, float] = field(default_factory=dict)
    cores: int = 1
    sections: tuple[SectionCost, ...] = ()
    # nki.collectives calls (simulator/collectives.py CollectiveRecord) and their time on the links (comm_cost.py).
    # The schedule runs them on the "collective" queue beside compute, so est_time_s already includes the part of
    # est_comm_s that no compute ran alongside; comm_overlap_s is the part hidden under compute.
    collectives: tuple = ()
    est_comm_s: float = 0.0
    comm_overlap_s: float = 0.0

    @property
    def collective_bytes(self) -> int:
        """Bytes the collectives moved in: each one's input on this rank."""
        return sum(record.bytes for record in self.collectives)

    @property
    def comm_exposed_s(self) -> float:
        """Communication time with no compute alongside: what collectives add to the launch's time."""
        return max(0.0, self.est_comm_s - self.comm_overlap_s)

    @property
    def hbm_bytes(self) -> int:
        return self.hbm_bytes_read + self.hbm_bytes_written

    def kernel_costs(self, launched: str, scope: str = "") -> list[KernelCost]:
        """Per kernel the launch ran: the launch ``launched`` itself when it ran one kernel; a region kernel's
        sections (each kernel's share of the schedule, named ``scope`` + the kernel's name) plus a
        ``launched + " launch"`` entry for the fixed launch cost, when it ran several. Their times add up to
        ``est_time_s``."""
        if len(self.sections) <= 1:
            return [KernelCost(launched, self.est_time_s, self.est_lower_bound_s, self.roofline_s, self.bottleneck)]
        costs = [KernelCost(f"{launched} launch", self.launch_s, self.launch_s, 0.0, "launch")]
        costs += [KernelCost(scope + section.name, section.est_time_s, section.lower_bound_s, section.roofline_s,
                             section.bottleneck) for section in self.sections]
        return costs

    @property
    def achieved_flops_per_s(self) -> float:
        return self.flops / self.est_time_s if self.est_time_s else 0.0

    @property
    def bottleneck(self) -> str:
        """The engine with the most busy time (the one the lower bound is made of)."""
        if not self.busy_s_per_engine:
            return "none"
        return max(self.busy_s_per_engine, key=self.busy_s_per_engine.get)

    def format(self) -> str:
        """A readable table: one row per engine, then bytes, FLOPs, times and utilization."""
        total = sum(self.instructions_per_engine.values())
        launches = f", {self.launches} launches" if self.launches > 1 else ""
        cores = f", {self.cores} cores" if self.cores > 1 else ""
        lines = [
            f"cost report ({self.target}{launches}{cores}): {total} instructions",
            f"  {'engine':<8}{'instructions':>13}{'cycles':>15}{'busy (us)':>13}{'of device':>11}",
        ]
        for engine in ENGINES:
            if engine not in self.instructions_per_engine:
                continue
            busy = self.busy_s_per_engine.get(engine, 0.0)
            share = busy / (self.device_time_s * self.cores) if self.device_time_s else 0.0
            cycles = f"{self.cycles_per_engine.get(engine, 0.0):,.0f}" + ("ns" if engine in ("dma", "collective") else "")
            lines.append(
                f"  {engine:<8}{self.instructions_per_engine[engine]:>13,}{cycles:>15}"
                f"{busy * 1e6:>13.2f}{share:>11.1%}"
            )
        top = sorted(self.time_per_instruction.items(), key=lambda item: -item[1])[:6]
        if top:
            lines.append("  top instructions: " + ", ".join(f"{name} {secs * 1e6:.2f}us" for name, secs in top))
        waits = sorted(self.wait_s_per_queue.items(), key=lambda item: -item[1])[:4]
        if waits:
            lines.append("  waiting on dependencies: " + ", ".join(f"{q} {s * 1e6:.2f}us" for q, s in waits))
        bound = "compute" if self.roofline_compute_s >= self.roofline_memory_s else "memory"
        lines += [
            f"  HBM read {_mib(self.hbm_bytes_read)}, written {_mib(self.hbm_bytes_written)}; "
            f"{_si(self.flops)}FLOP ({_si(self.achieved_flops_per_s)}FLOP/s at the estimate)",
            f"  estimated {self.est_time_s * 1e6:.2f} us = launch {self.launch_s * 1e6:.2f} + schedule "
            f"{self.device_time_s * 1e6:.2f}; lower bound {self.est_lower_bound_s * 1e6:.2f} us (engines "
            f"overlapped, bottleneck {self.bottleneck}); serial {self.serial_time_s * 1e6:.2f} us",
            f"  roofline {self.roofline_s * 1e6:.2f} us ({bound}-bound); utilization {self.utilization:.1%}",
        ]
        if self.est_comm_s:
            lines.append(f"  communication {self.est_comm_s * 1e6:.2f} us, of which {self.comm_overlap_s * 1e6:.2f} us "
                         f"overlapped compute ({self.comm_exposed_s * 1e6:.2f} us exposed)")
        if self.unmodeled:
            lines.append("  costed by a fallback formula: " + ", ".join(self.unmodeled))
        if len(self.sections) > 1:
            lines.append(f"  {len(self.sections)} kernels in this launch (each one's share of the schedule, us):")
            lines += [f"    {section.name:<28}{section.est_time_s * 1e6:>10.2f}  {section.bottleneck}"
                      for section in self.sections]
        return "\n".join(lines)


def _si(value: float) -> str:
    """1.5e12 -> '1.50 T', 2048 -> '2.05 k'."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {prefix}"
    return f"{value:.0f} "


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def _add_dicts(dicts: Iterable[dict]) -> dict:
    total: dict = {}
    for mapping in dicts:
        for key, value in mapping.items():
            total[key] = total.get(key, 0) + value
    return total


def sum_reports(reports: Iterable[CostReport]) -> CostReport:
    """Several launches run one after the other: every count, byte and time adds up (est times and lower
    bounds too, since launches do not overlap); utilization is recomputed from the sums."""
    reports = list(reports)
    if not reports:
        raise ValueError("[cost_sum_empty] sum_reports needs at least one CostReport, got none")
    targets = sorted({report.target for report in reports})
    if len(targets) > 1:
        raise ValueError(f"[cost_sum_mixed_targets] cannot add reports of different targets: {targets}")
    device = sum(report.device_time_s for report in reports)
    roofline = sum(report.roofline_s for report in reports)
    return CostReport(
        target=targets[0],
        instructions_per_engine=_add_dicts(r.instructions_per_engine for r in reports),
        cycles_per_engine=_add_dicts(r.cycles_per_engine for r in reports),
        busy_s_per_engine=_add_dicts(r.busy_s_per_engine for r in reports),
        hbm_bytes_read=sum(r.hbm_bytes_read for r in reports),
        hbm_bytes_written=sum(r.hbm_bytes_written for r in reports),
        flops=sum(r.flops for r in reports),
        est_time_s=sum(report.est_time_s for report in reports),
        serial_time_s=sum(r.serial_time_s for r in reports),
        roofline_s=roofline,
        utilization=roofline / device if device else 0.0,
        roofline_compute_s=sum(r.roofline_compute_s for r in reports),
        roofline_memory_s=sum(r.roofline_memory_s for r in reports),
        time_per_instruction=_add_dicts(r.time_per_instruction for r in reports),
        unmodeled=tuple(sorted({name for r in reports for name in r.unmodeled})),
        launches=sum(r.launches for r in reports),
        est_lower_bound_s=sum(r.est_lower_bound_s for r in reports),
        device_time_s=device,
        launch_s=sum(r.launch_s for r in reports),
        wait_s_per_queue=_add_dicts(r.wait_s_per_queue for r in reports),
        cores=max(r.cores for r in reports),
        sections=tuple(section for r in reports for section in r.sections),
        collectives=tuple(record for r in reports for record in r.collectives),
        est_comm_s=sum(r.est_comm_s for r in reports),
        comm_overlap_s=sum(r.comm_overlap_s for r in reports),
    )


def report_data(report: CostReport) -> dict:
    """``report`` as JSON data (str, number, list and dict only); JSON keeps every float exactly. A report with
    collective calls has none: those records name the process group of one run."""
    if report.collectives:
        raise ValueError("[cost_report_collectives] a report with collective calls is not stored as data")
    data = dataclasses.asdict(report)
    data["unmodeled"] = list(report.unmodeled)
    data["sections"] = [dataclasses.asdict(section) for section in report.sections]
    data["collectives"] = []
    return data


def report_from_data(data: dict) -> CostReport:
    """The report ``report_data`` made; ``ValueError`` for anything else (other fields, a non-number figure)."""
    fields = {item.name for item in dataclasses.fields(CostReport)}
    if not isinstance(data, dict) or set(data) != fields:
        raise ValueError("[cost_report_data] not a cost report's data: its fields differ from CostReport's")
    sections = tuple(SectionCost(**_checked_figures(section, SectionCost)) for section in data["sections"])
    figures = _checked_figures({**data, "sections": sections, "unmodeled": tuple(data["unmodeled"]),
                                "collectives": ()}, CostReport)
    return CostReport(**figures)


def _checked_figures(data: dict, kind: type) -> dict:
    """``data`` when its fields are ``kind``'s and every figure (a number, or a dict of numbers) is numeric."""
    if not isinstance(data, dict) or set(data) != {item.name for item in dataclasses.fields(kind)}:
        raise ValueError(f"[cost_report_data] not {kind.__name__} data")
    for name, value in data.items():
        values = value.values() if isinstance(value, dict) else [value]
        if name not in ("target", "name", "unmodeled", "sections", "collectives") and not all(
                isinstance(item, numbers.Real) and not isinstance(item, bool) for item in values):
            raise ValueError(f"[cost_report_data] {kind.__name__}.{name} is not a number: {value!r}")
    return data

"""Simulator stage: the instruction schedule behind the cost model's time estimate.

Input: an instruction trace (trace.InstructionRecord list, each with the memory Regions it reads and writes) and
each instruction's cost on its engine (cost.py). Output: a ``Schedule``: when every instruction starts and
finishes, the makespan per NeuronCore, and the wait each queue spent on dependencies.

The model, as a device profile shows it:

* Engines. Each compute engine (TensorE, VectorE, ScalarE, GpSimd, and the sync engine) runs one
  instruction at a time, for its cost in cycles (which already includes the ~64-cycle minimum initiation
  interval, cost.MIN_II). An instruction starts at the earliest moment its dependencies allow and its engine
  is idle for its whole duration, even before instructions that come earlier in the program: the compiler's
  instruction scheduler reorders independent instructions (the NKI docs: "the compiler schedules this
  overlap ... it enforces the ordering between operations that share storage"), so program order binds only
  through memory. Each instruction is labelled with its queue (the engine; DMA transfers by direction: loads
  to SBUF, stores to HBM, the rest), the lanes of a profile.
* DMA engines. A transfer over P partitions uses ceil(P / 8) of the 16 DMA engines, occupying each for its
  share of the bytes plus 1/8 of the fixed cost (cost.dma_transfer_time). The engines interleave the
  descriptors of several transfers, so a transfer's occupancy is placed in ``DMA_DESCRIPTOR_NS`` pieces, each
  where that many engines are idle together; its data lands the rest of its fixed latency after its last piece
  (``latency`` after it starts when nothing else runs: the ~1300 ns fixed cost plus the bytes at the engines'
  bandwidth).
* Dependencies. An instruction starts when what it reads has been written (read after write) and what it
  writes is no longer read or written by an earlier instruction (write after read, write after write), by
  the Regions of the trace: an allocation slot, a partition range and a byte range. A compute result is
  visible ``DEPENDENCY_LATENCY_CYCLES`` after the engine finishes it (the ~100-cycle static overhead of
  dependent back-to-back instructions in the SDK's cost notes); a dependency between two queues also waits
  ``SEMAPHORE_WAIT_NS`` for the semaphore the producer signals and the consumer waits on.
* Cores. With lnc=2 the two programs of a launch run on two NeuronCores, each with its own engines and DMA
  engines; the launch's makespan is the later of the two. At a core_barrier or sendrecv the cores wait for each
  other: what either does after its k-th such point starts no earlier than the later core's arrival there.

[I] The semaphore figure and the dependency latency are inferences (the SDK documents the overheads, not
their exact size); what the model does not see: instruction fetch, SBUF bank conflicts, DMA descriptor
generation on GpSimd, HBM refresh and contention with other cores.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

from neuron_compile.runtime.simulator.trace import InstructionRecord, Region

DEPENDENCY_LATENCY_CYCLES = 100  # a result is visible this long after its engine finishes it [SDK cost notes]
SEMAPHORE_WAIT_NS = 50.0  # [I] a cross-queue dependency: the producer's semaphore increment seen by the consumer
DMA_QUEUES = ("dma_load", "dma_store", "dma_copy")
DMA_DESCRIPTOR_NS = 256.0  # [I] the engines' interleaving grain: about one 6 KiB descriptor at one engine's rate


@dataclass(frozen=True)
class InstructionCost:
    """What the scheduler needs of one instruction: its queue, and either an engine duration (compute) or a
    DMA transfer's latency, per-engine occupancy and engine count."""

    queue: str
    duration_ns: float = 0.0  # compute: engine busy time
    latency_ns: float = 0.0  # DMA: start to data landed
    occupancy_ns: float = 0.0  # DMA: busy time of each DMA engine it uses
    dma_engines: int = 0  # DMA: engines it is spread over
    visible_after_ns: float = 0.0  # compute: result visible this long after the engine finishes


@dataclass(frozen=True)
class Timing:
    queue: str
    start_ns: float
    end_ns: float  # the engine (or the transfer) is done
    visible_ns: float  # its results can be read from here on


@dataclass(frozen=True)
class Schedule:
    timings: tuple[Timing, ...]
    makespan_ns: float  # latest end over all cores
    makespan_ns_per_core: dict[int, float]
    wait_ns_per_queue: dict[str, float]  # per queue: idle time between its first start and its last end
    serial_ns: float  # every instruction one after another, each with its fixed costs (no overlap at all)

    def busiest_wait(self) -> str:
        if not self.wait_ns_per_queue:
            return "none"
        return max(self.wait_ns_per_queue, key=self.wait_ns_per_queue.get)


def dma_queue(record: InstructionRecord) -> str:
    """The DMA queue of a transfer: by direction."""
    dst = record.dst.buffer if record.dst is not None else "hbm"
    src = record.srcs[0].buffer if record.srcs else "hbm"
    if dst != "hbm" and src == "hbm":
        return "dma_load"
    if dst == "hbm" and src != "hbm":
        return "dma_store"
    return "dma_copy"


@dataclass
class _Memory:
    """The last accesses of every region seen so far, by memory id."""

    writes: dict[int, dict[Region, tuple[float, float, str]]] = field(default_factory=dict)  # region -> (visible, end, queue)
    reads: dict[int, dict[tuple[Region, str], float]] = field(default_factory=dict)  # (region, queue) -> end

    def ready_ns(self, record: InstructionRecord, queue: str) -> float:
        """The earliest start the record's dependencies allow."""
        ready = 0.0
        # A matmul accumulating into PSUM reads its destination, but successive matmuls of one accumulation
        # group stream into the bank back to back (the PSUM adds on arrival): on TensorE's own queue, in program
        # order, they need no result-visibility wait, only the previous one's end.
        accumulated = set(record.writes) if record.name == "nc_matmul" else set()
        for region in record.reads:
            if region not in accumulated:
                ready = max(ready, self._after_writes(region, queue))
        for region in record.writes:
            # [I] writes into HBM are not ordered after earlier writes: the hull of a strided HBM tile overlaps
            # its neighbours', and kernels do not write one HBM element twice
            if not region.hbm:
                ready = max(ready, self._after_writes(region, queue, in_order=region in accumulated))
            for (other, reader), end in self.reads.get(region.memory, {}).items():
                if other.overlaps(region):
                    ready = max(ready, end + (SEMAPHORE_WAIT_NS if reader != queue else 0.0))
        return ready

    def _after_writes(self, region: Region, queue: str, in_order: bool = False) -> float:
        """When ``region`` may be accessed from ``queue``: once earlier writes to it are visible (with a
        semaphore across queues); ``in_order``: a write that the queue's program order already keeps behind an
        earlier write of the same queue, which it may follow at once."""
        ready = 0.0
        for other, (visible, end, writer) in self.writes.get(region.memory, {}).items():
            if other.overlaps(region):
                if writer != queue:
                    ready = max(ready, visible + SEMAPHORE_WAIT_NS)
                else:
                    ready = max(ready, end if in_order else visible)
        return ready

    def update(self, record: InstructionRecord, queue: str, timing: Timing) -> None:
        for region in record.reads:
            reads = self.reads.setdefault(region.memory, {})
            key = (region, queue)
            reads[key] = max(reads.get(key, 0.0), timing.end_ns)
        for region in record.writes:
            # a write that covers earlier accesses supersedes them: later accesses wait for it, it waited for them
            writes = self.writes.setdefault(region.memory, {})
            for other in [r for r in writes if region.covers(r)]:
                del writes[other]
            reads = self.reads.get(region.memory, {})
            for key in [k for k in reads if region.covers(k[0])]:
                del reads[key]
            writes[region] = (timing.visible_ns, timing.end_ns, queue)


class _Units:
    """The busy intervals of a pool of identical units (one compute engine, or a core's 16 DMA engines). A
    unit's intervals are kept sorted and merged, so an engine that is never idle holds one interval."""

    def __init__(self, count: int):
        self.busy: list[list[list[float]]] = [[] for _ in range(count)]

    def _earliest_idle(self, unit: int, start: float, duration: float) -> float:
        """The earliest moment >= ``start`` from which ``unit`` stays idle for ``duration``."""
        intervals = self.busy[unit]
        index = bisect.bisect_right(intervals, [start, float("inf")])
        if index and intervals[index - 1][1] > start:
            index -= 1
        moment = start
        while index < len(intervals) and intervals[index][0] < moment + duration:
            moment = max(moment, intervals[index][1])
            index += 1
        return moment

    def _reserve(self, unit: int, start: float, end: float) -> None:
        intervals = self.busy[unit]
        index = bisect.bisect_right(intervals, [start, float("inf")])
        if index and intervals[index - 1][1] == start:  # extends the interval before it
            index -= 1
            intervals[index][1] = end
        else:
            intervals.insert(index, [start, end])
        if index + 1 < len(intervals) and intervals[index + 1][0] == end:  # and touches the one after
            intervals[index][1] = intervals.pop(index + 1)[1]

    def place(self, ready: float, duration: float, wanted: int = 1) -> float:
        """Reserve ``wanted`` units for ``duration`` ns from the earliest start >= ``ready`` at which that
        many are all idle; the start. No start before the ``wanted``-th earliest moment at which some unit is
        idle long enough can have that many idle units, so the search jumps there until it holds."""
        wanted = min(wanted, len(self.busy))
        start = ready
        while True:
            frees = sorted((self._earliest_idle(unit, start, duration), unit) for unit in range(len(self.busy)))
            if frees[wanted - 1][0] == start:
                for _, unit in frees[:wanted]:
                    self._reserve(unit, start, start + duration)
                return start
            start = frees[wanted - 1][0]


@dataclass
class _Core:
    """One NeuronCore's engines and DMA engines while its program is scheduled."""

    dma_engine_count: int
    engines: dict[str, _Units] = field(default_factory=dict)
    dma_engines: _Units = None
    memory: _Memory = field(default_factory=_Memory)
    end_ns: float = 0.0

    def __post_init__(self) -> None:
        self.dma_engines = _Units(self.dma_engine_count)

    def place(self, record: InstructionRecord, cost: InstructionCost, not_before: float = 0.0) -> Timing:
        """Start the instruction as early as its dependencies, a free engine and ``not_before`` (the release of
        the cores' last synchronization point) allow (the compiler's instruction scheduler reorders independent
        instructions; program order binds only through memory)."""
        queue = cost.queue
        ready = max(self.memory.ready_ns(record, queue), not_before)
        if cost.dma_engines:
            start, occupied_until = self._place_transfer(ready, cost)
            landed = occupied_until + max(0.0, cost.latency_ns - cost.occupancy_ns)
            timing = Timing(queue, start, landed, landed)
        else:
            engine = self.engines.setdefault(queue, _Units(1))
            start = engine.place(ready, cost.duration_ns)
            end = start + cost.duration_ns
            timing = Timing(queue, start, end, end + cost.visible_after_ns)
        self.memory.update(record, queue, timing)
        self.end_ns = max(self.end_ns, timing.end_ns)
        return timing


    def _place_transfer(self, ready: float, cost: InstructionCost) -> tuple[float, float]:
        """A transfer moves as a stream of descriptors, which the engines interleave with other queues'
        transfers: its occupancy is placed in pieces of at most ``DMA_DESCRIPTOR_NS``, each at the first idle
        moment after the previous piece. Its first piece's start, and its last piece's end."""
        start = None
        moment, remaining = ready, cost.occupancy_ns
        while True:
            piece = min(DMA_DESCRIPTOR_NS, remaining)
            piece_start = self.dma_engines.place(moment, piece, cost.dma_engines)
            start = piece_start if start is None else start
            moment, remaining = piece_start + piece, remaining - piece
            if remaining <= 0:
                return start, moment


def idle_ns_per_queue(timings: Sequence[Timing]) -> dict[str, float]:
    """Per queue, the time between its first start and its last end when none of its instructions ran."""
    by_queue: dict[str, list[Timing]] = {}
    for timing in timings:
        by_queue.setdefault(timing.queue, []).append(timing)
    idle = {}
    for queue, queue_timings in by_queue.items():
        queue_timings.sort(key=lambda t: t.start_ns)
        gaps, covered = 0.0, queue_timings[0].end_ns
        for timing in queue_timings[1:]:
            gaps += max(0.0, timing.start_ns - covered)
            covered = max(covered, timing.end_ns)
        idle[queue] = gaps
    return idle


class _Synchronizations:
    """The points where the cores of an LNC=2 launch wait for each other (core_barrier, sendrecv): the k-th such
    point of every program ends together, so what a program does after it starts no earlier than the last
    program's arrival there. The launch's trace lists every program's k-th point before anything after it."""

    def __init__(self, trace: Sequence[InstructionRecord]):
        self.programs = len({record.program for record in trace})
        self.passed: dict[int, int] = {}  # program -> synchronization points it has passed
        self.arrivals: list[list[float]] = []  # per point, the end of each program's instruction there

    def not_before(self, program: int) -> float:
        """The earliest start of the program's next instruction: when its last point released everyone."""
        passed = self.passed.get(program, 0)
        if not passed or self.programs < 2:  # a single core has no one to wait for at its barriers
            return 0.0
        arrivals = self.arrivals[passed - 1]
        return max(arrivals) if len(arrivals) >= self.programs else 0.0

    def arrive(self, program: int, end_ns: float) -> None:
        point = self.passed.get(program, 0)
        if point == len(self.arrivals):
            self.arrivals.append([])
        self.arrivals[point].append(end_ns)
        self.passed[program] = point + 1


SYNCHRONIZING = ("core_barrier", "sendrecv")


def schedule(trace: Sequence[InstructionRecord], costs: Sequence[InstructionCost], dma_engines: int = 16) -> Schedule:
    """Place every instruction of ``trace`` (program order: what it defines is which access comes first) on
    its core's engines; ``costs[i]`` is the cost of ``trace[i]``."""
    cores: dict[int, _Core] = {}
    timings = []
    serial = 0.0
    synchronizations = _Synchronizations(trace)
    for record, cost in zip(trace, costs):
        core = cores.get(record.program)
        if core is None:
            core = cores[record.program] = _Core(dma_engines)
        timing = core.place(record, cost, synchronizations.not_before(record.program))
        if record.name in SYNCHRONIZING:
            synchronizations.arrive(record.program, timing.end_ns)
        timings.append(timing)
        serial += (cost.latency_ns if cost.dma_engines else cost.duration_ns + cost.visible_after_ns)
        serial += SEMAPHORE_WAIT_NS if record.reads or record.writes else 0.0
    per_core = {program: core.end_ns for program, core in sorted(cores.items())}
    return Schedule(
        timings=tuple(timings),
        makespan_ns=max(per_core.values(), default=0.0),
        makespan_ns_per_core=per_core,
        wait_ns_per_queue=idle_ns_per_queue(timings),
        serial_ns=serial,
    )

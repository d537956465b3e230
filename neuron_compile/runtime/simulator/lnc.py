"""Simulator stage: the programs of one ``kernel[lnc]`` launch, run as concurrent NeuronCores.

Input: the kernel function and one KernelContext per program. Output: every program run to its end in its own
thread, sharing HBM (the launch's arguments and shared outputs), so that ``nisa.core_barrier`` and
``nisa.sendrecv`` between the programs synchronize and exchange data as on the two cores of an LNC=2 pair.

Deterministic by construction: one program runs at a time. A program runs until it reaches a synchronization
point (``sync``) or its end, then hands the turn to the next program that can run; once every program that has
not finished waits at the same point, the point releases them and they resume in program order. So a launch's
trace is the same on every run. A program that finishes while another waits for it, or two programs meeting at
different kinds of points, is the deadlock it would be on the device: a named error, not a hang.
"""

from __future__ import annotations

import threading

from neuron_compile.runtime.simulator.errors import NkiValidationError
from neuron_compile.runtime.simulator.memory import current, kernel_context


class ProgramGroup:
    """The turn-taking and the synchronization points of the programs of one launch."""

    def __init__(self, programs: int):
        self.programs = programs
        self.condition = threading.Condition()
        self.turn = 0
        self.finished: set[int] = set()
        self.waiting: dict[int, tuple[str, object]] = {}  # program -> (kind of point, its payload)
        self.released: dict[int, dict[int, object]] = {}  # program -> the payloads of its released point
        self.error: BaseException | None = None
        self.results: dict[int, object] = {}

    # ------------------------------------------------------------------------------------------ turns
    def _next_runnable(self, after: int) -> int | None:
        for step in range(1, self.programs + 1):
            candidate = (after + step) % self.programs
            if candidate not in self.finished and candidate not in self.waiting:
                return candidate
        return None

    def _wait_turn(self, program: int) -> None:
        while self.turn != program and self.error is None:
            self.condition.wait()
        if self.error is not None:
            raise NkiValidationError(
                "err_lnc_program_failed", f"program {program} stopped: another program of the launch failed "
                f"({type(self.error).__name__}: {self.error})",
            )

    def _check_deadlock(self) -> None:
        """Every unfinished program waits, and some program finished: it will never arrive."""
        live = set(range(self.programs)) - self.finished
        if self.waiting and self.finished and set(self.waiting) >= live:
            kinds = sorted({kind for kind, _ in self.waiting.values()})
            raise NkiValidationError(
                "err_lnc_deadlock", f"programs {sorted(self.waiting)} wait at a {'/'.join(kinds)} that programs "
                f"{sorted(self.finished)} finished without reaching",
            )

    def _release(self) -> None:
        kinds = {kind for kind, _ in self.waiting.values()}
        if len(kinds) > 1:
            raise NkiValidationError(
                "err_lnc_mismatched_sync", f"the programs meet at different synchronization points: "
                f"{ {program: kind for program, (kind, _) in self.waiting.items()} }",
            )
        payloads = {program: payload for program, (_, payload) in self.waiting.items()}
        for program in self.waiting:
            self.released[program] = payloads
        self.waiting = {}
        self.turn = min(payloads)

    # ------------------------------------------------------------------------------------------ points
    def sync(self, program: int, kind: str, payload=None) -> dict[int, object]:
        """Wait until every unfinished program reaches a point of this kind; returns their payloads."""
        with self.condition:
            self.waiting[program] = (kind, payload)
            self._check_deadlock()
            if set(self.waiting) >= set(range(self.programs)) - self.finished:
                self._release()
            else:
                self.turn = self._next_runnable(program)
            self.condition.notify_all()
            while program not in self.released and self.error is None:
                self.condition.wait()
            self._wait_turn(program)
            return self.released.pop(program)

    def _finish(self, program: int, error: BaseException | None) -> None:
        with self.condition:
            self.finished.add(program)
            if self.error is None:
                self.error = error
            if self.error is None:
                try:
                    self._check_deadlock()
                except NkiValidationError as deadlock:
                    self.error = deadlock
            if self.error is None:
                following = self._next_runnable(program)
                if following is not None:
                    self.turn = following
            self.condition.notify_all()

    def run(self, program: int, context, fn, args, kwargs) -> None:
        """Thread body: run program ``program`` of the kernel when its turn comes."""
        error = None
        try:
            with self.condition:
                self._wait_turn(program)
            with kernel_context(context):
                self.results[program] = fn(*args, **kwargs)
        except BaseException as failure:  # noqa: BLE001 - handed to the launching thread
            error = failure
        finally:
            self._finish(program, error)


def run_programs(fn, args, kwargs, contexts: list) -> object:
    """Run the kernel once per context, as concurrent programs; the last program's return value."""
    group = ProgramGroup(len(contexts))
    for context in contexts:
        context.program_group = group
    threads = [threading.Thread(target=group.run, args=(pid, context, fn, args, kwargs), name=f"nki-program-{pid}")
               for pid, context in enumerate(contexts)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if group.error is not None:
        raise group.error
    return group.results[len(contexts) - 1]


def program_group() -> ProgramGroup | None:
    """The running launch's group of concurrent programs (None with a single program)."""
    return getattr(current(), "program_group", None)

"""Simulator stage: replaying a validated kernel launch as its plan of numpy operations.

Input: a kernel function and its arguments' shapes and dtypes (the launch signature). Output, on the first launch
of a signature: the launch itself, run in full (every rule checked, the trace recorded as asked), and beside it a
``ReplayPlan``: each instruction's numpy work as a closure over the array views it resolved (``steps``), the
arrays holding the kernel's HBM arguments and the views its outputs are read from. On later launches of that
signature, ``ReplayPlan.run`` copies the new arguments in and runs the steps: no kernel Python, no views built, no
static rule checked again, nothing traced.

Why this is exact: a kernel is a meta-program whose loops and slices depend on its arguments' shapes only, so its
instructions, their operands' views and every static rule's outcome are the same at every launch of one signature.
The instructions build their steps once and run them on the first launch too (the same code, so a replay is
bit-identical by construction); what depends on values stays inside the steps: the valid input ranges of the
activation functions, indirect DMA offsets and their bounds. Each allocation is a step that fills it again (NaN, or
4 for ints), as a new buffer is, unless a step overwrites all of it before any step reads it.

Memory: a plan keeps the arrays its steps touch between launches. While recording, a new tile takes the array of a
released one of its size (its steps all come before), so a plan holds at most the tiles live at once, plus the
launch's HBM buffers.

What is not replayed (the recorder is refused, with the reason, and every launch of that signature is simulated in
full): values read outside an instruction's step (a kernel reading a tile, a register loaded from memory, a
dynamic ``scalar_offset``), any instruction that has not built its step (``rules.record`` refuses it), accumulator
register commands, random-number state, collectives, and launches of more than one program (LNC 2). Tensors the
recording launch made know its recorder (``Storage.recorder``), so a value read through ``NkiTensor.read`` /
``write`` / ``peek`` refuses it without any import of this module from tensor.py.

A plan is used by one thread at a time: a launch that finds it busy is simulated in full.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from neuron_compile.runtime.simulator.memory import current

Step = Callable[[], None]


class Recorder:
    """Collects the steps of one recording launch; ``refused`` holds why the launch cannot be replayed."""

    def __init__(self):
        self.steps: list[Step] = []
        self.refused: str | None = None
        self.step_pending = False  # an instruction ran its step and has not reached rules.record yet
        self.closed = False  # the kernel has returned: the launch's own output handling reads values freely
        # arrays of released on-chip tensors by (elements, dtype): the plan keeps every array its steps touch, so a
        # new tile takes a released one (its earlier steps all come before) instead of growing the plan's memory
        self.released: dict[tuple, list[np.ndarray]] = {}
        # id of an array whose fill no step has read yet -> that fill's index in steps: a step that overwrites the
        # whole array first makes the fill pointless, and it leaves the plan
        self.unread_fills: dict[int, int] = {}

    def refuse(self, reason: str) -> None:
        if self.refused is None and not self.closed:
            self.refused = reason
            self.steps = []

    def add(self, step: Step) -> None:
        if self.refused is None:
            self.steps.append(step)

    def fill_on_replay(self, data: np.ndarray, value) -> None:
        """A new buffer's fill, as a step (the same array is filled again at every replay)."""
        self.unread_fills[id(data)] = len(self.steps)
        self.add(lambda: np.copyto(data, value, casting="unsafe"))  # as np.full fills

    def array_used(self, data: np.ndarray) -> None:
        """A step will read ``data`` (or may: every use counts): its fill stays in the plan."""
        self.unread_fills.pop(id(data), None)

    def array_overwritten(self, data: np.ndarray) -> None:
        """A step will write every element of ``data`` before any step reads it: its fill can go (None in
        ``steps`` until the plan is built, so that the other fills' indices hold)."""
        index = self.unread_fills.pop(id(data), None)
        if index is not None and self.refused is None:
            self.steps[index] = None

    def reused_array(self, size: int, dtype: np.dtype) -> np.ndarray | None:
        """A released on-chip array of ``size`` elements of ``dtype`` to hold a new tile, or None."""
        arrays = self.released.get((size, dtype.str))
        # once refused, no reuse: the kernel's Python may hold an array it read, which a reuse would overwrite
        return arrays.pop() if arrays and self.refused is None else None

    def release_when_dead(self, storage) -> None:
        """Pool ``storage``'s array once no tensor refers to the storage (no later instruction can touch it)."""
        data = storage.data
        weakref.finalize(storage, self.released.setdefault((data.size, data.dtype.str), []).append, data)

    def value_accessed(self, tensor) -> None:
        """A tensor's values were read or written outside an instruction's step (tensor.py calls this)."""
        self.refuse(f"the values of {tensor.name} are accessed outside an instruction's step")

    def instruction_recorded(self, name: str) -> None:
        """rules.record of an instruction: it must have run a step since the last one."""
        if not self.step_pending:
            self.refuse(f"instruction {name} has no replay step")
        self.step_pending = False


def run_step(step: Step) -> None:
    """Run one instruction's numpy work, and keep it in the launch's plan when the launch records one."""
    recorder = current().recorder
    step()
    if recorder is not None:
        recorder.add(step)
        recorder.step_pending = True


def refuse_replay(reason: str) -> None:
    """The running launch does something a replay cannot repeat: simulate every launch of it in full."""
    recorder = current().recorder
    if recorder is not None:
        recorder.refuse(reason)


@dataclass(eq=False)
class ReplayPlan:
    """A launch's numpy work: its steps, the arrays its arguments are copied into, the views its outputs are read
    from, which arguments it writes (copied back, as a launch writes the caller's array), and the launch's
    capacity figures (a replay reports the first launch's)."""

    steps: list[Step]
    inputs: list[np.ndarray]
    outputs: list[np.ndarray]
    written_inputs: list[int]
    sbuf_peak_bytes: int
    psum_peak_banks: int
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def run(self, arguments: list[np.ndarray]) -> list[np.ndarray] | None:
        """The outputs of a launch on ``arguments`` (copies), or None when another thread holds the plan."""
        if not self.lock.acquire(blocking=False):
            return None
        try:
            for array, argument in zip(self.inputs, arguments):
                np.copyto(array, argument.reshape(-1))
            for step in self.steps:
                step()
            for index in self.written_inputs:
                np.copyto(arguments[index], self.inputs[index].reshape(arguments[index].shape))
            return [np.array(view) for view in self.outputs]
        finally:
            self.lock.release()


# kernel function -> {launch signature: ReplayPlan, or the reason it cannot be replayed}; a plan dies with its function
_plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_plans_lock = threading.Lock()


def build_plan(recorder: Recorder, arguments: list, outputs: list, sbuf_peak_bytes: int,
               psum_peak_banks: int) -> ReplayPlan | str:
    """The plan of a finished recording launch (its HBM argument tensors and output tensors), or why it has none."""
    recorder.closed = True
    if recorder.refused is not None:
        return recorder.refused
    return ReplayPlan(
        steps=[step for step in recorder.steps if step is not None],
        inputs=[tensor.storage.data for tensor in arguments],
        outputs=[tensor.array_view() for tensor in outputs],
        written_inputs=[index for index, tensor in enumerate(arguments) if tensor.storage.written],
        sbuf_peak_bytes=sbuf_peak_bytes,
        psum_peak_banks=psum_peak_banks,
    )


def launch_signature(arguments, target_name: str, lnc: int) -> tuple | None:
    """What a plan is valid for: the target and each argument's shape and dtype; None when a launch cannot be
    replayed at all (an argument that is not a numpy array, LNC 2)."""
    if lnc != 1 or not all(isinstance(argument, np.ndarray) for argument in arguments):
        return None
    return (target_name, *((argument.shape, argument.dtype.str) for argument in arguments))


def known(function, signature: tuple):
    """The plan (or the refusal reason, a str) recorded for ``function`` at ``signature``; None if none yet."""
    with _plans_lock:
        return _plans.get(function, {}).get(signature)


def remember(function, signature: tuple, plan: ReplayPlan | str) -> None:
    with _plans_lock:
        _plans.setdefault(function, {}).setdefault(signature, plan)


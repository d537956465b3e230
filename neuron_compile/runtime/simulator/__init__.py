"""Simulator stage: the ``nki`` module itself — ``jit``, ``simulate``, ``language``, ``isa`` — and ``run_kernel``.

The compiler reaches it only through ``runtime/launcher.py`` (``SimulatorLauncher``); ``neuron-compile
simulate`` and ``demo_kernels`` are its other front ends.

Input: an NKI kernel (a ``@nki.jit`` object, a plain kernel function, or NKI source text via ``load_module``)
and its arguments (numpy arrays or torch tensors, plus Python scalars). Output: the kernel's returned
``nl.shared_hbm`` tensors as numpy arrays (torch tensors when called with torch tensors), and a ``KernelRun``
with the instruction trace and the target, whose ``report`` is the cost model's CostReport.

``load_module`` and ``nki_import_alias`` bind ``import nki`` / ``nki.language`` / ``nki.isa`` (and
``nki.isa.constants``, ``nki.dtype``, ``nki.typing``, ``nki.collectives``, and the same modules under the legacy
``neuronxcc.nki``) in NKI source to this package: the first through a private ``__import__`` in the module's
builtins (no global state), the second through sys.modules for the duration of a ``with`` block.
"""

from __future__ import annotations

import builtins
import dataclasses
import functools
import linecache
import sys
import types
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from neuron_compile.runtime.simulator import collectives, dtypes, isa, isa_constants, language
from neuron_compile.runtime.simulator import lnc as lnc_programs
from neuron_compile.runtime.simulator import ops
from neuron_compile.runtime.simulator import replay as replays
from neuron_compile.runtime.simulator import nki_typing as typing
from neuron_compile.runtime.simulator.blas_threads import single_threaded_blas
from neuron_compile.runtime.simulator.errors import NkiCapacityError, NkiNotSimulatedError, NkiValidationError
from neuron_compile.hardware import Target, get_target
from neuron_compile.runtime.simulator.memory import KernelContext, hbm_input, inside_launch, kernel_context
from neuron_compile.runtime.simulator.tensor import NkiTensor
from neuron_compile.runtime.simulator.trace import InstructionRecord

__all__ = ["jit", "simulate", "language", "isa", "collectives", "typing", "dtype", "run_kernel", "load_module",
           "kernel_filename", "nki_import_alias", "KernelRun", "Kernel", "launch_hooks", "NkiValidationError",
           "NkiCapacityError", "NkiNotSimulatedError"]

# Callables receiving every KernelRun after a launch (the CLI's --report registers one).
launch_hooks: list = []


@dataclass
class KernelRun:
    """One launch: the kernel's outputs, its instruction trace and the target it ran on."""

    outputs: list[np.ndarray]
    trace: list[InstructionRecord] | None  # None: launched with ``trace=False`` (no instruction recorded, no report)
    target: Target
    sbuf_peak_bytes: int = 0  # most SBUF bytes per partition live at once (any program of the launch)
    psum_peak_banks: int = 0  # most PSUM banks live at once
    collectives: list = field(default_factory=list)  # a collectives.CollectiveRecord per nki.collectives call
    # the replay plan this launch recorded (replay.ReplayPlan), or why it could not (a str); None: it recorded none
    plan: object = None

    @functools.cached_property
    def report(self):
        from neuron_compile.runtime.simulator import cost  # written separately; imported only when asked

        if self.trace is None:
            raise ValueError("this launch ran with trace=False: it recorded no instruction, so it has no cost report")
        report = cost.cost_report(self.trace, self.target)  # the collectives' times come from their trace records
        if not self.collectives:
            return report
        return dataclasses.replace(report, collectives=tuple(self.collectives))


def _is_torch(value) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "detach")


def _to_numpy(value) -> np.ndarray:
    import torch

    tensor = value.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:
        return tensor.float().numpy().astype(language.bfloat16)
    return tensor.numpy()


def _to_torch(array: np.ndarray):
    import torch

    if array.dtype == language.bfloat16:
        return torch.from_numpy(array.astype(np.float32)).to(torch.bfloat16)
    if array.dtype.name.startswith("float8"):
        return torch.from_numpy(array.astype(np.float32))
    return torch.from_numpy(np.ascontiguousarray(array))


def _kernel_argument(value, name: str):
    if isinstance(value, np.ndarray):
        return hbm_input(value, name)
    if _is_torch(value):
        return hbm_input(_to_numpy(value), name)
    if isinstance(value, (list, tuple)) and any(isinstance(v, np.ndarray) or _is_torch(v) for v in value):
        return type(value)(_kernel_argument(v, f"{name}_{i}") for i, v in enumerate(value))
    return value


def _write_back_mutated_inputs(originals: list, tensors: list) -> None:
    """A kernel that writes into an input HBM tensor mutates the caller's array, as on the device."""
    for original, tensor in zip(originals, tensors):
        if isinstance(tensor, (list, tuple)) and isinstance(original, (list, tuple)):
            _write_back_mutated_inputs(list(original), list(tensor))
        elif isinstance(tensor, NkiTensor) and tensor.storage.written:
            values = tensor.storage.data.reshape(tensor.shape)
            if isinstance(original, np.ndarray) and original.flags.writeable:
                np.copyto(original, values.astype(original.dtype, copy=False))
            elif _is_torch(original):
                import torch

                with torch.no_grad():
                    original.copy_(_to_torch(values).to(original.dtype))


def _collect_outputs(result) -> list[NkiTensor]:
    if result is None:
        return []
    if isinstance(result, NkiTensor):
        return [result]
    if isinstance(result, (tuple, list)):
        outputs = []
        for item in result:
            outputs.extend(_collect_outputs(item))
        return outputs
    raise NkiValidationError(
        "err_kernel_output", f"a kernel returns nl.shared_hbm tensors, got {type(result).__name__}"
    )


def _input_storages(arguments) -> set[int]:
    """Ids of the storages of the kernel's HBM tensor arguments (nested lists and tuples included)."""
    found = set()
    for value in arguments:
        if isinstance(value, NkiTensor):
            found.add(id(value.storage))
        elif isinstance(value, (list, tuple)):
            found |= _input_storages(value)
    return found


def _check_output(tensor: NkiTensor, input_storages: set[int]) -> None:
    """A kernel returns nl.shared_hbm tensors it allocated, or HBM tensors it was given (written in place)."""
    if tensor.buffer is not language.shared_hbm and id(tensor.storage) not in input_storages:
        raise NkiValidationError(
            "err_output_must_be_shared_hbm",
            f"kernel output {tensor.name} is in {tensor.buffer}; kernel outputs must be nl.shared_hbm tensors the "
            "kernel allocates, or HBM tensors it was given",
        )
    if not tensor.storage.written:
        raise NkiValidationError(
            "err_tensor_output_not_written_to", f"kernel output {tensor.name} {tensor.shape} is never written"
        )


def _output_array(tensor: NkiTensor) -> np.ndarray:
    """The output's values; a whole, contiguous allocation is handed over without a copy."""
    data = tensor.storage.data
    if tensor.offset == 0 and tensor.size == data.size and tensor.is_contiguous() and tensor.dtype == data.dtype:
        return data.reshape(tensor.shape)
    return np.array(tensor.read())


def _launch(fn, args, kwargs, target: Target, lnc: int, traced: bool = True,
            recorder: replays.Recorder | None = None) -> tuple[KernelRun, object]:
    """Run the kernel in full; with a ``recorder`` (LNC 1 only), record its replay plan beside (``run.plan``)."""
    if lnc not in (1, 2):
        raise NkiValidationError("err_lnc", f"kernel[lnc]: lnc must be 1 or 2, got {lnc}")
    names = getattr(fn, "__code__", None)
    arg_names = names.co_varnames[: names.co_argcount] if names else ()
    hbm_args = [_kernel_argument(a, arg_names[i] if i < len(arg_names) else f"arg{i}") for i, a in enumerate(args)]
    hbm_kwargs = {k: _kernel_argument(v, k) for k, v in kwargs.items()}
    for tensor in hbm_args if recorder is not None else ():
        tensor.storage.recorder = recorder
    trace: list[InstructionRecord] | None = [] if traced else None
    shared_outputs: list[NkiTensor] = []
    result = None
    sbuf_peak = psum_peak = 0
    collective_records: list = []
    contexts = [KernelContext(target=target, program_id=pid, num_programs=lnc, trace=trace,
                              shared_reuse=shared_outputs, launched=True, launch_frame=sys._getframe(),
                              recorder=recorder)
                for pid in range(lnc)]
    # thousands of small matmuls: threads cost more than they give
    with single_threaded_blas(), ops.float_errors_ignored():
        if lnc == 1:
            with kernel_context(contexts[0]):
                result = fn(*hbm_args, **hbm_kwargs)
        else:  # the programs run as concurrent NeuronCores, so core_barrier and sendrecv between them work
            result = lnc_programs.run_programs(fn, hbm_args, hbm_kwargs, contexts)
    for context in contexts:
        sbuf_peak = max(sbuf_peak, context.sbuf_peak_bytes)
        psum_peak = max(psum_peak, context.psum_peak_banks)
        collective_records.extend(context.collectives)
        if context.collectives and recorder is not None:
            recorder.refuse("collectives exchange values with other processes")
    _write_back_mutated_inputs([*args, *kwargs.values()], [*hbm_args, *hbm_kwargs.values()])
    outputs = _collect_outputs(result)
    inputs = _input_storages([*hbm_args, *hbm_kwargs.values()])
    for tensor in outputs:
        _check_output(tensor, inputs)
    plan = replays.build_plan(recorder, hbm_args, outputs, sbuf_peak, psum_peak) if recorder is not None else None
    arrays = [_output_array(t) for t in outputs]
    run = KernelRun(outputs=arrays, trace=trace, target=target, sbuf_peak_bytes=sbuf_peak, psum_peak_banks=psum_peak,
                    collectives=collective_records, plan=plan)
    for hook in list(launch_hooks):
        hook(run)
    return run, result


def _package(result, arrays: list[np.ndarray], as_torch: bool):
    converted = [_to_torch(a) for a in arrays] if as_torch else arrays
    if isinstance(result, (tuple, list)):
        return type(result)(converted) if len(converted) == len(result) else tuple(converted)
    return converted[0] if converted else None


class Kernel:
    """A ``@nki.jit`` kernel: call it with arrays; ``kernel[lnc](...)`` launches lnc programs."""

    def __init__(self, fn, lnc: int = 1, target: Target | str | None = None, **options):
        self.fn = fn
        self.lnc = lnc
        self.target = target
        self.options = options
        self.last_run: KernelRun | None = None
        functools.update_wrapper(self, fn)

    def __getitem__(self, lnc) -> Kernel:
        if isinstance(lnc, tuple):
            if len(lnc) != 1:
                raise NkiValidationError("err_lnc", f"kernel[...] must contain only one number (the LNC), got {lnc}")
            lnc = lnc[0]
        launched = Kernel(self.fn, int(lnc), self.target, **self.options)
        launched._parent = self
        return launched

    def _resolved_target(self) -> Target:
        return self.target if isinstance(self.target, Target) else get_target(self.target)

    def __call__(self, *args, **kwargs):
        if inside_launch():
            return self.fn(*args, **kwargs)  # called from another kernel: inline, as NKI does
        as_torch = any(_is_torch(a) for a in args)
        run, result = _launch(self.fn, args, kwargs, self._resolved_target(), self.lnc)
        self.last_run = run
        parent = getattr(self, "_parent", None)
        if parent is not None:
            parent.last_run = run
        return _package(result, run.outputs, as_torch)


def jit(fn=None, **options):
    """``@nki.jit`` / ``@nki.jit(...)``: a Kernel running on this simulator."""
    if fn is None:
        return lambda f: Kernel(f, **options)
    return Kernel(fn, **options)


def simulate(kernel):
    """``nki.simulate(kernel)``: a callable running the kernel on the CPU simulator."""
    target = kernel if isinstance(kernel, Kernel) else Kernel(kernel)
    return target


def run_kernel(fn, args, *, target: Target | str | None = None, lnc: int = 1, trace: bool = True,
               replay: bool = False) -> KernelRun:
    """Launch ``fn`` (a Kernel or a plain kernel function) on numpy/torch ``args``; return the KernelRun.

    ``trace=False`` records no trace (its run has no report): for a caller that already holds the report of an
    identical launch (runtime/launcher.py). With ``launch_hooks`` registered, the launch is traced anyway: the hooks
    read its report. ``replay=True`` (numpy arguments, LNC 1): the first launch of a signature also records its
    replay plan (replay.py), and a later untraced launch of it runs that plan instead of the kernel."""
    body = fn.fn if isinstance(fn, Kernel) else fn
    resolved = target if isinstance(target, Target) else get_target(target)
    traced = trace or bool(launch_hooks)
    signature = replays.launch_signature(args, resolved.name, lnc) if replay else None
    plan = replays.known(body, signature) if signature is not None else None
    run = _replayed(plan, args, resolved) if isinstance(plan, replays.ReplayPlan) and not traced else None
    if run is None:
        recorder = replays.Recorder() if signature is not None and plan is None else None
        run, _ = _launch(body, tuple(args), {}, resolved, lnc, traced=traced, recorder=recorder)
        if recorder is not None:
            replays.remember(body, signature, run.plan)
    if isinstance(fn, Kernel):
        fn.last_run = run
    return run


def _replayed(plan: replays.ReplayPlan, args, target: Target) -> KernelRun | None:
    """A launch as its plan's replay (no trace), or None when another thread is replaying the plan."""
    # as the recording launch ran: the same BLAS calls give the same bits
    with single_threaded_blas(), ops.float_errors_ignored():
        outputs = plan.run(list(args))
    if outputs is None:
        return None
    return KernelRun(outputs=outputs, trace=None, target=target, sbuf_peak_bytes=plan.sbuf_peak_bytes,
                     psum_peak_banks=plan.psum_peak_banks)


# ------------------------------------------------------------------------------------------------ imports
_SELF = sys.modules[__name__]
dtype = dtypes  # ``nki.dtype``: published kernels annotate dtype arguments with it
_SUBMODULES = {"nki": _SELF, "nki.language": language, "nki.isa": isa, "nki.isa.constants": isa_constants,
               "nki.typing": typing, "nki.collectives": collectives, "nki.dtype": dtypes}
# The legacy namespace of the neuronx-cc wheel, which published kernels still name in type hints
# (``import neuronxcc.nki.typing as nt``): the same modules under ``neuronxcc.nki``.
_LEGACY_ROOT = types.ModuleType("neuronxcc", "neuronxcc.nki as the neuron_compile simulator (an import alias)")
_LEGACY_ROOT.nki = _SELF
_ALIASES = {**_SUBMODULES, "neuronxcc": _LEGACY_ROOT,
            **{f"neuronxcc.{name}": module for name, module in _SUBMODULES.items()}}


def _aliased(name: str) -> bool:
    return name.split(".")[0] in ("nki", "neuronxcc")


def _alias_import(name, globals=None, locals=None, fromlist=(), level=0):  # noqa: A002 - __import__ signature
    if level == 0 and _aliased(name):
        if name not in _ALIASES:
            raise ImportError(f"{name} is not simulated by neuron_compile (available: {sorted(_ALIASES)})")
        return _ALIASES[name] if fromlist else _ALIASES[name.split(".")[0]]
    return builtins.__import__(name, globals, locals, fromlist, level)


def kernel_filename(name: str) -> str:
    """The file name kernel text ``name`` is compiled under (linecache holds the text under it)."""
    return f"<nki-kernel {name}>"


def load_module(source: str, name: str, *, code: types.CodeType | None = None,
                builtins_for: Callable[[Callable], dict] | None = None) -> types.ModuleType:
    """Execute NKI source text as module ``name`` with ``nki`` bound to this simulator (no sys.modules change).

    ``code``: the text already compiled (under ``kernel_filename(name)``), as the launcher does from a checked syntax
    tree; ``builtins_for``: given this module's import hook, the module's whole ``__builtins__`` (the launcher's
    restricted set for generated kernels); None: every builtin, for kernels people write."""
    module = types.ModuleType(name)
    filename = kernel_filename(name)
    module.__file__ = filename
    if builtins_for is None:
        module_builtins = dict(builtins.__dict__)
        module_builtins["__import__"] = _alias_import
    else:
        module_builtins = builtins_for(_alias_import)
    module.__dict__["__builtins__"] = module_builtins
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    # dont_inherit: the source gets its own __future__ flags, not this module's (postponed annotations would send
    # dataclasses looking the module up in sys.modules, where a loaded kernel module never is)
    if code is None:
        code = compile(source, filename, "exec", dont_inherit=True)
    exec(code, module.__dict__)
    return module


@contextmanager
def nki_import_alias():
    """Make ``import nki`` (and nki.language, nki.isa, ..., and the legacy ``neuronxcc.nki``) resolve to this
    simulator until the block exits; the previous sys.modules entries are put back then."""
    saved = {key: sys.modules.get(key) for key in _ALIASES}
    sys.modules.update(_ALIASES)
    try:
        yield _SELF
    finally:
        for key, previous in saved.items():
            if previous is None:
                sys.modules.pop(key, None)
            else:
                sys.modules[key] = previous

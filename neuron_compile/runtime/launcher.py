"""Runtime stage: the launcher seam, where a compiled region's kernels are loaded and run.

Input: a kernel's ``KernelSource`` (its NKI text, the buffers it reads in argument order, the buffers it
returns) to ``load``; then, per launch, the loaded kernel and one flat torch tensor per parameter (the storage
span the kernel's access patterns read, in the kernel's dtype: float32, bfloat16, bool or int32) to ``launch``.
Output of ``launch``: one torch tensor per output buffer, allocated by torch on the CPU so that it owns its
storage (FSDP2 calls ``untyped_storage().resize_(0)`` on parameters, the Trainer writes into outputs in place;
a ``torch.from_numpy`` view of numpy memory cannot be resized), and the launch's cost report, or None when the
launcher has no cost model.

``Launcher``           the interface: ``load(source) -> LoadedKernel``, ``launch(kernel, tensors) -> (outputs,
                       report)``. Both paths get the same kernel text; each binds ``import nki`` /
                       ``nki.language`` / ``nki.isa`` in it to its own modules through the loaded module's
                       ``__import__`` (no sys.modules change, nothing left behind). Loading is the one place
                       generated kernel text is executed, fresh or read back from the on-disk cache: ``checked_code``
                       compiles it only when it stays inside the subset the templates emit (codegen/kernel_check.py,
                       else ``KernelTextError``), and it runs with only the builtins that subset uses and an
                       ``__import__`` that resolves the ``nki`` package alone.
``SimulatorLauncher``  the built-in numpy simulator (``neuron_compile.runtime.simulator``): torch tensors to
                       numpy (bfloat16 through ml_dtypes, bool as uint8), ``simulator.run_kernel``, outputs
                       copied into torch-allocated tensors; the report is the simulator's ``CostReport`` (a
                       kernel's first launch per signature reads it from the on-disk cache when it is there:
                       runtime/report_cache.py; that launch then records no trace either). With ``replay``
                       (``NEURON_COMPILE_REPLAY``), a later launch of a signature replays the first one's numpy
                       work (runtime/simulator/replay.py).
``DeviceLauncher``     the real ``nki.jit`` on a Neuron device: the inputs moved to the device, the kernel called
                       with torch tensors, its outputs copied back into torch-allocated CPU tensors; no report.
``select_launcher``    ``Config.launcher`` (``NEURON_COMPILE_LAUNCHER``): ``auto`` (the device where the real
                       ``nki`` imports and a Neuron device is present, else the simulator), ``simulator``,
                       ``device`` (a ``LauncherError`` saying what is missing where it cannot work).

What a Neuron host needs for ``DeviceLauncher`` (none of it exists on the CPU machines the tests run on; the
tests drive it with a stand-in ``nki`` module passed to the constructor):

* A Trainium / Inferentia2 instance whose Neuron driver exposes the devices as ``/dev/neuron0``, ... (that is
  what ``neuron_device_present`` looks for) and the Neuron runtime.
* The Neuron SDK's NKI package importable as ``nki`` (the modern namespace: ``nki.jit``, ``nki.language``,
  ``nki.isa``, which the generated kernels import), and torch-neuronx, which makes torch tensors live on the
  device and lets ``nki.jit`` kernels be called with them. The launcher moves inputs with
  ``tensor.to(device)``: pass ``DeviceLauncher(device=...)`` to choose the device; by default it is
  ``torch_xla``'s ``xla_device()`` when ``torch_xla`` imports, else ``"neuron"``.
* ``Config.target`` / ``NEURON_PLATFORM_TARGET_OVERRIDE`` naming the instance's generation (trn1, trn2, trn3):
  the kernels are tiled for the configured target, and ``nki.jit`` reads the override as well.
* ``nki.jit`` reads a kernel's Python source (``inspect.getsource``): ``load`` registers the text in
  ``linecache`` under the loaded module's file name ``<nki-kernel NAME>``, where inspect finds it.
* Kernels run with LNC 1 (``kernel(...)``, not ``kernel[2](...)``), so ``NEURON_LOGICAL_NC_CONFIG`` must be
  unset or 1.
"""

from __future__ import annotations

import abc
import dataclasses
import glob
import importlib
import importlib.util
import linecache
import types

import ml_dtypes
import numpy as np
import torch

from neuron_compile import config as config_module
from neuron_compile.codegen.kernel_check import check_kernel_text, kernel_builtins
from neuron_compile.codegen.kernel_source import KernelSource
from neuron_compile.hardware import Target, get_target
from neuron_compile.kernel_dtypes import TORCH_DTYPES
from neuron_compile.runtime import simulator
from neuron_compile.runtime.report_cache import ReportCache, open_report_cache
from neuron_compile.runtime.signed_code import SignedCodeCache, open_signed_code_cache
from neuron_compile.runtime.simulator.cost import CostReport

# The simulator's numpy dtype of each (bool buffers are uint8 arrays, as NKI's bool_ is a byte).
NUMPY_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "bool": np.uint8, "int32": np.int32}
NEURON_DEVICE_PATTERN = "/dev/neuron[0-9]*"


class LauncherError(RuntimeError):
    """A launcher was asked for where it cannot work (``launcher=device`` without the real nki or a device)."""


@dataclasses.dataclass
class LoadedKernel:
    """A kernel ready to launch: its source and the launcher's callable for it (a ``nki.jit`` object).

    ``reports``: the cost report of its first launch per argument signature (the arguments' shapes and dtypes, and
    the target). A generated kernel is a meta-program whose loops unroll and whose branches test shapes, never
    values, so its instruction trace, and the report made from it, is a function of that signature: later
    launches reuse the report instead of recording and scheduling the same trace (the stats of a repeated call are
    those of the first), and replay the first launch's numpy work (runtime/simulator/replay.py)."""

    source: KernelSource
    function: object
    reports: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)


class Launcher(abc.ABC):
    """Loads kernel sources and launches them on torch tensors (see the module docstring)."""

    name: str = ""

    @abc.abstractmethod
    def load(self, source: KernelSource) -> LoadedKernel:
        """Execute the kernel text with ``nki`` bound to this launcher's modules; return the kernel."""

    @abc.abstractmethod
    def launch(self, kernel: LoadedKernel, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], CostReport | None]:
        """Run ``kernel`` on one flat tensor per parameter; return its outputs (torch-allocated) and report."""

    def launch_function(self, function, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], CostReport | None]:
        """Run a kernel function (a hand-written ``@nki.jit`` kernel, not loaded from text) on ``tensors`` of its
        own shapes; return its outputs in the dtypes it produced (torch-allocated) and the report."""
        raise LauncherError(f"{type(self).__name__} cannot launch kernel functions")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def checked_code(source: KernelSource, signed: SignedCodeCache | None = None) -> types.CodeType:
    """The kernel text compiled from its syntax tree once codegen/kernel_check.py admits it (``KernelTextError``
    names the rule and the line it breaks otherwise): a text read back from a shared cache folder is executed only
    when it is what our templates emit. With ``signed``, code this user's process checked and compiled before is
    taken from there (runtime/signed_code.py: only under a tag the user's own key made), and new code is kept."""
    filename = simulator.kernel_filename(source.name)
    parts = signed.key_parts(source.source, filename) if signed is not None else None
    code = signed.lookup(parts) if signed is not None else None
    if code is None:
        tree = check_kernel_text(source.source, source.name)
        code = compile(tree, filename, "exec", dont_inherit=True)
        if signed is not None:
            signed.store(parts, code)
    return code


# ------------------------------------------------------------------------------------------------ simulator
def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A kernel argument as the simulator takes it: bfloat16 as ml_dtypes.bfloat16, bool as uint8. Read from a
    torch copy: ``Tensor.numpy()`` marks the storage it views as not resizable for good, and the caller's tensor
    (an FSDP2 parameter) must stay resizable."""
    copy = tensor.detach().to("cpu", copy=True)
    if copy.dtype == torch.bfloat16:
        return copy.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if copy.dtype == torch.bool:
        return copy.numpy().view(np.uint8)
    return copy.numpy()


def to_owned_tensor(array: np.ndarray, dtype: str) -> torch.Tensor:
    """A simulator output as a tensor of the buffer dtype's torch type, copied into torch-allocated memory: it
    owns a resizable storage, unlike a ``torch.from_numpy`` view (or any tensor whose ``.numpy()`` was taken)."""
    array = np.ascontiguousarray(array)
    if dtype == "bfloat16":
        view = torch.from_numpy(array.astype(ml_dtypes.bfloat16, copy=False).view(np.int16)).view(torch.bfloat16)
    elif dtype == "bool":
        view = torch.from_numpy(array != 0)
    else:
        view = torch.from_numpy(array.astype(NUMPY_DTYPES[dtype], copy=False))
    return view.clone()


def buffer_dtype(array: np.ndarray) -> str:
    """The buffer dtype name of a simulator output array (uint8 is NKI's bool); LauncherError for any other."""
    for name, numpy_dtype in NUMPY_DTYPES.items():
        if array.dtype == numpy_dtype:
            return name
    raise LauncherError(f"a kernel output of dtype {array.dtype} has no torch counterpart here "
                        f"(supported: {sorted(NUMPY_DTYPES)})")


class SimulatorLauncher(Launcher):
    """Kernels on the built-in numpy simulator, on ``target`` (a Target or its name; None: the default)."""

    name = "simulator"

    def __init__(self, target: Target | str | None = None, stored_reports: ReportCache | None = None,
                 replay: bool = True, signed_code: SignedCodeCache | None = None):
        self.target = target if isinstance(target, Target) else get_target(target)
        self.stored_reports = stored_reports  # first-launch reports on disk (runtime/report_cache.py), or None
        self.replay = replay  # launches after a signature's first replay its recorded plan
        self.signed_code = signed_code  # checked kernel code on disk (runtime/signed_code.py), or None

    def load(self, source: KernelSource) -> LoadedKernel:
        module = simulator.load_module(source.source, source.name, code=checked_code(source, self.signed_code),
                                       builtins_for=kernel_builtins)
        return LoadedKernel(source, getattr(module, source.name))

    def launch(self, kernel: LoadedKernel, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], CostReport]:
        arrays = [to_numpy(tensor) for tensor in tensors]
        signature = (self.target.name, *[(array.shape, array.dtype) for array in arrays])
        report = kernel.reports.get(signature)
        if report is None and self.stored_reports is not None:
            report = self.stored_reports.lookup(kernel.source.name, kernel.source.source, signature)
        run = simulator.run_kernel(kernel.function, arrays, target=self.target, trace=report is None,
                                   replay=self.replay)
        if report is None and self.stored_reports is not None:
            self.stored_reports.store(kernel.source.name, kernel.source.source, signature, run.report)
        report = kernel.reports.setdefault(signature, report or run.report)  # threads racing keep one report
        outputs = [to_owned_tensor(np.asarray(array), buffer.dtype)
                   for buffer, array in zip(kernel.source.outputs, run.outputs)]
        return outputs, report

    def launch_function(self, function, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], CostReport]:
        run = simulator.run_kernel(function, [to_numpy(tensor) for tensor in tensors], target=self.target)
        arrays = [np.asarray(array) for array in run.outputs]
        return [to_owned_tensor(array, buffer_dtype(array)) for array in arrays], run.report

    def __repr__(self) -> str:
        return f"SimulatorLauncher(target={self.target.name!r})"


# ------------------------------------------------------------------------------------------------ device
def real_nki_available() -> bool:
    """The real NKI package imports as ``nki`` (the simulator aliased as ``nki`` does not count)."""
    try:
        spec = importlib.util.find_spec("nki")
    except (ImportError, ValueError):
        return False
    return spec is not None and spec.name == "nki"


def neuron_device_present() -> bool:
    return bool(glob.glob(NEURON_DEVICE_PATTERN))


def default_device() -> torch.device | str:
    """Where torch-neuronx keeps device tensors: torch_xla's device when torch_xla imports, else "neuron"."""
    if importlib.util.find_spec("torch_xla") is not None:
        from torch_xla.core import xla_model

        return xla_model.xla_device()
    return "neuron"


def _bound_import(nki_module: types.ModuleType):
    """An ``__import__`` resolving ``nki`` and ``nki.<sub>`` to ``nki_module`` and its submodules (a real
    package's submodules are imported on first use, as ``import nki.isa`` would). ``kernel_builtins`` hands it the
    ``nki`` package's names alone."""

    def resolve(name: str) -> types.ModuleType:
        module, path = nki_module, nki_module.__name__
        for sub in name.split(".")[1:]:
            path = f"{path}.{sub}"
            found = getattr(module, sub, None)
            module = found if found is not None else importlib.import_module(path)
        return module

    def bound_import(name, globals=None, locals=None, fromlist=(), level=0):  # noqa: A002 - __import__ signature
        module = resolve(name)
        for item in fromlist or ():
            if item != "*" and not hasattr(module, item):
                resolve(f"{name}.{item}")  # ``from nki import isa``: a submodule, imported as an attribute
        return module if fromlist else nki_module

    return bound_import


def load_with_nki(source: KernelSource, nki_module: types.ModuleType) -> LoadedKernel:
    """Execute the kernel text as module ``source.name`` with ``import nki`` bound to ``nki_module`` (checked and
    with restricted builtins, as ``checked_code`` says)."""
    code = checked_code(source)
    module = types.ModuleType(source.name)
    filename = simulator.kernel_filename(source.name)
    module.__file__ = filename
    module.__dict__["__builtins__"] = kernel_builtins(_bound_import(nki_module))
    linecache.cache[filename] = (len(source.source), None, source.source.splitlines(keepends=True), filename)
    exec(code, module.__dict__)
    return LoadedKernel(source, getattr(module, source.name))


def _kernel_outputs(result) -> list:
    if result is None:
        return []
    if isinstance(result, (tuple, list)):
        return [tensor for item in result for tensor in _kernel_outputs(item)]
    return [result]


class DeviceLauncher(Launcher):
    """Kernels on a Neuron device through the real ``nki.jit``, with torch tensors.

    ``nki_module``: the ``nki`` package to bind the kernels' ``import nki`` to (default: the real one, imported
    here); ``device``: where inputs are moved before the call (default: ``default_device()``)."""

    name = "device"

    def __init__(self, nki_module: types.ModuleType | None = None, device: torch.device | str | None = None):
        if nki_module is None:
            require_device()
            nki_module = importlib.import_module("nki")
        self.nki = nki_module
        self.device = device if device is not None else default_device()

    def load(self, source: KernelSource) -> LoadedKernel:
        return load_with_nki(source, self.nki)

    def launch(self, kernel: LoadedKernel, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], None]:
        result = kernel.function(*(tensor.detach().to(self.device) for tensor in tensors))
        returned = _kernel_outputs(result)
        if len(returned) != len(kernel.source.outputs):
            raise LauncherError(f"kernel {kernel.source.name} returned {len(returned)} tensors on the device, "
                                f"expected {len(kernel.source.outputs)} ({[b.name for b in kernel.source.outputs]})")
        outputs = []
        for buffer, tensor in zip(kernel.source.outputs, returned):
            owned = torch.empty(tuple(tensor.shape), dtype=TORCH_DTYPES[buffer.dtype])
            outputs.append(owned.copy_(tensor))  # device -> CPU, into torch-allocated memory
        return outputs, None

    def launch_function(self, function, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], None]:
        returned = _kernel_outputs(function(*(tensor.detach().to(self.device) for tensor in tensors)))
        return [tensor.to("cpu", copy=True) for tensor in returned], None

    def __repr__(self) -> str:
        return f"DeviceLauncher(nki={getattr(self.nki, '__name__', self.nki)!r}, device={str(self.device)!r})"


def require_device() -> None:
    """Raise a LauncherError naming what is missing when the device launcher cannot work here."""
    missing = []
    if not real_nki_available():
        missing.append("the real nki package is not importable (install the Neuron SDK's nki and torch-neuronx)")
    if not neuron_device_present():
        missing.append(f"no Neuron device found ({NEURON_DEVICE_PATTERN} matches nothing)")
    if missing:
        raise LauncherError(
            "launcher 'device' (NEURON_COMPILE_LAUNCHER=device) cannot run here: " + "; ".join(missing)
            + ". Use launcher 'auto' or 'simulator' to run the kernels on the built-in simulator."
        )


# ------------------------------------------------------------------------------------------------ selection
def resolve_launcher(choice: str, *, real_nki: bool, device: bool) -> str:
    """``simulator`` or ``device`` for a ``Config.launcher`` value, given what this host has."""
    if choice not in config_module.LAUNCHERS:
        raise ValueError(f"launcher must be one of {list(config_module.LAUNCHERS)}, got {choice!r}")
    if choice == "auto":
        return "device" if real_nki and device else "simulator"
    return choice


def select_launcher(config: config_module.Config | None = None, target: Target | str | None = None) -> Launcher:
    """The launcher ``config.launcher`` names (the current config when None); ``target`` for the simulator."""
    config = config if config is not None else config_module.get()
    name = resolve_launcher(config.launcher, real_nki=real_nki_available(), device=neuron_device_present())
    if name == "device":
        return DeviceLauncher()
    return SimulatorLauncher(target if target is not None else config.target, open_report_cache(config),
                             replay=config.replay, signed_code=open_signed_code_cache(config))

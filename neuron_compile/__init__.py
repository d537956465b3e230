"""neuron_compile: a torch.compile backend for AWS Trainium that generates NKI kernels.

Public API only. ``torch.compile(model, backend="neuron")`` works without importing this package (the
``torch_dynamo_backends`` entry point); importing it registers the backend too (as ``"neuron_compile"`` only,
if AWS ``torch_neuronx`` already owns ``"neuron"``) and gives ``stats()``, ``reset_stats()``, ``config``,
``last_compiled()``, ``record_launches()``, ``NeuronCompileError`` and ``nki_op`` (a hand-written ``@nki.jit`` kernel
as a torch operator, eager and compiled: neuron_compile/nki_op.py).

``stats()`` returns a dict of process-wide counters since the last ``reset_stats()``:

- ``graphs_compiled``: ATen graphs handed to the backend by aot_autograd (each forward, backward and inference
  graph of each Dynamo graph counts once; a graph break makes two Dynamo graphs).
- ``cache_misses`` / ``cache_hits``: calls of a compiled graph whose shape signature (shapes, strides, dtypes,
  config) had to be compiled / was already compiled.
- ``recompiles``: misses after a graph's first signature (dynamic shapes seeing new sizes).
- ``regions_compiled`` / ``region_compile_failures``: NKI regions compiled into kernels / that failed to
  compile and ran eagerly (per signature); ``region_run_failures``: compiled regions that failed when run
  and run eagerly from then on.
- ``disk_cache_hits`` / ``disk_cache_misses``: of the regions compiled, those loaded from the on-disk cache
  (``NEURON_COMPILE_CACHE``: their lowering, fusion, tiling and rendering were skipped) / compiled and written to
  it; ``disk_cache_corrupt``: entries found unusable (each also a miss, rewritten); ``disk_cache_evictions``:
  entries deleted to keep the cache under ``NEURON_COMPILE_CACHE_SIZE``.
- ``aot_autograd_skipped`` / ``warm_records_written``: Dynamo graphs run from their warm-start record without
  aot_autograd's trace (``NEURON_COMPILE_WARM_START``) / records written for later processes.
- ``nki_nodes`` / ``fallback_nodes``: ATen nodes placed in NKI kernels / run eagerly (per signature);
  ``fallback_reasons`` is a Counter of ``"<op>: <reason>"`` for the eager ones.
- ``kernels_launched``, ``hbm_bytes``, ``flops``, ``est_time_s``, ``roofline_s``: kernel launches and the
  simulator's cost-model figures summed over launches; ``est_lower_bound_s``: the same with every kernel's
  engines perfectly overlapped (its busiest engine); ``launch_s``: the launch costs within ``est_time_s``.
- ``weight_copies`` / ``weight_copy_bytes``: column-major copies made of parameters that inference matmuls read
  transposed (``NEURON_COMPILE_TRANSPOSED_WEIGHTS``); a copy is remade only when its parameter changes.
- ``collectives`` / ``collective_bytes`` / ``est_comm_s`` / ``est_comm_overlap_s``: ``nki.collectives`` calls in
  launched kernels (torch.distributed functional collectives), the bytes of their inputs on this rank, their time
  on the trn2 links by a ring model (runtime/simulator/comm_cost.py), and the part of it that compute in the same
  launch ran alongside; ``est_time_s`` includes the rest.

``with record_launches() as launches:`` appends one ``Launch(kernel, report, source)`` per kernel launched inside the
block (the kernel's name and its cost report: the per-kernel figures behind the sums; ``bench/kernel_bench.py``).
"""

from neuron_compile import config, logs
from neuron_compile.backend import register as _register
from neuron_compile.errors import NeuronCompileError, NeuronCompileWarning
from neuron_compile.nki_op import NkiOp, NkiOpSpecError, nki_op
from neuron_compile.runtime import stats as _stats
from neuron_compile.runtime.graph_records import compiled_records, last_compiled
from neuron_compile.runtime.stats import record_launches
from neuron_compile.version import __version__

__all__ = [
    "NeuronCompileError",
    "NeuronCompileWarning",
    "NkiOp",
    "NkiOpSpecError",
    "__version__",
    "backend_name",
    "compiled_records",
    "config",
    "last_compiled",
    "nki_op",
    "record_launches",
    "reset_stats",
    "stats",
]


def stats() -> dict:
    """A snapshot of the counters described in the module docstring."""
    return _stats.snapshot()


def reset_stats() -> None:
    """Zero every counter."""
    _stats.reset()


logs.register()  # our log topics, for torch._logging.set_logs
backend_name = _register()  # "neuron", or "neuron_compile" when another package owns "neuron"

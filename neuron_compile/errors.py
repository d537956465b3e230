"""Errors and warnings the backend raises to users (the simulator has its own, in runtime/simulator/errors.py)."""

from __future__ import annotations


class NeuronCompileError(RuntimeError):
    """A graph or region could not be compiled and ``NEURON_COMPILE_FALLBACK=raise`` forbids running it eagerly."""


class LoweringError(RuntimeError):
    """An op (or a shape of it) the NKI lowering cannot handle; the message names the op and the rule. Raised while
    lowering (the region then runs eagerly) and by a compiled region refusing inputs its kernels were not made for."""


class NeuronCompileWarning(UserWarning):
    """A compile did less than asked: a region fell back to eager execution (``NEURON_COMPILE_FALLBACK=warn``,
    the default), or Dynamo stopped at FSDP2's hooks (untraced_fsdp.py)."""

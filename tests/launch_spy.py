"""Test helper: record whether each simulator launch from now on was traced (the launcher's fast paths skip the
trace when a cost report is already known)."""

from __future__ import annotations

from neuron_compile.runtime import simulator


def spy_traces(monkeypatch) -> list[bool]:
    """The ``trace`` argument of every simulator launch from now on."""
    traced, run_kernel = [], simulator.run_kernel

    def spy(fn, args, **kwargs):
        traced.append(kwargs.get("trace", True))
        return run_kernel(fn, args, **kwargs)

    monkeypatch.setattr(simulator, "run_kernel", spy)
    return traced

"""Codegen output: ``KernelSource``, one rendered kernel (its name, its NKI text, the HBM buffers it reads and the
ones it returns).

The render pass makes them (codegen/kernel_text.py, codegen/render.py); the launcher, the compiled regions and the
on-disk cache only read them. This module is that shared definition, kept apart from the renderers so that a warm
start, which loads stored kernels, imports none of the code that renders them.
"""

from __future__ import annotations

import dataclasses

from neuron_compile import ir


@dataclasses.dataclass(frozen=True)
class KernelSource:
    name: str
    source: str
    parameters: tuple[str, ...] = ()  # HBM buffers the kernel reads, in argument order
    outputs: tuple[ir.Buffer, ...] = ()  # buffers it returns, in order

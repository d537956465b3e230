"""Test helper for kernels written in the simulator tests: a whole HBM tensor into one SBUF tile and back."""

from __future__ import annotations

from neuron_compile.runtime import simulator as nki

nl = nki.language
nisa = nki.isa


def load_tile(src, dtype=None):
    """``src`` (an HBM tensor) copied into an SBUF tile of its shape (and ``dtype``, if given)."""
    tile = nl.ndarray(src.shape, dtype or src.dtype)
    nisa.dma_copy(tile, src)
    return tile


def store_tile(tile):
    """``tile`` copied into a new shared-HBM tensor the kernel can return."""
    out = nl.ndarray(tile.shape, tile.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(out, tile)
    return out

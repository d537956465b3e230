"""Simulator stage: run a kernel's many small matmuls on one BLAS thread.

Input: nothing (finds the OpenBLAS that numpy loaded). Output: ``single_threaded_blas()``, a context manager
that sets numpy's OpenBLAS to one thread for the duration of a launch and restores the previous count.

Why: a kernel issues thousands of 128x128x512 matmuls. Multi-threaded OpenBLAS spends more on waking and
synchronizing threads than on such a product, and on a loaded machine a spinning thread waits for a core, so
the same loop measured 10x slower with threads than with one. Big products (numpy outside kernels) keep their
threads, since the count is restored on exit. If numpy's BLAS is not OpenBLAS, this does nothing.
"""

from __future__ import annotations

import ctypes
import glob
import os
import threading
from contextlib import contextmanager

import numpy as np

_SYMBOLS = (
    ("scipy_openblas_get_num_threads64_", "scipy_openblas_set_num_threads64_"),
    ("openblas_get_num_threads64_", "openblas_set_num_threads64_"),
    ("openblas_get_num_threads", "openblas_set_num_threads"),
)


def _find_openblas():
    """(get, set) thread-count functions of the OpenBLAS bundled with numpy, else None."""
    libs_dir = os.path.join(os.path.dirname(os.path.dirname(np.__file__)), "numpy.libs")
    for path in sorted(glob.glob(os.path.join(libs_dir, "*openblas*.so*"))):
        try:
            library = ctypes.CDLL(path)
        except OSError:
            continue
        for get_name, set_name in _SYMBOLS:
            getter, setter = getattr(library, get_name, None), getattr(library, set_name, None)
            if getter is not None and setter is not None:
                getter.restype = ctypes.c_int
                setter.argtypes = [ctypes.c_int]
                return getter, setter
    return None


_OPENBLAS = _find_openblas()


# The thread count is process-wide: with launches overlapping in several threads, the first to enter saves the
# count and the last to leave restores it (a plain save / restore per launch would restore another launch's 1).
_lock = threading.Lock()
_launches_running = 0
_saved_count = None


@contextmanager
def single_threaded_blas():
    global _launches_running, _saved_count
    if _OPENBLAS is None:
        yield
        return
    getter, setter = _OPENBLAS
    with _lock:
        if _launches_running == 0:
            _saved_count = getter()
            setter(1)
        _launches_running += 1
    try:
        yield
    finally:
        with _lock:
            _launches_running -= 1
            if _launches_running == 0:
                setter(_saved_count)

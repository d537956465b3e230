"""Simulator stage: the experimental ``nki.language`` wrappers that lower to several ISA instructions
(rms_norm, gather_flattened, dropout, random_seed, rand) and the ``no_reorder`` scheduling directive.

Input: SBUF tiles. Output: new SBUF tiles computed by the ISA instructions (so the trace, the cost model and
every hardware rule apply), re-exported by ``nki.language``.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from neuron_compile.runtime.simulator import isa, ops
from neuron_compile.runtime.simulator.errors import NkiValidationError
from neuron_compile.runtime.simulator.memory import allocate, current, sbuf
from neuron_compile.runtime.simulator.rules import reduce_axes

FLOAT32 = np.dtype(np.float32)
UNIFORM_BITS = 24  # rand: the top 24 bits of a 32-bit draw, exactly representable in fp32


@contextmanager
def no_reorder():
    """``with nl.no_reorder():`` keeps the block's instructions in program order on the device. The simulator
    executes in program order anyway, and its cost model schedules by data dependencies, so it changes nothing."""
    yield


def rms_norm(x, w, axis, n, epsilon=1e-6, dtype=None, compute_dtype=None):
    """x / sqrt(sum(x^2 over axis) / n + epsilon) * w, with the sum of squares on ScalarE (activation with an
    add reduction), the reciprocal root on ScalarE and the scaling on VectorE."""
    axes = reduce_axes("nl.rms_norm", x, axis)
    if axes != (x.ndim - 1,) or x.ndim != 2:
        raise NkiValidationError("err_reduce_axis", f"nl.rms_norm over axis {axis} of {x.shape}: the free dim of a "
                                 "2-d tile", "nl.rms_norm")
    p = x.partitions
    squares, total = allocate(x.shape, FLOAT32, sbuf), allocate((p, 1), FLOAT32, sbuf)
    isa.activation(squares, ops.UNARY["square"], x, reduce_op=ops.BINARY["add"], reduce_res=total)
    inverse_rms = allocate((p, 1), FLOAT32, sbuf)
    isa.tensor_scalar(inverse_rms, total, ops.BINARY["multiply"], 1.0 / n, op1=ops.BINARY["add"], operand1=epsilon)
    isa.activation(inverse_rms, ops.UNARY["rsqrt"], inverse_rms)
    normed = allocate(x.shape, np.dtype(compute_dtype) if compute_dtype is not None else FLOAT32, sbuf)
    isa.tensor_scalar(normed, x, ops.BINARY["multiply"], inverse_rms)
    out = allocate(x.shape, np.dtype(dtype) if dtype is not None else x.dtype, sbuf)
    isa.tensor_tensor(out, normed, w, ops.BINARY["multiply"])
    return out


def gather_flattened(data, indices, axis=0, dtype=None):
    """out[p, j] = data[p, indices[p, j]] over data's flattened free dims (GpSimd's nc_n_gather; indices
    converted to uint32 first when they are another integer type)."""
    if axis not in (0, -data.ndim):
        raise NkiValidationError("err_gather_axis", f"nl.gather_flattened along axis {axis}: only the flattened free "
                                 "dims of each partition (axis 0)", "nl.gather_flattened")
    if indices.dtype != np.dtype(np.uint32):
        converted = allocate(indices.shape, np.uint32, sbuf)
        isa.tensor_copy(converted, indices)
        indices = converted
    gathered = allocate(indices.shape, data.dtype, sbuf)
    isa.nc_n_gather(gathered, data, indices)
    if dtype is None or np.dtype(dtype) == data.dtype:
        return gathered
    out = allocate(indices.shape, dtype, sbuf)
    isa.tensor_copy(out, gathered)
    return out


def random_seed(seed) -> None:
    """Seed the random-number generator ``rand`` and ``dropout`` draw from (a [1, 1] 32-bit tile)."""
    isa.set_rng_seed(seed)


def rand(shape, dtype, buffer=sbuf, name: str = ""):
    """Uniform values in [0, 1): rand2 on NeuronCore-v4, else 32 random bits per element whose top 24 become
    the fraction (rng, a shift, a conversion and a scaling)."""
    out = allocate(shape, dtype, buffer, name)
    if current().target.nc_version >= "gen4":
        isa.rand2(out, 0.0, 1.0)
        return out
    bits = allocate(shape, np.uint32, sbuf)
    isa.rng(bits)
    isa.tensor_scalar(bits, bits, ops.BINARY["right_shift"], 32 - UNIFORM_BITS)
    fraction = allocate(shape, FLOAT32, sbuf)
    isa.tensor_copy(fraction, bits)
    isa.tensor_scalar(out, fraction, ops.BINARY["multiply"], 2.0 ** -UNIFORM_BITS)
    return out


def dropout(x, rate, dtype=None):
    """x with each element zeroed with probability ``rate`` (a scalar or a (P, 1) tile), unscaled."""
    dropped = allocate(x.shape, x.dtype, sbuf)
    isa.dropout(dropped, x, rate)
    if dtype is None or np.dtype(dtype) == x.dtype:
        return dropped
    out = allocate(x.shape, dtype, sbuf)
    isa.tensor_copy(out, dropped)
    return out

"""Simulator stage: the accumulator registers of ScalarE and VectorE and their ``reduce_cmd`` protocol.

Input: the per-partition partial reduction of one instruction's results, the instruction's ``reduce_cmd`` and
``reduce_op``. Output: the updated registers (one fp32 value per lane and engine, kept in the kernel context),
which the instruction writes out into ``reduce_res`` when it is given one.

The protocol (nki.isa.reduce_cmd, shared by activation / activate2 on ScalarE and exponential, range_select,
select_reduce, tensor_scalar_reduce and tensor_scalar_cumulative on VectorE): ``reset`` sets the registers to
the identity of ``reduce_op`` (0 for add, 1 for multiply, -inf for max, +inf for min), ``reset_reduce`` resets
then folds this instruction's values in, ``reduce`` folds them into what the registers hold, ``load_reduce``
loads an initial value then folds, ``idle`` leaves the registers alone. One register per physical partition:
an instruction on partitions 32..63 uses lanes 32..63.
"""

from __future__ import annotations

import numpy as np

from neuron_compile.runtime.simulator import ops
from neuron_compile.runtime.simulator.errors import NkiValidationError
from neuron_compile.runtime.simulator.memory import current
from neuron_compile.runtime.simulator.rules import is_float, require_tensor, store

LANES = 128
COMMANDS = ("idle", "reset", "reduce", "reset_reduce", "load_reduce")
# The fold of each reduce op (a numpy ufunc) and its identity (the reset value); abs_max / abs_min fold absolute
# values.
FOLDS = {
    "add": (np.add, 0.0),
    "multiply": (np.multiply, 1.0),
    "maximum": (np.maximum, -np.inf),
    "minimum": (np.minimum, np.inf),
    "abs_max": (np.maximum, 0.0),
    "abs_min": (np.minimum, np.inf),
}
ABSOLUTE = ("abs_max", "abs_min")


def command_name(reduce_cmd, default: str = "idle") -> str:
    """The reduce_cmd's name ("idle", "reset", ...), from the enum, its name or None."""
    name = getattr(reduce_cmd, "name", reduce_cmd)
    if name is None:
        return default
    if name not in COMMANDS:
        raise NkiValidationError("err_reduce_cmd", f"reduce_cmd {reduce_cmd!r} is not one of {COMMANDS}")
    return name


def resolve_reduce_op(instruction: str, reduce_op, allowed: tuple[str, ...], default: str,
                      rule: str = "err_unsupported_reduce_op") -> str:
    """The name of ``reduce_op`` (default when None), refused unless it is one of ``allowed``."""
    name = ops.resolve(reduce_op, instruction, "reduce_op").name if reduce_op is not None else default
    if name not in allowed:
        raise NkiValidationError(
            rule, f"reduce_op {name} is not one of {list(allowed)} for this instruction",
            instruction,
        )
    return name


def partial_reduce(values: np.ndarray, reduce_op: str) -> np.ndarray:
    """One instruction's per-partition reduction of its (P, F) fp32 results with ``reduce_op``."""
    fold, identity = FOLDS[reduce_op]
    values = np.abs(values) if reduce_op in ABSOLUTE else values
    return fold.reduce(values.astype(np.float32, copy=False), axis=1, initial=np.float32(identity))


def registers(engine: str) -> np.ndarray:
    """The engine's 128 accumulator registers (created zeroed on first use, as after a reset to add)."""
    banks = current().accumulators
    if engine not in banks:
        banks[engine] = np.zeros(LANES, dtype=np.float32)
    return banks[engine]


def accumulate(engine: str, command: str, reduce_op: str, partial: np.ndarray, first_lane: int,
               initial=None) -> np.ndarray:
    """Apply ``command`` to the lanes first_lane.. of ``engine`` with this instruction's ``partial`` (P,)
    reduction; ``initial`` ((P,) or scalar) is what load_reduce loads. Returns those lanes after the command."""
    lanes = registers(engine)[first_lane:first_lane + partial.shape[0]]
    fold, identity = FOLDS[reduce_op]
    if command in ("reset", "reset_reduce"):
        lanes[...] = identity
    elif command == "load_reduce":
        lanes[...] = initial
    if command in ("reduce", "reset_reduce", "load_reduce"):
        lanes[...] = fold(lanes, partial)
    return lanes.copy()


def reduce_res_tile(op: str, reduce_res, partitions: int):
    """``reduce_res`` checked: a (P, 1) SBUF/PSUM tile of a float dtype."""
    tile = require_tensor(op, "reduce_res", reduce_res)
    if tile.partitions != partitions or tile.free_size != 1 or not tile.on_chip:
        raise NkiValidationError(
            "err_reduce_res_shape", f"reduce_res {tile.name} {tile.shape} in {tile.buffer} must be a ({partitions}, 1) "
            "SBUF/PSUM tile", op,
        )
    if not is_float(tile.dtype):
        raise NkiValidationError("err_reduce_res_dtype", f"reduce_res {tile.name} is {tile.dtype.name}, not a float", op)
    return tile


def reduce_into(op: str, engine: str, command: str, reduce_op: str, partial: np.ndarray, first_lane: int,
                reduce_res=None, initial=None, negate: bool = False) -> None:
    """Run ``command`` on the engine's registers with this instruction's ``partial`` and write the registers
    into ``reduce_res`` when given (negated with ``negate``; the registers keep their sign)."""
    lanes = accumulate(engine, command, reduce_op, partial, first_lane, initial)
    if reduce_res is not None:
        tile = reduce_res_tile(op, reduce_res, partial.shape[0])
        store(tile, (-lanes if negate else lanes)[:, None])

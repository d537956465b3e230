"""Simulator stage: the engine sequencers' virtual registers of ``nki.isa`` (register_alloc, register_move,
register_load, register_store) and ``VirtualRegister``.

Input: integers, registers and one-element SBUF/HBM tensors. Output: registers holding concrete 32-bit values,
since the simulator runs the kernel as it is traced: a register drives ``nl.dynamic_range`` loop bounds and
``.ap(scalar_offset=...)`` as an int. Loads and stores are instructions on the sync engine's queue (one
InstructionRecord each); allocating and moving values between registers touch no memory and are not traced.
"""

from __future__ import annotations

import numpy as np

from neuron_compile.runtime.simulator.errors import NkiValidationError
from neuron_compile.runtime.simulator.rules import record, require_tensor, store
from neuron_compile.runtime.simulator.tensor import NkiTensor

INT32_RANGE = (-(2**31), 2**32 - 1)  # a register holds 32 bits: signed or unsigned values


class VirtualRegister:
    """``nisa.register_alloc()``'s register: an int once written (``int(reg)``, ``range(reg)`` and index use)."""

    __slots__ = ("value", "name")

    def __init__(self, value: int | None = None, name: str = ""):
        self.value = None if value is None else _checked(value, "register_alloc")
        self.name = name

    def __index__(self) -> int:
        if self.value is None:
            raise NkiValidationError(
                "err_register_uninitialized", "a register is read before any register_move / register_load wrote it"
            )
        return self.value

    __int__ = __index__

    def __bool__(self) -> bool:  # ``while reg:`` loops
        return self.__index__() != 0

    def __repr__(self) -> str:
        return f"VirtualRegister({self.value})"


def _checked(value, op: str) -> int:
    as_int = int(value)
    if as_int != value or not INT32_RANGE[0] <= as_int <= INT32_RANGE[1]:
        raise NkiValidationError("err_register_value", f"{value!r} is not a 32-bit integer", op)
    return as_int


def _require_register(op: str, role: str, value) -> VirtualRegister:
    if not isinstance(value, VirtualRegister):
        raise NkiValidationError(
            "err_expected_register", f"{role} must be a register from nisa.register_alloc, got {type(value).__name__}",
            op,
        )
    return value


def _one_element(op: str, role: str, tensor) -> NkiTensor:
    tensor = require_tensor(op, role, tensor)
    if tensor.size != 1 or tensor.kind == "psum":
        raise NkiValidationError(
            "err_register_memory", f"{role} {tensor.name} {tensor.shape} in {tensor.buffer}: a register moves one "
            "32-bit value from or to SBUF or HBM", op,
        )
    if tensor.itemsize > 4:
        raise NkiValidationError("err_register_memory", f"{role} {tensor.name} is wider than 32 bits", op)
    return tensor


def register_alloc(x: int | None = None) -> VirtualRegister:
    """A new register, uninitialized or holding the integer ``x``."""
    return VirtualRegister(x)


def register_move(dst, src) -> None:
    """dst = src (an integer constant or another register)."""
    op = "register_move"
    dst = _require_register(op, "dst", dst)
    dst.value = _checked(int(src), op)


def register_load(dst, src) -> None:
    """dst = the single value of the one-element tensor ``src`` (SBUF or HBM)."""
    op = "register_load"
    dst = _require_register(op, "dst", dst)
    src = _one_element(op, "src", src)
    value = np.asarray(src.read()).reshape(-1)[0]
    if not float(value).is_integer():
        raise NkiValidationError("err_register_value", f"src {src.name} holds {value!r}, not an integer", op)
    dst.value = _checked(int(value), op)
    record(op, "sync", None, [("src", src)])


def register_store(dst, src) -> None:
    """The one-element tensor ``dst`` (SBUF or HBM) = the register's value."""
    op = "register_store"
    dst = _one_element(op, "dst", dst)
    value = int(_require_register(op, "src", src))
    store(dst, np.asarray(value, dtype=np.int64))
    record(op, "sync", dst, [])

"""Simulator stage: the errors a kernel can raise, each naming the rule it broke.

``NkiValidationError`` is what ``nki.isa.NkiValidationError`` is on the real toolchain. Every message names
the rule (an nki-spec.md §1.6 row or an NKI error-manual id such as ``err_num_partition_exceed_arch_limit``),
the offending values, and the instruction that raised it, so that a user reads the constraint, not a stack.
"""

from __future__ import annotations


class NkiValidationError(Exception):
    """A kernel broke a hardware or language rule. ``rule`` is the short rule id; ``op`` the instruction."""

    def __init__(self, rule: str, message: str, op: str | None = None):
        self.rule = rule
        self.op = op
        where = f" in {op}" if op else ""
        super().__init__(f"[{rule}]{where}: {message}")


class NkiCapacityError(NkiValidationError):
    """SBUF or PSUM capacity exceeded (the official simulator does not check this; ours does)."""


class NkiNotSimulatedError(NkiValidationError, NotImplementedError):
    """An ``nki.isa`` / ``nki.language`` name that exists on hardware but has no simulation here."""

    def __init__(self, name: str):
        super().__init__("not_simulated", f"{name} is part of NKI but is not simulated by neuron_compile", op=name)

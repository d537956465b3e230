"""Random pointwise programs for hypothesis tests: a program is a list of (op, left, right) index triples.

Shared by the partitioner's and the backend's random-graph tests, so both draw from the same op set.
"""

from __future__ import annotations

import operator

import torch
from hypothesis import strategies as st

UNARY = [torch.exp, torch.tanh, torch.relu, torch.neg, torch.sigmoid]
BINARY = [operator.add, operator.mul, operator.sub]


def programs(max_size: int):
    """Programs of 1..max_size steps; operand indices wrap around the values computed so far."""
    step = st.tuples(st.integers(0, len(UNARY) + len(BINARY) - 1), st.integers(0, 100), st.integers(0, 100))
    return st.lists(step, min_size=1, max_size=max_size)


def run_program(program, a, b) -> list:
    """Every value the program computes from inputs ``a`` and ``b``, inputs first."""
    values = [a, b]
    for op_index, left, right in program:
        first, second = values[left % len(values)], values[right % len(values)]
        if op_index < len(UNARY):
            values.append(UNARY[op_index](first))
        else:
            values.append(BINARY[op_index - len(UNARY)](first, second))
    return values

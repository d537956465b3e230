"""A small model for the hit path's tests (tests/test_hit_plan.py, tests/test_direct_hit.py): two Linear layers
with a gelu between, whose up weight is read through a column-major copy and whose biases are read in place."""

from __future__ import annotations

import torch


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(16, 24)
        self.down = torch.nn.Linear(24, 8)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))

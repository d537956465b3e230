"""Runtime stage: the dispatch cache from a call signature to a compiled (partitioned) graph.

Input: a ``GraphKey`` — graph hash, each argument's shape / stride / storage offset / dtype / device (or int
value), and the ``Config`` — and a function that compiles on a miss. Output: the compiled entry, compiled at
most once per key even when threads race. Keys are frozen dataclasses of plain values so the same key can
later address an on-disk cache (NEURON_COMPILE_CACHE); today entries live in memory only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import torch

from neuron_compile.config import Config

Entry = TypeVar("Entry")


@dataclasses.dataclass(frozen=True)
class TensorSignature:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    dtype: str
    device: str

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorSignature:
        return cls(
            tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset(), str(tensor.dtype), str(tensor.device)
        )


@dataclasses.dataclass(frozen=True)
class ScalarSignature:
    kind: str
    value: object  # int / float / bool value: SymInt placeholders are specialized on it


@dataclasses.dataclass(frozen=True)
class GraphKey:
    graph_hash: str
    inputs: tuple[TensorSignature | ScalarSignature, ...]
    config: Config


def graph_hash(gm: torch.fx.GraphModule) -> str:
    """A stable hash of the graph's code (names, ops, constants) — not of its weights, which are inputs."""
    return hashlib.sha256(gm.code.encode()).hexdigest()[:16]


def signature_of(args: Sequence[object]) -> tuple[TensorSignature | ScalarSignature, ...]:
    signature = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            signature.append(TensorSignature.of(arg))
        elif isinstance(arg, bool | int | float):
            signature.append(ScalarSignature(type(arg).__name__, arg))
        else:
            signature.append(ScalarSignature(type(arg).__name__, repr(arg)))
    return tuple(signature)


class DispatchCache(Generic[Entry]):
    """In-memory ``GraphKey -> Entry`` map with a double-checked, locked compile on a miss."""

    def __init__(self):
        self._entries: dict[GraphKey, Entry] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get_or_compile(self, key: GraphKey, compile_entry: Callable[[], Entry]) -> tuple[Entry, bool]:
        """``(entry, compiled_now)``. A failed compile is not cached: the next call retries."""
        entry = self._entries.get(key)
        if entry is not None:
            return entry, False
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                return entry, False
            entry = compile_entry()
            self._entries[key] = entry
            return entry, True

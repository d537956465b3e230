"""Runtime stage: the dispatch cache from a call signature to a compiled (partitioned) graph.

Input: a dispatch key — the ``Config`` and ``dispatch_signature(args)``: each argument's shape / stride / storage
offset / dtype / device (or type and value) and, for a small integer tensor (and a float one the graph's sin / cos
read through value ranges), the bound its values pass in the guard of ``passes/input_ranges.py`` — and a function
that compiles on a miss. Output: the compiled entry, compiled at most once per key even when threads race.

Two forms of one signature: ``dispatch_signature`` is what every call builds, plain tuples of what torch hands
back (``torch.Size``, dtype and device objects) because it runs per argument per call and must cost about a
microsecond a tensor; ``GraphKey`` / ``signature_of`` is the readable form (strings, named fields) kept in a
compile's record, built only when a call misses.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, TypeVar

import torch

from neuron_compile.config import Config
from neuron_compile.passes.input_ranges import GUARDED_DTYPES, guard_bound, guard_float_bound

Entry = TypeVar("Entry")
MAX_ENTRIES = 256  # compiled signatures kept per graph
BOUNDED_DTYPES = frozenset(GUARDED_DTYPES)  # tensors of these dtypes may carry a value bound (a set: one hash)


@dataclasses.dataclass(frozen=True)
class TensorSignature:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    dtype: str
    device: str
    # An integer tensor's value bound (``passes/input_ranges.guard_bound``, as text), or a float one's
    # (``guard_float_bound``, for the inputs the graph's guard covers): the graph compiled for it lowers math that
    # relies on it, so a call outside it needs another entry. None: not bounded.
    bound: str | None = None

    @classmethod
    def of(cls, tensor: torch.Tensor, float_guard: bool = False) -> TensorSignature:
        bound = guard_float_bound(tensor) if float_guard else guard_bound(tensor)
        return cls(
            tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset(), str(tensor.dtype), str(tensor.device),
            None if bound is None else str(bound),
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
    """A stable hash of the graph's text (names, ops, constants) — not of its weights, which are inputs. The text, not
    ``gm.code``: aot_autograd's graph modules generate their code on first use, and nothing else here uses it."""
    return hashlib.sha256(str(gm.graph).encode()).hexdigest()[:16]


def dispatch_signature(args: Sequence[object], float_guarded: frozenset[int] = frozenset()) -> tuple:
    """The per-call dispatch signature: one tuple per argument, as discriminating as ``signature_of`` (a bool, an
    int and a float of equal value differ by their type) and several times cheaper to build and hash. The tensors
    at ``float_guarded`` positions carry their float bound."""
    return tuple([
        (arg.shape, arg.stride(), arg.storage_offset(), arg.dtype, arg.device, _bound(arg, position in float_guarded))
        if isinstance(arg, torch.Tensor)
        else (type(arg), scalar_value(arg))
        for position, arg in enumerate(args)
    ])


def scalar_value(arg):
    """A non-tensor argument as the dispatch key compares it: numbers by value, anything else by its repr."""
    return arg if isinstance(arg, bool | int | float) else repr(arg)


def _bound(tensor: torch.Tensor, float_guard: bool):
    if float_guard:
        return guard_float_bound(tensor)
    return guard_bound(tensor) if tensor.dtype in BOUNDED_DTYPES else None


def signature_of(args: Sequence[object], float_guarded: frozenset[int] = frozenset()
                 ) -> tuple[TensorSignature | ScalarSignature, ...]:
    """Each argument's signature; the tensors at ``float_guarded`` positions carry their float bound
    (``passes/input_ranges.range_guarded_floats`` of the graph)."""
    signature = []
    for position, arg in enumerate(args):
        if isinstance(arg, torch.Tensor):
            signature.append(TensorSignature.of(arg, float_guard=position in float_guarded))
        elif isinstance(arg, bool | int | float):
            signature.append(ScalarSignature(type(arg).__name__, arg))
        else:
            signature.append(ScalarSignature(type(arg).__name__, repr(arg)))
    return tuple(signature)


class DispatchCache(Generic[Entry]):
    """In-memory ``key -> Entry`` map (any hashable key) with a double-checked, locked compile on a miss.

    At most ``max_entries`` signatures are kept (least recently used evicted first), so a graph called with
    ever-new shapes does not hold every compiled version forever; an evicted signature compiles again.
    """

    def __init__(self, max_entries: int = MAX_ENTRIES):
        self.max_entries = max_entries
        self._entries: collections.OrderedDict[Hashable, Entry] = collections.OrderedDict()
        self._entries_lock = threading.Lock()  # guards the map; held only briefly
        self._compile_lock = threading.Lock()  # one compile at a time per graph: compiles are rare
        self._last_hit: tuple[Hashable, Entry] | None = None  # the last key found and its entry

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def lookup(self, key: Hashable) -> Entry | None:
        last = self._last_hit  # one read: another thread may replace it meanwhile
        if last is not None and last[0] == key:
            # A call like the previous one (the common case): comparing the keys costs about half of hashing one
            # (CPython does not keep a tuple's hash), and the entry is already the most recently used.
            return last[1]
        with self._entries_lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self._last_hit = (key, entry)
            return entry

    def get_or_compile(self, key: Hashable, compile_entry: Callable[[], Entry]) -> tuple[Entry, bool]:
        """``(entry, compiled_now)``. A failed compile is not cached: the next call retries."""
        entry = self.lookup(key)
        if entry is not None:
            return entry, False
        with self._compile_lock:
            entry = self.lookup(key)
            if entry is not None:  # another thread compiled it while this one waited
                return entry, False
            entry = compile_entry()
            with self._entries_lock:
                self._entries[key] = entry
                while len(self._entries) > self.max_entries:
                    self._entries.popitem(last=False)
                # The newest entry is the most recently used: a later hit on the previous one must move it again.
                self._last_hit = (key, entry)
            return entry, True

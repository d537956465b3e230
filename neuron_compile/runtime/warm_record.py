"""Runtime stage: the warm-start record of a Dynamo graph (when one is written: runtime/warm_candidate.py).

Input: what a graph's first call showed (runtime/warm_candidate.py gathers it). Output: ``WarmRecord``, plain data
stored in the on-disk cache under the graph's warm-start key (runtime/warm_key.py; JSON through runtime/disk_cache.py,
never pickle), which a later process reads to run the graph without aot_autograd (runtime/warm_start.py).

The record holds which argument or constant each region input is and which region output each graph output is, the
region's entry key (the kernels stay in the region's own entry, loaded as any disk hit is: the launcher checks every
kernel text, codegen/kernel_check.py), the column-major weight inputs, the value-guarded float inputs, the dispatch
signature of the first call (as text), the inputs whose version aot_autograd bumps, and the region's ATen node
placements (for stats and messages). ``from_data`` refuses anything that is not what ``to_data`` writes (a
``ValueError``: a miss).
"""

from __future__ import annotations

import dataclasses
import math
import re

import torch

from neuron_compile.passes.partition import REGION_PREFIX, NodePlacement

KEY_PATTERN = re.compile(r"[0-9a-f]{40}")
REGION_NAME_PATTERN = re.compile(re.escape(REGION_PREFIX) + r"[0-9]+")
# aot_autograd's graph constants a record may hold (an empty cache's ``tensor([])``): small, by value
CONSTANT_DTYPES = ("float32", "bfloat16", "float16", "int64", "int32", "bool")
MAX_CONSTANT_ELEMENTS = 1024


@dataclasses.dataclass(frozen=True)
class WarmRecord:
    """What a warm start needs besides the region's entry (module docstring)."""

    region_key: str  # the region's on-disk cache entry
    region_name: str  # its submodule's name (``nki_region_<i>``)
    inputs: int  # the graph's arguments: each one an input of the region
    # per region input: the graph argument it is (a position), or a constant of aot_autograd's graph (a small tensor)
    sources: tuple[int | torch.Tensor, ...]
    outputs: tuple[int, ...]  # per graph output, the region output it is
    column_major: tuple[int, ...]  # the arguments read through column-major weight copies
    float_guarded: tuple[int, ...]  # the float arguments whose value bound is part of the dispatch key
    signature: str  # the first call's dispatch signature (``runtime/cache.signature_of``), as text
    version_bumps: tuple[int, ...]  # the arguments whose version aot_autograd's wrapper bumps (``version_bumps``)
    placements: tuple[NodePlacement, ...]  # the region's ATen nodes

    def to_data(self) -> dict:
        return {
            "region_key": self.region_key, "region_name": self.region_name, "inputs": self.inputs,
            "sources": [source if isinstance(source, int) else constant_data(source) for source in self.sources],
            "outputs": list(self.outputs),
            "column_major": list(self.column_major), "float_guarded": list(self.float_guarded),
            "signature": self.signature, "version_bumps": list(self.version_bumps),
            "placements": [[placement.node, placement.op, placement.flops] for placement in self.placements],
        }

    @classmethod
    def from_data(cls, data: dict) -> WarmRecord:
        try:
            inputs = _count(data["inputs"])
            region_name = _matching(data["region_name"], REGION_NAME_PATTERN)
            record = cls(
                region_key=_matching(data["region_key"], KEY_PATTERN),
                region_name=region_name,
                inputs=inputs,
                sources=_sources(data["sources"], inputs),
                outputs=_outputs(data["outputs"]),
                column_major=_positions(data["column_major"], inputs),
                float_guarded=_positions(data["float_guarded"], inputs),
                signature=_text(data["signature"]),
                version_bumps=_positions(data["version_bumps"], inputs),
                placements=tuple(_placement(item, region_name) for item in data["placements"]),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"not a warm-start record: {type(error).__name__}: {error}") from error
        if len(data) != len(record.to_data()):
            raise ValueError("not a warm-start record: unknown fields")
        return record


def _text(value) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__}")
    return value


def _matching(value, pattern: re.Pattern) -> str:
    if pattern.fullmatch(_text(value)) is None:
        raise ValueError(f"{value!r} is not of the form {pattern.pattern}")
    return value


def _count(value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TypeError(f"expected a count, got {value!r}")
    return value


def constant_data(tensor: torch.Tensor) -> dict:
    return {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape),
            "values": tensor.reshape(-1).tolist()}


def _constant(data: dict) -> torch.Tensor:
    dtype_name, shape, values = _text(data["dtype"]), [_count(size) for size in data["shape"]], data["values"]
    if dtype_name not in CONSTANT_DTYPES or not isinstance(values, list) or len(values) != math.prod(shape):
        raise ValueError(f"not a constant: {dtype_name} {shape} with {len(values)} values")
    if len(values) > MAX_CONSTANT_ELEMENTS or not all(type(value) in (int, float, bool) for value in values):
        raise ValueError("a constant's values are not numbers, or too many")
    return torch.tensor(values, dtype=getattr(torch, dtype_name)).reshape(shape)


def _sources(items, inputs: int) -> tuple[int | torch.Tensor, ...]:
    sources = tuple(item if isinstance(item, int) and not isinstance(item, bool) else _constant(item)
                    for item in items)
    positions = [source for source in sources if isinstance(source, int)]
    if sorted(set(positions)) != list(range(inputs)):
        raise ValueError(f"the region's inputs {positions} are not every graph argument")
    return sources


def _outputs(items) -> tuple[int, ...]:
    outputs = tuple(_count(item) for item in items)
    if sorted(outputs) != list(range(len(outputs))):
        raise ValueError(f"the graph's outputs {list(outputs)} are not the region's, one each")
    return outputs


def _placement(item, region: str) -> NodePlacement:
    node, op, flops = item
    return NodePlacement(_text(node), _text(op), region, None, _count(flops))


def _positions(values, length: int) -> tuple[int, ...]:
    positions = tuple(_count(value) for value in values)
    if any(position >= length for position in positions) or len(set(positions)) != len(positions):
        raise ValueError(f"positions {list(positions)} are not distinct arguments of {length}")
    return positions

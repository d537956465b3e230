"""Front-end stage: the warm-start key of a Dynamo graph, taken before aot_autograd runs.

Input: Dynamo's FX graph, its fake example inputs and the effective ``Config``. Output: ``warm_key_parts``: the parts
of the key (plain data, hashed by ``runtime/disk_cache.key_of``) under which the graph's warm-start record is kept
(runtime/warm_start.py), or a ``Refusal`` that says why this graph takes no fast path (aot_autograd then runs, as it
always did).

The key changes with everything aot_autograd's output for the graph depends on: the graph's text (each node's op,
its target by module and qualified name, its arguments, which must be plain values), each input's metadata (sizes,
strides, storage offset, dtype, device, requires_grad, whether it is a view, which inputs share a storage), the values
of the tensor constants the graph reads, the global state aot_autograd reads (grad mode, inference mode, the default
dtype, deterministic algorithms, functorch's config), our config and the versions of torch, neuron_compile (with a
hash of its sources) and the kernel backend. Refused before anything is looked up: dynamic shapes (aot_autograd adds
the ShapeEnv's guards), inputs that are not plain tensors (subclasses, SymInts, numbers), one tensor in two positions,
gradients (grad enabled with an input that requires grad: a training graph), autocast, a dump folder (a dump shows
every stage), submodules or parameters held by the graph (aot_autograd lifts them into inputs), and a call target from
outside torch, ``operator``, ``math`` or the builtins (its code would not be in the key).
"""

from __future__ import annotations

import builtins
import dataclasses
import hashlib
import math
import operator

import torch
import torch.fx
from torch._functorch import config as functorch_config
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef

from neuron_compile.config import Config
from neuron_compile.runtime.disk_cache import FORMAT_VERSION, cache_root, config_key, versions

WARM_WHAT = "warm start"  # the ``what`` key part of a warm-start record (a region's: runtime/disk_cache.REGION_WHAT)
TRUSTED_MODULES = ("_operator", operator.__name__, math.__name__, builtins.__name__)  # _operator: operator's C half
PLAIN_VALUES = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)
AUTOCAST_DEVICES = ("cpu", "cuda")
# Dynamo's example inputs: fake tensors, and the parameters themselves (the exact types: a subclass is refused)
PLAIN_TENSORS = (FakeTensor, torch.Tensor, torch.nn.Parameter)


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why a graph takes no fast path; ``str()`` is the reason, for the log."""

    reason: str

    def __str__(self) -> str:
        return self.reason


def warm_key_parts(gm: torch.fx.GraphModule, example_inputs: list, config: Config) -> dict | Refusal:
    """The warm-start key's parts of Dynamo graph ``gm`` (module docstring), or why it has none."""
    refusal = refusal_of_state(config, example_inputs) or refusal_of_inputs(example_inputs)
    if refusal is not None:
        return refusal
    graph = graph_lines(gm)
    if isinstance(graph, Refusal):
        return graph
    return {
        "format": FORMAT_VERSION,
        "what": WARM_WHAT,
        "graph": graph,
        "inputs": input_lines(example_inputs),
        "state": global_state(),
        "config": {name: value for name, value in config_key(config).items() if name != "logs"},  # logs change nothing
        "versions": versions(),
    }


def refusal_of_state(config: Config, example_inputs: list) -> Refusal | None:
    """Why the process's state or the config rules the fast path out, if it does."""
    if not config.warm_start:
        return Refusal("NEURON_COMPILE_WARM_START=0")
    if cache_root(config.cache_dir) is None:
        return Refusal("the on-disk cache is off")
    if config.dump_dir:
        return Refusal("a dump folder is set (a dump shows every stage)")
    if any(torch.is_autocast_enabled(device) for device in AUTOCAST_DEVICES):
        return Refusal("autocast is enabled")
    if torch.is_grad_enabled() and any(getattr(value, "requires_grad", False) for value in example_inputs):
        return Refusal("grad is enabled and an input requires grad (a training graph)")
    return None


def refusal_of_inputs(example_inputs: list) -> Refusal | None:
    """Why the inputs rule the fast path out, if they do: not plain fake tensors, dynamic, or one tensor twice."""
    for position, value in enumerate(example_inputs):
        if type(value) not in PLAIN_TENSORS:
            return Refusal(f"input {position} is a {type(value).__name__}, not a plain tensor or parameter")
        if not all(isinstance(size, int) for size in (*value.shape, *value.stride(), value.storage_offset())):
            return Refusal(f"input {position} has a symbolic size (dynamic shapes: aot_autograd adds guards)")
        if value.is_complex():
            return Refusal(f"input {position} is complex (carried as real pairs)")
    if len({id(value) for value in example_inputs}) != len(example_inputs):
        return Refusal("one tensor is passed in two positions (aot_autograd deduplicates them)")
    return None


def input_lines(example_inputs: list) -> list[str]:
    """One line per input: its metadata, and the first input sharing its storage (aliasing decides aot's wrappers)."""
    storages: dict[object, int] = {}
    lines = []
    for position, value in enumerate(example_inputs):
        storage = storages.setdefault(StorageWeakRef(value.untyped_storage()), position)
        dtype = str(value.dtype).removeprefix("torch.")
        lines.append(f"{type(value).__name__} {dtype}{list(value.shape)} strides {list(value.stride())} "
                     f"offset {value.storage_offset()} {value.device} requires_grad {value.requires_grad} "
                     f"view {value._is_view()} storage of input {storage}")
    return lines


def global_state() -> dict:
    """The process state aot_autograd's trace reads, as text."""
    return {
        "grad": torch.is_grad_enabled(),
        "inference mode": torch.is_inference_mode_enabled(),
        "default dtype": str(torch.get_default_dtype()),
        "deterministic": [torch.are_deterministic_algorithms_enabled(),
                          torch.is_deterministic_algorithms_warn_only_enabled()],
        "functorch config": sorted(f"{name}={value!r}" for name, value in functorch_config.get_config_copy().items()),
    }


def graph_lines(gm: torch.fx.GraphModule) -> list[str] | Refusal:
    """The graph as one line per node, targets by module and qualified name, constants by value; or why it cannot
    be keyed."""
    if any(True for _ in gm.parameters()) or any(True for _ in gm.buffers()):
        return Refusal("the graph holds parameters or buffers (aot_autograd lifts them into inputs)")
    lines = []
    for node in gm.graph.nodes:
        if node.op == "call_module":
            return Refusal(f"the graph calls submodule {node.target}")
        target = target_name(node) if node.op == "call_function" else str(node.target)
        if isinstance(target, Refusal):
            return target
        arguments = argument_text((node.args, node.kwargs))
        if isinstance(arguments, Refusal):
            return arguments
        line = f"{node.name} = {node.op} {target}{arguments}"
        if node.op == "get_attr":
            constant = constant_text(gm, node.target)
            if isinstance(constant, Refusal):
                return constant
            line += f" = {constant}"
        lines.append(line)
    return lines


def target_name(node: torch.fx.Node) -> str | Refusal:
    """A call_function target as ``module.qualified_name``, when its code is torch's or the standard library's."""
    target = node.target
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    if isinstance(target, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        return f"torch.ops.{target}"
    if name is None or not (module == "torch" or module.startswith("torch.") or module in TRUSTED_MODULES):
        return Refusal(f"call target {target!r} is not torch's or the standard library's")
    return f"{module}.{name}"


def argument_text(value) -> str | Refusal:
    """A node's arguments as text: other nodes by name, plain values by repr; anything else is refused (its repr
    may hide state)."""
    if isinstance(value, torch.fx.Node):
        return f"%{value.name}"
    if isinstance(value, list | tuple | torch.Size):
        items = [argument_text(item) for item in value]
        refused = next((item for item in items if isinstance(item, Refusal)), None)
        return refused if refused is not None else f"{type(value).__name__}({', '.join(items)})"
    if isinstance(value, dict):
        items = [(str(key), argument_text(item)) for key, item in value.items()]
        refused = next((item for _, item in items if isinstance(item, Refusal)), None)
        return refused if refused is not None else "{" + ", ".join(f"{key}: {item}" for key, item in items) + "}"
    if isinstance(value, slice):
        return argument_text((value.start, value.stop, value.step))
    if value is Ellipsis or isinstance(value, PLAIN_VALUES):
        return repr(value)
    return Refusal(f"an argument of type {type(value).__name__} cannot be keyed by value")


def constant_text(gm: torch.fx.GraphModule, target: str) -> str | Refusal:
    """A tensor constant the graph reads, as its metadata and a hash of its bytes."""
    value = gm
    for name in target.split("."):
        value = getattr(value, name, None)
    if type(value) is not torch.Tensor or value.device.type != "cpu" or value.is_complex():
        return Refusal(f"constant {target} is not a plain CPU tensor")
    data = value.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return (f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)} "
            f"sha256 {hashlib.sha256(data).hexdigest()}")
